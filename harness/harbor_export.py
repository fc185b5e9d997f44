"""fleetrl tasks -> Harbor task directories, and such a directory back to its task.

`export_harbor_files(task)` is the directory as files (pure): the Dockerfile starts
FROM the task's image, COPYs its setup files into the work dir and RUNs its setup
commands; tests/test.sh puts the evaluator's hidden files in place, runs the evaluator
command in the work dir and turns its result into /logs/verifier/reward.txt (by the
task's reward kind); task.toml carries the timeouts and resources, and every field
Harbor has no place for under ``fleetrl.``-prefixed ``[metadata]`` keys.
`restore_exported` reads those keys back: a directory that is exactly what
`export_harbor_files` writes for the task it describes loads as that task, image
included, so ``import(export(task)) == task``; one edited since loads as any other
Harbor task. Pure apart from `write_harbor_dir` and `restore_exported`'s read of the
directory.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
from pathlib import Path

import msgspec

from .harbor_toml import toml_key, toml_value
from .task_schema import Evaluator, Limits, Message, Setup, Source, Task

__all__ = ["EXPORT_FORMAT", "export_dir_name", "export_harbor_files", "restore_exported", "write_harbor_dir"]

EXPORT_FORMAT = 1
PREFIX = "fleetrl."
BUILD_TIMEOUT_S = 600.0
_EXECUTABLE = frozenset({"tests/test.sh"})
_REWARD_TXT = "/logs/verifier/reward.txt"


def _instruction(task: Task) -> str:
    if task.prompt is not None:
        return task.prompt
    users = [m.content for m in task.messages or () if m.role == "user"]
    return users[-1] if users else ""


def _dockerfile(task: Task) -> str:
    lines = [f"FROM {task.image}", "USER root", f"WORKDIR {task.workdir}"]
    if task.setup.files:
        lines.append("COPY " + json.dumps(["setup/", task.workdir.rstrip("/") + "/"], ensure_ascii=False))
    for cmd in task.setup.commands:
        lines.append("RUN " + json.dumps(["/bin/sh", "-c", cmd], ensure_ascii=False))
    return "\n".join(lines) + "\n"


def _test_sh(task: Task) -> str:
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        "# Written by `fleetrl tasks export-harbor`: runs the task's evaluator command",
        "# (tests/fleetrl/command.sh) and writes its reward to /logs/verifier/reward.txt.",
        "mkdir -p /logs/verifier",
    ]
    for i, path in enumerate(task.evaluator.files):
        full = path if path.startswith("/") else posixpath.join(task.workdir, path)
        lines.append(f"mkdir -p {q(posixpath.dirname(full))} && cp /tests/fleetrl/files/{i} {q(full)} || exit 1")
    lines += [
        f"cd {q(task.workdir)} || exit 1",
        "out=$(mktemp)",
        'sh -c "$(cat /tests/fleetrl/command.sh)" >"$out"; code=$?',
        'cat "$out"',
    ]
    kind = task.evaluator.reward
    if kind == "exit_code":
        lines.append(f'if [ "$code" -eq 0 ]; then echo 1 >{_REWARD_TXT}; else echo 0 >{_REWARD_TXT}; fi')
    else:
        lines.append("last=$(grep -v '^[[:space:]]*$' \"$out\" | tail -n 1)")
        if kind == "json":
            lines.append("""r=$(printf '%s\\n' "$last" | sed -n 's/.*"reward"[[:space:]]*:[[:space:]]*\\([-+0-9.eE]*\\).*/\\1/p')""")
        else:
            lines.append("""r=$(printf '%s\\n' "$last" | awk -F/ 'NF == 2 && $2 + 0 > 0 { printf "%.17g", $1 / $2 }')""")
        lines.append(f'if [ -n "$r" ]; then echo "$r" >{_REWARD_TXT}; fi')
    lines.append("exit 0  # the reward file is the result")
    return "\n".join(lines) + "\n"


def _task_toml(task: Task) -> str:
    ev, lim = task.evaluator, task.limits
    meta: dict[str, str | int | float | bool] = {}
    nulls = []
    for key, value in task.metadata.items():
        if key.startswith(PREFIX):
            raise ValueError(f"task {task.id!r}: metadata key {key!r}: the prefix {PREFIX!r} is reserved "
                             "for fleetrl's own fields in an exported task")
        if value is None:
            nulls.append(key)
        else:
            meta[key] = value
    own: dict[str, str | int | float | bool] = {
        "format": EXPORT_FORMAT,
        "id": task.id,
        "image": task.image,
        "workdir": task.workdir,
        "max_turns": lim.max_turns,
        "reward": ev.reward,
        "command": ev.command,
    }
    if ev.group_command is not None:
        own["group_command"] = ev.group_command
    if task.messages is not None:
        own["messages"] = msgspec.json.encode(task.messages).decode()
    if task.setup.commands:
        own["setup_commands"] = json.dumps(task.setup.commands, ensure_ascii=False)
    if ev.files:
        own["evaluator_files"] = json.dumps(list(ev.files), ensure_ascii=False)
    if nulls:
        own["null_metadata"] = json.dumps(nulls, ensure_ascii=False)
    if task.source is not None:
        own["source"] = msgspec.json.encode(task.source).decode()
    out = ['version = "1.0"', "", "[metadata]"]
    out += [f"{toml_key(k)} = {toml_value(v)}" for k, v in meta.items()]
    out += [f"{toml_key(PREFIX + k)} = {toml_value(v)}" for k, v in own.items()]
    out += ["", "[verifier]", f"timeout_sec = {toml_value(float(ev.timeout_s))}",
            "", "[agent]", f"timeout_sec = {toml_value(float(lim.timeout_s))}",
            "", "[environment]", f"build_timeout_sec = {toml_value(BUILD_TIMEOUT_S)}"]
    if lim.cpus is not None:
        out.append(f"cpus = {toml_value(float(lim.cpus))}")
    if lim.memory_mb is not None:
        out.append(f"memory_mb = {toml_value(int(lim.memory_mb))}")
    return "\n".join(out) + "\n"


def export_harbor_files(task: Task) -> dict[str, bytes]:
    """The Harbor directory of `task` as (relative path -> content); tests/test.sh is
    the one executable file. A metadata key with the reserved ``fleetrl.`` prefix is a
    ValueError."""
    files = {
        "task.toml": _task_toml(task).encode(),
        "instruction.md": _instruction(task).encode(),
        "environment/Dockerfile": _dockerfile(task).encode(),
        "tests/test.sh": _test_sh(task).encode(),
        "tests/fleetrl/command.sh": task.evaluator.command.encode(),
    }
    for path, content in task.setup.files.items():
        files[f"environment/setup/{path}"] = content.encode()
    for i, content in enumerate(task.evaluator.files.values()):
        files[f"tests/fleetrl/files/{i}"] = content.encode()
    return files


def export_dir_name(task_id: str) -> str:
    """A directory name for a task id (letters, digits, ``.``, ``_``, ``-``)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", task_id).strip("-.") or "task"
    return name[:120]


