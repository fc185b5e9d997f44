"""The tracker actor (actors/tracker) writing a run's step scalars to W&B (offline) and
trackio for real: the scalars each tracker holds at each step equal metrics.jsonl's
(same names; nested fields joined by "/"), rows appended while the daemon runs arrive,
a partly written line waits for its end, a bad line is skipped and counted, and the
report's plots are logged as images once the report is written at shutdown. The
evaluator's eval.jsonl likewise: each evaluation's numbers under eval/<split>/<field>
against eval/step, once each over a restart, a bad line skipped with a warning."""

from __future__ import annotations

import json
import math
import random
import sqlite3
import struct
from functools import partial
from pathlib import Path

import msgspec
import pytest
import structlog.testing
import trio

from fleetrl.actors.tracker import TrackerState
from fleetrl.actors.tracker.backends import EvalRows
from fleetrl.actors.tracker.scalars import Evaluation, eval_scalars_of, scalars_of
from fleetrl.actors.tracker.tail import read_new_lines, read_new_rows
from fleetrl.daemon.checkpoint import CheckpointStore
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
    assert read_new_lines(f, 0)[0] == [(0, {"step": 1}), (len(b'{"step": 1}\nnot json\n[1]\n'), {"step": 2})]


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


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory) -> Path:
    """trackio reads its directory once per process: the trackio tests share one (a
    project each), the tracker's ``dir``."""
    return tmp_path_factory.mktemp("trackio")


