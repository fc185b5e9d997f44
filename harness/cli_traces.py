"""``fleetrl traces import`` for recorded sessions on a template task: any trajectory
format (``--format``), the workspace and grader of ``--template FILE[:ID]`` or
``--template-harbor DIR`` (docs/traces.md). `cli.cmd_traces_import` hands over here
whenever a template or a format other than our own is given.

Exit codes as the rest of the CLI: 0 every record made a task (or was a duplicate or
left out by ``--only-failed``), 1 some records were unusable or skipped (listed; the
tasks are still written), 2 usage errors and unreadable or unwritable files.
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

__all__ = ["add_session_options", "cmd_traces_import_sessions"]


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def add_session_options(p: argparse.ArgumentParser) -> None:
    """The options of ``traces import`` beyond our own trace format."""
    from .trace_import import FORMATS

    p.add_argument(
        "--format",
        choices=FORMATS,
        default="fleetrl",
        help="input format (default fleetrl: our trace lines; auto: sniff it per file). "
             "Formats other than fleetrl need a template",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--template", metavar="FILE[:ID]",
                       help="task JSONL file (and task id) whose image, workspace, evaluator and limits the tasks get")
    group.add_argument("--template-harbor", metavar="DIR",
                       help="Harbor task directory used as the template (its image is built locally, as by "
                            "`tasks import-harbor`)")
    p.add_argument("--no-build", action="store_true",
                   help="with --template-harbor: do not build the template's image (the tasks name the tag a "
                        "build would give; `tasks import-harbor DIR` builds it later)")
    p.add_argument("--map-image", action="append", metavar="FROM=LOCAL",
                   help="with --template-harbor: build the template's image on LOCAL where its Dockerfile says "
                        "FROM (repeatable), e.g. python:3.11-slim=fleetrl-sandbox:py311")
    p.add_argument(
        "--at",
        choices=("first", "last", "every"),
        default=None,
        help="where to cut each session: first (the original request, = --from-turn 0), last (the model's "
             "last reply, redone), every (one task per turn); needs a template",
    )


def _template(args: argparse.Namespace):
    from .harbor import parse_image_map
    from .trace_import import TemplateError, load_template, load_template_harbor

    try:
        if args.template_harbor:
            return load_template_harbor(args.template_harbor, parse_image_map(args.map_image or []),
                                         build=not args.no_build), None
        return load_template(args.template), None
    except (TemplateError, ValueError) as err:
        return None, str(err)


def cmd_traces_import_sessions(args: argparse.Namespace) -> int:
    from .tasks import dump_tasks_jsonl
    from .trace_import import read_sessions, tasks_from_sessions

    if not (args.template or args.template_harbor):
        return _fail(f"--format {args.format} needs --template FILE[:ID] or --template-harbor DIR: "
                     "a recorded session says nothing of the sandbox or the grader")
    if args.from_turn is not None and args.at is not None:
        return _fail("give either --from-turn or --at, not both")
    for path in args.files:
        try:
            if os.path.exists(args.out) and os.path.samefile(path, args.out):
                return _fail("--out must not be an input file")
        except OSError:
            pass  # a missing input is reported below
    template, why = _template(args)
    if template is None:
        return _fail(why or "no template")

    reads = []
    for path in args.files:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as err:
            return _fail(f"cannot read {path}: {err.strerror or err}")
        reads.append(read_sessions(data, args.format, path))
    sessions = [s for r in reads for s in r.sessions]
    problems = [p for r in reads for p in r.problems]
    try:
        result = tasks_from_sessions(sessions, template=template, from_turn=args.from_turn, at=args.at or "first",
                                     only_failed=args.only_failed, fail_below=args.fail_below)
    except ValueError as err:
        return _fail(str(err))
    try:
        dump_tasks_jsonl(result.tasks, args.out)
    except OSError as err:
        return _fail(f"cannot write {args.out}: {err.strerror or err}")
    report = result.report
    if args.json:
        doc = {
            "out": args.out,
            "inputs": [{"file": path, "format": r.format, "sessions": len(r.sessions), "merged": r.merged}
                       for path, r in zip(args.files, reads, strict=True)],
            "problems": problems,
            **msgspec.to_builtins(report),
        }
        print(msgspec.json.encode(doc).decode())
    else:
        for path, r in zip(args.files, reads, strict=True):
            folded = f", {r.merged} request lines folded into longer sessions" if r.merged else ""
            print(f"{path}: {r.format or 'unknown format'}: {len(r.sessions)} sessions, "
                  f"{len(r.problems)} unusable records{folded}")
        for p in problems:
            print(f"  unusable {p.render()}")
        print(report.render())
        print(f"wrote {report.tasks} tasks to {args.out}")
    return 0 if not problems and not report.skipped else 1
