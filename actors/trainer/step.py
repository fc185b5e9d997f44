"""One GRPO train step on the fp32 master model (pure apart from mutating model and optimizer).

Forward the batch through the Hugging Face causal LM to get the logits at the positions
that predicted the generated tokens (each distinct prompt computed once and shared by
the rows that start with it, `fleetrl.actors.trainer.prefix`; or, with
``share_prompts=False``, the plain forward of every full row), divide by the sampling temperature,
apply `fleetrl.grpo.policy_loss` (support replay, importance weights and masks, score
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
exactly (`_Mismatch.add`).

A step is *skipped* (weights and optimizer state untouched) when no token can carry a
gradient: every advantage is zero (zero-variance groups), or the corrections masked every
token, or the gradient is not finite. With weight decay or Adam momentum an optimizer
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
from fleetrl.grpo import CorrectionConfig, policy_loss, replay_logprobs
from fleetrl.grpo.weights import in_band, kept_tokens

from .batch import Batch, split_rows
from .collective import Collective, LocalCollective, gather_bytes
from .fsdp import has_activation_checkpointing, is_sharded, use_sum_reduction
from .prefix import plain_logits, shared_prompt_logits

__all__ = ["MismatchFigures", "RowDetail", "StepMetrics", "build_optimizer", "combine_figures", "load_into", "master_bf16",
           "train_step"]


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


def _nanmax(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


class _Mismatch(msgspec.Struct):
    """The mismatch of a set of tokens, in a form that combines exactly over a union of
    disjoint sets (`add`): counts and sums add, the mean and the sum of squared
    deviations combine by Chan, Golub and LeVeque's pairwise update, maxima by max."""

    tokens: int = 0
    k3_sum: float = 0.0
    out_of_band: int = 0
    mean: float = 0.0
    """Mean log-ratio."""
    m2: float = 0.0
    """Sum of squared deviations of the log-ratio from ``mean``."""
    max_abs: float = 0.0

    @staticmethod
    def of(log_ratio: torch.Tensor, out_of_band: torch.Tensor) -> _Mismatch:
        """The figures of the tokens whose log-ratios (any shape) are given, with the
        flags of those outside the band."""
        r = log_ratio.double().reshape(-1)
        n = int(r.numel())
        if n == 0:
            return _Mismatch()
        mean = float(r.mean())
        return _Mismatch(tokens=n, k3_sum=float((torch.expm1(r) - r).sum()), out_of_band=int(out_of_band.sum()),
                         mean=mean, m2=float(((r - mean) ** 2).sum()), max_abs=float(r.abs().max()))

    def add(self, other: _Mismatch) -> None:
        if other.tokens == 0:
            return
        if self.tokens == 0:
            for f in self.__struct_fields__:
                setattr(self, f, getattr(other, f))
            return
        n = self.tokens + other.tokens
        delta = other.mean - self.mean
        self.m2 = self.m2 + other.m2 + delta * delta * self.tokens * other.tokens / n
        self.mean = self.mean + delta * other.tokens / n
        self.tokens = n
        self.k3_sum += other.k3_sum
        self.out_of_band += other.out_of_band
        self.max_abs = _nanmax(self.max_abs, other.max_abs)

    def figures(self) -> MismatchFigures:
        n = self.tokens
        if n == 0:
            return MismatchFigures(tokens=0, kl_k3=0.0, frac_out_of_band=0.0, log_ratio_mean=0.0, log_ratio_std=0.0,
                                   log_ratio_max_abs=0.0)
        return MismatchFigures(tokens=n, kl_k3=self.k3_sum / n, frac_out_of_band=self.out_of_band / n,
                               log_ratio_mean=self.mean, log_ratio_std=math.sqrt(self.m2 / n) if self.m2 >= 0
                               else math.nan, log_ratio_max_abs=self.max_abs)

    @staticmethod
    def from_figures(f: MismatchFigures) -> _Mismatch:
        return _Mismatch(tokens=f.tokens, k3_sum=f.kl_k3 * f.tokens, out_of_band=round(f.frac_out_of_band * f.tokens),
                         mean=f.log_ratio_mean, m2=f.log_ratio_std ** 2 * f.tokens, max_abs=f.log_ratio_max_abs)


def combine_figures(parts: Sequence[MismatchFigures]) -> MismatchFigures:
    """The figures of the union of disjoint token sets, from each set's figures (exact up
    to float rounding: token-weighted means, the pooled standard deviation, the maximum)."""
    total = _Mismatch()
    for f in parts:
        total.add(_Mismatch.from_figures(f))
    return total.figures()


