"""Who feeds whom in a loaded config, and with what sampling settings (pure).

The daemon's config names each actor's factory and checks each actor's own settings
alone; how the actors fit together is only in the names they give each other. `wiring`
reads those names: each environment worker (local, or the remote workers actor) feeds
the trainer it targets, calls the sampler pool of its model (with ``harness =
"external"``: the endpoint actor's model) and samples with settings that are known
from the config in two cases only: a built-in harness (its ``harness_config``) and an
endpoint whose sampling policy is ``override`` (its ``sampling``). With ``honour`` the
harness decides call by call, which a config does not say.

Actors are recognised by the type of their config (`TrainerConfig`, `PoolConfig`, ...),
whatever their names. A key path is a tuple of TOML keys, e.g. ``("actors", "env",
"config", "harness_config", "temperature")``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from fleetrl.actors.endpoint.config import EndpointActorConfig
from fleetrl.actors.envworker.config import EXTERNAL, EnvWorkerConfig, PoolModel
from fleetrl.actors.evaluator.config import EvaluatorConfig
from fleetrl.actors.pool.config import PoolConfig
from fleetrl.actors.trainer.config import TrainerConfig
from fleetrl.actors.workers.config import RemoteWorkersConfig
from fleetrl.daemon.config import Config
from fleetrl.daemon.messages import SamplingParams
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT
from fleetrl.harness.builtin import CompletionHarness, ShellAgentHarness
from fleetrl.harness.sampling_policy import SamplingPolicy

__all__ = ["BUILTIN_HARNESSES", "Feed", "KeyPath", "Sampling", "Wiring", "wiring"]

KeyPath = tuple[str, ...]

BUILTIN_HARNESSES: dict[str, type[msgspec.Struct]] = {
    "fleetrl.harness.builtin:CompletionHarness": CompletionHarness,
    "fleetrl.harness.builtin:ShellAgentHarness": ShellAgentHarness,
}
"""The harnesses whose sampling settings are fields of ``harness_config``."""


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling settings every call of a worker is made with."""

    temperature: float
    top_p: float
    top_k: int | None
    at: KeyPath
    """The table that holds them (a ``harness_config``, or an endpoint's ``sampling``)."""
    how: Literal["harness", "override"]

    def describe(self) -> str:
        k = "" if self.top_k is None else f", top_k {self.top_k}"
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}{k}"


class Feed(msgspec.Struct, frozen=True, kw_only=True):
    """One environment-worker actor and what it is wired to."""

    name: str
    cfg: EnvWorkerConfig
    remote: bool
    """The remote workers actor (`RemoteWorkersConfig`)."""
    trainer: str | None
    """The actor it sends groups to, when that is a trainer (else None)."""
    pool: str | None
    """The sampler pool actor its calls go through (None: a local model, or unknown)."""
    pool_model: PoolModel | None
    """The ``model = {kind = "pool", ...}`` setting of that pool (pacing, its mirror)."""
    pool_model_at: KeyPath
    sampling: Sampling | None
    """Known settings of every call (None: not known from the config)."""
    harness_problem: str | None
    """Why a built-in harness's ``harness_config`` would fail at the worker's start."""
    policy: SamplingPolicy | None
    """The endpoint's sampling policy (an external harness)."""
    policy_at: KeyPath

    @property
    def paced(self) -> bool:
        return self.pool is not None and self.pool_model is not None and self.pool_model.pacing


class Wiring(msgspec.Struct, frozen=True, kw_only=True):
    """A config's actors by kind, and its feeds."""

    names: tuple[str, ...]
    trainers: dict[str, TrainerConfig]
    pools: dict[str, PoolConfig]
    evaluators: dict[str, EvaluatorConfig]
    endpoints: dict[str, EndpointActorConfig]
    feeds: tuple[Feed, ...]

    def cap(self, feed: Feed) -> int:
        """The most members any support of the feed's calls has (the pool's ``max_support``;
        a local model's torch sampler keeps the default)."""
        return self.pools[feed.pool].max_support if feed.pool in self.pools else DEFAULT_MAX_SUPPORT


def _builtin(cfg: EnvWorkerConfig, at: KeyPath) -> tuple[Sampling | None, str | None]:
    cls = BUILTIN_HARNESSES.get(cfg.harness)
    if cls is None:
        return None, None
    unknown = sorted(set(cfg.harness_config) - set(cls.__struct_fields__))
    if unknown:
        return None, (f"unknown key(s) {', '.join(unknown)} for {cls.__name__} "
                      f"(known: {', '.join(cls.__struct_fields__)})")
    try:
        h: Any = msgspec.convert(cfg.harness_config, cls)
        SamplingParams(max_tokens=h.max_tokens, temperature=h.temperature, top_p=h.top_p, top_k=h.top_k)
    except (msgspec.ValidationError, ValueError) as exc:
        return None, str(exc)
    return Sampling(temperature=float(h.temperature), top_p=float(h.top_p), top_k=h.top_k, at=at,
                    how="harness"), None


def _override(policy: SamplingPolicy | None, at: KeyPath) -> Sampling | None:
    if policy is None or policy.policy != "override":
        return None
    return Sampling(temperature=policy.temperature, top_p=policy.top_p, top_k=policy.top_k, at=at,
                    how="override")


def wiring(config: Config) -> Wiring:
    """The actors of ``config`` by kind and each environment worker's `Feed`."""
    by_kind: dict[type, dict[str, Any]] = {k: {} for k in (TrainerConfig, PoolConfig, EvaluatorConfig,
                                                           EndpointActorConfig)}
    workers: list[tuple[str, EnvWorkerConfig]] = []
    for spec in config.actors:
        for kind, found in by_kind.items():
            if isinstance(spec.config, kind):
                found[spec.name] = spec.config
        if isinstance(spec.config, EnvWorkerConfig):
            workers.append((spec.name, spec.config))
    trainers, pools = by_kind[TrainerConfig], by_kind[PoolConfig]
    endpoints = by_kind[EndpointActorConfig]
    feeds = []
    for name, cfg in workers:
        base: KeyPath = ("actors", name, "config")
        remote = isinstance(cfg, RemoteWorkersConfig)
        model, model_at = cfg.model, base + ("model",)
        policy, policy_at = None, ()
        if cfg.harness == EXTERNAL:
            if remote:
                policy, policy_at = cfg.endpoint_config.sampling, base + ("endpoint_config", "sampling")
            elif cfg.endpoint in endpoints:
                ep = endpoints[cfg.endpoint]
                model, model_at = ep.model, ("actors", cfg.endpoint, "config", "model")
                policy, policy_at = ep.sampling, ("actors", cfg.endpoint, "config", "sampling")
        sampling, problem = _builtin(cfg, base + ("harness_config",))
        if sampling is None and problem is None:
            sampling = _override(policy, policy_at)
        pool_model = model if isinstance(model, PoolModel) else None
        feeds.append(Feed(
            name=name, cfg=cfg, remote=remote, trainer=cfg.target if cfg.target in trainers else None,
            pool=pool_model.pool if pool_model is not None and pool_model.pool in pools else None,
            pool_model=pool_model, pool_model_at=model_at, sampling=sampling, harness_problem=problem,
            policy=policy, policy_at=policy_at))
    return Wiring(names=tuple(s.name for s in config.actors), trainers=trainers, pools=pools,
                  evaluators=by_kind[EvaluatorConfig], endpoints=endpoints, feeds=tuple(feeds))
