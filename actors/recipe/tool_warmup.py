"""The warm-up's data for the tool-lookup family: reference conversations, masked.

Each training example is the reference conversation of a task of the tool-lookup
*training* stream (`fleetrl.harness.synthetic_tools.reference_messages`: the request, a
``read_file`` call, the file's text, the answer) rendered with the model's own chat
template and the family's tools, exactly as the endpoint renders what the example
harness sends (the tools in the first system turn, the call in the template's tool-call
format, the result as a ``tool`` turn). The loss is on the assistant's tokens only: the
tool call and the answer, each with its closing EOS (what a sampler generates); the
system turn, the request and the tool's output are context, never targets. The first
``plain_steps`` batches (`WarmRecipe.plain_steps`) render the same conversations without
the tools list: a short context in which the tiny model learns the two lookups quickly.
With ``lookup_share < 1`` the others answer at once with a guessed code
(`guess_messages`): the warm model then looks up only part of the time, as a model that
does not always use its tools does, and reinforcement learning has a habit to change.

`render_conversation` turns OpenAI-format messages into the template's text exactly as
the endpoint renders a request (`HFChatTokenizer.render`);
`encode_conversation` finds the assistant spans by rendering each prefix with and
without the generation prompt. Pure, given the tokenizer.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import torch
from transformers import PreTrainedTokenizerFast

from fleetrl.actors.model.byte_tokenizer import EOS_ID, PAD_ID
from fleetrl.harness.chat import ChatMessage, ToolCall
from fleetrl.harness.model import HFChatTokenizer
from fleetrl.harness.synthetic_tools import CODE_LETTERS, TOOLS, reference_messages, tool_task_stream
from fleetrl.harness.tasks import Task

from .warmup import IGNORE, Batch, WarmupConfig

__all__ = [
    "MaskedExample",
    "collate_masked",
    "encode_conversation",
    "chat_message",
    "encode_tool_example",
    "guess_messages",
    "looks_up",
    "render_conversation",
    "tool_training_batches",
]


def chat_message(message: Mapping[str, Any]) -> ChatMessage:
    """An OpenAI-format message as the endpoint's `ChatMessage`."""
    calls = tuple(ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                  for c in message.get("tool_calls") or ())
    return ChatMessage(message["role"], message.get("content") or "", tool_calls=calls,
                       tool_call_id=message.get("tool_call_id"), name=message.get("name"))


def render_conversation(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None, *, add_generation_prompt: bool) -> str:
    """The chat template's text of OpenAI-format ``messages`` with ``tools``, rendered as
    the endpoint renders a request (`HFChatTokenizer.render`)."""
    return HFChatTokenizer(tokenizer).render([chat_message(m) for m in messages],
                                             [dict(t) for t in tools] if tools else None,
                                             add_generation_prompt)


class MaskedExample(msgspec.Struct, frozen=True):
    """Token ids of a conversation and, per position, whether it is a target (an
    assistant token: a tool call or an answer, with its EOS)."""

    ids: tuple[int, ...]
    targets: tuple[bool, ...]


def encode_conversation(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None) -> MaskedExample:
    """``messages`` (ending with an assistant message) as ids with the assistant tokens
    marked. Raises ValueError when the template does not render the conversation
    incrementally (a prefix's text is not a prefix of the whole) or an assistant turn
    does not end with EOS."""
    ids: list[int] = []
    targets: list[bool] = []
    done = ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_conversation(tokenizer, messages[:k], tools, add_generation_prompt=True)
        after = render_conversation(tokenizer, messages[:k + 1], tools, add_generation_prompt=False)
        if not before.startswith(done) or not after.startswith(before):
            raise ValueError(f"the chat template does not extend the conversation at message {k}")
        context = tokenizer.encode(before[len(done):], add_special_tokens=False)
        turn = tokenizer.encode(after[len(before):], add_special_tokens=False)
        if EOS_ID not in turn:
            raise ValueError(f"assistant message {k} does not end with EOS in the template's text")
        end = turn.index(EOS_ID) + 1  # what the sampler generates: up to and including EOS
        ids += context + turn[:end]
        targets += [False] * len(context) + [True] * end
        done = before + tokenizer.decode(turn[:end], skip_special_tokens=False)
        if not after.startswith(done):
            raise ValueError(f"assistant message {k}: its tokens do not decode to the template's text")
    if not any(targets):
        raise ValueError("the conversation has no assistant message")
    return MaskedExample(ids=tuple(ids), targets=tuple(targets))