def write_harbor_dir(task: Task, out_dir: str | os.PathLike[str]) -> Path:
    """Write `task` as a Harbor directory at `out_dir` (which must not exist yet)."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=False)
    for rel, content in export_harbor_files(task).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        if rel in _EXECUTABLE:
            path.chmod(0o755)
    return root


# --------------------------------------------------------------------------- back


def _on_disk(root: Path) -> dict[str, bytes] | None:
    out: dict[str, bytes] = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel.startswith("solution/"):
                continue  # a reference solution does not change the task
            if full.is_symlink():
                return None
            out[rel] = full.read_bytes()
    return out


def restore_exported(hdir) -> Task | None:
    """The task an ``export-harbor`` directory was written from, or None when `hdir`
    (a `harbor.HarborDir`) is not one, or was changed since (then it loads as any
    Harbor task)."""
    md = hdir.config.metadata
    if f"{PREFIX}id" not in md:
        return None
    try:
        task = _rebuild(hdir, md)
        if export_harbor_files(task) != _on_disk(Path(hdir.path)):
            return None
    except (ValueError, TypeError, KeyError, msgspec.ValidationError, UnicodeDecodeError):
        return None
    return task


def _rebuild(hdir, md: dict) -> Task:
    def own(key: str, default: object = None) -> object:
        return md.get(PREFIX + key, default)

    if own("format") != EXPORT_FORMAT:
        raise ValueError("unknown export format")
    messages = own("messages")
    setup_files = {rel.removeprefix("setup/"): data.decode("utf-8")
                   for rel, data in hdir.context.items() if rel.startswith("setup/")}
    ev_paths = json.loads(own("evaluator_files", "[]"))
    ev_files = {path: hdir.tests[f"fleetrl/files/{i}"] for i, path in enumerate(ev_paths)}
    metadata = {k: v for k, v in md.items() if not k.startswith(PREFIX)}
    metadata.update({k: None for k in json.loads(own("null_metadata", "[]"))})
    source = own("source")
    cfg = hdir.config
    return msgspec.convert({
        "id": own("id"),
        "prompt": hdir.instruction if messages is None else None,
        "messages": None if messages is None else msgspec.json.decode(messages, type=list[Message]),
        "image": own("image"),
        "workdir": own("workdir"),
        "setup": Setup(files=setup_files, commands=json.loads(own("setup_commands", "[]"))),
        "evaluator": Evaluator(command=own("command"), timeout_s=cfg.verifier_timeout_s, reward=own("reward"),
                               group_command=own("group_command"), files=ev_files),
        "limits": Limits(timeout_s=cfg.agent_timeout_s, max_turns=own("max_turns"), memory_mb=cfg.memory_mb,
                         cpus=cfg.cpus),
        "metadata": metadata,
        "source": None if source is None else msgspec.json.decode(source, type=Source),
    }, Task, from_attributes=True)
