"""`fleetrl sampler --join URL --token TOKEN ...`: run a remote sampler in this process.

Registered in the ``fleetrl.commands`` entry-point group (``register``); also runnable as
``python -m fleetrl.actors.pool.cli --join ...``, which is how the pool starts a sampler
configured with ``process = true`` (`children`). Exit codes: 0 after Ctrl-C or SIGTERM, 2
for a bad command line or model, 3 when the daemon refuses the join (e.g. a wrong
token). With ``--parent-pid PID`` the sampler ends, with its whole process group when it
leads one, as soon as its parent is no longer PID (the daemon that started it is gone).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import trio

__all__ = ["build_parser", "exit_with_parent", "main", "register", "run_command", "serve_until_sigterm"]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--join", required=True, metavar="URL",
                   help="join endpoint of the daemon, e.g. ws://HOST:PORT/fleet/join")
    p.add_argument("--token", default=os.environ.get("FLEETRL_FLEET_TOKEN"),
                   help="a sampler token (`fleetrl token create --role sampler`) or the pool's fleet token "
                        "(default: $FLEETRL_FLEET_TOKEN; the daemon keeps it in <state>/actors/<pool>/fleet_token)")
    p.add_argument("--backend", choices=("torch", "vllm"), default="torch")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "fp8"), default="bf16")
    p.add_argument("--model", required=True, metavar="DIR", help="model directory (config.json + safetensors)")
    p.add_argument("--device", default="cpu", help="torch device for the torch backend (cpu, cuda, cuda:1)")
    p.add_argument("--fp8-scheme", choices=("tensor", "row", "block128"), default="block128",
                   help="scale granularity of an fp8 torch backend")
    p.add_argument("--matmul", choices=("auto", "native", "fp32", "fp16_accumulate"), default="auto",
                   help="how a low-precision torch backend multiplies (TorchBackendConfig.matmul)")
    p.add_argument("--price-per-hour", type=float, default=0.0, metavar="X",
                   help="what this device costs per hour (for cost-aware routing)")
    p.add_argument("--capacity", type=int, default=1, help="requests served at once")
    p.add_argument("--max-support", type=int, default=None, metavar="N",
                   help="the most tokens one token is drawn from (default: fleetrl's cap, 512; it bounds each "
                        "token's record, docs/reference/corrections.md)")
    p.add_argument("--vllm", default=None, metavar="JSON",
                   help='the vLLM backend\'s engine settings as a JSON object, e.g. \'{"max_model_len": 4096, '
                        '"cpu_kv_cache_bytes": 1073741824}\' (VllmEngineConfig, docs/reference/vllm.md)')
    p.add_argument("--max-batch", type=int, default=64, metavar="N",
                   help="most requests decoded in one backend call (concurrent requests are batched)")
    p.add_argument("--weights", default=None, metavar="URL",
                   help="where to follow weight versions from: the daemon's delta store "
                        "(https://HOST:PORT/weights) or an S3-compatible bucket (s3://BUCKET/PREFIX; endpoint and "
                        "credentials from boto3's configuration, e.g. AWS_ENDPOINT_URL)")
    p.add_argument("--weights-mirror", default=None, metavar="URL",
                   help="a cache or mirror of --weights to read through first (an HTTP cache such as nginx, or "
                        "s3://...); what it lacks or serves stale comes from --weights")
    p.add_argument("--weights-token", default=os.environ.get("FLEETRL_TOKEN"),
                   help="bearer token for the delta store (default: $FLEETRL_TOKEN, else --token when it is "
                        "an issued sampler token: `fleetrl token create --role sampler`)")
    p.add_argument("--ca-file", default=os.environ.get("FLEETRL_CA_FILE"), metavar="PEM",
                   help="CAs that sign the daemon's TLS certificate for wss:// and https:// "
                        "(default: $FLEETRL_CA_FILE, else the system's)")
    p.add_argument("--name", default="", help="name shown in the daemon's logs")
    p.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                   help="end (with this process's group, when it leads one) once the parent process is not PID "
                        "(the daemon's child samplers: none outlives the daemon)")


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
    if args.parent_pid is not None:  # first: the imports below take seconds
        exit_with_parent(args.parent_pid)
    import structlog

    from .remote_client import JoinRefused, RemoteClientConfig, build_backend, vllm_engine

    if not args.token:
        print("fleetrl sampler: --token is required (or set FLEETRL_FLEET_TOKEN)", file=sys.stderr)
        return 2
    try:
        cfg = RemoteClientConfig(join_url=args.join, token=args.token, backend=args.backend, dtype=args.dtype,
                                 model_dir=args.model, device=args.device, fp8_scheme=args.fp8_scheme,
                                 matmul=args.matmul, price_per_hour=args.price_per_hour,
                                 capacity=args.capacity, max_batch=args.max_batch, weights_url=args.weights,
                                 weights_token=args.weights_token, name=args.name, ca_file=args.ca_file,
                                 weights_mirror=args.weights_mirror,
                                 **({} if args.max_support is None else {"max_support": args.max_support}),
                                 **({} if args.vllm is None else {"vllm": vllm_engine(args.vllm)}))
        backend = build_backend(cfg)
    except (ValueError, OSError) as exc:
        print(f"fleetrl sampler: {exc}", file=sys.stderr)
        return 2
    log = structlog.get_logger("fleetrl.sampler")
    try:
        trio.run(_serve_until_terminated, cfg, backend, log)
    except JoinRefused as exc:
        print(f"fleetrl sampler: join refused: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 0
    finally:
        close = getattr(backend, "close", None)  # a vLLM engine: its memory and helper threads
        if close is not None:
            close()
    return 0


async def _serve_until_terminated(cfg: Any, backend: Any, log: Any) -> None:
    from .remote_client import run_remote

    await serve_until_sigterm(lambda: run_remote(cfg, backend, log=log), log)


async def serve_until_sigterm(serve: Any, log: Any) -> None:
    """Run ``await serve()`` until SIGTERM (then return: exit 0) or a refused join (the
    `JoinRefused` is raised, out of any task group)."""
    from .remote_client import JoinRefused

    refused: JoinRefused | None = None
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            async def run() -> None:
                nonlocal refused
                try:
                    await serve()
                except JoinRefused as exc:
                    refused = exc
                nursery.cancel_scope.cancel()

            async def terminate() -> None:
                async for _ in signals:
                    log.info("SIGTERM: leaving")
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(terminate)
            nursery.start_soon(run)
    if refused is not None:
        raise refused


def exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """End this process once its parent is no longer `parent_pid`: SIGKILL to its whole
    process group when it leads one (a sampler started in a session of its own, with any
    helper process its engine started), else ``os._exit(3)``
    (`fleetrl.harness.processes.exit_with_parent` watches)."""
    from fleetrl.harness.processes import exit_with_parent as watch_parent

    def end() -> None:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(3)

    watch_parent(parent_pid, interval_s=interval_s, end=end)


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
