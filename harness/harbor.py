"""Harbor task directories -> fleetrl tasks (docs/guides/harbor.md).

A Harbor task is a directory: ``task.toml`` (`harbor_toml`), ``instruction.md`` (the
prompt), ``environment/Dockerfile`` (`harbor_dockerfile`; its directory is the build
context) or ``[environment].docker_image``, ``tests/test.sh`` (+ other test files; it
writes the reward to /logs/verifier/reward.txt or reward.json) and optionally
``solution/solve.sh``.

`read_harbor_dir` reads and checks a directory (`HarborDir`); `harbor_build_plan` says
which image fleetrl builds for it (the rewritten Dockerfile and its content-hash tag;
``fleetrl.sandboxes.harbor_image`` builds it); `harbor_task` / `load_harbor_task` make
the `Task`. The tests travel in ``evaluator.files``: written into the sandbox only
right before the evaluator runs, so the agent never sees them. A directory written by
``fleetrl tasks export-harbor`` loads back as the task it was made from
(`harbor_export.restore_exported`). Pure apart from reading the directory.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shlex
import stat
from collections.abc import Mapping
from pathlib import Path

import msgspec

from .errors import TaskError
from .harbor_dockerfile import (
    HARBOR_ROOT,
    SEED_DIR,
    BaseImage,
    Dockerfile,
    base_images,
    final_workdir,
    parse_dockerfile,
    rewrite_dockerfile,
)
from .harbor_toml import HarborConfig, flatten_metadata, parse_task_toml
from .task_codec import validate_task
from .task_schema import Evaluator, Limits, Setup, Source, Task

__all__ = [
    "DEFAULT_HARBOR_TIMEOUT_S",
    "DEFAULT_HARBOR_WORKDIR",
    "HARBOR_IMAGE_REPO",
    "BuildPlan",
    "HarborDir",
    "find_harbor_dirs",
    "harbor_build_plan",
    "harbor_evaluator_command",
    "harbor_task",
    "harbor_task_and_plan",
    "load_harbor_task",
    "parse_image_map",
    "read_harbor_dir",
]

DEFAULT_HARBOR_WORKDIR = "/app"
"""The work dir when the Dockerfile sets none (the one Harbor tasks commonly use)."""
DEFAULT_HARBOR_TIMEOUT_S = 600.0
"""The agent's and the verifier's timeout when task.toml gives none."""
HARBOR_IMAGE_REPO = "fleetrl-harbor"
INCOMING = f"{HARBOR_ROOT}/incoming"
"""Where ``evaluator.files`` puts the tests; the evaluator copies them to /tests."""
_BUILD_FORMAT = 1  # bump when the rewriting or the epilogue changes what gets built
_SLUG = re.compile(r"[^a-z0-9._-]+")


class HarborDir(msgspec.Struct, frozen=True, kw_only=True):
    """A read and checked Harbor task directory.

    ``tests`` / ``solution``: path relative to tests/ (solution/) -> content;
    ``executable``: the test files with an execute bit; ``context``: every file of
    environment/ (relative path -> content, a link as its target), what the image
    hash covers; ``dockerfile`` is None when ``[environment].docker_image`` names the
    image instead."""

    path: str
    name: str
    instruction: str
    config: HarborConfig
    dockerfile: Dockerfile | None
    workdir: str
    bases: tuple[BaseImage, ...]
    tests: dict[str, str]
    executable: frozenset[str]
    solution: dict[str, bytes]
    context: dict[str, bytes]

    @property
    def context_dir(self) -> str:
        return os.path.join(self.path, "environment")

    @property
    def dockerfile_path(self) -> str:
        return os.path.join(self.path, "environment", "Dockerfile")


class BuildPlan(msgspec.Struct, frozen=True, kw_only=True):
    """How fleetrl builds a Harbor task's image: ``dockerfile`` (rewritten) with the
    task's environment/ as context, tagged ``tag``; ``bases``: the local images it
    starts from (after mapping); ``timeout_s``: ``[environment].build_timeout_sec``."""

    tag: str
    dockerfile: str
    context_dir: str
    bases: tuple[str, ...]
    origins: tuple[BaseImage, ...]
    timeout_s: float | None


def _read_text(path: Path, *, where: str, field: str = "") -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TaskError(f"missing {path.name}", where=where, field=field) from None
    except OSError as err:
        raise TaskError(f"cannot read {path}: {err.strerror or err}", where=where, field=field) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TaskError(f"{path.name} is not UTF-8 text", where=where, field=field) from None


def _walk(root: Path, *, follow_links: bool) -> dict[str, Path]:
    """Every file under `root` (relative POSIX path -> path), sorted."""
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_links):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            full = Path(dirpath) / name
            out[full.relative_to(root).as_posix()] = full
    return dict(sorted(out.items()))


def _read_tests(task_dir: Path) -> tuple[dict[str, str], frozenset[str]]:
    where = str(task_dir / "tests")
    if not (task_dir / "tests" / "test.sh").is_file():
        raise TaskError("missing tests/test.sh (the verifier Harbor runs)", where=str(task_dir))
    tests: dict[str, str] = {}
    executable: set[str] = set()
    for rel, full in _walk(task_dir / "tests", follow_links=False).items():
        if full.is_symlink():
            raise TaskError(f"tests/{rel} is a symbolic link: test files must be regular files", where=where)
        data = full.read_bytes()
        try:
            tests[rel] = data.decode("utf-8")
        except UnicodeDecodeError:
            raise TaskError(f"tests/{rel} is not UTF-8 text: binary test files are not supported "
                            "(evaluator.files holds text)", where=where) from None
        if full.stat().st_mode & stat.S_IXUSR:
            executable.add(rel)
    return tests, frozenset(executable)


def read_harbor_dir(path: str | os.PathLike[str]) -> HarborDir:
    """Read and check a Harbor task directory; a `TaskError` names the file and the
    field at fault (missing task.toml, instruction.md or tests/test.sh, invalid TOML,
    a bad value, no Dockerfile and no docker_image, a binary test file, ...)."""
    task_dir = Path(path)
    if not task_dir.is_dir():
        raise TaskError("not a directory", where=str(task_dir))
    toml_path = task_dir / "task.toml"
    config = parse_task_toml(_read_text(toml_path, where=str(task_dir)), where=str(toml_path))
    instruction = _read_text(task_dir / "instruction.md", where=str(task_dir))
    env_dir = task_dir / "environment"
    df_path = env_dir / "Dockerfile"
    dockerfile: Dockerfile | None = None
    context: dict[str, bytes] = {}
    if df_path.is_file():
        dockerfile = parse_dockerfile(_read_text(df_path, where=str(df_path)), where=str(df_path))
        bases = tuple(base_images(dockerfile, where=str(df_path)))
        workdir = final_workdir(dockerfile, default=DEFAULT_HARBOR_WORKDIR)
        for rel, full in _walk(env_dir, follow_links=False).items():
            context[rel] = os.readlink(full).encode() if full.is_symlink() else full.read_bytes()
    elif config.docker_image is not None:
        bases = (BaseImage(image=config.docker_image, line=0, text=f"docker_image = {config.docker_image!r}"),)
        workdir = DEFAULT_HARBOR_WORKDIR
    elif (env_dir / "docker-compose.yaml").exists() or (env_dir / "docker-compose.yml").exists():
        raise TaskError("environment/docker-compose.yaml environments are not supported (one Dockerfile only)",
                        where=str(task_dir))
    else:
        raise TaskError("missing environment/Dockerfile (and task.toml sets no [environment].docker_image)",
                        where=str(task_dir))
    if not workdir.startswith("/") or workdir in ("/", "/tmp", "/proc", "/sys", "/dev") or ".." in workdir:
        raise TaskError(f"WORKDIR {workdir!r} cannot be a sandbox work dir (it is mounted as an empty tmpfs)",
                        where=str(df_path))
    tests, executable = _read_tests(task_dir)
    solution = {rel: full.read_bytes() for rel, full in _walk(task_dir / "solution", follow_links=False).items()
                if full.is_file()} if (task_dir / "solution").is_dir() else {}
    name = config.name or task_dir.resolve().name
    return HarborDir(path=str(task_dir), name=name, instruction=instruction, config=config, dockerfile=dockerfile,
                     workdir=workdir, bases=bases, tests=tests, executable=executable, solution=solution,
                     context=context)


def find_harbor_dirs(paths: list[str] | tuple[str, ...]) -> list[str]:
    """The task directories `paths` name: a path holding task.toml is one, any other
    directory stands for its sub-directories that hold one (sorted). A path that is
    neither is a `TaskError`."""
    out: list[str] = []
    for path in paths:
        p = Path(path)
        if (p / "task.toml").is_file():
            out.append(str(p))
            continue
        if not p.is_dir():
            raise TaskError("no such directory", where=str(p))
        found = sorted(str(c) for c in p.iterdir() if c.is_dir() and (c / "task.toml").is_file())
        if not found:
            raise TaskError("neither a Harbor task directory (no task.toml) nor a directory of them", where=str(p))
        out += found
    return out


def parse_image_map(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["python:3.11-slim=fleetrl-sandbox:py311", ...]`` -> a mapping (FROM image ->
    local image); a pair without ``=`` is a ValueError naming it."""
    out: dict[str, str] = {}
    for pair in pairs:
        src, eq, dst = pair.partition("=")
        if not eq or not src.strip() or not dst.strip():
            raise ValueError(f"image mapping {pair!r}: expected FROM_IMAGE=LOCAL_IMAGE")
        out[src.strip()] = dst.strip()
    return out


