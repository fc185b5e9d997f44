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
* ``n`` choices are ``n`` generations of the same prompt, run concurrently, each
  recorded as its own call (the conversation then extends whichever choice the client
  sends back). With a ``seed``, choice ``i`` samples with ``seed + i``.
* With ``tools`` (and ``tool_choice`` ``"auto"``, the default then), each answer is
  parsed for tool calls in the chat template's format; an answer that does not parse
  comes back as plain content and is counted (``app.state.tool_calls``, and the
  call's ``tool_call_parse_failure``).
* Floods are refused, never queued: a call over the per-attempt limit on calls in
  flight, or over the total limit on calls waiting for the model, gets 429 at once
  with a ``Retry-After`` header (`openai_limits`); it is not recorded, and the calls
  already admitted run and are recorded as usual. ``app.state.limits`` counts them.
* The sampling policy (``EndpointConfig.sampling``, `sampling_policy`) decides what a
  call is sampled with: ``honour`` what it asks, ``override`` the run's own settings
  (the response names what changed in the ``X-Fleetrl-Sampling-Overridden`` header,
  streamed or not), ``refuse`` a 400 ``sampling_refused`` before anything is generated
  or recorded. ``app.state.sampling`` (`SamplingCounts`) counts overridden and refused
  requests per parameter.

Streaming (``stream: true``): each choice's text is sent as the sampler produces its
tokens (the model client's ``stream``, `model.stream_generation`), in OpenAI's chunk
format (``chat.completion.chunk`` / ``text_completion``): the role, then text pieces
as they become certain (`openai_stream.TextStreamer`: not a stop string nor a tail that
may start one, not a tool-call block), then, once the call is recorded, the rest of the
text, the tool calls and the finish with the choice's log-probabilities; the usage when
asked, and ``data: [DONE]``. A model failure after the stream began is an ``error``
event before ``[DONE]`` (the status line is already sent). A client that disconnects
gives its generations up; nothing of that request is recorded. The request's slots
(`openai_limits`) are held until its stream ends.

This module holds the routes (I/O); the rest lives beside it: the attempts in
`attempts`, request checking in `openai_request`, response bodies and events in
`openai_response`, the event-stream response in `event_stream`, the flood limits in
`openai_limits`, `ApiError` in `errors`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack, aclosing
from typing import Any

import msgspec
import structlog
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetrl.daemon.messages import Generation, SamplingParams, TokenChunk

from .attempts import ATTEMPT_HEADER, AttemptRegistry, resolve_attempt
from .recording import AttemptRecorder, CallRecord
from .errors import ApiError, ModelUnavailable
from .event_stream import Emit, EventStream
from .model import ModelClient, stream_generation
from .openai_limits import CallLimits
from .openai_request import Common, EndpointConfig, chat_request, completion_request, parse_body, sampling_params
from .openai_response import (
    CALL_HEADER,
    DONE,
    IGNORED_HEADER,
    OVERRIDDEN_HEADER,
    Reply,
    ResponseShape,
    chat_logprobs,
    chat_shape,
    completion_logprobs,
    completion_shape,
    response_headers,
    sse,
    usage_chunk,
)
from .openai_stream import TextStreamer
from .sampling_policy import REFUSED_CODE, describe

__all__ = [
    "ATTEMPT_HEADER",
    "CALL_HEADER",
    "IGNORED_HEADER",
    "OVERRIDDEN_HEADER",
    "ApiError",
    "AttemptRegistry",
    "EndpointConfig",
    "SamplingCounts",
    "SamplingStatistics",
    "ToolCallCounts",
    "ToolCallStatistics",
    "create_app",
]

_log = structlog.get_logger("fleetrl.harness.openai_api")


class ToolCallStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """Tool calling so far. ``answers_parsed``: chat answers parsed for tool calls
    (requests with tools and ``tool_choice`` ``"auto"``, one per choice);
    ``answers_with_tool_calls``: those that held at least one; ``tool_calls``: the
    calls returned; ``parse_failures``: answers with a tool-call block that did not
    parse (returned as plain content)."""

    answers_parsed: int
    answers_with_tool_calls: int
    tool_calls: int
    parse_failures: int


class ToolCallCounts:
    """The counters behind `ToolCallStatistics` (``app.state.tool_calls``)."""

    def __init__(self) -> None:
        self.answers_parsed = self.answers_with_tool_calls = self.tool_calls = self.parse_failures = 0

    def count(self, rec: CallRecord) -> None:
        """Count the answer of a call that was parsed for tool calls."""
        self.answers_parsed += 1
        self.answers_with_tool_calls += bool(rec.tool_calls)
        self.tool_calls += len(rec.tool_calls)
        self.parse_failures += rec.tool_call_parse_failure is not None

    def statistics(self) -> ToolCallStatistics:
        return ToolCallStatistics(answers_parsed=self.answers_parsed,
                                  answers_with_tool_calls=self.answers_with_tool_calls,
                                  tool_calls=self.tool_calls, parse_failures=self.parse_failures)


class SamplingStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling policy's work so far. ``overridden_requests``: requests answered
    at settings other than those they asked for (``override``); ``refused_requests``:
    requests refused (``refuse``); ``overridden`` and ``refused``: the same per
    parameter (``temperature``, ``top_p``, ``top_k``; a request that changed two
    counts for both; parameters never counted are left out). A request with ``n``
    choices counts once."""

    overridden_requests: int
    refused_requests: int
    overridden: dict[str, int]
    refused: dict[str, int]


class SamplingCounts:
    """The counters behind `SamplingStatistics` (``app.state.sampling``).
    ``on_count(kind, param)``, when given, is called for each parameter counted
    (``kind`` ``"overridden"`` or ``"refused"``): the endpoint actor's Prometheus
    counters."""

    def __init__(self, on_count: Callable[[str, str], None] | None = None) -> None:
        self.on_count = on_count
        self.overridden_requests = self.refused_requests = 0
        self.overridden: dict[str, int] = {}
        self.refused: dict[str, int] = {}

    def count_overridden(self, params: Sequence[str]) -> None:
        """Count a request answered with ``params`` overridden."""
        self.overridden_requests += 1
        for p in params:
            self.overridden[p] = self.overridden.get(p, 0) + 1
            if self.on_count is not None:
                self.on_count("overridden", p)

    def count_refused(self, param: str) -> None:
        """Count a request refused for ``param``."""
        self.refused_requests += 1
        self.refused[param] = self.refused.get(param, 0) + 1
        if self.on_count is not None:
            self.on_count("refused", param)

    def statistics(self) -> SamplingStatistics:
        return SamplingStatistics(overridden_requests=self.overridden_requests,
                                  refused_requests=self.refused_requests, overridden=dict(self.overridden),
                                  refused=dict(self.refused))


_LOGGED_OVERRIDES = 64
"""Distinct overridden combinations logged (once each); past that, only counted."""


def _choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of ``n`` choices: with a seed, choice ``i`` uses ``seed + i``
    (the same seed would give ``n`` equal answers)."""
    if params.seed is None:
        return [params] * n
    return [msgspec.structs.replace(params, seed=(params.seed + i) % 2**63) for i in range(n)]


def _error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(err.body, status_code=err.status, headers=headers)


def create_app(
    model: ModelClient,
    registry: AttemptRegistry,
    config: EndpointConfig = EndpointConfig(),
    *,
    clock: Callable[[], float] = time.time,
    sampling_counts: SamplingCounts | None = None,
) -> Starlette:
    """The endpoint app over ``model``, attributing calls through ``registry``.

    The registry's tokenizer must be the model's (ids are the model's vocabulary).
    ``app.state.registry`` and ``app.state.config`` hold the two for the caller,
    ``app.state.limits`` the `CallLimits` (its statistics), ``app.state.tool_calls``
    the `ToolCallCounts`, ``app.state.sampling`` the `SamplingCounts` (``sampling_counts``,
    else new ones).
    """
    tok = registry.tokenizer
    limits = CallLimits(per_attempt=config.max_concurrent_calls_per_attempt, waiting=config.max_waiting_calls)
    tool_counts = ToolCallCounts()
    sampling = sampling_counts if sampling_counts is not None else SamplingCounts()
    logged_overrides: set[str] = set()

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

    async def generate(key: str, attempt_id: str, prompt_ids: list[int], params: SamplingParams, n: int,
                       on_text: Callable[[int, list[int]], Awaitable[None]] | None = None) -> list[Generation]:
        """``n`` generations of ``prompt_ids``, run concurrently; each holds a waiting
        slot, all taken before any starts (so a busy endpoint refuses the request
        whole). With ``on_text`` each choice streams: ``on_text(i, ids so far)`` after
        every piece the sampler sends. One failing fails the request (503) and cancels
        the others."""
        # a client that tags requests by attempt (the sampler pool's: its logs, prompt
        # affinity and pacing go by attempt) answers through its view of this attempt
        client = model.for_attempt(attempt_id) if hasattr(model, "for_attempt") else model
        gens: list[Generation | None] = [None] * n
        failures: list[ModelUnavailable] = []

        async def one(i: int, p: SamplingParams, cancel: trio.CancelScope | None) -> None:
            try:
                if on_text is None:
                    gens[i] = await client.generate(prompt_ids, p)
                    return
                ids: list[int] = []
                async with aclosing(stream_generation(client, prompt_ids, p)) as items:
                    async for item in items:
                        if isinstance(item, TokenChunk):
                            ids.extend(item.token_ids)
                            await on_text(i, ids)
                        else:
                            gens[i] = item
            except ModelUnavailable as err:
                failures.append(err)
                if cancel is not None:
                    cancel.cancel()

        with ExitStack() as slots:
            if on_text is None:  # a stream's slots are taken before it begins (`respond`)
                for _ in range(n):
                    slots.enter_context(limits.model_slot())
            choice_params = _choice_params(params, n)
            if n == 1:
                await one(0, choice_params[0], None)
            else:
                async with trio.open_nursery() as nursery:
                    for i, p in enumerate(choice_params):
                        nursery.start_soon(one, i, p, nursery.cancel_scope)
        if failures or any(g is None for g in gens):
            raise ApiError(503, f"the model could not answer: {failures[0] if failures else 'no generation'}",
                           type="server_error", code="model_unavailable")
        if registry.recorder(key) is None:
            raise ApiError(401, "the attempt was closed while this call ran; the call was not recorded",
                           type="authentication_error", code="attempt_closed")
        return gens  # type: ignore[return-value]

    def log_ignored(recorder: AttemptRecorder, recs: Sequence[CallRecord], ignored: Sequence[str]) -> None:
        if ignored:
            _log.warning("openai request parameters ignored", attempt_id=recorder.attempt_id,
                         call=recs[0].index if len(recs) == 1 else [r.index for r in recs], ignored=list(ignored))

    def sampling_headers(c: Common) -> dict[str, str]:
        return {OVERRIDDEN_HEADER: describe(c.overridden)} if c.overridden else {}

    def count_overridden(recorder: AttemptRecorder, c: Common) -> None:
        """Count a request answered at overridden settings; log each distinct
        combination once (info: the policy is the operator's choice, not a fault)."""
        if not c.overridden:
            return
        sampling.count_overridden([o.param for o in c.overridden])
        text = describe(c.overridden)
        if text not in logged_overrides and len(logged_overrides) < _LOGGED_OVERRIDES:
            logged_overrides.add(text)
            _log.info("openai request sampling overridden (logged once per combination)",
                      attempt_id=recorder.attempt_id, overridden=text)

    def reply(prefix: str) -> Reply:
        return Reply(id=f"{prefix}-{secrets.token_hex(12)}", created=int(clock()), model=config.model_name)

    Record = Callable[[Sequence[Generation]], tuple[list[CallRecord], list[Any]]]

    async def respond(slots: ExitStack, key: str, recorder: AttemptRecorder, prompt_ids: list[int],
                      params: SamplingParams, c: Common, record: Record, shape: ResponseShape,
                      streamers: Callable[[], TextStreamer]) -> Response:
        """The answer to a request of either route: one JSON body, or (``stream``) its
        event stream: the opening chunks, each choice's safe text as it is generated,
        then once the calls are recorded the rest of the text and the final chunks, the
        usage when asked, ``[DONE]``. The stream's ``n`` model slots are taken now (429
        before it begins) and ``slots`` are held until it ends; a failure once it has
        begun is an error event."""
        if not c.stream:
            recs, logprobs = record(await generate(key, recorder.attempt_id, prompt_ids, params, c.n))
            count_overridden(recorder, c)
            return JSONResponse(shape.body(recs, logprobs), headers={**response_headers(recs), **sampling_headers(c)})
        for _ in range(c.n):
            slots.enter_context(limits.model_slot())
        texts = [streamers() for _ in range(c.n)]

        async def produce(emit: Emit) -> None:
            async def on_text(i: int, ids: list[int]) -> None:
                if text := texts[i].push(ids):
                    await emit(sse(shape.content(i, text)))

            for i in range(c.n):
                for chunk in shape.opening(i):
                    await emit(sse(chunk))
            recs, logprobs = record(await generate(key, recorder.attempt_id, prompt_ids, params, c.n, on_text))
            count_overridden(recorder, c)
            for i, (rec, lp) in enumerate(zip(recs, logprobs)):
                if rest := texts[i].rest(rec.text):
                    await emit(sse(shape.content(i, rest)))
                for chunk in shape.final(i, rec, lp):
                    await emit(sse(chunk))
            if c.include_usage:
                await emit(sse(usage_chunk(shape.reply, shape.chunk_object, recs)))
            await emit(DONE)

        async def guarded(emit: Emit) -> None:
            try:
                await produce(emit)
            except ApiError as err:
                _log.warning("openai stream failed", status=err.status, code=err.code, error=err.message)
                await emit(sse(err.body))
                await emit(DONE)

        # known before anything is generated: the stream's headers carry it
        return EventStream(guarded, sampling_headers(c), slots.pop_all())

    async def chat_completions(request: Request) -> Response:
        key, recorder = resolve_attempt(registry, request.headers)
        with ExitStack() as slots:
            slots.enter_context(limits.attempt_slot(key))
            req = chat_request(await read_json(request), config)
            c = req.common
            plan = recorder.plan_chat(req.messages, req.tools)
            params = sampling_params(c, req.max_tokens, len(plan.ids), config, tok.eos_id, "messages")

            def record(gens: Sequence[Generation]) -> tuple[list[CallRecord], list[Any]]:
                recs = [recorder.record_chat(req.messages, plan, gen, stops=c.stops, ignored_params=req.ignored,
                                             tools=req.tools, parse_tool_calls=req.parse_tool_calls) for gen in gens]
                if req.parse_tool_calls:
                    for rec in recs:
                        tool_counts.count(rec)
                log_ignored(recorder, recs, req.ignored)
                return recs, [chat_logprobs(tok, rec, req.top_logprobs) if req.logprobs else None for rec in recs]

            return await respond(slots, key, recorder, plan.ids, params, c, record, chat_shape(reply("chatcmpl")),
                                 lambda: TextStreamer(tok, stops=c.stops, tool_calls=req.parse_tool_calls))

    async def completions(request: Request) -> Response:
        key, recorder = resolve_attempt(registry, request.headers)
        with ExitStack() as slots:
            slots.enter_context(limits.attempt_slot(key))
            req = completion_request(await read_json(request), config, tok)
            c = req.common
            params = sampling_params(c, req.max_tokens, len(req.prompt_ids), config, tok.eos_id, "prompt")

            def record(gens: Sequence[Generation]) -> tuple[list[CallRecord], list[Any]]:
                recs = [recorder.record_completion(req.prompt_ids, gen, stops=c.stops, ignored_params=c.ignored)
                        for gen in gens]
                log_ignored(recorder, recs, c.ignored)
                return recs, [completion_logprobs(tok, rec, req.logprobs) if req.logprobs is not None else None
                              for rec in recs]

            return await respond(slots, key, recorder, req.prompt_ids, params, c, record,
                                 completion_shape(reply("cmpl")), lambda: TextStreamer(tok, stops=c.stops))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": 0, "owned_by": "fleetrl"}]})

    def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as err:
                if err.code == REFUSED_CODE and err.param is not None:
                    sampling.count_refused(err.param)
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
    app.state.tool_calls = tool_counts
    app.state.sampling = sampling
    return app
