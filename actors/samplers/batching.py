"""Which waiting generate requests may share one backend call (pure, no I/O).

A backend call takes one `SamplingParams` for all its prompts, so only requests with
equal parameters can be batched. The seed is the exception that keeps them apart:

* A request *without* a seed gets a random stream either way. Requests with equal
  ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` and ``stop_ids`` share one call;
  the call draws one seed for the whole batch (the torch backend samples every row from
  one generator; vLLM derives one seed per prompt from it), which each generation
  reports in ``Generation.seed``. The batch is reproducible from that seed, its prompts
  in order, its parameters and its weight versions; a single request of it is not
  reproducible alone.
* A request *with* a seed is promised "same seed, weights, prompts and params give the
  same tokens" (`SamplingParams.seed`). Inside a batch its row would share the RNG
  stream with the other rows (and its logits would be computed in a batch of another
  shape, equal only to rounding), so such a request always runs alone, exactly the
  call it would have been without batching.

`take_batch` picks the next batch from a FIFO queue: the oldest request, plus the
oldest later ones compatible with it, up to a limit. Requests it does not take keep
their order, so no request is overtaken for ever by a stream of compatible ones behind it
(it heads the queue once everything before it has gone).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

from fleetrl.daemon.messages import SamplingParams

__all__ = ["batch_key", "take_batch"]

T = TypeVar("T")


def batch_key(params: SamplingParams) -> Hashable | None:
    """What requests must share to run in one call; None: the request runs alone (it has a seed)."""
    if params.seed is not None:
        return None
    return (params.max_tokens, params.temperature, params.top_p, params.top_k, tuple(params.stop_ids))


def take_batch(queue: list[T], key: Callable[[T], Hashable | None], limit: int) -> list[T]:
    """Remove and return the next batch from `queue` (oldest first; see the module docstring).

    The batch is the head of the queue and, when its key is not None, the following
    items with the same key, at most `limit` in all. An empty queue gives an empty batch.
    """
    if limit < 1:
        raise ValueError(f"take_batch: limit must be >= 1, got {limit}")
    if not queue:
        return []
    head = queue[0]
    k = key(head)
    if k is None or limit == 1:
        del queue[0]
        return [head]
    taken: list[T] = []
    rest: list[T] = []
    for item in queue:
        if len(taken) < limit and key(item) == k:
            taken.append(item)
        else:
            rest.append(item)
    queue[:] = rest
    return taken
