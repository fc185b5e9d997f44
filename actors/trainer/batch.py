"""RolloutGroups -> padded tensors for one train step (pure, no model).

One row per `TokenSegment` (one model call) that generated at least one token: the
row's input is ``prompt_ids + token_ids``; the logit at input position ``P - 1 + t``
(``P`` the prompt length) predicts generated token ``t``, so ``positions[b, t] = P - 1 + t``.
Generated-token arrays are left-aligned in ``[B, T]`` (``T`` = longest generation) with
``loss_mask`` true exactly on real generated tokens; prompt tokens are never in the loss.
Supports are unpacked from CSR into ``[B, T, K]`` (``K`` = largest support in the batch),
padded with id ``-1`` and log-prob ``-inf`` (the `fleetrl.grpo` convention).

Rows whose prompts are identical (the attempts of one group, usually) share one entry of
``prompt_ids`` (the distinct prompts, right-padded, first-seen order); ``prefix_index[b]``
names row ``b``'s entry. `fleetrl.actors.trainer.prefix` uses it to run each distinct
prompt through the model once per step instead of once per row.

Every segment of a trajectory gets that trajectory's advantage, computed per group
from the group's rewards by `fleetrl.grpo.group_advantages`. Each row records which
sampler produced it (``"backend/dtype"`` keys) so the step can report the mismatch KL
per (backend, dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence

import numpy as np
import torch

from fleetrl.daemon.messages import RolloutGroup
from fleetrl.daemon.tokens import check_sampled_tokens
from fleetrl.grpo import group_advantages

from .config import AdvantageConfig
from .errors import BadBatch

__all__ = ["BadBatch", "Batch", "build_batch", "check_group", "sampler_key"]


BREAKS_PREFIX = "retokenization_breaks/"
"""Trajectory metrics ``retokenization_breaks/<cause>`` (set by the environment worker)."""


def sampler_key(backend: str, dtype: str) -> str:
    """The metric key of a sampler kind, e.g. ``"torch/bfloat16"``."""
    return f"{backend}/{dtype}"


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
    advantages: torch.Tensor  # [B] float32
    row_sampler: torch.Tensor  # [B] long index into sampler_keys
    row_trajectory: torch.Tensor  # [B] long index into rewards
    row_group: torch.Tensor  # [B] long index of the group in the input order
    prompt_ids: torch.Tensor  # [D, P] long: the D distinct prompts, 0-padded on the right
    prompt_lengths: torch.Tensor  # [D] long, each >= 1
    prefix_index: torch.Tensor  # [B] long: row b's prompt is prompt_ids[prefix_index[b]]
    sampler_keys: tuple[str, ...]
    rewards: torch.Tensor  # [n_trajectories] float32
    n_groups: int
    retokenization_breaks: dict[str, int] = field(default_factory=dict)
    """Breaks of the batch's trajectories by cause (the harness's token stream was not
    extended; each segment is a row of its own, trained with its own context)."""

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on ``device``."""
        return Batch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                        for k, v in self.__dict__.items()})

    @property
    def n_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def token_sampler(self) -> torch.Tensor:
        """[B, T] sampler index of every token (rows come from one model call each)."""
        return self.row_sampler[:, None].expand_as(self.tokens)


def check_group(group: RolloutGroup, vocab_size: int, *, tol: float = 5e-3) -> None:
    """Raise `BadBatch` naming group, attempt, segment and token if ``group`` cannot be
    trained on: no trajectories, a non-finite reward, an empty prompt before generated
    tokens, a token id outside the vocabulary, a sampled token missing from its reported
    support, or support log-probs that are not a normalised log q^S agreeing with the
    token's reported log-prob. Checked at admission, so a bad group is refused (and
    reported) instead of crashing the train step that would contain it."""
    if not group.trajectories:
        raise BadBatch(f"group {group.group_id!r} of task {group.task_id!r} has no trajectories")
    for traj in group.trajectories:
        if not np.isfinite(traj.reward):
            raise BadBatch(f"group {group.group_id!r}, attempt {traj.attempt_id!r}: reward {traj.reward} "
                           "is not finite")
        for si, seg in enumerate(traj.segments):
            where = f"group {group.group_id!r}, attempt {traj.attempt_id!r}, segment {si}"
            tokens = seg.token_ids.to_numpy().astype(np.int64)
            prompt = seg.prompt_ids.to_numpy().astype(np.int64)
            if tokens.size == 0:
                continue
            if prompt.size == 0:
                raise BadBatch(f"{where}: empty prompt (no position predicts the first token)")
            for name, ids in (("prompt_ids", prompt), ("token_ids", tokens),
                              ("support.ids", seg.support.ids.to_numpy())):
                bad = (ids < 0) | (ids >= vocab_size)
                if bad.any():
                    i = int(np.argmax(bad))
                    raise BadBatch(f"{where}: {name}[{i}] = {int(ids[i])} is not a token id in [0, {vocab_size})")
            try:
                check_sampled_tokens(tokens, seg.logprobs, seg.support, tol=tol, normalised=True)
            except ValueError as exc:
                raise BadBatch(f"{where}: {exc}") from exc