def _slug(name: str) -> str:
    slug = _SLUG.sub("-", name.lower()).strip("-._")
    return (slug or "task")[:100]


def harbor_build_plan(hdir: HarborDir, image_map: Mapping[str, str] | None = None) -> BuildPlan:
    """The image fleetrl builds for `hdir` (pure): FROMs mapped by `image_map`, the
    epilogue appended, tagged ``fleetrl-harbor/<name>:<hash>`` where the hash covers the
    rewritten Dockerfile and every file of environment/."""
    mapping = dict(image_map or {})
    if hdir.dockerfile is not None:
        text = rewrite_dockerfile(hdir.dockerfile, mapping, workdir=hdir.workdir)
    else:
        image = hdir.bases[0].image
        text = rewrite_dockerfile(parse_dockerfile(f"FROM {image}\n", where="docker_image"), mapping,
                                  workdir=hdir.workdir)
    h = hashlib.sha256()
    h.update(f"fleetrl-harbor-build {_BUILD_FORMAT}\n".encode())
    h.update(text.encode())
    for rel, data in sorted(hdir.context.items()):
        if rel == "Dockerfile":
            continue  # its rewritten text is hashed above
        h.update(f"\0{rel}\0{len(data)}\0".encode())
        h.update(data)
    tag = f"{HARBOR_IMAGE_REPO}/{_slug(hdir.name)}:{h.hexdigest()[:16]}"
    bases = tuple(dict.fromkeys(mapping.get(b.image, b.image) for b in hdir.bases))
    return BuildPlan(tag=tag, dockerfile=text, context_dir=hdir.context_dir, bases=bases, origins=hdir.bases,
                     timeout_s=hdir.config.build_timeout_s)


