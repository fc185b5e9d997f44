"""A Llama forward pass with a key/value cache, written for batched decoding.

The arithmetic follows Hugging Face's `LlamaForCausalLM` step by step (RMSNorm in fp32
then cast back and scaled, rotary embeddings from an fp32 table cast to the activation
dtype, SwiGLU MLP, grouped-query attention, softmax in fp32 inside SDPA), so in fp32 its
logits equal a full transformers forward to float rounding. Weights are read through a
`WeightReader`, which lets the caller keep them in any storage (plain fp32/bf16/fp16
tensors, or fp8 with scales dequantised for each matmul).

Matmuls: by default each projection is `F.linear` in the activations' dtype. A caller
may pass `mm`, a second reader giving the projection weights as fp32 tensors holding the
same (already rounded) values: each projection then multiplies in fp32 and rounds its
result to the activations' dtype, which is what a bf16/fp16 matmul with fp32
accumulation computes (GPU tensor cores, oneDNN), at fp32 matmul speed on CPUs that
have no native bf16 arithmetic.

Layout: a batch is left-padded, so every row's last prompt token sits in the same cache
column and each decode step writes one new column for the whole batch. A row's
position is its column minus its padding; padded key columns are masked out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from fleetrl.actors.samplers.errors import UnsupportedModel

__all__ = ["KVCache", "LlamaShape", "UnsupportedModel", "WeightReader", "RopeTable", "decoder_forward", "lm_logits",
           "attention_mask", "projection"]


@dataclass(frozen=True)
class LlamaShape:
    """The numbers of a Llama config that the forward pass needs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: Any) -> LlamaShape:
        """From a transformers LlamaConfig; refuses features this forward lacks."""
        if getattr(config, "model_type", None) != "llama":
            raise UnsupportedModel(f"model_type {getattr(config, 'model_type', None)!r} is not 'llama'")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise UnsupportedModel(f"rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise UnsupportedModel("config has no rope_theta")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(config, flag, False):
                raise UnsupportedModel(f"config.{flag}=True is not supported")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        if (getattr(config, "pretraining_tp", 1) or 1) != 1:
            raise UnsupportedModel("pretraining_tp != 1 is not supported")
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(config.tie_word_embeddings),
        )

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight by its Hugging Face name, with its shape."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (self.num_heads * d, h),
                p + "self_attn.k_proj.weight": (self.num_kv_heads * d, h),
                p + "self_attn.v_proj.weight": (self.num_kv_heads * d, h),
                p + "self_attn.o_proj.weight": (h, self.num_heads * d),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    @property
    def lm_head_name(self) -> str:
        return "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"


class WeightReader(Protocol):
    """Gives each weight by Hugging Face name as a dense tensor in the compute dtype."""

    def __call__(self, name: str) -> torch.Tensor: ...


