"""Errors raised by fleetrl.grpo.

One root type, :class:`BadLossInput`, a ``ValueError`` so callers that already catch
``ValueError`` keep working. It is raised when a caller hands the math tensors that
break its contract (wrong shapes, ids outside the vocabulary, a sampled token missing
from its reported support, non-finite log-probs at counted positions, ...). The
message names the argument and, where it helps, the first offending position.
"""

from __future__ import annotations

__all__ = ["BadLossInput"]


class BadLossInput(ValueError):
    """A tensor or option passed to fleetrl.grpo breaks the documented contract."""
