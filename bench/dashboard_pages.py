"""Benchmark: does the dashboard slow the trainer when pages are open? The same shortened
embedded default run once per arm, each a real `fleetrl serve` on a fresh state directory:

1. ``none``: no page open (the baseline);
2. ``streams``: ``--pages`` plain HTTP clients (httpx, in this process) doing to the
   daemon what a page does: load the page and its script, log in (the form's POST, a
   session cookie each), hold ``/ui/events`` open reading every snapshot, GET
   ``/ui/rollouts`` every 5 s (the rollout browser's poll) and open a group
   (``/ui/rollouts/{n}``) every sixth poll: the daemon's serving cost without rendering;
3. ``browsers``: ``--pages`` real pages of one headless Chromium (Debian's package, driven
   over the DevTools protocol; each page in its own browser context, so each has its own
   cookies and its own connections, as separate browsers would: one profile allows only
   6 connections per host, and 8 event streams need 8), each logged in through the form,
   live, and clicking into a rollout group once. Background throttling is off, so every
   page renders every snapshot and polls the rollout list every 5 s.

The run (configs/tiny.toml derived as tests/e2e/tiny_config.py does): ``--groups`` 2
groups of ``--group-size`` 4 attempts per step, the pool's ``attempts_per_step`` to
match, ``max_steps = --steps`` (default 400) without the time budget, a held-out
evaluation of 8 fresh tasks at version 0 and the final one only, console logging off; the
warm start's cache (``--models``, default ``~/.cache/fleetrl/models``) is shared by the
arms, so the warm-up is built at most once. The dashboard runs as shipped (refresh 1 s).

Measured per arm: the trainer's steps/s by its own clock (``elapsed_s`` of
``<state>/actors/trainer/metrics.jsonl``) over the steady part, from step 5 % of the
steps (20 of 400) -- or from the step at which all the arm's pages were connected,
when later -- to the last (skipped steps take time but are not steps); the dashboard's
own ``refresh_ms`` and open event streams (``pages``), from ``/status`` every 2 s while the
trainer runs (proof that the pages were connected); what the clients saw (snapshots,
rollout lists, groups opened, errors); the CPU seconds the clients spent (this process's
for ``streams``, Chromium's process tree's for ``browsers``). The load stops after the
last step; the daemon then drains (final evaluation) and exits by itself
(``shutdown_when_done``), or is stopped after ``--exit-timeout`` s. No daemon or Chromium
process outlives the bench, whatever fails.

Prints a table, the ratios streams/none and browsers/none of steps/s (1.0: no slowdown),
then one JSON line.

Run: .venv/bin/python bench/dashboard_pages.py [--steps 400] [--pages 8] [--arms none,streams,browsers]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

from fleetrl.actors.runs.serve import MetricsTail, serve_command

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "common"))
from browser import Page, chromium_binary  # noqa: E402  (tests/common/browser.py: one tab over CDP)
from cpu import cpu_model  # noqa: E402  (bench/cpu.py)
from daemon_runs import killpg, stop_daemon, tiny_config  # noqa: E402  (bench/daemon_runs.py)

ARMS = ("none", "streams", "browsers")
POLL_S = 5.0
"""The rollout browser's poll of ``/ui/rollouts`` (actors/dashboard/static/rollouts.js)."""
GROUP_EVERY = 6
"""A streams client opens a group every this many polls (30 s)."""
SAMPLE_S = 2.0
"""How often ``/status`` is sampled for the dashboard's statistics."""


