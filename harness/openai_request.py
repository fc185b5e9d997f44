"""Requests to the OpenAI-compatible endpoint, parsed and checked (pure).

`chat_request` and `completion_request` turn a decoded request body into a typed
request, in the order OpenAI checks: the first invalid value is an `ApiError` 400
(OpenAI's error body, ``param`` naming the field, down to
``messages[3].tool_calls[0].function.arguments``), an unknown model a 404.
What fleetrl cannot honour without constraining decoding (``tool_choice``
``"required"`` or a named function) is a 400 ``unsupported_value``, never a silent
change of meaning.
Parameters we do not know or do not implement are not errors: they are collected in
``ignored`` (the endpoint logs them and names them in a response header).
Once the whole body is checked, the endpoint's sampling policy (``EndpointConfig.sampling``,
`sampling_policy.apply_policy`) decides what the request is sampled with: ``Common``
then holds those settings and what they override, or the request is refused (400
``sampling_refused``) before anything is generated or recorded.
`sampling_params` fits the generation to the room the prompt leaves in the context.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated

import msgspec

from fleetrl.daemon.messages import SamplingParams

from .chat import ChatMessage, ChatTokenizer
from .errors import ApiError
from .openai_fields import bad_param as _bad
from .openai_fields import type_name as _type_name
from .openai_messages import chat_messages, request_tool_choice, request_tools
from .sampling_policy import Override, SamplingPolicy, SamplingSettings, apply_policy

__all__ = [
    "ChatRequest",
    "Common",
    "CompletionRequest",
    "EndpointConfig",
    "chat_request",
    "completion_request",
    "parse_body",
    "sampling_params",
]


_PosInt = Annotated[int, msgspec.Meta(ge=1)]
"""An int >= 1 (checked with its field's name when a config file is decoded; `EndpointConfig`
checks it again when built in code)."""


class EndpointConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the endpoint serves.

    ``model_name``: the one model id it serves (others get 404). ``context_length``:
    prompt plus generation, in tokens. ``default_max_tokens``: generation length when
    a request gives none (always capped at the room left in the context).
    ``max_body_bytes``: larger request bodies get 413.
    ``max_concurrent_calls_per_attempt``: calls of one attempt in flight at once; the
    next gets 429 ``too_many_concurrent_calls``. ``max_waiting_calls``: calls of all
    attempts waiting for the model at once; the next gets 429 ``endpoint_busy``
    (`openai_limits`). ``max_n``: the most choices (``n``) one request may ask for;
    each is a generation of its own, and each takes a waiting slot.
    ``sampling``: what the endpoint does with the sampling settings a call sends
    (`sampling_policy.SamplingPolicy`: honour, override or refuse).
    """

    model_name: str = "fleetrl"
    context_length: _PosInt = 4096
    default_max_tokens: _PosInt = 512
    max_body_bytes: _PosInt = 8 << 20
    max_concurrent_calls_per_attempt: _PosInt = 8
    max_waiting_calls: _PosInt = 256
    max_n: _PosInt = 16
    sampling: SamplingPolicy = SamplingPolicy()

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("EndpointConfig.model_name must not be empty")
        for name in ("context_length", "default_max_tokens", "max_body_bytes", "max_concurrent_calls_per_attempt",
                     "max_waiting_calls", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"EndpointConfig.{name} must be >= 1, got {getattr(self, name)}")



def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise _bad(name, f"must be a number, got {_type_name(v)}", "invalid_type")
    if v > hi or v < lo or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise _bad(name, f"must be in {left}{lo}, {hi}], got {v}")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(name, f"must be an integer, got {_type_name(v)}", "invalid_type")
    if v < lo or (hi is not None and v > hi):
        raise _bad(name, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"must be a boolean, got {_type_name(v)}", "invalid_type")
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop", "must be a string or an array of strings", "invalid_type")
    if len(v) > 4:
        raise _bad("stop", f"at most 4 stop sequences, got {len(v)}")
    if any(not s for s in v):
        raise _bad("stop", "stop sequences must not be empty")
    return v


_SAMPLING = {"model", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "n", "stream",
             "stream_options"}
