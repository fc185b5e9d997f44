"""A Harbor task's ``environment/Dockerfile``: its instructions, base images and last
``WORKDIR``, and the rewritten Dockerfile fleetrl builds.

Reading is line-based, as Docker's parser: comments, parser directives (``# escape=``),
line continuations and here-documents (``RUN <<EOF``) are understood well enough to
find each instruction and its line; only ``FROM``, ``ARG`` (before the first ``FROM``)
and ``WORKDIR`` are interpreted. Rewriting replaces the image of each ``FROM`` that is
mapped to a local one and appends fleetrl's epilogue (`epilogue`); every other line is
kept as written. Pure: text in, text out (the Docker calls are in
``fleetrl.sandboxes.harbor_image``).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Mapping

import msgspec

from .errors import TaskError

__all__ = [
    "HARBOR_ROOT",
    "SEED_DIR",
    "BaseImage",
    "Dockerfile",
    "Instruction",
    "base_images",
    "epilogue",
    "final_workdir",
    "parse_dockerfile",
    "rewrite_dockerfile",
]

HARBOR_ROOT = "/tmp/fleetrl-harbor"
"""Where ``/tests`` and ``/logs`` point in a built image (links made by `epilogue`): the
sandbox's root filesystem is read-only, /tmp is writable."""
SEED_DIR = "/fleetrl-harbor/workdir"
"""A copy of the image's work dir, made at build time: the sandbox mounts an empty
tmpfs over the work dir, so a setup command copies this back."""

