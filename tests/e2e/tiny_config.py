"""Derive a test config from configs/tiny.toml: its paths moved under a state directory,
some keys overridden (TOML literals), the rest exactly as shipped. `edit_toml` is the
edit itself, for any config text (bench/real_size.py derives configs/gpu.toml with it)."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.toml"


def derive(state_dir: Path, overrides: Mapping[str, Mapping[str, str | None]], text: str | None = None) -> str:
    """``overrides``: section name (as in its ``[header]``) -> key -> TOML literal, or None
    to remove the key. A key that the section lacks is added under its header. The
    result is checked to parse."""
    text = TINY.read_text() if text is None else text
    text = text.replace('state_dir = ".fleetrl"', f'state_dir = "{state_dir}"').replace('".fleetrl/', f'"{state_dir}/')
    return edit_toml(text, overrides, name=TINY.name)


def edit_toml(text: str, overrides: Mapping[str, Mapping[str, str | None]], *, drop: Sequence[str] = (),
              samplers: str | None = None, name: str = "the config") -> str:
    """``text`` with keys overridden (section name -> key -> TOML literal, None removes the
    key; a missing key is added under its header), whole sections dropped (``drop``: their
    names), and the ``[[actors.pool.config.samplers]]`` tables replaced by ``samplers``.
    Checked to parse; KeyError names a section ``name`` lacks."""
    if samplers is not None:
        start, end = text.index("[[actors.pool.config.samplers]]"), text.index("[actors.env]")
        text = text[:start] + samplers + "\n" + text[end:]
    lines = text.splitlines()

    def bounds(section: str) -> tuple[int, int]:
        header = f"[{section}]"
        start = next((i for i, line in enumerate(lines) if line.strip() == header), None)
        if start is None:
            raise KeyError(f"{name} has no section {header}")
        end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
        return start, end

    for section in drop:
        start, end = bounds(section)
        del lines[start:end]
    for section, keys in overrides.items():
        start, end = bounds(section)
        for key, value in keys.items():
            pat = re.compile(rf"^{re.escape(key)}\s*=")
            at = next((i for i in range(start + 1, end) if pat.match(lines[i])), None)
            if value is None:
                if at is not None:
                    del lines[at]
                    end -= 1
            elif at is None:
                lines.insert(start + 1, f"{key} = {value}")
                end += 1
            else:
                lines[at] = f"{key} = {value}"
    out = "\n".join(lines) + "\n"
    tomllib.loads(out)
    return out
