"""One sandbox on the real Docker engine: exec, stdin/env/workdir, files, timeouts,
cancellation, bad input, and that the container is always removed."""

from __future__ import annotations

import docker
import pytest
import trio

from fleetrl.sandboxes import (
    Limits,
    SandboxError,
    SandboxGoneError,
    SandboxStartError,
    open_sandbox,
    start_sandbox,
)
from fleetrl.sandboxes.sweep import LABEL_CREATED, LABEL_OWNER, LABEL_RUN, LABEL_STATE

pytestmark = pytest.mark.docker


async def test_exec_argv_shell_stdin_env_workdir(engine, image, ownership, docker_client):
    with trio.fail_after(60):
        async with open_sandbox(engine, image=image, ownership=ownership) as sb:
            c = docker_client.containers.get(sb.id)
            assert c.labels[LABEL_OWNER] == ownership.owner
            assert c.labels[LABEL_RUN] == "test-run" and c.labels[LABEL_STATE] == ownership.state
            assert float(c.labels[LABEL_CREATED]) > 1.6e9
            r = await sb.exec(["python3", "-c", "import os,sys; print(os.getuid(), os.getcwd()); sys.exit(3)"])
            assert (r.exit_code, r.stdout, r.timed_out, r.ok) == (3, b"1000 /work\n", False, False)
            r = await sb.exec("cat; echo err >&2; echo $FOO", stdin=b"in-data\n", env={"FOO": "bar"})
            assert r.ok and r.stdout == b"in-data\nbar\n" and r.stderr == b"err\n"
            assert not r.stdout_truncated and r.stdout_bytes == len(r.stdout)
            r = await sb.exec("pwd", workdir="/tmp")
            assert r.stdout == b"/tmp\n"
            big = bytes(range(256)) * 4096  # 1 MiB of stdin, echoed back while still being written
            r = await sb.exec(["cat"], stdin=big)
            assert r.ok and r.stdout == big
        assert sb.closed
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(sb.id)


async def test_files_round_trip_and_path_checks(engine, image, ownership):
    with trio.fail_after(60):
        async with open_sandbox(engine, image=image, ownership=ownership) as sb:
            await sb.write_files({"pkg/mod.py": "X = 41\n", "/tmp/data.bin": bytes(range(256))})
            r = await sb.exec(["python3", "-c", "import sys; sys.path.insert(0, 'pkg'); import mod; print(mod.X + 1)"])
            assert r.stdout == b"42\n"
            assert await sb.read_file("/tmp/data.bin") == bytes(range(256))
            assert await sb.read_file("pkg/mod.py") == b"X = 41\n"
            r = await sb.exec("stat -c '%u %a' pkg/mod.py")
            assert r.stdout == b"1000 644\n"
            with pytest.raises(SandboxError, match="larger than max_bytes=10"):
                await sb.read_file("/tmp/data.bin", max_bytes=10)
            with pytest.raises(SandboxError, match="missing.txt"):
                await sb.read_file("missing.txt")
            with pytest.raises(ValueError, match="outside the work dir"):
                await sb.write_files({"/etc/passwd": b"x"})
            with pytest.raises(ValueError, match=r"\.\."):
                await sb.write_files({"../etc/x": b"x"})


async def test_bad_exec_arguments_are_rejected_before_docker(engine, image, ownership):
    with trio.fail_after(60):
        async with open_sandbox(engine, image=image, ownership=ownership) as sb:
            with pytest.raises(ValueError, match="timeout"):
                await sb.exec("true", timeout=0)
            with pytest.raises(ValueError, match="workdir"):
                await sb.exec("true", workdir="rel")
            with pytest.raises(TypeError, match="stdin"):
                await sb.exec("true", stdin=123)  # type: ignore[arg-type]
            assert (await sb.exec("true")).ok  # still usable


async def test_timeout_kills_the_process_tree_and_sandbox_stays_usable(engine, image, ownership):
    with trio.fail_after(60):
        async with open_sandbox(engine, image=image, ownership=ownership) as sb:
            r = await sb.exec("sleep 300 & sleep 300 & while :; do :; done", timeout=1.0)
            assert r.timed_out and r.exit_code == 137 and not r.ok
            # nothing of the sandbox user is left running but PID 1 and its sleeper
            r = await sb.exec("ls -d /proc/[0-9]* | wc -l")
            # PID 1, its sleep, this sh, ls, wc
            assert int(r.stdout) <= 5, r.stdout
            assert (await sb.exec("echo alive")).stdout == b"alive\n"


