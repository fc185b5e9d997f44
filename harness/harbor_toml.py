"""A Harbor task's ``task.toml``: read into `HarborConfig`, written back as TOML text.

Only what fleetrl maps is read (docs/guides/harbor.md); other keys and sections are
ignored, as Harbor ignores keys it does not know. Both spellings of the schema
version (``version``, ``schema_version``) and of memory (``memory_mb``, the older
``memory = "2G"``) are read. Every problem is a `TaskError` naming the file and the
dotted key. Pure: text in, values out.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import tomllib
from collections.abc import Mapping
from typing import Any

import msgspec

from .errors import TaskError
from .task_schema import MetadataValue

__all__ = ["HarborConfig", "flatten_metadata", "parse_task_toml", "toml_key", "toml_value"]


class HarborConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What fleetrl reads of ``task.toml`` (None: the file does not say)."""

    name: str | None = None
    """``[task].name`` (schema 1.1)."""
    metadata: dict[str, Any] = {}
    """``[metadata]`` as written (nested tables and lists kept)."""
    agent_timeout_s: float | None = None
    verifier_timeout_s: float | None = None
    verifier_env: dict[str, str] = {}
    verifier_user: str | None = None
    build_timeout_s: float | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    docker_image: str | None = None
    """``[environment].docker_image``: a prebuilt image instead of environment/Dockerfile."""


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def _table(doc: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise TaskError(f"must be a table, got {type(value).__name__}", where=where, field=key)
    return value


def _positive(table: Mapping[str, Any], section: str, key: str, where: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise TaskError(f"must be a number > 0, got {value!r}", where=where, field=f"{section}.{key}")
    return float(value)


def _memory_mb(env: Mapping[str, Any], where: str) -> int | None:
    if "memory_mb" in env:
        value = env["memory_mb"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 1:
            raise TaskError(f"must be a number >= 1, got {value!r}", where=where, field="environment.memory_mb")
        return int(math.ceil(value))
    if "memory" in env:  # the older spelling: "2G", "512M"
        value = env["memory"]
        match = _SIZE.match(value) if isinstance(value, str) else None
        if match is None:
            raise TaskError(f"must be a size like '2G' or '512M', got {value!r}", where=where,
                            field="environment.memory")
        mult = {"": 1 / (1 << 20), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1 << 20}[match[2].lower()]
        mb = int(math.ceil(float(match[1]) * mult))
        if mb < 1:
            raise TaskError(f"must be at least 1 MB, got {value!r}", where=where, field="environment.memory")
        return mb
    return None


def parse_task_toml(text: str, *, where: str) -> HarborConfig:
    """Read ``task.toml`` text (`where`: its path, for errors)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise TaskError(f"invalid TOML: {err}", where=where) from None
    task = _table(doc, "task", where)
    metadata = _table(doc, "metadata", where)
    agent = _table(doc, "agent", where)
    verifier = _table(doc, "verifier", where)
    env = _table(doc, "environment", where)
    name = task.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TaskError(f"must be a non-empty string, got {name!r}", where=where, field="task.name")
    venv = verifier.get("env", {})
    if not isinstance(venv, dict):
        raise TaskError("must be a table of NAME = value", where=where, field="verifier.env")
    env_out: dict[str, str] = {}
    for key, value in venv.items():
        if not _ENV_NAME.match(key):
            raise TaskError(f"{key!r} is not a shell variable name", where=where, field="verifier.env")
        if isinstance(value, bool):
            value = "true" if value else "false"
        if not isinstance(value, str | int | float):
            raise TaskError(f"{key}: must be a string or number, got {type(value).__name__}", where=where,
                            field="verifier.env")
        env_out[key] = str(value)
    user = verifier.get("user")
    if user is not None and not isinstance(user, str | int):
        raise TaskError(f"must be a user name or id, got {user!r}", where=where, field="verifier.user")
    docker_image = env.get("docker_image")
    if docker_image is not None and (not isinstance(docker_image, str) or not docker_image.strip()):
        raise TaskError(f"must be a non-empty string, got {docker_image!r}", where=where,
                        field="environment.docker_image")
    cpus = _positive(env, "environment", "cpus", where)
    return HarborConfig(
        name=name,
        metadata=dict(metadata),
        agent_timeout_s=_positive(agent, "agent", "timeout_sec", where),
        verifier_timeout_s=_positive(verifier, "verifier", "timeout_sec", where),
        verifier_env=env_out,
        verifier_user=None if user is None else str(user),
        build_timeout_s=_positive(env, "environment", "build_timeout_sec", where),
        cpus=cpus,
        memory_mb=_memory_mb(env, where),
        docker_image=docker_image,
    )


def flatten_metadata(metadata: Mapping[str, Any], prefix: str = "") -> dict[str, MetadataValue]:
    """Harbor's ``[metadata]`` as fleetrl metadata (string -> scalar): scalars are kept,
    nested tables flattened with dotted keys (``author.name``), lists and dates written
    as JSON text (``tags = ["a", "b"]`` -> ``'["a", "b"]'``)."""
    out: dict[str, MetadataValue] = {}
    for key, value in metadata.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_metadata(value, prefix=f"{full}."))
        elif isinstance(value, str | int | float | bool):
            out[full] = value if not (isinstance(value, float) and not math.isfinite(value)) else str(value)
        else:
            out[full] = json.dumps(value, default=_json_default, ensure_ascii=False)
    return out


def _json_default(value: object) -> object:
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, float):
        return str(value)
    raise TypeError(type(value).__name__)


# --------------------------------------------------------------------------- writing

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_key(key: str) -> str:
    """A TOML key: bare when it can be, else a basic string."""
    return key if _BARE_KEY.match(key) else toml_value(key)


def toml_value(value: str | int | float | bool) -> str:
    """A TOML scalar. Strings are basic strings (JSON escapes, plus DEL, which TOML
    does not allow raw)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise ValueError(f"integer {value} does not fit TOML's 64 bits")
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite number")
        text = repr(value)
        return text if any(c in text for c in ".en") else text + ".0"
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
