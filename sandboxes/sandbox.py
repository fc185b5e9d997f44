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

All Docker SDK calls are blocking; they run in worker threads under a
``trio.CapacityLimiter`` (``Engine``), never on the event loop. Closing a sandbox
(``aclose``) removes its container under a shielded cancel scope with a deadline, so
cancellation never leaks a container.
"""

from __future__ import annotations

import functools
import io
import math
import socket
import struct
import tarfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import docker
import docker.errors
import msgspec
import trio

from .batch import RUNNER_SOURCE, ExecSpec, PreparedProgram, encode_batch, parse_runner_output
from .limits import DEFAULT_LIMITS, Limits, host_config_kwargs
from .metrics import SandboxMetrics
from .sweep import Ownership

__all__ = [
    "Engine",
    "ExecResult",
    "ExecSpec",
    "Sandbox",
    "SandboxError",
    "SandboxStartError",
    "SandboxGoneError",
    "start_sandbox",
    "open_sandbox",
    "KEEPER_ARGV",
    "REMOVE_DEADLINE_S",
]

REMOVE_DEADLINE_S = 30.0
"""Most seconds a shielded container removal may take before it is given up (and left
for the sweep)."""
KILL_DEADLINE_S = 10.0
BATCH_SLACK_S = 15.0
"""Seconds per program, beyond the programs' own timeouts, a batch exec may take (the
runner's resets, files, kills) before the engine-side watchdog ends it."""

# PID 1 of every sandbox: `sleep` with SIGCHLD ignored. It never forks, so a fork bomb
# at the pids limit cannot take it down; with SIGCHLD ignored the kernel reaps every
# child at exit, so orphans reparented to it never pile up as zombies (which would keep
# holding the pids limit); `kill -9 -1` from the sandbox user spares it (a PID
# namespace's init is immune). `env --ignore-signal` is coreutils >= 8.31.
KEEPER_ARGV = ["env", "--ignore-signal=CHLD", "sleep", "infinity"]
KEEPER_CMDLINE = KEEPER_ARGV[2:]
"""PID 1's /proc/1/cmdline once ``env`` has exec'ed ``sleep``."""

# Kill every process of the sandbox user but PID 1 (and this shell), wipe every
# writable dir, then check that nothing survived. Returns 0 when the sandbox is clean.
# A function, not a subshell: `kill -9 -1` spares only the calling process.
_RESET_FUNCTION = r"""
fleetrl_reset() {
  wd="$1"
  i=0
  while :; do
    kill -9 -1 2>/dev/null
    n=0
    for d in /proc/[0-9]*; do
      p=${d#/proc/}
      [ "$p" = 1 ] && continue
      [ "$p" = $$ ] && continue
      read -r line < "$d/stat" 2>/dev/null || continue
      set -- $line
      [ "$4" = $$ ] && continue
      n=$((n+1))
    done
    [ "$n" = 0 ] && break
    i=$((i+1))
    [ "$i" -ge 50 ] && { echo "processes survive: $n" >&2; return 3; }
    sleep 0.02
  done
  # SysV IPC objects live in the container's IPC namespace, not in /dev/shm
  command -v ipcrm >/dev/null 2>&1 && ipcrm --all 2>/dev/null
  # every place the sandbox user can write (read-only root): work dir, /tmp, /dev/shm, /dev/mqueue
  set -- "$wd" /tmp /dev/shm /dev/mqueue
  for dir; do
    rm -rf "$dir"/* "$dir"/.[!.]* "$dir"/..?* 2>/dev/null || {
      chmod -R u+rwX "$dir" 2>/dev/null; rm -rf "$dir"/* "$dir"/.[!.]* "$dir"/..?* 2>/dev/null; }
  done
  for dir; do
    for f in "$dir"/* "$dir"/.[!.]* "$dir"/..?*; do
      if [ -e "$f" ] || [ -L "$f" ]; then echo "not wiped: $f" >&2; return 5; fi
    done
  done
  return 0
}
"""
_RESET_SCRIPT = _RESET_FUNCTION + 'fleetrl_reset "$1"\n'

# A lease's final command and the reset in one exec: run the command, then reset, then
# report both statuses as the last line of stderr. Only this shell's own exit status
# (0 after it printed the line, 137 if it was killed) says the line is genuine: when
# it prints, every other process is dead, so nothing can write after it.
_FINAL_MARK = b"\nfleetrl-final "
_FINAL_SCRIPT = _RESET_FUNCTION + r"""
wd="$1"; shift
"$@"
rc=$?
fleetrl_reset "$wd" 2>/dev/null
st=$?
printf '\nfleetrl-final %s %s\n' "$rc" "$st" >&2
exit 0
"""

