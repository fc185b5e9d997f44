"""Per-token arrays on the wire: the support CSR and the checks of a token record.

A model call's record (`messages.Generation`, `messages.TokenSegment`) holds, per
generated token, its id, the sampler's log q^S of it, the support it could have chosen
(`SupportCSR`) and the weight version that produced it. Two kinds of checks apply:

* `check_token_arrays`: the arrays agree (dtypes, 1-d, equal lengths, one support per
  token). Structural, so every record runs it when built or decoded.
* `check_sampled_tokens`: the numbers describe a sample (each token once in its own
  support with the same log-prob, support log-probs finite and <= 0, optionally a
  normalised support and non-decreasing versions), within a tolerance. Samplers run it
  tightly on what they produce; the trainer runs it loosely on what it admits.

Token ids are int32 or int64; log-probabilities float32 or float64; CSR offsets int64;
weight versions int32 or int64.
"""

from __future__ import annotations

import numpy as np

from .protocol import Record, Tensor

__all__ = [
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "SupportCSR",
    "check_sampled_tokens",
    "check_token_arrays",
    "vector_length",
]

INT_DTYPES = ("int32", "int64")
FLOAT_DTYPES = ("float32", "float64")


def vector_length(t: Tensor, name: str, dtypes: tuple[str, ...]) -> int:
    """Length of ``t``, which must be 1-d of one of ``dtypes``; else ValueError."""
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(dtypes)}, got {t.dtype}")
    if len(t.shape) != 1:
        raise ValueError(f"{name} must be 1-d, got shape {list(t.shape)}")
    return t.shape[0]


class SupportCSR(Record):
    """Per-position sampling support in CSR form.

    Position ``i`` could have sampled any of ``ids[offsets[i]:offsets[i+1]]``, whose
    log-probabilities under the sampler's truncated, renormalised distribution (log
    q^S) are the same slice of ``logprobs``. ``offsets`` (int64) has one entry per
    position plus one, starts at 0, strictly increases (a support is never empty)
    and ends at ``len(ids)``.
    """

    ids: Tensor
    logprobs: Tensor
    offsets: Tensor

    def __post_init__(self) -> None:
        n_ids = vector_length(self.ids, "support.ids", INT_DTYPES)
        n_lp = vector_length(self.logprobs, "support.logprobs", FLOAT_DTYPES)
        if n_lp != n_ids:
            raise ValueError(f"support.logprobs has {n_lp} entries but support.ids has {n_ids}")
        n_off = vector_length(self.offsets, "support.offsets", ("int64",))
        if n_off < 1:
            raise ValueError("support.offsets must have at least one entry (0)")
        off = self.offsets.to_numpy()
        if off[0] != 0:
            raise ValueError(f"support.offsets must start at 0, got {int(off[0])}")
        if off[-1] != n_ids:
            raise ValueError(
                f"support.offsets ends at {int(off[-1])} but support.ids has {n_ids} entries"
            )
        if n_off > 1 and not (off[1:] > off[:-1]).all():
            at = int(np.argmax(off[1:] <= off[:-1]))
            raise ValueError(
                f"support.offsets must strictly increase (empty support at position {at})"
            )

    @property
    def positions(self) -> int:
        """Number of positions covered."""
        return self.offsets.shape[0] - 1

    @classmethod
    def from_padded(cls, ids_NK: np.ndarray, logprobs_NK: np.ndarray) -> SupportCSR:
        """From the padded form of ``fleetrl.grpo.sampler_support`` (ids padded with -1)."""
        ids_NK = np.asarray(ids_NK)
        logprobs_NK = np.asarray(logprobs_NK)
        if ids_NK.shape != logprobs_NK.shape or ids_NK.ndim != 2:
            raise ValueError(
                f"ids and logprobs must be N x K of one shape, got {ids_NK.shape} and "
                f"{logprobs_NK.shape}"
            )
        keep = ids_NK >= 0
        counts = keep.sum(axis=1)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ids = ids_NK[keep].astype(np.int64 if ids_NK.dtype == np.int64 else np.int32)
        lps = logprobs_NK[keep]
        lps = lps.astype(lps.dtype if lps.dtype.name in FLOAT_DTYPES else np.float32)
        return cls(
            ids=Tensor.from_numpy(ids),
            logprobs=Tensor.from_numpy(lps),
            offsets=Tensor.from_numpy(offsets),
        )

    def padded(self) -> tuple[np.ndarray, np.ndarray]:
        """The support as padded arrays ``(ids_NK, logprobs_NK)``: int64 ids padded with
        -1, float32 log-probs padded with -inf, ``K`` the largest support (1 when there
        are no positions). The layout of ``fleetrl.grpo`` (add a batch dimension)."""
        n = self.positions
        off = self.offsets.to_numpy()
        sizes = np.diff(off)
        k = int(sizes.max()) if n else 1
        ids = np.full((n, k), -1, dtype=np.int64)
        lps = np.full((n, k), -np.inf, dtype=np.float32)
        if n:
            row = np.repeat(np.arange(n), sizes)
            col = np.arange(int(off[-1])) - np.repeat(off[:-1], sizes)
            ids[row, col] = self.ids.to_numpy()
            lps[row, col] = self.logprobs.to_numpy()
        return ids, lps

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and log-probs of position ``i``'s support."""
        off = self.offsets.to_numpy()
        lo, hi = int(off[i]), int(off[i + 1])
        return self.ids.to_numpy()[lo:hi], self.logprobs.to_numpy()[lo:hi]


