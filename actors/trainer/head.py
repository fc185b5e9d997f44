"""The LM head at a real vocabulary: the trainer computes only what its loss reads.

At V = 151,936 one position's logits are 608 KB in fp32. The loss reads, per generated
position, the logits of the sampler's listed support (at most its cap, 512 by default),
the sampled token's, and on whole-vocabulary rows the log-normaliser over the vocabulary
(`fleetrl.grpo.SupportLogits`). So the trainer runs the model without its head
(`final_hidden`: the final, normed hidden states, captured from the base model with a
forward hook, while the causal LM's own head is asked for no position through
``logits_to_keep``), and applies the head itself in chunks of positions (`SupportHead`):
each chunk's ``[c, V]`` logits exist only inside the chunk, in the forward and again
(recomputed) in the backward, which forms their gradient ``[c, V]`` from the gathered
gradients and multiplies it into the hidden states and the head's weight at once. Peak
memory per micro-batch is then a chunk's logits (``logits_chunk_bytes``) instead of
``[B, T, V]`` fp32 several times over (the forward, its temperature-scaled copy, its
gather at the generated positions, and the dense gradient of each).

Numerics are those of the plain path: the head's matmul in the weight's dtype (bf16 with
FSDP's mixed precision), upcast to fp32, divided by the temperature (each position's
own: a row is scored at the temperature its call was sampled with); the gradient is
formed in fp32 and cast to the weight's dtype for the matmuls, as autograd does through
``.float()``. Rows of a matmul computed in chunks may round differently from one big
matmul (a BLAS chooses its blocking by shape), so logits agree with the plain path to
float rounding (tests/trainer/test_head.py).

FSDP2: the head's weight belongs to the root module's parameter group (`fsdp.shard_model`
shards the decoder blocks and then the root), which FSDP2 keeps unsharded from the
root's forward until its post-backward; `SupportHead` uses that unsharded weight (tied to
the embedding in Qwen3-0.6B) between the two, and its gradient is reduce-scattered with
the root's at the end of the backward, like the gradient the model's own head would
have produced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fleetrl.grpo import SupportLogits

__all__ = ["DEFAULT_LOGITS_CHUNK_BYTES", "SupportHead", "chunk_positions", "final_hidden", "lm_head",
           "support_logits"]

DEFAULT_LOGITS_CHUNK_BYTES = 256 << 20
"""The most memory one chunk's fp32 ``[positions, V]`` logits take (the trainer's
``logits_chunk_mb``): 441 positions at V = 151,936, every position of a small vocabulary."""


def lm_head(model: nn.Module) -> nn.Linear:
    """The causal LM's output projection (``model.lm_head``: Llama, Qwen2, Qwen3, Mistral)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__} has no lm_head Linear: the trainer needs a Llama, Qwen2, Qwen3 "
                         "or Mistral causal LM")
    return head


def final_hidden(model: nn.Module, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """``model(**kwargs)`` without its head: ``(the final normed hidden states [B, L, H],
    the model's output)``. The base model's output is captured by a forward hook on
    ``model.model``; the head runs on no position (``logits_to_keep`` empty)."""
    base = getattr(model, "model", None)
    if not isinstance(base, nn.Module):
        raise ValueError(f"{type(model).__name__} has no base model at model.model")
    captured: list[torch.Tensor] = []

    def keep(_module: nn.Module, _args: Any, output: Any) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = base.register_forward_hook(keep)
    try:
        ids = kwargs.get("input_ids")
        none = torch.empty(0, dtype=torch.long, device=ids.device if isinstance(ids, torch.Tensor) else None)
        out = model(**kwargs, logits_to_keep=none)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"the base model ran {len(captured)} times in one forward")
    return captured[0], out


