"""Per-container limits: a frozen, hashable struct with safe defaults, bounds-checked.

``Limits`` is also the warm pool's key (with the image): two leases share idle
containers only when their limits are equal. ``host_config_kwargs`` turns it into the
Docker ``HostConfig`` that enforces it; the translation is pure so it can be tested
without an engine.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["Limits", "DEFAULT_LIMITS", "host_config_kwargs", "parse_size"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Resource and isolation limits of one sandbox container.

    Always on (not configurable): all capabilities dropped, no-new-privileges, no
    swap (memory+swap = memory), the exec user is ``user`` (never root).
    """

    network: Literal["none", "bridge"] = "none"
    """"none": no interface but the container's own loopback. "bridge" opens the
    network: only for trusted images."""
    memory_bytes: int = 512 * MiB
    """Memory cgroup limit (tmpfs contents count against it); the OOM killer acts inside."""
    cpus: float = 1.0
    """CPU quota in cores (CFS quota over a 100 ms period)."""
    pids: int = 256
    """Most processes/threads alive at once in the container (fork bombs stop here)."""
    nofile: int = 1024
    """RLIMIT_NOFILE: open files per process."""
    fsize_bytes: int = 256 * MiB
    """RLIMIT_FSIZE: largest file a process may write."""
    workdir: str = "/work"
    """Writable work dir (a tmpfs owned by ``user``); wiped on reset."""
    work_bytes: int = 256 * MiB
    """Size of the work dir tmpfs."""
    tmp_bytes: int = 64 * MiB
    """Size of the /tmp tmpfs."""
    read_only_root: bool = True
    """Root filesystem mounted read-only (only workdir and /tmp are writable)."""
    user: str = "1000:1000"
    """uid:gid every exec runs as; must not be root."""
    timeout_s: float = 30.0
    """Default wall-clock limit per exec; when it passes, every process of the
    sandbox user is killed."""
    stdout_cap: int = 1 * MiB
    """Most bytes of stdout kept per exec (the rest is read and dropped; flagged truncated)."""
    stderr_cap: int = 1 * MiB
    """Most bytes of stderr kept per exec."""
    output_limit_bytes: int = 64 * MiB
    """Most bytes of stdout+stderr an exec may write in all; beyond it every process of
    the sandbox user is killed (output has to cross the Docker daemon, which moves
    only tens of MB/s, so an output flood is stopped rather than drained)."""

    def __post_init__(self) -> None:
        def bound(name: str, value: float, lo: float, hi: float) -> None:
            if isinstance(value, bool) or not (lo <= value <= hi):
                raise ValueError(f"Limits.{name}: {value!r} is outside [{lo}, {hi}]")

        bound("memory_bytes", self.memory_bytes, 16 * MiB, 256 * GiB)
        bound("cpus", self.cpus, 0.01, 256)
        bound("pids", self.pids, 8, 1 << 22)
        bound("nofile", self.nofile, 16, 1 << 20)
        bound("fsize_bytes", self.fsize_bytes, 1 * KiB, 1 << 50)
        bound("work_bytes", self.work_bytes, 1 * MiB, 256 * GiB)
        bound("tmp_bytes", self.tmp_bytes, 1 * MiB, 256 * GiB)
        bound("timeout_s", self.timeout_s, 0.001, 86400)
        bound("stdout_cap", self.stdout_cap, 0, 1 * GiB)
        bound("stderr_cap", self.stderr_cap, 0, 1 * GiB)
        bound("output_limit_bytes", self.output_limit_bytes, max(self.stdout_cap, self.stderr_cap), 1 << 40)
        wd = self.workdir
        if not wd.startswith("/") or wd.rstrip("/") in ("", "/tmp", "/proc", "/sys", "/dev") or ".." in wd.split("/"):
            raise ValueError(f"Limits.workdir: {wd!r} must be an absolute path other than /, /tmp, /proc, /sys, /dev")
        if "," in wd or ":" in wd:
            raise ValueError(f"Limits.workdir: {wd!r} must not contain ',' or ':'")
        parts = self.user.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"Limits.user: {self.user!r} must be 'uid:gid' (numbers)")
        if int(parts[0]) == 0 or int(parts[1]) == 0:
            raise ValueError(f"Limits.user: {self.user!r} must not be root (uid/gid 0)")

    @property
    def uid(self) -> int:
        return int(self.user.split(":")[0])

    @property
    def gid(self) -> int:
        return int(self.user.split(":")[1])

    @property
    def writable_dirs(self) -> tuple[str, ...]:
        """Every place the sandbox user can write (the root is read-only): the work dir,
        /tmp, /dev/shm, /dev/mqueue. A reset wipes them all."""
        return (self.workdir, "/tmp", "/dev/shm", "/dev/mqueue")


DEFAULT_LIMITS = Limits()


def parse_size(text: str) -> int:
    """'512m', '1g', '64k', '1024' (bytes) -> bytes; raises ValueError naming the text."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "kmgt" and t[-1:] else t
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"size {text!r}: expected a number with optional k/m/g/t suffix") from None
    if value < 0:
        raise ValueError(f"size {text!r}: must not be negative")
    return int(value * mult)


def host_config_kwargs(limits: Limits) -> dict:
    """Keyword arguments for ``docker.APIClient.create_host_config`` enforcing ``limits``."""
    uid, gid = limits.uid, limits.gid
    return dict(
        network_mode=limits.network,
        read_only=limits.read_only_root,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true"],
        pids_limit=limits.pids,
        mem_limit=limits.memory_bytes,
        memswap_limit=limits.memory_bytes,
        nano_cpus=int(limits.cpus * 1e9),
        ulimits=[
            {"Name": "nofile", "Soft": limits.nofile, "Hard": limits.nofile},
            {"Name": "fsize", "Soft": limits.fsize_bytes, "Hard": limits.fsize_bytes},
            {"Name": "core", "Soft": 0, "Hard": 0},
        ],
        tmpfs={
            "/tmp": f"rw,nosuid,nodev,size={limits.tmp_bytes},mode=1777",
            limits.workdir: f"rw,nosuid,nodev,exec,size={limits.work_bytes},uid={uid},gid={gid},mode=0755",
        },
        ipc_mode="private",
        init=False,
        auto_remove=False,
    )
