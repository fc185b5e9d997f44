"""The dashboard's routes on a real daemon (in-process, HTTP on 127.0.0.1): the page
holds no data; every data route answers 401 without a session; a wrong token does not
log in; the control token, sent once in a form body, gives an HttpOnly cookie that opens
/snapshot and the event stream, whose snapshots follow the trainer's metrics as they are
written; no URL carries the token; logging out ends the session."""

from __future__ import annotations

import json
import random
from functools import partial

import httpx
import trio

from fleetrl.actors.dashboard.snapshot import Series, eval_points, event_of, staleness_mean
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.state import StateDir, read_control
from fleetrl.daemon.supervisor import Supervisor

CONFIG = """
[daemon]
grace_s = 30.0
checkpoint_interval_s = 1000.0
[http]
enabled = true
host = "127.0.0.1"
port = 0
[actors.ui]
factory = "fleetrl.actors.dashboard:run"
config = {refresh_s = 0.2, pool = "nobody"}
"""


def test_series_evals_and_events_are_what_the_page_draws():
    s = Series(3)
    for step in (1, 2, 2, 3, 4):  # a repeated step is ignored
        s.add({"step": step, "reward_mean": step / 10, "staleness_hist": {"0": 1, "2": 1},
               "mismatch_kl_by_sampler": {"torch/bfloat16": 1e-6} if step >= 3 else {}})
    j = s.as_json()
    assert j["steps"] == [2, 3, 4] and j["reward_mean"] == [0.2, 0.3, 0.4] and j["staleness_mean"] == [1.0] * 3
    assert j["kl_by_sampler"] == {"torch/bfloat16": [None, 1e-6, 1e-6]}  # a kind that appears later
    assert staleness_mean({}) is None and staleness_mean({"x": 1}) is None
    rows = [{"split": "fresh", "version": 0, "pass_at_1": 0.3, "ci_low": 0.2, "ci_high": 0.4},
            {"split": "fresh", "version": 0, "pass_at_1": 0.31, "ci_low": 0.2, "ci_high": 0.4},
            {"split": "fresh", "version": 5, "pass_at_1": float("nan"), "ci_low": 0, "ci_high": 1}]
    assert eval_points(rows) == {"fresh": [{"version": 0, "pass_at_1": 0.31, "ci_low": 0.2, "ci_high": 0.4}]}
    assert event_of({"event": "tick", "level": "info"}) is None
    e = event_of({"event": "sampler lost", "level": "info", "actor": "pool", "sampler": "s1", "timestamp": "T",
                  "run_id": "r", "blob": "x" * 400})
    assert e == {"time": "T", "level": "info", "event": "sampler lost", "actor": "pool", "detail": {"sampler": "s1"}}


async def test_login_cookie_data_routes_and_the_live_stream(tmp_path):
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(load_config_text(CONFIG, source="test.toml"), state, rng=random.Random(0))
    metrics = state.path / "actors" / "trainer" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    with state, trio.fail_after(60):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await sup.wait_handle("ui")
            _, port = read_control(state.path)
            base = f"http://127.0.0.1:{port}/ui"
            async with httpx.AsyncClient() as c:
                assert (await c.get(base)).status_code in (200, 307)
                page = await c.get(base + "/")
                assert page.status_code == 200 and "login-form" in page.text and "run-" not in page.text
                assert (await c.get(base + "/static/dashboard.js")).status_code == 200
                assert (await c.get(base + "/static/..%2Ftoken")).status_code == 404
                for route in ("/snapshot", "/events"):
                    r = await c.get(base + route)
                    assert r.status_code == 401, route
                bad = await c.post(base + "/login", data={"token": "nope"})
                assert bad.status_code == 401 and "fleetrl_ui" not in bad.cookies
                ok = await c.post(base + "/login", data={"token": state.token}, follow_redirects=False)
                assert ok.status_code == 303
                cookie = ok.headers["set-cookie"]
                assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
                assert state.token not in cookie and state.token not in ok.headers.get("location", "")
                snap = (await c.get(base + "/snapshot")).json()
                assert snap["run"]["run_id"] == state.run_id and snap["series"]["steps"] == []
                seen: list[dict] = []
                cookies = dict(c.cookies)
                async with c.stream("GET", base + "/events") as stream:
                    assert stream.headers["content-type"].startswith("text/event-stream")
                    metrics.write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n"
                                               for s in (1, 2)))
                    logged_out = False
                    kind, steps, ticks, wrote = "", [], [], False
                    async for line in stream.aiter_lines():  # ends when the session does
                        if line.startswith("event: "):
                            kind = line[7:]
                        if line.startswith("data: "):
                            seen.append(json.loads(line[6:]))
                            new = seen[-1]["series"]["steps"]
                            # a snapshot holds the whole series, a tick only the steps after the last event's
                            steps = new if kind == "snapshot" else steps + new
                            if kind == "tick":
                                ticks.append(new)
                            if steps == [1, 2] and not wrote:
                                wrote = True
                                with metrics.open("a") as fh:
                                    fh.write(json.dumps({"step": 3, "reward_mean": 0.3}) + "\n")
                            if steps == [1, 2, 3] and not logged_out:
                                async with httpx.AsyncClient(cookies=cookies) as other:
                                    await other.post(base + "/logout")
                                logged_out = True
                assert logged_out and len(seen) >= 2 and seen[-1]["seq"] > seen[0]["seq"]
                assert [3] in ticks and all(t in ([], [1], [2], [1, 2], [3]) for t in ticks), ticks
                assert (await c.get(base + "/snapshot")).status_code == 401  # the session ended
            sup.request_shutdown("test")
    logged = (state.path / "logs" / "daemon.jsonl").read_text() if (state.path / "logs" / "daemon.jsonl").exists() \
        else ""
    assert state.token not in logged
