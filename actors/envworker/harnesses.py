"""Loading the harness an environment worker runs, by import path."""

from __future__ import annotations

import importlib
from typing import Any

import msgspec

from fleetrl.harness.protocol import Harness

__all__ = ["load_harness"]


def load_harness(path: str, config: dict[str, Any]) -> Harness:
    """The harness named by ``module:attr``: an object with ``run`` is used as is (then
    ``config`` must be empty); a msgspec Struct class is built from ``config`` (checked);
    any other callable is called with ``config`` as keyword arguments."""
    mod_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"harness {path!r} cannot be loaded: {exc}") from exc
    if not isinstance(obj, type) and hasattr(obj, "run"):
        if config:
            raise ValueError(f"harness {path!r} is an object; harness_config must be empty")
        harness = obj
    elif isinstance(obj, type) and issubclass(obj, msgspec.Struct):
        unknown = sorted(set(config) - set(obj.__struct_fields__))
        if unknown:  # checked here: a harness struct need not forbid unknown fields itself
            raise ValueError(f"harness_config for {path}: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(obj.__struct_fields__)})")
        try:
            harness = msgspec.convert(config, obj)
        except msgspec.ValidationError as exc:
            raise ValueError(f"harness_config for {path}: {exc}") from exc
    elif callable(obj):
        try:
            harness = obj(**config)
        except TypeError as exc:
            raise ValueError(f"harness_config for {path}: {exc}") from exc
    else:
        raise ValueError(f"harness {path!r} is neither a harness nor a factory")
    if not isinstance(harness, Harness):
        raise ValueError(f"harness {path!r} gives a {type(harness).__name__}, which has no async run()")
    return harness
