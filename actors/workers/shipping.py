"""Shipping a harness to remote environment workers, signed (pure: no I/O).

The daemon sends the harness its worker actor names (``harness = "module:attr"``) in one
of two forms (`HarnessShipped`):

* ``import``: the import path and its ``harness_config`` (JSON); the worker loads it with
  its own copy of that module (fleetrl's own harnesses, or a package the user installed
  on every worker host). ``harness = "external"`` always travels this way: its config
  is the command (`ExternalCommand`), run on the worker host.
* ``pickle``: the harness object itself as cloudpickle bytes, with the user's module
  pickled by value, so a harness written in the user's own code runs on hosts that do not
  have that code. Modules the harness merely imports (numpy, ...) still travel by
  reference and must be installed on the worker.

Either form carries an HMAC-SHA256 under a key the worker received in its `WorkerWelcome`
on the same connection. A worker verifies it before looking at the payload, and unpickles
only when the connection is TLS: unpickling runs code, so the bytes must come from the
daemon the worker verified, unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import json
import secrets
import sys
from typing import Any, Literal

import msgspec

from fleetrl.actors.envworker.config import EXTERNAL
from fleetrl.actors.envworker.harnesses import load_harness
from fleetrl.daemon.worker_messages import HarnessShipped
from fleetrl.harness.external import ExternalCommand
from fleetrl.harness.protocol import Harness

from .errors import UnsafeHarness

__all__ = ["ShipMode", "UnsafeHarness", "new_key", "open_harness", "ship_harness", "sign"]

ShipMode = Literal["auto", "import", "pickle"]

_OWN = "fleetrl"


def new_key() -> bytes:
    """A fresh signing key (32 random bytes) for one worker connection."""
    return secrets.token_bytes(32)


def sign(key: bytes, kind: str, ref: str, payload: bytes) -> bytes:
    """HMAC-SHA256 of the three fields, each length-prefixed by its msgpack framing."""
    return hmac.new(key, msgspec.msgpack.encode((kind, ref, payload)), hashlib.sha256).digest()


def _own(module: str) -> bool:
    return module == _OWN or module.startswith(_OWN + ".")


def ship_harness(path: str, config: dict[str, Any], key: bytes, *, mode: ShipMode = "auto") -> HarnessShipped:
    """The harness at ``path`` (with ``config``, as `load_harness` takes them) as a signed
    message. ``auto``: by import path when the module is fleetrl's own, else pickled."""
    module = path.partition(":")[0]
    kind = ("import" if _own(module) or path == EXTERNAL else "pickle") if mode == "auto" else mode
    if path == EXTERNAL and kind != "import":
        raise ValueError('harness = "external" is a command, not code: it travels by its argv (ship_harness = "auto")')
    if kind == "import":
        payload = json.dumps(config, sort_keys=True).encode()
    else:
        payload = _pickled(load_harness(path, config), module)
    return HarnessShipped(kind=kind, ref=path, payload=payload, mac=sign(key, kind, path, payload))


def _pickled(harness: Harness, module: str) -> bytes:
    """cloudpickle bytes of `harness`, the user's modules (the path's and the class's,
    unless fleetrl's own) pickled by value."""
    import cloudpickle

    by_value = []
    for name in dict.fromkeys((module, type(harness).__module__)):
        mod = sys.modules.get(name) or importlib.import_module(name)
        if _own(name) or name == "builtins":
            continue
        if name == type(harness).__module__ and isinstance(harness, msgspec.Struct):
            raise ValueError(f"harness {type(harness).__qualname__} (module {name}) is a msgspec Struct, whose class "
                             "cannot travel by value: make it a plain class, or install its module on every "
                             'worker host and set ship_harness = "import"')
        try:
            cloudpickle.register_pickle_by_value(mod)
        except ValueError:  # registered already (by the user, or by an earlier shipment)
            continue
        by_value.append(mod)
    try:
        return cloudpickle.dumps(harness)
    finally:
        for mod in by_value:
            cloudpickle.unregister_pickle_by_value(mod)


def open_harness(msg: HarnessShipped, key: bytes, *, secure: bool) -> Harness | ExternalCommand:
    """The harness in `msg`, after checking its signature under `key`; a pickled one only
    when ``secure`` (the connection is TLS). ``harness = "external"`` gives its
    `ExternalCommand` (the worker runs it against an endpoint of its own). Raises
    `UnsafeHarness` when it may not be loaded, ValueError when it cannot be."""
    if not msg.mac:
        raise UnsafeHarness(f"harness {msg.ref!r} arrived unsigned: refused")
    if not hmac.compare_digest(msg.mac, sign(key, msg.kind, msg.ref, msg.payload)):
        raise UnsafeHarness(f"harness {msg.ref!r}: the signature does not match this connection's key: refused")
    if msg.kind == "import":
        try:
            config = json.loads(msg.payload)
        except ValueError as exc:
            raise ValueError(f"harness {msg.ref!r}: its config is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"harness {msg.ref!r}: its config must be a JSON object")
        if msg.ref == EXTERNAL:
            try:
                return msgspec.convert(config, ExternalCommand)
            except msgspec.ValidationError as exc:
                raise ValueError(f"the external harness's command: {exc}") from None
        return load_harness(msg.ref, config)
    if not secure:
        raise UnsafeHarness(f"harness {msg.ref!r} is pickled and this connection is not TLS: refused "
                            "(unpickling runs code; join over wss://)")
    import cloudpickle

    obj = cloudpickle.loads(msg.payload)
    if not isinstance(obj, Harness):
        raise ValueError(f"harness {msg.ref!r} unpickled to a {type(obj).__name__}, which has no async run()")
    return obj
