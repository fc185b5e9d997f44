"""Task schema, validation with field paths, JSONL loading/dumping, evaluator rewards."""

from __future__ import annotations

import json
import os

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.harness.tasks import (
    DEFAULT_IMAGE,
    Evaluator,
    EvaluatorOutputError,
    FunctionCall,
    Limits,
    Message,
    Setup,
    Source,
    Task,
    TaskError,
    ToolCall,
    decode_task_json,
    dump_tasks_jsonl,
    encode_task_json,
    load_tasks_jsonl,
    parse_task,
    reward_from_evaluator,
    validate_task,
)

MINIMAL = {"id": "t1", "prompt": "do it", "evaluator": {"command": "true"}}


def with_(base: dict, **changes) -> dict:
    out = json.loads(json.dumps(base))
    out.update(changes)
    return out


# ----------------------------------------------------------------- construction


def test_minimal_record_gets_documented_defaults():
    task = parse_task(MINIMAL, where="x:1")
    assert task.image == DEFAULT_IMAGE == "fleetrl-sandbox:py311"
    assert task.workdir == "/work"
    assert task.setup == Setup(files={}, commands=[])
    assert task.evaluator == Evaluator(command="true", timeout_s=60.0, reward="exit_code")
    assert task.limits == Limits(timeout_s=600.0, max_turns=30, memory_mb=None, cpus=None)
    assert task.metadata == {}
    assert task.source is None
    assert task.messages is None


def test_task_is_frozen():
    task = parse_task(MINIMAL, where="x:1")
    with pytest.raises(AttributeError):
        task.id = "other"  # type: ignore[misc]


def test_python_construction_validates_too():
    with pytest.raises(ValueError, match="exactly one of"):
        Task(id="a", evaluator=Evaluator(command="x"))
    with pytest.raises(ValueError, match="exactly one of"):
        Task(id="a", prompt="p", messages=[Message(role="user", content="x")], evaluator=Evaluator(command="x"))
    with pytest.raises(ValueError, match="inside workdir"):
        Setup(files={"../escape": ""})


def test_validate_task_applies_bounds_to_python_built_tasks():
    ok = Task(id="a", prompt="p", evaluator=Evaluator(command="x"))
    assert validate_task(ok, where="py") == ok
    bad = Task(id="a", prompt="p", evaluator=Evaluator(command="x"), limits=Limits(max_turns=0))
    with pytest.raises(TaskError) as info:
        validate_task(bad, where="py")
    assert (info.value.where, info.value.field) == ("py", "limits.max_turns")
    odd = Task(id="a", prompt="p", evaluator=Evaluator(command="x"), metadata={"k": object()})  # type: ignore[dict-item]
    with pytest.raises(TaskError, match="not representable as JSON"):
        validate_task(odd, where="py")


def test_messages_task_with_tool_calls_is_valid():
    obj = with_(MINIMAL)
    del obj["prompt"]
    obj["messages"] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "fix the bug"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
    ]
    task = parse_task(obj, where="x:1")
    assert task.messages is not None and task.messages[2].tool_calls == [
        ToolCall(id="c1", function=FunctionCall(name="sh", arguments="{}"))
    ]


