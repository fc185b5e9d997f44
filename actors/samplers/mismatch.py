"""Measured sampler-trainer mismatch: the trainer's replayed log-probs and a k3 KL estimate.

For tokens a sampler drew from q^S, the trainer recomputes log p^S of each with a full
forward of the sequence and support replay (`fleetrl.grpo.replay_logprobs` over the
support the sampler reported). With r = p^S(a) / q^S(a) the k3 estimator
``E_q[(r - 1) - log r]`` is an unbiased, non-negative-per-sample estimate of
KL(q^S || p^S) (Schulman, "Approximating KL divergence", 2020). It is ~0 for an fp32
sampler of the trainer's own weights and small but positive for bf16 and fp8 samplers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import torch

from fleetrl.daemon.messages import Generation
from fleetrl.grpo import replay_logprobs

__all__ = ["MismatchReport", "measure_mismatch", "trainer_logprobs"]


class MismatchReport(msgspec.Struct, frozen=True, kw_only=True):
    """Mismatch between a sampler's reported log-probs and the trainer's, over many tokens."""

    tokens: int
    k3_kl: float
    """Mean of (r - 1) - log r, r = p^S/q^S: estimates KL(q^S || p^S) per token."""
    mean_log_ratio: float
    """Mean of log p^S - log q^S (its negative is the k1 estimate of the same KL)."""
    max_abs_log_ratio: float


def trainer_logprobs(model: torch.nn.Module, prompt: Sequence[int], generation: Generation,
                     temperature: float) -> torch.Tensor:
    """log p^S of each generated token under `model` (an HF causal LM) with support replay.

    One forward of prompt + generated tokens in the model's own dtype; the logits at
    the positions that predicted each token are divided by the temperature (greedy,
    temperature 0, leaves them as they are: its supports have one member) and
    renormalised over the sampler's reported support. Returns float32 [N].
    """
    n = generation.num_tokens
    if n == 0:
        return torch.empty(0)
    device = next(model.parameters()).device
    generated = generation.token_ids.to_numpy().tolist()
    ids = torch.tensor([list(prompt) + generated], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    support_ids, _ = generation.support.padded()
    tokens = torch.tensor([generated], dtype=torch.long, device=device)
    logp, _ = replay_logprobs(logits, tokens, torch.from_numpy(support_ids)[None].to(device))
    return logp[0].float().cpu()


def measure_mismatch(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                     generations: Sequence[Generation], temperature: float) -> MismatchReport:
    """Compare the sampler's log q^S with the trainer's replayed log p^S over all tokens."""
    if len(prompts) != len(generations):
        raise ValueError(f"{len(prompts)} prompts but {len(generations)} generations")
    log_ratios = []
    for prompt, gen in zip(prompts, generations):
        logp = trainer_logprobs(model, prompt, gen, temperature)
        logq = torch.from_numpy(gen.logprobs.to_numpy().astype("float64"))
        log_ratios.append(logp.double() - logq)
    lr = torch.cat(log_ratios) if log_ratios else torch.empty(0, dtype=torch.float64)
    if lr.numel() == 0:
        return MismatchReport(tokens=0, k3_kl=math.nan, mean_log_ratio=math.nan, max_abs_log_ratio=math.nan)
    k3 = torch.expm1(lr) - lr
    return MismatchReport(
        tokens=lr.numel(),
        k3_kl=float(k3.mean()),
        mean_log_ratio=float(lr.mean()),
        max_abs_log_ratio=float(lr.abs().max()),
    )
