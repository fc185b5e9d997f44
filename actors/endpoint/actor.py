"""The endpoint actor: the OpenAI-compatible, token-recording endpoint served by the daemon.

``run(cfg: EndpointActorConfig, ctx, *, task_status)`` builds
`fleetrl.harness.openai_api.create_app` over a model client (a torch backend of its
own, or the sampler pool actor's handle: the environment worker's `LocalModelClient` /
`PoolModelClient`, from `fleetrl.actors.envworker.model.open_model`) and one
`AttemptRegistry`, and mounts it on the daemon's control plane at ``/v1`` without the
control token (the endpoint checks the per-attempt keys itself). A harness then talks
to ``http://127.0.0.1:PORT/v1`` (PORT from ``<state>/control.json``).

It starts with an `EndpointHandle` (the registry to open and close attempts in, the
base URL a harness is pointed at, the served model name): other actors of the same
daemon reach it with ``await ctx.handle(name)``. The environment worker's external
harness (``harness = "external"``, ``endpoint = NAME``) does, and paces its groups
through the handle's model when that is the sampler pool (``model.kind = "pool"``,
``pacing = true``): the same staleness admission as the built-in harness.

The endpoint's sampling policy (``[actors.NAME.config.sampling]``,
`fleetrl.harness.sampling_policy`) is counted twice: in its statistics (/status) and as
the Prometheus counters ``fleetrl_endpoint_sampling_overridden_total`` and
``fleetrl_endpoint_sampling_refused_total``, labelled ``actor`` and ``param``.

The registry outlives a restart of the actor (the new incarnation takes it from
``ctx.previous_handle``), so attempts opened before a crash keep recording once the
endpoint is back. It reads no messages; at shutdown it keeps serving until its inbox
ends, which happens once every actor holding its handle (the workers, finishing their
attempts in their drain grace) has returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Never

import msgspec
import trio

from fleetrl.actors.envworker.model import open_model
from fleetrl.daemon.actor import ActorContext
from fleetrl.daemon.state import client_host, read_control
from fleetrl.harness.openai_api import AttemptRegistry, SamplingCounts, ToolCallCounts, create_app
from fleetrl.harness.openai_limits import CallLimits
from fleetrl.harness.sampling_policy import PARAMS

from .config import EndpointActorConfig

__all__ = ["PREFIX", "EndpointHandle", "EndpointStatistics", "Inbox", "base_url_of", "client_host", "run",
           "sampling_counters"]

PREFIX = "/v1"
"""Where the endpoint is mounted on the control plane (its routes are ``/v1/...``)."""

Inbox = Never
"""The endpoint takes no messages; it serves HTTP."""


class EndpointStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What the endpoint holds now and what it has refused."""

    open_attempts: int
    """Attempts whose keys are open now."""
    calls_in_flight: int = 0
    """Calls being served now (admitted, not yet answered)."""
    calls_waiting: int = 0
    """Calls waiting for the model now."""
    rejected_too_many_concurrent_calls: int = 0
    """Calls refused with 429 ``too_many_concurrent_calls`` (an attempt over its limit)."""
    rejected_endpoint_busy: int = 0
    """Calls refused with 429 ``endpoint_busy`` (too many calls waiting for the model)."""
    answers_with_tool_calls: int = 0
    """Answers parsed for tool calls (requests with ``tools``) that held at least one."""
    tool_calls: int = 0
    """Tool calls returned."""
    tool_call_parse_failures: int = 0
    """Answers with a tool-call block that did not parse (returned as plain content)."""
    sampling_overridden_requests: int = 0
    """Requests answered at the run's sampling settings instead of those they asked for
    (sampling policy ``override``; a request with ``n`` choices counts once)."""
    sampling_refused_requests: int = 0
    """Requests refused with 400 ``sampling_refused`` (sampling policy ``refuse``)."""
    sampling_overridden: dict[str, int] = {}
    """Overridden requests per parameter (``temperature``, ``top_p``, ``top_k``)."""
    sampling_refused: dict[str, int] = {}
    """Refused requests per parameter (the first out of range)."""


