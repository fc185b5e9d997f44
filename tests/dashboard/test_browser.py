"""The dashboard as a person sees it, in headless Chromium (Debian's package) against a
running daemon: a sampler pool of three torch samplers (fp32, bf16, fp8) following a fake
trainer's weight versions, which also writes metrics and held-out results, and the remote
workers actor with one worker joined by hand. Without the token the page shows the log-in
form and no data; after logging in the charts fill and change as training goes on, the
fleet table lists the three samplers at the versions the pool holds, the environment
workers table the remote worker holding its task, and the events list shows the run's
warnings; screenshots are taken."""

from __future__ import annotations

import io
import random
from functools import partial

import pytest
import trio
from browser import chromium

from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.credentials import CredentialStore
from fleetrl.daemon.logs import close_logging, configure_logging
from fleetrl.daemon.state import StateDir, read_control
from fleetrl.daemon.supervisor import Supervisor

pytestmark = pytest.mark.slow

VERSIONS = 6


def _config(tmp_path, model_dir) -> str:
    weights = tmp_path / "weights"
    samplers = "".join(f"""
[[actors.pool.config.samplers]]
id = "torch-{d}"
model_dir = "{model_dir}"
dtype = "{d}"
capacity = 2
price_per_hour = {p}
""" for d, p in (("fp32", 0.4), ("bf16", 0.2), ("fp8", 0.1)))
    return f"""
[daemon]
grace_s = 30.0
checkpoint_interval_s = 1000.0
[http]
enabled = true
host = "127.0.0.1"
port = 0
[actors.ui]
factory = "fleetrl.actors.dashboard:run"
config = {{refresh_s = 0.3}}
[actors.trainer]
factory = "dashboard_test_actors:trainer"
config = {{model_dir = "{model_dir}", weights_dir = "{weights}", versions = {VERSIONS}, every_s = 0.8}}
[actors.pool]
factory = "fleetrl.actors.pool:run"
after = ["trainer"]
[actors.pool.config]
weights_dir = "{weights}"
join = false
max_staleness = 100
{samplers}
[actors.remote]
factory = "fleetrl.actors.workers:run"
after = ["pool"]
[actors.remote.config]
target = "trainer"
model = {{kind = "pool", tokenizer_dir = "{model_dir}", pacing = false}}
harness = "fleetrl.harness.builtin:CompletionHarness"
tasks = {{kind = "synthetic", seed = 1}}
group_size = 2
heartbeat_s = 0.5
heartbeat_timeout_s = 5.0
sandbox = {{max_warm = 2, max_containers = 4}}
"""


PIXELS = """(() => { const c = document.getElementById(ID); const d = c.getContext('2d')
    .getImageData(0, 0, c.width, c.height).data; let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++;
    return n; })()"""


