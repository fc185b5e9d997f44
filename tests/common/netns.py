"""A network namespace joined to this host by a veth pair (``ip netns``, root only): a
process run in it (``ip netns exec NAME ...``) is on another host as far as the network
goes, reaching this one at ``host_ip`` only."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Netns", "netns"]


@dataclass(frozen=True)
class Netns:
    name: str
    host_ip: str
    """This host's address on the pair (listen here to be reachable from the namespace)."""
    ns_ip: str

    def argv(self, *command: str) -> list[str]:
        """`command` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *command]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def netns(index: int) -> Iterator[Netns]:
    """Namespace ``frl<pid>-<index>`` on 10.<200+index%50>.<pid%250>.0/30; removed on exit."""
    tag = f"{os.getpid() % 100000}{index}"
    name, host_if, ns_if = f"frl{tag}", f"vh{tag}", f"vn{tag}"
    net = f"10.{200 + index % 50}.{os.getpid() % 250}"
    ns = Netns(name=name, host_ip=f"{net}.1", ns_ip=f"{net}.2")
    _ip("netns", "add", name)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{ns.host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{ns.ns_ip}/30", "dev", ns_if)
        _ip("netns", "exec", name, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
