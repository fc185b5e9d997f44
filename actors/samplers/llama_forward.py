"""A decoder forward pass with a key/value cache, written for batched decoding.

One forward for the Llama, Qwen2, Qwen3 and Mistral families, with per-family options
in `DecoderShape` (q/k/v and output biases, per-head q/k RMSNorm, a sliding attention
window). The arithmetic follows Hugging Face's `LlamaForCausalLM` (and its Qwen2,
Qwen3, Mistral variants) step by step (RMSNorm in fp32 then cast back and scaled,
rotary embeddings from an fp32 table cast to the activation dtype, SwiGLU MLP,
grouped-query attention, softmax in fp32 inside SDPA), so in fp32 its logits equal a
full transformers forward to float rounding (tests/samplers/test_families.py). A config
feature it does not implement is refused by `DecoderShape.from_config` with
`UnsupportedModel` naming the feature. Weights are read through a
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
position is its column minus its padding; padded key columns are masked out. Columns
of one row are consecutive positions, so a sliding window over columns is the window
over positions; windowed layers narrow the caller's mask (`window_band`), the cache
keeps every column.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from fleetrl.actors.samplers.errors import UnsupportedModel

__all__ = ["FP16_ACC_BLOCK", "DecoderShape", "Fp16AccWeight", "KVCache", "LlamaShape", "MatmulReader",
           "UnsupportedModel", "WeightReader", "RopeTable", "decoder_forward", "fp16_accumulate_linear",
           "fp16_accumulate_weight", "lm_logits", "attention_mask", "projection", "window_band"]


_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
"""The ``model_type``s this forward runs (fleetrl.actors.model.families)."""


@dataclass(frozen=True)
class DecoderShape:
    """The numbers and per-family options of a decoder config that the forward needs."""

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
    family: str = "llama"
    """The config's ``model_type``: llama, qwen2, qwen3 or mistral."""
    attention_bias: bool = False
    """The q, k and v projections add a bias (qwen2 always; llama/qwen3 with
    ``attention_bias``)."""
    output_bias: bool = False
    """The attention output projection (o_proj) adds a bias (llama/qwen3 with
    ``attention_bias``; never qwen2)."""
    qk_norm: bool = False
    """Queries and keys go through a per-head RMSNorm (``q_norm``/``k_norm``, weights of
    size head_dim) before the rotary embedding (qwen3)."""
    sliding_window: int | None = None
    """Keys a query may attend on a windowed layer, itself included: key column k is
    visible from query column c when c - sliding_window < k <= c (transformers' and
    vLLM's definition). None: no layer is windowed."""
    sliding_layers: tuple[int, ...] = ()
    """The layers that use `sliding_window` (every layer for mistral; for qwen2/qwen3 the
    ``sliding_attention`` entries of ``layer_types``)."""

    @classmethod
    def from_config(cls, config: Any) -> DecoderShape:
        """From a transformers config of a supported family; raises UnsupportedModel naming
        the first feature this forward lacks."""
        family = getattr(config, "model_type", None)
        if family not in _FAMILIES:
            raise UnsupportedModel(f"model_type {family!r} is not supported (supported: {', '.join(_FAMILIES)})")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise UnsupportedModel(f"rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise UnsupportedModel("config has no rope_theta")
        if float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
            raise UnsupportedModel("partial_rotary_factor != 1 is not supported")
        if getattr(config, "mlp_bias", False):
            raise UnsupportedModel("config.mlp_bias=True is not supported")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        if (getattr(config, "pretraining_tp", 1) or 1) != 1:
            raise UnsupportedModel("pretraining_tp != 1 is not supported")
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        biased = bool(getattr(config, "attention_bias", False))
        window, sliding = _sliding_layers(config, family)
        _check_window(window)
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
            family=family,
            attention_bias=family == "qwen2" or (family in ("llama", "qwen3") and biased),
            output_bias=family in ("llama", "qwen3") and biased,
            qk_norm=family == "qwen3",
            sliding_window=window,
            sliding_layers=sliding,
        )

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to the whole prefix."""
        return self.sliding_window if layer in self.sliding_layers else None

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight by its Hugging Face name, with its shape (biases and q/k norms
        included where the family has them)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
            if self.attention_bias:
                shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)}
            if self.output_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    @property
    def lm_head_name(self) -> str:
        return "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"


LlamaShape = DecoderShape
"""The former name of `DecoderShape` (it covers every family now)."""


def _sliding_layers(config: Any, family: str) -> tuple[int | None, tuple[int, ...]]:
    """(window, windowed layers) of a config, as transformers applies them."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if family == "llama":
        return None, ()
    if family == "mistral":
        # transformers' Mistral windows every layer whenever sliding_window is set
        return (None, ()) if window is None else (int(window), tuple(range(n)))
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise UnsupportedModel(f"layer_types {unknown} are not supported (only full_attention, sliding_attention)")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not sliding or window is None:
        return None, ()
    return int(window), sliding


