"""fleetrl.daemon: the runtime kernel every other part of fleetrl runs inside.

Modules: `supervisor` (actors under one Trio nursery tree, restarts, shutdown
contract), `actor` (`ActorContext`, what an actor sees), `config` (TOML -> frozen
structs), `control` (HTTP control plane), `checkpoint`, `state` (the state
directory), `logs`, `metrics`, `restart` (pure backoff arithmetic), `cli` (the
``fleetrl`` command), `ticker` (the heartbeat actor), and the wire protocol in
`protocol` / `messages` / `tokens` / `errors` (`examples` builds typical messages). The
kernel imports nothing else of fleetrl.

The names below are loaded lazily, so importing one small module (say
``fleetrl.daemon.errors``) does not pull in the HTTP server.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ActorContext": "actor",
    "ActorSpec": "config",
    "Config": "config",
    "ConfigError": "faults",
    "DaemonError": "faults",
    "ExitCode": "faults",
    "StateDir": "state",
    "Supervisor": "supervisor",
    "load_config": "config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fleetrl.daemon' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
