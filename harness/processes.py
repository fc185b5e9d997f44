"""A command run in its own session and stopped with its whole process tree.

`run_command` starts a command in a new session (process group), keeps the tail of
its stdout and stderr (`tail_bytes`), waits at most a wall-clock limit and, on
timeout or when the caller is cancelled, stops every process of its tree with
`kill_process_tree`: SIGTERM, a grace period, then SIGSTOP until the tree stops
growing (a fork cannot outrun a frozen parent), then SIGKILL; even processes that left
the group with ``setsid`` are found, through the parent links of ``/proc``
(`read_parent_map`, `process_tree`). `ExternalHarness` runs its command with it, started
afresh or forked from a preloading `forkserver.ForkServer`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import msgspec
import trio

from .forkserver import ForkedProcess, ForkServer, ForkServerFailed

__all__ = ["CommandOutcome", "exit_reason", "exit_with_parent", "kill_process_tree", "process_tree", "read_parent_map", "run_command", "tail_bytes"]


def exit_with_parent(parent_pid: int, *, interval_s: float, end: Callable[[], None] = lambda: os._exit(3)) -> None:
    """Call ``end`` (default: ``os._exit(3)``) once this process's parent is no longer
    `parent_pid` (at once if it already is not): for child processes that must not
    outlive the process that started them (trainer ranks, child samplers).

    A daemon thread polls ``os.getppid()`` every ``interval_s``: the kernel's parent-death
    signal would fire when the parent *thread* that spawned us exits, and Trio starts
    processes from worker threads that it retires while the child is still wanted.
    """
    if os.getppid() != parent_pid:  # gone before we started watching
        end()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        end()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def exit_reason(code: int) -> str:
    """A process's exit status in words (``killed by SIGKILL``, ``exited with status 2``)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def tail_bytes(buf: bytearray, data: bytes, cap: int) -> None:
    """Append ``data`` to ``buf`` keeping only its last ``cap`` bytes."""
    buf += data
    if len(buf) > cap:
        del buf[: len(buf) - cap]