def _check_window(window: int | None) -> int | None:
    if window is not None and window < 1:
        raise UnsupportedModel(f"sliding_window {window} is not supported (must be >= 1 or null)")
    return window


class WeightReader(Protocol):
    """Gives each weight by Hugging Face name as a dense tensor in the compute dtype."""

    def __call__(self, name: str) -> torch.Tensor: ...


FP16_ACC_BLOCK = 16
"""Inner-dimension elements per fp16 accumulation step: the k of the fp16 tensor-core
instructions (``mma.sync`` m16n8k16 on Ampere/Ada/Hopper, Hopper's ``wgmma`` k16), each
of which adds a k-long dot product to the fp16 accumulator and rounds once."""

_PARTIAL_ELEMS = 1 << 22
"""fp32 elements of block partial products `fp16_accumulate_linear` holds at once (16 MiB)."""


@dataclass(frozen=True)
class Fp16AccWeight:
    """A projection weight laid out for `fp16_accumulate_linear` (`fp16_accumulate_weight`)."""

    blocks_BKN: torch.Tensor
    """fp32 holding the fp16 weight's values, transposed and cut along the inner dimension
    into blocks of `FP16_ACC_BLOCK` (the last one zero-padded): [blocks, block, out]."""
    in_features: int


class MatmulReader(Protocol):
    """Gives a projection weight for the matmul emulations of `projection`: an fp32 tensor
    holding the rounded values (fp32 accumulation), or an `Fp16AccWeight`."""

    def __call__(self, name: str) -> torch.Tensor | Fp16AccWeight: ...


