"""The OpenAI-compatible, token-recording endpoint (a Starlette ASGI app).

Routes: ``POST /v1/chat/completions`` (``stream`` false or true), ``POST
/v1/completions`` (likewise), ``GET /v1/models``. docs/openai-endpoint.md is the
user's guide; in short:

* Every call belongs to an attempt. The environment worker opens one with
  `AttemptRegistry.open_attempt` and hands the harness the key it returns, as the API
  key (``Authorization: Bearer <key>``) or, for a harness whose API key is fixed, in
  the ``X-Fleetrl-Attempt`` header. A key the registry does not know, or whose attempt
  is closed, gets 401. `AttemptRegistry.close_attempt` returns the `AttemptRecord`.
* Chat prompts are built by `chat.ChatHistory`: a call whose messages extend an
  earlier call's messages plus its answer reuses that call's ids exactly (prompt and
  generated ids, including the ``<eos>`` that ended the answer) and tokenises only
  the new messages; other calls are tokenised from scratch and recorded as a new
  segment, with the reason.
* Parameters we do not know or do not implement are ignored: logged as a warning,
  named in the ``X-Fleetrl-Ignored-Params`` response header and kept in the call's
  record. Invalid values get 400 with OpenAI's error body
  ``{"error": {"message", "type", "param", "code"}}``; an unknown model 404; a prompt
  longer than the context 400 with code ``context_length_exceeded``; a model failure
  503. No request makes the app fail: an unexpected error is a 500 of the same shape.

Streaming: the sampler protocol answers a request with a whole `Generation`, so a
streamed response is produced once the generation is complete, as OpenAI's chunk
format (``chat.completion.chunk`` / ``text_completion``) ending with ``data: [DONE]``.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetrl.daemon.messages import SamplingParams

from .chat import ChatMessage, ChatTokenizer
from .model import ModelClient, ModelUnavailable
from .recording import AttemptRecord, AttemptRecorder, CallRecord

__all__ = [
    "ATTEMPT_HEADER",
    "IGNORED_HEADER",
    "ApiError",
    "AttemptRegistry",
    "EndpointConfig",
    "create_app",
]

ATTEMPT_HEADER = "X-Fleetrl-Attempt"
"""Fallback attribution header: the attempt key, for harnesses with a fixed API key."""
IGNORED_HEADER = "X-Fleetrl-Ignored-Params"
"""Response header naming the request parameters that were ignored (comma-separated)."""
CALL_HEADER = "X-Fleetrl-Call"
"""Response header: the index of the call in its attempt's record."""

_log = structlog.get_logger("fleetrl.harness.openai_api")


class EndpointConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the endpoint serves.

    ``model_name``: the one model id it serves (others get 404). ``context_length``:
    prompt plus generation, in tokens. ``default_max_tokens``: generation length when
    a request gives none (always capped at the room left in the context).
    ``max_body_bytes``: larger request bodies get 413.
    """

    model_name: str = "fleetrl"
    context_length: int = 4096
    default_max_tokens: int = 512
    max_body_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("EndpointConfig.model_name must not be empty")
        for name in ("context_length", "default_max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"EndpointConfig.{name} must be >= 1, got {getattr(self, name)}")


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _bad(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


# --------------------------------------------------------------------------- attempts


class AttemptRegistry:
    """The open attempts, by key. The environment worker opens and closes them."""

    max_closed = 100_000
    """Closed keys remembered (oldest forgotten first); a forgotten one is 'unknown'."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self._open: dict[str, AttemptRecorder] = {}
        self._closed: dict[str, str] = {}  # key -> attempt id

    def open_attempt(self, attempt_id: str, task_id: str) -> str:
        """Start recording an attempt; returns its key (a fresh random secret)."""
        if not attempt_id or not task_id:
            raise ValueError("open_attempt: attempt_id and task_id must be non-empty")
        if any(r.attempt_id == attempt_id for r in self._open.values()):
            raise ValueError(f"open_attempt: attempt {attempt_id!r} is already open")
        key = "fleetrl-" + secrets.token_urlsafe(24)
        self._open[key] = AttemptRecorder(attempt_id, task_id, self.tokenizer)
        return key

    def close_attempt(self, key: str) -> AttemptRecord:
        """Stop recording and return the record; later calls with ``key`` get 401."""
        rec = self._open.pop(key, None)
        if rec is None:
            raise KeyError("close_attempt: no open attempt has this key")
        self._closed[key] = rec.attempt_id
        while len(self._closed) > self.max_closed:  # remembered only to say "closed"
            del self._closed[next(iter(self._closed))]
        return rec.finish()

    def recorder(self, key: str) -> AttemptRecorder | None:
        """The recorder of the open attempt with ``key``, else None."""
        return self._open.get(key)

    def is_closed(self, key: str) -> bool:
        return key in self._closed

    def __len__(self) -> int:
        return len(self._open)


