"""The GRPO policy loss with off-policy corrections.

Per generated position ``t`` of sequence ``b`` (docs/reference/corrections.md), with ``A`` the
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

Whole-vocabulary rows (``vocabulary``; docs/reference/corrections.md, "Supports at real
vocabularies"). A sampler that drew from all of ``q`` lists only its most likely members,
with ``log q`` over the vocabulary and the tail mass ``tau`` it puts elsewhere. There
``S`` is the whole vocabulary: the ratio ``rho = p(a) / q(a)`` is exact (``log p(a) = z_a -
logsumexp(z)``; the sampled token need not be listed), and centering runs over the listed
members only, which leaves out of the centering gradient (w.r.t. the logits) the terms
``sum_{v unlisted} c_v (e_v - p)``: their L1 norm is at most ``2 * sum_{v unlisted} c_v
<= 2 * W * tau`` with ``W`` the largest weight the weighting gives (and, for a weighting
whose weights never exceed ``rho``, at most ``2 * pi`` with ``pi`` the trainer's own mass
outside the listing). The metrics report ``tau`` and that bound per step.

Micro-batches and data-parallel ranks: with ``reduction="sum"`` the loss is the
*numerator* of the normalised mean, ``sum_{kept (b,t)} l_bt`` for token normalisation or
``sum_b mean_t l_bt`` over sequences with a kept token for sequence normalisation, and the
denominator is in the metrics (``tokens_counted`` or ``sequences_counted``). Both are sums
over rows, so for any split of the rows into parts (a sequence never split)
``sum(numerators) / sum(denominators)`` is the mean over the whole batch, in value and in
gradient. The other metrics come with the sums and counts they are means of
(``tokens_in_loss``, ``tokens_masked``, ``sequences_in_loss``, ``sequences_masked``,
``log_ratio_sum``, ``weight_sum``, ``centering_norm_sum``, and for whole-vocabulary rows
``vocabulary_tokens``, ``tail_mass_sum``, ``tail_mass_max``, ``centering_bound_sum``,
``centering_bound_max``), so they combine exactly too (sums add, maxima by max).

The trainer does not hand this module ``[B, T, V]`` logits: it computes, in chunks of
positions, only what the loss reads of them (`SupportLogits`: the support members'
logits, the sampled token's, the log-normaliser over the vocabulary) and calls
`policy_loss_gathered`, which is `policy_loss` after its gather.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from .config import CorrectionConfig
from .errors import BadLossInput
from .support import _check_support_ids, _support_logsumexp, _upcast
from .weights import kept_tokens, log_weights, sequence_keep

Reduction = Literal["mean", "sum"]

__all__ = ["SupportLogits", "centering_gradient_logits", "max_weight", "policy_loss", "policy_loss_gathered",
           "replay_sampled"]


def _first(bad: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in bad.nonzero()[0].tolist())


def _tolerance(dtype: torch.dtype) -> float:
    """How far reported log-probs may stray from normalised (rounding in the sampler)."""
    return 5e-3 if dtype in (torch.float32, torch.float64) else 5e-2


class SupportLogits(NamedTuple):
    """What `policy_loss` reads of the trainer's logits (already divided by the sampling
    temperature), gathered; each differentiable w.r.t. those logits.

    ``support`` [B,T,K]: the logit of each listed member (any finite value on padding);
    ``sampled`` [B,T]: the logit of the sampled token, and ``vocab_lse`` [B,T]: logsumexp
    of the logits over the whole vocabulary, both needed only on whole-vocabulary rows
    (None when there are none).
    """

    support: Tensor
    sampled: Tensor | None = None
    vocab_lse: Tensor | None = None


def max_weight(config: CorrectionConfig) -> float:
    """The largest token weight ``config.weighting`` can give (``inf`` when unbounded):
    the ``W`` of the whole-vocabulary centering bound (module docstring)."""
    w = config.weighting
    if w == "none":
        return 1.0
    if w == "tis":
        return config.tis_cap
    if w == "mask":
        return config.mask_high
    return min(config.tis_cap, config.mask_high)


def _vocabulary_rows(vocabulary: Tensor | None, B: int, T: int, device: torch.device) -> Tensor | None:
    """``vocabulary`` as a [B, T] bool tensor (it may be given per row, [B]); None if no row is."""
    if vocabulary is None:
        return None
    if not isinstance(vocabulary, Tensor) or vocabulary.dtype != torch.bool or tuple(vocabulary.shape) not in ((B,), (B, T)):
        raise BadLossInput(f"vocabulary must be a bool [B] = ({B},) or [B, T] = {(B, T)} tensor, got "
                           f"{getattr(vocabulary, 'shape', vocabulary)!r} {getattr(vocabulary, 'dtype', '')}")
    rows = vocabulary.to(device)
    rows = rows[:, None].expand(B, T) if rows.dim() == 1 else rows
    return rows if bool(rows.any()) else None


def _validate(
    shape: tuple[int, int, int],
    tokens: Tensor,
    sampler_logprobs: Tensor,
    support_ids: Tensor | None,
    support_logprobs: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    config: CorrectionConfig,
    vocab: Tensor | None,
    tail_mass: Tensor | None,
) -> None:
    if not isinstance(config, CorrectionConfig):
        raise BadLossInput(f"config must be a fleetrl.grpo.CorrectionConfig, got {type(config).__name__}")
    B, T, V = shape
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
    if vocab is not None and support_ids is None:
        raise BadLossInput("whole-vocabulary rows (vocabulary) need support_ids: the listed members of q")
    if tail_mass is not None and (tuple(tail_mass.shape) != (B, T) or not tail_mass.is_floating_point()):
        raise BadLossInput(f"tail_mass must be a floating [B, T] = {(B, T)} tensor, got {tuple(tail_mass.shape)}")
    listed = m if vocab is None else m & ~vocab
    if support_ids is not None:
        _check_support_ids(support_ids, B, T, V)
        valid = support_ids >= 0
        ids_sorted = support_ids.sort(-1).values
        dup = m & ((ids_sorted[..., 1:] == ids_sorted[..., :-1]) & (ids_sorted[..., 1:] >= 0)).any(-1)
        if dup.any():
            b, t = _first(dup)
            raise BadLossInput(f"support_ids[{b}, {t}] lists a token id twice: {support_ids[b, t].tolist()}")
        missing = listed & ~((support_ids == tokens.unsqueeze(-1)) & valid).any(-1)
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
        unnorm = listed & ((lse.abs() > tol) | torch.isnan(lse))
        if unnorm.any():
            b, t = _first(unnorm)
            raise BadLossInput(
                f"support_logprobs[{b}, {t}] sum to probability {math.exp(float(lse[b, t])):.6f}, not 1: they must be "
                "log q^S, renormalised over the support"
            )
        if vocab is not None:
            over = m & vocab & (lse > tol)
            if over.any():
                b, t = _first(over)
                raise BadLossInput(
                    f"support_logprobs[{b}, {t}] of a whole-vocabulary row sum to probability "
                    f"{math.exp(float(lse[b, t])):.6f} > 1: they must be log q over the vocabulary"
                )
        if support_ids is not None:
            match = (support_ids == tokens.unsqueeze(-1)) & valid
            at_a = torch.where(match, support_logprobs.double(), torch.zeros((), dtype=torch.float64)).sum(-1)
            checked = m & match.any(-1)
        else:
            at_a = support_logprobs.detach().gather(-1, tokens.clamp(0, V - 1).long().unsqueeze(-1)).squeeze(-1).double()
            checked = m
        off = checked & ((at_a - sampler_logprobs.double()).abs() > tol)
        if off.any():
            b, t = _first(off)
            raise BadLossInput(
                f"sampler_logprobs[{b}, {t}] = {float(sampler_logprobs[b, t])} disagrees with the support's "
                f"log-prob of the sampled token, {float(at_a[b, t])}"
            )


def _check_logits(logits: Tensor) -> tuple[int, int, int]:
    if not isinstance(logits, Tensor) or logits.dim() != 3 or not logits.is_floating_point():
        raise BadLossInput(f"logits must be a floating [B, T, V] tensor, got {getattr(logits, 'shape', logits)!r}")
    B, T, V = logits.shape
    return B, T, V


def centering_gradient_logits(c_BTK: Tensor, logp_BTK: Tensor) -> Tensor:
    """Gradient of ``sum_v c_v log p^S_v`` w.r.t. the support logits: ``c - (sum c) p^S``.

    Used for the ``centering_norm`` metric and by tests (closed form of docs/reference/corrections.md).
    ``c`` must be zero and ``logp`` may be anything finite on padding.
    """
    p = logp_BTK.exp()
    return c_BTK - c_BTK.sum(-1, keepdim=True) * p


def _safe_support(support_ids: Tensor, m: Tensor, tok: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The support's valid members (loss-mask positions only; a row with none gets its
    first slot as a dummy member, so that a logsumexp over it stays finite and no NaN
    reaches a gradient), ids safe to gather with, and where the sampled token sits."""
    valid = (support_ids >= 0) & m.unsqueeze(-1)
    empty = ~valid.any(-1, keepdim=True)
    first = torch.zeros_like(valid)
    first[..., 0] = True
    valid = valid | (empty & first)
    ids = torch.where(valid, support_ids.long().clamp(min=0), torch.zeros((), dtype=torch.long, device=tok.device))
    a_idx = ((ids == tok.unsqueeze(-1)) & valid).to(torch.uint8).argmax(-1, keepdim=True)
    return valid, ids, a_idx


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
    vocabulary: Tensor | None = None,
    tail_mass: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss (to minimise) with IS weights, masks, support replay and centering.

    logits [B,T,V] float (requires grad; already divided by the sampling temperature,
    position t predicts tokens[t]); tokens [B,T] long; sampler_logprobs [B,T] = log q^S
    of the sampled token; support_ids [B,T,K] long, -1 padding, or None for the full
    vocabulary; support_logprobs [B,T,K] log q^S of each member (-inf padding), or
    [B,T,V] when support_ids is None, or None (then centering must be off);
    advantages [B]; loss_mask [B,T] bool; config a :class:`CorrectionConfig`.

    ``vocabulary`` ([B] or [B,T] bool, optional): whole-vocabulary rows (module
    docstring): there ``support_ids`` lists the most likely members of q, whose
    ``support_logprobs`` are log q over the vocabulary, the sampled token need not be
    listed, and ``tail_mass`` ([B,T], optional) is q's mass outside the listing.

    Returns ``(loss, metrics)``: a scalar tensor and a flat dict of floats
    (log_ratio_mean/min/max over loss-mask tokens, frac_masked_tokens,
    frac_masked_sequences, mismatch_kl_k3, centering_norm, weight_mean,
    tokens_counted, sequences_counted, loss, the whole-vocabulary figures
    tail_mass_mean and centering_bound_mean, and the sums, counts and maxima behind the
    means: tokens_in_loss, tokens_masked, sequences_in_loss, sequences_masked,
    log_ratio_sum, weight_sum, centering_norm_sum, vocabulary_tokens,
    vocabulary_tokens_counted (the kept ones), tail_mass_sum, tail_mass_max,
    centering_bound_sum, centering_bound_max). Raises
    :class:`BadLossInput` on tensors that break this contract at loss-mask positions;
    positions outside the loss mask may hold anything (padding).

    ``reduction="mean"`` (default) returns the normalised loss; ``"sum"`` returns its
    numerator, whose normaliser is ``metrics["tokens_counted"]`` (token normalisation) or
    ``metrics["sequences_counted"]`` (sequence normalisation); ``metrics["loss"]`` is then
    the sum too. Summing numerators and normalisers over any row split of a batch and
    dividing gives the whole batch's mean (module docstring).
    """
    if reduction not in ("mean", "sum"):
        raise BadLossInput(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    B, T, V = _check_logits(logits)
    vocab = _vocabulary_rows(vocabulary, B, T, logits.device)
    _validate((B, T, V), tokens, sampler_logprobs, support_ids, support_logprobs, advantages, loss_mask, config,
              vocab, tail_mass)
    m = loss_mask
    cd = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tok = torch.where(m, tokens.long(), torch.zeros((), dtype=torch.long, device=tokens.device))
    if support_ids is None:
        lpS = torch.log_softmax(_upcast(logits).to(cd), dim=-1)
        lp_a = lpS.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        return _loss(lpS, lp_a, None, sampler_logprobs, support_logprobs, advantages, m, config, reduction,
                     None, None)
    valid, ids, _ = _safe_support(support_ids, m, tok)
    # one gather from [B,T,V] for the members, so backward scatters into a single dense grad
    gathered = SupportLogits(support=logits.gather(-1, ids))
    if vocab is not None:
        gathered = gathered._replace(sampled=logits.gather(-1, tok.unsqueeze(-1)).squeeze(-1),
                                     vocab_lse=torch.logsumexp(_upcast(logits).to(cd), dim=-1))
    return _support_loss(gathered, tok, sampler_logprobs, support_ids, support_logprobs, advantages, m, config,
                         reduction, vocab, tail_mass)


def policy_loss_gathered(
    gathered: SupportLogits,
    tokens: Tensor,
    sampler_logprobs: Tensor,
    support_ids: Tensor,
    support_logprobs: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    config: CorrectionConfig,
    *,
    vocab_size: int,
    reduction: Reduction = "mean",
    vocabulary: Tensor | None = None,
    tail_mass: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """`policy_loss` with a listed support, from the gathered logits instead of ``[B,T,V]``
    ones: ``gathered.support`` must hold the logits at ``support_ids`` (with ``-1`` read
    as any id), ``gathered.sampled`` those at ``tokens``, ``gathered.vocab_lse`` the
    log-normaliser over the ``vocab_size`` tokens wherever ``vocabulary`` marks a row.
    Same value, gradients (through ``gathered``) and metrics as `policy_loss` on the
    logits they were gathered from."""
    if reduction not in ("mean", "sum"):
        raise BadLossInput(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(support_ids, Tensor):
        raise BadLossInput("policy_loss_gathered needs support_ids (the gathered members)")
    B, T, K = support_ids.shape if support_ids.dim() == 3 else (-1, -1, -1)
    zS = gathered.support
    if not (isinstance(zS, Tensor) and zS.is_floating_point() and tuple(zS.shape) == tuple(support_ids.shape)):
        raise BadLossInput(f"gathered.support must be a floating tensor shaped like support_ids {tuple(support_ids.shape)}, "
                           f"got {getattr(zS, 'shape', zS)!r}")
    vocab = _vocabulary_rows(vocabulary, B, T, zS.device)
    if vocab is not None:
        for name in ("sampled", "vocab_lse"):
            x = getattr(gathered, name)
            if not (isinstance(x, Tensor) and tuple(x.shape) == (B, T)):
                raise BadLossInput(f"whole-vocabulary rows need gathered.{name} [B, T] = {(B, T)}, "
                                   f"got {getattr(x, 'shape', x)!r}")
    _validate((B, T, vocab_size), tokens, sampler_logprobs, support_ids, support_logprobs, advantages, loss_mask,
              config, vocab, tail_mass)
    tok = torch.where(loss_mask, tokens.long(), torch.zeros((), dtype=torch.long, device=tokens.device))
    return _support_loss(gathered, tok, sampler_logprobs, support_ids, support_logprobs, advantages, loss_mask,
                         config, reduction, vocab, tail_mass)


def replay_sampled(gathered: SupportLogits, tokens: Tensor, support_ids: Tensor, loss_mask: Tensor,
                   vocabulary: Tensor | None = None) -> Tensor:
    """``log p^S`` of each sampled token [B,T] from gathered logits, as `policy_loss`
    replays it: over the listed support, or over the vocabulary on whole-vocabulary rows
    (meaningful at loss-mask positions; finite elsewhere). The trainer's mismatch metrics."""
    B, T = tokens.shape
    vocab = _vocabulary_rows(vocabulary, B, T, tokens.device)
    tok = torch.where(loss_mask, tokens.long(), torch.zeros((), dtype=torch.long, device=tokens.device))
    return _replay(gathered, tok, support_ids, loss_mask, vocab)[1]


