"""The tiny models and prompts the sampler tests share (torch backend and vLLM): one
spec builder with the shape both use, and prompts of varied lengths (a code prefix, one
byte, a long line)."""

from __future__ import annotations

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec

PROMPTS = [
    [BOS_ID, *b"def add(a, b):\n    return"],
    [BOS_ID, *b"x"],
    [BOS_ID, *b"print('hello, world')\n# and then some more text to make it longer"],
]


def sampler_spec(*, num_heads: int, num_kv_heads: int) -> TinyLlamaSpec:
    """Grouped-query attention, peaked enough (``initializer_range=0.1``) that top-p
    supports are small and varied; 512 positions."""
    return TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         intermediate_size=128, max_position_embeddings=512, initializer_range=0.1)
