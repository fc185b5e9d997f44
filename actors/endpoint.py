"""The endpoint actor: the OpenAI-compatible, token-recording endpoint served by the daemon.

``run(cfg: EndpointActorConfig, ctx, *, task_status)`` builds
`fleetrl.harness.openai_api.create_app` over a model client (a torch backend of its
own, or the sampler pool actor's in-process client: the environment worker's
`LocalModelClient` / `PoolModelClient`) and one `AttemptRegistry`, and mounts it on
the daemon's control plane at ``/v1`` without the control token (the endpoint checks
the per-attempt keys itself). A harness then talks to
``http://127.0.0.1:PORT/v1`` (PORT from ``<state>/control.json``).

Other actors of the same daemon reach it in-process: ``await endpoint_handle(name,
instance_id=ctx.instance_id)`` waits until the endpoint actor ``name`` has started and
gives its `EndpointHandle` (the registry to open and close attempts in, the base URL a
harness is pointed at, the served model name). The environment worker's external
harness (``harness = "external"``, ``endpoint = NAME``) uses it.

The registry outlives a restart of the actor (same daemon instance, same name), so
attempts opened before a crash keep recording once the endpoint is back. At shutdown
the endpoint keeps serving while attempts are open (workers finish theirs during
their drain grace) and returns once none has been open for ``drain_quiet_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import trio

from fleetrl.actors.envworker.config import LocalModel, PoolModel
from fleetrl.daemon.state import read_control
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app

__all__ = ["PREFIX", "EndpointActorConfig", "EndpointHandle", "endpoint_handle", "run"]

PREFIX = "/v1"
"""Where the endpoint is mounted on the control plane (its routes are ``/v1/...``)."""

PosInt = Annotated[int, msgspec.Meta(ge=1)]


class EndpointActorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of the endpoint actor (``[actors.NAME.config]``; see docs/openai-endpoint.md)."""

    model: LocalModel | PoolModel
    """``{kind = "local", model_dir = ...}`` or ``{kind = "pool", pool = "pool", tokenizer_dir = ...}``."""
    model_name: str = "fleetrl"
    """The one model id served (requests naming another get 404)."""
    context_length: PosInt = 4096
    default_max_tokens: PosInt = 512
    max_body_bytes: PosInt = 8 << 20
    drain_quiet_s: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    """At shutdown: return once no attempt has been open for this long."""

    def __post_init__(self) -> None:
        self.endpoint_config()  # its checks, at load time

    def endpoint_config(self) -> EndpointConfig:
        return EndpointConfig(model_name=self.model_name, context_length=self.context_length,
                              default_max_tokens=self.default_max_tokens, max_body_bytes=self.max_body_bytes)


@dataclass(frozen=True)
class EndpointHandle:
    """What another actor needs to run a harness against the endpoint."""

    registry: AttemptRegistry
    base_url: str
    """``http://HOST:PORT/v1`` of the control plane."""
    model_name: str


_HANDLES: dict[tuple[str, str], EndpointHandle] = {}
_READY: dict[tuple[str, str], trio.Event] = {}


async def endpoint_handle(name: str, *, instance_id: str) -> EndpointHandle:
    """The handle of endpoint actor ``name`` of daemon ``instance_id`` (waits until it has started)."""
    key = (instance_id, name)
    while key not in _HANDLES:
        await _READY.setdefault(key, trio.Event()).wait()
    return _HANDLES[key]


def client_host(host: str) -> str:
    """The address a local client dials for a server bound to ``host`` (wildcards -> loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


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


async def _open_model(cfg: EndpointActorConfig, ctx: Any) -> Any:
    from fleetrl.actors.envworker.worker import open_model

    return await open_model(cfg.model, ctx)


async def run(cfg: EndpointActorConfig, ctx: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """The endpoint actor (see the module docstring)."""
    base_url = base_url_of(ctx.daemon_dir)
    model = await _open_model(cfg, ctx)
    key = (ctx.instance_id, ctx.name)
    held = _HANDLES.get(key)
    if held is not None and held.registry.tokenizer.vocab_size == model.tokenizer.vocab_size:
        registry = held.registry  # a restart: attempts opened before it keep recording
    else:
        registry = AttemptRegistry(model.tokenizer)
    app = create_app(model, registry, cfg.endpoint_config())
    ctx.mount(PREFIX, _KeepFullPath(app, PREFIX), auth=False)
    _HANDLES[key] = EndpointHandle(registry=registry, base_url=base_url, model_name=cfg.model_name)
    _READY.pop(key, trio.Event()).set()
    ctx.log.info("openai endpoint serving", url=base_url, model=cfg.model_name)
    task_status.started()
    await ctx.wait_draining()
    quiet_since = trio.current_time()
    while True:  # serve the attempts still running in the workers' drain grace
        if len(registry):
            quiet_since = trio.current_time()
        elif trio.current_time() - quiet_since >= cfg.drain_quiet_s:
            break
        await trio.sleep(0.1)
    ctx.log.info("openai endpoint stopped", open_attempts=len(registry))
