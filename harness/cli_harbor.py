"""``fleetrl tasks import-harbor`` and ``fleetrl tasks export-harbor``: Harbor task
directories to a task JSONL file (building each task's image locally) and back
(docs/guides/harbor.md).

Exit codes as the other ``tasks`` commands: 0 every input was usable; 1 some
directories or records were skipped (each is listed; the others were still written);
2 usage errors, unreadable or unwritable files, no Docker engine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["cmd_export_harbor", "cmd_import_harbor", "register_harbor"]


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cmd_import_harbor(args: argparse.Namespace) -> int:
    from fleetrl.sandboxes.harbor_image import HarborImageError

    from .errors import TaskError
    from .harbor import find_harbor_dirs, parse_image_map
    from .harbor_load import load_built_harbor_task
    from .tasks import dump_tasks_jsonl, encode_task_json

    try:
        image_map = parse_image_map(args.map_image or [])
        dirs = find_harbor_dirs(args.dirs)
    except (ValueError, TaskError) as err:
        return _fail(str(err))
    client = None
    if not args.no_build:
        import docker

        try:
            client = docker.from_env()
            client.ping()
        except docker.errors.DockerException as err:
            return _fail(f"building the tasks' images needs a Docker engine ({err}); --no-build skips it")
    out = sys.stderr if args.out is None else sys.stdout
    tasks, skipped, seen = [], 0, {}
    for path in dirs:
        try:
            task, image = load_built_harbor_task(path, image_map, client=client, build=client is not None)
            if task.id in seen:
                raise TaskError(f"duplicate task id {task.id!r} (first: {seen[task.id]})", where=path)
            if image is not None:
                print(f"  {task.id}: image {image.tag} ({'built' if image.built else 'already built'})", file=out)
        except TaskError as err:
            skipped += 1
            print(f"  skipped {err}", file=out)
            continue
        except HarborImageError as err:
            skipped += 1
            print(f"  skipped {path}: {err}", file=out)
            continue
        seen[task.id] = path
        tasks.append(task)
    if args.out is None:
        for task in tasks:
            sys.stdout.write(encode_task_json(task).decode() + "\n")
    else:
        try:
            dump_tasks_jsonl(tasks, args.out)
        except OSError as err:
            return _fail(f"cannot write {args.out}: {err.strerror or err}")
    where = "stdout" if args.out is None else args.out
    print(f"wrote {len(tasks)} Harbor tasks to {where} ({skipped} skipped)", file=out)
    return 1 if skipped else 0


def cmd_export_harbor(args: argparse.Namespace) -> int:
    from .harbor_export import export_dir_name, write_harbor_dir
    from .tasks import load_tasks_jsonl

    try:
        report = load_tasks_jsonl(args.tasks)
    except OSError as err:
        return _fail(f"cannot read {args.tasks}: {err.strerror or err}")
    for err in report.errors:
        print(f"  skipped {err}")
    root = Path(args.out)
    written, skipped, names = 0, report.n_invalid, set()
    for task in report.tasks:
        name = export_dir_name(task.id)
        n = 2
        base = name
        while name.lower() in names:  # ids that differ only where the name cannot say it
            name, n = f"{base}-{n}", n + 1
        names.add(name.lower())
        try:
            write_harbor_dir(task, root / name)
        except FileExistsError:
            skipped += 1
            print(f"  skipped {task.id}: {root / name} already exists")
            continue
        except ValueError as err:
            skipped += 1
            print(f"  skipped {task.id}: {err}")
            continue
        except OSError as err:
            return _fail(f"cannot write {root / name}: {err.strerror or err}")
        written += 1
    print(f"wrote {written} Harbor task directories to {root} ({skipped} skipped)")
    return 1 if skipped else 0


def register_harbor(sub) -> None:
    """Add ``import-harbor`` and ``export-harbor`` to the ``tasks`` group's sub-parsers."""
    p = sub.add_parser(
        "import-harbor",
        help="Harbor task directories -> a task JSONL file (builds each task's image locally)",
        description="Each DIR is a Harbor task directory (with task.toml) or a directory of them. "
                    "Exit 0 if every directory was imported, 1 if some were skipped, 2 on usage errors.",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", help="a Harbor task directory, or a directory of them")
    p.add_argument("--out", default=None, help="task JSONL file to write (default: the tasks on stdout)")
    p.add_argument("--map-image", action="append", metavar="FROM=LOCAL",
                   help="build FROM images named FROM on the local image LOCAL instead "
                        "(e.g. python:3.11-slim=fleetrl-sandbox:py311); repeatable")
    p.add_argument("--no-build", action="store_true", help="write the tasks without building their images")
    p.set_defaults(func=cmd_import_harbor)

    p = sub.add_parser(
        "export-harbor",
        help="a task JSONL file -> Harbor task directories (one per task)",
        description="Writes OUT/<task id>/ for each task. Exit 0 if every task was written, 1 if some "
                    "were skipped, 2 if the file cannot be read or the output written.",
    )
    p.add_argument("--tasks", required=True, metavar="FILE.jsonl", help="task JSONL file (docs/guides/tasks.md)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write the task directories into")
    p.set_defaults(func=cmd_export_harbor)
