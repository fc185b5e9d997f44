"""``fleetrl report STATE_DIR [--out DIR]``: write a run's report and print its HTML path.

``register(subparsers)`` adds the command (entry-point group ``fleetrl.commands``);
``python -m fleetrl.actors.report.cli ...`` runs it standalone. Exit codes: 0 written,
1 unreadable input (the message names file:line), 2 bad command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from fleetrl.daemon.cli import group_main

__all__ = ["cmd_report", "main", "register"]


def cmd_report(args: argparse.Namespace) -> int:
    from .records import ReportInputError
    from .report import write_report

    state = Path(args.state_dir)
    out = Path(args.out) if args.out else state / "report"
    try:
        page = write_report(state, out)
    except ReportInputError as exc:
        print(f"fleetrl report: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"fleetrl report: cannot write the report into {out}: {exc}", file=sys.stderr)
        return 1
    print(page)
    return 0


def register(subparsers) -> None:
    """Add the ``report`` command (contract: docs/reference/contracts.md, CLI command groups)."""
    p = subparsers.add_parser("report", help="write a run's plots and HTML report",
                              description="Write PNG plots and an HTML page for the run in "
                                          "STATE_DIR; prints the page's path.")
    p.add_argument("state_dir", metavar="STATE_DIR", help="the run's state directory")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default: STATE_DIR/report)")
    p.set_defaults(func=cmd_report)


def main(argv: Sequence[str] | None = None) -> int:
    return group_main((register,), argv)


if __name__ == "__main__":
    sys.exit(main())
