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

The record is bounded by design (docs/reference/corrections.md, "Supports at real
vocabularies"): a sampler draws from at most `DEFAULT_MAX_SUPPORT` tokens unless its
configuration says otherwise, and lists them, so a generated token costs about 8 bytes
per listed member (int32 id, float32 log-prob) whatever the vocabulary. A support has
one of two rules (`SupportRule`), the same for every position of one model call:

* ``"listed"``: the listed members *are* the support the token was drawn from, with
  their log q^S renormalised over it (replay and centering are exact);
* ``"vocabulary"``: the token was drawn from the whole vocabulary (a call asking for no
  truncation on a sampler configured to allow it); the listing holds the most likely
  members of q with their log q over the whole vocabulary (not renormalised), and
  ``tail_mass`` the mass of q outside them, per position. The sampled token need not be
  listed; its log q is in the record's ``logprobs`` as always.

Token ids are int32 or int64 (samplers send int32: every vocabulary fits); log-probabilities
float32 or float64; CSR offsets int64; weight versions int32 or int64.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

import numpy as np

from .protocol import Record, Tensor

__all__ = [
    "DEFAULT_MAX_SUPPORT",
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "SupportCSR",
    "SupportRule",
    "check_sampled_tokens",
    "check_token_arrays",
    "vector_length",
]

INT_DTYPES = ("int32", "int64")
FLOAT_DTYPES = ("float32", "float64")

DEFAULT_MAX_SUPPORT = 512
"""The most tokens a sampler draws one token from (and lists), unless configured
otherwise: 4 KB of listing per generated token at any vocabulary. Chosen by measurement
(docs/results/support-cap.md): the record's bytes grow linearly with it, and 512 is the cap
prime-rl uses for the same purpose."""

SupportRule = Literal["listed", "vocabulary"]
"""What a record's support listing means (module docstring)."""


def vector_length(t: Tensor, name: str, dtypes: tuple[str, ...]) -> int:
    """Length of ``t``, which must be 1-d of one of ``dtypes``; else ValueError."""
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(dtypes)}, got {t.dtype}")
    if len(t.shape) != 1:
        raise ValueError(f"{name} must be 1-d, got shape {list(t.shape)}")
    return t.shape[0]


