"""A small TOML writer for config dicts (the inverse of `tomllib.loads` on what configs hold).

Supports tables, arrays of tables, inline arrays and inline tables, strings, booleans,
integers and floats (``inf``/``nan`` included). Anything else (dates, bytes, None) is a
`TypeError` naming the key path, since TOML cannot say it. Pure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["dumps"]

_BARE = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _str(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _key(k: object, path: Sequence[str]) -> str:
    if not isinstance(k, str):
        raise TypeError(f"TOML keys are strings; {'.'.join(path) or '<root>'} has key {k!r}")
    return k if _BARE.fullmatch(k) else _str(k)


def _dotted(path: Sequence[str]) -> str:
    return ".".join(_key(k, path[:i]) for i, k in enumerate(path))


def _float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    r = repr(x)
    return r if any(c in r for c in ".en") else r + ".0"


def _value(v: Any, path: Sequence[str]) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _float(v)
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, Mapping):
        inner = ", ".join(f"{_key(k, path)} = {_value(x, [*path, k])}" for k, x in v.items())
        return "{ " + inner + " }" if inner else "{}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x, [*path, str(i)]) for i, x in enumerate(v)) + "]"
    raise TypeError(f"{'.'.join(path)}: TOML cannot hold a {type(v).__name__} ({v!r})")


def _is_aot(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(x, Mapping) for x in v)


def _table(t: Mapping[str, Any], path: list[str], lines: list[str]) -> None:
    subs = [(k, v) for k, v in t.items() if isinstance(v, Mapping)]
    aots = [(k, v) for k, v in t.items() if _is_aot(v)]
    for k, v in t.items():
        if not isinstance(v, Mapping) and not _is_aot(v):
            lines.append(f"{_key(k, path)} = {_value(v, [*path, k])}")
    for k, v in subs:
        lines += ["", f"[{_dotted([*path, k])}]"]
        _table(v, [*path, k], lines)
    for k, items in aots:
        for item in items:
            lines += ["", f"[[{_dotted([*path, k])}]]"]
            _table(item, [*path, k], lines)


def dumps(doc: Mapping[str, Any]) -> str:
    """TOML text for ``doc`` (``tomllib.loads(dumps(doc)) == doc`` for NaN-free docs)."""
    lines: list[str] = []
    _table(doc, [], lines)
    while lines and lines[0] == "":
        lines.pop(0)
    return "\n".join(lines) + "\n"
