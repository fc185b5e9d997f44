"""RolloutGroups -> padded tensors for one train step (pure, no model).

One row per `TokenSegment` (one model call) that generated at least one token: the
row's input is ``prompt_ids + token_ids``; the logit at input position ``P - 1 + t``
(``P`` the prompt length) predicts generated token ``t``, so ``positions[b, t] = P - 1 + t``.
Generated-token arrays are left-aligned in ``[B, T]`` (``T`` = longest generation) with
``loss_mask`` true exactly on real generated tokens; prompt tokens are never in the loss.
Supports are unpacked from CSR into ``[B, T, K]`` (``K`` = largest support in the batch,
at most the samplers' cap, never the vocabulary), padded with id ``-1`` and log-prob
``-inf`` (the `fleetrl.grpo` convention). A row whose call drew from the whole
vocabulary (support rule ``"vocabulary"``) is marked in ``support_vocab`` and carries its
per-token tail mass in ``support_tail``.

Rows whose prompts are identical (the attempts of one group, usually) share one entry of
``prompt_ids`` (the distinct prompts, right-padded, first-seen order); ``prefix_index[b]``
names row ``b``'s entry. `fleetrl.actors.trainer.prefix` uses it to run each distinct
prompt through the model once per step instead of once per row.

`split_rows` cuts a batch into micro-batches under a token budget, and `select_rows`
makes the batch of any subset of rows (each a valid `Batch` of its own: distinct
prompts, trajectories and groups re-indexed, padding trimmed). What describes the whole
batch rather than its rows (groups, trajectories and their rewards, each group's oldest
version, retokenization breaks: `BatchSummary`) travels with the part that holds the
parent's row 0 and is empty in the others, so summing the parts' summaries over
micro-batches and data-parallel ranks counts each group and trajectory once.

Each row is scored at the temperature its call was sampled with (``row_temperature``,
from the segment's `SamplingRecord`; NaN where the record has none, a segment of an
earlier release, which the train step scores at the trainer's configured temperature and
`BatchSummary` counts as ``unrecorded_rows``). A row that cannot carry a gradient is never
in the batch: a greedy call (temperature 0: its support is the argmax alone) and a call
capped at one candidate (``top_k = 1``) give ``log p^S = 0`` at every token whatever the
weights, so they are left out and counted by reason (``excluded_rows``: ``"greedy"``,
``"top_k_1"``, with their tokens in ``excluded_tokens``); their trajectories' rewards
still count in the group's advantages.

Every segment of a trajectory gets that trajectory's advantage, computed per group
from the group's rewards by `fleetrl.grpo.group_advantages`. Each row records which
sampler produced it, both its kind (``row_sampler`` into ``sampler_keys``,
``"backend/dtype"``) and the sampler itself (``row_identity`` into
``sampler_identities``, one per sampler id, the identity its first segment carried), so
the step can report the measured mismatch per kind and per sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Sequence

import numpy as np
import torch

from fleetrl.daemon.messages import RolloutGroup, SamplerIdentity
from fleetrl.grpo import group_advantages

from .config import AdvantageConfig
from .errors import BadBatch
from .group_checks import NO_GRADIENT_REASONS, check_group, generated_segment, no_gradient_reason

__all__ = ["NO_GRADIENT_REASONS", "BadBatch", "Batch", "BatchSummary", "build_batch", "check_group",
           "micro_batch_cost", "no_gradient_reason", "sampler_key", "select_rows", "split_rows"]


BREAKS_PREFIX = "retokenization_breaks/"
"""Trajectory metrics ``retokenization_breaks/<cause>`` (set by the environment worker)."""


def sampler_key(backend: str, dtype: str) -> str:
    """The metric key of a sampler kind, e.g. ``"torch/bfloat16"``."""
    return f"{backend}/{dtype}"


@dataclass(frozen=True)
class BatchSummary:
    """What a batch says about its groups and trajectories as a whole (CPU tensors).

    The summaries of the parts of a split batch add up to the whole's (concatenate
    ``rewards`` and ``group_oldest``, add ``retokenization_breaks``)."""

    rewards: torch.Tensor  # [n_trajectories] float32
    group_oldest: torch.Tensor  # [n_groups] long: oldest token version of each group, -1 if none
    retokenization_breaks: dict[str, int] = field(default_factory=dict)
    excluded_rows: dict[str, int] = field(default_factory=dict)
    """Model calls left out of the batch because they cannot carry a gradient, by reason."""
    excluded_tokens: int = 0
    """Their generated tokens."""
    unrecorded_rows: int = 0
    """Rows whose record carries no sampling settings (scored at the configured temperature)."""

    @property
    def n_groups(self) -> int:
        return int(self.group_oldest.numel())

    @property
    def n_trajectories(self) -> int:
        return int(self.rewards.numel())

    @staticmethod
    def empty() -> BatchSummary:
        return BatchSummary(rewards=torch.zeros(0, dtype=torch.float32), group_oldest=torch.zeros(0, dtype=torch.long))


@dataclass(frozen=True)
class Batch:
    """Padded training tensors (B rows, L input positions, T generated, K support)."""

    input_ids: torch.Tensor  # [B, L] long, 0-padded on the right
    attention_mask: torch.Tensor  # [B, L] long
    positions: torch.Tensor  # [B, T] long: input position whose logits predict tokens[b, t]
    tokens: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool
    sampler_logprobs: torch.Tensor  # [B, T] float32, log q^S of the sampled token (0 padding)
    support_ids: torch.Tensor  # [B, T, K] long, -1 padding
    support_logprobs: torch.Tensor  # [B, T, K] float32, -inf padding
    versions: torch.Tensor  # [B, T] long, -1 padding
    support_vocab: torch.Tensor  # [B] bool: the row drew from the whole vocabulary (its listing: q's most likely)
    support_tail: torch.Tensor  # [B, T] float32: q's mass outside the listing (0 on listed rows and padding)
    row_temperature: torch.Tensor  # [B] float32: the temperature the row was sampled at (NaN: not recorded)
    advantages: torch.Tensor  # [B] float32
    row_sampler: torch.Tensor  # [B] long index into sampler_keys
    row_trajectory: torch.Tensor  # [B] long index into rewards
    row_group: torch.Tensor  # [B] long index of the group in the input order
    row_identity: torch.Tensor  # [B] long index into sampler_identities
    prompt_ids: torch.Tensor  # [D, P] long: the D distinct prompts, 0-padded on the right
    prompt_lengths: torch.Tensor  # [D] long, each >= 1
    prefix_index: torch.Tensor  # [B] long: row b's prompt is prompt_ids[prefix_index[b]]
    sampler_keys: tuple[str, ...]
    sampler_identities: tuple[SamplerIdentity, ...]
    """The samplers of the rows, one per sampler id (the identity of its first segment)."""
    rewards: torch.Tensor  # [n_trajectories] float32
    n_groups: int
    retokenization_breaks: dict[str, int] = field(default_factory=dict)
    """Breaks of the batch's trajectories by cause (the harness's token stream was not
    extended; each segment is a row of its own, trained with its own context)."""
    excluded_rows: dict[str, int] = field(default_factory=dict)
    """Model calls of the groups left out because they cannot carry a gradient, by reason
    (module docstring)."""
    excluded_tokens: int = 0
    unrecorded_rows: int = 0
    """Rows whose segment carries no `SamplingRecord` (NaN in ``row_temperature``)."""
    row_origin: tuple[tuple[int, int, int], ...] = ()
    """Per row, where it came from in the groups given to `build_batch`: (group index,
    trajectory index in the group, segment index in the trajectory)."""
    whole: BatchSummary | None = None
    """Set by `select_rows`: the summary this part contributes to the batch it was cut
    from (the parent's for the part holding its row 0, empty for the others). None for a
    batch built by `build_batch`, whose summary is its own (`summary`)."""

    def summary(self) -> BatchSummary:
        """This batch's contribution to the whole batch's groups, trajectories, rewards,
        staleness and breaks (`BatchSummary`)."""
        if self.whole is not None:
            return self.whole
        oldest = torch.full((self.n_groups,), -1, dtype=torch.long)
        rg, v = self.row_group.cpu(), self.versions.cpu()
        for g in range(self.n_groups):
            vg = v[rg == g]
            vg = vg[vg >= 0]
            if vg.numel():
                oldest[g] = int(vg.min())
        return BatchSummary(rewards=self.rewards.detach().cpu().float(), group_oldest=oldest,
                            retokenization_breaks=dict(self.retokenization_breaks),
                            excluded_rows=dict(self.excluded_rows), excluded_tokens=self.excluded_tokens,
                            unrecorded_rows=self.unrecorded_rows)

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on ``device``."""
        return Batch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                        for k, v in self.__dict__.items()})

    @property
    def n_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def token_sampler(self) -> torch.Tensor:
        """[B, T] sampler-kind index of every token (rows come from one model call each)."""
        return self.row_sampler[:, None].expand_as(self.tokens)

    @property
    def token_identity(self) -> torch.Tensor:
        """[B, T] index into ``sampler_identities`` of every token."""
        return self.row_identity[:, None].expand_as(self.tokens)