class RowDetail(msgspec.Struct, frozen=True, array_like=True):
    """What the step saw of one row's generated tokens (the rollout log, `train_step`'s
    ``detail``): where the row came from (`Batch.row_origin`), the trainer's replayed log
    p^S of each token (temperature applied, over the sampler's support), and the
    positions the corrections masked (loss-mask tokens the loss did not keep)."""

    origin: tuple[int, int, int]
    trainer_logprobs: list[float]
    masked: list[int]


class _Details(msgspec.Struct):
    rows: list[RowDetail] = []


class _Sums(msgspec.Struct):
    """A rank's sums over its micro-batches, combined over ranks by adding."""

    numerator: float = 0.0
    tokens_counted: float = 0.0
    sequences_counted: float = 0.0
    tokens_in_loss: float = 0.0
    tokens_masked: float = 0.0
    sequences_in_loss: float = 0.0
    sequences_masked: float = 0.0
    log_ratio_sum: float = 0.0
    weight_sum: float = 0.0
    centering_norm_sum: float = 0.0
    fleet: _Mismatch = msgspec.field(default_factory=_Mismatch)
    by_kind: dict[str, _Mismatch] = {}
    by_id: dict[str, _Mismatch] = {}
    identities: dict[str, SamplerIdentity] = {}

    def add(self, other: _Sums) -> None:
        for f in self.__struct_fields__:
            a, b = getattr(self, f), getattr(other, f)
            if f == "identities":
                self.identities = {**b, **a}  # the first seen wins
            elif isinstance(a, _Mismatch):
                a.add(b)
            elif isinstance(a, dict):
                merged = {k: (msgspec.structs.replace(v) if isinstance(v, _Mismatch) else v) for k, v in a.items()}
                for k, v in b.items():
                    if isinstance(v, _Mismatch):
                        merged.setdefault(k, _Mismatch()).add(v)
                    else:
                        merged[k] = merged.get(k, 0) + v
                setattr(self, f, merged)
            else:
                setattr(self, f, a + b)


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
        breaks=dict(summary.retokenization_breaks))


def _base(heads: Sequence[_Head], pass_threshold: float, trainer_version: int) -> dict:
    rewards = torch.tensor([r for h in heads for r in h.rewards], dtype=torch.float64)
    hist: dict[int, int] = {}
    for h in heads:
        for v in h.group_oldest:
            if v >= 0:
                hist[trainer_version - v] = hist.get(trainer_version - v, 0) + 1
    breaks: dict[str, int] = {}
    for h in heads:
        for k, n in h.breaks.items():
            breaks[k] = breaks.get(k, 0) + n
    return dict(
        groups=sum(len(h.group_oldest) for h in heads),
        trajectories=int(rewards.numel()),
        rows=sum(h.rows for h in heads),
        tokens=sum(h.tokens for h in heads),
        reward_mean=float(rewards.mean()) if rewards.numel() else 0.0,
        pass_rate=float((rewards >= pass_threshold).double().mean()) if rewards.numel() else 0.0,
        staleness_hist=hist,
        retokenization_breaks=breaks,
    )


@torch.no_grad()
def _mismatch_sums(logits_BTV: torch.Tensor, batch: Batch, sums: _Sums, corrections: CorrectionConfig,
                   detail: list[RowDetail] | None) -> None:
    """The mismatch of ``batch``'s loss tokens (replayed log p^S vs reported log q^S)
    overall, per sampler kind and per sampler id, added to ``sums``; with ``detail``, each
    row's `RowDetail` appended to it."""
    lp, _ = replay_logprobs(logits_BTV, batch.tokens, batch.support_ids)
    m = batch.loss_mask
    lr = lp.double() - batch.sampler_logprobs.double()
    out = ~in_band(lr, corrections.mask_low, corrections.mask_high)
    if detail is not None:
        masked = (m & ~kept_tokens(torch.where(m, lr, 0.0), m, corrections)).cpu()
        lengths, lp_cpu = m.sum(-1).tolist(), lp.float().cpu()
        for b, n in enumerate(lengths):
            detail.append(RowDetail(origin=batch.row_origin[b], trainer_logprobs=lp_cpu[b, :n].tolist(),
                                    masked=masked[b, :n].nonzero().reshape(-1).tolist()))
    sums.fleet.add(_Mismatch.of(lr[m], out[m]))
    for owner, names, into in ((batch.token_sampler, batch.sampler_keys, sums.by_kind),
                               (batch.token_identity, [s.sampler_id for s in batch.sampler_identities], sums.by_id)):
        for i, name in enumerate(names):
            sel = m & (owner == i)
            if bool(sel.any()):
                into.setdefault(name, _Mismatch()).add(_Mismatch.of(lr[sel], out[sel]))
    for ident in batch.sampler_identities:
        sums.identities.setdefault(ident.sampler_id, ident)


