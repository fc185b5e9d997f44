"""The OpenAI-compatible, token-recording endpoint (a Starlette ASGI app).

Routes: ``POST /v1/chat/completions`` (``stream`` false or true), ``POST
/v1/completions`` (likewise), ``GET /v1/models``. docs/reference/openai-endpoint.md is the
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
* Floods are refused, never queued: a call over the per-attempt limit on calls in
  flight, or over the total limit on calls waiting for the model, gets 429 at once
  with a ``Retry-After`` header (`openai_limits`); it is not recorded, and the calls
  already admitted run and are recorded as usual. ``app.state.limits`` counts them.

Streaming: the sampler protocol answers a request with a whole `Generation`, so a
streamed response is produced once the generation is complete, as OpenAI's chunk
format (``chat.completion.chunk`` / ``text_completion``) ending with ``data: [DONE]``.

This module holds the routes (I/O); the rest is pure and lives beside it: the
attempts in `attempts`, request checking in `openai_request`, response bodies and
events in `openai_response`, the flood limits in `openai_limits`, `ApiError` in `errors`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetrl.daemon.messages import Generation, SamplingParams

from .attempts import ATTEMPT_HEADER, AttemptRegistry, resolve_attempt
from .recording import AttemptRecorder
from .errors import ApiError, ModelUnavailable
from .model import ModelClient
from .openai_limits import CallLimits
from .openai_request import EndpointConfig, chat_request, completion_request, parse_body, sampling_params
from .openai_response import (
    CALL_HEADER,
    IGNORED_HEADER,
    Reply,
    chat_body,
    chat_events,
    chat_logprobs,
    completion_body,
    completion_events,
    completion_logprobs,
    response_headers,
)

__all__ = [
    "ATTEMPT_HEADER",
    "CALL_HEADER",
    "IGNORED_HEADER",
    "ApiError",
    "AttemptRegistry",
    "EndpointConfig",
    "create_app",
]

_log = structlog.get_logger("fleetrl.harness.openai_api")


def _error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(err.body, status_code=err.status, headers=headers)


def _streamed(events: list[bytes], headers: dict[str, str]) -> StreamingResponse:
    async def each() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    return StreamingResponse(each(), media_type="text/event-stream", headers=headers)


def create_app(
    model: ModelClient,
    registry: AttemptRegistry,
    config: EndpointConfig = EndpointConfig(),
    *,
    clock: Callable[[], float] = time.time,
) -> Starlette:
    """The endpoint app over ``model``, attributing calls through ``registry``.

    The registry's tokenizer must be the model's (ids are the model's vocabulary).
    ``app.state.registry`` and ``app.state.config`` hold the two for the caller,
    ``app.state.limits`` the `CallLimits` (its statistics).
    """
    tok = registry.tokenizer
    limits = CallLimits(per_attempt=config.max_concurrent_calls_per_attempt, waiting=config.max_waiting_calls)

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
        return parse_body(b"".join(chunks), request.headers.get("content-type", "(none)"))

    async def generate(key: str, attempt_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        # a client that tags requests by attempt (the sampler pool's: its logs, prompt
        # affinity and pacing go by attempt) answers through its view of this attempt
        client = model.for_attempt(attempt_id) if hasattr(model, "for_attempt") else model
        try:
            with limits.model_slot():
                gen = await client.generate(prompt_ids, params)
        except ModelUnavailable as err:
            raise ApiError(503, f"the model could not answer: {err}", type="server_error",
                           code="model_unavailable") from None
        if registry.recorder(key) is None:
            raise ApiError(401, "the attempt was closed while this call ran; the call was not recorded",
                           type="authentication_error", code="attempt_closed")
        return gen

    def reply(prefix: str) -> Reply:
        return Reply(id=f"{prefix}-{secrets.token_hex(12)}", created=int(clock()), model=config.model_name)

    async def chat_completions(request: Request) -> Response:
        key, recorder = resolve_attempt(registry, request.headers)
        with limits.attempt_slot(key):
            return await chat_call(request, key, recorder)

    async def chat_call(request: Request, key: str, recorder: AttemptRecorder) -> Response:
        req = chat_request(await read_json(request), config)
        c = req.common
        plan = recorder.plan_chat(req.messages)
        params = sampling_params(c, req.max_tokens, len(plan.ids), config, tok.eos_id, "messages")
        gen = await generate(key, recorder.attempt_id, plan.ids, params)
        rec = recorder.record_chat(req.messages, plan, gen, stops=c.stops, ignored_params=req.ignored)
        if req.ignored:
            _log.warning("openai request parameters ignored", attempt_id=recorder.attempt_id, call=rec.index,
                         ignored=req.ignored)
        r = reply("chatcmpl")
        logprobs = chat_logprobs(tok, rec, req.top_logprobs) if req.logprobs else None
        if not c.stream:
            return JSONResponse(chat_body(r, rec, logprobs), headers=response_headers(rec))
        return _streamed(chat_events(r, tok, rec, logprobs, include_usage=c.include_usage), response_headers(rec))

    async def completions(request: Request) -> Response:
        key, recorder = resolve_attempt(registry, request.headers)
        with limits.attempt_slot(key):
            return await completion_call(request, key, recorder)

    async def completion_call(request: Request, key: str, recorder: AttemptRecorder) -> Response:
        req = completion_request(await read_json(request), config, tok)
        c = req.common
        params = sampling_params(c, req.max_tokens, len(req.prompt_ids), config, tok.eos_id, "prompt")
        gen = await generate(key, recorder.attempt_id, req.prompt_ids, params)
        rec = recorder.record_completion(req.prompt_ids, gen, stops=c.stops, ignored_params=c.ignored)
        if c.ignored:
            _log.warning("openai request parameters ignored", attempt_id=recorder.attempt_id, call=rec.index,
                         ignored=c.ignored)
        r = reply("cmpl")
        logprobs = completion_logprobs(tok, rec, req.logprobs) if req.logprobs is not None else None
        if not c.stream:
            return JSONResponse(completion_body(r, rec, logprobs), headers=response_headers(rec))
        return _streamed(completion_events(r, tok, rec, logprobs, include_usage=c.include_usage),
                         response_headers(rec))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": 0, "owned_by": "fleetrl"}]})

    def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as err:
                # a flood's refusals are counted (app.state.limits), not logged one by one
                log = _log.warning if err.status >= 500 else _log.debug if err.status == 429 else _log.info
                log("openai request rejected" if err.status < 500 else "openai request failed",
                    path=request.url.path, status=err.status, code=err.code, error=err.message)
                return _error_response(err)
            except Exception as err:  # our bug: answer it, keep serving, log it loudly
                _log.exception("openai request crashed", path=request.url.path)
                return _error_response(ApiError(500, f"internal error: {type(err).__name__}", type="server_error",
                                                code="internal_error"))
        return run

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                        code=code))

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
    app.state.limits = limits
    return app