def process_tree(parents: Mapping[int, int], root: int) -> list[int]:
    """``root`` and every descendant of it in the ``pid -> parent pid`` map, parents first."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo, seen = [], [root], set()
    while todo:
        pid = todo.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        todo.extend(sorted(children.get(pid, ())))
    return out


def read_parent_map(proc: str = "/proc") -> dict[int, int]:
    """``pid -> parent pid`` of every live process (zombies excluded), from ``/proc``."""
    out = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # it exited meanwhile
        # the command name is parenthesised and may hold anything: split after the last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) < 2 or fields[0] == b"Z":
            continue
        out[int(name)] = int(fields[1])
    return out



def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


async def kill_process_tree(root: int | None, pgid: int | None, *, grace_s: float,
                            known: Iterable[int] = ()) -> list[int]:
    """Stop ``root``, its process group ``pgid`` and all their descendants, including
    those that left the group (``setsid``): SIGTERM, ``grace_s`` seconds to exit, then
    SIGSTOP until no new process appears (a fork cannot outrun a frozen parent), then
    SIGKILL. Returns every pid that was signalled. Runs shielded (it is cleanup).

    ``root`` must not have been reaped yet (a reaped pid may be reused by another
    process); pass None once it has been, and the group alone is followed (a group id
    is not reused while a member lives)."""
    signalled: set[int] = set(known)

    def tree() -> set[int]:
        parents = read_parent_map()
        pids = set(process_tree(parents, root)) if root is not None and root in parents else set()
        for p in list(signalled):
            if p in parents:
                pids.update(process_tree(parents, p))
        if pgid is not None:
            for p in list(parents):
                try:
                    if os.getpgid(p) == pgid:
                        pids.update(process_tree(parents, p))
                except (ProcessLookupError, PermissionError):
                    pass
        pids.discard(os.getpid())
        return pids

    with trio.CancelScope(shield=True):
        pids = tree()
        signalled |= pids
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        _signal_all(pids, signal.SIGTERM)
        deadline = trio.current_time() + grace_s
        while grace_s > 0 and trio.current_time() < deadline:
            if not tree():
                break
            await trio.sleep(0.05)
        for _ in range(100):  # freeze until the tree stops growing, then kill it
            pids = tree()
            if not pids:
                break
            signalled |= pids
            _signal_all(pids, signal.SIGSTOP)
            if tree() <= pids:
                _signal_all(pids, signal.SIGKILL)
                _signal_all(pids, signal.SIGCONT)
                await trio.sleep(0.01)
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return sorted(signalled)


class CommandOutcome(msgspec.Struct, kw_only=True):
    """What `run_command` saw: the exit code (None when killed), whether it timed out,
    every pid signalled, the tails of stdout and stderr, and how long it ran."""

    exit_code: int | None = None
    timed_out: bool = False
    killed: list[int] = msgspec.field(default_factory=list)
    stdout: bytearray = msgspec.field(default_factory=bytearray)
    stderr: bytearray = msgspec.field(default_factory=bytearray)
    duration_s: float = 0.0


async def run_command(argv: list[str], *, env: dict[str, str], cwd: str, timeout_s: float, grace_s: float,
                       cap: int, forkserver: ForkServer | None = None) -> CommandOutcome:
    """Run ``argv`` in a new session; kill its tree on timeout or cancellation. With a
    ``forkserver`` (`forkserver.ForkServer`), ``argv`` is ``[python, program...]`` and
    the program is forked from the server (its preloaded modules already imported)
    instead of started afresh; everything else is the same."""
    start = trio.current_time()
    if forkserver is None:
        try:
            proc = await trio.lowlevel.open_process(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                    start_new_session=True)
        except OSError as err:
            raise ValueError(f"ExternalHarness: cannot start {argv[0]!r}: {err}") from err
        assert proc.stdout is not None and proc.stderr is not None
        return await _supervise(proc, proc.stdout, proc.stderr, start, timeout_s=timeout_s, grace_s=grace_s, cap=cap)
    pipes = [os.pipe(), os.pipe()]
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        child = await forkserver.spawn(argv[1:], env=env, cwd=cwd, stdio=(devnull, pipes[0][1], pipes[1][1]))
    except BaseException:
        for fd in (pipes[0][0], pipes[1][0]):
            os.close(fd)
        raise
    finally:
        for fd in (devnull, pipes[0][1], pipes[1][1]):
            os.close(fd)
    try:
        return await _supervise(child, trio.lowlevel.FdStream(pipes[0][0]), trio.lowlevel.FdStream(pipes[1][0]),
                                start, timeout_s=timeout_s, grace_s=grace_s, cap=cap)
    finally:
        child.close()


async def _supervise(proc: trio.Process | ForkedProcess, stdout: trio.abc.ReceiveStream,
                     stderr: trio.abc.ReceiveStream, start: float, *, timeout_s: float, grace_s: float,
                     cap: int) -> CommandOutcome:
    """Wait for ``proc`` (the leader of its own session) at most ``timeout_s``, keeping
    the tails of its output; stop its tree on timeout, when it exits (what it left
    running) and when the caller is cancelled; ``start`` is when the command was started."""
    out = CommandOutcome()
    drained = [trio.Event(), trio.Event()]
    lost: ForkServerFailed | None = None

    async def drain(stream: trio.abc.ReceiveStream, buf: bytearray, done: trio.Event) -> None:
        try:
            while data := await stream.receive_some(65536):
                tail_bytes(buf, data, cap)
        finally:
            done.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, stdout, out.stdout, drained[0])
            nursery.start_soon(drain, stderr, out.stderr, drained[1])
            with trio.move_on_after(timeout_s) as scope:
                try:
                    await proc.wait()
                except ForkServerFailed as err:  # the exit status is lost: stop the tree, then say so
                    lost = err
            if lost is not None:
                out.killed = await kill_process_tree(proc.pid, proc.pid, grace_s=grace_s)
            elif scope.cancelled_caught:
                out.timed_out = True
                out.killed = await kill_process_tree(proc.pid, proc.pid, grace_s=grace_s)
                with trio.CancelScope(shield=True):
                    try:
                        await proc.wait()
                    except ForkServerFailed:
                        pass
            else:
                out.exit_code = proc.returncode
                # the command exited; whatever it left running in its session goes too
                out.killed = await kill_process_tree(None, proc.pid, grace_s=0)
            with trio.move_on_after(5):  # every writer is dead: the pipes reach EOF
                for ev in drained:
                    await ev.wait()
            nursery.cancel_scope.cancel()
    except BaseException:
        if proc.returncode is None:
            await kill_process_tree(proc.pid, proc.pid, grace_s=grace_s)
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                try:
                    await proc.wait()
                except ForkServerFailed:  # the server died too: its exit status is gone with it
                    pass
        raise
    finally:
        with trio.CancelScope(shield=True):
            await stdout.aclose()
            await stderr.aclose()
    if lost is not None:
        raise lost
    out.duration_s = trio.current_time() - start
    return out