def _micro_step(model: torch.nn.Module, mb: Batch, *, corrections: CorrectionConfig, temperature: float,
                share: bool, detail: list[RowDetail] | None = None) -> _Sums:
    """Forward ``mb``, backward the *sum* of its loss (gradients accumulate); its sums."""
    logits_BTV = (shared_prompt_logits if share else plain_logits)(model, mb)
    lg = logits_BTV.float() / temperature
    loss_sum, m = policy_loss(lg, mb.tokens, mb.sampler_logprobs, mb.support_ids, mb.support_logprobs,
                              mb.advantages, mb.loss_mask, corrections, reduction="sum")
    sums = _Sums(**{k: m[k] for k in ("tokens_counted", "sequences_counted", "tokens_in_loss", "tokens_masked",
                                      "sequences_in_loss", "sequences_masked", "log_ratio_sum", "weight_sum",
                                      "centering_norm_sum")}, numerator=m["loss"])
    _mismatch_sums(lg.detach(), mb, sums, corrections, detail)
    del logits_BTV, lg
    loss_sum.backward()
    return sums


def _idle_pass(model: torch.nn.Module, device: torch.device, share: bool) -> None:
    """A zero-weighted forward and backward on one token, with the same forward calls as
    a real micro-batch, so a rank with fewer micro-batches joins FSDP's collectives."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    if share:
        out = model(input_ids=ids, use_cache=True)
        rest = model(input_ids=ids, position_ids=torch.ones_like(ids), past_key_values=out.past_key_values,
                     use_cache=True)
        total = out.logits.float().sum() + rest.logits.float().sum()
    else:
        total = model(input_ids=ids, use_cache=False).logits.float().sum()
    (total * 0.0).backward()


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


def _stats(t: _Sums) -> dict:
    n_loss, n_keep = t.tokens_in_loss, t.tokens_counted
    fleet = t.fleet.figures()
    by_kind = {k: v.figures() for k, v in sorted(t.by_kind.items()) if v.tokens}
    by_id = {k: v.figures() for k, v in sorted(t.by_id.items()) if v.tokens}
    return dict(
        frac_masked_tokens=t.tokens_masked / n_loss if n_loss else 0.0,
        frac_masked_sequences=t.sequences_masked / t.sequences_in_loss if t.sequences_in_loss else 0.0,
        mismatch_kl_k3=fleet.kl_k3,
        mismatch_kl_by_sampler={k: f.kl_k3 for k, f in by_kind.items()},
        tokens_by_sampler={k: f.tokens for k, f in by_kind.items()},
        frac_out_of_band=fleet.frac_out_of_band,
        log_ratio_std=fleet.log_ratio_std,
        log_ratio_max_abs=fleet.log_ratio_max_abs,
        mismatch_by_kind=by_kind,
        mismatch_by_sampler_id=by_id,
        sampler_identities=tuple(t.identities[k] for k in by_id),
        log_ratio_mean=t.log_ratio_sum / n_loss if n_loss else 0.0,
        centering_norm=t.centering_norm_sum / n_keep if n_keep else 0.0,
        weight_mean=t.weight_sum / n_keep if n_keep else 0.0,
    )


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *,
               corrections: CorrectionConfig, temperature: float, grad_clip: float,
               pass_threshold: float, step: int, trainer_version: int,
               share_prompts: bool = True, micro_batch_tokens: int | None = None,
               collective: Collective | None = None, detail: list[RowDetail] | None = None) -> StepMetrics:
    """Train ``model`` on ``batch``; returns the step's metrics (``step`` = steps before it).

    ``trainer_version`` is the version the batch is trained against (for staleness).
    ``share_prompts`` computes each distinct prompt once (`shared_prompt_logits`); off,
    every row is forwarded in full (`plain_logits`). Both give the same logits to float
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
    stats = dict(loss=total.numerator / max(count, 1.0), **_stats(total))
    if count == 0:
        optimizer.zero_grad(set_to_none=True)
        return StepMetrics(**base, **stats, step=step, skipped=True, skipped_reason="every token masked",
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