@dataclass(frozen=True)
class EndpointHandle:
    """What another actor needs to run a harness against the endpoint."""

    registry: AttemptRegistry
    base_url: str
    """``http://HOST:PORT/v1`` of the control plane."""
    model_name: str
    model: Any = None
    """The model client answering the calls (`LocalModelClient` or `PoolModelClient`)."""
    model_config: Any = None
    """Its setting (`LocalModel` or `PoolModel`): a worker running an external harness
    paces its groups through the pool's pacer when this is a `PoolModel` with
    ``pacing = true``."""
    limits: CallLimits | None = None
    """The app's flood limits (`fleetrl.harness.openai_limits`), for the statistics."""
    tool_counts: ToolCallCounts | None = None
    """The app's tool-call counters (`fleetrl.harness.openai_api.ToolCallCounts`)."""
    sampling_counts: SamplingCounts | None = None
    """The app's sampling-policy counters (`fleetrl.harness.openai_api.SamplingCounts`)."""

    def statistics(self) -> EndpointStatistics:
        if self.limits is None:
            return EndpointStatistics(open_attempts=len(self.registry))
        s = self.limits.statistics()
        t = self.tool_counts.statistics() if self.tool_counts is not None else None
        p = self.sampling_counts.statistics() if self.sampling_counts is not None else None
        return EndpointStatistics(open_attempts=len(self.registry), calls_in_flight=s.in_flight,
                                  calls_waiting=s.waiting,
                                  rejected_too_many_concurrent_calls=s.rejected_per_attempt,
                                  rejected_endpoint_busy=s.rejected_busy,
                                  answers_with_tool_calls=t.answers_with_tool_calls if t else 0,
                                  tool_calls=t.tool_calls if t else 0,
                                  tool_call_parse_failures=t.parse_failures if t else 0,
                                  sampling_overridden_requests=p.overridden_requests if p else 0,
                                  sampling_refused_requests=p.refused_requests if p else 0,
                                  sampling_overridden=p.overridden if p else {},
                                  sampling_refused=p.refused if p else {})


def base_url_of(daemon_dir: Any) -> str:
    """``http://HOST:PORT/v1`` of the daemon's control plane (from ``control.json``)."""
    try:
        host, port = read_control(daemon_dir)
    except FileNotFoundError:
        raise ValueError("the endpoint actor needs the control plane: set [http] enabled = true "
                         f"(no control.json in {daemon_dir})") from None
    return f"http://{client_host(host)}:{port}{PREFIX}"


class _KeepFullPath:
    """Mounted apps see ``root_path`` = the prefix and Starlette routes on the path
    without it; the endpoint's routes are the full ``/v1/...`` paths, so the prefix is
    taken back out of ``root_path`` before the app sees the request."""

    def __init__(self, app: Any, prefix: str) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        root = scope.get("root_path", "")
        if root.endswith(self.prefix):
            scope = dict(scope)
            scope["root_path"] = root[: -len(self.prefix)]
        await self.app(scope, receive, send)


def sampling_counters(metrics: Any) -> SamplingCounts:
    """`SamplingCounts` that also count into the Prometheus counters
    ``endpoint_sampling_overridden`` and ``endpoint_sampling_refused`` (exported with
    ``_total``) of ``metrics`` (the actor's `ActorMetrics`), one child per parameter,
    created up front so each reads 0 until counted. A restarted actor gets the same
    children back, so the counters keep counting across restarts."""
    docs = {"overridden": "Endpoint requests sampled at the run's settings instead of those they asked for, "
                          "per parameter changed (sampling policy override)",
            "refused": "Endpoint requests refused for a sampling parameter outside the allowed range "
                       "(sampling policy refuse)"}
    counters = {(kind, param): metrics.counter(f"endpoint_sampling_{kind}", doc, {"param": param})
                for kind, doc in docs.items() for param in PARAMS}

    def on_count(kind: str, param: str) -> None:
        counter = counters.get((kind, param))
        if counter is not None:
            counter.inc()

    return SamplingCounts(on_count=on_count)


async def run(cfg: EndpointActorConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[EndpointHandle] = trio.TASK_STATUS_IGNORED) -> None:
    """The endpoint actor (see the module docstring)."""
    base_url = base_url_of(ctx.daemon_dir)
    model = await open_model(cfg.model, ctx)
    held = ctx.previous_handle
    if held is not None and held.registry.tokenizer.vocab_size == model.tokenizer.vocab_size:
        registry = held.registry  # a restart: attempts opened before it keep recording
    else:
        registry = AttemptRegistry(model.tokenizer)
    app = create_app(model, registry, cfg.endpoint_config(), sampling_counts=sampling_counters(ctx.metrics))
    ctx.mount(PREFIX, _KeepFullPath(app, PREFIX), auth=False)
    ctx.log.info("openai endpoint serving", url=base_url, model=cfg.model_name,
                 sampling_policy=cfg.sampling.policy)
    task_status.started(EndpointHandle(registry=registry, base_url=base_url, model_name=cfg.model_name,
                                       model=model, model_config=cfg.model, limits=app.state.limits,
                                       tool_counts=app.state.tool_calls, sampling_counts=app.state.sampling))
    async for msg in ctx.inbox:  # ends at shutdown once every holder of the handle has returned
        ctx.log.warning("message ignored", type=type(msg).__name__)
    ctx.log.info("openai endpoint stopped", open_attempts=len(registry))
