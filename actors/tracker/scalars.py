"""The scalars of one metrics.jsonl row, as an experiment tracker takes them (pure).

Every number keeps its name: a top-level field is logged under its own name (``loss``,
``reward_mean``), a nested one under its path joined by ``/``
(``mismatch_kl_by_sampler/torch/bfloat16``, ``staleness_hist/0``). Booleans, strings,
lists and nulls are not scalars and are left out; ``step`` is the tracker's step, not a
scalar.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["STEP", "scalars_of"]

STEP = "step"


def scalars_of(row: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of `row` by name (see the module docstring)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if not prefix and key == STEP:
            continue
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, Mapping):
            out.update(scalars_of(value, f"{name}/"))
    return out
