"""One GRPO train step on the fp32 master model (pure apart from mutating model and optimizer).

Forward the batch through the Hugging Face causal LM to get the logits at the positions
that predicted the generated tokens (each distinct prompt computed once and shared by
the rows that start with it, `fleetrl.actors.trainer.prefix`; or, with
``share_prompts=False``, the plain forward of every full row), divide by the sampling temperature,
apply `fleetrl.grpo.policy_loss` (support replay, importance weights and masks, score
centering as configured), backward, clip the global grad norm, AdamW step.

A step is *skipped* (weights and optimizer state untouched) when no token can carry a
gradient: every advantage is zero (zero-variance groups), or the corrections masked every
token, or the gradient is not finite. With weight decay or Adam momentum an optimizer
step on a zero gradient would still move the weights, which is not what "no signal"
should do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import msgspec
import torch

from fleetrl.grpo import CorrectionConfig, policy_loss, replay_logprobs

from .batch import Batch
from .prefix import plain_logits, shared_prompt_logits

__all__ = ["StepMetrics", "build_optimizer", "load_into", "master_bf16", "train_step"]


class StepMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """What one train step did (one JSON line per step in the trainer's metrics file)."""

    step: int
    """Optimizer steps taken so far, this one included (skipped steps do not count)."""
    version: int = 0
    """Weight version published after this step (set by the actor)."""
    groups: int = 0
    trajectories: int = 0
    rows: int = 0
    tokens: int = 0
    """Generated tokens in the batch (loss-mask positions)."""
    loss: float = 0.0
    grad_norm: float = 0.0
    """Global L2 norm of the gradient before clipping."""
    lr: float = 0.0
    """Learning rate of this step (set by the trainer from its schedule)."""
    reward_mean: float = 0.0
    pass_rate: float = 0.0
    """Fraction of trajectories with reward >= pass_threshold."""
    frac_masked_tokens: float = 0.0
    frac_masked_sequences: float = 0.0
    mismatch_kl_k3: float = 0.0
    """k3 estimate of KL(q^S || p^S) per token, all samplers."""
    mismatch_kl_by_sampler: dict[str, float] = {}
    """The same per ``"backend/dtype"``."""
    tokens_by_sampler: dict[str, int] = {}
    log_ratio_mean: float = 0.0
    centering_norm: float = 0.0
    weight_mean: float = 0.0
    staleness_hist: dict[int, int] = {}
    """Groups of this batch by ``trainer version - oldest token version``."""
    retokenization_breaks: dict[str, int] = {}
    """Breaks in the trained trajectories' token streams, by cause (harness.chat.BREAK_CAUSES)."""
    step_s: float = 0.0
    elapsed_s: float = 0.0
    """The trainer's wall-clock seconds so far, restarts summed (set by the trainer)."""
    tokens_per_s: float = 0.0
    delta_ratio: float = 0.0
    """bf16 bytes / step-delta bytes of the published version (set by the actor)."""
    delta_density: float = 0.0
    """Fraction of bf16 elements that changed (set by the actor)."""
    delta_bytes: int = 0
    publish_s: float = 0.0
    cost_usd: float = 0.0
    """Sampling cost of the batch: the sum of its segments' ``cost_usd`` (set by the trainer)."""
    usd_per_rollout: float = 0.0
    """``cost_usd`` / trajectories of the batch."""
    skipped: bool = False
    skipped_reason: str = ""


def build_optimizer(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float) -> torch.optim.AdamW:
    """AdamW over every parameter that requires grad (foreach off: same kernel on resume)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             foreach=False)


def _staleness_hist(batch: Batch, trainer_version: int) -> dict[int, int]:
    hist: dict[int, int] = {}
    for g in range(batch.n_groups):
        rows = batch.row_group == g
        v = batch.versions[rows]
        v = v[v >= 0]
        if v.numel():
            s = trainer_version - int(v.min())
            hist[s] = hist.get(s, 0) + 1
    return hist


@torch.no_grad()
def _mismatch(logits_BTV: torch.Tensor, batch: Batch) -> tuple[float, dict[str, float], dict[str, int]]:
    """k3 KL overall and per sampler kind, from replayed log p^S vs reported log q^S."""
    lp, _ = replay_logprobs(logits_BTV, batch.tokens, batch.support_ids)
    m = batch.loss_mask
    lr = (lp.double() - batch.sampler_logprobs.double())
    k3 = torch.where(m, torch.expm1(lr) - lr, 0.0)
    overall = float(k3.sum() / m.sum()) if m.any() else 0.0
    by, counts = {}, {}
    owner = batch.token_sampler
    for i, key in enumerate(batch.sampler_keys):
        sel = m & (owner == i)
        n = int(sel.sum())
        counts[key] = n
        by[key] = float(k3[sel].sum() / n) if n else 0.0
    return overall, by, counts


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *,
               corrections: CorrectionConfig, temperature: float, grad_clip: float,
               pass_threshold: float, step: int, trainer_version: int,
               share_prompts: bool = True) -> StepMetrics:
    """Train ``model`` on ``batch``; returns the step's metrics (``step`` = steps before it).

    ``trainer_version`` is the version the batch is trained against (for staleness).
    ``share_prompts`` computes each distinct prompt once (`shared_prompt_logits`); off,
    every row is forwarded in full (`plain_logits`). Both give the same logits to float
    rounding.
    """
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    if batch.input_ids.device != device:
        batch = batch.to(device)
    rewards = batch.rewards.double()
    base = dict(
        groups=batch.n_groups,
        trajectories=int(rewards.numel()),
        rows=int(batch.tokens.shape[0]),
        tokens=batch.n_tokens,
        reward_mean=float(rewards.mean()) if rewards.numel() else 0.0,
        pass_rate=float((rewards >= pass_threshold).double().mean()) if rewards.numel() else 0.0,
        staleness_hist=_staleness_hist(batch, trainer_version),
        retokenization_breaks=dict(batch.retokenization_breaks),
    )
    if batch.n_tokens == 0 or not bool((batch.advantages != 0).any()):
        return StepMetrics(**base, step=step, skipped=True, skipped_reason="zero advantage",
                           step_s=time.perf_counter() - t0)
    model.train()
    logits_BTV = (shared_prompt_logits if share_prompts else plain_logits)(model, batch)
    lg = logits_BTV.float() / temperature
    loss, m = policy_loss(lg, batch.tokens, batch.sampler_logprobs, batch.support_ids,
                          batch.support_logprobs, batch.advantages, batch.loss_mask, corrections)
    kl, kl_by, counts = _mismatch(lg.detach(), batch)
    stats = dict(
        loss=m["loss"], frac_masked_tokens=m["frac_masked_tokens"],
        frac_masked_sequences=m["frac_masked_sequences"], mismatch_kl_k3=kl,
        mismatch_kl_by_sampler=kl_by, tokens_by_sampler=counts,
        log_ratio_mean=m["log_ratio_mean"], centering_norm=m["centering_norm"],
        weight_mean=m["weight_mean"],
    )
    if m["tokens_counted"] == 0:
        return StepMetrics(**base, **stats, step=step, skipped=True, skipped_reason="every token masked",
                           step_s=time.perf_counter() - t0)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=False))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return StepMetrics(**base, **stats, step=step, grad_norm=grad_norm, skipped=True,
                           skipped_reason="non-finite gradient", step_s=time.perf_counter() - t0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    return StepMetrics(**base, **stats, step=step + 1, grad_norm=grad_norm, step_s=dt,
                       tokens_per_s=batch.n_tokens / dt if dt > 0 else 0.0)


def master_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The canonical bf16 weights to publish: state-dict order, HF names, CPU."""
    return {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def load_into(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model``'s parameters in place (bit-exact)."""
    with torch.no_grad():
        own = model.state_dict()
        missing = set(own) - set(tensors)
        if missing:
            raise ValueError(f"checkpoint lacks model tensors {sorted(missing)[:5]}")
        for k, v in own.items():
            v.copy_(tensors[k])
