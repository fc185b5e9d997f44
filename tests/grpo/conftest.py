"""Shared builders for the grpo tests: small random batches in float64 whose sampler
side is produced by the real sampler helpers (sampler_support + sample_from_support),
and a per-token reference loss written as plain Python loops."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import settings

from fleetrl.grpo import CorrectionConfig, sample_from_support, sampler_support

settings.register_profile("grpo", max_examples=40, deadline=None, derandomize=True)


def make_batch(
    seed: int,
    B: int,
    T: int,
    V: int,
    *,
    top_p: float = 1.0,
    top_k: int | None = None,
    mismatch: float = 0.3,
    scale: float = 2.0,
    mask_p: float = 0.8,
    on_policy: bool = False,
) -> SimpleNamespace:
    """A batch whose tokens were drawn from a perturbed copy of the trainer's logits."""
    g = torch.Generator().manual_seed(seed)
    z = (scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)).requires_grad_(True)
    zq = z.detach() if on_policy else z.detach() + mismatch * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids, lq = sampler_support(zq.reshape(B * T, V), temperature=1.0, top_p=top_p, top_k=top_k)
    tok, lqa = sample_from_support(ids, lq, generator=g)
    K = ids.shape[1]
    mask = torch.rand(B, T, generator=g) < mask_p
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return SimpleNamespace(
        logits=z,
        tokens=tok.reshape(B, T),
        sampler_logprobs=lqa.reshape(B, T),
        support_ids=ids.reshape(B, T, K),
        support_logprobs=lq.reshape(B, T, K),
        advantages=adv,
        loss_mask=mask,
        sampler_logits=zq,
    )


def reference_loss(batch: SimpleNamespace, config: CorrectionConfig) -> torch.Tensor:
    """docs/reference/corrections.md written one token at a time, with plain loops.

    Same conventions as policy_loss: the centering term enters as (log p - sg(log p))
    so its value is zero; masked positions drop out of the numerator and denominator.
    ``batch.support_ids is None`` means the full vocabulary.
    """
    z = batch.logits
    B, T, V = z.shape
    A = batch.advantages.detach()

    def band(lr: float, low: float, high: float) -> bool:
        return (low == 0 or lr >= math.log(low)) and (math.isinf(high) or lr <= math.log(high))

    def weight(lr: float) -> float:  # f(rho), 0 = masked
        rho = math.exp(lr) if lr < 700 else math.inf
        w = config.weighting
        if w == "none":
            return 1.0
        if w == "tis":
            return min(rho, config.tis_cap)
        if not band(lr, config.mask_low, config.mask_high):
            return 0.0
        return rho if w == "mask" else min(rho, config.tis_cap)

    # per position: list of (token, log q^S) members and the trainer's log p^S of each
    per_seq_terms: list[list[torch.Tensor]] = []
    for b in range(B):
        rows = []
        log_ratios = []
        for t in range(T):
            if not bool(batch.loss_mask[b, t]):
                continue
            a = int(batch.tokens[b, t])
            if batch.support_ids is not None:
                members = [
                    (int(batch.support_ids[b, t, k]), float(batch.support_logprobs[b, t, k]))
                    for k in range(batch.support_ids.shape[2])
                    if int(batch.support_ids[b, t, k]) >= 0
                ]
            else:  # the full vocabulary; q^S of each member only if given
                slp = batch.support_logprobs
                members = [(v, None if slp is None else float(slp[b, t, v])) for v in range(V)]
            lse = torch.logsumexp(torch.stack([z[b, t, v] for v, _ in members]), dim=0)
            logp = {v: z[b, t, v] - lse for v, _ in members}
            lr_a = float(logp[a].detach()) - float(batch.sampler_logprobs[b, t])
            assert math.isfinite(lr_a)
            log_ratios.append(lr_a)
            rows.append((a, members, logp, lr_a))
        if config.seq_mask is not None and log_ratios:
            gm = sum(log_ratios) / len(log_ratios)
            if not band(gm, *config.seq_mask):
                rows = []
        terms = []
        for a, members, logp, lr_a in rows:
            w_a = weight(lr_a)
            if w_a == 0.0:
                continue
            term = w_a * logp[a]
            if config.centering:
                for v, lq_v in members:
                    lr_v = float(logp[v].detach()) - lq_v
                    c_v = 0.0 if lq_v == -math.inf else math.exp(lq_v) * weight(lr_v)
                    term = term - c_v * (logp[v] - logp[v].detach())
            terms.append(-A[b] * term)
        per_seq_terms.append(terms)
    if config.normalization == "token":
        flat = [x for terms in per_seq_terms for x in terms]
        return sum(flat) / max(len(flat), 1) if flat else z.sum() * 0.0
    seqs = [sum(terms) / len(terms) for terms in per_seq_terms if terms]
    return sum(seqs) / len(seqs) if seqs else z.sum() * 0.0


@pytest.fixture(scope="session")
def grpo() -> SimpleNamespace:
    """Helpers for the tests in this folder (a fixture, so no test-package imports)."""
    return SimpleNamespace(make_batch=make_batch, reference_loss=reference_loss)
