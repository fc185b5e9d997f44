"""The sandbox reaper (sandboxes/reaper.py) on real Docker: when the pipe from its owner
closes it sweeps the owner's state directory: a SIGKILLed owner's containers are
removed; the containers of a live owner of the lock (a restarted process) are spared."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from fleetrl.sandboxes import state_hash
from fleetrl.sandboxes.reaper import start_reaper

pytestmark = pytest.mark.docker

FAKE_DAEMON = Path(__file__).with_name("fake_daemon.py")


def _labelled(state_dir: Path) -> list[str]:
    return subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state_dir)}"],
                          check=True, capture_output=True, text=True).stdout.split()


def _owner(state_dir: Path, iid: str, n: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(FAKE_DAEMON), str(state_dir), iid, str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("READY "), proc.stderr.read() if proc.poll() is not None else line
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


async def _gone(state_dir: Path, timeout_s: float = 60.0) -> None:
    with trio.fail_after(timeout_s):
        while _labelled(state_dir):
            await trio.sleep(0.2)


async def test_the_reaper_sweeps_a_killed_owner_s_containers_and_spares_a_live_one(state_dir, image):
    killed = await trio.to_thread.run_sync(_owner, state_dir, "owner-killed", 2)
    reaper = start_reaper(state_dir)
    try:
        assert len(_labelled(state_dir)) == 2
        _kill(killed)
        assert len(_labelled(state_dir)) == 2  # nothing else removes them
        reaper.stdin.close()  # what the owner's death does to the pipe
        assert await trio.to_thread.run_sync(reaper.wait, 60) == 0
        await _gone(state_dir)

        # a live owner holds the lock when the pipe closes: its containers stay
        live = await trio.to_thread.run_sync(_owner, state_dir, "owner-live", 1)
        second = start_reaper(state_dir)
        second.stdin.close()
        assert await trio.to_thread.run_sync(second.wait, 60) == 0
        assert len(_labelled(state_dir)) == 1
        _kill(live)
        third = start_reaper(state_dir)
        third.stdin.close()
        assert await trio.to_thread.run_sync(third.wait, 60) == 0
        await _gone(state_dir)
    finally:
        for c in _labelled(state_dir):
            subprocess.run(["docker", "rm", "-f", c], capture_output=True)
        if reaper.poll() is None:
            reaper.kill()


def test_the_reaper_needs_its_state_directory():
    out = subprocess.run([sys.executable, "-m", "fleetrl.sandboxes.reaper"], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr
