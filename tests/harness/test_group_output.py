"""The group evaluation contract (harness.tasks): `Evaluator.group_command` and the
parser of its output, `split_group_output`."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.harness.tasks import GROUP_END, TaskError, decode_task_json, encode_task_json, split_group_output

from .test_tasks import MINIMAL


def section(k: int, code: int, text: str) -> str:
    return f"@@fleetrl-attempt {k} exit={code}\n{text}"


def test_sections_are_split_by_headers_and_closed_by_the_end_line():
    out = section(0, 0, "a\n1/2\n") + section(1, -1, "") + section(2, 3, "x\n") + GROUP_END + "\n"
    assert split_group_output(out, 3) == {0: (0, "a\n1/2\n"), 1: (-1, ""), 2: (3, "x\n")}


def test_a_run_cut_short_loses_only_its_open_section():
    out = section(0, 0, "1/2\n") + section(1, 0, "2/")  # no end line: attempt 1's output may be partial
    assert split_group_output(out, 2) == {0: (0, "1/2\n")}
    assert split_group_output("", 2) == {}
    assert split_group_output("noise before any header\n" + section(0, 0, "1/1\n") + GROUP_END, 1) == {0: (0, "1/1\n")}


def test_forged_or_confused_output_costs_a_rerun_not_a_wrong_reward():
    twice = section(0, 0, "2/2\n") + section(0, 0, "0/2\n") + section(1, 0, "1/2\n") + GROUP_END
    assert split_group_output(twice, 2) == {1: (0, "1/2\n")}  # attempt 0 reported twice: neither copy counts
    out_of_range = section(5, 0, "1/1\n") + section(-1, 0, "1/1\n") + GROUP_END
    assert split_group_output(out_of_range, 2) == {}
    assert split_group_output(section(0, 0, "@@fleetrl-attempt x exit=0\n1/1\n") + GROUP_END, 1) == {
        0: (0, "@@fleetrl-attempt x exit=0\n1/1\n")}  # not a header: kept as text


_line = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"),
                max_size=20).filter(lambda s: not s.startswith("@@fleetrl-attempt"))


@given(st.lists(st.tuples(st.integers(-5, 300), st.lists(_line, max_size=4)), max_size=8), st.booleans())
def test_round_trip_of_well_formed_sections(items, closed):
    n = 8
    out = "".join(section(k, code, "".join(line + "\n" for line in lines))
                  for k, (code, lines) in enumerate(items))
    if closed:
        out += GROUP_END + "\n"
    got = split_group_output(out, n)
    want = {k: (code, "".join(line + "\n" for line in lines)) for k, (code, lines) in enumerate(items)}
    if not closed and items:
        want.pop(len(items) - 1)
    assert got == want


def test_group_command_is_optional_and_checked():
    d = copy.deepcopy(MINIMAL)
    assert decode_task_json(json.dumps(d), where="t").evaluator.group_command is None
    d["evaluator"]["group_command"] = "python3 check.py --group .fleetrl-group"
    task = decode_task_json(json.dumps(d), where="t")
    assert task.evaluator.group_command == "python3 check.py --group .fleetrl-group"
    assert decode_task_json(encode_task_json(task), where="t") == task
    d["evaluator"]["group_command"] = ""
    with pytest.raises(TaskError, match="evaluator.group_command"):
        decode_task_json(json.dumps(d), where="t")
