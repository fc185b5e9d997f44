"""Supervised warm-up of the tiny model on the synthetic task format.

Before RL the embedded default gives the random-init model a short supervised phase
so that it starts weak but not hopeless: it has learnt the layout (indented
`return <expr>` then `<eos>`) and a rough idea of the families, and its sampled
pass@1 on fresh tasks is low enough that GRPO has room to show an improvement but
high enough that groups of samples are not all zero (zero-variance groups carry no
signal). docs/reference/warmup.md has the recipe, docs/results/warmup.md its measured effect.

Each training example is `prompt + reference_solution(task)` of a task from the
synthetic *training* stream (`fleetrl.harness.synthetic.task_stream`), byte-tokenised
with the model's tokenizer: `<bos>` + prompt bytes, then the completion bytes and the
EOS id (the reference text ends with the literal `<eos>`, which the tokenizer turns
into its EOS token). The loss is the token-mean cross-entropy over the completion
tokens, plus `prompt_loss_weight` times the token-mean cross-entropy over the prompt
(after `<bos>`): predicting each shown output from the examples before it makes the
model work out the function from examples, the skill the completion needs; with the
completion loss alone the tiny model learns the family prior long before it learns
to read (docs/results/warmup.md has the measurements). AdamW with a linear warm-up then
cosine decay of the learning rate, gradient clipping, small batches.

Pure pieces (`encode_example`, `collate`, `completion_loss`, `warmup_loss`, `lr_at`) are separate
from the loop (`run_warmup`), which is deterministic: the tasks come from a seeded
stream and the model has no dropout, so the same model, config and thread count give
the same weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Final

import msgspec
import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast

from fleetrl.actors.model.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, build_byte_tokenizer
from fleetrl.harness.synthetic import reference_solution, task_stream
from fleetrl.harness.tasks import Task

__all__ = [
    "IGNORE",
    "Batch",
    "Example",
    "WarmupConfig",
    "WarmupResult",
    "collate",
    "completion_loss",
    "encode_example",
    "lr_at",
    "run_warmup",
    "training_batches",
    "warmup_loss",
]

IGNORE: Final = -100
"""Label of a position that carries no loss (prompt and padding)."""


class WarmupConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Hyper-parameters of the supervised warm-up. Invalid values raise ValueError
    naming the field."""

    steps: int = 1200
    """Optimizer steps. docs/results/warmup.md has the measured effect: 800 steps reached 29.0%
    sampled pass@1 on fresh tasks on one machine and 14.25% on another (the loss sits on
    a plateau until the model learns to read the examples, and when that happens depends
    on the CPU's rounding); 1200 steps reach 39.0% on the second, well past the plateau."""
    batch_size: int = 16
    """Examples (tasks) per step. At equal CPU time, 16 per step learnt faster than 32
    (more, smaller steps; docs/results/warmup.md)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    warmup_steps: int = 10
    """Steps of linear learning-rate warm-up from 0 to `lr`; cosine decay to
    `min_lr_ratio * lr` over the remaining steps."""
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    prompt_loss_weight: float = 1.0
    """Weight of the prompt's own next-token loss beside the completion's (0: the
    completion alone). Predicting each shown output from the examples before it is
    what teaches the tiny model to read the examples (docs/results/warmup.md)."""
    task_seed: int = 0
    """Seed of the synthetic training stream the examples come from."""
    task_start: int = 0
    """Index of the first training task used (the stream's cursor)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or value < 1:
                raise ValueError(f"WarmupConfig.{name} must be an int >= 1, got {value!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"WarmupConfig.warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"WarmupConfig.lr must be finite and > 0, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"WarmupConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"WarmupConfig.weight_decay must be finite and >= 0, got {self.weight_decay!r}")
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"WarmupConfig.betas[{i}] must be in [0, 1), got {beta!r}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(f"WarmupConfig.grad_clip must be finite and >= 0, got {self.grad_clip!r}")
        if not (math.isfinite(self.prompt_loss_weight) and self.prompt_loss_weight >= 0):
            raise ValueError(
                f"WarmupConfig.prompt_loss_weight must be finite and >= 0, got {self.prompt_loss_weight!r}"
            )
        if self.task_start < 0:
            raise ValueError(f"WarmupConfig.task_start must be >= 0, got {self.task_start!r}")


class Example(msgspec.Struct, frozen=True):
    """One tokenised training example: all token ids and how many are the prompt."""

    ids: tuple[int, ...]
    prompt_len: int


class Batch(msgspec.Struct, frozen=True):
    """Right-padded tensors of a batch: `input_ids_BT`, `attention_mask_BT` (1 = real
    token), `labels_BT` (the completion token to predict at each position, IGNORE
    where none) and `prompt_labels_BT` (likewise for the prompt tokens after `<bos>`)."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    labels_BT: torch.Tensor
    prompt_labels_BT: torch.Tensor

    @property
    def num_target_tokens(self) -> int:
        return int((self.labels_BT != IGNORE).sum())


def encode_example(task: Task, tokenizer: PreTrainedTokenizerFast) -> Example:
    """`<bos>` + prompt bytes, then the reference completion's bytes and the EOS id.

    Raises ValueError if the tokenizer does not give the layout the warm-up relies on
    (a leading BOS on the prompt, the completion ending with EOS).
    """
    assert task.prompt is not None
    prompt = tokenizer(task.prompt, add_special_tokens=True)["input_ids"]
    completion = tokenizer(reference_solution(task), add_special_tokens=False)["input_ids"]
    if not prompt or prompt[0] != BOS_ID:
        raise ValueError(f"task {task.id!r}: the tokenizer did not start the prompt with <bos> ({BOS_ID})")
    if not completion or completion[-1] != EOS_ID or EOS_ID in completion[:-1]:
        raise ValueError(
            f"task {task.id!r}: the tokenised reference completion must end with the EOS id {EOS_ID} exactly once"
        )
    return Example(ids=tuple(prompt) + tuple(completion), prompt_len=len(prompt))


def collate(examples: Sequence[Example]) -> Batch:
    """Right-pad examples into a batch, with separate completion and prompt labels.

    `labels_BT[b, t]` is the token at position t where that token is part of the
    completion (unshifted); `completion_loss` scores the logits at t-1 against it.
    `prompt_labels_BT[b, t]` is the token at t for the prompt positions 1..prompt_len-1
    (everything the model can predict in the prompt: not `<bos>`)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    prompt_labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for b, e in enumerate(examples):
        if not 0 < e.prompt_len < len(e.ids):
            raise ValueError(f"example {b}: prompt_len {e.prompt_len} leaves no completion in {len(e.ids)} tokens")
        n = len(e.ids)
        row = torch.tensor(e.ids, dtype=torch.long)
        ids[b, :n] = row
        mask[b, :n] = 1
        labels[b, e.prompt_len:n] = row[e.prompt_len:]
        prompt_labels[b, 1:e.prompt_len] = row[1:e.prompt_len]
    return Batch(ids, mask, labels, prompt_labels)


def completion_loss(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of the next-token predictions over labelled tokens.

    The logits at position t predict the token at t+1, so logits[:, :-1] are scored
    against labels[:, 1:]. Positions labelled IGNORE (prompt, padding) contribute
    nothing; the mean is over all labelled tokens of the batch. (The warm-up also
    applies it to `prompt_labels_BT` for the prompt's loss.)
    """
    if logits_BTV.shape[:2] != labels_BT.shape:
        raise ValueError(f"logits {tuple(logits_BTV.shape)} and labels {tuple(labels_BT.shape)} disagree on (B, T)")
    pred = logits_BTV[:, :-1].float()
    target = labels_BT[:, 1:]
    if not bool((target != IGNORE).any()):
        raise ValueError("completion_loss: the batch has no labelled (completion) token")
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), ignore_index=IGNORE)


def warmup_loss(logits_BTV: torch.Tensor, batch: Batch, prompt_weight: float) -> tuple[torch.Tensor, float, float]:
    """The warm-up's objective: completion loss + `prompt_weight` x prompt loss (each a
    token mean, `completion_loss`), and the two parts as floats for reporting. A batch
    with no prompt token to predict (only `<bos>`) has prompt loss 0."""
    loss = completion_loss(logits_BTV, batch.labels_BT)
    completion_value, prompt_value = float(loss.detach()), 0.0
    if bool((batch.prompt_labels_BT != IGNORE).any()):
        prompt_loss = completion_loss(logits_BTV, batch.prompt_labels_BT)
        prompt_value = float(prompt_loss.detach())
        if prompt_weight > 0:
            loss = loss + prompt_weight * prompt_loss
    return loss, completion_value, prompt_value


def lr_at(step: int, config: WarmupConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, cosine decay."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    floor = config.min_lr_ratio * config.lr
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def training_batches(config: WarmupConfig, tokenizer: PreTrainedTokenizerFast) -> Iterator[Batch]:
    """Batches of `config.batch_size` consecutive tasks of the seeded training stream."""
    stream = task_stream(config.task_seed, start=config.task_start)
    while True:
        yield collate([encode_example(next(stream), tokenizer) for _ in range(config.batch_size)])


class WarmupResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a warm-up did: the completion loss of every step (before its update), the
    prompt loss beside it (computed even when its weight is 0), its duration."""

    losses: tuple[float, ...]
    prompt_losses: tuple[float, ...]
    seconds: float
    examples: int


def run_warmup(
    model: torch.nn.Module,
    config: WarmupConfig = WarmupConfig(),
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
    on_step: Callable[[int, float], None] | None = None,
    batches: Iterator[Batch] | None = None,
    stop_after: int | None = None,
) -> WarmupResult:
    """Train `model` (a causal LM taking input_ids/attention_mask) in place.

    `batches`: the training data (default: `training_batches` of the synthetic coding
    family; the tool-lookup family's are `tool_warmup.tool_training_batches`).
    `stop_after`: run only the first steps of the schedule (None: all `config.steps`).

    `on_step(step, loss)` is called after every step with the completion loss
    (progress reporting). The model
    is left in eval mode. Raises FloatingPointError if the loss becomes non-finite.
    """
    tok = tokenizer if tokenizer is not None else build_byte_tokenizer()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=config.betas,
    )
    if batches is None:
        batches = training_batches(config, tok)
    losses: list[float] = []
    prompt_losses: list[float] = []
    started = time.perf_counter()
    model.train()
    try:
        for step in range(config.steps if stop_after is None else min(stop_after, config.steps)):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config)
            batch = next(batches)
            logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
            loss, value, prompt_value = warmup_loss(logits, batch, config.prompt_loss_weight)
            if not (math.isfinite(value) and math.isfinite(prompt_value)):
                raise FloatingPointError(f"warm-up step {step}: loss is {value}, prompt loss {prompt_value}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
            losses.append(value)
            prompt_losses.append(prompt_value)
            if on_step is not None:
                on_step(step, value)
    finally:
        model.eval()
    return WarmupResult(
        losses=tuple(losses),
        prompt_losses=tuple(prompt_losses),
        seconds=time.perf_counter() - started,
        examples=len(losses) * config.batch_size,
    )