class SupportCSR(Record):
    """Per-position sampling support in CSR form.

    Position ``i`` lists ``ids[offsets[i]:offsets[i+1]]`` with their log-probabilities
    in the same slice of ``logprobs``; ``offsets`` (int64) has one entry per position
    plus one, starts at 0, never decreases and ends at ``len(ids)``. ``rule`` says what
    the listing is (module docstring):

    * ``"listed"`` (the default): the support itself, with log q^S renormalised over it;
      every position lists at least one member (``offsets`` strictly increase) and
      ``tail_mass`` is None.
    * ``"vocabulary"``: the most likely members of q over the whole vocabulary, with
      their log q (not renormalised); a position may list none; ``tail_mass`` (float32
      or float64, one per position, each in [0, 1]) is the mass of q outside the listing.
    """

    ids: Tensor
    logprobs: Tensor
    offsets: Tensor
    rule: SupportRule = "listed"
    tail_mass: Tensor | None = None

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
        if self.rule == "listed":
            if n_off > 1 and not (off[1:] > off[:-1]).all():
                at = int(np.argmax(off[1:] <= off[:-1]))
                raise ValueError(
                    f"support.offsets must strictly increase (empty support at position {at})"
                )
            if self.tail_mass is not None:
                raise ValueError("support.tail_mass is for rule 'vocabulary'; a listed support has no tail")
        elif self.rule == "vocabulary":
            if n_off > 1 and not (off[1:] >= off[:-1]).all():
                at = int(np.argmax(off[1:] < off[:-1]))
                raise ValueError(f"support.offsets must not decrease (at position {at})")
            if self.tail_mass is None:
                raise ValueError("support.tail_mass is required with rule 'vocabulary' (one per position)")
            n_tail = vector_length(self.tail_mass, "support.tail_mass", FLOAT_DTYPES)
            if n_tail != n_off - 1:
                raise ValueError(f"support.tail_mass has {n_tail} entries but the support covers "
                                 f"{n_off - 1} positions")
            tail = self.tail_mass.to_numpy()
            bad = ~((tail >= 0.0) & (tail <= 1.0))
            if bad.any():
                at = int(np.argmax(bad))
                raise ValueError(f"support.tail_mass[{at}] = {float(tail[at])} is not a probability mass in [0, 1]")
        else:
            raise ValueError(f"support.rule must be 'listed' or 'vocabulary', got {self.rule!r}")

    @property
    def positions(self) -> int:
        """Number of positions covered."""
        return self.offsets.shape[0] - 1

    @property
    def whole_vocabulary(self) -> bool:
        """Whether the tokens were drawn from the whole vocabulary (rule ``"vocabulary"``)."""
        return self.rule == "vocabulary"

    @classmethod
    def from_padded(cls, ids_NK: np.ndarray, logprobs_NK: np.ndarray, *, rule: SupportRule = "listed",
                    tail_mass: np.ndarray | None = None) -> SupportCSR:
        """From the padded form of ``fleetrl.grpo.sampler_support`` (ids padded with -1).
        Ids travel as int32 (every vocabulary fits), log-probs in their float dtype
        (float32 for anything else); ``tail_mass`` (rule ``"vocabulary"``) per row."""
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
        ids = ids_NK[keep]
        if ids.size and int(ids.max()) >= 2**31:
            raise ValueError(f"support id {int(ids.max())} does not fit int32")
        lps = logprobs_NK[keep]
        lps = lps.astype(lps.dtype if lps.dtype.name in FLOAT_DTYPES else np.float32)
        tail = None
        if tail_mass is not None:
            tail = np.asarray(tail_mass)
            tail = Tensor.from_numpy(tail.astype(tail.dtype if tail.dtype.name in FLOAT_DTYPES else np.float32))
        return cls(
            ids=Tensor.from_numpy(ids.astype(np.int32)),
            logprobs=Tensor.from_numpy(lps),
            offsets=Tensor.from_numpy(offsets),
            rule=rule,
            tail_mass=tail,
        )

    def padded(self) -> tuple[np.ndarray, np.ndarray]:
        """The listing as padded arrays ``(ids_NK, logprobs_NK)``: int64 ids padded with
        -1, float32 log-probs padded with -inf, ``K`` the longest listing (at least 1).
        The layout of ``fleetrl.grpo`` (add a batch dimension)."""
        n = self.positions
        off = self.offsets.to_numpy()
        sizes = np.diff(off)
        k = max(int(sizes.max()), 1) if n else 1
        ids = np.full((n, k), -1, dtype=np.int64)
        lps = np.full((n, k), -np.inf, dtype=np.float32)
        if n:
            row = np.repeat(np.arange(n), sizes)
            col = np.arange(int(off[-1])) - np.repeat(off[:-1], sizes)
            ids[row, col] = self.ids.to_numpy()
            lps[row, col] = self.logprobs.to_numpy()
        return ids, lps

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and log-probs of position ``i``'s listing."""
        off = self.offsets.to_numpy()
        lo, hi = int(off[i]), int(off[i + 1])
        return self.ids.to_numpy()[lo:hi], self.logprobs.to_numpy()[lo:hi]

    def to_json(self) -> dict[str, Any]:
        """A compact JSON form (for files such as ATIF): each array as base64 of its
        little-endian bytes (ids int32, log-probs float32, offsets int64, tail mass
        float32), 10.7 characters a listed member instead of ~28 as JSON numbers.
        `from_json` reads it back (log-probs rounded to float32)."""
        out: dict[str, Any] = {"rule": self.rule, "encoding": _JSON_ENCODING,
                               "ids": _b64(self.ids.to_numpy(), "<i4"),
                               "logprobs": _b64(self.logprobs.to_numpy(), "<f4"),
                               "offsets": _b64(self.offsets.to_numpy(), "<i8")}
        if self.tail_mass is not None:
            out["tail_mass"] = _b64(self.tail_mass.to_numpy(), "<f4")
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = "support") -> SupportCSR:
        """The support of `to_json`'s form; ValueError naming ``where`` and the field."""
        if not isinstance(obj, dict) or obj.get("encoding") != _JSON_ENCODING:
            raise ValueError(f"{where}: not a support in the encoding {_JSON_ENCODING!r}")
        rule = obj.get("rule", "listed")
        arrays = {}
        for key, dtype in (("ids", "<i4"), ("logprobs", "<f4"), ("offsets", "<i8"), ("tail_mass", "<f4")):
            if key not in obj:
                continue
            try:
                raw = base64.b64decode(obj[key], validate=True)
                arrays[key] = np.frombuffer(raw, dtype=dtype).astype(dtype[1:])
            except (TypeError, ValueError, binascii.Error) as exc:
                raise ValueError(f"{where}.{key}: not base64 of {dtype[1:]} values ({exc})") from None
        for key in ("ids", "logprobs", "offsets"):
            if key not in arrays:
                raise ValueError(f"{where}: {key} is missing")
        tail = arrays.get("tail_mass")
        try:
            return cls(ids=Tensor.from_numpy(arrays["ids"].astype(np.int32)),
                       logprobs=Tensor.from_numpy(arrays["logprobs"].astype(np.float32)),
                       offsets=Tensor.from_numpy(arrays["offsets"].astype(np.int64)), rule=rule,
                       tail_mass=None if tail is None else Tensor.from_numpy(tail.astype(np.float32)))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def head(self, n: int) -> SupportCSR:
        """The support of the first ``n`` positions (same rule)."""
        off = self.offsets.to_numpy()
        end = int(off[n])
        tail = None if self.tail_mass is None else Tensor.from_numpy(self.tail_mass.to_numpy()[:n])
        return SupportCSR(ids=Tensor.from_numpy(self.ids.to_numpy()[:end]),
                          logprobs=Tensor.from_numpy(self.logprobs.to_numpy()[:end]),
                          offsets=Tensor.from_numpy(off[: n + 1].astype(np.int64)), rule=self.rule, tail_mass=tail)