def _resolve_attempt(registry: AttemptRegistry, request: Request) -> tuple[str, AttemptRecorder]:
    auth = request.headers.get("authorization", "")
    bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    header = request.headers.get(ATTEMPT_HEADER, "").strip()
    for key in (bearer, header):
        if not key:
            continue
        rec = registry.recorder(key)
        if rec is not None:
            return key, rec
        if registry.is_closed(key):
            raise ApiError(401, "the attempt of this key is closed", type="authentication_error",
                           code="attempt_closed")
    if not bearer and not header:
        raise ApiError(401, f"no attempt key: send it as the API key (Authorization: Bearer <key>) "
                            f"or in the {ATTEMPT_HEADER} header", type="authentication_error", code="invalid_api_key")
    raise ApiError(401, "unknown attempt key", type="authentication_error", code="invalid_api_key")


# --------------------------------------------------------------------------- validation


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _type_name(v: object) -> str:
    return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
            list: "array", dict: "object"}.get(type(v), type(v).__name__)


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
_CHAT_KNOWN = _SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
_COMPLETION_KNOWN = _SAMPLING | {"prompt", "logprobs", "echo", "suffix", "best_of"}
_MESSAGE_KNOWN = {"role", "content"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    temperature: float
    top_p: float
    top_k: int | None
    seed: int | None
    stops: list[str]
    stream: bool
    include_usage: bool
    ignored: list[str]


def _common(body: dict, known: set[str], config: EndpointConfig) -> _Common:
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
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise _bad("n", f"only n=1 is supported, got {n}", "unsupported_value")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options", f"must be an object, got {_type_name(opts)}", "invalid_type")
        include_usage = _bool(opts, "include_usage")
    ignored = sorted(k for k in body if k not in known)
    return _Common(temperature=1.0 if temperature is None else temperature,
                   top_p=1.0 if top_p is None else top_p, top_k=top_k, seed=seed, stops=_stops(body),
                   stream=stream, include_usage=include_usage, ignored=ignored)


def _content_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported",
                           "unsupported_value")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}.content", f"must be a string or an array of text parts, got {_type_name(content)}",
               "invalid_type")


def _messages(body: dict, ignored: list[str]) -> list[ChatMessage]:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise _bad("messages", "is required and must be an array" if msgs is None else
                   f"must be an array, got {_type_name(msgs)}", "invalid_type")
    if not msgs:
        raise _bad("messages", "must hold at least one message")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"must be an object, got {_type_name(m)}", "invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"{where}.role", f"must be one of {', '.join(sorted(_ROLES))}, got {role!r}")
        out.append(ChatMessage(role, _content_text(m.get("content"), where)))
        ignored.extend(f"{where}.{k}" for k in m if k not in _MESSAGE_KNOWN)
    return out


def _sampling(c: _Common, requested: int | None, prompt_len: int, config: EndpointConfig, eos: int,
              param: str) -> SamplingParams:
    room = config.context_length - prompt_len
    if room < 1:
        raise ApiError(400, f"the prompt is {prompt_len} tokens; this model's context is {config.context_length} "
                            "tokens, which leaves no room to generate", param=param,
                       code="context_length_exceeded")
    max_tokens = min(requested if requested is not None else config.default_max_tokens, room)
    return SamplingParams(max_tokens=max_tokens, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                          stop_ids=(eos,), seed=c.seed)


# --------------------------------------------------------------------------- responses


def _usage(rec: CallRecord) -> dict[str, int]:
    p = rec.segment.prompt_ids.shape[0]
    g = rec.segment.token_ids.shape[0]
    return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


