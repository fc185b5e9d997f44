"""The tracker actor (actors/tracker) writing a run's step scalars to W&B (offline) and
trackio for real: the scalars each tracker holds at each step equal metrics.jsonl's
(same names; nested fields joined by "/"), rows appended while the daemon runs arrive,
a partly written line waits for its end, a bad line is skipped and counted, and the
report's plots are logged as images once the report is written at shutdown."""

from __future__ import annotations

import json
import math
import random
import sqlite3
import struct
from functools import partial
from pathlib import Path

import pytest
import trio

from fleetrl.actors.tracker.scalars import scalars_of
from fleetrl.actors.tracker.tail import read_new_rows
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor

pytestmark = pytest.mark.slow

ROW = {"step": 1, "version": 1, "loss": -0.0052, "reward_mean": 0.44, "skipped": False, "skipped_reason": "",
       "mismatch_kl_by_sampler": {"torch/bfloat16": 6.9e-06, "torch/float32": 1.5e-07},
       "staleness_hist": {"0": 8}, "sampler_identities": [{"sampler_id": "a"}], "usd_per_rollout": None}


def test_scalars_keep_their_names_and_nested_ones_are_joined():
    assert scalars_of(ROW) == {"version": 1, "loss": -0.0052, "reward_mean": 0.44,
                               "mismatch_kl_by_sampler/torch/bfloat16": 6.9e-06,
                               "mismatch_kl_by_sampler/torch/float32": 1.5e-07, "staleness_hist/0": 8}


def test_new_rows_after_an_offset_a_partial_line_waits_and_a_bad_line_is_named(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_bytes(b'{"step": 1}\nnot json\n[1]\n{"step": 2')
    rows, offset, problems = read_new_rows(f, 0)
    assert rows == [{"step": 1}] and offset == len(b'{"step": 1}\nnot json\n[1]\n')
    assert len(problems) == 2 and "byte 12 is not JSON" in problems[0] and "not a JSON object" in problems[1]
    with f.open("ab") as fh:
        fh.write(b"}\n")
    assert read_new_rows(f, offset)[:2] == ([{"step": 2}], f.stat().st_size)
    assert read_new_rows(tmp_path / "none.jsonl", 5) == ([], 5, [])


def _rows(n: int, start: int = 1) -> list[dict]:
    rng = random.Random(start)
    return [dict(ROW, step=s, version=s, loss=rng.uniform(-1, 1), reward_mean=rng.random(),
                 mismatch_kl_by_sampler={"torch/bfloat16": rng.random() * 1e-5}) for s in range(start, start + n)]


def _append(path: Path, rows: list[dict]) -> None:
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history records of a W&B run file (``run-ID.wandb``: a 7-byte W&B header, then
    records in 32 KiB blocks, each with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts, out = 7, [], []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        parts = [chunk] if kind in (1, 2) else [*parts, chunk]
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            if rec.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return out


def _trackio_history(db: Path) -> list[dict]:
    with sqlite3.connect(db) as c:
        return [dict(json.loads(m), _step=s) for s, m in c.execute("select step, metrics from metrics order by id")]


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
async def test_the_trackers_hold_metrics_jsonl_s_scalars_and_the_report_s_plots(tmp_path, tracker):
    state_dir = tmp_path / "state"
    metrics = state_dir / "actors" / "trainer" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    first, later = _rows(5), _rows(4, start=6)
    _append(metrics, first)
    state = StateDir(state_dir).open()
    sup = Supervisor(load_config_text(f"""
[daemon]
grace_s = 60.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
[actors.tracker]
factory = "fleetrl.actors.tracker:run"
config = {{tracker = "{tracker}", project = "frl-test", report_dir = "report", poll_s = 0.2, report_wait_s = 30.0}}
""", source="test.toml"), state, rng=random.Random(0))
    with state, trio.fail_after(120):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            handle = await sup.wait_handle("tracker")
            while handle.rows < 5:
                await trio.sleep(0.1)
            _append(metrics, later[:2])
            with metrics.open("a") as f:
                f.write("garbage\n" + json.dumps(later[2])[:20])  # a bad line, then half a row
            while handle.rows < 7:
                await trio.sleep(0.1)
            assert handle.skipped == 1
            with metrics.open("a") as f:
                f.write(json.dumps(later[2])[20:] + "\n" + json.dumps(later[3]) + "\n")
            sup.request_shutdown("test")
            report = state_dir / "report"
            report.mkdir()
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            plt.plot([1, 2, 3])
            plt.savefig(report / "learning.png")
            plt.close()
            (report / "index.html").write_text("<html></html>")
    assert handle.rows == 9 and handle.last_step == 9 and handle.images == 1
    if tracker == "wandb":
        (run_dir,) = (state_dir / "tracker" / "wandb").glob(f"offline-run-*-{state.run_id}")
        history = _wandb_history(run_dir)
    else:
        history = _trackio_history(state_dir / "tracker" / "frl-test.db")
    by_step = {h["_step"]: h for h in history}
    for row in first + later:
        got = {k: v for k, v in by_step[row["step"]].items() if not k.startswith("_")}
        want = scalars_of(row)
        assert got.keys() == want.keys(), (row["step"], got.keys() ^ want.keys())
        assert all(math.isclose(got[k], want[k], rel_tol=1e-12) for k in want), (got, want)
    images = {"/".join(k.split("/")[:2]) for h in history for k in h if k.startswith("report/")}  # W&B: fields
    assert images == {"report/learning"}
    assert any(k.startswith("report/") for k in by_step[10])  # at the step after the last row
