"""The batch protocol between Sandbox.exec_many and the in-container runner, without
Docker: the encoder's layout, and a parser that keeps only complete, well-formed records
(so a runner killed mid-write, or output that is not the runner's, cannot yield a result)."""

from __future__ import annotations

import ast
import json
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.sandboxes.batch import PreparedProgram, encode_batch, parse_runner_output
from fleetrl.sandboxes.programs import RUNNER_SOURCE

CAPS = dict(stdout_cap=16, stderr_cap=8)


def record(i: int, out: bytes = b"", err: bytes = b"", *, out_total=None, err_total=None, **over) -> bytes:
    head = dict(
        i=i, exit_code=0, timed_out=False, over_limit=False, oom=False, oom_count=0, duration=0.01,
        out_total=len(out) if out_total is None else out_total, err_total=len(err) if err_total is None else err_total,
        out_len=len(out), err_len=len(err),
    )  # fmt: skip
    head.update(over)
    return b"R " + json.dumps(head).encode() + b"\n" + out + err


END = b'E {"reset":0,"error":"","oom_count":2}\n'


def test_encoder_puts_files_then_stdin_of_each_program_after_the_header():
    progs = [
        PreparedProgram(["a"], None, "/work", 1.5, b"IN0", [("/work/f", b"F0"), ("/tmp/g", b"G0")]),
        PreparedProgram(["b", "c"], {"K": "v"}, "/tmp", 2.0, None, []),
        PreparedProgram(["d"], None, "/work", 3.0, b"", []),
    ]
    blob = encode_batch(progs, dirs=["/work", "/tmp"], output_limit=100, final=True, keeper=["sleep", "infinity"], **CAPS)
    head, _, payload = blob.partition(b"\n")
    h = json.loads(head)
    assert h["final"] is True and h["dirs"] == ["/work", "/tmp"] and h["keeper"] == ["sleep", "infinity"]
    assert (h["stdout_cap"], h["stderr_cap"], h["output_limit"]) == (16, 8, 100)
    assert [p["stdin"] for p in h["programs"]] == [3, None, 0]
    assert h["programs"][0]["files"] == [["/work/f", 2], ["/tmp/g", 2]]
    assert h["programs"][1] == {"argv": ["b", "c"], "env": {"K": "v"}, "cwd": "/tmp", "timeout": 2.0, "stdin": None, "files": []}
    assert payload == b"F0G0IN0"


def test_complete_output_yields_every_record_and_the_end():
    data = record(0, b"out0", b"e") + b'S {"i":1}\n' + record(2, b"x" * 16, b"y" * 8, out_total=99, err_total=9) + END
    out = parse_runner_output(data, 3, **CAPS)
    assert out.problem == "" and out.end is not None and out.end.reset == 0 and out.end.oom_count == 2
    assert sorted(out.records) == [0, 2] and out.not_started == {1}
    rec, so, se = out.records[2]
    assert (so, se, rec.out_total, rec.err_total) == (b"x" * 16, b"y" * 8, 99, 9)
    assert out.records[0][1:] == (b"out0", b"e")


def test_a_record_cut_short_is_dropped_and_the_rest_kept():
    data = record(0, b"aa") + record(1, b"bbbb")[:-2]
    out = parse_runner_output(data, 3, **CAPS)
    assert list(out.records) == [0] and out.end is None and "cut short" in out.problem


def test_records_out_of_order_or_out_of_range_stop_the_parse():
    out = parse_runner_output(record(1) + record(0) + END, 2, **CAPS)
    assert list(out.records) == [1] and out.end is None and "out of order" in out.problem
    out = parse_runner_output(record(5) + END, 2, **CAPS)
    assert out.records == {} and "program 5" in out.problem


def test_lengths_that_disagree_with_the_caps_are_rejected():
    # more kept than the cap, or less kept than min(total, cap): not the runner's output
    out = parse_runner_output(record(0, b"x" * 17) + END, 1, **CAPS)
    assert out.records == {} and "inconsistent" in out.problem
    out = parse_runner_output(record(0, b"x" * 3, out_total=10) + END, 1, **CAPS)
    assert out.records == {} and "inconsistent" in out.problem


def test_unknown_tags_bad_json_and_trailing_bytes():
    assert "unknown tag" in parse_runner_output(b"X {}\n", 1, **CAPS).problem
    assert parse_runner_output(b'R {"i":0}\n', 1, **CAPS).problem.startswith("record at byte")
    assert "no complete head line" in parse_runner_output(b"R " + b"{" * 5000, 1, **CAPS).problem
    out = parse_runner_output(record(0) + END + b"junk", 1, **CAPS)
    assert out.end is not None and "after the end record" in out.problem
    out = parse_runner_output(record(0), 1, **CAPS)
    assert out.end is None and out.problem == "no end record"


@settings(max_examples=200, deadline=None)
@given(
    outs=st.lists(st.tuples(st.binary(max_size=16), st.binary(max_size=8)), min_size=1, max_size=6),
    cut=st.integers(min_value=0, max_value=10_000),
)
def test_any_prefix_of_genuine_output_yields_only_complete_records(outs, cut):
    full = b"".join(record(i, o, e) for i, (o, e) in enumerate(outs)) + END
    part = full[: min(cut, len(full))]
    out = parse_runner_output(part, len(outs), **CAPS)
    for i, (rec, so, se) in out.records.items():
        assert (so, se) == outs[i] and rec.i == i
    boundaries = [len(b"".join(record(i, o, e) for i, (o, e) in enumerate(outs[:k]))) for k in range(len(outs) + 1)]
    complete = sum(1 for b in boundaries[1:] if b <= len(part))
    assert len(out.records) == complete
    assert (out.end is not None) == (len(part) == len(full))


def test_runner_source_imports_only_the_standard_library():
    # it runs inside the image with nothing of ours installed
    tree = ast.parse(RUNNER_SOURCE)
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods and mods <= set(sys.stdlib_module_names), mods - set(sys.stdlib_module_names)
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