def _trackio_history(db: Path) -> list[dict]:
    with sqlite3.connect(db) as c:
        return [dict(json.loads(m), _step=s) for s, m in c.execute("select step, metrics from metrics order by id")]


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
async def test_the_trackers_hold_metrics_jsonl_s_scalars_and_the_report_s_plots(tmp_path, tracker, trackio_dir):
    state_dir = tmp_path / "state"
    metrics = state_dir / "actors" / "trainer" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    first, later = _rows(5), _rows(4, start=6)
    _append(metrics, first)
    state = StateDir(state_dir).open()
    where = trackio_dir if tracker == "trackio" else "tracker"
    sup = Supervisor(load_config_text(f"""
[daemon]
grace_s = 60.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
[actors.tracker]
factory = "fleetrl.actors.tracker:run"
[actors.tracker.config]
tracker = "{tracker}"
dir = "{where}"
project = "frl-test"
report_dir = "report"
poll_s = 0.2
report_wait_s = 30.0
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
        history = _trackio_history(trackio_dir / "frl-test.db")
    by_step = {h["_step"]: h for h in history}
    for row in first + later:
        got = {k: v for k, v in by_step[row["step"]].items() if not k.startswith("_")}
        want = scalars_of(row)
        assert got.keys() == want.keys(), (row["step"], got.keys() ^ want.keys())
        assert all(math.isclose(got[k], want[k], rel_tol=1e-12) for k in want), (got, want)
    images = {"/".join(k.split("/")[:2]) for h in history for k in h if k.startswith("report/")}  # W&B: fields
    assert images == {"report/learning"}
    assert any(k.startswith("report/") for k in by_step[10])  # at the step after the last row


EVAL = {"version": 3, "step": 2, "split": "fresh", "n": 4, "passed": 1, "pass_at_1": 0.25, "ci_low": 0.0456,
        "ci_high": 0.6994, "mean_reward": 0.4375, "time": 1.7e9, "rewards": [1.0, 0.5, 0.25, 0.0],
        "tool_calls": [0, 2, 1, 0]}


def _want_eval(line: dict) -> dict:
    """What a tracker should hold for one eval.jsonl line, written out by hand."""
    s = line["split"]
    want = {"eval/step": line["step"], "eval/version": line["version"],
            **{f"eval/{s}/{k}": line[k] for k in ("n", "passed", "pass_at_1", "ci_low", "ci_high", "mean_reward")}}
    if line["tool_calls"]:
        want[f"eval/{s}/tool_use"] = sum(c > 0 for c in line["tool_calls"]) / len(line["tool_calls"])
    return want


def test_an_evaluation_is_logged_under_eval_split_field_against_its_trainer_step():
    ev = eval_scalars_of(EVAL)
    assert ev == Evaluation(3, 2, "fresh", _want_eval(EVAL)) and ev.scalars["eval/fresh/tool_use"] == 0.5
    assert "eval/fresh/tool_use" not in eval_scalars_of(dict(EVAL, tool_calls=[])).scalars
    assert eval_scalars_of(dict(EVAL, version=None)) == "version None is not an integer"
    assert eval_scalars_of(dict(EVAL, step=True)) == "step True is not an integer"
    assert eval_scalars_of({k: v for k, v in EVAL.items() if k != "split"}) == "split None is not a name"


def test_a_checkpoint_with_only_the_metrics_offset_still_restores():
    assert msgspec.convert({"offset": 12}, TrackerState) == TrackerState(offset=12, eval_offset=0)
    old = msgspec.msgpack.encode({"offset": 12})
    assert msgspec.msgpack.decode(old, type=TrackerState) == TrackerState(offset=12, eval_offset=0)


def _ev(version: int, split: str) -> Evaluation:
    return Evaluation(version, version, split, {f"eval/{split}/pass_at_1": version / 10, "eval/step": version})


def test_w_and_b_rows_carry_one_evaluation_each_and_the_rest_waits():
    rows = EvalRows()
    assert rows.add(_ev(0, "fresh")) == {} and len(rows.queue) == 1  # no row yet
    assert rows.new_row(5, {"loss": 1.0}) == {"loss": 1.0, **_ev(0, "fresh").scalars}
    assert rows.add(_ev(0, "general")) == _ev(0, "general").scalars  # the same evaluation: joins row 5
    assert rows.add(_ev(2, "fresh")) == {} and rows.add(_ev(2, "general")) == {}  # row 5 holds version 0
    assert rows.new_row(6, {"loss": 2.0}) == {"loss": 2.0, **_ev(2, "fresh").scalars, **_ev(2, "general").scalars}
    for ev in (_ev(4, "fresh"), _ev(4, "fresh"), _ev(6, "fresh")):  # version 4 evaluated twice
        rows.add(ev)
    assert [rows.new_row(s, {}) for s in (7, 8, 9)] == [_ev(4, "fresh").scalars, _ev(4, "fresh").scalars,
                                                       _ev(6, "fresh").scalars]
    assert not rows.queue and rows.step == 9


def _eval_lines(at: list[tuple[int, int]], seed: int, tools: bool = False) -> list[dict]:
    """eval.jsonl lines as the evaluator writes them, for each (version, step), fresh then general."""
    from fleetrl.actors.evaluator.records import make_record

    rng = random.Random(seed)
    out = []
    for version, step in at:
        for split in ("fresh", "general"):
            rewards = [rng.choice([0.0, 0.5, 1.0]) for _ in range(9)]
            calls = [rng.randrange(3) for _ in rewards] if tools else ()
            rec = make_record(version=version, step=step, split=split, rewards=rewards, time=1.7e9 + version,
                              tool_calls=calls)
            out.append(json.loads(msgspec.json.encode(rec)))
    return out


def _held_evals(history: list[dict]) -> list[tuple[int, dict]]:
    """Each evaluation a tracker holds: (the row's step, its scalars with the axis)."""
    out = []
    for h in history:
        for split in sorted({k.split("/")[1] for k in h if k.startswith("eval/") and k.count("/") == 2}):
            out.append((h["_step"], {k: v for k, v in h.items()
                                     if k.startswith(f"eval/{split}/") or k in ("eval/step", "eval/version")}))
    return out


async def _run_daemon(state_dir: Path, tracker: str, trackio_dir: Path, until, then=None) -> object:
    """Run the daemon with a tracker actor until ``until(handle)``; ``then(handle, sup)``
    may append more and wait; then shut down. The tracker's handle."""
    state = StateDir(state_dir).open()
    where = trackio_dir if tracker == "trackio" else "tracker"
    sup = Supervisor(load_config_text(f"""
[daemon]
grace_s = 60.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
[actors.tracker]
factory = "fleetrl.actors.tracker:run"
config = {{tracker = "{tracker}", project = "frl-evals", poll_s = 0.2, dir = "{where}"}}
""", source="test.toml"), state, rng=random.Random(0))
    with state, trio.fail_after(120):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            handle = await sup.wait_handle("tracker")
            while not until(handle):
                await trio.sleep(0.1)
            if then is not None:
                await then(handle, sup)
            sup.request_shutdown("test")
    return handle


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
async def test_the_trackers_hold_eval_jsonl_s_evaluations_once_over_a_restart(tmp_path, tracker, trackio_dir):
    state_dir = tmp_path / "state"
    metrics = state_dir / "actors" / "trainer" / "metrics.jsonl"
    evals = state_dir / "actors" / "evaluator" / "eval.jsonl"
    metrics.parent.mkdir(parents=True)
    evals.parent.mkdir(parents=True)
    # versions a step ahead after version 0 (as after a trainer restart): the axis is the step
    first, torn, later, last = (_eval_lines([(0, 0), (3, 2)], seed=1), _eval_lines([(6, 5)], seed=2),
                                _eval_lines([(8, 7)], seed=3, tools=True), _eval_lines([(9, 8)], seed=4))
    _append(metrics, _rows(4))
    _append(evals, first)
    bad_at = evals.stat().st_size

    async def bad_lines_then_the_rest(handle, sup) -> None:
        with evals.open("a") as f:
            f.write('garbage\n{"split": "fresh", "pass_at_1": 1.0}\n' + json.dumps(torn[0])[:30])
        while handle.eval_skipped < 2:
            await trio.sleep(0.1)
        assert handle.evals == 4  # the half-written line waits for its end
        with evals.open("a") as f:
            f.write(json.dumps(torn[0])[30:] + "\n" + json.dumps(torn[1]) + "\n")
        _append(metrics, _rows(2, start=5))
        while handle.evals < 6 or handle.rows < 6:
            await trio.sleep(0.1)

    with structlog.testing.capture_logs() as logs:
        handle = await _run_daemon(state_dir, tracker, trackio_dir, lambda h: h.evals >= 4 and h.rows >= 4,
                                   bad_lines_then_the_rest)
    assert handle.evals == 6 and handle.eval_skipped == 2 and handle.statistics().queued_evals == 0
    skipped = [e["problem"] for e in logs if e["event"] == "eval line skipped"]
    assert len(skipped) == 2 and all(str(evals) in p for p in skipped), skipped
    assert f"line at byte {bad_at} is not JSON" in skipped[0]
    assert f"line at byte {bad_at + len('garbage') + 1}: version None is not an integer" in skipped[1]
    # the restart: only what was appended since is logged (the bad lines are not read
    # again). The evaluation of step 8 comes after the last row: W&B holds it back until
    # finish, and a checkpoint taken meanwhile does not count it as logged.
    _append(evals, later)
    held_back_at = evals.stat().st_size
    _append(evals, last)
    _append(metrics, _rows(2, start=7))

    def saved() -> TrackerState:
        ckpt, _ = CheckpointStore(StateDir(state_dir).checkpoints).load_latest()
        assert ckpt is not None
        state = ckpt.actors["tracker"]
        return (msgspec.msgpack.decode(state, type=TrackerState) if isinstance(state, bytes)
                else msgspec.convert(state, TrackerState))

    async def checkpoint_with_one_held_back(handle, sup) -> None:
        assert handle.statistics().queued_evals == (2 if tracker == "wandb" else 0)
        await sup.checkpoint("test")
        assert saved() == TrackerState(offset=metrics.stat().st_size,
                                       eval_offset=held_back_at if tracker == "wandb" else evals.stat().st_size)

    handle = await _run_daemon(state_dir, tracker, trackio_dir, lambda h: h.evals >= 4 and h.rows >= 2,
                               checkpoint_with_one_held_back)
    assert handle.evals == 4 and handle.eval_skipped == 0 and handle.skipped == 0
    assert handle.statistics().queued_evals == 0
    assert saved() == TrackerState(offset=metrics.stat().st_size, eval_offset=evals.stat().st_size)

    if tracker == "wandb":
        run_dirs = sorted((state_dir / "tracker" / "wandb").glob("offline-run-*"))
        history = [h for d in run_dirs for h in _wandb_history(d)]  # offline: one directory per incarnation
    else:
        history = _trackio_history(trackio_dir / "frl-evals.db")

    def key(h: dict) -> tuple[int, int, str]:
        (split,) = {k.split("/")[1] for k in h if k.count("/") == 2}
        return h["eval/version"], h["eval/step"], split

    held = sorted(_held_evals(history), key=lambda x: key(x[1]))
    lines = sorted(first + torn + later + last, key=lambda x: (x["version"], x["step"], x["split"]))
    assert [key(h) for _, h in held] == [(x["version"], x["step"], x["split"]) for x in lines]  # each once
    for (row_step, got), line in zip(held, lines):
        want = _want_eval(line)
        assert got.keys() == want.keys(), (key(got), got.keys() ^ want.keys())
        assert all(math.isclose(got[k], want[k], rel_tol=1e-12) for k in want), (got, want)
        if tracker == "trackio":
            assert row_step == line["step"]  # on the trainer's step axis itself
