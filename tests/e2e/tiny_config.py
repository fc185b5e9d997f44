"""Derive a test config from configs/tiny.toml: its paths moved under a state directory,
some keys overridden (TOML literals), the rest exactly as shipped."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.toml"


def derive(state_dir: Path, overrides: Mapping[str, Mapping[str, str | None]], text: str | None = None) -> str:
    """``overrides``: section name (as in its ``[header]``) -> key -> TOML literal, or None
    to remove the key. A key that the section lacks is added under its header. The
    result is checked to parse."""
    text = TINY.read_text() if text is None else text
    text = text.replace('state_dir = ".fleetrl"', f'state_dir = "{state_dir}"').replace('".fleetrl/', f'"{state_dir}/')
    lines = text.splitlines()
    for section, keys in overrides.items():
        header = f"[{section}]"
        try:
            start = next(i for i, line in enumerate(lines) if line.strip() == header)
        except StopIteration:
            raise KeyError(f"{TINY.name} has no section {header}") from None
        end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
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