_OOM_PROBE = "cat /sys/fs/cgroup/memory/memory.oom_control 2>/dev/null || cat /sys/fs/cgroup/memory.events 2>/dev/null"


class SandboxError(Exception):
    """Root of sandbox errors."""


class SandboxStartError(SandboxError):
    """A container could not be created or started (bad image, engine refused)."""


class SandboxGoneError(SandboxError):
    """The container disappeared (removed, killed, engine restarted)."""


class ExecResult(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one ``Sandbox.exec``."""

    exit_code: int | None
    """Exit status (128+N after signal N, e.g. 137 when killed); None if unknown."""
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    """More stdout was written than the cap; only the first ``stdout_cap`` bytes are kept."""
    stderr_truncated: bool
    stdout_bytes: int
    """Bytes of stdout the process wrote (kept or not)."""
    stderr_bytes: int
    duration_s: float
    timed_out: bool
    """The wall-clock timeout passed and every process of the sandbox user was killed."""
    output_limit_exceeded: bool = False
    """More than ``limits.output_limit_bytes`` of output: every process was killed."""
    oom_killed: bool
    """The OOM killer killed a process of this sandbox during this exec."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def to_json_dict(self) -> dict[str, Any]:
        d = msgspec.to_builtins(self)
        d["stdout"] = self.stdout.decode("utf-8", errors="replace")
        d["stderr"] = self.stderr.decode("utf-8", errors="replace")
        return d


class Engine:
    """The Docker client plus the capacity limiters its blocking calls run under.

    ``control`` bounds short API calls (create, start, inspect, remove); ``streams``
    bounds long-lived exec output readers, so a burst of slow execs can never starve
    the calls that kill or remove containers.
    """

    def __init__(
        self, client: docker.DockerClient | None = None, *, max_calls: int = 16, max_streams: int = 256
    ) -> None:
        self.client = client or docker.from_env(max_pool_size=max_calls + max_streams)
        self.api: docker.APIClient = self.client.api
        self.control = trio.CapacityLimiter(max_calls)
        self.streams = trio.CapacityLimiter(max_streams)

    async def call(self, fn, /, *args, **kwargs):
        """Run blocking ``fn(*args, **kwargs)`` in a worker thread under ``control``."""
        return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self.control)

    def close(self) -> None:
        self.client.close()


# -- blocking helpers (worker threads) --------------------------------------------------


class _Capture:
    """Demultiplexed, capped output of one exec, filled by the reader thread."""

    __slots__ = ("out", "err", "out_total", "err_total", "out_cap", "err_cap", "limit", "over_limit", "err_tail")
    TAIL = 256  # last bytes of stderr always kept (a final exec's status line lives there)

    def __init__(self, out_cap: int, err_cap: int, limit: int | None = None) -> None:
        self.out, self.err = bytearray(), bytearray()
        self.out_total = self.err_total = 0
        self.out_cap, self.err_cap = out_cap, err_cap
        self.limit = limit  # total output beyond which the exec is killed (None: never)
        self.over_limit = False
        self.err_tail = bytearray()

    def add(self, stream: int, data: bytes | memoryview) -> None:
        if stream == 2:
            self.err_total += len(data)
            room = self.err_cap - len(self.err)
            if room > 0:
                self.err += data[:room]
            self.err_tail += data[-self.TAIL :]
            del self.err_tail[: -self.TAIL]
        else:
            self.out_total += len(data)
            room = self.out_cap - len(self.out)
            if room > 0:
                self.out += data[:room]


