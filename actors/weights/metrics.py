"""Per-version delta metrics and the information-theoretic bound they are measured against.

The bound for a delta that changes k of n bf16 elements is

    n * H2(k / n)  +  k * H(xor)      bits,

where H2 is the binary entropy (which elements changed, as if each changed independently
with probability k/n) and H(xor) is the empirical order-0 entropy of the 16-bit XOR
patterns of the changed elements. A coder that sees each element's change flag and XOR
pattern as independent draws cannot beat it on average; our gap + XOR streams are
measured as a percentage of it ("% of bound" = bound bytes / delta bytes).
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

__all__ = ["VersionMetrics", "binary_entropy", "symbol_entropy", "entropy_bound_bytes"]


def binary_entropy(p: float) -> float:
    """H2(p) in bits."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def symbol_entropy(values: np.ndarray) -> float:
    """Empirical order-0 entropy (bits per symbol) of uint16 ``values``."""
    if values.size == 0:
        return 0.0
    counts = np.bincount(values.astype(np.uint16, copy=False), minlength=1 << 16)
    q = counts[counts > 0] / values.size
    return float(-(q * np.log2(q)).sum())


def entropy_bound_bytes(total: int, xor_values: np.ndarray) -> float:
    """Bytes of the bound above for ``xor_values`` (the non-zero XOR words) out of ``total``."""
    k = int(xor_values.size)
    if total <= 0:
        return 0.0
    return (total * binary_entropy(k / total) + k * symbol_entropy(xor_values)) / 8.0


class VersionMetrics(msgspec.Struct, frozen=True):
    """What publishing one version cost and achieved (returned by ``Publisher.publish``)."""

    version: int
    anchor: bool  # version 0 (or a reset): only an anchor, no step delta
    total_elements: int
    changed_elements: int
    changed_fraction: float
    delta_bytes: int  # the step delta from version - 1 (0 when anchor)
    ratio_vs_bf16: float  # bf16 bytes / delta bytes
    entropy_bound_bytes: float
    bound_ratio: float  # bf16 bytes / bound bytes
    pct_of_bound: float  # 100 * bound bytes / delta bytes
    encode_s: float  # diff + compress + serialize
    apply_s: float  # parse + verify + apply to the publisher's own shadow copy
    anchor_bytes: int  # size of the anchor written at this version, else 0
    publish_s: float  # everything, catch-up deltas and store writes included
