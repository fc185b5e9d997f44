"""What the trainer checks of a group before it trains on it (pure, no model).

`check_group` refuses, at admission, a group the train step could not use (naming group,
attempt, segment and token); `no_gradient_reason` says why a model call's tokens cannot
carry a gradient whatever the weights (greedy, one candidate), so `batch.build_batch`
leaves it out of the batch and counts it instead of training a row of zeros.
"""

from __future__ import annotations

import numpy as np

from fleetrl.daemon.messages import RolloutGroup, TokenSegment, Trajectory
from fleetrl.daemon.tokens import check_sampled_tokens

from .errors import BadBatch

__all__ = ["NO_GRADIENT_REASONS", "check_group", "generated_segment", "no_gradient_reason"]


NO_GRADIENT_REASONS = ("greedy", "top_k_1")
"""Why a model call is left out of a batch (`no_gradient_reason`)."""


def no_gradient_reason(seg: TokenSegment) -> str | None:
    """Why ``seg``'s tokens cannot carry a gradient, by what its call was sampled with,
    or None when they can: ``"greedy"`` (temperature 0), ``"top_k_1"`` (one candidate
    per position). Either way every support has one member, so ``log p^S`` of every
    token is 0 whatever the weights: the row would add only zeros to the loss and its
    tokens to the normaliser. (A record without sampling settings is never excluded.)"""
    if seg.sampling is None:
        return None
    if seg.sampling.greedy:
        return "greedy"
    if seg.sampling.top_k == 1:
        return "top_k_1"
    return None


def generated_segment(group: RolloutGroup, traj: Trajectory, si: int
                      ) -> tuple[str, np.ndarray, np.ndarray] | None:
    """Segment ``si`` of ``traj`` as ``(where, prompt ids, generated ids)`` (int64), where
    names group, attempt and segment; None when it generated nothing (it is no row).
    `BadBatch` for an empty prompt before generated tokens (no position predicts them)."""
    seg = traj.segments[si]
    where = f"group {group.group_id!r}, attempt {traj.attempt_id!r}, segment {si}"
    tokens = seg.token_ids.to_numpy().astype(np.int64)
    if tokens.size == 0:
        return None
    prompt = seg.prompt_ids.to_numpy().astype(np.int64)
    if prompt.size == 0:
        raise BadBatch(f"{where}: empty prompt (no position predicts the first token)")
    return where, prompt, tokens


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
            got = generated_segment(group, traj, si)
            if got is None:
                continue
            where, prompt, tokens = got
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