def _stream_exec(
    api: docker.APIClient,
    exec_id: str,
    stdin: bytes | None,
    cap: _Capture,
    read_timeout: float,
    on_over_limit=None,
) -> None:
    """Start exec ``exec_id``, feed ``stdin``, read its multiplexed output into ``cap``
    until the process ends (the stream closes). Calls ``on_over_limit()`` once when the
    output passes ``cap.limit`` (and keeps draining until the stream ends)."""
    sock = api.exec_start(exec_id, socket=True)
    raw: socket.socket = getattr(sock, "_sock", sock)
    writer = None
    try:
        raw.settimeout(read_timeout)
        if stdin is not None:

            def feed() -> None:
                try:
                    raw.sendall(stdin)
                    raw.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # the process exited without reading all of its input

            writer = threading.Thread(target=feed, name="sandbox-stdin", daemon=True)
            writer.start()
        # Frames: 8-byte header (stream, 0, 0, 0, big-endian size) then the payload.
        # Payload bytes go straight from the receive buffer into the capped capture;
        # only a header split across reads is buffered.
        chunk = bytearray(1 << 16)
        view = memoryview(chunk)
        header = bytearray()
        stream, size = 1, 0
        while True:
            n = raw.recv_into(view)
            if n == 0:
                break
            pos = 0
            while pos < n:
                if size == 0:
                    take = min(8 - len(header), n - pos)
                    header += view[pos : pos + take]
                    pos += take
                    if len(header) == 8:
                        stream, size = header[0], struct.unpack(">I", header[4:8])[0]
                        header.clear()
                    continue
                take = min(size, n - pos)
                cap.add(stream, view[pos : pos + take])
                pos += take
                size -= take
            if (
                not cap.over_limit
                and cap.limit is not None
                and cap.out_total + cap.err_total > cap.limit
            ):
                cap.over_limit = True
                if on_over_limit is not None:
                    on_over_limit()
    finally:
        if writer is not None:
            writer.join(timeout=5)
        try:
            sock.close()
        finally:
            if raw is not sock:
                raw.close()


def _exit_code(api: docker.APIClient, exec_id: str) -> int | None:
    for _ in range(200):
        info = api.exec_inspect(exec_id)
        if not info.get("Running") and info.get("ExitCode") is not None:
            return int(info["ExitCode"])
        time.sleep(0.005)
    return None


def _tar_files(files: Mapping[str, bytes], uid: int, gid: int) -> bytes:
    bio = io.BytesIO()
    with tarfile.open(fileobj=bio, mode="w", format=tarfile.PAX_FORMAT) as tar:
        now = time.time()
        for name, data in files.items():
            info = tarfile.TarInfo(name.lstrip("/"))
            info.size, info.mode, info.mtime, info.uid, info.gid = len(data), 0o644, now, uid, gid
            tar.addfile(info, io.BytesIO(data))
    return bio.getvalue()