def say(line: str) -> None:
    print(f"[dashboard pages] {line}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    model = cpu_model()
    try:
        chromium = subprocess.run([chromium_binary(), "--version"], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        chromium = None
    return {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform(), "chromium": chromium,
            "load_before": round(os.getloadavg()[0], 2)}


# -- the run's config ------------------------------------------------------------------

def run_config(state: Path, models: Path, args: argparse.Namespace) -> str:
    return tiny_config().derive(state, {
        "logging": {"console": '"none"'},
        "actors.warm_start.config": {"cache_dir": json.dumps(str(models)), "progress": "false"},
        "actors.trainer.config": {"groups_per_step": str(args.groups), "max_steps": str(args.steps),
                                  "time_budget_s": None, "progress": "false"},
        "actors.pool.config": {"attempts_per_step": str(args.groups * args.group_size)},
        "actors.env.config": {"group_size": str(args.group_size)},
        "actors.evaluator.config": {"n": "8", "splits": '["fresh"]', "every_versions": "1000000",
                                    "progress": "false"},
    })


# -- processes ---------------------------------------------------------------------------

def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of the live processes of process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) == pgid:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- the load: plain HTTP clients ------------------------------------------------------------

@dataclass
class ClientStats:
    connected: bool = False
    events: int = 0
    last_seq: int = 0
    rollout_lists: int = 0
    groups_opened: int = 0
    errors: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(what)


async def stream_client(i: int, base: str, token: str, st: ClientStats) -> None:
    """What a page does to the daemon, without rendering (see the module docstring)."""
    timeout = httpx.Timeout(60.0, read=None)  # the event stream waits; no read timeout
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as c:
        for path in ("/ui/", "/ui/static/dashboard.css", "/ui/static/dashboard.js", "/ui/static/rollouts.js"):
            await c.get(path)
        await c.get("/ui/snapshot")  # the page's first question: a session? (401: the form)
        r = await c.post("/ui/login", data={"token": token})
        if r.status_code != 303:
            raise RuntimeError(f"client {i}: login answered {r.status_code}")

        async def events() -> None:
            while True:
                try:
                    async with c.stream("GET", "/ui/events") as resp:
                        if resp.status_code != 200:
                            st.error(f"events {resp.status_code}")
                        else:
                            async for line in resp.aiter_lines():
                                if line.startswith("data: "):
                                    st.last_seq = int(json.loads(line[6:]).get("seq", 0) or 0)
                                    st.events += 1
                                    st.connected = True
                except httpx.HTTPError as exc:
                    st.error(f"events: {type(exc).__name__}: {exc}")
                st.connected = False
                await trio.sleep(2.0)  # the stream's retry

        async def poll() -> None:
            await trio.sleep(POLL_S * i / 8)  # pages are not opened in the same instant
            k = 0
            while True:
                try:
                    r = await c.get("/ui/rollouts")
                    if r.status_code == 200:
                        st.rollout_lists += 1
                        groups = [g["n"] for g in r.json()["groups"] if g.get("n") is not None]
                        if groups and (st.groups_opened == 0 or k % GROUP_EVERY == 0):
                            g = await c.get(f"/ui/rollouts/{groups[(i + k) % len(groups)]}")
                            if g.status_code == 200:
                                st.groups_opened += 1
                            elif g.status_code != 404:  # 404: the log no longer keeps it
                                st.error(f"group {g.status_code}")
                    else:
                        st.error(f"rollouts {r.status_code}")
                except httpx.HTTPError as exc:
                    st.error(f"rollouts: {type(exc).__name__}: {exc}")
                k += 1
                await trio.sleep(POLL_S)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(events)
            nursery.start_soon(poll)


# -- the load: headless Chromium -------------------------------------------------------------

CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                  "--remote-debugging-port=0", "--disable-background-timer-throttling",
                  "--disable-backgrounding-occluded-windows", "--disable-renderer-backgrounding",
                  "--window-size=1400,1100"]

LOOK = ("({state: document.body.dataset.state, updates: +document.body.dataset.updates,"
        " rows: document.querySelectorAll('#groups tbody tr[data-n]').length,"
        " group: document.getElementById('group') ? document.getElementById('group').dataset.n || null : null,"
        " visible: document.visibilityState})")
CLICK = ("(() => { const r = document.querySelector('#groups tbody tr[data-n]'); if (!r) return null;"
         " r.click(); return +r.dataset.n; })()")


