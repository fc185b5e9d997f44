"""One Docker sandbox container as a Trio async resource.

What a sandbox isolates (with the default ``Limits``):
  * network: no interface but its own loopback (``--network none``); nothing on the
    host, including the host's 127.0.0.1, is reachable;
  * filesystem: read-only root; only the work dir (tmpfs, owned by the sandbox user)
    and /tmp (tmpfs) are writable, besides Docker's per-container /dev/shm (64 MiB)
    and /dev/mqueue; no host path is mounted;
  * processes: own PID namespace (the host's processes and /proc are not visible),
    pids limit (fork bombs stop there), every process of the sandbox user is killed
    when an exec times out and on reset;
  * privileges: a non-root uid, all capabilities dropped, no-new-privileges (setuid
    binaries do not elevate), Docker's default seccomp profile, private IPC;
  * resources: memory cgroup limit without swap (the OOM killer acts inside the
    container), CPU quota, nofile and fsize ulimits, no core dumps, capped output.

What it does not isolate:
  * the kernel: containers share the host kernel; a kernel exploit escapes (use a
    VM runtime such as gVisor or Kata via Docker's runtime setting for hostile code);
  * CPU time up to the quota, disk I/O bandwidth, page cache and kernel memory
    pressure are shared with the host and other sandboxes;
  * host hardware facts (/proc/cpuinfo, /proc/meminfo, nproc), the clock, timing
    side channels;
  * processes of one lease from each other and from our own execs in that container
    (same uid: they may signal or, without Yama, ptrace each other); a process left
    at release could race the reset, which re-checks and discards on failure;
  * the Docker daemon itself: whoever controls the pool controls the engine.

Closing a sandbox (``aclose``) removes its container under a shielded cancel scope
with a deadline (``transport.remove_container``), so cancellation never leaks a
container; so does every other path that gives a container up. The engine transport is
``transport.py``, the programs a sandbox runs for us are files in ``scripts/``
(``programs.py``), the batch codec is ``batch.py``, starting one is ``start.py``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import docker
import docker.errors
import trio

from .batch import ExecSpec, PreparedProgram, encode_batch, parse_runner_output, prepare, runner_budget, runner_report_cap
from .checks import argv_of, check_workdir, env_list, exec_timeout, resolve, stdin_bytes, writable_files
from .errors import SandboxError, SandboxGoneError
from .limits import Limits
from .metrics import SandboxMetrics
from .programs import (
    FINAL_SCRIPT,
    KEEPER_CMDLINE,
    OOM_PROBE,
    RESET_SCRIPT,
    RUNNER_SOURCE,
    finish_final,
    oom_count,
)
from .result import ExecResult
from .transport import Capture, Engine, exec_exit_code, remove_container, run_to_end, stream_exec, tar_files

__all__ = ["Sandbox", "KILL_DEADLINE_S"]

KILL_DEADLINE_S = 10.0
"""Most seconds to wait for the kill of a runaway exec, and for its stream to end after it."""


class Sandbox:
    """A running sandbox container (see the module docstring for what it isolates).

    Obtain one from ``SandboxPool.lease`` or ``open_sandbox``. ``exec`` runs one command
    at a time to completion or timeout; ``aclose`` removes the container. A sandbox
    whose exec was cancelled, or that was ``mark_dirty``-ed, is never reused by a pool.
    """

    def __init__(
        self, engine: Engine, container_id: str, *, image: str, limits: Limits, metrics: SandboxMetrics | None = None
    ) -> None:
        self.engine = engine
        self.id = container_id
        self.image = image
        self.limits = limits
        self.metrics = metrics
        self._dirty = False
        self._closed = False
        self._clean = False  # a final exec reset it: the pool may reuse it without a reset
        self._oom_seen = 0
        self._runner_ok = True  # exec_many may use the in-container runner (python3 present)
        self.batch_reruns = 0
        """Programs of ``exec_many`` batches the runner did not report, run again alone."""
        self._lock = trio.Lock()

    def __repr__(self) -> str:
        return f"<Sandbox {self.id[:12]} image={self.image!r}{' dirty' if self._dirty else ''}>"

    @property
    def dirty(self) -> bool:
        return self._dirty

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def clean(self) -> bool:
        """The last exec was ``final`` and its reset succeeded."""
        return self._clean and not self._dirty and not self._closed

    def mark_dirty(self) -> None:
        """Never hand this container to another lease (it is removed on release)."""
        self._dirty = True

    # -- exec ---------------------------------------------------------------------------
    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        final: bool = False,
    ) -> ExecResult:
        """Run ``cmd`` (argv, or a string for ``/bin/sh -c``) as the sandbox user.

        When ``timeout`` (default ``limits.timeout_s``) passes, every process of the
        sandbox user is killed and the result says ``timed_out``. Output beyond the
        caps is read and dropped. Cancelling the caller removes the container.

        ``final=True``: this is the lease's last command; the sandbox is reset in the
        same engine round trip right after it ends (every process killed, writable dirs
        wiped), which halves the engine work of one-command leases. Its duration
        includes the reset. Any later exec cancels the saving (the pool then resets
        on release as usual).
        """
        argv = argv_of(cmd)
        timeout = exec_timeout(timeout, self.limits.timeout_s, "Sandbox.exec")
        data = stdin_bytes(stdin, "Sandbox.exec")
        envl = env_list(env)
        check_workdir(workdir, "Sandbox.exec")
        cap = Capture(self.limits.stdout_cap, self.limits.stderr_cap, self.limits.output_limit_bytes)
        if final:
            argv = ["/bin/sh", "-c", FINAL_SCRIPT, "final", self.limits.workdir, *argv]
        r = await self._run(argv, timeout=timeout, stdin=data, env=envl, workdir=workdir, cap=cap, count=not final)
        if final:
            r, self._clean = finish_final(r, bytes(cap.err_tail))
            if self.metrics is not None:
                self.metrics.on_exec(r.duration_s, timed_out=r.timed_out, oom_killed=r.oom_killed)
        return r

    async def exec_many(self, programs: Sequence[ExecSpec], *, final: bool = False) -> list[ExecResult]:
        """Run independent programs one after another in one engine exec; one result
        each, in order, as if each had been run by ``exec`` in a freshly reset sandbox.

        Before each program every process is killed and the writable dirs (work dir,
        /tmp, /dev/shm, /dev/mqueue) are wiped, so a program sees nothing of the ones
        before it (nor of earlier ``write_files``: give it ``ExecSpec.files``). Each
        runs in its own session with its own stdin, env, work dir, timeout, output caps
        and limit. The in-container runner (``scripts/batch_runner.py``; needs
        ``python3`` in the image) protects its report (non-dumpable, fresh pipes per
        program); any program it did not report (a program killed or stopped it, it
        could not start one, the image has no python3) is run again here with one
        ``exec`` after a reset. ``final=True``: the runner resets the sandbox after the last program
        (as ``exec(final=True)`` does) when nothing had to be run again.

        Programs of one batch share the container one after another: use it for
        programs of one owner (e.g. one evaluation), not to mix untrusted attempts of
        different tasks (see docs/reference/sandboxes.md).
        """
        progs = [prepare(i, p, self.limits) for i, p in enumerate(programs)]
        if not progs:
            return []
        results: list[ExecResult | None] = [None] * len(progs)
        if self._runner_ok:
            results = await self._run_batch(progs, final=final)
        for i, r in enumerate(results):
            if r is None:  # not reported by the runner: once more, alone
                self.batch_reruns += 1
                if not await self.reset():
                    self._dirty = True
                    raise SandboxError(f"sandbox {self.id[:12]}: reset before rerunning program {i} of a batch failed")
                p = progs[i]
                if p.files:
                    await self.write_files(dict(p.files))
                results[i] = await self.exec(p.argv, timeout=p.timeout, stdin=p.stdin, env=p.env, workdir=p.cwd)
        return [r for r in results if r is not None]

    async def _run_batch(self, progs: list[PreparedProgram], *, final: bool) -> list[ExecResult | None]:
        """One exec of the in-container runner; None for each program it did not report."""
        lim = self.limits
        payload = encode_batch(
            progs,
            dirs=lim.writable_dirs,
            stdout_cap=lim.stdout_cap,
            stderr_cap=lim.stderr_cap,
            output_limit=lim.output_limit_bytes,
            final=final,
            keeper=KEEPER_CMDLINE,
        )
        cap = Capture(runner_report_cap(progs, lim), 64 << 10)
        argv = ["python3", "-I", "-S", "-c", RUNNER_SOURCE]
        r = await self._run(argv, timeout=runner_budget(progs), stdin=payload, env=None, workdir="/", cap=cap, count=False)
        out = parse_runner_output(r.stdout, len(progs), stdout_cap=lim.stdout_cap, stderr_cap=lim.stderr_cap)
        if not out.records and not out.not_started and out.end is None and r.exit_code in (126, 127):
            self._runner_ok = False  # no python3 in this image: one exec per program from now on
        results = out.results(len(progs))
        self._oom_seen = max(self._oom_seen, out.oom_count)
        if self.metrics is not None:
            for x in results:
                if x is not None:
                    self.metrics.on_exec(x.duration_s, timed_out=x.timed_out, oom_killed=x.oom_killed)
        complete = out.end is not None and r.exit_code == 0 and not r.timed_out and not out.problem
        if final and complete and out.end.reset == 0 and all(x is not None for x in results):
            self._clean = True
        return results

    async def _run(
        self,
        argv: list[str],
        *,
        timeout: float,
        stdin: bytes | None,
        env: list[str] | None,
        workdir: str | None,
        cap: Capture,
        count: bool,
    ) -> ExecResult:
        if self._closed:
            raise SandboxGoneError(f"sandbox {self.id[:12]} is closed")
        self._clean = False
        async with self._lock:
            api = self.engine.api
            t0 = time.monotonic()
            try:
                exec_id = (
                    await self.engine.call(
                        api.exec_create,
                        self.id,
                        argv,
                        stdin=stdin is not None,
                        user=self.limits.user,
                        environment=env,
                        workdir=workdir or self.limits.workdir,
                    )
                )["Id"]
            except docker.errors.NotFound as e:
                self._dirty = True
                raise SandboxGoneError(f"sandbox {self.id[:12]}: container is gone") from e
            except docker.errors.APIError as e:
                self._dirty = True
                raise SandboxError(f"sandbox {self.id[:12]}: exec_create failed: {e.explanation or e}") from e
            timed_out = False
            wake = trio.Event()  # the stream ended, or the reader saw the output limit pass
            ended = trio.Event()  # the stream ended

            async def watchdog() -> None:
                nonlocal timed_out
                try:
                    with trio.move_on_after(timeout):
                        await wake.wait()
                    if ended.is_set():
                        return
                    timed_out = not cap.over_limit
                    await self._kill_processes()
                    with trio.move_on_after(KILL_DEADLINE_S):
                        await ended.wait()
                        return
                    # Still streaming after the kill (e.g. the pids limit left no room for
                    # the kill itself): removing the container ends every process.
                    await self._remove()
                except trio.Cancelled:
                    # The caller is cancelled mid-exec: the container goes, which also ends
                    # the output stream the reader thread is blocked on.
                    await self._remove()
                    raise

            def over_limit() -> None:  # called from the reader thread
                trio.from_thread.run_sync(wake.set)

            read_timeout = timeout + KILL_DEADLINE_S + 30.0
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watchdog)
                try:
                    await trio.to_thread.run_sync(
                        stream_exec,
                        api,
                        exec_id,
                        stdin,
                        cap,
                        read_timeout,
                        over_limit,
                        limiter=self.engine.streams,
                    )
                except (OSError, docker.errors.APIError) as e:
                    self._dirty = True
                    raise SandboxError(f"sandbox {self.id[:12]}: exec stream failed: {e}") from e
                finally:
                    ended.set()
                    wake.set()
            try:
                code = await self.engine.call(exec_exit_code, api, exec_id)
            except docker.errors.APIError as e:
                self._dirty = True
                if not (self._closed and (timed_out or cap.over_limit)):
                    raise SandboxError(f"sandbox {self.id[:12]}: exec_inspect failed: {e.explanation or e}") from e
                code = None  # we removed the container to end a runaway exec: killed, status unknown
            duration = time.monotonic() - t0
            oom = False
            if code == 137 and not timed_out:
                oom = await self._oom_since_last()
        if count and self.metrics is not None:
            self.metrics.on_exec(duration, timed_out=timed_out, oom_killed=oom)
        return ExecResult(
            exit_code=code,
            stdout=bytes(cap.out),
            stderr=bytes(cap.err),
            stdout_truncated=cap.out_total > len(cap.out),
            stderr_truncated=cap.err_total > len(cap.err),
            stdout_bytes=cap.out_total,
            stderr_bytes=cap.err_total,
            duration_s=duration,
            timed_out=timed_out,
            oom_killed=oom,
            output_limit_exceeded=cap.over_limit,
        )

    async def _simple(self, argv: list[str], *, timeout: float = KILL_DEADLINE_S, stdin: bytes | None = None) -> ExecResult:
        """An internal exec with small caps, uncounted (reset, kill, file I/O)."""
        return await self._run(
            argv, timeout=timeout, stdin=stdin, env=None, workdir="/", cap=Capture(64 << 10, 64 << 10), count=False
        )

    async def _kill_processes(self) -> None:
        """Kill every process of the sandbox user (PID 1 survives: it is the namespace init)."""
        api = self.engine.api

        def kill() -> int | None:
            eid, _ = run_to_end(api, self.id, ["/bin/sh", "-c", "kill -9 -1"], user=self.limits.user)
            return exec_exit_code(api, eid)

        try:
            with trio.fail_after(KILL_DEADLINE_S):
                code = await self.engine.call(kill)
        except (docker.errors.APIError, trio.TooSlowError):
            code = None
        if code != 0:
            # Could not kill inside: remove the container, which ends everything.
            await self._remove()

    async def _oom_since_last(self) -> bool:
        argv = ["/bin/sh", "-c", OOM_PROBE]
        try:
            _, out = await self.engine.call(run_to_end, self.engine.api, self.id, argv, user=self.limits.user)
        except docker.errors.APIError:
            return False
        n = oom_count(out.decode(errors="replace"))
        fresh = n > self._oom_seen
        self._oom_seen = n
        return fresh

    # -- files --------------------------------------------------------------------------
    async def write_files(self, files: Mapping[str, bytes | str]) -> None:
        """Write files (relative paths are under the work dir; absolute ones must be in the
        work dir or /tmp), creating parent directories, owned by the sandbox user."""
        blobs = dict(writable_files(files, self.limits.workdir, "Sandbox.write_files"))
        if not blobs:
            return
        tar = tar_files(blobs, self.limits.uid, self.limits.gid)
        r = await self._simple(["tar", "-x", "-m", "--no-same-owner", "-C", "/", "-f", "-"], stdin=tar, timeout=60)
        if not r.ok:
            raise SandboxError(
                f"Sandbox.write_files: tar exited {r.exit_code}: {r.stderr.decode(errors='replace')[:500]}"
            )

    async def read_file(self, path: str, *, max_bytes: int = 1 << 20) -> bytes:
        """The content of ``path`` (relative to the work dir); SandboxError if it is missing
        or larger than ``max_bytes``."""
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"Sandbox.read_file: max_bytes={max_bytes!r} must be a non-negative int")
        full = resolve(path, self.limits.workdir)
        r = await self._run(
            ["head", "-c", str(max_bytes + 1), "--", full],
            timeout=60,
            stdin=None,
            env=None,
            workdir="/",
            cap=Capture(max_bytes + 1, 4096),
            count=False,
        )
        if r.exit_code != 0:
            raise SandboxError(f"Sandbox.read_file: {path!r}: {r.stderr.decode(errors='replace').strip()}")
        if len(r.stdout) > max_bytes:
            raise SandboxError(f"Sandbox.read_file: {path!r} is larger than max_bytes={max_bytes}")
        return r.stdout

    # -- lifecycle ----------------------------------------------------------------------
    async def reset(self) -> bool:
        """Kill every process, wipe the work dir, /tmp, /dev/shm and /dev/mqueue; True when
        the sandbox is clean (nothing carries over to the next lease)."""
        if self._closed or self._dirty:
            return False
        try:
            r = await self._simple(["/bin/sh", "-c", RESET_SCRIPT, "reset", self.limits.workdir], timeout=20)
        except SandboxError:
            return False
        return r.exit_code == 0 and not r.timed_out

    async def _remove(self) -> None:
        """Mark the sandbox dirty and remove its container: shielded, within
        ``REMOVE_DEADLINE_S``, even when the caller is cancelled. The one way a sandbox
        gives up its container; idempotent."""
        self._dirty = True
        if not self._closed and await remove_container(self.engine, self.id):
            self._closed = True

    async def aclose(self) -> None:
        """Remove the container (shielded, at most ``REMOVE_DEADLINE_S``); idempotent."""
        await self._remove()

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
