"""Sampling supports: what a sampler could have drawn, and its replay by the trainer.

A sampler with temperature ``T``, nucleus ``top_p`` and cap ``top_k`` draws the next
token from ``q^S(v) = q(v) / q(S)`` on a support ``S``, where ``q = softmax(z / T)``.
fleetrl makes the sampler *report* ``S`` (ids and ``log q^S`` of each member) instead of
the threshold, because the trainer's own distribution differs slightly from the
sampler's, so a nucleus recomputed by the trainer would be a different set (vLLM's
``--return-sampling-mask`` and SGLang's ``return_sampling_mask`` report it for the
same reason; DeepSeek-V3.2 calls this "keep sampling mask").

Definitions shared by every sampler backend and the trainer (docs/reference/contracts.md):

* Order: tokens by decreasing ``q``; ties are broken by the lower token id first.
* Support: the shortest prefix of that order whose mass under ``q`` reaches ``top_p``
  (so it is non-empty, contains the argmax and is minimal), then cut to at most
  ``top_k`` members. ``top_p == 1`` with no ``top_k`` is the whole vocabulary. Tokens
  whose logit is ``-inf`` (probability exactly zero) are never in a support.
* ``temperature == 0`` is greedy: the support is ``{argmax}`` with ``log q^S = 0``.
* Whole vocabulary (`vocabulary_listing`, `sample_from_vocabulary`): a sampler that
  draws from all of ``q`` (no truncation) reports its ``k`` most likely members (same
  order) with ``log q`` over the vocabulary and the mass ``q`` puts outside them.

Cost at a real vocabulary: with a cap ``top_k`` smaller than the vocabulary only the
``top_k`` most likely tokens are ever ordered (``torch.topk`` plus an exact tie rule at
the cut), never the whole row: at V = 151,936 that is what keeps a decode step's support
cheap (docs/results/support-cap.md).

Departure from Hugging Face / vLLM: those apply ``top_k`` first and then take the
nucleus of the *renormalised* top-k distribution; here the nucleus is taken under the
full ``q`` and then capped at ``top_k``. The two agree whenever ``top_k`` does not bind
or ``top_p == 1``. Because the support is reported, the trainer never depends on which
rule a sampler used.

Padding convention: ids ``-1`` and log-probs ``-inf``, on the right of each row.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import BadLossInput

__all__ = ["replay_logprobs", "sample_from_support", "sample_from_vocabulary", "sampler_support",
           "vocabulary_listing"]


def _check_sampling_params(temperature: float, top_p: float, top_k: int | None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise BadLossInput(f"temperature must be a number, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise BadLossInput(f"temperature must be finite and >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise BadLossInput(f"top_p must be a number, got {top_p!r}")
    if not (0.0 < top_p <= 1.0):
        raise BadLossInput(f"top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise BadLossInput(f"top_k must be an int or None, got {top_k!r}")
        if top_k < 1:
            raise BadLossInput(f"top_k must be >= 1 (use None for no cap), got {top_k!r}")


def sampler_support(
    logits_NV: Tensor, *, temperature: float, top_p: float, top_k: int | None
) -> tuple[Tensor, Tensor]:
    """The support of each row of ``logits_NV`` and its renormalised log-probs.

    Returns ``(ids_NK, logprobs_NK)``: ids (long) most likely first, ties lower id
    first, padded with ``-1``; ``log q^S`` of each member (``-inf`` on padding).
    ``K`` is the largest support size in the batch, never more than ``top_k``.
    The threshold is decided in float64 so that the nucleus is exactly minimal for
    the distribution it reports; log-probs come back as float64 for float64 input
    and float32 otherwise. Works on any device; no gradient flows.
    """
    _check_sampling_params(temperature, top_p, top_k)
    if logits_NV.dim() != 2:
        raise BadLossInput(f"logits_NV must be 2-D [N, V], got shape {tuple(logits_NV.shape)}")
    if not logits_NV.is_floating_point():
        raise BadLossInput(f"logits_NV must be floating point, got {logits_NV.dtype}")
    N, V = logits_NV.shape
    out_dtype = torch.float64 if logits_NV.dtype == torch.float64 else torch.float32
    device = logits_NV.device
    if N == 0:
        return (
            torch.empty(0, 1, dtype=torch.long, device=device),
            torch.empty(0, 1, dtype=out_dtype, device=device),
        )
    z = logits_NV.detach()
    n_finite = _finite_per_row(z)

    if temperature == 0:
        ids = z.argmax(-1, keepdim=True)  # first maximum = lowest id among ties
        return ids, torch.zeros(N, 1, dtype=out_dtype, device=device)

    if top_k is not None and top_k < V:
        # Ordering by the raw logits is ordering by q (exact in float64 for any float
        # dtype, and dividing by T > 0 keeps it): only the top_k are ever sorted, and the
        # vocabulary is read in float64 only for the nucleus mass (top_p < 1).
        vals, order = _most_likely(z, top_k)
        x_sorted = vals.to(torch.float64) / temperature  # log q up to the row's normaliser
        lse = torch.logsumexp(z.to(torch.float64) / temperature, -1, keepdim=True) if top_p < 1.0 else None
    else:
        lq = torch.log_softmax(z.to(torch.float64) / temperature, dim=-1)
        x_sorted, order = torch.sort(lq, dim=-1, descending=True, stable=True)
        lse = torch.zeros((N, 1), dtype=torch.float64, device=device)
    if top_p >= 1.0:
        size = n_finite
    else:
        cum = (x_sorted - lse).exp().cumsum(-1)
        # shortest prefix with mass >= top_p: one more than the count of prefixes below it
        size = torch.minimum((cum < top_p).sum(-1) + 1, n_finite)
    if top_k is not None:
        size = size.clamp(max=top_k)
    K = int(size.max())
    keep = torch.arange(K, device=device) < size[:, None]
    ids = torch.where(keep, order[:, :K], torch.full_like(order[:, :K], -1))
    kept = x_sorted[:, :K].masked_fill(~keep, -math.inf)
    logprobs = kept - torch.logsumexp(kept, dim=-1, keepdim=True)
    return ids, logprobs.to(out_dtype)


def _finite_per_row(z: Tensor) -> Tensor:
    """Finite logits per row; BadLossInput for a NaN or +inf, or a row with none."""
    finite = torch.isfinite(z)
    if not bool(finite.all()):
        bad = torch.isnan(z) | torch.isposinf(z)
        if bad.any():
            raise BadLossInput(f"logits_NV row {int(bad.any(-1).nonzero()[0, 0])} contains NaN or +inf")
    n_finite = finite.sum(-1)
    if (n_finite == 0).any():
        raise BadLossInput(f"logits_NV row {int((n_finite == 0).nonzero()[0, 0])} has no finite logit: "
                           "nothing can be sampled")
    return n_finite


def _most_likely(x_NV: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest entries of each row and their ids, in the support order
    (decreasing value, ties by lower id), without sorting the whole row.

    ``torch.topk`` picks an arbitrary subset of the values tied at the cut; a row whose
    cut splits a tie takes the tied ids lowest first instead, so the result equals the
    first ``k`` of a stable descending sort of the row."""
    vals, ids = torch.topk(x_NV, k, dim=-1, sorted=False)
    kth = vals.min(-1, keepdim=True).values
    split = (x_NV == kth).sum(-1) != (vals == kth).sum(-1)
    if bool(split.any()):
        rows = split.nonzero().squeeze(1)
        x = x_NV[rows]
        above, tied = x > kth[rows], x == kth[rows]
        chosen = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
        ids[rows] = chosen.nonzero()[:, 1].reshape(rows.numel(), k)  # ascending ids per row
        vals[rows] = x.gather(-1, ids[rows])
    ids, by_id = ids.sort(-1)
    vals = vals.gather(-1, by_id)
    vals, pos = torch.sort(vals, dim=-1, descending=True, stable=True)
    return vals, ids.gather(-1, pos)


