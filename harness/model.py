"""The model as the harness side sees it: a client of the sampler pool.

`ModelClient` is the one thing a harness (built in or external, through the
OpenAI-compatible endpoint) needs from the model: ``generate(prompt_ids, params)``
returning the wire `Generation` of ``fleetrl.daemon.messages`` (generated ids, the
sampler's log q^S, the support, weight versions, sampler identity, finish reason), and
its ``tokenizer`` (`chat.ChatTokenizer`: encode, decode, special ids). The sampler pool
(actors/) implements it; tests use in-memory fakes and an adapter over the torch
backend.

A client may also stream: ``stream(prompt_ids, params)`` (`StreamingModelClient`)
yields zero or more `TokenChunk`s as the sampler produces tokens, then exactly one
`Generation`, the one ``generate`` would return. `stream_generation` streams from any
client, one without ``stream`` as its final `Generation` alone.

`HFChatTokenizer` adapts a Hugging Face tokenizer (object or saved directory) to
`ChatTokenizer`: prompts are rendered by the tokenizer's own chat template. `RecordedModel` makes chat and completion calls through an
`recording.AttemptRecorder`, so every call a built-in harness makes is recorded
token-exactly, exactly as calls through the endpoint are.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from fleetrl.daemon.messages import Generation, SamplingParams, TokenChunk
from fleetrl.daemon.streams import stream_or_once

from .chat import ChatMessage, ChatTokenizer, template_messages
from .errors import ModelUnavailable
from .recording import AttemptRecorder, CallRecord

__all__ = [
    "ChatTokenizer",
    "HFChatTokenizer",
    "ModelClient",
    "ModelUnavailable",
    "RecordedModel",
    "StreamingModelClient",
    "TokenChunk",
    "stream_generation",
]


@runtime_checkable
class ModelClient(Protocol):
    """A client of the sampler pool."""

    @property
    def tokenizer(self) -> ChatTokenizer:
        """The tokenizer of the model (encode/decode, special ids) for the chat layout."""
        ...

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Continue ``prompt_ids``; raises `ModelUnavailable` when it cannot."""
        ...


@runtime_checkable
class StreamingModelClient(ModelClient, Protocol):
    """A `ModelClient` that streams its tokens (the sampler pool's and the local clients
    of actors/envworker/model.py)."""

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenChunk | Generation]:
        """Continue ``prompt_ids``, streamed: zero or more `TokenChunk` (``token_ids``: the
        tokens the sampler has produced since the last chunk, in order) as the sampler
        produces them, then exactly one `Generation`, the same ``generate`` returns.

        The chunks concatenate to a prefix of the Generation's ``token_ids`` (all of it
        when the sampler streams every token, as the torch and vLLM samplers do; none of
        it from a sampler that does not stream): a reader sends on the chunks as they
        come and the rest of ``token_ids``, if any, at the end. Raises
        `ModelUnavailable` when it cannot (also after some chunks: a stream whose
        sampler is lost is not resumed elsewhere). Close it early with
        ``contextlib.aclosing`` to give the request up."""
        ...


def stream_generation(model: ModelClient, prompt_ids: Sequence[int], params: SamplingParams
                      ) -> AsyncIterator[TokenChunk | Generation]:
    """``model.stream(prompt_ids, params)`` when the client streams, else the one
    `Generation` of ``model.generate`` (no chunks): `StreamingModelClient.stream` for
    any client. Use it inside ``contextlib.aclosing``."""
    return stream_or_once(getattr(model, "stream", None), model.generate, prompt_ids, params)


# A client may also offer ``for_attempt(attempt_id) -> ModelClient``: a view whose
# requests carry the attempt's id (the sampler pool's client does: its logs, prompt
# affinity and pacing go by attempt). The endpoint and the environment worker use it
# when it is there.


class HFChatTokenizer:
    """A Hugging Face tokenizer as a `ChatTokenizer`.

    ``render`` is ``apply_chat_template(..., tokenize=False)`` with the tokenizer's own
    chat template; ``encode`` adds no special tokens (text spelling a special token
    still maps to its id, as in ``apply_chat_template(..., tokenize=True)``);
    ``decode`` skips special tokens.
    """

    def __init__(self, hf: Any) -> None:
        if hf.eos_token_id is None:
            raise ValueError("HFChatTokenizer: the tokenizer has no eos token; the chat layout needs one")
        if not getattr(hf, "chat_template", None):
            raise ValueError(
                "HFChatTokenizer: the tokenizer has no chat template, so chat prompts cannot be rendered; "
                "use the model's instruct/chat tokenizer, or add one (a chat_template.jinja file or "
                "\"chat_template\" in tokenizer_config.json of the tokenizer directory)")
        self.hf = hf
        self._bos: int | None = hf.bos_token_id
        self._eos: int = int(hf.eos_token_id)
        self._vocab = len(hf)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> HFChatTokenizer:
        """Load a saved tokenizer directory with transformers' AutoTokenizer."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(os.fspath(directory)))

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def eos_token(self) -> str:
        return str(self.hf.eos_token)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[dict] | None,
               add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(
            template_messages(messages), tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


class RecordedModel:
    """Chat and completion calls to ``model``, each recorded by ``recorder``."""

    def __init__(self, model: ModelClient, recorder: AttemptRecorder) -> None:
        self.model = model
        self.recorder = recorder

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self.model.tokenizer

    def _params(self, params: SamplingParams) -> SamplingParams:
        eos = self.model.tokenizer.eos_id
        if eos in params.stop_ids:
            return params
        return SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop_ids=(*params.stop_ids, eos),
            seed=params.seed,
        )

    async def chat(self, messages: Sequence[ChatMessage], params: SamplingParams, *, stop: Sequence[str] = (),
                   tools: Sequence[dict] | None = None, parse_tool_calls: bool = False) -> CallRecord:
        """One chat call: prompt from the recorder's history, ``<eos>`` always a stop id;
        ``tools`` go to the chat template, and with ``parse_tool_calls`` the answer's
        tool calls are parsed (see `AttemptRecorder.record_chat`)."""
        msgs = tuple(messages)
        plan = self.recorder.plan_chat(msgs, tools)
        gen = await self.model.generate(plan.ids, self._params(params))
        return self.recorder.record_chat(msgs, plan, gen, stops=stop, tools=tools, parse_tool_calls=parse_tool_calls)

    async def complete(self, prompt_ids: Sequence[int], params: SamplingParams, *, stop: Sequence[str] = ()) -> CallRecord:
        """One completion call on raw prompt ids, ``<eos>`` always a stop id."""
        ids = list(prompt_ids)
        gen = await self.model.generate(ids, self._params(params))
        return self.recorder.record_completion(ids, gen, stops=stop)
