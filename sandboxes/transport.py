"""The exec transport: the Docker client and its limiters (``Engine``), one ``docker
exec`` streamed into a capped capture, its exit code, files as a tar, and the shielded
removal of a container.

All Docker SDK calls are blocking; they run in worker threads under a
``trio.CapacityLimiter`` (``Engine``), never on the event loop. The functions below
without ``async`` are those thread bodies.
"""

from __future__ import annotations

import functools
import io
import socket
import struct
import tarfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import docker
import docker.errors
import trio

__all__ = [
    "Engine",
    "Capture",
    "stream_exec",
    "exec_exit_code",
    "run_to_end",
    "tar_files",
    "remove_container",
    "REMOVE_DEADLINE_S",
]

REMOVE_DEADLINE_S = 30.0
"""Most seconds a shielded container removal may take before it is given up (and left
for the sweep)."""


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


async def remove_container(engine: Engine, container_id: str) -> bool:
    """Force-remove a container and its anonymous volumes, shielded from cancellation and
    within ``REMOVE_DEADLINE_S``: a cancelled caller still removes it. True once it is
    gone (already gone counts); False when the deadline passed first (the container
    keeps its labels, so the sweep removes it). Other engine errors raise
    ``docker.errors.APIError``."""
    with trio.CancelScope(shield=True) as cs:
        cs.deadline = trio.current_time() + REMOVE_DEADLINE_S
        try:
            await engine.call(engine.api.remove_container, container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                raise
        return True
    return False


# -- blocking helpers (worker threads) --------------------------------------------------


class Capture:
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


def stream_exec(
    api: docker.APIClient,
    exec_id: str,
    stdin: bytes | None,
    cap: Capture,
    read_timeout: float,
    on_over_limit: Callable[[], None] | None = None,
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


def exec_exit_code(api: docker.APIClient, exec_id: str) -> int | None:
    """The exit status of a finished exec; None when the engine does not report one soon."""
    for _ in range(200):
        info = api.exec_inspect(exec_id)
        if not info.get("Running") and info.get("ExitCode") is not None:
            return int(info["ExitCode"])
        time.sleep(0.005)
    return None


def run_to_end(api: docker.APIClient, container_id: str, argv: Sequence[str], *, user: str) -> tuple[str, bytes]:
    """Run ``argv`` in the container as ``user`` without stdin, to its end: (exec id,
    its output, stdout and stderr interleaved). For our own short commands only: the
    output is not capped."""
    exec_id = api.exec_create(container_id, list(argv), user=user)["Id"]
    return exec_id, api.exec_start(exec_id)


def tar_files(files: Mapping[str, bytes], uid: int, gid: int) -> bytes:
    """An uncompressed tar of ``files`` (absolute path -> content), mode 0644, owned by
    ``uid:gid``."""
    bio = io.BytesIO()
    with tarfile.open(fileobj=bio, mode="w", format=tarfile.PAX_FORMAT) as tar:
        now = time.time()
        for name, data in files.items():
            info = tarfile.TarInfo(name.lstrip("/"))
            info.size, info.mode, info.mtime, info.uid, info.gid = len(data), 0o644, now, uid, gid
            tar.addfile(info, io.BytesIO(data))
    return bio.getvalue()