def build_batch(groups: Sequence[RolloutGroup], advantage: AdvantageConfig = AdvantageConfig()) -> Batch:
    """Convert ``groups`` into a `Batch`; raises `BadBatch` naming the offending segment."""
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    row_adv: list[float] = []
    row_sampler: list[int] = []
    row_traj: list[int] = []
    row_group: list[int] = []
    keys: dict[str, int] = {}
    rewards: list[float] = []
    prompt_of: dict[bytes, int] = {}  # prompt ids (int64 bytes) -> index of the distinct prompt
    distinct: list[np.ndarray] = []
    prefix_index: list[int] = []
    breaks: dict[str, int] = {}
    for gi, group in enumerate(groups):
        if not group.trajectories:
            raise BadBatch(f"group {group.group_id!r} of task {group.task_id!r} has no trajectories")
        r = torch.tensor(group.rewards, dtype=torch.float64)
        if not torch.isfinite(r).all():
            raise BadBatch(f"group {group.group_id!r} has a non-finite reward: {list(group.rewards)}")
        adv = group_advantages(r, std_normalize=advantage.std_normalize,
                               leave_one_out=advantage.leave_one_out).tolist()
        for traj, a in zip(group.trajectories, adv):
            ti = len(rewards)
            rewards.append(float(traj.reward))
            for key, n in traj.metrics.items():
                if key.startswith(BREAKS_PREFIX) and n:
                    cause = key[len(BREAKS_PREFIX):]
                    breaks[cause] = breaks.get(cause, 0) + int(n)
            for si, seg in enumerate(traj.segments):
                where = f"group {group.group_id!r}, attempt {traj.attempt_id!r}, segment {si}"
                prompt = seg.prompt_ids.to_numpy().astype(np.int64)
                tokens = seg.token_ids.to_numpy().astype(np.int64)
                if tokens.size == 0:
                    continue
                if prompt.size == 0:
                    raise BadBatch(f"{where}: empty prompt (no position predicts the first token)")
                off = seg.support.offsets.to_numpy()
                sids = seg.support.ids.to_numpy().astype(np.int64)
                slps = seg.support.logprobs.to_numpy().astype(np.float32)
                key = sampler_key(seg.sampler.backend, seg.sampler.dtype)
                keys.setdefault(key, len(keys))
                rows.append((prompt, tokens, seg.logprobs.to_numpy().astype(np.float32),
                             off, sids, slps, seg.versions.to_numpy().astype(np.int64)))
                row_adv.append(float(a))
                row_sampler.append(keys[key])
                row_traj.append(ti)
                row_group.append(gi)
                pi = prompt_of.setdefault(prompt.tobytes(), len(distinct))
                if pi == len(distinct):
                    distinct.append(prompt)
                prefix_index.append(pi)
    B = len(rows)
    L = max((p.size + t.size for p, t, *_ in rows), default=1)
    T = max((t.size for _, t, *_ in rows), default=1)
    K = max((int(np.diff(o).max()) for _, _, _, o, *_ in rows), default=1)
    input_ids = np.zeros((B, L), dtype=np.int64)
    attn = np.zeros((B, L), dtype=np.int64)
    positions = np.zeros((B, T), dtype=np.int64)
    tok = np.zeros((B, T), dtype=np.int64)
    mask = np.zeros((B, T), dtype=bool)
    slp = np.zeros((B, T), dtype=np.float32)
    sup_ids = np.full((B, T, K), -1, dtype=np.int64)
    sup_lps = np.full((B, T, K), -np.inf, dtype=np.float32)
    vers = np.full((B, T), -1, dtype=np.int64)
    for b, (prompt, tokens, lps, off, sids, slps, v) in enumerate(rows):
        P, N = prompt.size, tokens.size
        input_ids[b, :P] = prompt
        input_ids[b, P:P + N] = tokens
        attn[b, :P + N] = 1
        positions[b, :N] = np.arange(P - 1, P - 1 + N)
        tok[b, :N] = tokens
        mask[b, :N] = True
        slp[b, :N] = lps
        vers[b, :N] = v
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
        advantages=torch.tensor(row_adv, dtype=torch.float32),
        row_sampler=torch.tensor(row_sampler, dtype=torch.long),
        row_trajectory=torch.tensor(row_traj, dtype=torch.long),
        row_group=torch.tensor(row_group, dtype=torch.long),
        prompt_ids=torch.from_numpy(prompt_ids),
        prompt_lengths=torch.tensor([p.size for p in distinct], dtype=torch.long),
        prefix_index=torch.tensor(prefix_index, dtype=torch.long),
        sampler_keys=tuple(keys),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        n_groups=len(groups),
        retokenization_breaks=breaks,
    )