def _oom_count(text: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "oom_kill" and parts[1].isdigit():
            return int(parts[1])
    return 0


# -- the resource ------------------------------------------------------------------------


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
        argv = self._argv(cmd)
        timeout = self.limits.timeout_s if timeout is None else timeout
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"Sandbox.exec: timeout={timeout!r} must be a positive number of seconds")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        if data is not None and not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"Sandbox.exec: stdin must be bytes or str, not {type(stdin).__name__}")
        envl = self._env(env)
        if workdir is not None and not workdir.startswith("/"):
            raise ValueError(f"Sandbox.exec: workdir={workdir!r} must be an absolute path")
        cap = _Capture(self.limits.stdout_cap, self.limits.stderr_cap, self.limits.output_limit_bytes)
        if final:
            argv = ["/bin/sh", "-c", _FINAL_SCRIPT, "final", self.limits.workdir, *argv]
        r = await self._run(argv, timeout=timeout, stdin=data, env=envl, workdir=workdir, cap=cap, count=not final)
        if final:
            r = self._finish_final(r, cap)
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
        and limit. The in-container runner (``batch_runner.py``; needs ``python3`` in
        the image) protects its report (non-dumpable, fresh pipes per program); any
        program it did not report (a program killed or stopped it, it could not start
        one, the image has no python3) is run again here with one ``exec`` after a
        reset. ``final=True``: the runner resets the sandbox after the last program
        (as ``exec(final=True)`` does) when nothing had to be run again.

        Programs of one batch share the container one after another: use it for
        programs of one owner (e.g. one evaluation), not to mix untrusted attempts of
        different tasks (see docs/sandboxes.md).
        """
        progs = [self._prepare(i, p) for i, p in enumerate(programs)]
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
        lim = self.limits
        payload = encode_batch(
            progs,
            dirs=[lim.workdir, "/tmp", "/dev/shm", "/dev/mqueue"],
            stdout_cap=lim.stdout_cap,
            stderr_cap=lim.stderr_cap,
            output_limit=lim.output_limit_bytes,
            final=final,
            keeper=KEEPER_CMDLINE,
        )
        budget = sum(p.timeout for p in progs) + BATCH_SLACK_S * len(progs)
        report_cap = sum(lim.stdout_cap + lim.stderr_cap + 1024 for _ in progs) + 4096
        cap = _Capture(report_cap, 64 << 10)
        argv = ["python3", "-I", "-S", "-c", RUNNER_SOURCE]
        r = await self._run(argv, timeout=budget, stdin=payload, env=None, workdir="/", cap=cap, count=False)
        out = parse_runner_output(r.stdout, len(progs), stdout_cap=lim.stdout_cap, stderr_cap=lim.stderr_cap)
        if not out.records and not out.not_started and out.end is None and r.exit_code in (126, 127):
            self._runner_ok = False  # no python3 in this image: one exec per program from now on
        results: list[ExecResult | None] = [None] * len(progs)
        for i, (rec, so, se) in out.records.items():
            results[i] = ExecResult(
                exit_code=rec.exit_code,
                stdout=so,
                stderr=se,
                stdout_truncated=rec.out_total > len(so),
                stderr_truncated=rec.err_total > len(se),
                stdout_bytes=rec.out_total,
                stderr_bytes=rec.err_total,
                duration_s=rec.duration,
                timed_out=rec.timed_out,
                output_limit_exceeded=rec.over_limit,
                oom_killed=rec.oom,
            )
            self._oom_seen = max(self._oom_seen, rec.oom_count)
            if self.metrics is not None:
                self.metrics.on_exec(rec.duration, timed_out=rec.timed_out, oom_killed=rec.oom)
        if out.end is not None:
            self._oom_seen = max(self._oom_seen, out.end.oom_count)
        complete = out.end is not None and r.exit_code == 0 and not r.timed_out and not out.problem
        if final and complete and out.end.reset == 0 and all(x is not None for x in results):
            self._clean = True
        return results

    def _prepare(self, i: int, p: ExecSpec) -> PreparedProgram:
        """Check one ``ExecSpec`` as ``exec`` checks its arguments; errors name the index."""
        where = f"Sandbox.exec_many: programs[{i}]"
        if not isinstance(p, ExecSpec):
            raise TypeError(f"{where} must be an ExecSpec, not {type(p).__name__}")
        try:
            argv = self._argv(p.cmd)
            envd = dict(p.env) if p.env is not None else None
            self._env(envd)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from None
        timeout = self.limits.timeout_s if p.timeout is None else p.timeout
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"{where}: timeout={timeout!r} must be a positive number of seconds")
        data = p.stdin.encode() if isinstance(p.stdin, str) else p.stdin
        if data is not None and not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"{where}: stdin must be bytes or str, not {type(p.stdin).__name__}")
        if p.workdir is not None and (not isinstance(p.workdir, str) or not p.workdir.startswith("/")):
            raise ValueError(f"{where}: workdir={p.workdir!r} must be an absolute path")
        wd = self.limits.workdir.rstrip("/")
        if not isinstance(p.files, Mapping):
            raise TypeError(f"{where}: files must be a mapping of path -> content, not {type(p.files).__name__}")
        files: list[tuple[str, bytes]] = []
        for name, content in p.files.items():
            try:
                full = self._resolve(name)
            except ValueError as e:
                raise ValueError(f"{where}: files: {e}") from None
            if not (full.startswith(wd + "/") or full.startswith("/tmp/")):
                raise ValueError(f"{where}: file {name!r} is outside the work dir {wd} and /tmp")
            if not isinstance(content, (str, bytes, bytearray)):
                raise TypeError(f"{where}: file {name!r} must be bytes or str, not {type(content).__name__}")
            files.append((full, content.encode() if isinstance(content, str) else bytes(content)))
        return PreparedProgram(
            argv=argv,
            env=envd,
            cwd=p.workdir or self.limits.workdir,
            timeout=float(timeout),
            stdin=None if data is None else bytes(data),
            files=files,
        )

    def _finish_final(self, r: ExecResult, cap: _Capture) -> ExecResult:
        """Read the final exec's status line (trusted only if the wrapper shell itself
        exited 0), strip it from stderr, and note whether the sandbox is now clean."""
        tail = bytes(cap.err_tail)
        at = tail.rfind(_FINAL_MARK)
        fields = tail[at + len(_FINAL_MARK) :].split() if at >= 0 else []
        genuine = (
            r.exit_code == 0
            and not r.timed_out
            and not r.output_limit_exceeded
            and len(fields) == 2
            and all(f.isdigit() for f in fields)
            and tail.endswith(b"\n")
        )
        if not genuine:
            # Killed (timeout, output limit) or the wrapper could not run: the status
            # is what the engine saw; the pool resets on release as usual.
            return r
        rc, status = int(fields[0]), int(fields[1])
        self._clean = status == 0
        line_len = len(tail) - at
        total = r.stderr_bytes - line_len  # the line was the last bytes of the stream
        stderr = r.stderr[:total]
        return msgspec.structs.replace(
            r, exit_code=rc, stderr=stderr, stderr_bytes=total, stderr_truncated=total > len(stderr)
        )

    async def _run(
        self,
        argv: list[str],
        *,
        timeout: float,
        stdin: bytes | None,
        env: list[str] | None,
        workdir: str | None,
        cap: _Capture,
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
                    self._dirty = True
                    with trio.CancelScope(shield=True) as cs:
                        cs.deadline = trio.current_time() + REMOVE_DEADLINE_S
                        await self._remove()
                except trio.Cancelled:
                    # The caller is cancelled mid-exec: the container goes, which also ends
                    # the output stream the reader thread is blocked on.
                    self._dirty = True
                    with trio.CancelScope(shield=True) as cs:
                        cs.deadline = trio.current_time() + REMOVE_DEADLINE_S
                        await self._remove()
                    raise

            def over_limit() -> None:  # called from the reader thread
                trio.from_thread.run_sync(wake.set)

            read_timeout = timeout + KILL_DEADLINE_S + 30.0
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watchdog)
                try:
                    await trio.to_thread.run_sync(
                        _stream_exec,
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
                code = await self.engine.call(_exit_code, api, exec_id)
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
            argv, timeout=timeout, stdin=stdin, env=None, workdir="/", cap=_Capture(64 << 10, 64 << 10), count=False
        )

    async def _kill_processes(self) -> None:
        """Kill every process of the sandbox user (PID 1 survives: it is the namespace init)."""
        api = self.engine.api

        def kill() -> int | None:
            eid = api.exec_create(self.id, ["/bin/sh", "-c", "kill -9 -1"], user=self.limits.user)["Id"]
            api.exec_start(eid)
            return _exit_code(api, eid)

        try:
            with trio.fail_after(KILL_DEADLINE_S):
                code = await self.engine.call(kill)
        except (docker.errors.APIError, trio.TooSlowError):
            code = None
        if code != 0:
            # Could not kill inside: remove the container, which ends everything.
            self._dirty = True
            await self._remove()

    async def _oom_since_last(self) -> bool:
        api = self.engine.api

        def probe() -> str:
            eid = api.exec_create(self.id, ["/bin/sh", "-c", _OOM_PROBE], user=self.limits.user)["Id"]
            return api.exec_start(eid).decode(errors="replace")

        try:
            n = _oom_count(await self.engine.call(probe))
        except docker.errors.APIError:
            return False
        fresh = n > self._oom_seen
        self._oom_seen = n
        return fresh

    # -- files --------------------------------------------------------------------------
    def _resolve(self, path: str) -> str:
        if not isinstance(path, str) or not path or "\0" in path:
            raise ValueError(f"sandbox path {path!r} must be a non-empty string")
        full = path if path.startswith("/") else f"{self.limits.workdir.rstrip('/')}/{path}"
        parts = [p for p in full.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ValueError(f"sandbox path {path!r} must not contain '..'")
        return "/" + "/".join(parts)

    async def write_files(self, files: Mapping[str, bytes | str]) -> None:
        """Write files (relative paths are under the work dir; absolute ones must be in the
        work dir or /tmp), creating parent directories, owned by the sandbox user."""
        wd = self.limits.workdir.rstrip("/")
        blobs: dict[str, bytes] = {}
        for name, data in files.items():
            full = self._resolve(name)
            if not (full.startswith(wd + "/") or full.startswith("/tmp/")):
                raise ValueError(f"Sandbox.write_files: {name!r} is outside the work dir {wd} and /tmp")
            blobs[full] = data.encode() if isinstance(data, str) else bytes(data)
        if not blobs:
            return
        tar = _tar_files(blobs, self.limits.uid, self.limits.gid)
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
        full = self._resolve(path)
        r = await self._run(
            ["head", "-c", str(max_bytes + 1), "--", full],
            timeout=60,
            stdin=None,
            env=None,
            workdir="/",
            cap=_Capture(max_bytes + 1, 4096),
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
            r = await self._simple(["/bin/sh", "-c", _RESET_SCRIPT, "reset", self.limits.workdir], timeout=20)
        except SandboxError:
            return False
        return r.exit_code == 0 and not r.timed_out

    async def _remove(self) -> None:
        if self._closed:
            return
        try:
            await self.engine.call(self.engine.api.remove_container, self.id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                raise
        self._closed = True

    async def aclose(self) -> None:
        """Remove the container (shielded, at most ``REMOVE_DEADLINE_S``); idempotent."""
        if self._closed:
            return
        with trio.CancelScope(shield=True) as cs:
            cs.deadline = trio.current_time() + REMOVE_DEADLINE_S
            await self._remove()
        self._dirty = True

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- argument checks ------------------------------------------------------------------
    @staticmethod
    def _argv(cmd: str | Sequence[str]) -> list[str]:
        if isinstance(cmd, str):
            if not cmd.strip():
                raise ValueError("Sandbox.exec: cmd is an empty string")
            return ["/bin/sh", "-c", cmd]
        argv = list(cmd)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"Sandbox.exec: cmd {cmd!r} must be a non-empty list of strings")
        if any("\0" in a for a in argv):
            raise ValueError("Sandbox.exec: arguments must not contain NUL bytes")
        return argv

    @staticmethod
    def _env(env: Mapping[str, str] | None) -> list[str] | None:
        if env is None:
            return None
        out = []
        for k, v in env.items():
            if not isinstance(k, str) or not k or "=" in k or "\0" in k:
                raise ValueError(f"Sandbox.exec: env name {k!r} must be non-empty without '=' or NUL")
            if not isinstance(v, str) or "\0" in v:
                raise ValueError(f"Sandbox.exec: env[{k!r}] must be a string without NUL")
            out.append(f"{k}={v}")
        return out


async def start_sandbox(
    engine: Engine,
    *,
    image: str,
    limits: Limits = DEFAULT_LIMITS,
    ownership: Ownership,
    metrics: SandboxMetrics | None = None,
) -> Sandbox:
    """Create and start one sandbox container. If this is cancelled or fails after the
    container exists, the container is removed (shielded) before the error escapes."""
    api = engine.api
    cid: str | None = None
    try:
        try:
            hc = api.create_host_config(**host_config_kwargs(limits))
            cid = (
                await engine.call(
                    api.create_container,
                    image,
                    command=KEEPER_ARGV,
                    user=limits.user,
                    working_dir=limits.workdir,
                    labels=ownership.labels(),
                    host_config=hc,
                    network_disabled=limits.network == "none",
                    stop_signal="SIGKILL",
                )
            )["Id"]
            await engine.call(api.start, cid)
        except docker.errors.ImageNotFound as e:
            raise SandboxStartError(
                f"image {image!r} not found locally: build it with `fleetrl sandbox build-image` or name a local image"
            ) from e
        except docker.errors.APIError as e:
            raise SandboxStartError(f"starting a sandbox of image {image!r} failed: {e.explanation or e}") from e
    except BaseException:
        if cid is not None:
            with trio.CancelScope(shield=True) as cs:
                cs.deadline = trio.current_time() + REMOVE_DEADLINE_S
                try:
                    await engine.call(api.remove_container, cid, force=True, v=True)
                except docker.errors.APIError:
                    pass  # left for the sweep: it carries our labels
        raise
    if metrics is not None:
        metrics.on_created()
    return Sandbox(engine, cid, image=image, limits=limits, metrics=metrics)


class open_sandbox:
    """``async with open_sandbox(engine, image=..., ownership=...) as sb``: one fresh
    container, removed on exit (no pool)."""

    def __init__(self, engine: Engine, *, image: str, limits: Limits = DEFAULT_LIMITS, ownership: Ownership, metrics=None):
        self._args = dict(image=image, limits=limits, ownership=ownership, metrics=metrics)
        self._engine = engine
        self._sb: Sandbox | None = None

    async def __aenter__(self) -> Sandbox:
        self._sb = await start_sandbox(self._engine, **self._args)
        return self._sb

    async def __aexit__(self, *exc: object) -> None:
        assert self._sb is not None
        await self._sb.aclose()