BAD_RECORDS = [
    # (record, field path, message fragment)
    ({"prompt": "p", "evaluator": {"command": "x"}}, "id", "missing required field"),
    (with_(MINIMAL, id=""), "id", "length >= 1"),
    (with_(MINIMAL, id=3), "id", "Expected `str`, got `int`"),
    ({"id": "a", "evaluator": {"command": "x"}}, "prompt", "exactly one of"),
    (with_(MINIMAL, messages=[{"role": "user", "content": "x"}]), "prompt", "exactly one of"),
    ({"id": "a", "messages": [], "evaluator": {"command": "x"}}, "messages", "at least one"),
    (
        {"id": "a", "messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}], "evaluator": {"command": "x"}},
        "messages[1].role",
        "Invalid enum value 'robot'",
    ),
    (
        {"id": "a", "messages": [{"role": "user"}], "evaluator": {"command": "x"}},
        "messages[0].content",
        "missing required field",
    ),
    (
        {"id": "a", "messages": [{"role": "user", "content": "x", "tool_call_id": "c"}], "evaluator": {"command": "x"}},
        "messages[0].tool_call_id",
        "only tool messages",
    ),
    ({"id": "a", "prompt": "p"}, "evaluator", "missing required field"),
    (with_(MINIMAL, evaluator={"command": ""}), "evaluator.command", "length >= 1"),
    (with_(MINIMAL, evaluator={"command": "x", "reward": "vibes"}), "evaluator.reward", "Invalid enum value"),
    (with_(MINIMAL, evaluator={"command": "x", "timeout_s": 0}), "evaluator.timeout_s", "> 0"),
    (with_(MINIMAL, evaluator={"command": "x", "timeot_s": 5}), "evaluator.timeot_s", "unknown field"),
    (with_(MINIMAL, limits={"max_turns": 0}), "limits.max_turns", ">= 1"),
    (with_(MINIMAL, limits={"timeout_s": -1}), "limits.timeout_s", "> 0"),
    (with_(MINIMAL, limits={"memory_mb": 1.5}), "limits.memory_mb", "Expected `int | null`"),
    (with_(MINIMAL, limits={"cpus": "two"}), "limits.cpus", "got `str`"),
    (with_(MINIMAL, setup={"files": {"/etc/passwd": "x"}}), "setup.files['/etc/passwd']", "not absolute"),
    (with_(MINIMAL, setup={"files": {"a/../../b": "x"}}), "setup.files['a/../../b']", "normalised"),
    (with_(MINIMAL, setup={"files": {"../b": "x"}}), "setup.files['../b']", "inside workdir"),
    (with_(MINIMAL, setup={"files": {"a.txt": 1}}), "setup.files[...]", "Expected `str`"),
    (with_(MINIMAL, setup={"commands": "make"}), "setup.commands", "Expected `array`"),
    (with_(MINIMAL, workdir="work"), "workdir", "absolute"),
    (with_(MINIMAL, image=""), "image", "length >= 1"),
    (with_(MINIMAL, metadata={"k": [1]}), "metadata[...]", "got `array`"),
    (with_(MINIMAL, source={"kind": "web"}), "source.kind", "Invalid enum value"),
    (with_(MINIMAL, source={"kind": "trace", "from_turn": -1}), "source.from_turn", ">= 0"),
    (with_(MINIMAL, promtp="typo"), "promtp", "unknown field"),
]


@pytest.mark.parametrize(("record", "field", "fragment"), BAD_RECORDS)
def test_invalid_record_names_field_and_where(record, field, fragment):
    with pytest.raises(TaskError) as info:
        parse_task(record, where="tasks.jsonl:7")
    err = info.value
    assert err.where == "tasks.jsonl:7"
    assert err.field == field
    assert fragment in err.message
    assert str(err).startswith(f"tasks.jsonl:7: {field}: ")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "must be a JSON object, got an array"),
        ('"s"', "got a string"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"id": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ],
)
def test_decode_rejects_non_objects(text, fragment):
    with pytest.raises(TaskError, match=fragment) as info:
        decode_task_json(text, where="f:2")
    assert info.value.field == ""
    assert info.value.where == "f:2"


# ----------------------------------------------------------------- files


def test_load_reports_every_bad_line_and_keeps_good_ones(tmp_path):
    path = tmp_path / "tasks.jsonl"
    lines = [
        json.dumps(with_(MINIMAL, id="a")),  # 1 ok
        "",  # 2 blank: ignored
        "{broken",  # 3 bad JSON
        json.dumps(with_(MINIMAL, id="b", limits={"max_turns": "many"})),  # 4 bad field
        json.dumps(with_(MINIMAL, id="a")),  # 5 duplicate of line 1
        json.dumps(with_(MINIMAL, id="c", source={"kind": "synthetic", "ref": "gen:1"})),  # 6 ok, keeps its source
        "42",  # 7 not an object
    ]
    data = ("\n".join(lines) + "\n").encode() + b'{"id": "\xff"}\n'  # 8 not UTF-8
    path.write_bytes(data)
    report = load_tasks_jsonl(path)
    assert [t.id for t in report.tasks] == ["a", "c"]
    assert report.tasks[0].source == Source(kind="user", ref=f"{path}:1")
    assert report.tasks[1].source == Source(kind="synthetic", ref="gen:1")
    got = [(e.file, e.line, e.field) for e in report.errors]
    assert got == [
        (str(path), 3, ""),
        (str(path), 4, "limits.max_turns"),
        (str(path), 5, "id"),
        (str(path), 7, ""),
        (str(path), 8, ""),
    ]
    assert "duplicate id 'a' (first at line 1)" in report.errors[2].message
    assert "not UTF-8" in report.errors[4].message
    assert (report.n_valid, report.n_invalid, report.n_records) == (2, 5, 7)
    assert str(report.errors[1]).startswith(f"{path}:4: limits.max_turns: ")


