"""`fleetrl serve` as a real subprocess: signals, checkpoints, lock, CLI commands."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import read_jsonl, wait_until

from fleetrl.daemon.checkpoint import CheckpointStore

WORKER = """
[daemon]
grace_s = {grace}
checkpoint_interval_s = {interval}
[logging]
format = "json"
[actors.worker]
factory = "daemon_test_actors:worker"
config = {{unit_s = {unit}, hook_log = "{hook_log}", stubborn = {stubborn}}}
"""


class Daemon:
    """One `fleetrl serve` process and its state directory."""

    def __init__(self, tmp: Path, bin_: str, env: dict[str, str], *, grace: float = 20,
                 interval: float = 1000, unit: float = 0.3, stubborn: bool = False,
                 config: str | None = None) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        self.hook_log = tmp / "hooks.jsonl"
        self.config = tmp / "run.toml"
        self.config.write_text(config or WORKER.format(
            grace=grace, interval=interval, unit=unit, hook_log=self.hook_log,
            stubborn=str(stubborn).lower()))
        self.bin, self.env = bin_, env
        self.proc: subprocess.Popen[str] | None = None
        self._files: list = []

    def start(self) -> "Daemon":
        self.stderr = (self.tmp / f"stderr-{time.monotonic_ns()}.txt").open("w+")
        self._files.append(self.stderr)
        self.proc = subprocess.Popen(
            [self.bin, "serve", "--config", str(self.config), "--state-dir", str(self.state)],
            env=self.env, stdout=subprocess.DEVNULL, stderr=self.stderr, text=True)
        return self

    def logs(self) -> list[dict]:
        return read_jsonl(self.state / "logs" / "daemon.jsonl")

    def wait_for(self, pred, what: str, timeout: float = 180.0):
        return wait_until(pred, what, timeout, proc=self.proc, stderr=Path(self.stderr.name), interval=0.05)

    def wait_log(self, event: str, timeout: float = 180.0, **fields) -> dict:
        def find():
            for e in self.logs():
                if e.get("event") == event and all(e.get(k) == v for k, v in fields.items()):
                    return e
            return None
        return self.wait_for(find, f"log {event} {fields}", timeout)

    def err(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        return self.stderr.read()[-3000:]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for fh in self._files:
            fh.close()


@pytest.fixture
def daemons(tmp_path, fleetrl_bin, subprocess_env):
    made: list[Daemon] = []

    def make(**kw) -> Daemon:
        d = Daemon(tmp_path, fleetrl_bin, subprocess_env, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def latest_done(d: Daemon) -> int | None:
    ckpt, _ = CheckpointStore(d.state / "checkpoints").load_latest()
    return None if ckpt is None else ckpt.actors["worker"]["done"]


def test_sigterm_mid_work_drains_runs_hook_and_exits_0(daemons):
    d = daemons(unit=0.4).start()
    d.wait_log("unit begun", unit=3)
    d.signal(signal.SIGTERM)  # unit 3 is in flight
    assert d.wait() == 0, d.err()
    logs = d.logs()
    done = [e["done"] for e in logs if e["event"] == "unit done"]
    assert done[-1] >= 3  # the in-flight unit was finished, not dropped
    assert any(e["event"] == "worker drained" for e in logs)
    hooks = [json.loads(x) for x in d.hook_log.read_text().splitlines()]
    assert hooks[-1] == {"done": done[-1], "draining": True}
    assert latest_done(d) == done[-1]
    assert logs[-1]["event"] == "stopped cleanly"
    assert all("run_id" in e and "actor" in e for e in logs)
    assert not (d.state / "control.json").exists()


def test_sigkill_then_restart_resumes_from_last_checkpoint(daemons):
    d = daemons(interval=0.25, unit=0.1).start()
    d.wait_for(lambda: (latest_done(d) or 0) >= 3, "a checkpoint with done >= 3")
    d.signal(signal.SIGKILL)
    assert d.wait() == -signal.SIGKILL
    run_id = (d.state / "run_id").read_text()
    at_kill = latest_done(d)
    d.start()
    started = d.wait_log("worker started", restored_done=at_kill)
    assert started["run_id"] == run_id.strip()
    d.wait_log("unit done", done=at_kill + 1)
    d.signal(signal.SIGTERM)
    assert d.wait() == 0, d.err()
    assert latest_done(d) > at_kill


def test_second_daemon_on_same_state_dir_is_refused(daemons, tmp_path, fleetrl_bin,
                                                     subprocess_env):
    d = daemons().start()
    d.wait_log("daemon running")
    other = subprocess.run([fleetrl_bin, "serve", "--config", str(d.config), "--state-dir",
                            str(d.state)], env=subprocess_env, capture_output=True,
                           text=True, timeout=60)
    assert other.returncode == 3
    assert "is in use by another fleetrl daemon" in other.stderr
    assert f"pid {d.proc.pid}" in other.stderr
    d.signal(signal.SIGINT)
    assert d.wait() == 0, d.err()


def test_second_signal_forces_exit_4(daemons):
    d = daemons(stubborn=True, grace=60).start()
    d.wait_log("unit done", done=1)
    d.signal(signal.SIGTERM)
    d.wait_log("shutdown requested")
    d.signal(signal.SIGTERM)
    assert d.wait(timeout=60) == 4, d.err()
    assert any(e["event"] == "forced exit" for e in d.logs())


def test_status_and_stop_commands(daemons, fleetrl_bin, subprocess_env):
    d = daemons().start()
    d.wait_log("daemon running")
    table = subprocess.run([fleetrl_bin, "status", "--state-dir", str(d.state)],
                           env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    first, header, *rows = table.stdout.splitlines()
    assert first.startswith("run ") and header.split()[:2] == ["ACTOR", "STATE"]
    assert any(r.split()[:2] == ["worker", "running"] for r in rows), table.stdout
    st = subprocess.run([fleetrl_bin, "status", "--json", "--state-dir", str(d.state)],
                        env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert st.returncode == 0, st.stderr
    body = json.loads(st.stdout)
    assert body["actors"]["worker"]["state"] == "running"
    assert body["run_id"] == (d.state / "run_id").read_text().strip()
    stop = subprocess.run([fleetrl_bin, "stop", "--state-dir", str(d.state)],
                          env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and stop.stdout.strip() == "stopped", stop.stderr
    assert d.wait(timeout=60) == 0
    gone = subprocess.run([fleetrl_bin, "status", "--state-dir", str(d.state)],
                          env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 5 and "no fleetrl daemon is running" in gone.stderr


def test_crash_loop_exits_1_naming_actor(daemons):
    d = daemons(config="""
[logging]
format = "json"
[actors.doomed]
factory = "daemon_test_actors:crasher"
config = {tag = "x"}
restart = {intensity = 2, backoff_base_s = 0.01, jitter = 0.0}
""").start()
    assert d.wait() == 1
    line = [e for e in d.logs() if e["event"] == "actor escalated"]
    assert line and line[0]["failed_actor"] == "doomed"
    assert line[0]["last_error"] == "RuntimeError: boom #3"
    assert "actor 'doomed' crashed 3 times" in d.err()
