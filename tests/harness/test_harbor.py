"""Harbor task directories in and out, without Docker (the Docker side:
tests/sandboxes/test_harbor_docker.py).

Checked: the hand-written task in harbor_tasks/hello-upper maps field by field; clear
errors for a missing task.toml / instruction.md / tests/test.sh, bad TOML, negative
timeouts, a binary test file, a FROM with an undeclared variable; Dockerfile reading
(continuations, here-documents, multi-stage work dirs, FROM mapping, the syntax
directive); `Evaluator.files` validation and where it is written (the protocol's
evaluate_in_sandbox, the envworker's scoring specs); export then import gives back
the same task for any task (Hypothesis), and an edited export loads as a plain Harbor
task; the CLI commands.
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import msgspec
import pytest
import trio

from fleetrl.actors.envworker.config import EnvWorkerConfig, HarborTasks
from fleetrl.actors.envworker.sandboxing import group_scoring_spec, scoring_spec
from fleetrl.harness.cli import main as cli_main
from fleetrl.harness.errors import TaskError
from fleetrl.harness.harbor import (
    DEFAULT_HARBOR_WORKDIR,
    INCOMING,
    find_harbor_dirs,
    harbor_build_plan,
    harbor_task,
    harbor_task_and_plan,
    load_harbor_task,
    parse_image_map,
    read_harbor_dir,
)
from fleetrl.harness.harbor_dockerfile import (
    base_images,
    final_workdir,
    parse_dockerfile,
    rewrite_dockerfile,
)
from fleetrl.harness.harbor_export import (
    export_harbor_files,
    restore_exported,
    write_harbor_dir,
)
from fleetrl.harness.harbor_toml import flatten_metadata, parse_task_toml
from fleetrl.harness.protocol import evaluate_in_sandbox
from fleetrl.harness.tasks import (
    Evaluator,
    Limits,
    Message,
    Setup,
    Source,
    Task,
    decode_task_json,
    parse_task,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HELLO = Path(__file__).parent / "harbor_tasks" / "hello-upper"
MAP = {"python:3.11-slim": "fleetrl-sandbox:py311"}


@pytest.fixture
def hello(tmp_path) -> Path:
    """A copy of the hand-written task to break."""
    return Path(shutil.copytree(HELLO, tmp_path / "hello-upper"))


# --------------------------------------------------------------------------- reading


def test_hand_written_task_maps_every_field():
    task = load_harbor_task(HELLO, image_map=MAP)
    assert task.id == "harbor:hello-upper"
    assert task.prompt == (HELLO / "instruction.md").read_text()
    assert task.image.startswith("fleetrl-harbor/hello-upper:") and len(task.image.split(":")[1]) == 16
    assert task.workdir == "/app"
    assert task.setup == Setup(commands=["cp -R /fleetrl-harbor/workdir/. ."])
    assert task.limits == Limits(timeout_s=120.0, max_turns=30, memory_mb=1024, cpus=1.0)
    ev = task.evaluator
    assert (ev.timeout_s, ev.reward, ev.group_command) == (60.0, "json", None)
    assert ev.files == {f"{INCOMING}/test.sh": (HELLO / "tests/test.sh").read_text(),
                        f"{INCOMING}/check_outputs.py": (HELLO / "tests/check_outputs.py").read_text()}
    assert "export EXPECTED_SUFFIX='!'" in ev.command and "bash /tests/test.sh" in ev.command
    assert task.metadata == {"author_name": "fleetrl tests", "difficulty": "easy", "category": "file-operations",
                             "tags": '["trivial", "shell"]'}
    assert task.source == Source(kind="harbor", ref=str(HELLO))
    # the tests are nowhere in what the agent's sandbox gets before the evaluator
    assert not any("check_outputs" in c for c in task.setup.commands) and not task.setup.files
    # the JSONL form loads back
    assert decode_task_json(msgspec.json.encode(task), where="x") == task


def test_image_tag_is_a_content_hash(hello):
    tag = harbor_task(read_harbor_dir(hello), MAP).image
    assert harbor_task(read_harbor_dir(hello), MAP).image == tag
    (hello / "environment" / "greeting.txt").write_text("bye\n")
    assert harbor_task(read_harbor_dir(hello), MAP).image != tag
    assert harbor_task(read_harbor_dir(hello), {"python:3.11-slim": "other:1"}).image not in (tag,)


def test_build_plan_maps_the_from_and_appends_the_epilogue():
    plan = harbor_build_plan(read_harbor_dir(HELLO), MAP)
    assert plan.bases == ("fleetrl-sandbox:py311",)
    assert plan.timeout_s == 300.0
    lines = plan.dockerfile.splitlines()
    assert lines[0] == "FROM fleetrl-sandbox:py311" and lines[1] == "USER root"
    assert "COPY greeting.txt /app/greeting.txt" in lines
    assert "ln -s /tmp/fleetrl-harbor/tests /tests" in plan.dockerfile
    assert "cp -R /app/. /fleetrl-harbor/workdir/" in plan.dockerfile
    unmapped = harbor_build_plan(read_harbor_dir(HELLO), {})
    assert unmapped.bases == ("python:3.11-slim",) and unmapped.dockerfile.startswith("FROM python:3.11-slim\n")


def _write(d: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


@pytest.mark.parametrize("remove, message", [
    ("task.toml", "missing task.toml"),
    ("instruction.md", "missing instruction.md"),
    ("tests/test.sh", "missing tests/test.sh"),
    ("environment/Dockerfile", "missing environment/Dockerfile"),
])
def test_missing_files_are_named(hello, remove, message):
    (hello / remove).unlink()
    with pytest.raises(TaskError, match=message) as err:
        read_harbor_dir(hello)
    assert str(hello) in str(err.value)


def test_bad_toml_names_the_file(hello):
    (hello / "task.toml").write_text("[verifier\ntimeout_sec = 1\n")
    with pytest.raises(TaskError, match="invalid TOML") as err:
        read_harbor_dir(hello)
    assert err.value.where == str(hello / "task.toml")


@pytest.mark.parametrize("section, key, value", [
    ("verifier", "timeout_sec", "-1.0"), ("agent", "timeout_sec", "-5"), ("agent", "timeout_sec", "0"),
    ("environment", "build_timeout_sec", "-1"), ("environment", "cpus", "-2"), ("agent", "timeout_sec", '"x"'),
    ("environment", "memory_mb", "0"), ("environment", "memory", '"lots"'),
])
def test_bad_values_name_the_key(section, key, value):
    with pytest.raises(TaskError) as err:
        parse_task_toml(f"[{section}]\n{key} = {value}\n", where="t/task.toml")
    assert err.value.field == f"{section}.{key}" and err.value.where == "t/task.toml"


def test_toml_spellings():
    cfg = parse_task_toml('schema_version = "1.1"\n[task]\nname = "org/x"\n[environment]\nmemory = "2G"\n'
                          'docker_image = "img:1"\n[verifier]\nenv = { A = "1", B = 2 }\nuser = "root"\n', where="t")
    assert (cfg.name, cfg.memory_mb, cfg.docker_image, cfg.verifier_env) == ("org/x", 2048, "img:1", {"A": "1", "B": "2"})
    with pytest.raises(TaskError, match="not a shell variable"):
        parse_task_toml('[verifier]\nenv = { "A-B" = "1" }\n', where="t")


def test_metadata_flattening():
    md = parse_task_toml('[metadata]\na = 1\ntags = ["x", 2]\n[metadata.author]\nname = "n"\n'
                         '[metadata.author.more]\nk = true\n', where="t").metadata
    assert flatten_metadata(md) == {"a": 1, "tags": '["x", 2]', "author.name": "n", "author.more.k": True}


def test_binary_test_file_is_an_error_naming_it(hello):
    (hello / "tests" / "data.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TaskError, match="tests/data.bin is not UTF-8 text: binary test files are not supported"):
        read_harbor_dir(hello)


def test_nested_and_executable_test_files(hello):
    _write(hello, {"tests/sub/helper.sh": "echo hi\n"})
    (hello / "tests" / "sub" / "helper.sh").chmod(0o755)
    task = harbor_task(read_harbor_dir(hello), MAP)
    assert f"{INCOMING}/sub/helper.sh" in task.evaluator.files
    assert "mkdir -p /tmp/fleetrl-harbor/tests/sub" in task.evaluator.command
    assert "chmod +x /tmp/fleetrl-harbor/tests/sub/helper.sh" in task.evaluator.command


def test_docker_image_instead_of_a_dockerfile(hello):
    shutil.rmtree(hello / "environment")
    (hello / "task.toml").write_text('[environment]\ndocker_image = "corp/env:3"\n')
    hdir = read_harbor_dir(hello)
    assert hdir.workdir == DEFAULT_HARBOR_WORKDIR
    plan = harbor_build_plan(hdir, {})
    assert plan.bases == ("corp/env:3",) and plan.dockerfile.startswith("FROM corp/env:3\n")


def test_find_dirs(tmp_path):
    for name in ("b", "a"):
        _write(tmp_path / "set" / name, {"task.toml": ""})
    (tmp_path / "set" / "not-a-task").mkdir()
    assert find_harbor_dirs([str(tmp_path / "set")]) == [str(tmp_path / "set" / "a"), str(tmp_path / "set" / "b")]
    assert find_harbor_dirs([str(tmp_path / "set" / "a")]) == [str(tmp_path / "set" / "a")]
    with pytest.raises(TaskError, match="no such directory"):
        find_harbor_dirs([str(tmp_path / "nope")])
    with pytest.raises(TaskError, match="nor a directory of them"):
        find_harbor_dirs([str(tmp_path / "set" / "not-a-task")])
    assert parse_image_map(["a:1=b:2"]) == {"a:1": "b:2"}
    with pytest.raises(ValueError, match="FROM_IMAGE=LOCAL_IMAGE"):
        parse_image_map(["a:1"])


# --------------------------------------------------------------------------- Dockerfiles


def test_dockerfile_parsing():
    text = ("# syntax=docker/dockerfile:1\nARG BASE=python:3.12\n\nFROM ${BASE} AS build\nWORKDIR /src\n"
            "RUN echo a \\\n  # a comment inside\n  && echo b\nRUN <<EOF\nFROM nothing\nWORKDIR /no\nEOF\n"
            "FROM build AS test\nWORKDIR sub\nFROM --platform=linux/amd64 scratch\n"
            "FROM build\nWORKDIR ../out\n")
    df = parse_dockerfile(text, where="D")
    assert [i.keyword for i in df.instructions] == ["ARG", "FROM", "WORKDIR", "RUN", "RUN", "FROM", "WORKDIR",
                                                    "FROM", "FROM", "WORKDIR"]
    run = df.instructions[3]
    assert (run.args, run.first_line, run.last_line) == ("echo a && echo b", 6, 8)
    assert [b.image for b in base_images(df, where="D")] == ["python:3.12"]
    assert final_workdir(df, default="/d") == "/out"
    out = rewrite_dockerfile(df, {"python:3.12": "local:1"}, workdir="/out")
    assert out.splitlines()[0].startswith("# (fleetrl: dropped the parser directive syntax")
    assert "FROM local:1 AS build\nUSER root\n" in out and "FROM nothing" in out
    assert final_workdir(parse_dockerfile("FROM a\n", where="D"), default="/d") == "/d"


def test_dockerfile_errors():
    with pytest.raises(TaskError, match="no default"):
        base_images(parse_dockerfile("FROM ${NOPE}\n", where="D"), where="D")
    with pytest.raises(TaskError, match="no FROM"):
        base_images(parse_dockerfile("RUN true\n", where="D"), where="D")
    with pytest.raises(TaskError, match="never closed"):
        parse_dockerfile("FROM a\nRUN <<EOF\necho\n", where="D")


def test_workdir_root_is_refused(hello):
    (hello / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /\n")
    with pytest.raises(TaskError, match="cannot be a sandbox work dir"):
        read_harbor_dir(hello)


# --------------------------------------------------------------------------- Evaluator.files


def _task(**ev) -> Task:
    return Task(id="t", prompt="p", evaluator=Evaluator(command="true", **ev))


def test_evaluator_files_paths_are_checked():
    assert _task(files={"a/b.py": "x", "/tmp/x/y": "y", "/work/z": "z"}).evaluator.files
    for bad, why in [("../x", "inside workdir"), ("/tmp/../etc/x", "normalised"), ("/", "normalised"),
                     ("a//b", "normalised")]:
        with pytest.raises(TaskError, match=why):
            parse_task({"id": "t", "prompt": "p", "evaluator": {"command": "c", "files": {bad: ""}}}, where="w")
    with pytest.raises(TaskError, match="under /tmp or the workdir") as err:
        parse_task({"id": "t", "prompt": "p", "evaluator": {"command": "c", "files": {"/tests/x": ""}}}, where="w")
    assert err.value.field == "evaluator.files['/tests/x']"


class _FakeSandbox:
    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    async def write_files(self, files):
        self.log.append(("write", dict(files)))

    async def exec(self, cmd, *, timeout=None, stdin=None, env=None, workdir=None):
        self.log.append(("exec", cmd))
        return msgspec.structs.replace(_Result(), stdout=b'{"reward": 0.25}\n')

    async def read_file(self, path, *, max_bytes=1 << 20):
        raise AssertionError


class _Result(msgspec.Struct):
    exit_code: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False


async def test_evaluate_in_sandbox_writes_the_hidden_files_first():
    task = _task(files={"rel.txt": "r", "/tmp/abs.txt": "a"}, reward="json")
    sb = _FakeSandbox()
    with trio.fail_after(5):
        reward, code, _ = await evaluate_in_sandbox(task, sb)
    assert (reward, code) == (0.25, 0)
    assert sb.log == [("write", {"/work/rel.txt": "r", "/tmp/abs.txt": "a"}), ("exec", "true")]


def test_scoring_specs_write_the_hidden_files_over_the_attempts():
    task = msgspec.structs.replace(_task(files={"t.py": "hidden", "/tmp/h/x": "h"}, group_command="g"),
                                   setup=Setup(files={"s.py": "setup"}))
    spec = scoring_spec(task, {"t.py": "planted by the agent", "a.py": "attempt"})
    assert spec.files == {"/work/s.py": "setup", "/work/t.py": "hidden", "/work/a.py": "attempt", "/tmp/h/x": "h"}
    group = group_scoring_spec(task, [{"a.py": "0"}, {"a.py": "1"}])
    assert group.files["/work/t.py"] == "hidden" and group.files["/tmp/h/x"] == "h"


# --------------------------------------------------------------------------- export / import

_seg = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=8)
_rel = st.lists(_seg, min_size=1, max_size=3).map("/".join).filter(lambda p: p not in (".", ".."))
_text = st.text(max_size=40)
_meta_value = st.one_of(st.none(), st.booleans(), _text, st.integers(-(1 << 63), (1 << 63) - 1),
                        st.floats(allow_nan=False, allow_infinity=False))
_seconds = st.floats(min_value=0.001, max_value=1e6, allow_nan=False)
_image = st.from_regex(r"[a-z0-9]{1,8}(/[a-z0-9]{1,8})?(:[a-z0-9._-]{1,8})?", fullmatch=True)
_workdir = st.lists(st.text(string.ascii_lowercase + string.digits + "_", min_size=1, max_size=6),
                    min_size=1, max_size=3).map(lambda p: "/" + "/".join(p)).filter(
                        lambda w: w.split("/")[1] not in ("tmp", "proc", "sys", "dev"))


def _no_prefix_clash(paths) -> bool:
    return not any(a != b and b.startswith(a + "/") for a in paths for b in paths)


@st.composite
def tasks(draw) -> Task:
    workdir = draw(_workdir)
    use_messages = draw(st.booleans())
    messages = None
    if use_messages:
        messages = draw(st.lists(st.builds(Message, role=st.sampled_from(["system", "user", "assistant"]),
                                           content=_text), min_size=1, max_size=3))
    setup_files = draw(st.dictionaries(_rel, _text, max_size=3).filter(_no_prefix_clash))
    ev_paths = draw(st.lists(st.one_of(_rel, _rel.map(lambda p: "/tmp/" + p)), max_size=3, unique=True))
    return Task(
        id=draw(st.text(min_size=1, max_size=20)),
        prompt=None if use_messages else draw(_text),
        messages=messages,
        image=draw(_image),
        workdir=workdir,
        setup=Setup(files=setup_files, commands=draw(st.lists(st.text(min_size=1, max_size=30), max_size=3))),
        evaluator=Evaluator(command=draw(st.text(min_size=1, max_size=60)), timeout_s=draw(_seconds),
                            reward=draw(st.sampled_from(["exit_code", "json", "fraction"])),
                            group_command=draw(st.none() | st.text(min_size=1, max_size=20)),
                            files={p: draw(_text) for p in ev_paths}),
        limits=Limits(timeout_s=draw(_seconds), max_turns=draw(st.integers(1, 10**6)),
                      memory_mb=draw(st.none() | st.integers(1, 10**6)),
                      cpus=draw(st.none() | st.floats(min_value=0.01, max_value=256))),
        metadata=draw(st.dictionaries(_text.filter(lambda k: not k.startswith("fleetrl.")), _meta_value,
                                      max_size=4)),
        source=draw(st.none() | st.builds(Source, kind=st.sampled_from(["user", "humaneval", "trace", "harbor"]),
                                          ref=_text, trace_id=st.none() | _text,
                                          from_turn=st.none() | st.integers(0, 100))),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(task=tasks())
def test_export_then_import_gives_the_same_task(task, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "t"
    write_harbor_dir(task, out)
    back, plan = harbor_task_and_plan(read_harbor_dir(out))
    assert plan is None  # an unchanged export keeps the task's own image: nothing to build
    assert back == task


def test_an_edited_export_loads_as_a_plain_harbor_task(tmp_path):
    task = Task(id="fix/1", prompt="fix it", setup=Setup(files={"a.py": "x = 1\n"}, commands=["echo hi"]),
                evaluator=Evaluator(command="python3 -c 'print(1/2)'", reward="fraction", timeout_s=30,
                                    files={"check.py": "assert True\n"}),
                limits=Limits(timeout_s=99, memory_mb=256), metadata={"team": "x", "n": None})
    out = write_harbor_dir(task, tmp_path / "fix-1")
    assert load_harbor_task(out) == task
    (out / "environment" / "README").write_text("edited\n")
    plain = load_harbor_task(out)
    assert plain.image.startswith("fleetrl-harbor/") and plain.source.kind == "harbor"
    assert (plain.prompt, plain.workdir, plain.limits.timeout_s, plain.limits.memory_mb) == ("fix it", "/work", 99, 256)
    assert plain.metadata == {"team": "x"}  # fleetrl.* keys describe a task this no longer is
    dockerfile = (out / "environment" / "Dockerfile").read_text()
    assert dockerfile == ('FROM fleetrl-sandbox:py311\nUSER root\nWORKDIR /work\nCOPY ["setup/", "/work/"]\n'
                          'RUN ["/bin/sh", "-c", "echo hi"]\n')
    test_sh = (out / "tests" / "test.sh").read_text()
    assert "cp /tests/fleetrl/files/0 /work/check.py" in test_sh and "awk -F/" in test_sh


def test_export_refuses_the_reserved_prefix():
    with pytest.raises(ValueError, match="reserved"):
        export_harbor_files(Task(id="t", prompt="p", evaluator=Evaluator(command="c"), metadata={"fleetrl.x": 1}))


def test_restore_ignores_plain_harbor_dirs():
    assert restore_exported(read_harbor_dir(HELLO)) is None


# --------------------------------------------------------------------------- CLI and task source


def test_cli_export_then_import(tmp_path, capsys):
    tasks_file = tmp_path / "tasks.jsonl"
    a = Task(id="a", prompt="do a", evaluator=Evaluator(command="true"))
    b = Task(id="b", messages=[Message(role="user", content="do b")], evaluator=Evaluator(command="false"))
    tasks_file.write_text(msgspec.json.encode(a).decode() + "\n" + msgspec.json.encode(b).decode() + "\nnot json\n")
    assert cli_main(["tasks", "export-harbor", "--tasks", str(tasks_file), "--out", str(tmp_path / "h")]) == 1
    assert "wrote 2 Harbor task directories" in capsys.readouterr().out
    out = tmp_path / "back.jsonl"
    assert cli_main(["tasks", "import-harbor", str(tmp_path / "h"), "--no-build", "--out", str(out)]) == 0
    back = [json.loads(line) for line in out.read_text().splitlines()]
    assert [t["id"] for t in back] == ["a", "b"] and back[1]["messages"][0]["content"] == "do b"
    # exporting again over existing directories skips them
    assert cli_main(["tasks", "export-harbor", "--tasks", str(tasks_file), "--out", str(tmp_path / "h")]) == 1
    assert "already exists" in capsys.readouterr().out
    assert cli_main(["tasks", "import-harbor", str(tmp_path / "nope"), "--no-build"]) == 2
    assert cli_main(["tasks", "import-harbor", str(HELLO), "--no-build", "--map-image", "bad"]) == 2


def test_cli_import_to_stdout(capsys):
    assert cli_main(["tasks", "import-harbor", str(HELLO), "--no-build", "--map-image",
                     "python:3.11-slim=fleetrl-sandbox:py311"]) == 0
    captured = capsys.readouterr()
    assert decode_task_json(captured.out.strip(), where="stdout") == load_harbor_task(HELLO, image_map=MAP)
    assert "wrote 1 Harbor tasks to stdout" in captured.err


def test_source_config():
    cfg = msgspec.convert({"model": {"kind": "local", "model_dir": "m"},
                           "tasks": {"kind": "harbor", "paths": ["d"], "image_map": MAP}}, EnvWorkerConfig)
    assert cfg.tasks == HarborTasks(paths=("d",), image_map=MAP)
    with pytest.raises(msgspec.ValidationError, match="at least one"):
        msgspec.convert({"kind": "harbor", "paths": []}, HarborTasks)