def encode_tool_example(task: Task, tokenizer: PreTrainedTokenizerFast) -> MaskedExample:
    """The reference conversation of a tool-lookup task, encoded with its assistant mask.
    Raises ValueError when the template ignores the tools (no tool-call format)."""
    example = encode_conversation(tokenizer, reference_messages(task), TOOLS)
    text = tokenizer.decode(list(example.ids), skip_special_tokens=False)
    if TOOLS[0]["function"]["name"] not in text.split(task.prompt or "", 1)[0]:
        raise ValueError("the tokenizer's chat template does not render tools: it has no tool-call format")
    return example


def collate_masked(examples: Sequence[MaskedExample]) -> Batch:
    """Right-pad into a warm-up `Batch`: ``labels_BT`` holds the target tokens (IGNORE
    elsewhere), ``prompt_labels_BT`` the other tokens after ``<bos>`` (the context; the
    tool recipe gives them weight 0)."""
    if not examples:
        raise ValueError("collate_masked needs at least one example")
    width = max(len(e.ids) for e in examples)
    B = len(examples)
    ids = torch.full((B, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.long)
    labels = torch.full((B, width), IGNORE, dtype=torch.long)
    prompt_labels = torch.full((B, width), IGNORE, dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e.ids)
        row = torch.tensor(e.ids, dtype=torch.long)
        target = torch.tensor(e.targets, dtype=torch.bool)
        ids[b, :n] = row
        mask[b, :n] = 1
        labels[b, :n] = torch.where(target, row, IGNORE)
        context = ~target
        context[0] = False  # <bos> is not predicted
        prompt_labels[b, :n] = torch.where(context, row, IGNORE)
    return Batch(ids, mask, labels, prompt_labels)


def guess_messages(task: Task) -> list[dict[str, Any]]:
    """The conversation of a model that answers without looking: the request, then a code
    guessed at once (drawn from the task's id alone: right about one time in 24)."""
    guess = random.Random(f"fleetrl.tool_lookup/guess/{task.id}").choice(CODE_LETTERS)
    return [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": guess}]


def looks_up(task: Task, lookup_share: float) -> bool:
    """Whether the warm-up's conversation of ``task`` looks the code up (`reference_messages`)
    or guesses (`guess_messages`): a hash of the task's id against ``lookup_share``."""
    if lookup_share >= 1.0:
        return True
    digest = hashlib.blake2b(f"lookup/{task.id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < lookup_share


def tool_training_batches(config: WarmupConfig, tokenizer: PreTrainedTokenizerFast, *,
                          plain_steps: int = 0, lookup_share: float = 1.0) -> Iterator[Batch]:
    """Batches of ``config.batch_size`` consecutive tasks of the tool-lookup training
    stream; the first ``plain_steps`` batches render the conversations without the tools
    list (`WarmRecipe.plain_steps`); a share ``1 - lookup_share`` of the tasks are
    conversations that answer without the tool (`guess_messages`, `WarmRecipe.lookup_share`)."""
    if not 0.0 < lookup_share <= 1.0:
        raise ValueError(f"lookup_share must be in (0, 1], got {lookup_share!r}")
    stream = tool_task_stream(config.task_seed, start=config.task_start)
    step = 0
    while True:
        tools = None if step < plain_steps else TOOLS
        examples = []
        for _ in range(config.batch_size):
            task = next(stream)
            if not looks_up(task, lookup_share):
                examples.append(encode_conversation(tokenizer, guess_messages(task), tools))
            elif tools is None:
                examples.append(encode_conversation(tokenizer, reference_messages(task), None))
            else:
                examples.append(encode_tool_example(task, tokenizer))
        yield collate_masked(examples)
        step += 1
