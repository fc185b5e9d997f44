"""``POST /v1/traces`` and the watched directory on a real `fleetrl serve` (hypercorn on
127.0.0.1): the bearer token, malformed lines named with the rest accepted, duplicates,
and a SIGKILL right after the 2xx answer losing nothing (the worker's source loads it)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from helpers import wait_until
from ingest_daemon import IngestDaemon
from ingest_traces import body, session

from fleetrl.actors.envworker.config import IngestedTasks
from fleetrl.actors.envworker.sources import open_task_source
from fleetrl.actors.ingest import StoreReader

pytestmark = pytest.mark.slow


@pytest.fixture
def daemon(tmp_path, fleetrl_bin):
    template = tmp_path / "templates.jsonl"
    template.write_text(json.dumps({"id": "tpl", "prompt": "x", "evaluator": {"command": "test -f ok"}}) + "\n")
    d = IngestDaemon(tmp_path, fleetrl_bin, extra=f'watch_dir = "{tmp_path / "drop"}"\n'
                                                  f'templates = {{tpl = "{template}"}}')
    yield d
    d.stop()
    d.kill()


def test_post_traces(daemon):
    daemon.start()
    assert daemon.post(body(session(1)), token=False).status_code == 401

    bad = session(3)
    bad["workspace"] = {"files": {"../x": "1"}}
    r = daemon.post(body(session(1), "{oops", bad, session(4)), format="fleetrl")
    assert r.status_code == 207, r.text
    got = r.json()
    assert got["accepted"] == ["trace:s01", "trace:s04"]
    assert [e.split(":")[:2] for e in got["errors"]] == [["body", "2"], ["body", "3"]]
    assert got["problems"][1]["field"].startswith("workspace.files")

    r = daemon.post(body(session(1)), format="fleetrl")  # the same task again
    assert r.status_code == 200 and r.json()["accepted"] == [] and r.json()["duplicates"] == ["trace:s01"]
    r = daemon.post(b"not json\n", format="fleetrl")
    assert r.status_code == 422 and r.json()["errors"] == ["body:1: invalid JSON: " + r.json()["errors"][0].split(
        "invalid JSON: ")[1]]
    assert daemon.post(body(session(5)), format="yaml").status_code == 400
    assert daemon.post(body(session(5)), format="fleetrl", at="sometimes").status_code == 400
    r = daemon.post(b"", format="fleetrl")
    assert r.status_code == 422 and "no task in the input" in r.json()["errors"][0]
    assert daemon.post(body(session(5)), format="atif").status_code in (400, 422)  # no template configured
    stats = daemon.get("/status").json()["actors"]["ingest"]["statistics"]
    assert stats["stored"] == 2 and stats["accepted"] == 2 and stats["duplicates"] == 1

    # a session format, named by the Content-Type, on a configured template
    log = (Path(__file__).resolve().parent.parent / "fixtures" / "traces" / "openai-log.jsonl").read_bytes()
    r = daemon.post(log, content_type="application/vnd.fleetrl.openai-log+jsonl")
    assert r.status_code == 400 and "template" in r.json()["error"]  # none named, no default
    r = daemon.post(log, content_type="application/json; format=openai-log", template="tpl")
    assert r.status_code in (200, 207) and r.json()["accepted"], r.text
    assert all(a.startswith("trace:") for a in r.json()["accepted"])
    assert daemon.post(log, format="openai-log", template="nope").status_code == 400


def test_watched_directory(daemon, tmp_path):
    daemon.start()
    drop = tmp_path / "drop"
    (drop / "a.jsonl.tmp").write_bytes(body(session(1), "{bad"))
    (drop / "a.jsonl.tmp").rename(drop / "a.jsonl")
    (drop / "b.fleetrl.jsonl").write_bytes(b"nothing usable\n")  # the extension names the format
    (drop / "c.jsonl").write_bytes(b"nothing usable\n")  # default_format = "auto" cannot tell
    failed = drop / "failed"
    wait_until(lambda: all(p.exists() for p in (drop / "done" / "a.jsonl", failed / "b.fleetrl.jsonl",
                                                  failed / "c.jsonl")),
               "the files to be ingested", 60, proc=daemon.proc, stderr=daemon.err)
    assert "a.jsonl:2: invalid JSON" in (drop / "done" / "a.jsonl.errors.txt").read_text()
    assert "b.fleetrl.jsonl:1: invalid JSON" in (failed / "b.fleetrl.jsonl.errors.txt").read_text()
    assert "cannot tell the format" in (failed / "c.jsonl.errors.txt").read_text()
    assert [r.task.id for r in StoreReader(daemon.state / "ingest").poll()] == ["trace:s01"]


def test_sigkill_right_after_the_answer_loses_nothing(daemon, tmp_path):
    daemon.start()
    r = daemon.post(body(session(8)), format="fleetrl")
    assert r.status_code == 200
    daemon.kill(signal.SIGKILL)  # at once: the answer promised the task is on disk
    assert daemon.proc.returncode == -signal.SIGKILL
    assert [t.task.id for t in StoreReader(daemon.state / "ingest").poll()] == ["trace:s08"]

    daemon.start()  # the same state directory
    stats = daemon.get("/status").json()["actors"]["ingest"]["statistics"]
    assert stats["stored"] == 1
    r = daemon.post(body(session(8), session(9)), format="fleetrl")
    assert r.json()["accepted"] == ["trace:s09"] and r.json()["duplicates"] == ["trace:s08"]
    # what a worker with tasks = {kind = "ingested"} loads at its start
    src = open_task_source(IngestedTasks(), None, daemon_dir=daemon.state, state_dir=tmp_path / "worker")
    assert [src.get(0).id, src.get(1).id] == ["trace:s08", "trace:s09"]