_JSON_ENCODING = "base64 little-endian: ids int32, logprobs float32, offsets int64, tail_mass float32"


def _b64(values: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode("ascii")


def check_token_arrays(token_ids: Tensor, logprobs: Tensor, support: SupportCSR, versions: Tensor) -> None:
    """The per-token arrays of one model call agree: 1-d, of the allowed dtypes, one
    entry per generated token, one support per token, and every sampled token's log-prob
    is finite (a NaN or an infinity is refused where the record enters, never filled).
    Else ValueError naming the array (and the token)."""
    n = vector_length(token_ids, "token_ids", INT_DTYPES)
    for name, t, dtypes in (("logprobs", logprobs, FLOAT_DTYPES), ("versions", versions, INT_DTYPES)):
        got = vector_length(t, name, dtypes)
        if got != n:
            raise ValueError(f"{name} has {got} entries but token_ids has {n}")
    if support.positions != n:
        raise ValueError(f"support covers {support.positions} positions but token_ids has {n}")
    lps = logprobs.to_numpy()
    bad = ~np.isfinite(lps)
    if bad.any():  # never filled in or passed on: a missing log-prob would bias every ratio it touches
        t = int(np.argmax(bad))
        raise ValueError(f"logprobs[{t}] = {float(lps[t])} is not a finite log-probability (token {t} of {n}: "
                         "the sampler's log q of a sampled token is finite)")


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

    Within ``tol``: every listed log-prob is finite and <= ``tol``; with rule
    ``"listed"`` each sampled token appears exactly once in its own support and its
    log-prob equals the support's log-prob of it; with rule ``"vocabulary"`` it appears
    at most once (with the same log-prob when it does), and its log-prob is finite and
    <= ``tol`` (a token outside the listing also has at most the tail's mass). With
    ``normalised``, each listed support's probabilities sum to one, and each vocabulary
    listing's plus its tail mass do (``|log sum| <= tol``); with ``versions``, versions
    never decrease along the sequence. The arrays must already agree in length
    (`check_token_arrays`).

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
    vocabulary = support.whole_vocabulary
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
    count = np.zeros(n, dtype=np.int64)
    np.add.at(count, np.repeat(np.arange(n), sizes), hit)
    wrong = (count > 1) if vocabulary else (count != 1)
    if wrong.any():
        t = int(np.argmax(wrong))
        what = "is not in" if count[t] == 0 else "appears more than once in"
        raise ValueError(f"generated token {t} (id {int(tokens[t])}) {what} its reported support")
    if vocabulary:
        tail = _values(support.tail_mass, np.float64)  # type: ignore[arg-type]  # required by the rule
        unlisted = count == 0
        too_big = ~np.isfinite(lps) | (lps > tol) | (unlisted & (np.exp(lps) > tail + tol))
        if too_big.any():
            t = int(np.argmax(too_big))
            raise ValueError(f"logprobs[{t}] = {lps[t]} is not the log-probability of a token drawn from "
                             f"the vocabulary (tail mass outside the listing {tail[t]:.6g})")
    if normalised:
        mass = np.zeros(n, dtype=np.float64)
        np.add.at(mass, np.repeat(np.arange(n), sizes), np.exp(slps))
        if vocabulary:
            mass = mass + tail
        off_one = np.abs(np.log(mass)) > tol
        if off_one.any():
            t = int(np.argmax(off_one))
            if vocabulary:
                raise ValueError(f"the listing of token {t} and its tail have probability {mass[t]:.6f}, not 1 "
                                 "(log q over the vocabulary, plus the mass outside the listing)")
            raise ValueError(f"the support of token {t} has probability {mass[t]:.6f}, not 1 "
                             "(log q^S must be renormalised over the support)")
    listed = count == 1
    at_token = np.zeros(n, dtype=np.float64)
    at_token[listed] = slps[hit]
    differs = listed & ~(np.abs(at_token - lps) <= tol)  # NaN differs too
    if differs.any():
        t = int(np.argmax(differs))
        raise ValueError(f"logprobs[{t}] = {lps[t]} disagrees with its support's log-prob "
                         f"{at_token[t]} of the same token (it differs by more than {tol})")
