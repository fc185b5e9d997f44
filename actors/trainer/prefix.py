"""The trainer's logits at the generated tokens, computing each distinct prompt once.

A train step needs ``logits_BTV[b, t]``: the model's logits at input position
``batch.positions[b, t]`` of row ``b`` (``prompt + generated tokens``), which predict
generated token ``t``; it takes the final hidden states there (``hidden_BTH``) and applies
the head itself, in chunks, reading only what the loss needs (`head`). `plain_hidden`
runs the model over the whole ``[B, L]`` batch. In
GRPO the ``G`` attempts of a group share their prompt, and the prompt is most of each row
(the embedded recipe: ~50 prompt bytes, 10-25 generated), so that recomputes the same
prompt ``G`` times. `shared_prompt_hidden` computes the same values as

1. one forward of the ``D`` distinct prompts (``batch.prompt_ids``, right-padded, with
   their attention mask and positions ``0..P-1``), keeping the KV cache *in the autograd
   graph*, so the loss differentiates through the prompt computation exactly as before;
2. the hidden state predicting generated token 0 of row ``b`` is that forward's at the
   last real prompt position of prompt ``prefix_index[b]``;
3. the cache is expanded to rows with ``index_select`` on its batch dimension (so the
   gradients of the ``G`` rows that share a prompt add up in it), and one forward of the
   generated tokens ``0..T-2`` of every row (``[B, T-1]``, right-padded) against that
   cache, with mask ``[prompt mask of the row's prompt | loss_mask]`` and positions
   ``P_b + t``, gives the hidden states predicting tokens ``1..T-1``. The last generated token is
   never an input: no logit we use depends on it.

Why it is exact: attention is causal, so a prompt position's keys, values and logits do
not depend on what follows it; position ids are the same as in the plain layout
(``P_b + t``); a key that is padding in either layout is masked out (the gap between a
short prompt's end and the longest prompt's end is just more masked keys). Every real
query attends to exactly the same real keys with the same rotary positions, so the
values differ from `plain_hidden` only by floating-point summation order (measured
max |diff| ~1e-6 in fp32, tests/trainer/test_prefix.py), and so do the loss and its
gradients.

No query row is ever fully masked (the source of NaN in SDPA): prompts are
right-padded and non-empty, so every prompt query sees its prompt's first token, and
every completion query sees its row's whole prompt.
"""

from __future__ import annotations

import torch

from .batch import Batch
from .head import final_hidden, lm_head

__all__ = ["plain_hidden", "plain_logits", "shared_prompt_hidden", "shared_prompt_logits"]


def plain_hidden(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``[B, T, H]`` final hidden states at ``batch.positions`` from one forward of the full
    rows (the reference); the head is left to the caller (`fleetrl.actors.trainer.head`).

    No KV cache is built (``use_cache=False``): nothing reads it, and a block that
    recomputes its forward in backward (activation checkpointing) would write it twice."""
    hidden_BLH, _ = final_hidden(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 use_cache=False)
    idx = batch.positions.unsqueeze(-1).expand(-1, -1, hidden_BLH.shape[-1])
    return hidden_BLH.gather(1, idx)


def shared_prompt_hidden(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``[B, T, H]`` final hidden states at ``batch.positions``, equal to `plain_hidden` to
    float rounding, with one forward per distinct prompt (module docstring). Gradients
    flow into the prompt forward through the expanded KV cache."""
    prompts_DP = batch.prompt_ids
    D, P = prompts_DP.shape
    device = prompts_DP.device
    arange_P = torch.arange(P, device=device)
    pmask_DP = (arange_P < batch.prompt_lengths[:, None]).long()
    hidden_DPH, out = final_hidden(model, input_ids=prompts_DP, attention_mask=pmask_DP,
                                   position_ids=arange_P.expand(D, P), use_cache=True)
    last_DH = hidden_DPH[torch.arange(D, device=device), batch.prompt_lengths - 1]
    first_BH = last_DH.index_select(0, batch.prefix_index)
    T = batch.tokens.shape[1]
    if T == 1:
        return first_BH.unsqueeze(1)
    cache = out.past_key_values
    cache.reorder_cache(batch.prefix_index)  # index_select on dim 0 of every layer: [D, ...] -> [B, ...]
    lens_B = batch.prompt_lengths.index_select(0, batch.prefix_index)
    inputs_BT = batch.tokens[:, :T - 1]
    mask_BL = torch.cat([pmask_DP.index_select(0, batch.prefix_index), batch.loss_mask[:, :T - 1].long()], dim=1)
    pos_BT = lens_B[:, None] + torch.arange(T - 1, device=device)
    rest_BTH, _ = final_hidden(model, input_ids=inputs_BT, attention_mask=mask_BL, position_ids=pos_BT,
                               past_key_values=cache, use_cache=True)
    return torch.cat([first_BH.unsqueeze(1), rest_BTH], dim=1)


def plain_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``[B, T, V]`` logits of `plain_hidden` through the model's head (the reference the
    tests and bench/train_step.py compare with; the train step never builds them)."""
    return lm_head(model)(plain_hidden(model, batch))


def shared_prompt_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``[B, T, V]`` logits of `shared_prompt_hidden` through the model's head."""
    return lm_head(model)(shared_prompt_hidden(model, batch))