async def test_a_person_logs_in_and_watches_the_run(tmp_path, tiny_model_dir, actors_module):
    test_actors = actors_module("dashboard_test_actors")
    state = StateDir(tmp_path / "state").open()
    _, worker_token = CredentialStore(state.path).create("worker")
    peer = trio.CancelScope()

    async def by_hand(url: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with peer:
            await test_actors.by_hand_worker(url, worker_token, task_status=task_status)
    # the daemon's log file, as `fleetrl serve` writes it: the events list reads it
    configure_logging(level="info", fmt="json", run_id=state.run_id, log_dir=state.logs, stream=io.StringIO(),
                      console="none")
    sup = Supervisor(load_config_text(_config(tmp_path, tiny_model_dir), source="test.toml"), state,
                     rng=random.Random(0))
    shots = tmp_path / "shots"
    shots.mkdir()
    with state, trio.fail_after(240):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await sup.wait_handle("pool")
            await sup.wait_handle("remote")
            _, port = read_control(state.path)
            wid = await n.start(by_hand, f"ws://127.0.0.1:{port}/workers/join")
            async with chromium(tmp_path / "chromium") as page:
                await page.goto(f"http://127.0.0.1:{port}/ui")  # no slash: the page adds it
                await page.wait_for("document.body.dataset.state === 'login'")
                assert await page.eval("location.pathname") == "/ui/"
                assert await page.eval("document.getElementById('dashboard').hidden") is True
                assert await page.eval("document.getElementById('cards').children.length") == 0  # no data
                await page.screenshot(shots / "login.png")
                # a wrong token: the form says so, still no data
                await page.eval("document.getElementById('token').value = 'nope';"
                                "document.getElementById('login-form').requestSubmit()")
                await page.wait_for("!document.getElementById('login-error').hidden")
                await page.eval(f"document.getElementById('token').value = {state.token!r};"
                                "document.getElementById('login-form').requestSubmit()")
                await page.wait_for("document.body.dataset.state === 'live' && +document.body.dataset.updates >= 2")
                first = await page.eval("document.getElementById('chart-reward_mean').toDataURL()")
                # the charts change while training goes on
                await page.wait_for(f"document.getElementById('chart-reward_mean').toDataURL() !== {first!r}", 60)
                try:
                    await page.wait_for(f"(() => {{ const s = [...document.querySelectorAll('#fleet tbody tr')]"
                                        f".map(r => +r.cells[4].textContent); return s.length === 3 && "
                                        f"s.every(v => v === {VERSIONS}); }})()", 60)
                except trio.TooSlowError:
                    raise AssertionError(await page.eval("document.getElementById('fleet').outerHTML")
                                         + repr(sup.status()["actors"]["pool"]["statistics"])) from None
                table = await page.eval("[...document.querySelectorAll('#fleet tbody tr')]"
                                        ".map(r => [...r.cells].map(c => c.textContent))")
                status = sup.status()["actors"]["pool"]["statistics"]["samplers"]
                held = {r["sampler"]: r["version"] for r in status}  # what /status says
                assert {row[0]: int(row[4]) for row in table} == held == {
                    "torch-bf16": VERSIONS, "torch-fp32": VERSIONS, "torch-fp8": VERSIONS}
                assert {row[3] for row in table} == {"float32", "bfloat16", "float8_e4m3fn"}
                assert all(row[10] == "up" for row in table)
                # the environment workers table: the remote worker, up, holding the task it was given
                try:
                    await page.wait_for(f"[...document.querySelectorAll('#workers tbody tr')].some(r => "
                                        f"r.cells[0].textContent === {wid!r} && r.cells[4].textContent === '1' "
                                        f"&& r.cells[9].textContent === 'up')", 60)
                except trio.TooSlowError:
                    raise AssertionError(await page.eval("document.getElementById('workers').outerHTML")
                                         + repr(sup.status()["actors"]["remote"]["statistics"])) from None
                (worker,) = await page.eval("[...document.querySelectorAll('#workers tbody tr')]"
                                            ".map(r => [...r.cells].map(c => c.textContent))")
                assert worker[1] == "remote" and worker[2].startswith("by-hand (127.0.0.1:")
                assert worker[3] == "-" and worker[7] == "- / - / 4" and worker[8].endswith(" s ago")
                for chart in ("chart-pass", "chart-reward_mean", "chart-grad_norm", "chart-kl", "chart-delta_ratio",
                              "chart-staleness_mean", "chart-usd_per_rollout"):
                    drawn = await page.eval(PIXELS.replace("ID", repr(chart)))
                    assert drawn > 300, (chart, drawn)  # axes alone draw fewer
                # the page built its series from one snapshot and then ticks (the new steps
                # only): they are the series of the whole snapshot, point for point
                await page.wait_for("fetch('snapshot').then(r => r.json()).then(s => JSON.stringify(s.series) === "
                                    "JSON.stringify(window.fleetrlSeries))", 30)
                assert await page.eval("window.fleetrlSeries.steps.length") >= 3
                events = await page.eval("document.getElementById('events').textContent")
                assert "a warning the events list shows" in events
                png = await page.screenshot(shots / "dashboard.png")
                assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
                assert state.token not in await page.eval("document.documentElement.outerHTML")
            peer.cancel()  # it hangs up: its task is requeued and the drain does not wait for it
            sup.request_shutdown("test")
    close_logging()
    assert state.token not in (state.logs / "daemon.jsonl").read_text()  # never logged, in no URL either