def _token_text(tok: ChatTokenizer, i: int) -> str:
    return tok.decode([i])


def _chat_logprobs(tok: ChatTokenizer, rec: CallRecord, top: int) -> dict[str, Any]:
    seg = rec.segment
    ids = seg.token_ids.to_numpy().tolist()
    lps = seg.logprobs.to_numpy().tolist()
    content = []
    for t, (i, lp) in enumerate(zip(ids, lps)):
        s_ids, s_lps = seg.support.row(t)
        tops = [{"token": (w := _token_text(tok, int(a))), "logprob": float(b), "bytes": list(w.encode())}
                for a, b in zip(s_ids[:top].tolist(), s_lps[:top].tolist())]
        text = _token_text(tok, i)
        content.append({"token": text, "logprob": float(lp), "bytes": list(text.encode()), "top_logprobs": tops})
    return {"content": content}


def _completion_logprobs(tok: ChatTokenizer, rec: CallRecord, top: int) -> dict[str, Any]:
    seg = rec.segment
    ids = seg.token_ids.to_numpy().tolist()
    tokens, offsets, tops = [], [], []
    at = 0
    for t, i in enumerate(ids):
        text = _token_text(tok, i)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
        s_ids, s_lps = seg.support.row(t)
        tops.append({_token_text(tok, int(a)): float(b) for a, b in zip(s_ids[:top].tolist(), s_lps[:top].tolist())})
    return {"tokens": tokens, "token_logprobs": [float(x) for x in seg.logprobs.to_numpy().tolist()],
            "top_logprobs": tops if top else None, "text_offset": offsets}


def _text_deltas(tok: ChatTokenizer, ids: Sequence[int], final: str, every: int = 8) -> list[str]:
    """Pieces of ``final`` in generation order (each a prefix's new text); they join to ``final``."""
    pieces: list[str] = []
    sent = ""
    for k in range(every, len(ids), every):
        prefix = tok.decode(ids[:k])
        if prefix.endswith("\ufffd") or not final.startswith(prefix) or len(prefix) <= len(sent):
            continue
        pieces.append(prefix[len(sent):])
        sent = prefix
    if len(final) > len(sent):
        pieces.append(final[len(sent):])
    return pieces


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _headers(rec: CallRecord) -> dict[str, str]:
    h = {CALL_HEADER: str(rec.index)}
    if rec.ignored_params:
        h[IGNORED_HEADER] = ",".join(rec.ignored_params)
    return h


# --------------------------------------------------------------------------- app