def test_load_ignores_a_leading_byte_order_mark(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(MINIMAL).encode() + b"\n")
    report = load_tasks_jsonl(path)
    assert [t.id for t in report.tasks] == ["t1"] and report.errors == []


def test_load_missing_file_is_an_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tasks_jsonl(tmp_path / "nope.jsonl")


def test_dump_is_atomic_and_round_trips(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("old contents\n")
    tasks = [
        parse_task(with_(MINIMAL, id=f"t{i}", source={"kind": "user", "ref": f"x:{i}"}), where="x")
        for i in range(3)
    ]
    assert dump_tasks_jsonl(tasks, path) == 3
    assert load_tasks_jsonl(path).tasks == tasks
    assert os.listdir(tmp_path) == ["out.jsonl"]  # no temp file left behind

    # an encoding failure half-way leaves the old file untouched and no temp file
    with pytest.raises(TypeError):
        dump_tasks_jsonl([tasks[0], object()], path)  # type: ignore[list-item]
    assert load_tasks_jsonl(path).tasks == tasks
    assert os.listdir(tmp_path) == ["out.jsonl"]


# ----------------------------------------------------------------- rewards


def task_with(reward: str) -> Task:
    return Task(id="r", prompt="p", evaluator=Evaluator(command="x", reward=reward))  # type: ignore[arg-type]


@pytest.mark.parametrize(("code", "expected"), [(0, 1.0), (1, 0.0), (2, 0.0), (-9, 0.0), (137, 0.0)])
def test_exit_code_reward(code, expected):
    assert reward_from_evaluator(task_with("exit_code"), code, "whatever\n") == expected


@pytest.mark.parametrize(
    ("stdout", "code", "expected"),
    [
        ('{"reward": 0.25}\n', 0, 0.25),
        ('log line\n{"reward": 1}\n\n  \n', 0, 1.0),
        ('{"reward": 0, "detail": "x"}', 1, 0.0),  # the exit code does not override JSON
    ],
)
def test_json_reward(stdout, code, expected):
    assert reward_from_evaluator(task_with("json"), code, stdout) == expected


@pytest.mark.parametrize(
    ("stdout", "fragment"),
    [
        ("", "stdout is empty"),
        ("reward=1\n", "not JSON"),
        ("[0.5]\n", "not an object"),
        ('{"score": 1}\n', "no 'reward'"),
        ('{"reward": "1"}\n', "not a number"),
        ('{"reward": true}\n', "not a number"),
        ('{"reward": 1.5}\n', "outside [0, 1]"),
        ('{"reward": -0.1}\n', "outside [0, 1]"),
        ('{"reward": NaN}\n', "outside [0, 1]"),
    ],
)
def test_json_reward_malformed(stdout, fragment):
    with pytest.raises(EvaluatorOutputError) as info:
        reward_from_evaluator(task_with("json"), 3, stdout)
    assert fragment in info.value.reason
    assert "exit code 3" in info.value.reason
    assert info.value.task_id == "r" and info.value.kind == "json"


@pytest.mark.parametrize(("stdout", "expected"), [("3/4\n", 0.75), ("ran\n 0 / 5 \n", 0.0), ("7/7", 1.0)])
def test_fraction_reward(stdout, expected):
    assert reward_from_evaluator(task_with("fraction"), 1, stdout) == expected


@pytest.mark.parametrize(
    ("stdout", "fragment"),
    [("", "empty"), ("3 of 4", "not 'passed/total'"), ("1/0", "total is 0"), ("5/4", "passed 5 > total 4"), ("-1/4", "not 'passed/total'")],
)
def test_fraction_reward_malformed(stdout, fragment):
    with pytest.raises(EvaluatorOutputError, match="fraction") as info:
        reward_from_evaluator(task_with("fraction"), 0, stdout)
    assert fragment in info.value.reason


# ----------------------------------------------------------------- properties

text = st.text(max_size=20)
finite_pos = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)
segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=8)
rel_path = st.lists(segment, min_size=1, max_size=3).map("/".join).filter(lambda p: p not in (".", ".."))
meta_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)