def build_batch(groups: Sequence[RolloutGroup], advantage: AdvantageConfig = AdvantageConfig()) -> Batch:
    """Convert ``groups`` into a `Batch`; raises `BadBatch` naming the offending segment."""
    rows: list[tuple[np.ndarray, ...]] = []
    row_adv: list[float] = []
    row_sampler: list[int] = []
    row_traj: list[int] = []
    row_group: list[int] = []
    row_identity: list[int] = []
    row_vocab: list[bool] = []
    row_temp: list[float] = []
    excluded: dict[str, int] = {}
    excluded_tokens = 0
    keys: dict[str, int] = {}
    identities: dict[str, int] = {}  # sampler id -> index into ident_list
    ident_list: list[SamplerIdentity] = []
    rewards: list[float] = []
    prompt_of: dict[bytes, int] = {}  # prompt ids (int64 bytes) -> index of the distinct prompt
    distinct: list[np.ndarray] = []
    prefix_index: list[int] = []
    breaks: dict[str, int] = {}
    origin: list[tuple[int, int, int]] = []
    for gi, group in enumerate(groups):
        if not group.trajectories:
            raise BadBatch(f"group {group.group_id!r} of task {group.task_id!r} has no trajectories")
        r = torch.tensor(group.rewards, dtype=torch.float64)
        if not torch.isfinite(r).all():
            raise BadBatch(f"group {group.group_id!r} has a non-finite reward: {list(group.rewards)}")
        adv = group_advantages(r, std_normalize=advantage.std_normalize,
                               leave_one_out=advantage.leave_one_out).tolist()
        for tg, (traj, a) in enumerate(zip(group.trajectories, adv)):
            ti = len(rewards)
            rewards.append(float(traj.reward))
            for key, n in traj.metrics.items():
                if key.startswith(BREAKS_PREFIX) and n:
                    cause = key[len(BREAKS_PREFIX):]
                    breaks[cause] = breaks.get(cause, 0) + int(n)
            for si, seg in enumerate(traj.segments):
                got = generated_segment(group, traj, si)
                if got is None:
                    continue
                _, prompt, tokens = got
                off = seg.support.offsets.to_numpy()
                why = no_gradient_reason(seg)
                if why is not None:
                    excluded[why] = excluded.get(why, 0) + 1
                    excluded_tokens += int(tokens.size)
                    continue
                sids = seg.support.ids.to_numpy().astype(np.int64)
                slps = seg.support.logprobs.to_numpy().astype(np.float32)
                key = sampler_key(seg.sampler.backend, seg.sampler.dtype)
                keys.setdefault(key, len(keys))
                if seg.sampler.sampler_id not in identities:
                    identities[seg.sampler.sampler_id] = len(ident_list)
                    ident_list.append(seg.sampler)
                tail = (seg.support.tail_mass.to_numpy().astype(np.float32) if seg.support.tail_mass is not None
                        else np.zeros(tokens.size, dtype=np.float32))
                rows.append((prompt, tokens, seg.logprobs.to_numpy().astype(np.float32),
                             off, sids, slps, seg.versions.to_numpy().astype(np.int64), tail))
                row_vocab.append(seg.support.whole_vocabulary)
                row_temp.append(math.nan if seg.sampling is None else float(seg.sampling.temperature))
                row_adv.append(float(a))
                row_sampler.append(keys[key])
                row_traj.append(ti)
                row_group.append(gi)
                row_identity.append(identities[seg.sampler.sampler_id])
                origin.append((gi, tg, si))
                pi = prompt_of.setdefault(prompt.tobytes(), len(distinct))
                if pi == len(distinct):
                    distinct.append(prompt)
                prefix_index.append(pi)
    B = len(rows)
    L = max((p.size + t.size for p, t, *_ in rows), default=1)
    T = max((t.size for _, t, *_ in rows), default=1)
    K = max((int(np.diff(o).max()) for _, _, _, o, *_ in rows), default=1)
    K = max(K, 1)  # a whole-vocabulary row may list nothing
    input_ids = np.zeros((B, L), dtype=np.int64)
    attn = np.zeros((B, L), dtype=np.int64)
    positions = np.zeros((B, T), dtype=np.int64)
    tok = np.zeros((B, T), dtype=np.int64)
    mask = np.zeros((B, T), dtype=bool)
    slp = np.zeros((B, T), dtype=np.float32)
    sup_ids = np.full((B, T, K), -1, dtype=np.int64)
    sup_lps = np.full((B, T, K), -np.inf, dtype=np.float32)
    vers = np.full((B, T), -1, dtype=np.int64)
    tails = np.zeros((B, T), dtype=np.float32)
    for b, (prompt, tokens, lps, off, sids, slps, v, tail) in enumerate(rows):
        P, N = prompt.size, tokens.size
        input_ids[b, :P] = prompt
        input_ids[b, P:P + N] = tokens
        attn[b, :P + N] = 1
        positions[b, :N] = np.arange(P - 1, P - 1 + N)
        tok[b, :N] = tokens
        mask[b, :N] = True
        slp[b, :N] = lps
        vers[b, :N] = v
        tails[b, :N] = tail
        sizes = np.diff(off)
        row = np.repeat(np.arange(N), sizes)
        col = np.arange(off[-1]) - np.repeat(off[:-1], sizes)
        sup_ids[b, row, col] = sids
        sup_lps[b, row, col] = slps
    prompt_ids = np.zeros((len(distinct), max((p.size for p in distinct), default=1)), dtype=np.int64)
    for d, prompt in enumerate(distinct):
        prompt_ids[d, :prompt.size] = prompt
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attn),
        positions=torch.from_numpy(positions),
        tokens=torch.from_numpy(tok),
        loss_mask=torch.from_numpy(mask),
        sampler_logprobs=torch.from_numpy(slp),
        support_ids=torch.from_numpy(sup_ids),
        support_logprobs=torch.from_numpy(sup_lps),
        versions=torch.from_numpy(vers),
        support_vocab=torch.tensor(row_vocab, dtype=torch.bool),
        support_tail=torch.from_numpy(tails),
        row_temperature=torch.tensor(row_temp, dtype=torch.float32),
        advantages=torch.tensor(row_adv, dtype=torch.float32),
        row_sampler=torch.tensor(row_sampler, dtype=torch.long),
        row_trajectory=torch.tensor(row_traj, dtype=torch.long),
        row_group=torch.tensor(row_group, dtype=torch.long),
        row_identity=torch.tensor(row_identity, dtype=torch.long),
        prompt_ids=torch.from_numpy(prompt_ids),
        prompt_lengths=torch.tensor([p.size for p in distinct], dtype=torch.long),
        prefix_index=torch.tensor(prefix_index, dtype=torch.long),
        sampler_keys=tuple(keys),
        sampler_identities=tuple(ident_list),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        n_groups=len(groups),
        retokenization_breaks=breaks,
        excluded_rows=excluded,
        excluded_tokens=excluded_tokens,
        unrecorded_rows=sum(1 for t in row_temp if math.isnan(t)),
        row_origin=tuple(origin),
    )


