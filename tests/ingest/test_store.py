"""The ingested-task store (actors/ingest/store.py) and the parse dispatch: durability
order, dedupe across restarts, torn tails, the tailing reader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ingest_traces import body, session

from fleetrl.actors.ingest import ParseOptions, StoreError, StoreReader, TaskStore, parse, task_key
from fleetrl.actors.ingest import store as store_mod


def tasks_of(*ids: int):
    tasks, problems = parse(body(*(session(i) for i in ids)), "fleetrl", "t.jsonl")
    assert problems == []
    return tasks


def test_parse_names_malformed_lines_and_keeps_the_rest():
    s2 = session(2)
    del s2["eval"]
    tasks, problems = parse(body(session(1), "{not json", s2, session(3)), "fleetrl", "body")
    assert [t.id for t in tasks] == ["trace:s01", "trace:s03"]
    assert [p.where for p in problems] == ["body:2", "body:3"]
    assert problems[1].field == "eval"
    assert "invalid JSON" in str(problems[0]) and str(problems[1]).startswith("body:3: eval: ")


def test_parse_auto_sniffs_our_format_and_refuses_unknown_ones():
    tasks, problems = parse(body(session(1)), "auto", "b")
    assert [t.id for t in tasks] == ["trace:s01"] and problems == []
    with pytest.raises(ValueError, match="unknown trace format"):
        parse(b"", "yaml", "b")


def test_session_formats_need_a_template(tmp_path):
    data = (Path(__file__).resolve().parent.parent / "fixtures" / "traces" / "openai-log.jsonl").read_bytes()
    with pytest.raises(ValueError, match="template"):
        parse(data, "openai-log", "log")
    template = tasks_of(1)[0]
    tasks, _ = parse(data, "openai-log", "log", ParseOptions(template=template))
    assert tasks and all(t.evaluator == template.evaluator for t in tasks)


def test_append_is_durable_before_it_returns(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):  # record what is synced: the file, then its directory
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)
    monkeypatch.setattr(store_mod.os, "fsync", fsync)
    with TaskStore(tmp_path / "ingest") as st:
        synced.clear()
        res = st.append(tasks_of(1, 2), origin="test")
        assert synced == ["tasks.jsonl", "ingest"]
        assert [rec.seq for _, rec in res.added] == [0, 1]
        lines = (tmp_path / "ingest" / "tasks.jsonl").read_bytes().splitlines()
        assert len(lines) == 2  # on disk when append returned


def test_duplicates_are_not_added_twice_also_across_restarts(tmp_path):
    d = tmp_path / "ingest"
    with TaskStore(d) as st:
        first = st.append(tasks_of(1, 2), origin="a")
        again = st.append(tasks_of(2, 3), origin="b")  # same content, other source.ref
        assert len(first.added) == 2 and [i for i, _ in again.duplicates] == [0] and len(again.added) == 1
    with TaskStore(d) as st:
        assert len(st) == 3
        res = st.append(tasks_of(1, 3), origin="c")
        assert res.added == [] and [seq for _, seq in res.duplicates] == [0, 2]
        # within one call too
        res = st.append(tasks_of(4) + tasks_of(4), origin="d")
        assert len(res.added) == 1 and [(i, s) for i, s in res.duplicates] == [(1, 3)]


def test_same_id_other_content_is_a_conflict(tmp_path):
    with TaskStore(tmp_path) as st:
        st.append(tasks_of(1), origin="a")
        other, _ = parse(body(session(1, command="false")), "fleetrl", "x")
        res = st.append(other, origin="b")
        assert res.added == [] and res.conflicts == [(0, 0)]
    assert task_key(other[0]) != task_key(tasks_of(1)[0])


def test_a_torn_tail_is_cut_at_open_and_never_read(tmp_path):
    d = tmp_path / "ingest"
    with TaskStore(d) as st:
        st.append(tasks_of(1), origin="a")
    with open(d / "tasks.jsonl", "ab") as fh:
        fh.write(b'{"seq": 1, "key": "ab')  # a write cut by SIGKILL
    reader = StoreReader(d)
    assert [r.seq for r in reader.poll()] == [0]
    with TaskStore(d) as st:
        assert len(st) == 1 and "torn" in st.problems[0]
        st.append(tasks_of(2), origin="b")
    assert [r.task.id for r in reader.poll()] == ["trace:s02"]
    assert [r.task.id for r in StoreReader(d).poll()] == ["trace:s01", "trace:s02"]


def test_one_writer_per_store(tmp_path):
    with TaskStore(tmp_path):
        with pytest.raises(StoreError, match="held by another"):
            TaskStore(tmp_path).open()
    TaskStore(tmp_path).open().close()  # released


def test_a_failed_write_is_taken_back(tmp_path, monkeypatch):
    with TaskStore(tmp_path) as st:
        st.append(tasks_of(1), origin="a")
        size = (tmp_path / "tasks.jsonl").stat().st_size

        def full(fd):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(store_mod.os, "fsync", full)
        with pytest.raises(OSError):
            st.append(tasks_of(2), origin="b")
        monkeypatch.undo()
        assert (tmp_path / "tasks.jsonl").stat().st_size == size and len(st) == 1
        assert [rec.seq for _, rec in st.append(tasks_of(2), origin="c").added] == [1]
    assert [r.task.id for r in StoreReader(tmp_path).poll()] == ["trace:s01", "trace:s02"]