def _replay(gathered: SupportLogits, tok: Tensor, support_ids: Tensor, m: Tensor,
            vocab: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(log p^S of the members [B,T,K], of the sampled token [B,T], valid members)``."""
    cd = torch.float64 if gathered.support.dtype == torch.float64 else torch.float32
    valid, _, a_idx = _safe_support(support_ids, m, tok)
    zS = _upcast(gathered.support).to(cd)
    lse = _support_logsumexp(zS, valid)
    if vocab is not None:
        lse = torch.where(vocab.unsqueeze(-1), _upcast(gathered.vocab_lse).to(cd).unsqueeze(-1), lse)
    lpS = zS - lse  # finite everywhere, meaningful where valid
    lp_a = lpS.gather(-1, a_idx).squeeze(-1)
    if vocab is not None:  # the sampled token of a whole-vocabulary row need not be listed
        lp_a = torch.where(vocab, _upcast(gathered.sampled).to(cd) - lse.squeeze(-1), lp_a)
    return lpS, lp_a, valid


def _support_loss(gathered: SupportLogits, tok: Tensor, sampler_logprobs: Tensor, support_ids: Tensor,
                  support_logprobs: Tensor | None, advantages: Tensor, m: Tensor, config: CorrectionConfig,
                  reduction: Reduction, vocab: Tensor | None, tail_mass: Tensor | None) -> tuple[Tensor, dict[str, float]]:
    """The loss of a listed support from its gathered logits (replay: log p^S over the
    listed members, or over the vocabulary on whole-vocabulary rows)."""
    lpS, lp_a, valid = _replay(gathered, tok, support_ids, m, vocab)
    return _loss(lpS, lp_a, valid, sampler_logprobs, support_logprobs, advantages, m, config, reduction, vocab,
                 tail_mass)


def _loss(lpS: Tensor, lp_a: Tensor, valid: Tensor | None, sampler_logprobs: Tensor, support_logprobs: Tensor | None,
          advantages: Tensor, m: Tensor, config: CorrectionConfig, reduction: Reduction, vocab: Tensor | None,
          tail_mass: Tensor | None) -> tuple[Tensor, dict[str, float]]:
    """Weights, masks, centering and normalisation from the replayed log-probs."""
    cd = lpS.dtype
    # --- importance weights of the sampled tokens (log space, no gradient)
    zero = torch.zeros((), dtype=cd, device=lpS.device)
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
    metrics.update(_vocabulary_metrics(lpS, valid, m, keep, vocab, tail_mass, config))
    return loss, metrics


@torch.no_grad()
def _vocabulary_metrics(lpS: Tensor, valid: Tensor | None, m: Tensor, keep: Tensor, vocab: Tensor | None,
                        tail_mass: Tensor | None, config: CorrectionConfig) -> dict[str, float]:
    """What the whole-vocabulary rows leave out of centering (module docstring): the
    sampler's tail mass over their loss tokens, and over their kept tokens the bound on
    the L1 norm of the missing centering gradient, ``2 min(W tau, pi)`` (``2 W tau`` for
    ``weighting = "none"``, whose weights are not bounded by the ratio)."""
    out = {"vocabulary_tokens": 0.0, "vocabulary_tokens_counted": 0.0, "tail_mass_sum": 0.0, "tail_mass_max": 0.0, "centering_bound_sum": 0.0,
           "centering_bound_max": 0.0, "tail_mass_mean": 0.0, "centering_bound_mean": 0.0}
    if vocab is None:
        return out
    rows = m & vocab
    n = int(rows.sum())
    if n == 0:
        return out
    tau = (tail_mass.detach().double() if tail_mass is not None
           else torch.zeros(rows.shape, dtype=torch.float64, device=rows.device))
    listed_p = lpS.detach().double().exp().masked_fill(~valid, 0.0).sum(-1) if valid is not None else None
    pi = (1.0 - listed_p).clamp(min=0.0) if listed_p is not None else torch.ones_like(tau)
    W = max_weight(config)
    w_tau = W * tau if math.isfinite(W) else torch.where(tau > 0, math.inf, 0.0).to(tau)  # inf * 0 is 0 here
    bound = 2.0 * (w_tau if config.weighting == "none" else torch.minimum(w_tau, pi))
    kept = keep & vocab
    out.update(vocabulary_tokens=float(n), tail_mass_sum=float(tau[rows].sum()), tail_mass_max=float(tau[rows].max()),
               tail_mass_mean=float(tau[rows].mean()))
    out["vocabulary_tokens_counted"] = float(kept.sum())
    if config.centering and bool(kept.any()):
        out.update(centering_bound_sum=float(bound[kept].sum()), centering_bound_max=float(bound[kept].max()),
                   centering_bound_mean=float(bound[kept].mean()))
    return out


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
