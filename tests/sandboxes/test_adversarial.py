"""Hostile programs in pooled sandboxes. Each must end with a clear result, leave the
host healthy, and (checked by the ownership fixture) leave no container behind."""

from __future__ import annotations

import socket
import threading

import pytest
import trio

from fleetrl.sandboxes import Limits, WarmPolicy, open_sandbox_pool

pytestmark = pytest.mark.docker

ONE = WarmPolicy(min_warm=0, max_warm=1, max_containers=1)  # one container, reused across leases


BOMB = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"


async def test_fork_bomb_is_stopped_by_the_pids_limit(engine, image, ownership, host_healthy, count_containers):
    lim = Limits(pids=64)
    with trio.fail_after(90):
        async with open_sandbox_pool(ownership, engine=engine, policy=ONE) as pool:
            async with pool.lease(image, lim) as sb:
                # Every process keeps forking and retrying: only the timeout ends it.
                r = await sb.exec(["python3", "-c", BOMB], timeout=3)
                assert r.timed_out
                if sb.closed:  # the kill found no free pid, so the container was removed
                    assert sb.dirty and r.exit_code is None
                else:
                    assert r.exit_code == 137
                    r = await sb.exec("cat /sys/fs/cgroup/pids/pids.events; ls -d /proc/[0-9]* | wc -l")
                    events, procs = r.stdout.decode().split("\n")[:2]
                    assert int(events.split()[1]) > 0  # forks were refused at the limit
                    assert int(procs) <= 5  # and the bomb is gone
            host_healthy()
            async with pool.lease(image, lim) as sb:  # the pool still serves a clean sandbox
                r = await sb.exec("ls -d /proc/[0-9]* | wc -l")
                assert r.ok and int(r.stdout) <= 5
        assert count_containers(ownership.owner) == 0


async def test_memory_bomb_is_oom_killed(engine, image, ownership, host_healthy):
    lim = Limits(memory_bytes=96 << 20)
    with trio.fail_after(90):
        async with open_sandbox_pool(ownership, engine=engine, policy=ONE) as pool:
            async with pool.lease(image, lim) as sb:
                r = await sb.exec(["python3", "-c", "a = []\nwhile True: a.append(bytearray(1 << 20))"], timeout=30)
                assert r.exit_code == 137 and r.oom_killed and not r.timed_out
                assert (await sb.exec("echo ok")).stdout == b"ok\n"
                r = await sb.exec("true")
                assert not r.oom_killed  # counted once, not again
            assert pool.statistics().oom_kills == 1
        host_healthy()


async def test_infinite_loop_times_out(engine, image, ownership, host_healthy):
    with trio.fail_after(60):
        async with open_sandbox_pool(ownership, engine=engine, policy=ONE) as pool:
            async with pool.lease(image) as sb:
                r = await sb.exec(["python3", "-c", "while True: pass"], timeout=1.5)
                assert r.timed_out and r.exit_code == 137
                assert 1.5 <= r.duration_s
            st = pool.statistics()
            assert st.timeouts == 1 and st.execs == 1
        host_healthy()


async def test_one_gigabyte_of_stdout_is_capped(engine, image, ownership, host_healthy):
    lim = Limits(stdout_cap=64 << 10, stderr_cap=1 << 10, output_limit_bytes=32 << 20)
    with trio.fail_after(120):
        async with open_sandbox_pool(ownership, engine=engine, policy=ONE) as pool:
            async with pool.lease(image, lim) as sb:
                r = await sb.exec("yes err | head -c 5000 >&2; head -c 1000000000 /dev/zero; echo never", timeout=100)
                assert r.output_limit_exceeded and not r.timed_out and r.exit_code == 137
                assert r.stdout_truncated and len(r.stdout) == 64 << 10 and r.stdout == bytes(64 << 10)
                assert 32 << 20 < r.stdout_bytes + r.stderr_bytes < 1_000_000_000
                assert r.stderr_truncated and r.stderr == b"err\n" * 256 and r.stderr_bytes == 5000
                # Output under the limit is drained (counted) but not kept beyond the cap.
                r = await sb.exec("head -c 3000000 /dev/zero", timeout=60)
                assert r.ok and not r.output_limit_exceeded
                assert r.stdout_truncated and r.stdout_bytes == 3_000_000 and len(r.stdout) == 64 << 10
        host_healthy()