_CHAT_KNOWN = _SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                            "parallel_tool_calls"}
_COMPLETION_KNOWN = _SAMPLING | {"prompt", "logprobs", "echo", "suffix", "best_of"}
class Common(msgspec.Struct, frozen=True, kw_only=True):
    """The checked parameters both kinds of request share. ``n``: how many choices
    (generations of the same prompt). ``temperature``, ``top_p``, ``top_k``, ``seed``:
    what the request is sampled with (as it asked, the endpoint's defaults where it
    sent nothing, until `chat_request` / `completion_request` apply the sampling
    policy; then the policy's answer). ``defaulted``: the sampling parameters it did
    not send. ``overridden``: what the policy changed (``override``; empty otherwise).
    ``ignored``: the request's parameters that are ignored (unknown or not implemented)."""

    n: int
    temperature: float
    top_p: float
    top_k: int | None
    seed: int | None
    stops: list[str]
    stream: bool
    include_usage: bool
    ignored: list[str]
    defaulted: tuple[str, ...] = ()
    overridden: tuple[Override, ...] = ()


def _common(body: dict, known: set[str], config: EndpointConfig) -> Common:
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", "is required and must be a string", "invalid_type" if "model" in body else "missing")
    if model != config.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this endpoint serves {config.model_name!r}",
                       param="model", code="model_not_found")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", -1)
    if top_k is not None and top_k in (0, -1):
        top_k = None  # vLLM's "no cap"
    seed = _int(body, "seed", 0, 2**63 - 1)
    n = _int(body, "n", 1, config.max_n) or 1
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options", f"must be an object, got {_type_name(opts)}", "invalid_type")
        include_usage = _bool(opts, "include_usage")
    ignored = sorted(k for k in body if k not in known)
    defaulted = tuple(name for name in ("temperature", "top_p", "top_k") if body.get(name) is None)
    return Common(n=n, temperature=1.0 if temperature is None else temperature,
                   top_p=1.0 if top_p is None else top_p, top_k=top_k, seed=seed, stops=_stops(body),
                   stream=stream, include_usage=include_usage, ignored=ignored, defaulted=defaulted)


def _apply_sampling_policy(c: Common, config: EndpointConfig) -> Common:
    """``c`` sampled as the endpoint's policy says (`sampling_policy.apply_policy`): its
    settings replaced and ``overridden`` filled in, or an `ApiError` 400
    ``sampling_refused``. Applied once the whole request is checked, so a refusal is
    never reported for a request that is invalid anyway."""
    requested = SamplingSettings(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, seed=c.seed)
    applied = apply_policy(config.sampling, requested, defaulted=c.defaulted)
    if applied.settings == requested:
        return c
    s = applied.settings
    return msgspec.structs.replace(c, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                                   overridden=applied.overridden)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(body: object) -> bool:
    stack, texts = [body], []
    while stack:  # no recursion: the body may be nested as deep as the decoder allowed
        v = stack.pop()
        if isinstance(v, str):
            texts.append(v)
        elif isinstance(v, dict):
            texts.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    try:
        for t in texts:
            t.encode()
    except UnicodeEncodeError:
        return True
    return False


