"""``fleetrl ablate ...`` and ``fleetrl bench async ...``.

``register_ablate(subparsers)`` and ``register_bench(subparsers)`` add the commands
(entry-point group ``fleetrl.commands``); ``python -m fleetrl.actors.runs.cli ...``
runs them standalone. Exit codes: 0 every run finished, 1 a run failed (its log is
named), 2 bad command line or config.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from fleetrl.daemon.cli import group_main

__all__ = ["main", "register_ablate", "register_bench"]


def _err(prog: str, msg: str) -> int:
    print(f"fleetrl {prog}: {msg}", file=sys.stderr)
    return 2


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _command_line(args: argparse.Namespace) -> str:
    """The `fleetrl ablate` command line that reproduces this run (for ablation.md)."""
    parts = ["fleetrl", "ablate", "--config", args.config]
    for flag, value in (("--steps", getattr(args, "steps", None)), ("--variants", getattr(args, "variants", None)),
                        ("--out", args.out)):
        if value is not None:
            parts += [flag, str(value)]
    return shlex.join(parts)


def cmd_ablate(args: argparse.Namespace) -> int:
    from .ablate import run_ablation
    from .variants import VariantError, variant_names

    try:
        variants = variant_names(args.variants or "a,b,c,d")
        results, md = run_ablation(Path(args.config), Path(args.out), variants, steps=args.steps,
                                   timeout_s=args.timeout,
                                   command=_command_line(args))
    except VariantError as exc:
        return _err("ablate", str(exc))
    print(md.read_text(encoding="utf-8"), end="")
    print(f"written: {md}")
    return 0 if all(r.exit_code == 0 and not r.error for r in results) else 1


def cmd_bench_async(args: argparse.Namespace) -> int:
    from .bench_async import run_bench_async
    from .variants import VariantError

    try:
        res = run_bench_async(Path(args.config), Path(args.out), groups=args.groups,
                              timeout_s=args.timeout)
    except VariantError as exc:
        return _err("bench async", str(exc))
    s, a = res["sync"]["loop_s"], res["async"]["loop_s"]
    if res["ratio"] is not None:
        print(f"sync  {s:9.1f} s   (generate, then train)")
        print(f"async {a:9.1f} s   (samplers run ahead)")
        print(f"async is {res['ratio']:.2f}x faster to {res['groups']} trained groups "
              f"(goal {res['goal']}x; from daemon start: {res['ratio_total']:.2f}x)")
    else:
        print("a run did not reach the target; no ratio (see the serve.log files)")
    print(json.dumps(res))
    return 0 if res["ratio"] is not None else 1


def register_ablate(subparsers) -> None:
    """Add ``ablate`` (contract: docs/reference/contracts.md, CLI command groups)."""
    p = subparsers.add_parser(
        "ablate", help="run the corrections ablation (four real runs) and compare them",
        description="Run (a) homogeneous fp32 synchronous, (b) mixed async full recipe, "
                    "(c) mixed async without corrections, (d) mixed masking only, each as "
                    "`fleetrl serve`, with the same budget and seeds; print and write the table.")
    p.add_argument("--config", required=True, metavar="FILE", help="the run's TOML config (e.g. configs/tiny.toml)")
    p.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                   help="trainer steps per arm (default: the config's max_steps)")
    p.add_argument("--out", default=".fleetrl/ablation", metavar="DIR",
                   help="where arms, table and plots go (default .fleetrl/ablation)")
    p.add_argument("--variants", default=None, metavar="LIST",
                   help="comma-separated arms to run, by letter or name (default a,b,c,d)")
    p.add_argument("--timeout", type=_positive_float, default=4 * 3600.0, metavar="S",
                   help="seconds one arm may run before it is stopped (default 14400)")
    p.set_defaults(func=cmd_ablate)


def register_bench(subparsers) -> None:
    """Add ``bench async``."""
    p = subparsers.add_parser("bench", help="end-to-end benchmarks")
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])
    sub = p.add_subparsers(dest="bench_command", metavar="{async}")
    a = sub.add_parser(
        "async", help="wall-clock to train the same groups: synchronous vs asynchronous",
        description="Run the config twice as `fleetrl serve` (max_staleness 0, then as is) "
                    "and compare the wall-clock to the same number of trained groups. "
                    "Ends with one JSON line.")
    a.add_argument("--config", required=True, metavar="FILE")
    a.add_argument("--groups", type=_positive_int, default=None, metavar="N",
                   help="trained groups to reach (default: 5 steps' worth)")
    a.add_argument("--out", default=".fleetrl/bench-async", metavar="DIR",
                   help="state directories and logs (default .fleetrl/bench-async)")
    a.add_argument("--timeout", type=_positive_float, default=3600.0, metavar="S",
                   help="seconds one run may take (default 3600)")
    a.set_defaults(func=cmd_bench_async)


def main(argv: Sequence[str] | None = None) -> int:
    return group_main((register_ablate, register_bench), argv)


if __name__ == "__main__":
    sys.exit(main())