def create_app(
    model: ModelClient,
    registry: AttemptRegistry,
    config: EndpointConfig = EndpointConfig(),
    *,
    clock: Callable[[], float] = time.time,
) -> Starlette:
    """The endpoint app over ``model``, attributing calls through ``registry``.

    The registry's tokenizer must be the model's (ids are the model's vocabulary).
    ``app.state.registry`` and ``app.state.config`` hold the two for the caller.
    """
    tok = registry.tokenizer

    async def read_json(request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise ApiError(413, f"request body over {config.max_body_bytes} bytes", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise ApiError(413, f"request body over {config.max_body_bytes} bytes", code="body_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as err:
            raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}", code="invalid_json")
        return body

    async def generate(key: str, prompt_ids: list[int], params: SamplingParams):
        try:
            gen = await model.generate(prompt_ids, params)
        except ModelUnavailable as err:
            raise ApiError(503, f"the model could not answer: {err}", type="server_error",
                           code="model_unavailable") from None
        if registry.recorder(key) is None:
            raise ApiError(401, "the attempt was closed while this call ran; the call was not recorded",
                           type="authentication_error", code="attempt_closed")
        return gen

    async def chat_completions(request: Request) -> Response:
        key, recorder = _resolve_attempt(registry, request)
        body = await read_json(request)
        c = _common(body, _CHAT_KNOWN, config)
        ignored = list(c.ignored)
        messages = _messages(body, ignored)
        requested = _int(body, "max_completion_tokens", 1)
        if requested is None:
            requested = _int(body, "max_tokens", 1)
        want_logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, 20) or 0
        if top and not want_logprobs:
            raise _bad("top_logprobs", "requires logprobs: true")
        plan = recorder.plan_chat(messages)
        params = _sampling(c, requested, len(plan.ids), config, tok.eos_id, "messages")
        gen = await generate(key, plan.ids, params)
        rec = recorder.record_chat(messages, plan, gen, stops=c.stops, ignored_params=ignored)
        if ignored:
            _log.warning("openai request parameters ignored", attempt_id=recorder.attempt_id, call=rec.index,
                         ignored=ignored)
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(clock())
        finish = rec.segment.finish_reason if rec.segment.finish_reason != "abort" else "stop"
        logprobs = _chat_logprobs(tok, rec, top) if want_logprobs else None
        if not c.stream:
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": created, "model": config.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": rec.text},
                             "logprobs": logprobs, "finish_reason": finish}],
                "usage": _usage(rec),
            }, headers=_headers(rec))

        def chunk(delta: dict, finish_reason: str | None, lp: object = None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": config.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]}

        async def events() -> AsyncIterator[bytes]:
            yield _sse(chunk({"role": "assistant", "content": ""}, None))
            for piece in _text_deltas(tok, rec.token_ids, rec.text):
                yield _sse(chunk({"content": piece}, None))
            yield _sse(chunk({}, finish, logprobs))
            if c.include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                            "model": config.model_name, "choices": [], "usage": _usage(rec)})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=_headers(rec))

    def completion_prompt(body: dict) -> list[int]:
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

    async def completions(request: Request) -> Response:
        key, recorder = _resolve_attempt(registry, request)
        body = await read_json(request)
        c = _common(body, _COMPLETION_KNOWN, config)
        requested = _int(body, "max_tokens", 1)
        top = _int(body, "logprobs", 0, 20)
        if _bool(body, "echo"):
            raise _bad("echo", "echo is not supported", "unsupported_value")
        if body.get("suffix") not in (None, ""):
            raise _bad("suffix", "suffix is not supported", "unsupported_value")
        best_of = _int(body, "best_of", 1)
        if best_of is not None and best_of != 1:
            raise _bad("best_of", f"only best_of=1 is supported, got {best_of}", "unsupported_value")
        prompt_ids = completion_prompt(body)
        if not prompt_ids:
            raise _bad("prompt", "is empty (and the tokenizer has no <bos> to start it)")
        params = _sampling(c, requested, len(prompt_ids), config, tok.eos_id, "prompt")
        gen = await generate(key, prompt_ids, params)
        rec = recorder.record_completion(prompt_ids, gen, stops=c.stops, ignored_params=c.ignored)
        if c.ignored:
            _log.warning("openai request parameters ignored", attempt_id=recorder.attempt_id, call=rec.index,
                         ignored=c.ignored)
        rid = f"cmpl-{secrets.token_hex(12)}"
        created = int(clock())
        finish = rec.segment.finish_reason if rec.segment.finish_reason != "abort" else "stop"
        logprobs = _completion_logprobs(tok, rec, top) if top is not None else None

        def choice(text: str, finish_reason: str | None, lp: object = None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": config.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}]}

        if not c.stream:
            out = choice(rec.text, finish, logprobs)
            out["usage"] = _usage(rec)
            return JSONResponse(out, headers=_headers(rec))

        async def events() -> AsyncIterator[bytes]:
            for piece in _text_deltas(tok, rec.token_ids, rec.text):
                yield _sse(choice(piece, None))
            yield _sse(choice("", finish, logprobs))
            if c.include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": config.model_name,
                            "choices": [], "usage": _usage(rec)})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=_headers(rec))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": 0, "owned_by": "fleetrl"}]})

    def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as err:
                log = _log.warning if err.status >= 500 else _log.info
                log("openai request rejected" if err.status < 500 else "openai request failed",
                    path=request.url.path, status=err.status, code=err.code, error=err.message)
                return err.response()
            except Exception as err:  # our bug: answer it, keep serving, log it loudly
                _log.exception("openai request crashed", path=request.url.path)
                return ApiError(500, f"internal error: {type(err).__name__}", type="server_error",
                                code="internal_error").response()
        return run

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
            Route("/v1/completions", guarded(completions), methods=["POST"]),
            Route("/v1/models", guarded(models), methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
    )
    app.state.registry = registry
    app.state.config = config
    return app