def check_token_arrays(token_ids: Tensor, logprobs: Tensor, support: SupportCSR, versions: Tensor) -> None:
    """The per-token arrays of one model call agree: 1-d, of the allowed dtypes, one
    entry per generated token, one support per token. Else ValueError naming the array."""
    n = vector_length(token_ids, "token_ids", INT_DTYPES)
    for name, t, dtypes in (("logprobs", logprobs, FLOAT_DTYPES), ("versions", versions, INT_DTYPES)):
        got = vector_length(t, name, dtypes)
        if got != n:
            raise ValueError(f"{name} has {got} entries but token_ids has {n}")
    if support.positions != n:
        raise ValueError(f"support covers {support.positions} positions but token_ids has {n}")


def _values(x: Tensor | np.ndarray, dtype: type) -> np.ndarray:
    return (x.to_numpy() if isinstance(x, Tensor) else np.asarray(x)).astype(dtype)


def check_sampled_tokens(
    token_ids: Tensor | np.ndarray,
    logprobs: Tensor | np.ndarray,
    support: SupportCSR,
    *,
    tol: float,
    versions: Tensor | np.ndarray | None = None,
    normalised: bool = False,
) -> None:
    """Check that the arrays describe tokens sampled from their reported supports.

    Within ``tol``: every support log-prob is finite and <= ``tol``; each sampled token
    appears exactly once in its own support, and its log-prob equals the support's
    log-prob of it. With ``normalised``, each support's probabilities also sum to one
    (``|log sum exp| <= tol``); with ``versions``, versions never decrease along the
    sequence. The arrays must already agree in length (`check_token_arrays`).

    Raises ValueError whose message names the first bad token. Samplers check what they
    produce with a tight ``tol`` (1e-6); the trainer checks what it admits with a loose
    one (its float32 round trips).
    """
    tokens = _values(token_ids, np.int64)
    n = tokens.size
    if versions is not None and n:
        v = _values(versions, np.int64)
        down = np.diff(v) < 0
        if down.any():
            t = int(np.argmax(down)) + 1
            raise ValueError(f"versions decrease at token {t}: {v[t - 1]} -> {v[t]}")
    if n == 0:
        return
    lps = _values(logprobs, np.float64)
    off = support.offsets.to_numpy()
    sizes = np.diff(off)
    sids = _values(support.ids, np.int64)
    slps = _values(support.logprobs, np.float64)
    bad = ~np.isfinite(slps) | (slps > tol)
    if bad.any():
        k = int(np.argmax(bad))
        t = int(np.searchsorted(off, k, side="right")) - 1
        raise ValueError(f"token {t}: support.logprobs[{k}] = {slps[k]} is not a finite log-probability")
    hit = sids == np.repeat(tokens, sizes)
    count = np.add.reduceat(hit.astype(np.int64), off[:-1])
    if (count != 1).any():
        t = int(np.argmax(count != 1))
        what = "is not in" if count[t] == 0 else "appears more than once in"
        raise ValueError(f"generated token {t} (id {int(tokens[t])}) {what} its reported support")
    if normalised:
        mass = np.add.reduceat(np.exp(slps), off[:-1])
        off_one = np.abs(np.log(mass)) > tol
        if off_one.any():
            t = int(np.argmax(off_one))
            raise ValueError(f"the support of token {t} has probability {mass[t]:.6f}, not 1 "
                             "(log q^S must be renormalised over the support)")
    differs = ~(np.abs(slps[hit] - lps) <= tol)  # NaN differs too
    if differs.any():
        t = int(np.argmax(differs))
        raise ValueError(f"logprobs[{t}] = {lps[t]} disagrees with its support's log-prob "
                         f"{slps[hit][t]} of the same token (it differs by more than {tol})")
