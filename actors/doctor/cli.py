"""``fleetrl doctor --config FILE [--state-dir DIR] [--steps N] [--json]``: the hazards of
a daemon config and, with ``--state-dir``, of its run's recent figures.

``register(subparsers)`` adds the command (entry-point group ``fleetrl.commands``);
``python -m fleetrl.actors.doctor.cli ...`` runs it standalone. Exit codes: 0 no hazard,
1 hazards found (each printed with its id, where, what and the fix), 2 the config or the
state directory cannot be read or is invalid (the config's error as ``fleetrl serve``
prints it), or a bad command line. docs/guides/doctor.md lists every hazard.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleetrl.daemon.cli import group_main, positive_int

__all__ = ["EXIT_CONFIG", "EXIT_HAZARDS", "EXIT_OK", "cmd_doctor", "main", "register", "render"]

EXIT_OK, EXIT_HAZARDS, EXIT_CONFIG = 0, 1, 2
HELP = "check a config (and a run's recent figures) for training hazards"


def _err(msg: str) -> None:
    print(f"fleetrl: {msg}", file=sys.stderr)


def render(hazards: Sequence[Any], config: str, state_dir: str | None) -> str:
    """The text report: one block per hazard, then a summary line."""
    out = []
    for h in hazards:
        at = f"{h.file}:{h.line}" if h.line is not None else h.file
        out.append(f"[{h.id}] {at}: {h.where}\n    {h.message}\n    fix: {h.fix}")
    read = f" and the run in {state_dir}" if state_dir is not None else ""
    if hazards:
        out.append(f"{len(hazards)} hazard{'s' if len(hazards) != 1 else ''} in {config}{read}")
    else:
        out.append(f"OK: no hazard in {config}{read}")
    return "\n".join(out)


def cmd_doctor(args: argparse.Namespace) -> int:
    import msgspec

    from fleetrl.daemon.config import load_config
    from fleetrl.daemon.faults import ConfigError

    from .config_checks import check_config
    from .errors import DoctorInputError
    from .hazards import locate
    from .run_checks import check_run
    from .state import read_run

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    hazards = locate(check_config(cfg), Path(args.config).read_text(encoding="utf-8"), cfg.source)
    figures = None
    if args.state_dir is not None:
        try:
            figures = read_run(cfg, Path(args.state_dir), steps=args.steps)
        except DoctorInputError as exc:
            _err(str(exc))
            return EXIT_CONFIG
        hazards += check_run(cfg, figures)
    if args.json:
        read = None if figures is None else {
            "state_dir": figures.state_dir,
            "trainers": [{"trainer": t.trainer, "file": t.path, "steps": len(t.lines)} for t in figures.trainers],
            "atif": [{"worker": s.worker, "dir": s.path, "files": s.files, "positions": sum(s.listed.values())
                      + s.vocabulary} for s in figures.supports]}
        body = {"config": args.config, "ok": not hazards, "read": read,
                "hazards": [msgspec.to_builtins(h) for h in hazards]}
        print(json.dumps(body, indent=2))
    else:
        print(render(hazards, args.config, args.state_dir))
    return EXIT_HAZARDS if hazards else EXIT_OK


def register(subparsers) -> None:
    """Add the ``doctor`` command (contract: docs/reference/contracts.md, CLI command groups)."""
    p = subparsers.add_parser(
        "doctor", help=HELP,
        description="Read a daemon config (the TOML `fleetrl serve --config` takes) and, with --state-dir, "
                    "its run's recent figures, and print each hazard: its id, where (the key path and file), "
                    "what is wrong and the fix (docs/guides/doctor.md). Exit 0: none; 1: hazards; 2: the "
                    "config or state directory cannot be read or is invalid.")
    p.add_argument("--config", metavar="FILE", required=True, help="the daemon config to check")
    p.add_argument("--state-dir", metavar="DIR", default=None,
                   help="a run's state directory: also check its trainer's recent metrics.jsonl steps and the "
                        "supports in its workers' ATIF files")
    p.add_argument("--steps", metavar="N", type=positive_int, default=50,
                   help="recent steps of metrics.jsonl to read (default 50)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: config, ok, read, hazards (each id, where, message, fix, file, line)")
    p.set_defaults(func=cmd_doctor)


def main(argv: Sequence[str] | None = None) -> int:
    return group_main((register,), argv)


if __name__ == "__main__":
    sys.exit(main())
