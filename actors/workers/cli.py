"""`fleetrl worker --join URL --token T`: run remote environment workers on this host.

Registered in the ``fleetrl.commands`` entry-point group (``register``); also runnable
as ``python -m fleetrl.actors.workers.cli``. Sandboxes run on this host's Docker engine.
Exit codes: 0 after Ctrl-C or SIGTERM (the daemon hands the unfinished tasks to other
workers); 2 for a bad command line, a state directory in use or no Docker engine; 3 when
the daemon refuses the join (a wrong or revoked token) or the worker refuses the harness
it ships (unsigned, or pickled over a plain connection).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import trio

__all__ = ["build_parser", "main", "register", "run_command"]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--join", required=True, metavar="URL",
                   help="the daemon's worker join endpoint, e.g. wss://HOST:PORT/workers/join")
    p.add_argument("--token", default=os.environ.get("FLEETRL_WORKER_TOKEN"),
                   help="a worker token (`fleetrl token create --role worker`; default: $FLEETRL_WORKER_TOKEN)")
    p.add_argument("--state-dir", default=os.environ.get("FLEETRL_WORKER_STATE", ".fleetrl-worker"), metavar="DIR",
                   help="this worker's own directory: its lock, the tokenizer, its sandboxes' labels "
                        "(default: $FLEETRL_WORKER_STATE, else .fleetrl-worker)")
    p.add_argument("--groups", type=int, default=2, metavar="N", help="groups (tasks) run at once")
    p.add_argument("--ca-file", default=os.environ.get("FLEETRL_CA_FILE"), metavar="PEM",
                   help="CAs that sign the daemon's TLS certificate (default: $FLEETRL_CA_FILE, else the system's)")
    p.add_argument("--name", default="", help="name shown in the daemon's logs (default: the host name)")


def register(subparsers: Any) -> None:
    """Add the ``worker`` command (the ``fleetrl.commands`` entry point)."""
    p = subparsers.add_parser("worker", help="run environment workers on this host for a daemon elsewhere",
                              description=__doc__)
    _add_arguments(p)
    p.set_defaults(func=run_command)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetrl worker", description=__doc__)
    _add_arguments(p)
    return p


def run_command(args: argparse.Namespace) -> int:
    """Run the worker until interrupted; returns the exit code."""
    import structlog

    from fleetrl.actors.pool.errors import JoinRefused
    from fleetrl.daemon.faults import StateDirLocked

    from .client import WorkerClientConfig, WorkerSetupError

    if not args.token:
        print("fleetrl worker: --token is required (or set FLEETRL_WORKER_TOKEN)", file=sys.stderr)
        return 2
    try:
        cfg = WorkerClientConfig(join_url=args.join, token=args.token, state_dir=args.state_dir,
                                 groups=args.groups, name=args.name, ca_file=args.ca_file)
    except ValueError as exc:
        print(f"fleetrl worker: {exc}", file=sys.stderr)
        return 2
    log = structlog.get_logger("fleetrl.worker")
    try:
        trio.run(_serve_until_terminated, cfg, log)
    except JoinRefused as exc:
        print(f"fleetrl worker: refused: {exc}", file=sys.stderr)
        return 3
    except (StateDirLocked, WorkerSetupError) as exc:
        print(f"fleetrl worker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


async def _serve_until_terminated(cfg: Any, log: Any) -> None:
    from fleetrl.actors.pool.cli import serve_until_sigterm

    from .client import run_worker

    await serve_until_sigterm(lambda: run_worker(cfg, log=log), log)


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