def fp16_accumulate_weight(w_NK: torch.Tensor, block: int = FP16_ACC_BLOCK) -> Fp16AccWeight:
    """Lay out an fp16 weight [out, in] for `fp16_accumulate_linear`."""
    if w_NK.dtype != torch.float16 or w_NK.dim() != 2:
        raise ValueError(f"fp16_accumulate_weight: expected a 2-D float16 weight, got {w_NK.dtype} "
                         f"of shape {tuple(w_NK.shape)}")
    if block < 1:
        raise ValueError(f"fp16_accumulate_weight: block must be >= 1, got {block}")
    N, K = w_NK.shape
    nb = -(-K // block)
    w = F.pad(w_NK.to(torch.float32), (0, nb * block - K))
    return Fp16AccWeight(w.view(N, nb, block).permute(1, 2, 0).contiguous(), K)


def fp16_accumulate_linear(x: torch.Tensor, w: Fp16AccWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ b)`` as an fp16 matmul with fp16 accumulation computes it, on any device.

    The accumulator (an [.., out] fp16 tensor) starts at the bias (or zero); for each
    block of `FP16_ACC_BLOCK` inner elements, in order, the block's dot products are
    computed in fp32 (products of fp16 values are exact in fp32), added to the
    accumulator, and the sum is rounded to fp16: one rounding per block, as a tensor-core
    MMA step rounds ``A_block @ B_block + C`` once. Rounding the fp32 sum of two fp16
    values to fp16 equals a correctly rounded fp16 addition (fp32 has more than
    2 * 11 + 2 significand bits), so the running sum is what fp16 arithmetic gives.
    Cost: one batched fp32 matmul of inner size `FP16_ACC_BLOCK` per block and one
    rounding pass over the output per block (`_PARTIAL_ELEMS` bounds the memory).
    """
    if x.dtype != torch.float16:
        raise ValueError(f"fp16_accumulate_linear: activations must be float16, got {x.dtype}")
    nb, k, N = w.blocks_BKN.shape
    K = w.in_features
    if x.shape[-1] != K:
        raise ValueError(f"fp16_accumulate_linear: input has {x.shape[-1]} features, the weight {K}")
    lead = x.shape[:-1]
    x_MK = F.pad(x.reshape(-1, K).to(torch.float32), (0, nb * k - K))
    M = x_MK.shape[0]
    x_BMK = x_MK.view(M, nb, k).transpose(0, 1)
    if bias is None:
        acc = torch.zeros((M, N), dtype=torch.float32, device=x.device)
    else:
        acc = bias.to(torch.float16).to(torch.float32).expand(M, N).clone()
    group = max(1, min(nb, _PARTIAL_ELEMS // max(1, M * N)))
    for lo in range(0, nb, group):
        parts = torch.bmm(x_BMK[lo:lo + group], w.blocks_BKN[lo:lo + group])  # [group, M, N] fp32
        for part in parts:
            acc = (acc + part).to(torch.float16).to(torch.float32)
    return acc.to(torch.float16).view(*lead, N)


class RopeTable:
    """cos/sin of every position up to the context length, in fp32 (as HF computes them)."""

    def __init__(self, shape: DecoderShape, device: torch.device) -> None:
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

    def __init__(self, shape: DecoderShape, batch: int, capacity: int, dtype: torch.dtype, device: torch.device):
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


def window_band(start: int, steps: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [steps, start + steps]: True where key column k is not too far behind query
    column c (c - window < k), for queries at columns start..start+steps-1. It bounds keys
    from below only: `decoder_forward` ands it with the causal `attention_mask`."""
    q = torch.arange(start, start + steps, device=device)[:, None]
    k = torch.arange(start + steps, device=device)[None, :]
    return k > q - window


def projection(x: torch.Tensor, w: WeightReader, mm: MatmulReader | None, name: str,
               bias: str | None = None) -> torch.Tensor:
    """`x @ W.T (+ b)` for the weight `name` (and the bias `bias`): in x's dtype, or (with
    `mm`) multiplied in fp32 by `mm(name)`, the bias added in fp32, and rounded back to
    x's dtype (fp32 accumulation, see the module docstring), or, where `mm(name)` is an
    `Fp16AccWeight`, with fp16 accumulation (`fp16_accumulate_linear`)."""
    b = None if bias is None else w(bias)
    if mm is None:
        return F.linear(x, w(name), b)
    m = mm(name)
    if isinstance(m, Fp16AccWeight):
        return fp16_accumulate_linear(x, m, b)
    return F.linear(x.to(torch.float32), m, None if b is None else b.to(torch.float32)).to(x.dtype)


def decoder_forward(
    w: WeightReader,
    shape: DecoderShape,
    rope: RopeTable,
    ids_BT: torch.Tensor,
    positions_BT: torch.Tensor,
    mask_B1TL: torch.Tensor,
    cache: KVCache,
    dtype: torch.dtype,
    mm: MatmulReader | None = None,
) -> torch.Tensor:
    """Run the decoder on `ids_BT` written at cache columns [cache.length, +T).

    Returns the final-normed hidden states [B, T, hidden] and advances `cache.length`.
    With `mm`, projections accumulate in fp32 or fp16 (see `projection`).
    """
    B, T = ids_BT.shape
    start = cache.length
    cache.ensure_capacity(start + T)
    end = start + T
    h_, d = shape.num_heads, shape.head_dim
    kv = shape.num_kv_heads
    eps = shape.rms_norm_eps
    cos, sin = rope(positions_BT, dtype)
    windowed = None
    if shape.sliding_window is not None:
        windowed = mask_B1TL & window_band(start, T, shape.sliding_window, mask_B1TL.device)
    x = F.embedding(ids_BT, w("model.embed_tokens.weight"))
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        attn_p = p + "self_attn."
        a = rms_norm(x, w(p + "input_layernorm.weight"), eps)
        qkv = []
        for proj, heads in (("q", h_), ("k", kv), ("v", kv)):
            bias = f"{attn_p}{proj}_proj.bias" if shape.attention_bias else None
            qkv.append(projection(a, w, mm, f"{attn_p}{proj}_proj.weight", bias).view(B, T, heads, d))
        q, k, v = qkv
        if shape.qk_norm:
            q = rms_norm(q, w(attn_p + "q_norm.weight"), eps)
            k = rms_norm(k, w(attn_p + "k_norm.weight"), eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache.keys[layer][:, :, start:end] = k
        cache.values[layer][:, :, start:end] = v
        attn = F.scaled_dot_product_attention(
            q,
            cache.keys[layer][:, :, :end],
            cache.values[layer][:, :, :end],
            attn_mask=mask_B1TL if windowed is None or shape.window(layer) is None else windowed,
            scale=d**-0.5,
            enable_gqa=kv != h_,
        )
        attn = attn.transpose(1, 2).reshape(B, T, h_ * d)
        x = x + projection(attn, w, mm, attn_p + "o_proj.weight", attn_p + "o_proj.bias" if shape.output_bias else None)
        m = rms_norm(x, w(p + "post_attention_layernorm.weight"), eps)
        gated = F.silu(projection(m, w, mm, p + "mlp.gate_proj.weight")) * projection(m, w, mm, p + "mlp.up_proj.weight")
        x = x + projection(gated, w, mm, p + "mlp.down_proj.weight")
    cache.length = end
    return rms_norm(x, w("model.norm.weight"), shape.rms_norm_eps)


def lm_logits(w: WeightReader, shape: DecoderShape, hidden: torch.Tensor, mm: MatmulReader | None = None
              ) -> torch.Tensor:
    """Logits over the vocabulary, returned in fp32 (computed in the hidden states' dtype,
    or with fp32 / fp16 accumulation and rounded to it when `mm` is given)."""
    return projection(hidden, w, mm, shape.lm_head_name).to(torch.float32)


def dense_reader(weights: Mapping[str, torch.Tensor]) -> WeightReader:
    """A WeightReader over a plain mapping of dense tensors."""
    return weights.__getitem__