async def test_writes_outside_the_work_dir_fail(engine, image, ownership):
    script = r"""
for p in /etc/evil /usr/bin/evil /evil /home/sandbox/evil /proc/sys/kernel/evil /sys/evil; do
  if echo x > "$p" 2>/dev/null; then echo "WROTE $p"; else echo "denied $p"; fi
done
echo ok > /work/fine && echo ok > /tmp/fine && echo "work ok"
"""
    with trio.fail_after(60):
        async with open_sandbox_pool(ownership, engine=engine, policy=ONE) as pool:
            async with pool.lease(image) as sb:
                r = await sb.exec(script)
                out = r.stdout.decode()
                assert "WROTE" not in out, out
                assert out.count("denied") == 6 and "work ok" in out
                r = await sb.exec("ls /etc/evil /evil 2>&1; touch /home/sandbox/x")  # its own home: still read-only
                assert r.exit_code != 0 and b"Read-only file system" in r.stderr


async def test_no_network_but_loopback_host_server_unreachable(engine, image, ownership):
    # A server on the host's 127.0.0.1: it must see no connection from the sandbox.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted: list = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, addr = srv.accept()
            except OSError:
                continue
            accepted.append(addr)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    probe = f"""
import socket
print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))
s = socket.socket(); s.settimeout(3)
try:
    s.connect(('127.0.0.1', {port})); print('CONNECTED')
except OSError as e:
    print('refused', type(e).__name__)
"""
    try:
        with trio.fail_after(60):
            async with open_sandbox_pool(ownership, engine=engine, policy=ONE) as pool:
                async with pool.lease(image) as sb:
                    r = await sb.exec(["python3", "-c", probe])
                    lines = r.stdout.decode().splitlines()
                    assert lines[0] == "['lo']", r.stdout
                    assert lines[1].startswith("refused"), r.stdout
                    r = await sb.exec("cat /proc/net/route | wc -l")
                    assert r.stdout.strip() == b"1"  # header only: no route anywhere
        # and the host's own client reaches the server, so the probe above was meaningful
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with trio.fail_after(10):
            while not accepted:
                await trio.sleep(0.05)
        assert len(accepted) == 1
    finally:
        stop.set()
        t.join(5)
        srv.close()


async def test_sleeping_children_after_exit_are_killed_on_reset(engine, image, ownership):
    with trio.fail_after(60):
        async with open_sandbox_pool(ownership, engine=engine, policy=ONE) as pool:
            async with pool.lease(image) as sb:
                first = sb.id
                r = await sb.exec(
                    "nohup sleep 777 >/dev/null 2>&1 & setsid sh -c 'sleep 778' >/dev/null 2>&1 & "
                    "echo leftover > /work/file; echo x > /tmp/.hidden; echo y > /dev/shm/shared; echo started"
                )
                assert r.ok and r.stdout == b"started\n"
                r = await sb.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
                assert b"sleep 777" in r.stdout and b"sleep 778" in r.stdout
            async with pool.lease(image) as sb:
                assert sb.id == first  # the same container, reset
                r = await sb.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; ls -A /work /tmp /dev/shm")
                assert b"sleep 777" not in r.stdout and b"sleep 778" not in r.stdout
                for name in (b"file", b".hidden", b"shared"):  # nothing carries over to the next attempt
                    assert name not in r.stdout, r.stdout


async def test_host_proc_is_not_visible(engine, image, ownership):
    with trio.fail_after(60):
        async with open_sandbox_pool(ownership, engine=engine, policy=ONE) as pool:
            async with pool.lease(image) as sb:
                r = await sb.exec(
                    "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done; ls -d /proc/[0-9]* | wc -l"
                )
                out = r.stdout.decode()
                assert "pytest" not in out and "dockerd" not in out and "containerd" not in out
                assert int(out.strip().splitlines()[-1]) <= 6
                r = await sb.exec("cat /proc/1/cmdline | tr '\\0' ' '")
                assert r.stdout == b"sleep infinity "  # PID 1 is the sandbox's own keeper
