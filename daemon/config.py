"""The daemon's config: one TOML file -> frozen, typed msgspec structs.

Sections: ``[daemon]``, ``[http]``, ``[supervisor]`` (with ``[supervisor.restart]``),
``[logging]`` and one ``[actors.NAME]`` table per actor. An actor table names its
factory by import path (``"package.module:function"``); the factory's first
parameter is annotated with a frozen msgspec Struct, and ``[actors.NAME.config]`` is
validated strictly against it. The daemon never imports actors by name: whatever the
config names is what runs (a user's own actor works the same way).

Every problem is one `ConfigError` naming the file, the line of the offending key
(tomllib gives no positions, so `key_line` finds it in the text) and the dotted key
path. The top-level `Config` only composes the sections; no section rewrites another.
"""

from __future__ import annotations

import importlib
import inspect
import re
import tomllib
import typing
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from .faults import ConfigError

__all__ = [
    "ActorSpec", "Config", "DaemonSection", "HttpSection", "LoggingSection",
    "RestartPolicy", "SupervisorSection", "default_config_path", "key_line",
    "load_config", "load_config_text", "load_factory",
]

PositiveSeconds = Annotated[float, Meta(gt=0, le=7 * 24 * 3600)]


class DaemonSection(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[daemon]``: where state lives and how shutdown and checkpoints are paced."""

    #: state directory (run id, token, lock, checkpoints, logs); relative to the cwd
    state_dir: str = ".fleetrl"
    #: seconds actors get to finish after SIGTERM before they are cancelled
    grace_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    #: seconds between periodic checkpoints
    checkpoint_interval_s: PositiveSeconds = 60.0
    #: how many checkpoint files to keep (newest first)
    checkpoint_keep: Annotated[int, Meta(ge=1, le=1000)] = 3
    #: deadline for running every checkpoint hook and writing one checkpoint
    checkpoint_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    #: intra-op threads of torch/MKL/OpenBLAS in every thread of the daemon (OMP_NUM_THREADS
    #: and friends, set by `fleetrl serve` before torch loads; daemon/threads.py); unset:
    #: the libraries' default (one per core) or what the environment says
    compute_threads: Annotated[int, Meta(ge=1, le=1024)] | None = None


class HttpSection(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[http]``: the control plane (bearer-token protected, loopback by default)."""

    enabled: bool = True
    host: Annotated[str, Meta(min_length=1)] = "127.0.0.1"
    #: 0 picks a free port; the bound port is written to ``<state>/control.json``
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    #: PEM certificate (chain) and private key: with both, the control plane (and
    #: everything mounted on it: the fleet join, weights, the endpoint) speaks only TLS
    tls_cert: Annotated[str, Meta(min_length=1)] | None = None
    tls_key: Annotated[str, Meta(min_length=1)] | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")

    def tls_problem(self) -> str | None:
        """Why the certificate and key cannot serve TLS (None: they can, or TLS is off)."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            return f"[http] tls_cert = {self.tls_cert!r}, tls_key = {self.tls_key!r}: {exc}"
        return None


class RestartPolicy(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One-for-one restart: exponential backoff, and an intensity limit.

    The n-th consecutive restart waits ``min(backoff_max_s, backoff_base_s *
    backoff_factor**(n-1))`` seconds, spread by +-``jitter`` (a fraction). More than
    ``intensity`` crashes within ``period_s`` seconds stops the daemon.
    """

    backoff_base_s: Annotated[float, Meta(gt=0, le=3600)] = 0.5
    backoff_factor: Annotated[float, Meta(ge=1, le=100)] = 2.0
    backoff_max_s: Annotated[float, Meta(gt=0, le=24 * 3600)] = 30.0
    jitter: Annotated[float, Meta(ge=0, le=1)] = 0.1
    intensity: Annotated[int, Meta(ge=1, le=10_000)] = 5
    period_s: PositiveSeconds = 60.0


class SupervisorSection(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[supervisor]``: defaults that every actor may override."""

    #: default inbox capacity (messages); small so backpressure is real
    inbox: Annotated[int, Meta(ge=1, le=1_000_000)] = 16
    restart: RestartPolicy = RestartPolicy()


class LoggingSection(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[logging]``: structlog output."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    #: auto: readable console output on a terminal, JSON lines otherwise (service mode)
    format: Literal["auto", "json", "console"] = "auto"
    #: also append JSON lines to ``<state>/logs/``
    file: bool = True
    #: which lines also go to stderr: all, only warnings and errors, or none (the file keeps all)
    console: Literal["all", "warnings", "none"] = "all"


class _ActorTable(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Raw ``[actors.NAME]`` table before its factory is resolved."""

    factory: Annotated[str, Meta(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")]
    after: list[Annotated[str, Meta(min_length=1)]] = []
    inbox: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    restart: dict[str, Any] = {}
    config: dict[str, Any] = {}


class ActorSpec(Struct, frozen=True, kw_only=True):
    """One resolved actor: its factory, typed config, inbox size and restart policy."""

    name: str
    factory: str
    run: Any  # the async factory function itself
    config: Any  # an instance of the factory's config Struct
    after: tuple[str, ...]
    inbox: int
    restart: RestartPolicy


class Config(Struct, frozen=True, kw_only=True):
    """The whole config; `actors` are in start (dependency) order."""

    daemon: DaemonSection = DaemonSection()
    http: HttpSection = HttpSection()
    supervisor: SupervisorSection = SupervisorSection()
    logging: LoggingSection = LoggingSection()
    actors: tuple[ActorSpec, ...] = ()
    #: where the config came from (for messages); "<text>" when loaded from a string
    source: str = "<text>"

    def actor(self, name: str) -> ActorSpec:
        for spec in self.actors:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def with_state_dir(self, state_dir: str) -> "Config":
        return msgspec.structs.replace(
            self, daemon=msgspec.structs.replace(self.daemon, state_dir=state_dir))


_SECTIONS: dict[str, type[Struct]] = {
    "daemon": DaemonSection,
    "http": HttpSection,
    "supervisor": SupervisorSection,
    "logging": LoggingSection,
}
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def default_config_path() -> Path:
    """The config shipped with the package (``daemon/default.toml``)."""
    return Path(str(resources.files("fleetrl.daemon") / "default.toml"))


def load_config(path: str | Path) -> Config:
    """Read and validate a config file; raises `ConfigError` naming file, line and key."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("config file not found", file=str(p)) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a config file", file=str(p)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file: {exc}", file=str(p)) from None
    return load_config_text(text, source=str(p))


def load_config_text(text: str, *, source: str = "<text>") -> Config:
    """Validate TOML text; `source` names it in error messages."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = _toml_error_line(str(exc))
        raise ConfigError(f"not valid TOML: {exc}", file=source, line=line) from None
    return _Validator(text, source).config(raw)


def load_factory(path: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` (attribute path may be dotted)."""
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def key_line(text: str, path: Sequence[str]) -> int | None:
    """1-based line of the TOML key (or table header) that best matches `path`.

    Scans table headers and ``key = value`` lines, tracking the current table, and
    returns the line whose full dotted path is the longest prefix of `path` (so a key
    inside an inline table maps to the line that holds the table). A good-enough
    reader for error messages, not a TOML parser: multi-line strings and arrays are
    skipped only approximately.
    """
    target = list(path)
    best: tuple[int, int] | None = None  # (matched length, line)
    table: list[str] = []
    in_multiline: str | None = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if in_multiline is not None:
            if in_multiline in stripped:
                in_multiline = None
            continue
        if not stripped or stripped.startswith("#"):
            continue
        full: list[str] | None = None
        if stripped.startswith("["):
            header = stripped.lstrip("[").split("]", 1)[0]
            table = _split_dotted(header)
            full = table
        else:
            key, sep, rest = _split_assignment(stripped)
            if sep:
                full = table + _split_dotted(key)
                for quote in ('"""', "'''"):
                    if rest.strip().startswith(quote) and rest.count(quote) == 1:
                        in_multiline = quote
        if full and full == target[: len(full)]:
            if best is None or len(full) > best[0]:
                best = (len(full), lineno)
    return best[1] if best else None


def _split_assignment(line: str) -> tuple[str, str, str]:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "=":
            return line[:i], "=", line[i + 1:]
    return line, "", ""


def _split_dotted(key: str) -> list[str]:
    parts, cur, quote = [], "", None
    for ch in key:
        if quote:
            if ch == quote:
                quote = None
            else:
                cur += ch
        elif ch in "\"'":
            quote = ch
        elif ch == ".":
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return [p for p in parts if p != ""]


def _toml_error_line(message: str) -> int | None:
    m = re.search(r"line (\d+)", message)
    return int(m.group(1)) if m else None


_MSGSPEC_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")


class _Validator:
    """Turns raw TOML data into a `Config`, translating every failure into one
    `ConfigError` with key path and line."""

    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source

    def fail(self, path: Sequence[str], message: str) -> ConfigError:
        return ConfigError(message, file=self.source, key=".".join(path) or None,
                           line=key_line(self.text, path))

    def convert(self, raw: Any, typ: Any, prefix: Sequence[str]) -> Any:
        try:
            return msgspec.convert(raw, typ)
        except msgspec.ValidationError as exc:
            raise self._translate(str(exc), prefix) from None

    def _translate(self, msg: str, prefix: Sequence[str]) -> ConfigError:
        path = list(prefix)
        m = _MSGSPEC_PATH.search(msg)
        if m:
            msg = msg[: m.start()]
            for part in re.findall(r"\.([^.\[]+)|\[(\d+)\]", m.group("path")):
                path.append(part[0] or f"[{part[1]}]")
        unknown = _UNKNOWN.match(msg)
        if unknown:
            return self.fail(path + [unknown.group("field")], "unknown key")
        missing = _MISSING.match(msg)
        if missing:
            err = self.fail(path, f"missing required key {missing.group('field')!r}")
            return err
        # list indexes are not TOML keys: locate the line by the list's key
        line_path = [p for p in path if not p.startswith("[")]
        err = ConfigError(msg[0].lower() + msg[1:], file=self.source,
                          key=".".join(path) or None, line=key_line(self.text, line_path))
        return err

    def config(self, raw: dict[str, Any]) -> Config:
        for key in raw:
            if key not in _SECTIONS and key != "actors":
                raise self.fail([key], f"unknown key (expected one of: "
                                       f"{', '.join([*_SECTIONS, 'actors'])})")
        sections: dict[str, Any] = {}
        for name, typ in _SECTIONS.items():
            value = raw.get(name, {})
            if not isinstance(value, dict):
                raise self.fail([name], f"expected a table, got {type(value).__name__}")
            sections[name] = self.convert(value, typ, [name])
        actors_raw = raw.get("actors", {})
        if not isinstance(actors_raw, dict):
            raise self.fail(["actors"], "expected a table of actors")
        specs = [self.actor(name, table, sections["supervisor"])
                 for name, table in actors_raw.items()]
        return Config(**sections, actors=tuple(self.order(specs)), source=self.source)

    def actor(self, name: str, table: Any, sup: SupervisorSection) -> ActorSpec:
        prefix = ["actors", name]
        if not _NAME_RE.match(name):
            raise self.fail(prefix, "actor names are letters, digits, '_' and '-'")
        if not isinstance(table, dict):
            raise self.fail(prefix, "expected a table")
        t: _ActorTable = self.convert(table, _ActorTable, prefix)
        restart_raw = {**msgspec.structs.asdict(sup.restart), **t.restart}
        restart = self.convert(restart_raw, RestartPolicy, prefix + ["restart"])
        run = self.resolve(t.factory, prefix + ["factory"])
        cfg_type = self.config_type(run, t.factory, prefix + ["factory"])
        cfg_prefix = prefix + ["config"]
        for key in t.config:
            if key not in cfg_type.__struct_fields__:
                raise self.fail(cfg_prefix + [key], f"unknown key for {cfg_type.__qualname__} "
                                f"(known: {', '.join(cfg_type.__struct_fields__) or 'none'})")
        cfg = self.convert(t.config, cfg_type, cfg_prefix)
        return ActorSpec(name=name, factory=t.factory, run=run, config=cfg,
                         after=tuple(t.after), inbox=t.inbox or sup.inbox, restart=restart)

    def resolve(self, factory: str, path: list[str]) -> Callable[..., Any]:
        try:
            fn = load_factory(factory)
        except ImportError as exc:
            raise self.fail(path, f"cannot import {factory!r}: {exc}") from None
        except AttributeError as exc:
            raise self.fail(path, f"{factory!r} not found: {exc}") from None
        except Exception as exc:  # the module itself failed while importing
            raise self.fail(path, f"importing {factory!r} failed: "
                                  f"{type(exc).__name__}: {exc}") from None
        if not inspect.iscoroutinefunction(fn):
            raise self.fail(path, f"{factory!r} is not an async function")
        return fn

    def config_type(self, fn: Callable[..., Any], factory: str, path: list[str]) -> type[Struct]:
        params = list(inspect.signature(fn).parameters.values())
        if len(params) < 2 or "task_status" not in inspect.signature(fn).parameters:
            raise self.fail(path, f"{factory!r} must have the actor signature "
                                  "run(cfg, ctx, *, task_status)")
        try:
            hints = typing.get_type_hints(fn)
        except Exception as exc:
            raise self.fail(path, f"cannot read annotations of {factory!r}: {exc}") from None
        typ = hints.get(params[0].name)
        if not (isinstance(typ, type) and issubclass(typ, Struct)):
            raise self.fail(path, f"the first parameter of {factory!r} must be annotated "
                                  "with a msgspec Struct (its config type)")
        if not typ.__struct_config__.frozen:
            raise self.fail(path, f"config type {typ.__qualname__} of {factory!r} "
                                  "must be a frozen Struct")
        return typ

    def order(self, specs: list[ActorSpec]) -> list[ActorSpec]:
        """Stable topological order by `after`; unknown names and cycles are errors."""
        by_name = {s.name: s for s in specs}
        for s in specs:
            for dep in s.after:
                if dep not in by_name:
                    raise self.fail(["actors", s.name, "after"], f"no actor named {dep!r}")
                if dep == s.name:
                    raise self.fail(["actors", s.name, "after"], "an actor cannot wait for itself")
        done: list[ActorSpec] = []
        placed: set[str] = set()
        pending = list(specs)
        while pending:
            ready = [s for s in pending if all(d in placed for d in s.after)]
            if not ready:
                names = " -> ".join(s.name for s in pending)
                raise self.fail(["actors", pending[0].name, "after"],
                                f"dependency cycle among actors: {names}")
            for s in ready:
                done.append(s)
                placed.add(s.name)
            pending = [s for s in pending if s.name not in placed]
        return done

