"""`fleetrl simulate`: how fast a new weight version reaches a fleet, by strategy.

    fleetrl simulate --params 1e12 --samplers 1000 --clouds 15 --density 0.014 0.002

For each density it measures the delta's bytes per parameter with fleetrl's codec, then
simulates direct pulls from the trainer, a cache per cloud and a relay tree per cloud on
the preset fleet (`preset_fleet`), and prints per strategy the seconds until p50 / p99 /
all samplers serve v+1, the trainer's egress, the clouds' egress bill per step, and the
staleness the pacer would see at a given step time; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

__all__ = ["main", "register", "run_command"]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, default=1e12, help="model parameters (default 1e12)")
    p.add_argument("--samplers", type=int, default=1000, help="samplers in the fleet (default 1000; up to 10000)")
    p.add_argument("--clouds", type=int, default=15, help="clouds of the preset they spread over (1-15, default 15)")
    p.add_argument("--density", type=float, nargs="+", default=[0.014, 0.002],
                   help="fractions of the weights a step changes (default 0.014 0.002)")
    p.add_argument("--strategies", nargs="+", choices=("direct", "cache", "relay"),
                   default=["direct", "cache", "relay"])
    p.add_argument("--origin-gbps", type=float, default=100.0, help="the trainer's uplink, Gbit/s (default 100)")
    p.add_argument("--relay-fanout", type=int, default=4, help="children per relay (default 4)")
    p.add_argument("--step-s", type=float, default=60.0, help="seconds per trainer step, for staleness (default 60)")
    p.add_argument("--seed", type=int, default=0)


def register(subparsers: Any) -> None:
    """Add the ``simulate`` command (the ``fleetrl.commands`` entry point)."""
    p = subparsers.add_parser("simulate", help="simulate how a weight version reaches a fleet over many clouds",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from .engine import simulate
    from .fleet import preset_fleet
    from .sizes import bytes_per_param

    if not 1 <= args.samplers <= 10_000:
        print("fleetrl simulate: --samplers must be in [1, 10000]", file=sys.stderr)
        return 2
    if args.params <= 0 or args.step_s <= 0 or not all(0 < d <= 1 for d in args.density):
        print("fleetrl simulate: --params and --step-s must be > 0, every --density in (0, 1]", file=sys.stderr)
        return 2
    try:
        fleet = preset_fleet(args.samplers, args.clouds, origin_gbps=args.origin_gbps,
                             relay_fanout=args.relay_fanout)
    except ValueError as exc:
        print(f"fleetrl simulate: {exc}", file=sys.stderr)
        return 2
    rows = []
    print(f"{args.params:.3g} parameters, {args.samplers} samplers in {args.clouds} clouds, trainer uplink "
          f"{args.origin_gbps:g} Gbit/s, a step every {args.step_s:g} s")
    for density in args.density:
        bpp = bytes_per_param(density)
        size = bpp * args.params
        print(f"\ndensity {100 * density:g}%: delta {size / 1e9:.2f} GB ({bpp:.4f} bytes/parameter, fleetrl codec)")
        print(f"{'strategy':<8} {'p50 s':>8} {'p99 s':>8} {'all s':>8} {'trainer GB':>11} {'egress $':>9} "
              f"{'stale p99':>9} {'stale max':>9} {'breaks':>6}")
        for strategy in args.strategies:
            r = simulate(fleet, strategy, size, seed=args.seed)
            stale99, stale_max = math.ceil(r.p99_s / args.step_s), math.ceil(r.all_s / args.step_s)
            print(f"{strategy:<8} {r.p50_s:>8.1f} {r.p99_s:>8.1f} {r.all_s:>8.1f} {r.origin_egress_gb:>11.1f} "
                  f"{r.egress_usd:>9.2f} {stale99:>9d} {stale_max:>9d} {r.breaks:>6d}")
            rows.append({"density": density, "delta_gb": round(size / 1e9, 3), "strategy": strategy,
                         "p50_s": round(r.p50_s, 2), "p99_s": round(r.p99_s, 2), "all_s": round(r.all_s, 2),
                         "trainer_egress_gb": round(r.origin_egress_gb, 2), "egress_usd": round(r.egress_usd, 2),
                         "staleness_p99": stale99, "staleness_max": stale_max, "breaks": r.breaks})
    by = {(r["density"], r["strategy"]): r for r in rows}
    ratios = {f"{d}": {s: round(by[(d, "direct")]["all_s"] / by[(d, s)]["all_s"], 2) for s in args.strategies}
              for d in args.density if (d, "direct") in by}
    print(json.dumps({"bench": "simulate", "params": args.params, "samplers": args.samplers, "clouds": args.clouds,
                      "step_s": args.step_s, "rows": rows, "speedup_vs_direct_all": ratios}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fleetrl simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return run_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
