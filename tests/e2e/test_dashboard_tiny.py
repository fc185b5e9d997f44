"""The dashboard of a real `fleetrl serve` run of the embedded default (configs/tiny.toml,
shortened: 4 tasks x 4 attempts per step, a tighter correction band so that some tokens
are masked), watched in headless Chromium as a person would: without the token the page
is the log-in form and the data routes answer 401; logged in, the charts change while
training goes on, the fleet table lists the three samplers at the versions /status
holds, and the rollout browser opens a trained group: its attempts side by side with
their rewards, tokens shaded, the masked ones marked. Screenshots are taken (and copied
to ``FLEETRL_DOCS_SCREENSHOTS`` when set: that is how docs/images gets them)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest
import trio
from browser import chromium
from helpers import read_jsonl

from fleetrl.daemon.state import read_control

from .tiny_config import derive

pytestmark = [pytest.mark.docker, pytest.mark.slow]

FLEET = "[...document.querySelectorAll('#fleet tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
PIXELS = """(() => { const c = document.getElementById(ID); const d = c.getContext('2d')
    .getImageData(0, 0, c.width, c.height).data; let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++;
    return n; })()"""


def _config(state: Path, cache: Path) -> str:
    return derive(state, {
        "daemon": {"grace_s": "300.0", "checkpoint_interval_s": "1000.0"},
        "logging": {"console": '"none"'},
        "actors.warm_start.config": {"cache_dir": f'"{cache}"'},
        "actors.trainer.config": {"groups_per_step": "4", "max_steps": "1000", "progress": "false",
                                  "time_budget_s": None, "max_staleness": "1000",
                                  "corrections": '{ normalization = "token", mask_low = 0.97, mask_high = 1.03 }'},
        "actors.pool.config": {"attempts_per_step": "16"},
        "actors.env.config": {"group_size": "4", "max_concurrent_attempts": "8", "drain_grace_s": "20.0"},
        "actors.evaluator.config": {"n": "8", "every_versions": "3", "progress": "false", "splits": '["fresh"]'},
    })


async def _until(pred, what: str, daemon, timeout: float) -> None:
    with trio.move_on_after(timeout):
        while not pred():
            if daemon.proc.poll() is not None:
                raise AssertionError(f"{what}: the daemon exited: {daemon.err_path.read_text()[-3000:]}")
            await trio.sleep(0.5)
        return
    raise AssertionError(f"{what}: not within {timeout:g} s")


async def test_a_person_watches_a_tiny_run_and_opens_a_group(tmp_path, warm_cache, fleetrl_bin, daemons):
    state = tmp_path / "state"
    cfg = tmp_path / "tiny-test.toml"
    cfg.write_text(_config(state, warm_cache))
    daemon = daemons([fleetrl_bin, "serve", "--config", str(cfg), "--state-dir", str(state)], tmp_path, "serve")
    index = state / "actors" / "trainer" / "rollouts" / "index.jsonl"
    masked_groups = lambda: [x for x in read_jsonl(index) if x.get("kind") == "group" and x.get("masked")]  # noqa: E731
    # warm-up (cached), then steps of 4 groups: one with a masked token, and the charts' first points
    await _until(lambda: index.exists() and masked_groups(), "a trained group with masked tokens", daemon, 1500)
    _, port = read_control(state)
    token = (state / "token").read_text().strip()
    base = f"http://127.0.0.1:{port}"
    shots = tmp_path / "shots"
    shots.mkdir()
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as api:
        async with chromium(tmp_path / "chromium") as page:
            await page.goto(f"{base}/ui/")
            await page.wait_for("document.body.dataset.state === 'login'")
            assert await page.eval("document.getElementById('cards').children.length") == 0
            for route in ("snapshot", "rollouts", "rollouts/0"):  # the page's own requests, without a session
                assert await page.eval(f"fetch({route!r}).then(r => r.status)") == 401, route
            await page.eval(f"document.getElementById('token').value = {token!r};"
                            "document.getElementById('login-form').requestSubmit()")
            await page.wait_for("document.body.dataset.state === 'live' && +document.body.dataset.updates >= 2", 60)
            # the charts change while training goes on
            first = await page.eval("document.getElementById('chart-reward_mean').toDataURL()")
            await page.wait_for(f"document.getElementById('chart-reward_mean').toDataURL() !== {first!r}", 300)
            for chart in ("chart-reward_mean", "chart-grad_norm", "chart-kl", "chart-delta_ratio"):
                assert await page.eval(PIXELS.replace("ID", repr(chart))) > 300, chart
            # the fleet table's versions are those /status holds (read around the same moment)
            agreed = None
            with trio.move_on_after(120):
                while agreed is None:
                    table = await page.eval(FLEET)
                    status = (await api.get(f"{base}/status")).json()
                    held = {r["sampler"]: r["version"] for r in status["actors"]["pool"]["statistics"]["samplers"]}
                    if {row[0]: int(row[4]) for row in table} == held:
                        agreed = table
                    else:
                        await trio.sleep(0.3)
            assert agreed is not None, (await page.eval(FLEET), held)
            assert sorted(row[0] for row in agreed) == ["torch-bf16", "torch-fp32", "torch-fp8"]
            assert all(row[10] == "up" for row in agreed)
            # the environment worker and its sandboxes
            workers = await page.eval("[...document.querySelectorAll('#workers tbody tr')]"
                                      ".map(r => [...r.cells].map(c => c.textContent))")
            assert [w[0] for w in workers] == ["env"], workers
            assert int(workers[0][4]) >= 0 and workers[0][9] == "up" and workers[0][7].endswith("/ 8"), workers
            await page.screenshot(shots / "dashboard-tiny-run.png")
            # the rollout browser: follow a group with masked tokens
            await page.wait_for("document.querySelectorAll('#groups tbody tr[data-n]').length > 0", 60)
            n = await page.eval("(() => { const r = [...document.querySelectorAll('#groups tbody tr[data-n]')]"
                                ".find(r => +r.cells[6].textContent > 0); if (!r) return null; r.click();"
                                " return +r.dataset.n; })()")
            assert n is not None, await page.eval("document.getElementById('groups').outerHTML")
            await page.wait_for(f"document.getElementById('group').dataset.n === '{n}'", 30)
            entry = json.loads((index.parent / f"g-{n}.json").read_text())
            shown = await page.eval("[...document.querySelectorAll('#attempts .attempt')].map(a => +a.dataset.reward)")
            assert shown == [a["reward"] for a in entry["attempts"]] and len(shown) == 4
            masked = sum(len(c["masked"]) for a in entry["attempts"] for c in a["calls"])
            assert await page.eval("document.querySelectorAll('#attempts .tok.masked').length") == masked > 0
            tokens = sum(len(c["token_ids"]) for a in entry["attempts"] for c in a["calls"])
            assert await page.eval("document.querySelectorAll('#attempts .tok').length") == tokens
            title = await page.eval("document.getElementById('group-title').textContent")
            assert entry["group_id"] in title and entry["task_id"] in title
            box = await page.eval("(() => { const r = document.getElementById('rollouts').getBoundingClientRect();"
                                  " return [r.x + scrollX, r.y + scrollY, r.width, r.height]; })()")
            png = base64.b64decode((await page.call(
                "Page.captureScreenshot", format="png", captureBeyondViewport=True,
                clip=dict(zip(("x", "y", "width", "height"), box), scale=1)))["data"])
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
            (shots / "dashboard-rollouts.png").write_bytes(png)
            assert token not in await page.eval("document.documentElement.outerHTML")
    daemon.kill(signal.SIGTERM, timeout=600)
    assert token not in (state / "logs" / "daemon.jsonl").read_text()
    out = os.environ.get("FLEETRL_DOCS_SCREENSHOTS")
    if out:
        for shot in shots.iterdir():
            shutil.copy(shot, Path(out) / shot.name)