def chunk_positions(vocab_size: int, chunk_bytes: int) -> int:
    """Positions per chunk so that one chunk's fp32 logits take at most ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


class SupportHead(torch.autograd.Function):
    """``hidden [N, H]`` -> the gathered logits of N positions, chunk by chunk (module
    docstring). Inputs: hidden [N, H]; weight [V, H]; bias [V] or None; ids [N, K] (any
    id for padding: the caller masks it); tokens [N]; the temperature (a number, or one
    per position [N]); positions per chunk; whether to compute the logsumexp over V. Outputs (fp32, or fp64 for an fp64
    weight): the logits at ``ids`` [N, K], at ``tokens`` [N], and their logsumexp over V
    [N] (zeros when not asked)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                tokens: torch.Tensor, temperature: float | torch.Tensor, chunk: int, want_lse: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        N, dtype = hidden.shape[0], _out_dtype(weight)
        zS = hidden.new_empty((N, ids.shape[1]), dtype=dtype)
        za = hidden.new_empty((N,), dtype=dtype)
        lse = hidden.new_zeros((N,), dtype=dtype)
        temperature = _per_position(temperature, N, dtype, hidden.device)
        for s in range(0, N, chunk):
            z = _logits(hidden[s:s + chunk], weight, bias, temperature[s:s + chunk])
            zS[s:s + chunk] = z.gather(1, ids[s:s + chunk])
            za[s:s + chunk] = z.gather(1, tokens[s:s + chunk, None]).squeeze(1)
            if want_lse:
                lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(hidden, weight, bias, ids, tokens)
        ctx.temperature, ctx.chunk, ctx.want_lse = temperature, chunk, want_lse
        return zS, za, lse

    @staticmethod
    def backward(ctx: Any, g_zS: torch.Tensor, g_za: torch.Tensor, g_lse: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, ids, tokens = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        d_hidden = torch.zeros_like(hidden) if need_h else None
        dtype = _out_dtype(weight)
        d_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        d_bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            g = torch.zeros((h.shape[0], weight.shape[0]), dtype=dtype, device=h.device)
            g.scatter_add_(1, ids[s:s + chunk], g_zS[s:s + chunk].to(dtype))
            g.scatter_add_(1, tokens[s:s + chunk, None], g_za[s:s + chunk, None].to(dtype))
            if ctx.want_lse:
                z = _logits(h, weight, bias, T[s:s + chunk])
                g.add_(torch.softmax(z, dim=-1).mul_(g_lse[s:s + chunk, None].to(dtype)))
                del z
            g.div_(T[s:s + chunk, None])
            g_low = g.to(weight.dtype)
            if d_hidden is not None:
                d_hidden[s:s + chunk] = g_low @ weight
            if d_weight is not None:
                if d_weight.dtype == weight.dtype:  # in place: no [V, H] temporary per chunk
                    d_weight.addmm_(g_low.t(), h.to(weight.dtype))
                else:  # a 16-bit weight: its own matmul, summed over chunks in fp32
                    d_weight.add_(g_low.t() @ h.to(weight.dtype))
            if d_bias is not None:
                d_bias.add_(g.sum(0))
        return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None, None)


def _out_dtype(weight: torch.Tensor) -> torch.dtype:
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def _per_position(temperature: float | torch.Tensor, n: int, dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
    """The temperature of each of ``n`` positions ([n], ``dtype``), each finite and > 0."""
    t = torch.as_tensor(temperature, dtype=dtype, device=device)
    t = t.expand(n) if t.dim() == 0 else t.reshape(-1)
    if t.numel() != n:
        raise ValueError(f"SupportHead: {t.numel()} temperatures for {n} positions")
    if n and not bool(((t > 0) & torch.isfinite(t)).all()):
        raise ValueError(f"SupportHead: every temperature must be finite and > 0, got {t.unique().tolist()[:5]}")
    return t.contiguous()


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor
            ) -> torch.Tensor:
    """One chunk's logits, as the model's head computes them, upcast and tempered (one
    temperature per row of ``h``)."""
    return torch.nn.functional.linear(h.to(weight.dtype), weight, bias).to(_out_dtype(weight)) / temperature[:, None]


def support_logits(model: nn.Module, hidden_BTH: torch.Tensor, tokens_BT: torch.Tensor, support_ids_BTK: torch.Tensor,
                   loss_mask_BT: torch.Tensor, *, temperature: float | torch.Tensor, want_vocab_lse: bool,
                   chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES) -> SupportLogits:
    """The `SupportLogits` of a batch from its hidden states at the generated positions:
    computed at loss-mask positions only (the others hold zeros, which the loss ignores),
    ``vocab_lse`` only when ``want_vocab_lse`` (a whole-vocabulary row in the batch).
    ``temperature``: one for every row, or each row's own ([B])."""
    head = lm_head(model)
    B, T, K = support_ids_BTK.shape
    where = loss_mask_BT.nonzero(as_tuple=True)
    h = hidden_BTH[where]
    ids = support_ids_BTK[where].long().clamp(min=0)
    tok = tokens_BT[where].long()
    chunk = chunk_positions(head.weight.shape[0], chunk_bytes)
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        temps = temperature.to(hidden_BTH.device)[:, None].expand(B, T)[where]
    else:
        temps = float(temperature)
    zS, za, lse = SupportHead.apply(h, head.weight, head.bias, ids, tok, temps, chunk, bool(want_vocab_lse))
    dev, dt = hidden_BTH.device, zS.dtype
    support = torch.zeros((B, T, K), dtype=dt, device=dev).index_put(where, zS)
    sampled = torch.zeros((B, T), dtype=dt, device=dev).index_put(where, za)
    vocab_lse = torch.zeros((B, T), dtype=dt, device=dev).index_put(where, lse) if want_vocab_lse else None
    return SupportLogits(support=support, sampled=sampled, vocab_lse=vocab_lse)