def harbor_evaluator_command(tests: Mapping[str, str], executable: frozenset[str] | set[str],
                             env: Mapping[str, str]) -> str:
    """The evaluator of a Harbor task, POSIX sh only: make /tests and /logs/verifier
    afresh (dropping anything the agent planted there), copy the test files from where
    ``evaluator.files`` wrote them, run ``bash /tests/test.sh`` with ``[verifier].env``
    exported (its output to /logs/verifier/test-stdout.txt, the tail on stderr), then
    print the reward as one JSON line: ``{"reward": <reward.txt>}``, else reward.json
    folded onto one line, else an object naming the missing files (no ``reward``: an
    evaluator error)."""
    h = HARBOR_ROOT
    q = shlex.quote
    stage = [f'rm -rf {h}/tests {h}/logs && mkdir -p {h}/tests {h}/logs/verifier {h}/logs/agent']
    for d in sorted({posixpath.dirname(rel) for rel in tests} - {""}):
        stage.append(f"mkdir -p {q(f'{h}/tests/{d}')}")
    for rel in tests:
        stage.append(f"cp {q(f'{INCOMING}/{rel}')} {q(f'{h}/tests/{rel}')}")
    for rel in sorted(executable):
        stage.append(f"chmod +x {q(f'{h}/tests/{rel}')}")
    exports = "".join(f"export {k}={q(v)}; " for k, v in env.items())
    log = f"{h}/logs/verifier/test-stdout.txt"
    lines = [
        "{ " + " && ".join(stage) + "; } || { echo '{\"error\": \"fleetrl: cannot stage the tests in /tests\"}'; exit 3; }",
        "command -v bash >/dev/null 2>&1 || { echo '{\"error\": \"fleetrl: the image has no bash, test.sh needs it\"}'; exit 3; }",
        f"( {exports}exec bash /tests/test.sh ) >{log} 2>&1; rc=$?",
        f"tail -c 4000 {log} >&2",
        "if [ -f /logs/verifier/reward.txt ]; then printf '{\"reward\": %s}\\n' \"$(tr -d ' \\t\\r\\n' </logs/verifier/reward.txt)\"",
        "elif [ -f /logs/verifier/reward.json ]; then tr -d '\\r\\n' </logs/verifier/reward.json; echo",
        "else echo \"{\\\"error\\\": \\\"test.sh exited $rc and wrote neither /logs/verifier/reward.txt nor /logs/verifier/reward.json\\\"}\"; fi",
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"


def harbor_task(hdir: HarborDir, image_map: Mapping[str, str] | None = None) -> Task:
    """The `Task` of a read Harbor directory (pure; the image is the build plan's tag,
    see docs/guides/harbor.md for each field). A directory written by ``export-harbor``
    gives back the task it was made from."""
    return harbor_task_and_plan(hdir, image_map)[0]


def harbor_task_and_plan(hdir: HarborDir, image_map: Mapping[str, str] | None = None) -> tuple[Task, BuildPlan | None]:
    """`harbor_task`, and the `BuildPlan` of its image; None when the directory is an
    unchanged ``export-harbor`` directory (its task keeps its own image: nothing to build)."""
    from .harbor_export import restore_exported

    restored = restore_exported(hdir)
    if restored is not None:
        return restored, None
    cfg = hdir.config
    plan = harbor_build_plan(hdir, image_map)
    metadata = {k: v for k, v in flatten_metadata(cfg.metadata).items() if not k.startswith("fleetrl.")}
    where = str(Path(hdir.path) / "task.toml")
    try:
        task = Task(
            id=f"harbor:{hdir.name}",
            prompt=hdir.instruction,
            image=plan.tag,
            workdir=hdir.workdir,
            setup=Setup(commands=[f"cp -R {SEED_DIR}/. ."]),
            evaluator=Evaluator(
                command=harbor_evaluator_command(hdir.tests, hdir.executable, cfg.verifier_env),
                timeout_s=cfg.verifier_timeout_s or DEFAULT_HARBOR_TIMEOUT_S,
                reward="json",
                files={f"{INCOMING}/{rel}": text for rel, text in hdir.tests.items()},
            ),
            limits=Limits(timeout_s=cfg.agent_timeout_s or DEFAULT_HARBOR_TIMEOUT_S, memory_mb=cfg.memory_mb,
                          cpus=cfg.cpus),
            metadata=metadata,
            source=Source(kind="harbor", ref=hdir.path),
        )
    except (msgspec.ValidationError, ValueError) as err:
        raise TaskError(str(err), where=where) from None
    return validate_task(task, where=where), plan


def load_harbor_task(path: str | os.PathLike[str], *, image_map: Mapping[str, str] | None = None) -> Task:
    """The `Task` of the Harbor task directory `path` (`read_harbor_dir` + `harbor_task`).
    Does not build the image: ``fleetrl.sandboxes.harbor_image.ensure_harbor_image`` does."""
    return harbor_task(read_harbor_dir(path), image_map)
