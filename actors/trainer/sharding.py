"""Which rows of a step's batch each data-parallel rank trains (pure).

Every rank builds the same `Batch` from the same groups; rank ``r`` of ``world`` trains
the contiguous run of rows `assign_rows` gives it. Runs are balanced by tokens (prompt +
generated per row): the cuts fall where the running total of tokens crosses each
``k/world`` of the whole, so a group's attempts (adjacent rows sharing a prompt) mostly
stay on one rank and keep sharing their prompt's forward. With fewer rows than ranks some
ranks get none; they still take part in every collective (`train_step` with a
collective handles an empty share). The gradient is the same whatever the split: the
loss is a sum over rows divided by the global count (docs/reference/trainer.md).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

from .batch import Batch, select_rows

__all__ = ["assign_rows", "rank_rows"]


def assign_rows(row_tokens: Sequence[int], world: int) -> list[range]:
    """``world`` contiguous ranges covering ``range(len(row_tokens))`` in order, balanced by tokens."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if any(t < 0 for t in row_tokens):
        raise ValueError("row token counts must be >= 0")
    n = len(row_tokens)
    if n <= world:  # one row each, the last ranks none
        return [range(min(r, n), min(r + 1, n)) for r in range(world)]
    prefix = list(accumulate(row_tokens, initial=0))  # prefix[c] = tokens of the first c rows
    total = prefix[-1]
    cuts = [0]
    for k in range(1, world):
        c = bisect_left(prefix, k * total / world)  # first cut whose rows before it reach k/world
        cuts.append(min(max(c, cuts[-1] + 1), n - (world - k)))  # every rank keeps >= 1 row
    cuts.append(n)
    return [range(cuts[r], cuts[r + 1]) for r in range(world)]


def rank_rows(batch: Batch, rank: int, world: int) -> Batch:
    """The rows of ``batch`` that ``rank`` trains (`assign_rows` over prompt + generated tokens)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if world == 1:
        return batch
    lengths = batch.prompt_lengths.index_select(0, batch.prefix_index) + batch.loss_mask.sum(-1)
    share = assign_rows([int(x) for x in lengths], world)[rank]
    return select_rows(batch, list(share))