@st.composite
def messages(draw):
    out = []
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        role = draw(st.sampled_from(["system", "user", "assistant", "tool"]))
        kw = {}
        if role == "assistant" and draw(st.booleans()):
            kw["tool_calls"] = [
                ToolCall(id=draw(segment), function=FunctionCall(name=draw(segment), arguments=draw(text)))
            ]
        if role == "tool":
            kw["tool_call_id"] = draw(segment)
        out.append(Message(role=role, content=draw(text), name=draw(st.none() | segment), **kw))
    return out


@st.composite
def tasks(draw):
    use_prompt = draw(st.booleans())
    return Task(
        id=draw(st.text(min_size=1, max_size=12)),
        prompt=draw(text) if use_prompt else None,
        messages=None if use_prompt else draw(messages()),
        image=draw(st.sampled_from([DEFAULT_IMAGE, "python:3.12-slim", "corp/agent:1"])),
        workdir=draw(st.sampled_from(["/work", "/repo", "/home/u/x"])),
        setup=Setup(
            files=draw(st.dictionaries(rel_path, text, max_size=3)),
            commands=draw(st.lists(st.text(min_size=1, max_size=10), max_size=2)),
        ),
        evaluator=Evaluator(
            command=draw(st.text(min_size=1, max_size=15)),
            timeout_s=draw(finite_pos),
            reward=draw(st.sampled_from(["exit_code", "json", "fraction"])),
        ),
        limits=Limits(
            timeout_s=draw(finite_pos),
            max_turns=draw(st.integers(min_value=1, max_value=1000)),
            memory_mb=draw(st.none() | st.integers(min_value=1, max_value=1 << 20)),
            cpus=draw(st.none() | finite_pos),
        ),
        metadata=draw(st.dictionaries(text, meta_value, max_size=3)),
        source=draw(
            st.none()
            | st.builds(
                Source,
                kind=st.sampled_from(["user", "humaneval", "synthetic", "trace"]),
                ref=text,
                trace_id=st.none() | text,
                from_turn=st.none() | st.integers(min_value=0, max_value=100),
            )
        ),
    )


PROPS = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(task=tasks())
def test_any_valid_task_round_trips_through_json(task):
    line = encode_task_json(task)
    assert b"\n" not in line
    assert decode_task_json(line, where="x:1") == task


@settings(max_examples=25, deadline=None, derandomize=True)
@given(batch=st.lists(tasks(), min_size=1, max_size=4, unique_by=lambda t: t.id))
def test_any_valid_tasks_round_trip_through_a_file(tmp_path_factory, batch):
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    dump_tasks_jsonl(batch, path)
    report = load_tasks_jsonl(path)
    assert report.errors == []
    expected = [
        t if t.source is not None else msgspec.structs.replace(t, source=Source(kind="user", ref=f"{path}:{i}"))
        for i, t in enumerate(batch, start=1)
    ]
    assert report.tasks == expected


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5))
json_value = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6
)


def _paths(obj, prefix=()):
    """Every (container path) to a value inside obj."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


@st.composite
def corrupted_records(draw):
    """A valid task record as JSON text with one random corruption applied."""
    record = json.loads(encode_task_json(draw(tasks())))
    how = draw(st.sampled_from(["replace", "delete", "add", "truncate", "byte"]))
    if how in ("truncate", "byte"):
        raw = json.dumps(record)
        if how == "truncate":
            return raw[: draw(st.integers(min_value=0, max_value=len(raw) - 1))]
        i = draw(st.integers(min_value=0, max_value=len(raw) - 1))
        return raw[:i] + draw(st.characters(codec="utf-8")) + raw[i + 1 :]
    paths = [p for p in _paths(record) if p]
    path = draw(st.sampled_from(paths))
    parent = record
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if how == "replace":
        parent[last] = draw(json_value)
    elif how == "delete":
        del parent[last]
    elif isinstance(parent, dict):
        parent[draw(st.text(min_size=1, max_size=6))] = draw(json_value)
    else:
        parent.append(draw(json_value))
    return json.dumps(record)


@PROPS
@given(raw=corrupted_records())
def test_corruption_gives_a_task_error_naming_a_field_or_the_line(raw):
    try:
        task = decode_task_json(raw, where="f.jsonl:9")
    except TaskError as err:
        assert err.where == "f.jsonl:9"
        assert err.message
        # a schema error names a field; only a record-level error (bad JSON, not an object) has none
        if not err.field:
            assert err.message.startswith(("invalid JSON", "a task record must be a JSON object")), err
    else:
        assert isinstance(task, Task)  # the corruption happened to keep it valid
