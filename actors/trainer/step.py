"""One GRPO train step on the fp32 master model (pure apart from mutating model and optimizer).

Forward the batch through the Hugging Face causal LM to get the final hidden states at
the positions that predicted the generated tokens (each distinct prompt computed once and
shared by the rows that start with it, `fleetrl.actors.trainer.prefix`; or, with
``share_prompts=False``, the plain forward of every full row), apply the head in chunks
of positions keeping only the logits the loss reads, each row's divided by the
temperature its call was sampled with (`Batch.row_temperature`; ``temperature`` for rows
whose record has none) (`fleetrl.actors.trainer.head`: never ``[B, T, V]`` at once), apply
`fleetrl.grpo.policy_loss_gathered` (support replay, importance weights and masks, score
centering as configured), backward, clip the global grad norm, AdamW step.

Micro-batches and ranks. The batch is cut into micro-batches of at most
``micro_batch_tokens`` tokens (`fleetrl.actors.trainer.batch.split_rows`; None: one), and
each data-parallel rank trains its own rows (``collective``). Each micro-batch's loss is
the *sum* ``policy_loss(..., reduction="sum")`` (the numerator of the batch's
normalised mean) and is backpropagated at once, so the gradients accumulate sums; then
the normalisers (kept tokens, or kept sequences) and every metric's sums are summed
over micro-batches and ranks, the gradients (summed over ranks: FSDP's reduce-scatter
with its divide factor set to 1, or one all-reduce for a replicated model) are divided
by the global normaliser once, clipped by their global norm, and AdamW steps. So any
split into micro-batches and ranks gives the one-batch step to fp32 rounding, and every
metric means what it means for the whole batch.

Mismatch. Every step that runs its forward measures, per token, the log-ratio ``r =
log p^S(a) - log q^S(a)`` of the trainer's replayed probability of the sampled token to
the sampler's reported one (temperature applied, over the reported support), and
reports it for all tokens together and per sampler kind (``"backend/dtype"``) and per
sampler id (`MismatchFigures`): the k3 KL ``mean(exp(r) - 1 - r)``, the fraction of
tokens whose ratio ``exp(r)`` is outside the correction band ``[mask_low, mask_high]``
(measured against the configured band whatever the weighting, so it says how much a
mask would drop), and the spread of ``r``: its mean, population standard deviation and
largest ``|r|``. Quantiles would not add up over micro-batches and ranks; these do,
exactly (`step_figures`).

A step is *skipped* (weights and optimizer state untouched) when no token can carry a
gradient: every model call was left out of the batch (greedy calls, `batch`), every
advantage is zero (zero-variance groups), or the corrections masked every token, or the
gradient is not finite. With weight decay or Adam momentum an optimizer
step on a zero gradient would still move the weights, which is not what "no signal"
should do. The decisions use the global figures, so every rank skips, or none.

Under FSDP every rank must run the same sequence of forwards and backwards (each is a
collective): ranks with fewer micro-batches run zero-weighted passes on one token, and
prompts are shared only when every micro-batch of every rank has at least two generated
positions (the shared path runs one forward for the prompts and one for the rest, the
plain path one). With activation checkpointing the plain path is used: a recomputed
forward would write the KV cache a second time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

import msgspec
import torch

from fleetrl.daemon.messages import MismatchFigures, SamplerIdentity
from fleetrl.grpo import CorrectionConfig, SupportLogits, policy_loss_gathered, replay_sampled

from .batch import Batch, split_rows
from .collective import Collective, LocalCollective, gather_bytes
from .fsdp import has_activation_checkpointing, is_sharded, published_names, use_sum_reduction
from .head import DEFAULT_LOGITS_CHUNK_BYTES, SupportHead, final_hidden, lm_head, support_logits
from .prefix import plain_hidden, shared_prompt_hidden
from .step_figures import SUM_KEYS, RowDetail, _Details, _Sums, combine_figures, metrics_fields, mismatch_sums

__all__ = ["ALL_MASKED_REASON", "MismatchFigures", "RowDetail", "StepMetrics", "build_optimizer", "combine_figures",
           "load_into", "master_bf16", "train_step"]


ALL_MASKED_REASON = "every token masked"
"""``skipped_reason`` of a step whose corrections kept no token (`alarms` halts on it)."""


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
    groups_received: int = 0
    """Groups the trainer received since the previous line, whatever became of them
    (admitted, zero-variance, stale, duplicate; set by the trainer): with ``groups``,
    the share of sampled work that carried a gradient."""
    tokens_received: int = 0
    """Generated tokens of those groups (set by the trainer): the fleet's generation
    rate, discarded groups included, where ``tokens`` counts only the trained ones."""
    groups_without_gradient: dict[str, int] = {}
    """Of those groups, the ones that carried no gradient, by why (set by the trainer):
    ``zero_variance`` (equal rewards: zero advantages), ``stale``, ``duplicate``,
    ``malformed`` (refused at admission)."""
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
    excluded_rows: dict[str, int] = {}
    """Model calls of the batch's groups left out of the loss because they cannot carry a
    gradient, by reason (``greedy``: sampled at temperature 0; ``top_k_1``: one candidate
    per position; `batch.no_gradient_reason`)."""
    excluded_tokens: int = 0
    """Their generated tokens."""
    frac_excluded_rows: float = 0.0
    """Excluded calls / (excluded + trained rows)."""
    unrecorded_rows: int = 0
    """Rows whose record carries no sampling settings (an earlier release's), scored at
    the trainer's configured ``temperature``."""
    alarms: tuple[str, ...] = ()
    """What this step raised an alarm for (set by the trainer, `alarms.step_alarms`):
    ``all_masked``, ``masked_tokens``, ``masked_sequences``, ``excluded_rows``, ``tail_mass``."""
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
    frac_out_of_band: float = 0.0
    """Fraction of the batch's tokens whose ratio p^S/q^S is outside ``[mask_low,
    mask_high]`` (whatever the weighting; module docstring)."""
    log_ratio_std: float = 0.0
    """Population standard deviation of log p^S - log q^S over the batch's tokens."""
    log_ratio_max_abs: float = 0.0
    """Largest |log p^S - log q^S| of the batch."""
    mismatch_by_kind: dict[str, MismatchFigures] = {}
    """The measured mismatch per sampler kind ``"backend/dtype"`` (kinds with tokens)."""
    mismatch_by_sampler_id: dict[str, MismatchFigures] = {}
    """The same per sampler id."""
    sampler_identities: tuple[SamplerIdentity, ...] = ()
    """The identities of the sampler ids of ``mismatch_by_sampler_id`` (device kind included)."""
    vocabulary_tokens: int = 0
    """Tokens of the batch drawn from the whole vocabulary (support rule ``"vocabulary"``);
    the four figures below describe them (0 when there are none)."""
    tail_mass_mean: float = 0.0
    """Mean mass of the sampler's q outside the listed members, over those tokens: what
    centering leaves out (docs/reference/corrections.md, "Supports at real vocabularies")."""
    tail_mass_max: float = 0.0
    centering_bound_mean: float = 0.0
    """Mean bound, over the kept ones of those tokens, on the L1 norm of the centering
    gradient (per unit advantage, w.r.t. the logits) that the listing leaves out."""
    centering_bound_max: float = 0.0


def build_optimizer(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float) -> torch.optim.AdamW:
    """AdamW over every parameter that requires grad (foreach off: same kernel on resume)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             foreach=False)


class _Head(msgspec.Struct, frozen=True):
    """A rank's figures before the forward (the whole-batch part of the metrics)."""

    rows: int
    tokens: int
    signal: bool
    """Some advantage of a row with generated tokens is non-zero."""
    n_micro: int
    multi: bool
    """Every micro-batch has >= 2 generated positions (the shared forward runs twice)."""
    rewards: list[float]
    group_oldest: list[int]
    breaks: dict[str, int]
    excluded: dict[str, int]
    excluded_tokens: int
    unrecorded: int


def _all(collective: Collective, value, typ) -> list:
    """Every rank's ``value`` (a msgspec struct), in rank order."""
    if collective.world_size == 1:
        return [value]
    return [msgspec.msgpack.decode(b, type=typ) for b in gather_bytes(collective, msgspec.msgpack.encode(value))]


def _head(batch: Batch, micro: Sequence[Batch]) -> _Head:
    summary = batch.summary()
    rows_with_tokens = batch.loss_mask.any(-1)
    return _Head(
        rows=int(batch.tokens.shape[0]), tokens=batch.n_tokens,
        signal=bool(((batch.advantages != 0) & rows_with_tokens.to(batch.advantages.device)).any()),
        n_micro=len(micro), multi=all(int(mb.loss_mask.sum(-1).max()) >= 2 for mb in micro),
        rewards=[float(r) for r in summary.rewards.tolist()], group_oldest=[int(v) for v in summary.group_oldest.tolist()],
        breaks=dict(summary.retokenization_breaks), excluded=dict(summary.excluded_rows),
        excluded_tokens=summary.excluded_tokens, unrecorded=summary.unrecorded_rows)


def _base(heads: Sequence[_Head], pass_threshold: float, trainer_version: int) -> dict:
    rewards = torch.tensor([r for h in heads for r in h.rewards], dtype=torch.float64)
    hist: dict[int, int] = {}
    for h in heads:
        for v in h.group_oldest:
            if v >= 0:
                hist[trainer_version - v] = hist.get(trainer_version - v, 0) + 1
    breaks: dict[str, int] = {}
    excluded: dict[str, int] = {}
    for h in heads:
        for k, n in h.breaks.items():
            breaks[k] = breaks.get(k, 0) + n
        for k, n in h.excluded.items():
            excluded[k] = excluded.get(k, 0) + n
    rows, n_excluded = sum(h.rows for h in heads), sum(excluded.values())
    return dict(
        groups=sum(len(h.group_oldest) for h in heads),
        trajectories=int(rewards.numel()),
        rows=rows,
        tokens=sum(h.tokens for h in heads),
        reward_mean=float(rewards.mean()) if rewards.numel() else 0.0,
        pass_rate=float((rewards >= pass_threshold).double().mean()) if rewards.numel() else 0.0,
        staleness_hist=hist,
        retokenization_breaks=breaks,
        excluded_rows=excluded,
        excluded_tokens=sum(h.excluded_tokens for h in heads),
        frac_excluded_rows=n_excluded / (n_excluded + rows) if n_excluded else 0.0,
        unrecorded_rows=sum(h.unrecorded for h in heads),
    )


def _micro_step(model: torch.nn.Module, mb: Batch, *, corrections: CorrectionConfig, temperature: float,
                share: bool, chunk_bytes: int, detail: list[RowDetail] | None = None) -> _Sums:
    """Forward ``mb``, backward the *sum* of its loss (gradients accumulate); its sums.
    Each row is scored at its own temperature (``temperature`` where it has none)."""
    hidden_BTH = (shared_prompt_hidden if share else plain_hidden)(model, mb)
    vocab = bool(mb.support_vocab.any())
    temps = torch.nan_to_num(mb.row_temperature.double(), nan=float(temperature))
    gathered = support_logits(model, hidden_BTH, mb.tokens, mb.support_ids, mb.loss_mask, temperature=temps,
                              want_vocab_lse=vocab, chunk_bytes=chunk_bytes)
    rows = mb.support_vocab if vocab else None
    loss_sum, m = policy_loss_gathered(gathered, mb.tokens, mb.sampler_logprobs, mb.support_ids, mb.support_logprobs,
                                       mb.advantages, mb.loss_mask, corrections, vocab_size=lm_head(model).out_features,
                                       reduction="sum", vocabulary=rows, tail_mass=mb.support_tail if vocab else None)
    sums = _Sums(**{k: m[k] for k in SUM_KEYS}, numerator=m["loss"])
    with torch.no_grad():
        lp = replay_sampled(SupportLogits(*(None if x is None else x.detach() for x in gathered)), mb.tokens,
                            mb.support_ids, mb.loss_mask, rows)
    mismatch_sums(lp, mb, sums, corrections, detail)
    del hidden_BTH, gathered
    loss_sum.backward()
    return sums


def _idle_pass(model: torch.nn.Module, device: torch.device, share: bool) -> None:
    """A zero-weighted forward and backward on one token, with the same forward calls and
    the same head as a real micro-batch, so a rank with fewer micro-batches joins FSDP's
    collectives."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    if share:
        first, out = final_hidden(model, input_ids=ids, use_cache=True)
        rest, _ = final_hidden(model, input_ids=ids, position_ids=torch.ones_like(ids),
                               past_key_values=out.past_key_values, use_cache=True)
        hidden = torch.cat([first, rest], dim=1)[0]
    else:
        hidden = final_hidden(model, input_ids=ids, use_cache=False)[0][0]
    head = lm_head(model)
    zeros = torch.zeros(hidden.shape[0], dtype=torch.long, device=device)
    zS, za, _ = SupportHead.apply(hidden, head.weight, head.bias, zeros[:, None], zeros, 1.0, 1, False)
    ((zS.sum() + za.sum()) * 0.0).backward()


def _sum_replicated_grads(params: Sequence[torch.Tensor], collective: Collective) -> None:
    """Sum the gradients of a replicated (unsharded) model over ranks: one all-reduce.

    A parameter without a gradient on every rank keeps none (AdamW then leaves it alone,
    as in one process)."""
    dtype, device = params[0].dtype, params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=device)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in params]
                     + [has])
    flat = collective.all_reduce_sum(flat)
    offset = 0
    used = flat[-len(params):].tolist()
    for p, u in zip(params, used):
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype).clone() if u > 0 else None
        offset += n


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *,
               corrections: CorrectionConfig, temperature: float, grad_clip: float,
               pass_threshold: float, step: int, trainer_version: int,
               share_prompts: bool = True, micro_batch_tokens: int | None = None,
               collective: Collective | None = None, detail: list[RowDetail] | None = None,
               logits_chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES) -> StepMetrics:
    """Train ``model`` on ``batch``; returns the step's metrics (``step`` = steps before it).

    ``trainer_version`` is the version the batch is trained against (for staleness).
    ``temperature``: the temperature of rows whose record carries none (every other row
    is scored at its own, `Batch.row_temperature`).
    ``share_prompts`` computes each distinct prompt once (`shared_prompt_hidden`); off,
    every row is forwarded in full (`plain_hidden`). Both give the same logits to float
    rounding. ``micro_batch_tokens`` cuts the batch into micro-batches of at most that many
    tokens (`split_rows`: rows x longest prompt + generated row; None: one micro-batch).
    ``collective``: this rank's data-parallel group (None: one process); each rank passes
    its own rows (e.g. `select_rows` of one shared batch: the rank holding row 0 carries the
    batch's groups, trajectories and rewards) and every rank calls ``train_step`` with the
    same arguments otherwise. The model is either sharded with FSDP2 over the same ranks
    (`fleetrl.actors.trainer.fsdp.shard_model`) or replicated (identical on every rank).
    The metrics describe the whole batch over all ranks (module docstring).
    ``detail``: a list that gets one `RowDetail` per row of the whole batch (every rank's,
    gathered; the batch needs its ``row_origin``) when the step runs its forward; every
    rank passes one, or none does.
    """
    t0 = time.perf_counter()
    if micro_batch_tokens is not None and (isinstance(micro_batch_tokens, bool)
                                           or not isinstance(micro_batch_tokens, int) or micro_batch_tokens < 1):
        raise ValueError(f"micro_batch_tokens must be None or an int >= 1, got {micro_batch_tokens!r}")
    coll = LocalCollective() if collective is None else collective
    device = next(model.parameters()).device
    if batch.tokens.shape[0] == 0:
        micro: list[Batch] = []
    elif micro_batch_tokens is None:
        micro = [batch]
    else:
        micro = split_rows(batch, micro_batch_tokens)
    heads = _all(coll, _head(batch, micro), _Head)
    base = _base(heads, pass_threshold, trainer_version)
    if base["tokens"] == 0 and base["excluded_rows"]:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(base["excluded_rows"].items()))
        return StepMetrics(**base, step=step, skipped=True,
                           skipped_reason=f"every model call excluded: no token can carry a gradient ({reasons})",
                           step_s=time.perf_counter() - t0)
    if base["tokens"] == 0 or not any(h.signal for h in heads):
        return StepMetrics(**base, step=step, skipped=True, skipped_reason="zero advantage",
                           step_s=time.perf_counter() - t0)
    sharded = is_sharded(model)
    if sharded:
        use_sum_reduction(model)
    share = share_prompts and not has_activation_checkpointing(model)
    if sharded and coll.world_size > 1:
        share = share and all(h.multi for h in heads)  # the same forward calls on every rank
    n_micro = max(h.n_micro for h in heads)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    local = _Sums()
    rows: list[RowDetail] | None = None if detail is None else []
    for i in range(n_micro):
        if i < len(micro):
            mb = micro[i] if micro[i].input_ids.device == device else micro[i].to(device)
            local.add(_micro_step(model, mb, corrections=corrections, temperature=temperature, share=share,
                                  chunk_bytes=logits_chunk_bytes,
                                  detail=rows))
        elif sharded and coll.world_size > 1:
            _idle_pass(model, device, share)
    total = _Sums()
    for s in _all(coll, local, _Sums):
        total.add(s)
    if detail is not None and rows is not None:
        for part in _all(coll, _Details(rows=rows), _Details):
            detail.extend(part.rows)
    count = total.tokens_counted if corrections.normalization == "token" else total.sequences_counted
    stats = dict(loss=total.numerator / max(count, 1.0), **metrics_fields(total))
    if count == 0:
        optimizer.zero_grad(set_to_none=True)
        return StepMetrics(**base, **stats, step=step, skipped=True, skipped_reason=ALL_MASKED_REASON,
                           step_s=time.perf_counter() - t0)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if coll.world_size > 1 and not sharded:
        _sum_replicated_grads(params, coll)
    for p in params:
        if p.grad is not None:
            p.grad.div_(count)
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=False)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return StepMetrics(**base, **stats, step=step, grad_norm=grad_norm, skipped=True,
                           skipped_reason="non-finite gradient", step_s=time.perf_counter() - t0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    return StepMetrics(**base, **stats, step=step + 1, grad_norm=grad_norm, step_s=dt,
                       tokens_per_s=base["tokens"] / dt if dt > 0 else 0.0)


def master_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The canonical bf16 weights to publish: state-dict order, HF names, CPU, each tensor
    once (a tied head under the embedding's name only: `fsdp.published_names`)."""
    state = model.state_dict()
    return {k: state[k].detach().to("cpu", torch.bfloat16).contiguous() for k in published_names(model)}


def load_into(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model``'s parameters in place (bit-exact); a tied tensor
    needs only its first name (`fsdp.published_names`)."""
    with torch.no_grad():
        own = model.state_dict()
        names = published_names(model)
        missing = set(names) - set(tensors)
        if missing:
            raise ValueError(f"checkpoint lacks model tensors {sorted(missing)[:5]}")
        for k in names:
            own[k].copy_(tensors[k])