def select_rows(batch: Batch, rows: Sequence[int] | torch.Tensor) -> Batch:
    """The `Batch` of ``rows`` of ``batch`` (in the given order), a valid batch of its own.

    Padding is trimmed to the selected rows (``L``, ``T``, ``K`` and the prompt width
    ``P`` are their longest); the distinct prompts, trajectories (``rewards``) and groups
    the rows use are kept in first-use order and re-indexed; ``sampler_keys`` and
    ``sampler_identities`` are kept whole (``row_sampler`` and ``row_identity`` are
    unchanged). A trajectory whose segments fall in two
    selections has its reward in both selections' ``rewards``.

    Whole-batch figures: the selection holding ``batch``'s row 0 carries
    ``batch.summary()`` (and ``retokenization_breaks``), every other selection an empty
    `BatchSummary` (and no breaks), so over a partition of the rows each group and
    trajectory is counted once (`train_step` sums summaries over micro-batches and
    ranks). A batch with no rows has no row 0: each selection of it carries its summary.
    """
    idx = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
    B = int(batch.tokens.shape[0])
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= B):
        raise IndexError(f"select_rows: row indices must be in [0, {B}), got {idx.tolist()}")
    if idx.numel() != idx.unique().numel():
        raise ValueError(f"select_rows: a row is selected twice: {idx.tolist()}")
    attn = batch.attention_mask[idx]
    mask = batch.loss_mask[idx]
    L = max(int(attn.sum(-1).max()), 1) if idx.numel() else 1
    T = max(int(mask.sum(-1).max()), 1) if idx.numel() else 1
    sup = batch.support_ids[idx, :T]
    K = max(int((sup >= 0).sum(-1).max()), 1) if idx.numel() else 1

    def reindex(values: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Distinct values in first-use order, and each value's position among them."""
        order: dict[int, int] = {}
        for v in values.tolist():
            order.setdefault(v, len(order))
        used = list(order)
        return used, torch.tensor([order[v] for v in values.tolist()], dtype=torch.long)

    prompts, prefix_index = reindex(batch.prefix_index[idx])
    trajs, row_traj = reindex(batch.row_trajectory[idx])
    groups, row_group = reindex(batch.row_group[idx])
    owner = batch.tokens.shape[0] == 0 or bool((idx == 0).any())
    whole = batch.summary() if owner else BatchSummary.empty()
    plens = batch.prompt_lengths[prompts] if prompts else torch.zeros(0, dtype=torch.long)
    P = max(int(plens.max()), 1) if prompts else 1
    prompt_ids = batch.prompt_ids[prompts, :P] if prompts else torch.zeros((0, 1), dtype=torch.long)
    return Batch(
        input_ids=batch.input_ids[idx, :L].contiguous(),
        attention_mask=attn[:, :L].contiguous(),
        positions=batch.positions[idx, :T].contiguous(),
        tokens=batch.tokens[idx, :T].contiguous(),
        loss_mask=mask[:, :T].contiguous(),
        sampler_logprobs=batch.sampler_logprobs[idx, :T].contiguous(),
        support_ids=sup[:, :, :K].contiguous(),
        support_logprobs=batch.support_logprobs[idx, :T, :K].contiguous(),
        versions=batch.versions[idx, :T].contiguous(),
        support_vocab=batch.support_vocab[idx].contiguous(),
        support_tail=batch.support_tail[idx, :T].contiguous(),
        row_temperature=batch.row_temperature[idx].contiguous(),
        advantages=batch.advantages[idx].contiguous(),
        row_sampler=batch.row_sampler[idx].contiguous(),
        row_trajectory=row_traj.to(batch.row_trajectory.device),
        row_group=row_group.to(batch.row_group.device),
        row_identity=batch.row_identity[idx].contiguous(),
        prompt_ids=prompt_ids.contiguous(),
        prompt_lengths=plens.contiguous(),
        prefix_index=prefix_index.to(batch.prefix_index.device),
        sampler_keys=batch.sampler_keys,
        sampler_identities=batch.sampler_identities,
        rewards=batch.rewards[trajs].contiguous() if trajs else batch.rewards[:0].clone(),
        n_groups=len(groups),
        retokenization_breaks=dict(whole.retokenization_breaks),
        excluded_rows=dict(whole.excluded_rows),
        excluded_tokens=whole.excluded_tokens,
        unrecorded_rows=whole.unrecorded_rows,
        row_origin=tuple(batch.row_origin[i] for i in idx.tolist()) if batch.row_origin else (),
        whole=whole,
    )


def micro_batch_cost(row_lengths: Sequence[int]) -> int:
    """Tokens of a micro-batch of rows of these lengths (prompt + generated each) in
    the padded ``[B, L]`` layout: ``B * max length``."""
    return len(row_lengths) * max(row_lengths, default=0)


def split_rows(batch: Batch, max_tokens: int) -> list[Batch]:
    """Cut ``batch`` into micro-batches of at most ``max_tokens`` tokens each (pure).

    A micro-batch's size is counted as its padded full-row layout: ``rows x the longest
    row's prompt + generated tokens`` (`micro_batch_cost`; padding included, whatever
    the forward then computes; the prompt-sharing forward computes at most about that).
    Rules, in order: rows stay in order (concatenating the micro-batches' rows gives the
    batch's rows); a row is never split; a run of consecutive rows with the same prompt
    (the attempts of a group) stays in one micro-batch whenever it fits in an empty
    one; a run that does not fit is packed row by row; a single row over the budget
    goes alone. Each micro-batch is a valid `Batch` (`select_rows`); the first carries
    the batch's `BatchSummary`, the others an empty one. An empty batch is one (empty)
    micro-batch.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"split_rows: max_tokens must be an int >= 1, got {max_tokens!r}")
    B = int(batch.tokens.shape[0])
    if B == 0:
        return [batch]
    lengths = batch.attention_mask.sum(-1).tolist()
    prefix = batch.prefix_index.tolist()
    runs: list[list[int]] = []
    for b in range(B):
        if runs and prefix[runs[-1][-1]] == prefix[b]:
            runs[-1].append(b)
        else:
            runs.append([b])
    parts: list[list[int]] = []
    cur: list[int] = []

    def fits(rows: list[int]) -> bool:
        return micro_batch_cost([lengths[r] for r in rows]) <= max_tokens

    for run in runs:
        if cur and fits(cur + run):
            cur = cur + run
        elif fits(run):
            if cur:
                parts.append(cur)
            cur = list(run)
        else:
            for r in run:
                if cur and fits(cur + [r]):
                    cur.append(r)
                else:
                    if cur:
                        parts.append(cur)
                    cur = [r]
    parts.append(cur)
    return [select_rows(batch, rows) for rows in parts]
