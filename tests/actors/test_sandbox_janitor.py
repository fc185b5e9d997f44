"""The sandbox janitor under a real `fleetrl serve`: orphans of a killed daemon are swept
at start, containers of other owners' state directories and unlabelled ones are spared."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest

from fleetrl.sandboxes.sweep import state_hash

pytestmark = pytest.mark.docker

IMAGE = "fleetrl-sandbox:py311"

CONFIG = """
[daemon]
grace_s = 10
[logging]
format = "json"
[actors.janitor]
factory = "fleetrl.actors.sandbox_janitor:run"
"""


def _start(client, labels: dict[str, str]) -> str:
    c = client.containers.run(IMAGE, ["sleep", "infinity"], detach=True, labels=labels,
                              network_mode="none", auto_remove=False)
    return c.id


def _exists(client, cid: str) -> bool:
    try:
        client.containers.get(cid)
        return True
    except docker.errors.NotFound:
        return False


def test_daemon_start_sweeps_orphans_of_its_state_dir_only(tmp_path: Path) -> None:
    client = docker.from_env()
    state = tmp_path / "state"
    state.mkdir()
    other_state = tmp_path / "other"
    other_state.mkdir()
    mine = {"fleetrl.owner": "dead-daemon", "fleetrl.run": "r", "fleetrl.state": state_hash(state),
            "fleetrl.created": str(int(time.time()))}
    theirs = dict(mine, **{"fleetrl.state": state_hash(other_state)})
    orphans = [_start(client, mine) for _ in range(2)]
    spared = [_start(client, theirs), _start(client, {"purpose": "not-fleetrl"})]
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    stderr = (tmp_path / "stderr.txt").open("w+")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "fleetrl"), "serve", "--config", str(config),
         "--state-dir", str(state)],
        stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + 60
        while any(_exists(client, c) for c in orphans):
            assert proc.poll() is None, f"daemon exited {proc.returncode}: {(tmp_path / 'stderr.txt').read_text()}"
            assert time.monotonic() < deadline, "orphans were not swept within 60 s"
            time.sleep(0.2)
        assert all(_exists(client, c) for c in spared)
        log = state / "logs" / "daemon.jsonl"
        deadline = time.monotonic() + 30
        sweeps: list[dict] = []
        while not sweeps:
            assert time.monotonic() < deadline, "no sweep log line"
            if log.exists():
                sweeps = [e for e in map(json.loads, log.read_text().splitlines())
                          if e.get("event") == "sandbox sweep"]
            time.sleep(0.1)
        assert sweeps[0]["removed"] == 2 and sweeps[0]["when"] == "start"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
        for cid in orphans + spared:
            if _exists(client, cid):
                client.containers.get(cid).remove(force=True)
        client.close()
