"""`MetricsTail`: the growing metrics file read as it is written."""

from __future__ import annotations

import json

from fleetrl.actors.runs.serve import MetricsTail


def _line(step: int, groups: int) -> str:
    return json.dumps({"step": step, "groups": groups}) + "\n"


def test_lines_read_together_each_carry_their_own_running_total(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []  # no file yet
    path.write_text(_line(1, 4))
    assert [g for _, g in tail.poll()] == [4]
    with path.open("a") as fh:  # two steps land between two polls
        fh.write(_line(2, 4) + _line(3, 5))
    assert [(r["step"], g) for r, g in tail.poll()] == [(2, 8), (3, 13)]
    assert tail.groups == 13


def test_a_partial_last_line_waits_for_its_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    whole = _line(1, 4)
    path.write_text(whole[:7])
    assert tail.poll() == []
    with path.open("a") as fh:
        fh.write(whole[7:])
    assert [(r["step"], g) for r, g in tail.poll()] == [(1, 4)]