def _check_logits(logits_NV: Tensor) -> None:
    if logits_NV.dim() != 2:
        raise BadLossInput(f"logits_NV must be 2-D [N, V], got shape {tuple(logits_NV.shape)}")
    if not logits_NV.is_floating_point():
        raise BadLossInput(f"logits_NV must be floating point, got {logits_NV.dtype}")
    _finite_per_row(logits_NV)


def _check_positive_temperature(temperature: float) -> None:
    _check_sampling_params(temperature, 1.0, None)
    if temperature == 0:
        raise BadLossInput("temperature 0 is greedy: its support is the argmax, not the whole vocabulary")


def vocabulary_listing(logits_NV: Tensor, *, temperature: float, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """What a sampler drawing from the whole vocabulary reports of each row of ``logits_NV``.

    Returns ``(ids_NK, logq_NK, tail_N)``: the ``k`` most likely tokens of
    ``q = softmax(z / temperature)`` (fewer where fewer have a finite logit; support
    order, ``-1`` / ``-inf`` padding), their ``log q`` over the whole vocabulary (not
    renormalised), and ``tail_N = 1 - sum of their q``, the mass outside the listing
    (float64, clamped at 0). Log-probs are float64 for float64 input, float32 otherwise.
    """
    _check_positive_temperature(temperature)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise BadLossInput(f"k must be an int >= 1, got {k!r}")
    _check_logits(logits_NV)
    N, V = logits_NV.shape
    out_dtype = torch.float64 if logits_NV.dtype == torch.float64 else torch.float32
    z = logits_NV.detach()
    lse = torch.logsumexp(z.to(torch.float64) / temperature, -1, keepdim=True)
    k = min(k, V)
    raw, ids = _most_likely(z, k) if k < V else torch.sort(z, dim=-1, descending=True, stable=True)
    vals = raw.to(torch.float64) / temperature - lse
    finite = torch.isfinite(vals)
    ids = torch.where(finite, ids, torch.full_like(ids, -1))
    tail = (1.0 - vals.exp().sum(-1)).clamp(min=0.0)
    return ids, vals.to(out_dtype), tail


def sample_from_vocabulary(logits_NV: Tensor, *, temperature: float,
                           generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Draw one token per row from ``q = softmax(z / temperature)`` over the whole
    vocabulary. Returns ``(token_ids [N], their log q [N])`` (float64 for float64 input,
    float32 otherwise)."""
    _check_positive_temperature(temperature)
    _check_logits(logits_NV)
    out_dtype = torch.float64 if logits_NV.dtype == torch.float64 else torch.float32
    if logits_NV.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=logits_NV.device), torch.empty(0, dtype=out_dtype)
    lq = torch.log_softmax(logits_NV.detach().to(torch.float64) / temperature, dim=-1)
    pick = torch.multinomial(lq.exp(), 1, generator=generator)
    return pick.squeeze(1), lq.gather(1, pick).squeeze(1).to(out_dtype)


def sample_from_support(
    ids_NK: Tensor, logprobs_NK: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Draw one token per row from the support distribution ``q^S``.

    Returns ``(token_ids [N], their log q^S [N])``. Padding (-1 / -inf) is never drawn.
    ``generator`` makes the draw reproducible (it must live on the tensors' device).
    """
    if ids_NK.dim() != 2 or ids_NK.shape != logprobs_NK.shape:
        raise BadLossInput(
            f"ids_NK and logprobs_NK must be 2-D with the same shape, got "
            f"{tuple(ids_NK.shape)} and {tuple(logprobs_NK.shape)}"
        )
    if ids_NK.shape[0] == 0:
        return ids_NK.new_empty(0), logprobs_NK.new_empty(0)
    valid = ids_NK >= 0
    if not valid.any(-1).all():
        row = int((~valid.any(-1)).nonzero()[0, 0])
        raise BadLossInput(f"support row {row} is empty (all padding)")
    lp = logprobs_NK.detach().to(torch.float64).masked_fill(~valid, -math.inf)
    probs = torch.softmax(lp, dim=-1)  # renormalises away rounding in the reported log-probs
    pick = torch.multinomial(probs, 1, generator=generator)
    return ids_NK.gather(1, pick).squeeze(1), logprobs_NK.gather(1, pick).squeeze(1)


def _support_logsumexp(zS: Tensor, valid: Tensor) -> Tensor:
    """logsumexp over the valid members of each support (last dim), keepdim."""
    return torch.logsumexp(zS.masked_fill(~valid, -math.inf), dim=-1, keepdim=True)


def replay_logprobs(
    logits_BTV: Tensor, tokens_BT: Tensor, support_ids_BTK: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Trainer log-probs renormalised over the sampler's reported support.

    ``log p^S(v) = z_v - logsumexp(z over S)`` for ``v`` in ``S``. Returns
    ``(logp_BT, logp_BTK)``: ``log p^S`` of the sampled token and of each support
    member (``-inf`` on padding). With ``support_ids_BTK=None`` the support is the whole
    vocabulary, ``logp_BT`` is the ordinary ``log_softmax`` gather and the second value
    is ``None``. Differentiable w.r.t. ``logits_BTV``; never materialises a
    ``[B, T, V]`` tensor when a support is given (only ``[B, T, K]`` gathers).

    The logits must already be divided by the sampling temperature. Positions whose
    support is all padding get ``-inf`` log-probs (nothing to replay); a sampled token
    that is not in its support gets ``z_a - logsumexp(z over S)``, which is not a
    log-probability — :func:`fleetrl.grpo.policy_loss` rejects that at counted positions.
    """
    if logits_BTV.dim() != 3:
        raise BadLossInput(f"logits must be [B, T, V], got shape {tuple(logits_BTV.shape)}")
    B, T, V = logits_BTV.shape
    if tokens_BT.shape != (B, T):
        raise BadLossInput(f"tokens must be [B, T] = {(B, T)}, got {tuple(tokens_BT.shape)}")
    if tokens_BT.numel() and (tokens_BT.min() < 0 or tokens_BT.max() >= V):
        raise BadLossInput(f"tokens must be token ids in [0, {V}), found {int(tokens_BT.min())}..{int(tokens_BT.max())}")
    tok = tokens_BT.long().unsqueeze(-1)
    if support_ids_BTK is None:
        lp = torch.log_softmax(_upcast(logits_BTV), dim=-1)
        return lp.gather(-1, tok).squeeze(-1), None
    _check_support_ids(support_ids_BTK, B, T, V)
    valid = support_ids_BTK >= 0
    zS, za = _gather_support(logits_BTV, tok, support_ids_BTK, valid)
    lse = _support_logsumexp(zS, valid)
    logp_BTK = (zS - lse).masked_fill(~valid, -math.inf)
    return (za - lse).squeeze(-1), logp_BTK


def _upcast(x: Tensor) -> Tensor:
    """Half-precision logits are upcast to float32 before softmax-type reductions."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _gather_support(
    logits_BTV: Tensor, tok_BT1: Tensor, support_ids_BTK: Tensor, valid_BTK: Tensor
) -> tuple[Tensor, Tensor]:
    """Gather the support logits [B,T,K] and the sampled token's logit [B,T,1]."""
    safe_ids = support_ids_BTK.long().clamp(min=0)
    zS = _upcast(logits_BTV.gather(-1, safe_ids))
    za = _upcast(logits_BTV.gather(-1, tok_BT1))
    return zS, za


def _check_support_ids(support_ids_BTK: Tensor, B: int, T: int, V: int) -> None:
    if support_ids_BTK.dim() != 3 or support_ids_BTK.shape[:2] != (B, T):
        raise BadLossInput(
            f"support_ids must be [B, T, K] with B, T = {(B, T)}, got {tuple(support_ids_BTK.shape)}"
        )
    if support_ids_BTK.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise BadLossInput(f"support_ids must be an integer tensor, got {support_ids_BTK.dtype}")
    if support_ids_BTK.numel() and (support_ids_BTK.min() < -1 or support_ids_BTK.max() >= V):
        bad = ((support_ids_BTK < -1) | (support_ids_BTK >= V)).nonzero()[0].tolist()
        raise BadLossInput(
            f"support_ids must be token ids in [0, {V}) or -1 padding; "
            f"found {int(support_ids_BTK[tuple(bad)])} at (b, t, k) = {tuple(bad)}"
        )
