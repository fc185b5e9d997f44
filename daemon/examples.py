"""Typical messages, built from a seed: for benchmarks, tests and the docs' figures.

`example_generation` is one model call's `Generation` (supports of ``k`` distinct ids
spread over the vocabulary, most likely first, each holding its sampled token);
`example_trajectory` a whole attempt of several such calls over a growing prompt.
"""

from __future__ import annotations

import numpy as np

from .messages import Generation, SamplerIdentity, SamplingRecord, TokenSegment, Trajectory
from .protocol import Tensor
from .tokens import SupportCSR

__all__ = ["example_generation", "example_trajectory"]

_EXAMPLE_SAMPLER = SamplerIdentity(
    sampler_id="example-0", backend="torch", device_kind="cpu", dtype="bfloat16"
)


def example_generation(
    n_tokens: int = 500, k: int = 20, *, vocab: int = 151_936, version: int = 7, seed: int = 0
) -> Generation:
    """A realistic `Generation`: ``n_tokens`` tokens, each with a support of ``k``."""
    rng = np.random.default_rng(seed)
    # k distinct ids per position, spread over the vocabulary
    start = rng.integers(0, vocab, size=(n_tokens, 1))
    support_ids = ((start + np.arange(k) * (vocab // k)) % vocab).astype(np.int32)
    z = rng.standard_normal((n_tokens, k)).astype(np.float32) * 3
    z = -np.sort(-z, axis=1)  # most likely first, as samplers report it
    support_lp = (z - np.log(np.exp(z).sum(axis=1, keepdims=True))).astype(np.float32)
    pick = np.minimum(rng.geometric(0.5, size=n_tokens) - 1, k - 1)
    rows = np.arange(n_tokens)
    return Generation(
        request_id=f"req-{seed}",
        token_ids=Tensor.from_numpy(support_ids[rows, pick]),
        logprobs=Tensor.from_numpy(support_lp[rows, pick]),
        support=SupportCSR.from_padded(support_ids, support_lp),
        versions=Tensor.from_numpy(np.full(n_tokens, version, dtype=np.int64)),
        sampler=_EXAMPLE_SAMPLER,
        finish_reason="stop",
        sampling=SamplingRecord(temperature=1.0, top_p=1.0, top_k=k, seed=seed),
    )


def example_trajectory(
    n_tokens: int = 2000,
    k: int = 20,
    *,
    n_segments: int = 4,
    prompt_tokens: int = 512,
    vocab: int = 151_936,
    seed: int = 0,
) -> Trajectory:
    """A typical `Trajectory` message: ``n_tokens`` generated tokens with a support of
    ``k`` each, over ``n_segments`` model calls whose prompts grow with the
    conversation (first prompt ``prompt_tokens`` long). For benchmarks and tests."""
    if n_segments < 1 or n_tokens < n_segments:
        raise ValueError(f"need 1 <= n_segments <= n_tokens, got {n_segments}, {n_tokens}")
    rng = np.random.default_rng(seed)
    context = rng.integers(0, vocab, size=prompt_tokens, dtype=np.int32)
    sizes = [n_tokens // n_segments + (i < n_tokens % n_segments) for i in range(n_segments)]
    segments = []
    for i, size in enumerate(sizes):
        gen = example_generation(size, k, vocab=vocab, version=7 + i, seed=seed * 1000 + i)
        segments.append(TokenSegment.from_generation(Tensor.from_numpy(context), gen))
        tool_output = rng.integers(0, vocab, size=64, dtype=np.int32)
        context = np.concatenate([context, gen.token_ids.to_numpy(), tool_output])
    return Trajectory(
        attempt_id=f"attempt-{seed}",
        task_id="task-example",
        group_id="group-example",
        segments=tuple(segments),
        reward=1.0,
        metrics={"tests_passed": 3.0, "wall_s": 41.5},
    )