_DIRECTIVE = re.compile(r"^#\s*([A-Za-z]+)\s*=\s*(.*?)\s*$")
_HEREDOC = re.compile(r"<<(-?)(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


class Instruction(msgspec.Struct, frozen=True, kw_only=True):
    """One instruction: its keyword (upper case), its arguments (continuations joined),
    and the 1-based lines it spans (a here-document's body included)."""

    keyword: str
    args: str
    first_line: int
    last_line: int


class Dockerfile(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    instructions: tuple[Instruction, ...]


class BaseImage(msgspec.Struct, frozen=True, kw_only=True):
    """The image one ``FROM`` starts from (variables substituted), and where."""

    image: str
    line: int
    text: str
    """The ``FROM`` instruction as written (for error messages)."""


def _lines(text: str) -> list[str]:
    """Lines as Docker splits them: at ``\n`` only (a ``\r`` before it dropped), not at
    the other separators `str.splitlines` knows (``\u2028``, ...)."""
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    return lines[:-1] if lines and lines[-1] == "" else lines


def parse_dockerfile(text: str, *, where: str) -> Dockerfile:
    """Split `text` into instructions (`where`: the file, for errors)."""
    lines = _lines(text)
    escape = "\\"
    i = 0
    while i < len(lines):  # parser directives: only at the very top
        m = _DIRECTIVE.match(lines[i])
        if m is None:
            break
        if m[1].lower() == "escape":
            if m[2] not in ("\\", "`"):
                raise TaskError(f"line {i + 1}: escape must be '\\' or '`', got {m[2]!r}", where=where)
            escape = m[2]
        i += 1
    out: list[Instruction] = []
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        first = i
        parts: list[str] = []
        while True:
            line = lines[i].rstrip()
            if line.endswith(escape) and i + 1 < len(lines):
                parts.append(line[:-1])
                i += 1
                while i < len(lines) and lines[i].strip().startswith("#"):
                    i += 1  # comment lines inside a continuation are dropped, as Docker does
                if i >= len(lines):
                    break
                continue
            parts.append(line)
            break
        joined = " ".join(p.strip() for p in parts if p.strip())
        keyword, _, args = joined.partition(" ")
        if not re.fullmatch(r"[A-Za-z]+", keyword):
            raise TaskError(f"line {first + 1}: {keyword[:40]!r} is not a Dockerfile instruction", where=where)
        heredocs = [] if args.lstrip().startswith("[") else list(_HEREDOC.finditer(args))  # not in JSON form
        for m in heredocs:  # skip each here-document's body
            end_word = m[3]
            i += 1
            while i < len(lines) and (lines[i].lstrip("\t") if m[1] else lines[i]) != end_word:
                i += 1
            if i >= len(lines):
                raise TaskError(f"line {first + 1}: here-document <<{end_word} is never closed", where=where)
        out.append(Instruction(keyword=keyword.upper(), args=args.strip(), first_line=first + 1, last_line=i + 1))
        i += 1
    return Dockerfile(text=text, instructions=tuple(out))


def _from_parts(args: str) -> tuple[list[str], str, str | None]:
    """A FROM's (flags, image, stage name)."""
    words = args.split()
    flags = [w for w in words if w.startswith("--")]
    rest = [w for w in words if not w.startswith("--")]
    if len(rest) == 3 and rest[1].lower() == "as":
        return flags, rest[0], rest[2]
    if len(rest) == 1:
        return flags, rest[0], None
    raise ValueError(args)


def _substitute(image: str, args: Mapping[str, str]) -> str | None:
    missing = False

    def sub(m: re.Match[str]) -> str:
        nonlocal missing
        name = m[1] or m[2]
        if name not in args:
            missing = True
            return ""
        return args[name]

    out = _VAR.sub(sub, image)
    return None if missing or "$" in out else out


def _global_args(df: Dockerfile) -> dict[str, str]:
    """``ARG NAME=default`` before the first FROM (what a FROM may use)."""
    out: dict[str, str] = {}
    for ins in df.instructions:
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG":
            for word in shlex.split(ins.args):
                name, eq, value = word.partition("=")
                if eq:
                    out[name] = value
    return out


def base_images(df: Dockerfile, *, where: str) -> list[BaseImage]:
    """The images the FROMs start from, in order: earlier stages (``FROM builder``) and
    ``scratch`` are left out. A FROM whose image uses an undeclared variable, or no
    FROM at all, is a `TaskError`."""
    gargs = _global_args(df)
    stages: set[str] = set()
    out: list[BaseImage] = []
    for ins in df.instructions:
        if ins.keyword != "FROM":
            continue
        raw = f"FROM {ins.args}"
        try:
            _flags, image, stage = _from_parts(ins.args)
        except ValueError:
            raise TaskError(f"line {ins.first_line}: cannot read {raw!r}", where=where) from None
        resolved = _substitute(image, gargs)
        if resolved is None:
            raise TaskError(f"line {ins.first_line}: {raw!r}: the image uses a variable with no default "
                            "(declare it as ARG NAME=default before the first FROM)", where=where)
        if resolved.lower() not in stages and resolved != "scratch":
            out.append(BaseImage(image=resolved, line=ins.first_line, text=raw))
        if stage is not None:
            stages.add(stage.lower())
    if not any(ins.keyword == "FROM" for ins in df.instructions):
        raise TaskError("no FROM instruction", where=where)
    return out


def final_workdir(df: Dockerfile, *, default: str) -> str:
    """The work dir of the last stage: its last ``WORKDIR`` (relative ones resolved
    against the one before; a stage built FROM an earlier stage starts from that
    stage's), else `default`. Variables in WORKDIR are not expanded."""
    stage_dirs: dict[str, str | None] = {}
    current: str | None = None
    last_stage: str | None = None
    for ins in df.instructions:
        if ins.keyword == "FROM":
            try:
                _flags, image, stage = _from_parts(ins.args)
            except ValueError:
                image, stage = ins.args, None
            current = stage_dirs.get(image.lower())
            if stage is not None:
                stage_dirs[stage.lower()] = current
            last_stage = stage
        elif ins.keyword == "WORKDIR":
            path = ins.args.strip().strip('"').strip("'")
            current = posixpath.normpath(posixpath.join(current or "/", path))
            if last_stage is not None:
                stage_dirs[last_stage.lower()] = current
    return current or default


def rewrite_dockerfile(df: Dockerfile, mapping: Mapping[str, str], *, workdir: str) -> str:
    """The Dockerfile fleetrl builds: each FROM whose image `mapping` maps (keys as
    `base_images` reports them) starts from the mapped image, followed by ``USER root``
    (a mapped image may default to another user; the Dockerfile was written for one
    whose default is root); every other line as written; then `epilogue`."""
    gargs = _global_args(df)
    lines = _lines(df.text)
    replace: dict[int, tuple[int, str]] = {}
    for ins in df.instructions:
        if ins.keyword != "FROM":
            continue
        flags, image, stage = _from_parts(ins.args)
        resolved = _substitute(image, gargs)
        if resolved is not None and resolved in mapping:
            new = " ".join(["FROM", *flags, mapping[resolved], *(["AS", stage] if stage else [])])
            replace[ins.first_line] = (ins.last_line, f"{new}\nUSER root")
    out: list[str] = []
    i = 1
    while i <= len(lines) and (m := _DIRECTIVE.match(lines[i - 1])) is not None:
        # a `# syntax=` directive would make BuildKit fetch a frontend image: dropped (offline)
        out.append(f"# (fleetrl: dropped the parser directive {m[1]}={m[2]})" if m[1].lower() == "syntax"
                   else lines[i - 1])
        i += 1
    while i <= len(lines):
        if i in replace:
            last, text = replace[i]
            out.append(text)
            i = last + 1
            continue
        out.append(lines[i - 1])
        i += 1
    return "\n".join(out) + "\n" + epilogue(workdir)


def epilogue(workdir: str) -> str:
    """What fleetrl appends to a Harbor Dockerfile (runs as root, needs /bin/sh):
    ``/tests`` and ``/logs`` become links into `HARBOR_ROOT` (writable in a sandbox),
    and the work dir's content is copied to `SEED_DIR` (readable by everyone)."""
    wd = shlex.quote(workdir)
    return (
        "# --- added by fleetrl (docs/guides/harbor.md)\n"
        "USER root\n"
        f"RUN rm -rf /tests /logs {SEED_DIR} && mkdir -p {SEED_DIR} "
        f"&& ln -s {HARBOR_ROOT}/tests /tests && ln -s {HARBOR_ROOT}/logs /logs "
        f"&& if [ -d {wd} ]; then cp -R {wd}/. {SEED_DIR}/; fi && chmod -R a+rX {posixpath.dirname(SEED_DIR)}\n"
    )