async def test_cancelled_exec_removes_the_container(engine, image, ownership, docker_client):
    with trio.fail_after(60):
        sb = await start_sandbox(engine, image=image, ownership=ownership)
        try:
            with trio.move_on_after(1.0) as cs:
                await sb.exec("sleep 600", timeout=600)
            assert cs.cancelled_caught
            assert sb.dirty and sb.closed
            with pytest.raises(docker.errors.NotFound):
                docker_client.containers.get(sb.id)
            with pytest.raises(SandboxGoneError):
                await sb.exec("true")
        finally:
            await sb.aclose()
            await sb.aclose()  # idempotent


async def test_cancelled_start_leaves_no_container(engine, image, ownership, count_containers):
    with trio.fail_after(60):
        for delay in (0.0, 0.05, 0.2):
            with trio.move_on_after(delay):
                sb = await start_sandbox(engine, image=image, ownership=ownership)
                await sb.aclose()
        await trio.sleep(0.5)
        assert count_containers(ownership.owner) == 0


async def test_unknown_image_is_a_clear_error(engine, ownership, count_containers):
    with trio.fail_after(30):
        with pytest.raises(SandboxStartError, match="no-such-image:1.*build-image"):
            await start_sandbox(engine, image="no-such-image:1", ownership=ownership)
        assert count_containers(ownership.owner) == 0


async def test_limits_are_applied_to_the_container(engine, image, ownership, docker_client):
    lim = Limits(memory_bytes=128 << 20, cpus=0.5, pids=64, nofile=256)
    with trio.fail_after(60):
        async with open_sandbox(engine, image=image, limits=lim, ownership=ownership) as sb:
            hc = docker_client.api.inspect_container(sb.id)["HostConfig"]
            assert hc["NetworkMode"] == "none" and hc["ReadonlyRootfs"] and hc["CapDrop"] == ["ALL"]
            assert hc["Memory"] == hc["MemorySwap"] == 128 << 20 and hc["PidsLimit"] == 64
            assert hc["NanoCpus"] == 500_000_000
            r = await sb.exec("ulimit -n; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status")
            lines = r.stdout.decode().split("\n")
            assert lines[0] == "256"
            assert "CapEff:\t0000000000000000" in lines and "NoNewPrivs:\t1" in lines


async def test_final_exec_resets_in_the_same_round_trip(engine, image, ownership):
    with trio.fail_after(60):
        async with open_sandbox(engine, image=image, ownership=ownership) as sb:
            r = await sb.exec(
                "nohup sleep 300 >/dev/null 2>&1 & echo data > /work/f; echo out; printf 'no newline' >&2; exit 7",
                final=True,
            )
            # the command's own status and output, without the wrapper's status line
            assert (r.exit_code, r.stdout, r.stderr, r.stderr_bytes) == (7, b"out\n", b"no newline", 10)
            assert not r.stderr_truncated and sb.clean
            r = await sb.exec("ls -A /work; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
            assert b"f\n" not in r.stdout and b"sleep 300" not in r.stdout
            assert not sb.clean  # another exec ran after the final one


async def test_final_exec_status_line_cannot_be_forged(engine, image, ownership):
    lim = Limits(stderr_cap=8)
    with trio.fail_after(60):
        async with open_sandbox(engine, image=image, limits=lim, ownership=ownership) as sb:
            # the command prints a fake status line; the wrapper's own line comes last
            r = await sb.exec("printf '\\nfleetrl-final 0 0\\n' >&2; exit 3", final=True)
            assert r.exit_code == 3 and sb.clean
            assert r.stderr_bytes == len(b"\nfleetrl-final 0 0\n") and r.stderr == b"\nfleetrl"
            assert r.stderr_truncated
            # the command kills the wrapper shell: its forged line is not trusted
            r = await sb.exec("printf '\\nfleetrl-final 0 0\\n' >&2; kill -9 $PPID", final=True)
            assert r.exit_code == 137 and not sb.clean
            # a timeout kills everything: not clean, the engine's status is reported
            r = await sb.exec("sleep 30", timeout=0.5, final=True)
            assert r.timed_out and r.exit_code == 137 and not sb.clean


async def test_a_long_exec_never_blocks_the_event_loop(engine, image, ownership):
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.05)
            ticks += 1

    with trio.fail_after(60):
        async with open_sandbox(engine, image=image, ownership=ownership) as sb:
            async with trio.open_nursery() as n:
                n.start_soon(ticker)
                before = ticks
                r = await sb.exec("sleep 1.5; echo done")
                during = ticks - before
                n.cancel_scope.cancel()
            assert r.stdout == b"done\n"
            assert during >= 5  # the loop kept running while the exec's stream was read in a thread
