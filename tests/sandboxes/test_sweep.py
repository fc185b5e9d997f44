"""Ownership and the orphan sweep on real Docker, with a real daemon process killed by
SIGKILL: its 8 leased sandboxes are swept by the next daemon; a live daemon's
containers are spared; containers without our labels are never touched."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest
import trio

from fleetrl.sandboxes import Ownership, SandboxMetrics, start_sandbox, state_hash, sweep, sweep_blocking
from fleetrl.sandboxes.sweep import LABEL_OWNER, LABEL_STATE

pytestmark = pytest.mark.docker

FAKE_DAEMON = Path(__file__).with_name("fake_daemon.py")


async def _read_ready(proc: subprocess.Popen) -> list[str]:
    line = await trio.to_thread.run_sync(proc.stdout.readline)
    assert line.startswith("READY "), f"fake daemon said {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
    return line.split()[1:]


async def test_sigkilled_daemon_is_swept_by_the_next_and_others_are_untouched(
    engine, image, ownership, state_dir, docker_client
):
    sh = ownership.state
    old_iid = f"{ownership.owner}-old"
    proc = subprocess.Popen(
        [sys.executable, str(FAKE_DAEMON), str(state_dir), old_iid, "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    foreign = None
    try:
        with trio.fail_after(120):
            leased = await _read_ready(proc)
            assert len(leased) == 8
            ours = docker_client.containers.list(all=True, filters={"label": f"{LABEL_STATE}={sh}"})
            assert {c.id for c in ours} == set(leased)
            assert all(c.labels[LABEL_OWNER] == old_iid for c in ours)

            # An orphan of an even older daemon of the same state dir, found while the daemon lives:
            # the CLI sweep removes it and spares the live daemon's 8.
            stale = await start_sandbox(
                engine, image=image, ownership=Ownership(owner=f"{ownership.owner}-stale", run="r", state=sh)
            )
            report = await trio.to_thread.run_sync(lambda: sweep_blocking(state_dir, client=docker_client))
            assert report.live_owner == old_iid
            assert report.removed == (stale.id[:12],)
            assert set(report.spared) == {c[:12] for c in leased}
            await stale.aclose()

            proc.send_signal(signal.SIGKILL)
            await trio.to_thread.run_sync(proc.wait)
            assert proc.returncode == -signal.SIGKILL
            # The 8 outlive their daemon...
            assert len(docker_client.containers.list(filters={"label": f"{LABEL_STATE}={sh}"})) == 8

            # ...and a container without our labels, which the sweep must never touch.
            foreign = docker_client.containers.run(image, ["sleep", "600"], detach=True, network_mode="none")

            # The next daemon starts: takes the (now free) lock, writes instance.json, sweeps.
            lock = os.open(state_dir / "daemon.lock", os.O_RDWR)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                new_iid = f"{ownership.owner}-new"
                (state_dir / "instance.json").write_text(json.dumps({"instance_id": new_iid, "pid": os.getpid(), "started_at": time.time()}))
                metrics = SandboxMetrics()
                report = await sweep(state_dir, current_instance_id=new_iid, client=docker_client, metrics=metrics)
            finally:
                os.close(lock)
            assert len(report.removed) == 8 and not report.spared and not report.errors
            assert set(report.removed) == {c[:12] for c in leased}
            assert (metrics.sweeps, metrics.swept) == (1, 8)
            assert docker_client.containers.list(all=True, filters={"label": f"{LABEL_STATE}={sh}"}) == []
            foreign.reload()
            assert foreign.status == "running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        if foreign is not None:
            foreign.remove(force=True)
        for c in docker_client.containers.list(all=True, filters={"label": f"{LABEL_STATE}={sh}"}):
            c.remove(force=True)


async def test_sweep_without_a_live_daemon_removes_all_of_its_state_only(engine, image, ownership, tmp_path, docker_client):
    other_state = tmp_path / "other"
    other_state.mkdir()
    other = Ownership.for_state_dir(other_state, owner=ownership.owner, run="r")
    with trio.fail_after(60):
        a = await start_sandbox(engine, image=image, ownership=ownership)
        b = await start_sandbox(engine, image=image, ownership=other)
        try:
            report = await sweep(ownership_state_dir(ownership, tmp_path), client=docker_client)
            assert report.live_owner is None and report.removed == (a.id[:12],)
            with pytest.raises(docker.errors.NotFound):
                docker_client.containers.get(a.id)
            assert docker_client.containers.get(b.id).status == "running"  # another state dir: untouched
        finally:
            await a.aclose()
            await b.aclose()


def ownership_state_dir(ownership, tmp_path) -> Path:
    d = tmp_path / "state"  # the conftest's state_dir
    assert ownership.state == state_hash(d)
    return d


async def test_a_live_daemon_whose_instance_file_is_unreadable_is_spared(engine, image, ownership, state_dir, docker_client):
    with trio.fail_after(60):
        sb = await start_sandbox(engine, image=image, ownership=ownership)
        lock = os.open(state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (state_dir / "instance.json").write_text("{not json")
            # the CLI sweep runs in another process (a flock is per open file, not per process)
            out = await trio.to_thread.run_sync(
                lambda: subprocess.run(
                    [sys.executable, "-m", "fleetrl.sandboxes.cli", "sweep", "--state-dir", str(state_dir)],
                    capture_output=True, text=True, timeout=60,
                )
            )
            report = json.loads(out.stdout)
            assert out.returncode == 0 and report["removed"] == [] and len(report["spared"]) == 1
            assert docker_client.containers.get(sb.id).status == "running"
        finally:
            os.close(lock)
            await sb.aclose()