def parse_body(raw: bytes, content_type: str = "application/json") -> dict:
    """The request body as a JSON object in UTF-8; anything else is an `ApiError` 400
    ``invalid_json``. ``content_type`` is not checked (a JSON body is read whatever the
    header says) but named in the error when the body is not JSON."""
    try:
        body = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not UTF-8 ({err.reason} at byte {err.start})",
                       code="invalid_json") from None
    except (ValueError, RecursionError) as err:
        hint = "" if "json" in content_type.lower() else f" (Content-Type {content_type!r}; send application/json)"
        raise ApiError(400, f"the request body is not valid JSON{hint}: {err}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}", code="invalid_json")
    # a \ud800-style escape decodes to a lone surrogate, which no text can hold (UTF-8 cannot)
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise ApiError(400, "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
                            "pair), which is no character", code="invalid_json")
    return body


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A checked ``POST /v1/chat/completions`` body. ``max_tokens``: the requested
    generation length (None: the endpoint's default). ``top_logprobs``: alternatives
    per token (0: none). ``tools``: the request's tools exactly as sent (for the chat
    template), None without any. ``tool_choice``: ``"auto"`` (answers are parsed for
    tool calls) or ``"none"`` (they are not; the tools still reach the template, as
    with vLLM). ``parallel_tool_calls`` is accepted but not enforced (named in
    ``ignored`` when false). ``ignored``: the parameters ignored, message fields
    included."""

    common: Common
    messages: list[ChatMessage]
    max_tokens: int | None
    logprobs: bool
    top_logprobs: int
    tools: list[dict] | None = None
    tool_choice: str = "none"
    ignored: list[str]

    @property
    def parse_tool_calls(self) -> bool:
        """Whether answers are parsed for tool calls."""
        return self.tools is not None and self.tool_choice == "auto"


def chat_request(body: dict, config: EndpointConfig) -> ChatRequest:
    """Check a chat completion request body (module docstring)."""
    c = _common(body, _CHAT_KNOWN, config)
    ignored = list(c.ignored)
    messages = chat_messages(body, ignored)
    requested = _int(body, "max_completion_tokens", 1)
    if requested is None:
        requested = _int(body, "max_tokens", 1)
    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 20) or 0
    if top and not want_logprobs:
        raise _bad("top_logprobs", "requires logprobs: true")
    tools = request_tools(body)
    tool_choice = request_tool_choice(body, tools)
    if body.get("parallel_tool_calls") is not None and not _bool(body, "parallel_tool_calls"):
        ignored.append("parallel_tool_calls")  # not enforced: every call the model wrote is returned
    c = _apply_sampling_policy(c, config)
    return ChatRequest(common=c, messages=messages, max_tokens=requested, logprobs=want_logprobs,
                       top_logprobs=top, tools=tools, tool_choice=tool_choice, ignored=ignored)


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A checked ``POST /v1/completions`` body. ``prompt_ids``: the prompt as ids
    (a text prompt encoded after ``<bos>``). ``logprobs``: alternatives per token
    (None: no log-probabilities)."""

    common: Common
    prompt_ids: list[int]
    max_tokens: int | None
    logprobs: int | None


def completion_request(body: dict, config: EndpointConfig, tok: ChatTokenizer) -> CompletionRequest:
    """Check a completion request body (module docstring); ``tok`` encodes a text prompt."""
    c = _common(body, _COMPLETION_KNOWN, config)
    requested = _int(body, "max_tokens", 1)
    top = _int(body, "logprobs", 0, 20)
    if _bool(body, "echo"):
        raise _bad("echo", "echo is not supported", "unsupported_value")
    if body.get("suffix") not in (None, ""):
        raise _bad("suffix", "suffix is not supported", "unsupported_value")
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of < c.n:
        raise _bad("best_of", f"must be >= n ({c.n}), got {best_of}")
    if best_of is not None and best_of != 1:
        raise _bad("best_of", f"only best_of=1 is supported, got {best_of}", "unsupported_value")
    prompt_ids = _completion_prompt(body, tok)
    if not prompt_ids:
        raise _bad("prompt", "is empty (and the tokenizer has no <bos> to start it)")
    c = _apply_sampling_policy(c, config)
    return CompletionRequest(common=c, prompt_ids=prompt_ids, max_tokens=requested, logprobs=top)


def _completion_prompt(body: dict, tok: ChatTokenizer) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(p)
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        for j, t in enumerate(p):
            if not 0 <= t < tok.vocab_size:
                raise _bad(f"prompt[{j}]", f"token id {t} is outside the vocabulary [0, {tok.vocab_size})")
        return list(p)
    if p is None:
        raise _bad("prompt", "is required", "missing")
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise _bad("prompt", "only one prompt per request is supported", "unsupported_value")
    raise _bad("prompt", "must be a string, an array of token ids, or an array holding one of those",
               "invalid_type")


def sampling_params(c: Common, requested: int | None, prompt_len: int, config: EndpointConfig, eos: int,
              param: str) -> SamplingParams:
    """The sampling of a request whose prompt is ``prompt_len`` ids: the requested
    length (else the default) capped at the room left in the context, which must not
    be empty (an `ApiError` 400 naming ``param``); ``eos`` always stops it."""
    room = config.context_length - prompt_len
    if room < 1:
        raise ApiError(400, f"the prompt is {prompt_len} tokens; this model's context is {config.context_length} "
                            "tokens, which leaves no room to generate", param=param,
                       code="context_length_exceeded")
    max_tokens = min(requested if requested is not None else config.default_max_tokens, room)
    return SamplingParams(max_tokens=max_tokens, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                          stop_ids=(eos,), seed=c.seed)
