"""The GRPO policy loss with off-policy corrections.

Per generated position ``t`` of sequence ``b`` (refs/corrections.md), with ``A`` the
sequence advantage, ``a`` the sampled token, ``S`` the sampler's reported support,
``q^S``/``p^S`` the sampler's/trainer's distributions renormalised over ``S``:

    l = -sg(A) * [ sg(w_a) * log p^S_a  -  sum_{v in S} sg(q^S_v * w_v) * (log p^S_v - sg(log p^S_v)) ]

* ``w = f(rho)``, ``rho = p^S / q^S`` (computed in log space, no gradient), ``f`` chosen
  by ``CorrectionConfig.weighting`` (truncated IS, Yao et al. 2025; two-sided band,
  IcePop / Ring-1T arXiv 2510.18855); positions whose ``w_a`` is masked, and whole
  sequences rejected by the geometric-mean mask, contribute nothing and are left out
  of the normaliser (the normaliser pitfall fixed in slime PR 657).
* Support replay: ``log p^S_v = z_v - logsumexp(z over S)`` over the ids the sampler
  reported (vLLM ``--return-sampling-mask``; DeepSeek-V3.2 "keep sampling mask").
* Score centering (Marek and Ryabinin, arXiv 2609.20807): subtracts the exact expected
  weighted score under ``q^S``, a finite sum over the reported support.

Where this departs from the papers, on purpose:

* The centering term enters as ``log p - sg(log p)``: its *value* is exactly zero and its
  gradient is the one in the paper. So the loss value is the uncentred surrogate and
  at ``rho == 1`` every variant has the same value as plain GRPO (invariant 1).
* A position whose sampled token is masked drops out entirely, centering term
  included, so masked tokens carry exactly zero gradient. The centred estimator is then
  mean-zero conditional on the position being kept; the residual is
  ``(1 - q^S(band)) * mu_w``, small when the band rarely rejects.
* No PPO ratio clipping and no KL penalty: fleetrl takes one optimiser step per batch,
  so ``p`` is the behaviour-corrected current policy, not an old-policy copy.
* The logits must already be divided by the sampling temperature.

Micro-batches and data-parallel ranks: with ``reduction="sum"`` the loss is the
*numerator* of the normalised mean, ``sum_{kept (b,t)} l_bt`` for token normalisation or
``sum_b mean_t l_bt`` over sequences with a kept token for sequence normalisation, and the
denominator is in the metrics (``tokens_counted`` or ``sequences_counted``). Both are sums
over rows, so for any split of the rows into parts (a sequence never split)
``sum(numerators) / sum(denominators)`` is the mean over the whole batch, in value and in
gradient. The other metrics come with the sums and counts they are means of
(``tokens_in_loss``, ``tokens_masked``, ``sequences_in_loss``, ``sequences_masked``,
``log_ratio_sum``, ``weight_sum``, ``centering_norm_sum``), so they combine exactly too.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from .config import CorrectionConfig
from .errors import BadLossInput
from .support import _check_support_ids, _support_logsumexp, _upcast
from .weights import kept_tokens, log_weights, sequence_keep

Reduction = Literal["mean", "sum"]

__all__ = ["policy_loss", "centering_gradient_logits"]


def _first(bad: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in bad.nonzero()[0].tolist())


def _tolerance(dtype: torch.dtype) -> float:
    """How far reported log-probs may stray from normalised (rounding in the sampler)."""
    return 5e-3 if dtype in (torch.float32, torch.float64) else 5e-2


def _validate(
    logits: Tensor,
    tokens: Tensor,
    sampler_logprobs: Tensor,
    support_ids: Tensor | None,
    support_logprobs: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    config: CorrectionConfig,
) -> None:
    if not isinstance(config, CorrectionConfig):
        raise BadLossInput(f"config must be a fleetrl.grpo.CorrectionConfig, got {type(config).__name__}")
    if not isinstance(logits, Tensor) or logits.dim() != 3 or not logits.is_floating_point():
        raise BadLossInput(f"logits must be a floating [B, T, V] tensor, got {getattr(logits, 'shape', logits)!r}")
    B, T, V = logits.shape
    if tokens.shape != (B, T) or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise BadLossInput(f"tokens must be an integer [B, T] = {(B, T)} tensor, got {tuple(tokens.shape)} {tokens.dtype}")
    if loss_mask.shape != (B, T):
        raise BadLossInput(f"loss_mask must be [B, T] = {(B, T)}, got {tuple(loss_mask.shape)}")
    if loss_mask.dtype != torch.bool:
        raise BadLossInput(f"loss_mask must be a bool tensor, got {loss_mask.dtype}")
    if sampler_logprobs.shape != (B, T) or not sampler_logprobs.is_floating_point():
        raise BadLossInput(
            f"sampler_logprobs must be a floating [B, T] = {(B, T)} tensor, got "
            f"{tuple(sampler_logprobs.shape)} {sampler_logprobs.dtype}"
        )
    if advantages.shape != (B,) or not advantages.is_floating_point():
        raise BadLossInput(f"advantages must be a floating [B] = ({B},) tensor, got {tuple(advantages.shape)} {advantages.dtype}")
    if not torch.isfinite(advantages).all():
        raise BadLossInput(f"advantages must be finite; sequence {_first(~torch.isfinite(advantages))[0]} is not")
    m = loss_mask
    tok_bad = m & ((tokens < 0) | (tokens >= V))
    if tok_bad.any():
        b, t = _first(tok_bad)
        raise BadLossInput(f"tokens[{b}, {t}] = {int(tokens[b, t])} is not a token id in [0, {V})")
    tol = _tolerance(sampler_logprobs.dtype)
    slp_bad = m & ~(torch.isfinite(sampler_logprobs) & (sampler_logprobs <= tol))
    if slp_bad.any():
        b, t = _first(slp_bad)
        raise BadLossInput(
            f"sampler_logprobs[{b}, {t}] = {float(sampler_logprobs[b, t])} is not a finite log-probability (<= 0)"
        )
    if config.centering and support_logprobs is None:
        raise BadLossInput(
            "config.centering=True needs support_logprobs (log q^S of each support member); "
            "pass them or set centering=False"
        )
    if support_ids is not None:
        _check_support_ids(support_ids, B, T, V)
        valid = support_ids >= 0
        ids_sorted = support_ids.sort(-1).values
        dup = m & ((ids_sorted[..., 1:] == ids_sorted[..., :-1]) & (ids_sorted[..., 1:] >= 0)).any(-1)
        if dup.any():
            b, t = _first(dup)
            raise BadLossInput(f"support_ids[{b}, {t}] lists a token id twice: {support_ids[b, t].tolist()}")
        missing = m & ~((support_ids == tokens.unsqueeze(-1)) & valid).any(-1)
        if missing.any():
            b, t = _first(missing)
            raise BadLossInput(
                f"sampled token tokens[{b}, {t}] = {int(tokens[b, t])} is not in its reported support "
                f"support_ids[{b}, {t}]; the sampler must report the set it drew from"
            )
        expected = tuple(support_ids.shape)
    else:
        valid = None
        expected = (B, T, V)
    if support_logprobs is not None:
        if tuple(support_logprobs.shape) != expected or not support_logprobs.is_floating_point():
            what = "support_ids" if support_ids is not None else "[B, T, V] (no support_ids: the full vocabulary)"
            raise BadLossInput(
                f"support_logprobs must be floating with the shape of {what} = {expected}, got "
                f"{tuple(support_logprobs.shape)} {support_logprobs.dtype}"
            )
        member = m.unsqueeze(-1) if valid is None else (m.unsqueeze(-1) & valid)
        nonfinite = member & (torch.isnan(support_logprobs) | torch.isposinf(support_logprobs))
        if nonfinite.any():
            b, t, k = _first(nonfinite)
            raise BadLossInput(
                f"support_logprobs[{b}, {t}, {k}] = {float(support_logprobs[b, t, k])} is not a log-probability"
            )
        slq = support_logprobs.detach()
        if valid is not None:
            slq = slq.masked_fill(~valid, -math.inf)
        lse = torch.logsumexp(_upcast(slq), dim=-1).double()
        tol = _tolerance(support_logprobs.dtype)
        unnorm = m & ((lse.abs() > tol) | torch.isnan(lse))
        if unnorm.any():
            b, t = _first(unnorm)
            raise BadLossInput(
                f"support_logprobs[{b}, {t}] sum to probability {math.exp(float(lse[b, t])):.6f}, not 1: they must be "
                "log q^S, renormalised over the support"
            )
        if support_ids is not None:
            match = (support_ids == tokens.unsqueeze(-1)) & valid
            at_a = torch.where(match, support_logprobs.double(), torch.zeros((), dtype=torch.float64)).sum(-1)
        else:
            at_a = support_logprobs.detach().gather(-1, tokens.clamp(0, V - 1).long().unsqueeze(-1)).squeeze(-1).double()
        off = m & ((at_a - sampler_logprobs.double()).abs() > tol)
        if off.any():
            b, t = _first(off)
            raise BadLossInput(
                f"sampler_logprobs[{b}, {t}] = {float(sampler_logprobs[b, t])} disagrees with the support's "
                f"log-prob of the sampled token, {float(at_a[b, t])}"
            )


def centering_gradient_logits(c_BTK: Tensor, logp_BTK: Tensor) -> Tensor:
    """Gradient of ``sum_v c_v log p^S_v`` w.r.t. the support logits: ``c - (sum c) p^S``.

    Used for the ``centering_norm`` metric and by tests (closed form of refs/corrections.md).
    ``c`` must be zero and ``logp`` may be anything finite on padding.
    """
    p = logp_BTK.exp()
    return c_BTK - c_BTK.sum(-1, keepdim=True) * p


def policy_loss(
    logits: Tensor,
    tokens: Tensor,
    sampler_logprobs: Tensor,
    support_ids: Tensor | None,
    support_logprobs: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    config: CorrectionConfig,
    *,
    reduction: Reduction = "mean",
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss (to minimise) with IS weights, masks, support replay and centering.

    logits [B,T,V] float (requires grad; already divided by the sampling temperature,
    position t predicts tokens[t]); tokens [B,T] long; sampler_logprobs [B,T] = log q^S
    of the sampled token; support_ids [B,T,K] long, -1 padding, or None for the full
    vocabulary; support_logprobs [B,T,K] log q^S of each member (-inf padding), or
    [B,T,V] when support_ids is None, or None (then centering must be off);
    advantages [B]; loss_mask [B,T] bool; config a :class:`CorrectionConfig`.

    Returns ``(loss, metrics)``: a scalar tensor and a flat dict of floats
    (log_ratio_mean/min/max over loss-mask tokens, frac_masked_tokens,
    frac_masked_sequences, mismatch_kl_k3, centering_norm, weight_mean,
    tokens_counted, sequences_counted, loss, and the sums and counts behind the means:
    tokens_in_loss, tokens_masked, sequences_in_loss, sequences_masked, log_ratio_sum,
    weight_sum, centering_norm_sum). Raises :class:`BadLossInput` on tensors
    that break this contract at loss-mask positions; positions outside the loss mask
    may hold anything (padding).

    ``reduction="mean"`` (default) returns the normalised loss; ``"sum"`` returns its
    numerator, whose normaliser is ``metrics["tokens_counted"]`` (token normalisation) or
    ``metrics["sequences_counted"]`` (sequence normalisation); ``metrics["loss"]`` is then
    the sum too. Summing numerators and normalisers over any row split of a batch and
    dividing gives the whole batch's mean (module docstring).
    """
    if reduction not in ("mean", "sum"):
        raise BadLossInput(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    _validate(logits, tokens, sampler_logprobs, support_ids, support_logprobs, advantages, loss_mask, config)
    B, T, V = logits.shape
    m = loss_mask
    cd = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tok = torch.where(m, tokens.long(), torch.zeros((), dtype=torch.long, device=tokens.device))

    # --- replay: log p^S of the sampled token and (for centering) of each member
    if support_ids is not None:
        valid = (support_ids >= 0) & m.unsqueeze(-1)
        # rows with nothing valid (outside the loss mask) get a dummy member so that
        # logsumexp stays finite and no NaN reaches the gradient
        empty = ~valid.any(-1, keepdim=True)
        first = torch.zeros_like(valid)
        first[..., 0] = True
        valid = valid | (empty & first)
        ids = torch.where(valid, support_ids.long().clamp(min=0), torch.zeros((), dtype=torch.long, device=tokens.device))
        # where the sampled token sits in its support (validated at loss positions);
        # one gather from [B,T,V] only, so backward scatters into a single dense grad
        a_idx = ((ids == tok.unsqueeze(-1)) & valid).to(torch.uint8).argmax(-1, keepdim=True)
        zS = _upcast(logits.gather(-1, ids)).to(cd)
        lpS = zS - _support_logsumexp(zS, valid)  # finite everywhere, meaningful where valid
        lp_a = lpS.gather(-1, a_idx).squeeze(-1)
    else:
        lpS = torch.log_softmax(_upcast(logits).to(cd), dim=-1)
        lp_a = lpS.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        valid = None

    # --- importance weights of the sampled tokens (log space, no gradient)
    zero = torch.zeros((), dtype=cd, device=logits.device)
    lq_a = torch.where(m, sampler_logprobs.detach().to(cd), zero)
    log_ratio = torch.where(m, lp_a.detach() - lq_a, zero)
    logw_a = log_weights(log_ratio, config)
    keep_seq = sequence_keep(log_ratio, m, config)
    keep = kept_tokens(log_ratio, m, config)
    w_a = torch.where(keep, logw_a.exp(), zero)
    term = w_a * lp_a

    # --- score centering: exact expected weighted score under q^S
    centering_norm_sum = 0.0
    if config.centering:
        assert support_logprobs is not None  # _validate guarantees it
        member = keep.unsqueeze(-1) if valid is None else (valid & keep.unsqueeze(-1))
        with torch.no_grad():
            lq = support_logprobs.detach().to(cd)
            log_c = log_weights(lpS.detach() - lq, config)  # log w_v
            log_c += lq  # log (q^S_v w_v); -inf / NaN off the members are masked next
            # a zero-probability member (log q = -inf) under an uncapped weight gives
            # -inf + inf = NaN: its c is 0
            c = log_c.masked_fill_(~member, -math.inf).nan_to_num_(nan=-math.inf, posinf=math.inf).exp_()
        centred = (c * lpS).sum(-1)
        # value exactly zero, gradient sum_v c_v grad log p^S_v (see module docstring)
        term = term - (centred - centred.detach())
        centering_norm_sum = _centering_norm_sum(c, lpS.detach().masked_fill(~member, -math.inf), keep)

    A = advantages.detach().to(cd).unsqueeze(-1)
    per_tok = torch.where(keep, -A * term, zero)
    n_b = keep.sum(-1)
    if config.normalization == "token":
        loss = per_tok.sum()
        if reduction == "mean":
            loss = loss / n_b.sum().clamp(min=1)
    else:
        has = n_b > 0
        seq = per_tok.sum(-1) / n_b.clamp(min=1)
        loss = seq.sum()
        if reduction == "mean":
            loss = loss / has.sum().clamp(min=1)

    metrics = _metrics(log_ratio, m, keep, keep_seq, w_a, centering_norm_sum, loss)
    return loss, metrics


@torch.no_grad()
def _centering_norm_sum(c: Tensor, logp: Tensor, keep: Tensor) -> float:
    """Sum over kept positions of ||c - (sum c) p^S||_2, the centering gradient per unit A."""
    if not bool(keep.any()):
        return 0.0
    c_k, logp_k = c[keep], logp[keep]
    return float(centering_gradient_logits(c_k, logp_k).norm(dim=-1).sum())


@torch.no_grad()
def _metrics(
    log_ratio: Tensor, m: Tensor, keep: Tensor, keep_seq: Tensor, w_a: Tensor, centering_norm_sum: float,
    loss: Tensor
) -> dict[str, float]:
    n_loss = int(m.sum())
    lr = log_ratio[m].double()
    seqs = m.any(-1)
    n_seq = int(seqs.sum())
    n_keep = int(keep.sum())
    n_tok_masked = int((m & ~keep).sum())
    n_seq_masked = int((seqs & ~keep_seq).sum())
    weight_sum = float(w_a[keep].double().sum()) if n_keep else 0.0
    return {
        "log_ratio_mean": float(lr.mean()) if n_loss else 0.0,
        "log_ratio_min": float(lr.min()) if n_loss else 0.0,
        "log_ratio_max": float(lr.max()) if n_loss else 0.0,
        "frac_masked_tokens": n_tok_masked / n_loss if n_loss else 0.0,
        "frac_masked_sequences": n_seq_masked / n_seq if n_seq else 0.0,
        # k3 estimator of KL(q || p) from samples of q (Schulman, "Approximating KL divergence")
        "mismatch_kl_k3": float((lr.exp() - 1 - lr).mean()) if n_loss else 0.0,
        "centering_norm": centering_norm_sum / n_keep if n_keep else 0.0,
        "weight_mean": weight_sum / n_keep if n_keep else 0.0,
        "tokens_counted": float(n_keep),
        "sequences_counted": float(int(keep.any(-1).sum())),
        "loss": float(loss.detach()),
        # the sums and counts behind the means, to combine micro-batches and ranks exactly
        "tokens_in_loss": float(n_loss),
        "tokens_masked": float(n_tok_masked),
        "sequences_in_loss": float(n_seq),
        "sequences_masked": float(n_seq_masked),
        "log_ratio_sum": float(lr.sum()) if n_loss else 0.0,
        "weight_sum": weight_sum,
        "centering_norm_sum": centering_norm_sum,
    }
