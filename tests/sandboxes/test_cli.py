"""The `fleetrl sandbox` command group, run as real subprocesses (standalone main) and
through register() on an argparse parser as the fleetrl CLI does."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import trio

from fleetrl.sandboxes import start_sandbox
from fleetrl.sandboxes.cli import register

CLI = [sys.executable, "-m", "fleetrl.sandboxes.cli"]


async def run_cli(*args: str, timeout: float = 120, stdin: str | None = None) -> subprocess.CompletedProcess:
    return await trio.to_thread.run_sync(
        lambda: subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, input=stdin)
    )


def test_register_adds_the_group_with_every_command():
    parser = argparse.ArgumentParser(prog="fleetrl")
    parser.add_argument("--state-dir", default="/somewhere")  # a global flag of the fleetrl CLI
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sandbox", "run", "--timeout", "5", "--memory", "256m", "--", "echo", "hi"])
    assert args.cmd == ["--", "echo", "hi"] and args.timeout == 5.0 and callable(args.func)
    assert args.state_dir == "/somewhere" and args.sandbox_state_dir is None
    for cmd in (["build-image", "--include", "jq,curl"], ["ls", "--json"], ["sweep"], ["humaneval", "--solutions", "empty", "--batch-size", "4"]):
        assert callable(parser.parse_args(["sandbox", *cmd]).func)
    with pytest.raises(SystemExit):
        parser.parse_args(["sandbox", "humaneval", "--solutions", "best"])


@pytest.mark.docker
async def test_build_image_is_cached(image):
    with trio.fail_after(120):
        r = await run_cli("build-image")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["built"] is False and out["name"] == image and "up to date" in r.stderr


@pytest.mark.docker
async def test_run_prints_one_json_result(image, tmp_path, docker_client):
    with trio.fail_after(120):
        r = await run_cli("run", "--state-dir", str(tmp_path), "--timeout", "10", "--", "sh", "-c", "echo out; echo err >&2; exit 3")
        res = json.loads(r.stdout)
        assert r.returncode == 1
        assert (res["exit_code"], res["stdout"], res["stderr"], res["timed_out"]) == (3, "out\n", "err\n", False)
        assert {"stdout_truncated", "stderr_truncated", "duration_s"} <= set(res)
        r = await run_cli("run", "--state-dir", str(tmp_path), "--timeout", "1", "--", "sleep", "30")
        assert json.loads(r.stdout)["timed_out"] is True and r.returncode == 1
        r = await run_cli("run", "--state-dir", str(tmp_path), "--memory", "lots", "--", "true")
        assert r.returncode == 1 and "size 'lots'" in r.stderr
        r = await run_cli("run", "--state-dir", str(tmp_path), "--stdin", "--", "wc", "-c", stdin="12345")
        assert json.loads(r.stdout)["stdout"].strip() == "5" and r.returncode == 0
        r = await run_cli("run", "--", )
        assert r.returncode == 2
    # every run removed its container
    from fleetrl.sandboxes import state_hash

    assert docker_client.containers.list(all=True, filters={"label": f"fleetrl.state={state_hash(tmp_path)}"}) == []


@pytest.mark.docker
async def test_ls_and_sweep(engine, image, ownership, state_dir):
    with trio.fail_after(120):
        sb = await start_sandbox(engine, image=image, ownership=ownership)
        try:
            r = await run_cli("ls", "--json", "--state-dir", str(state_dir))
            rows = json.loads(r.stdout)
            assert [row["id"] for row in rows] == [sb.id[:12]]
            assert rows[0]["owner"] == ownership.owner and rows[0]["age_s"] >= 0 and rows[0]["status"] == "running"
            r = await run_cli("ls", "--state-dir", str(state_dir))
            assert r.stdout.splitlines()[0].split()[:3] == ["ID", "OWNER", "RUN"] and sb.id[:12] in r.stdout
            r = await run_cli("sweep", "--state-dir", str(state_dir))
            rep = json.loads(r.stdout)
            assert r.returncode == 0 and rep["removed"] == [sb.id[:12]] and rep["live_owner"] is None
            r = await run_cli("ls", "--json", "--state-dir", str(state_dir))
            assert json.loads(r.stdout) == []
        finally:
            await sb.aclose()


@pytest.mark.docker
async def test_humaneval_empty_solutions_report_failures(image, tmp_path):
    with trio.fail_after(180):
        r = await run_cli("humaneval", "--solutions", "empty", "--limit", "6", "--concurrency", "2", "--state-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["solutions"] == "empty" and summary["problems"] == 6
    assert summary["failed"] == 6 and summary["passed"] == 0 and len(summary["failed_ids"]) == 6
    assert "[6/6]" in r.stderr
    r = await run_cli("humaneval", "--batch-size", "0", "--state-dir", str(tmp_path))
    assert r.returncode == 2 and "--batch-size must be >= 1" in r.stderr