@dataclass
class PageStats:
    live: bool = False
    updates: int = 0
    state: str = ""
    visible: str = ""
    clicked: int | None = None
    group_shown: bool = False
    errors: list[str] = field(default_factory=list)


class Chromium:
    """One headless Chromium in its own process group, killed as a group on exit."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.proc: subprocess.Popen | None = None
        self.cpu_s = 0.0

    async def __aenter__(self) -> str:
        """The browser's DevTools WebSocket URL."""
        self.work.mkdir(parents=True, exist_ok=True)
        log = self.work / "chromium.log"
        with log.open("w") as err:
            self.proc = subprocess.Popen([chromium_binary(), *CHROMIUM_FLAGS, f"--user-data-dir={self.work / 'profile'}",
                                          "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=err, start_new_session=True)
        with trio.fail_after(120):
            while True:
                m = re.search(r"DevTools listening on (ws://\S+)", log.read_text(errors="replace"))
                if m:
                    return m.group(1)
                if self.proc.poll() is not None:
                    raise RuntimeError(f"chromium exited ({self.proc.returncode}): {log.read_text()[-2000:]}")
                await trio.sleep(0.1)

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is None:
            return
        self.cpu_s = group_cpu_s(self.proc.pid)
        killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for _ in range(50):  # renderers and helpers of the group
            if not _group_alive(self.proc.pid):
                break
            killpg(self.proc.pid, signal.SIGKILL)
            time.sleep(0.1)
        self.proc = None


async def drive_page(page: Page, base: str, token: str, st: PageStats) -> None:
    """Open the dashboard, log in through the form, stay live; click a group once."""
    try:
        await page.goto(f"{base}/ui/")
        await page.wait_for("document.body && document.body.dataset.state === 'login'", 120)
        await page.eval(f"document.getElementById('token').value = {token!r};"
                        "document.getElementById('login-form').requestSubmit()")
        await page.wait_for("document.body.dataset.state === 'live' && +document.body.dataset.updates >= 1", 120)
        st.live = True
        while True:
            look = await page.eval(LOOK)
            st.state, st.updates, st.visible = look["state"], look["updates"], look["visible"]
            if st.clicked is None and look["rows"] > 0:
                st.clicked = await page.eval(CLICK)
                if st.clicked is not None:
                    await page.wait_for(f"document.getElementById('group').dataset.n === '{st.clicked}'", 60)
                    st.group_shown = True
            await trio.sleep(2.0)
    except (RuntimeError, trio.TooSlowError, OSError, ConnectionClosed, HandshakeError) as exc:
        st.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        st.live = False


async def browsers_load(n: int, base: str, token: str, work: Path, stats: list[PageStats],
                        chrome: Chromium) -> None:
    browser_ws = await chrome.__aenter__()
    port = int(re.search(r":(\d+)/", browser_ws).group(1))  # type: ignore[union-attr]
    async with AsyncExitStack() as stack:
        browser = Page(await stack.enter_async_context(open_websocket_url(browser_ws, max_message_size=64 << 20)))
        pages = []
        for _ in range(n):  # a browser context each: own cookies, own connection pool
            ctx = (await browser.call("Target.createBrowserContext"))["browserContextId"]
            target = (await browser.call("Target.createTarget", url="about:blank", browserContextId=ctx,
                                         newWindow=True, width=1400, height=1100))["targetId"]
            ws = await stack.enter_async_context(open_websocket_url(
                f"ws://127.0.0.1:{port}/devtools/page/{target}", max_message_size=64 << 20))
            pages.append(Page(ws))
        async with trio.open_nursery() as nursery:
            for page, st in zip(pages, stats, strict=True):
                nursery.start_soon(drive_page, page, base, token, st)


# -- one arm ---------------------------------------------------------------------------------

def _steady(rows: list[dict[str, Any]], start: int) -> dict[str, Any]:
    """Steps/s by the trainer's clock between the trained step ``start`` (or the first
    after it) and the last one."""
    trained = [r for r in rows if not r.get("skipped")]
    out: dict[str, Any] = {"steps": max((int(r["step"]) for r in trained), default=0),
                           "skipped": sum(1 for r in rows if r.get("skipped")), "window": None,
                           "steps_per_s": None, "s_per_step": None}
    inside = [r for r in trained if int(r["step"]) >= start]
    if len(inside) >= 2:
        a, b = inside[0], inside[-1]
        dt = float(b["elapsed_s"]) - float(a["elapsed_s"])
        if dt > 0:
            n = int(b["step"]) - int(a["step"])
            out.update(window=[int(a["step"]), int(b["step"])], steps_per_s=n / dt, s_per_step=dt / n,
                       trainer_s=dt)
    if len(trained) >= 2:
        dt = float(trained[-1]["elapsed_s"]) - float(trained[0]["elapsed_s"])
        n = int(trained[-1]["step"]) - int(trained[0]["step"])
        out["steps_per_s_all"] = n / dt if dt > 0 else None
    return out


def _summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"samples": 0}
    s = sorted(values)
    return {"samples": len(s), "min": s[0], "median": statistics.median(s),
            "p95": s[min(len(s) - 1, round(0.95 * (len(s) - 1)))], "max": s[-1]}


async def run_arm(arm: str, args: argparse.Namespace, out: Path, models: Path) -> dict[str, Any]:
    work = out / arm
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    state = work / "state"
    cfg = work / "config.toml"
    cfg.write_text(f"# bench/dashboard_pages.py: arm {arm}\n" + run_config(state, models, args))
    metrics = state / "actors" / "trainer" / "metrics.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    say(f"{arm}: fleetrl serve --config {cfg} --state-dir {state}")
    t0 = time.monotonic()
    result: dict[str, Any] = {"arm": arm, "pages_opened": 0 if arm == "none" else args.pages}
    samples: list[tuple[int, int, float, int]] = []  # (trainer step, pages, refresh_ms, snapshots)
    clients = [ClientStats() for _ in range(args.pages)] if arm == "streams" else []
    pages = [PageStats() for _ in range(args.pages)] if arm == "browsers" else []
    chrome = Chromium(work / "chromium")
    tail = MetricsTail(metrics)
    step = 0
    connected_step: int | None = None
    last_step_at: float | None = None
    cpu0 = own_cpu_s()
    with (work / "serve.log").open("ab") as log:
        proc = subprocess.Popen(serve_command(cfg, state), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            with trio.move_on_after(args.timeout) as deadline:
                # the control plane, then the dashboard
                while not ((state / "control.json").exists() and (state / "token").exists()):
                    if proc.poll() is not None:
                        raise RuntimeError(f"{arm}: the daemon exited ({proc.returncode}) before serving; "
                                           f"see {work / 'serve.log'}")
                    await trio.sleep(0.2)
                from fleetrl.daemon.state import client_host, read_control, read_token

                host, port = read_control(state)
                base = f"http://{client_host(host)}:{port}"
                token = read_token(state)
                async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"},
                                             timeout=30.0) as api:
                    while True:
                        try:
                            if (await api.get("/ui/")).status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        if proc.poll() is not None:
                            raise RuntimeError(f"{arm}: the daemon exited ({proc.returncode}); see {work / 'serve.log'}")
                        await trio.sleep(0.2)
                    say(f"{arm}: dashboard up at {base}/ui/ after {time.monotonic() - t0:.0f} s")
                    async with trio.open_nursery() as nursery:
                        load = trio.CancelScope()

                        async def run_load() -> None:
                            with load:
                                async with trio.open_nursery() as n:
                                    if arm == "streams":
                                        for i, st in enumerate(clients):
                                            n.start_soon(stream_client, i, base, token, st)
                                    elif arm == "browsers":
                                        n.start_soon(browsers_load, args.pages, base, token, work, pages, chrome)

                        async def sample() -> None:
                            while True:
                                try:
                                    ui = (await api.get("/status")).json()["actors"]["ui"].get("statistics") or {}
                                    samples.append((step, int(ui.get("pages", 0)), float(ui.get("refresh_ms", 0.0)),
                                                    int(ui.get("snapshots", 0))))
                                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                                    pass
                                await trio.sleep(SAMPLE_S)

                        nursery.start_soon(run_load)
                        nursery.start_soon(sample)
                        while True:
                            done = proc.poll() is not None
                            for row, _ in tail.poll():
                                if not row.get("skipped"):
                                    step = max(step, int(row.get("step", 0) or 0))
                                    if step % 20 == 0:
                                        say(f"{arm}: step {step} at {time.monotonic() - t0:.0f} s")
                            if connected_step is None:
                                up = (sum(c.connected for c in clients) if arm == "streams"
                                      else sum(p.live for p in pages) if arm == "browsers" else 0)
                                if up >= result["pages_opened"]:
                                    connected_step = step
                                    if arm != "none":
                                        say(f"{arm}: all {up} pages connected at step {step}")
                            if step >= args.steps or done:
                                break
                            await trio.sleep(0.25)
                        last_step_at = time.monotonic()
                        nursery.cancel_scope.cancel()  # the load ends with the last step
                    if arm == "browsers":
                        chrome.close()
                    result["client_cpu_s"] = (own_cpu_s() - cpu0) + chrome.cpu_s
            result["timed_out"] = deadline.cancelled_caught
            if deadline.cancelled_caught:
                say(f"{arm}: timed out after {args.timeout:g} s at step {step}")
            chrome.close()
            # the daemon drains (final evaluation) and exits by itself
            try:
                code = await trio.to_thread.run_sync(lambda: proc.wait(args.exit_timeout))
                result["stopped"] = False
            except subprocess.TimeoutExpired:
                say(f"{arm}: still running {args.exit_timeout:g} s after the last step: stopping it")
                code = await trio.to_thread.run_sync(stop_daemon, proc, 120.0)
                result["stopped"] = True
        finally:
            chrome.close()
            if proc.poll() is None:
                stop_daemon(proc, 60.0)
            killpg(proc.pid, signal.SIGKILL)
    result.update(exit_code=code, wall_s=round(time.monotonic() - t0, 1),
                  exit_s=round(time.monotonic() - last_step_at, 1) if last_step_at is not None else None)
    rows = [row for row, _ in MetricsTail(metrics).poll()]
    start = max(1, round(0.05 * args.steps))  # 20 of 400
    result["window_from"] = start if connected_step is None else max(start, connected_step)
    result["all_connected_at_step"] = connected_step if arm != "none" else None
    result.update(_steady(rows, result["window_from"]))
    lo, hi = result["window"] or (result["window_from"], step)
    inside = [s for s in samples if lo <= s[0] <= hi] or samples
    result["pages"] = _summary([s[1] for s in inside])
    result["pages_max_run"] = max((s[1] for s in samples), default=0)
    result["refresh_ms"] = _summary([s[2] for s in inside])
    result["snapshots"] = max((s[3] for s in samples), default=0)
    if arm == "streams":
        result["clients"] = {"connected_at_last_step": sum(c.connected for c in clients),
                             "events": [c.events for c in clients],
                             "rollout_lists": sum(c.rollout_lists for c in clients),
                             "groups_opened": sum(c.groups_opened for c in clients),
                             "errors": [e for c in clients for e in c.errors][:20]}
    elif arm == "browsers":
        result["clients"] = {"live": sum(p.live for p in pages), "updates": [p.updates for p in pages],
                             "visible": sorted({p.visible for p in pages}),
                             "groups_clicked": sum(p.clicked is not None for p in pages),
                             "groups_shown": sum(p.group_shown for p in pages),
                             "errors": [e for p in pages for e in p.errors][:20]}
    ok = code == 0 and result["steps"] >= args.steps and not result["timed_out"]
    if not ok:
        result["error"] = f"exit {code}, {result['steps']} of {args.steps} steps; see {work / 'serve.log'}"
    return result


# -- report ----------------------------------------------------------------------------------

def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(result: dict[str, Any]) -> None:
    print(f"dashboard_pages: {result['steps']} steps, {result['pages']} pages; {result['machine']['cpu']}, "
          f"{result['machine']['cores']} cores")
    print(f"{'arm':9} {'steps/s':>8} {'s/step':>7} {'window':>10} {'pages min/med/max':>18} "
          f"{'refresh ms med/p95':>19} {'client CPU s':>12} {'exit':>5}")
    for name, a in result["arms"].items():
        p, r = a["pages"], a["refresh_ms"]
        pages = f"{_f(p.get('min'), 'g')}/{_f(p.get('median'), 'g')}/{_f(p.get('max'), 'g')}"
        refresh = f"{_f(r.get('median'), '.1f')}/{_f(r.get('p95'), '.1f')}"
        window = f"{a['window'][0]}-{a['window'][1]}" if a.get("window") else "-"
        print(f"{name:9} {_f(a.get('steps_per_s'), '.3f'):>8} {_f(a.get('s_per_step'), '.2f'):>7} {window:>10} "
              f"{pages:>18} {refresh:>19} {_f(a.get('client_cpu_s'), '.0f'):>12} {a['exit_code']!s:>5}")
    for name in ("streams", "browsers"):
        r = result[f"ratio_{name}"]
        if r is not None:
            print(f"steps/s {name} / none: {r:.3f} (1.0: the pages cost the trainer nothing)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400, help="the trainer's max_steps (default 400)")
    ap.add_argument("--pages", type=int, default=8, help="open pages in the streams and browsers arms (default 8)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of none,streams,browsers (default all)")
    ap.add_argument("--groups", type=int, default=2, help="groups per step (default 2)")
    ap.add_argument("--group-size", type=int, default=4, help="attempts per group (default 4)")
    ap.add_argument("--models", type=Path, default=Path.home() / ".cache" / "fleetrl" / "models",
                    help="the warm start's cache, shared by the arms (default ~/.cache/fleetrl/models)")
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a new one under /tmp)")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds per arm until the last step")
    ap.add_argument("--exit-timeout", type=float, default=600.0,
                    help="seconds to wait for the daemon's own exit after the last step, then SIGTERM")
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        ap.error(f"--arms: a comma-separated list of {', '.join(ARMS)}")
    args.arms = arms
    if args.steps < 2:
        ap.error("--steps must be at least 2")
    if args.pages < 1 or args.groups < 1 or args.group_size < 2:
        ap.error("--pages and --groups must be at least 1, --group-size at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = (args.out or Path(tempfile.mkdtemp(prefix="fleetrl-dashboard-pages-"))).absolute()
    out.mkdir(parents=True, exist_ok=True)
    models = args.models.expanduser().absolute()
    models.mkdir(parents=True, exist_ok=True)
    say(f"work directory {out}")
    result: dict[str, Any] = {"bench": "dashboard_pages", "steps": args.steps, "pages": args.pages,
                              "groups_per_step": args.groups, "group_size": args.group_size,
                              "arms": {}, "ratio_streams": None, "ratio_browsers": None, "machine": machine(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    failed = False
    for arm in args.arms:
        try:
            result["arms"][arm] = trio.run(run_arm, arm, args, out, models)
        except Exception as exc:  # noqa: BLE001  -- the other arms still run; the JSON says what failed
            say(f"{arm}: failed: {type(exc).__name__}: {exc}")
            result["arms"][arm] = {"arm": arm, "error": f"{type(exc).__name__}: {exc}", "exit_code": None,
                                   "pages": {"samples": 0}, "refresh_ms": {"samples": 0}}
        failed |= "error" in result["arms"][arm]
    base = result["arms"].get("none", {}).get("steps_per_s")
    for name in ("streams", "browsers"):
        x = result["arms"].get(name, {}).get("steps_per_s")
        result[f"ratio_{name}"] = x / base if x is not None and base else None
    result["machine"]["load_after"] = round(os.getloadavg()[0], 2)
    report(result)
    print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
