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
import time
from collections.abc import Sequence
from pathlib import Path

from fleetrl.daemon.cli import group_main, positive_int

__all__ = ["main", "register_ablate", "register_bench"]


def _err(prog: str, msg: str) -> int:
    print(f"fleetrl {prog}: {msg}", file=sys.stderr)
    return 2


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
    for flag in ("steps", "seeds", "regime", "variants", "eval_tasks", "out", "work"):
        value = getattr(args, flag, None)
        if value is not None:
            parts += ["--" + flag.replace("_", "-"), str(value)]
    return shlex.join(parts)


def cmd_ablate(args: argparse.Namespace) -> int:
    from .ablate import MISMATCH_GOAL, run_ablation
    from .variants import VariantError, parse_seeds, regime_names, variant_names

    try:
        variants = variant_names(args.variants)
        regimes = regime_names(args.regime)
        seeds = parse_seeds(args.seeds)
        summary = run_ablation(Path(args.config), Path(args.out), variants, regimes=regimes, seeds=seeds,
                               steps=args.steps, timeout_s=args.timeout, command=_command_line(args),
                               work_dir=Path(args.work), eval_tasks=args.eval_tasks, resume=args.resume)
    except VariantError as exc:
        return _err("ablate", str(exc))
    md = Path(args.out) / "ablation.md"
    print(md.read_text(encoding="utf-8"), end="")
    print(f"written: {md} (and {', '.join(str(Path(args.out) / r.key) for r in regimes)})")
    multiple = summary["mismatch_multiple"]
    kl = {k: ("n/a" if v is None else f"{v:.2e}") for k, v in summary["fleet_kl"].items()}
    print("fleet mismatch (mean k3 KL of arm (%s)): %s" % (summary["fleet_arm"], ", ".join(f"{k} {v}" for k, v in kl.items())))
    if multiple is not None:
        print(f"mismatch multiple of the hard fleet: {multiple:.2f}x the mild fleet's (goal >= {MISMATCH_GOAL:g}x)")
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


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


RESULTS_DIR = "docs/results"
"""Where results pages live (the ablation's dated directory goes inside)."""


def _today() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


ABLATE_DESCRIPTION = """\
Run the corrections ablation: every arm as a real `fleetrl serve`, one after another,
with the same step budget, for every regime and seed; then compare each arm with (a),
paired per seed, and write tables, JSON and plots.

arms (--variants, by letter or name):
  a sync_fp32   homogeneous fp32, synchronous (the reference; the same run in every regime)
  b async_full  the regime's fleet, asynchronous, the config's corrections (full recipe)
  c async_none  as b without corrections (no weighting, no centering, no sequence mask)
  d async_mask  as b with masking only
  e async_tis   as b with truncated importance sampling only (no mask, no centering)

regimes (--regime, comma-separated):
  mild  the config's own fleet
  hard  the config's fleet plus a vLLM bf16 sampler run as a child process, torch fp8
        samplers on per-tensor scales, max_staleness 8 in the trainer and the pool;
        chosen so its mismatch KL is at least 4x the mild fleet's (the run prints the
        multiple). The vLLM sampler needs a model whose head size vLLM supports.

seeds (--seeds): seed s adds s to the config's training task seed, trainer seed and
warm-model init seed, so each seed has its own warm model (built once, shared by the
seed's arms) and task stream; every arm of a seed gets the same ones. Held-out tasks
are the same in every seed and arm, so pass@1 is compared task by task.

output: --out DIR gets ablation.md / ablation.json (all regimes, the mismatch multiple),
DIR/<regime>/ (tables, JSON, compare_*.png with one band per arm over seeds) and
DIR/<regime>/seed-<s>/<arm>/ (config, metrics.jsonl, eval.jsonl, run.json); --work DIR
gets the runs' state directories, warm models and serve logs. The last line printed is
one JSON object. Exit 0: every run finished; 1: one failed or timed out; 2: bad input.
"""


def register_ablate(subparsers) -> None:
    """Add ``ablate`` (contract: docs/reference/contracts.md, CLI command groups)."""
    p = subparsers.add_parser(
        "ablate", help="run the corrections ablation (arms x regimes x seeds as real runs) and compare them",
        description=ABLATE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="FILE", help="the run's TOML config (e.g. configs/tiny.toml)")
    p.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help="trainer steps per run (default: the config's max_steps)")
    p.add_argument("--seeds", default="1", metavar="SEEDS",
                   help="a count (2: seeds 0 and 1), a list (0,3) or a range (0..3); default 1 (seed 0)")
    p.add_argument("--regime", default="mild", metavar="LIST",
                   help="mild, hard, or both as mild,hard (default mild)")
    p.add_argument("--variants", default="a,b,c,d,e", metavar="LIST",
                   help="comma-separated arms, by letter or name; must include a (default a,b,c,d,e)")
    p.add_argument("--eval-tasks", type=positive_int, default=400, metavar="N",
                   help="held-out tasks per evaluation set in every run (default 400)")
    p.add_argument("--out", default=str(Path(RESULTS_DIR) / f"ablation-{_today()}"), metavar="DIR",
                   help="results: tables, JSON, plots, each run's config and logs (default "
                        f"ablation-<today, UTC> in {RESULTS_DIR})")
    p.add_argument("--work", default=".fleetrl/ablation", metavar="DIR",
                   help="the runs' state directories, warm models and serve logs (default .fleetrl/ablation)")
    p.add_argument("--timeout", type=_positive_float, default=4 * 3600.0, metavar="S",
                   help="seconds one run may take before it is stopped (default 14400)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the runs an earlier invocation with the same --out finished cleanly with the "
                        "same config, instead of running them again")
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
    a.add_argument("--groups", type=positive_int, default=None, metavar="N",
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
