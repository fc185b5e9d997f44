"""`fleetrl sampler --join URL --token TOKEN ...`: run a remote sampler in this process.

Registered in the ``fleetrl.commands`` entry-point group (``register``); also runnable as
``python -m fleetrl.actors.pool.cli --join ...``. Exit codes: 0 after Ctrl-C, 2 for a bad
command line or model, 3 when the daemon refuses the join (e.g. a wrong token).
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
                   help="join endpoint of the daemon, e.g. ws://HOST:PORT/fleet/join")
    p.add_argument("--token", default=os.environ.get("FLEETRL_FLEET_TOKEN"),
                   help="fleet token (default: $FLEETRL_FLEET_TOKEN; the daemon keeps it in "
                        "<state>/actors/<pool>/fleet_token)")
    p.add_argument("--backend", choices=("torch", "vllm"), default="torch")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "fp8"), default="bf16")
    p.add_argument("--model", required=True, metavar="DIR", help="model directory (config.json + safetensors)")
    p.add_argument("--device", default="cpu", help="torch device for the torch backend (cpu, cuda, cuda:1)")
    p.add_argument("--price-per-hour", type=float, default=0.0, metavar="X",
                   help="what this device costs per hour (for cost-aware routing)")
    p.add_argument("--capacity", type=int, default=1, help="requests served at once")
    p.add_argument("--max-batch", type=int, default=64, metavar="N",
                   help="most requests decoded in one backend call (concurrent requests are batched)")
    p.add_argument("--weights", default=None, metavar="URL",
                   help="base URL of the daemon's delta store to follow weight versions from")
    p.add_argument("--weights-token", default=os.environ.get("FLEETRL_TOKEN"),
                   help="bearer token for the delta store (default: $FLEETRL_TOKEN)")
    p.add_argument("--name", default="", help="name shown in the daemon's logs")


def register(subparsers: Any) -> None:
    """Add the ``sampler`` command (the ``fleetrl.commands`` entry point)."""
    p = subparsers.add_parser("sampler", help="run a remote sampler that joins a daemon's pool",
                              description=__doc__)
    _add_arguments(p)
    p.set_defaults(func=run_command)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetrl sampler", description=__doc__)
    _add_arguments(p)
    return p


def run_command(args: argparse.Namespace) -> int:
    """Run the sampler until interrupted; returns the exit code."""
    import structlog

    from .remote_client import JoinRefused, RemoteClientConfig, build_backend, run_remote

    if not args.token:
        print("fleetrl sampler: --token is required (or set FLEETRL_FLEET_TOKEN)", file=sys.stderr)
        return 2
    try:
        cfg = RemoteClientConfig(join_url=args.join, token=args.token, backend=args.backend, dtype=args.dtype,
                                 model_dir=args.model, device=args.device, price_per_hour=args.price_per_hour,
                                 capacity=args.capacity, max_batch=args.max_batch, weights_url=args.weights,
                                 weights_token=args.weights_token, name=args.name)
        backend = build_backend(cfg)
    except (ValueError, OSError) as exc:
        print(f"fleetrl sampler: {exc}", file=sys.stderr)
        return 2
    log = structlog.get_logger("fleetrl.sampler")
    try:
        trio.run(lambda: run_remote(cfg, backend, log=log))
    except JoinRefused as exc:
        print(f"fleetrl sampler: join refused: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