class RopeTable:
    """cos/sin of every position up to the context length, in fp32 (as HF computes them)."""

    def __init__(self, shape: LlamaShape, device: torch.device) -> None:
        d = shape.head_dim
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float) / d))
        positions = torch.arange(shape.max_position_embeddings, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def __call__(self, positions_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, 1, T, D] in `dtype`, broadcasting over heads."""
        return self.cos[positions_BT].to(dtype)[:, None], self.sin[positions_BT].to(dtype)[:, None]


class KVCache:
    """Per-layer keys and values, [B, kv_heads, capacity, head_dim], grown on demand."""

    def __init__(self, shape: LlamaShape, batch: int, capacity: int, dtype: torch.dtype, device: torch.device):
        size = (batch, shape.num_kv_heads, capacity, shape.head_dim)
        # Uninitialised: a column is always written (the prefill writes padding columns
        # too) before any query reads it, since reads stop at `length`.
        self.keys = [torch.empty(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.values = [torch.empty(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.length = 0
        """Columns filled so far (the same for every row)."""

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def ensure_capacity(self, columns: int) -> None:
        """Make room for at least `columns` columns, doubling to keep growth amortised."""
        if columns <= self.capacity:
            return
        new = max(columns, 2 * self.capacity)

        def grow(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty((t.shape[0], t.shape[1], new, t.shape[3]))
            out[:, :, : self.length] = t[:, :, : self.length]
            return out

        self.keys = [grow(t) for t in self.keys]
        self.values = [grow(t) for t in self.values]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows selected by index tensor `rows` (finished rows leave)."""
        self.keys = [t.index_select(0, rows) for t in self.keys]
        self.values = [t.index_select(0, rows) for t in self.values]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF Llama computes it: normalise in fp32, cast back, then scale."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_mask(pads_B: torch.Tensor, start: int, steps: int) -> torch.Tensor:
    """Boolean mask [B, 1, steps, start + steps]: True where a query may attend a key.

    Query at column c (c in start..start+steps-1) sees key columns <= c that are not
    left padding of its row. A padding query sees only itself, which keeps its softmax
    finite; its output is never used.
    """
    device = pads_B.device
    q = torch.arange(start, start + steps, device=device)[:, None]
    k = torch.arange(start + steps, device=device)[None, :]
    causal = k <= q
    real_key = k[None] >= pads_B[:, None, None]
    own = (k == q)[None]
    return ((causal[None] & real_key) | own)[:, None]


def projection(x: torch.Tensor, w: WeightReader, mm: WeightReader | None, name: str) -> torch.Tensor:
    """`x @ W.T` for the weight `name`: in x's dtype, or (with `mm`) multiplied in fp32 by
    `mm(name)` and rounded back to x's dtype (fp32 accumulation, see the module docstring)."""
    if mm is None:
        return F.linear(x, w(name))
    return F.linear(x.to(torch.float32), mm(name)).to(x.dtype)


def decoder_forward(
    w: WeightReader,
    shape: LlamaShape,
    rope: RopeTable,
    ids_BT: torch.Tensor,
    positions_BT: torch.Tensor,
    mask_B1TL: torch.Tensor,
    cache: KVCache,
    dtype: torch.dtype,
    mm: WeightReader | None = None,
) -> torch.Tensor:
    """Run the decoder on `ids_BT` written at cache columns [cache.length, +T).

    Returns the final-normed hidden states [B, T, hidden] and advances `cache.length`.
    With `mm`, projections accumulate in fp32 (see `projection`).
    """
    B, T = ids_BT.shape
    start = cache.length
    cache.ensure_capacity(start + T)
    end = start + T
    h_, d = shape.num_heads, shape.head_dim
    kv = shape.num_kv_heads
    cos, sin = rope(positions_BT, dtype)
    x = F.embedding(ids_BT, w("model.embed_tokens.weight"))
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        a = rms_norm(x, w(p + "input_layernorm.weight"), shape.rms_norm_eps)
        q = projection(a, w, mm, p + "self_attn.q_proj.weight").view(B, T, h_, d).transpose(1, 2)
        k = projection(a, w, mm, p + "self_attn.k_proj.weight").view(B, T, kv, d).transpose(1, 2)
        v = projection(a, w, mm, p + "self_attn.v_proj.weight").view(B, T, kv, d).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache.keys[layer][:, :, start:end] = k
        cache.values[layer][:, :, start:end] = v
        attn = F.scaled_dot_product_attention(
            q,
            cache.keys[layer][:, :, :end],
            cache.values[layer][:, :, :end],
            attn_mask=mask_B1TL,
            scale=d**-0.5,
            enable_gqa=kv != h_,
        )
        attn = attn.transpose(1, 2).reshape(B, T, h_ * d)
        x = x + projection(attn, w, mm, p + "self_attn.o_proj.weight")
        m = rms_norm(x, w(p + "post_attention_layernorm.weight"), shape.rms_norm_eps)
        gated = F.silu(projection(m, w, mm, p + "mlp.gate_proj.weight")) * projection(m, w, mm, p + "mlp.up_proj.weight")
        x = x + projection(gated, w, mm, p + "mlp.down_proj.weight")
    cache.length = end
    return rms_norm(x, w("model.norm.weight"), shape.rms_norm_eps)


def lm_logits(w: WeightReader, shape: LlamaShape, hidden: torch.Tensor, mm: WeightReader | None = None) -> torch.Tensor:
    """Logits over the vocabulary, returned in fp32 (computed in the hidden states' dtype,
    or with fp32 accumulation and rounded to it when `mm` is given)."""
    return projection(hidden, w, mm, shape.lm_head_name).to(torch.float32)


def dense_reader(weights: Mapping[str, torch.Tensor]) -> WeightReader:
    """A WeightReader over a plain mapping of dense tensors."""
    return weights.__getitem__
