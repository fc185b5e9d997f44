"""Every actor follows the one template (docs/daemon.md, "Writing an actor").

For every factory the shipped configs name (configs/*.toml, the daemon's default
config) and every ``fleetrl.*:run`` factory the docs and tests name:

    async def run(cfg: XConfig, ctx: ActorContext, *,
                  task_status: trio.TaskStatus[XHandle] = trio.TASK_STATUS_IGNORED) -> None

with ``XConfig`` a frozen msgspec Struct that refuses unknown fields, defined in the
actor package's ``config.py``; ``XHandle.statistics()`` returning a frozen msgspec
Struct; and a module-level ``Inbox``: the closed union of the message types the actor
reads (a Struct, a union of Structs, or ``Never``).
"""

from __future__ import annotations

import importlib
import inspect
import re
import tomllib
import types
import typing
from pathlib import Path

import msgspec
import pytest
import trio

from fleetrl.daemon.actor import ActorContext

REPO = Path(__file__).resolve().parent.parent
FACTORY = re.compile(r"\bfleetrl\.[a-z_.]+:run\b")


def shipped_factories() -> set[str]:
    """Factories in the configs we ship (configs/*.toml and the daemon's default)."""
    out = set()
    for path in [*sorted((REPO / "configs").glob("*.toml")), REPO / "daemon" / "default.toml"]:
        for spec in tomllib.loads(path.read_text(encoding="utf-8")).get("actors", {}).values():
            out.add(spec["factory"])
    return out


def named_factories() -> set[str]:
    """Our own factories named anywhere in docs/ or tests/ (a test config, an example)."""
    out = set()
    for path in [*REPO.glob("docs/**/*.md"), *REPO.glob("tests/**/*.py")]:
        out.update(FACTORY.findall(path.read_text(encoding="utf-8")))
    return out


def is_struct(t: object, *, frozen: bool = True) -> bool:
    return (isinstance(t, type) and issubclass(t, msgspec.Struct)
            and (not frozen or t.__struct_config__.frozen))


FACTORIES = sorted(shipped_factories() | named_factories())


def test_the_configs_name_the_actors_we_ship():
    shipped = shipped_factories()
    for factory in ("fleetrl.actors.trainer:run", "fleetrl.actors.pool:run", "fleetrl.actors.envworker:run",
                    "fleetrl.actors.evaluator:run", "fleetrl.daemon.ticker:run"):
        assert factory in shipped
    assert "fleetrl.actors.endpoint:run" in FACTORIES


def template_problems(run: typing.Any) -> list[str]:
    """How `run` departs from the actor template (empty: it follows it)."""
    if not inspect.iscoroutinefunction(run):
        return ["not an async function"]
    params = list(inspect.signature(run).parameters.values())
    if [(p.name, p.kind) for p in params] != [
            ("cfg", inspect.Parameter.POSITIONAL_OR_KEYWORD), ("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            ("task_status", inspect.Parameter.KEYWORD_ONLY)] or params[2].default is not trio.TASK_STATUS_IGNORED:
        return [f"signature {inspect.signature(run)}"]
    out = []
    hints = typing.get_type_hints(run)
    cfg = hints.get("cfg")
    package = run.__module__.rpartition(".")[0]
    if not (is_struct(cfg) and cfg.__struct_config__.forbid_unknown_fields):
        out.append(f"config {cfg!r} is not a frozen msgspec Struct refusing unknown fields")
    elif cfg.__module__ != f"{package}.config":
        out.append(f"config {cfg.__qualname__} is not in {package}/config.py")
    if hints.get("ctx") is not ActorContext:
        out.append(f"ctx is annotated {hints.get('ctx')!r}, not ActorContext")
    if hints.get("return") is not type(None):
        out.append("the return type is not None")
    status = hints.get("task_status")
    if typing.get_origin(status) is not trio.TaskStatus:
        out.append(f"task_status is {status!r}, not trio.TaskStatus[Handle]")
    else:
        (handle,) = typing.get_args(status)
        stats = getattr(handle, "statistics", None)
        record = typing.get_type_hints(stats).get("return") if callable(stats) else None
        if not is_struct(record):
            out.append(f"{handle!r}.statistics() does not return a frozen msgspec Struct (got {record!r})")
    inbox = getattr(importlib.import_module(run.__module__), "Inbox", None)
    members = typing.get_args(inbox) if typing.get_origin(inbox) in (typing.Union, types.UnionType) else (inbox,)
    if inbox is None:
        out.append(f"{run.__module__} declares no Inbox")
    elif inbox is not typing.Never and not all(is_struct(t) for t in members):
        out.append(f"Inbox = {inbox!r} is not a union of msgspec Structs (or Never)")
    return out


@pytest.mark.parametrize("factory", FACTORIES)
def test_every_actor_follows_the_template(factory):
    module_name, _, attr = factory.partition(":")
    run = getattr(importlib.import_module(module_name), attr)
    assert template_problems(run) == []


class _Loose(msgspec.Struct):
    n: int = 0


async def off_template(cfg: _Loose, ctx: typing.Any, *, task_status: typing.Any = trio.TASK_STATUS_IGNORED) -> None:
    """An actor written the old way: a loose config inline, ``ctx: Any``, no handle type."""


Inbox = int


def test_the_template_check_reports_an_actor_off_the_template():
    assert template_problems(off_template) == [
        f"config {_Loose!r} is not a frozen msgspec Struct refusing unknown fields",
        "ctx is annotated typing.Any, not ActorContext",
        "task_status is typing.Any, not trio.TaskStatus[Handle]",
        "Inbox = <class 'int'> is not a union of msgspec Structs (or Never)",
    ]
