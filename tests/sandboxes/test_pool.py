"""The warm pool on real Docker: reuse after reset, discard on dirt/errors/cancel,
capacity waits, metrics (statistics and Prometheus), removal of everything on close."""

from __future__ import annotations

import docker
import pytest
import trio
from prometheus_client import CollectorRegistry

from fleetrl.sandboxes import Limits, PoolClosedError, SandboxStartError, WarmPolicy, open_sandbox_pool

pytestmark = pytest.mark.docker


async def test_lease_reuses_a_reset_container(engine, image, ownership, count_containers):
    pol = WarmPolicy(min_warm=1, max_warm=1, max_containers=1)  # one container: the second lease must reuse it
    with trio.fail_after(60):
        async with open_sandbox_pool(ownership, engine=engine, policy=pol) as pool:
            await pool.prewarm(image)
            st = pool.statistics()
            assert st.idle == 1 and st.created == 1
            async with pool.lease(image) as sb:
                first = sb.id
                await sb.write_files({"secret.txt": b"attempt 1", "/tmp/t": b"x"})
                assert (await sb.exec("cat secret.txt")).stdout == b"attempt 1"
            async with pool.lease(image) as sb:
                assert sb.id == first
                r = await sb.exec("ls -A /work /tmp")
                assert r.ok and b"secret" not in r.stdout and b"t\n" not in r.stdout
            st = pool.statistics()
            assert st.leases == 2 and st.leases_active == 0 and st.execs == 2 and st.resets_failed == 0
            assert st.lease_wait_p50_s >= 0 and st.lease_wait_p99_s >= st.lease_wait_p50_s
            assert count_containers(ownership.owner) == st.containers >= 1
        assert count_containers(ownership.owner) == 0  # close removed every container


async def test_dirty_erroring_and_cancelled_leases_are_discarded(engine, image, ownership, docker_client):
    pol = WarmPolicy(min_warm=0, max_warm=2, max_containers=4)
    with trio.fail_after(60):
        async with open_sandbox_pool(ownership, engine=engine, policy=pol) as pool:
            async with pool.lease(image) as sb:
                sb.mark_dirty()
            gone = [sb.id]
            with pytest.raises(RuntimeError, match="harness bug"):
                async with pool.lease(image) as sb:
                    raise RuntimeError("harness bug")
            gone.append(sb.id)
            with trio.CancelScope() as cs:  # cancelled inside the lease, however long the start took
                async with pool.lease(image) as sb:
                    gone.append(sb.id)
                    cs.cancel()
                    await trio.sleep_forever()
            assert cs.cancelled_caught
            for cid in gone:
                with pytest.raises(docker.errors.NotFound):
                    docker_client.containers.get(cid)
            async with pool.lease(image) as sb:
                assert sb.id not in gone
                assert (await sb.exec("echo fresh")).stdout == b"fresh\n"
            assert pool.statistics().discarded >= 3


async def test_distinct_limits_get_distinct_containers(engine, image, ownership, docker_client):
    with trio.fail_after(60):
        async with open_sandbox_pool(ownership, engine=engine, policy=WarmPolicy(min_warm=0)) as pool:
            async with pool.lease(image, Limits(pids=100)) as a, pool.lease(image, Limits(pids=200)) as b:
                assert a.id != b.id
                assert docker_client.api.inspect_container(a.id)["HostConfig"]["PidsLimit"] == 100
                assert docker_client.api.inspect_container(b.id)["HostConfig"]["PidsLimit"] == 200


async def test_at_capacity_a_lease_waits_for_a_release(engine, image, ownership, count_containers):
    pol = WarmPolicy(min_warm=0, max_warm=2, max_containers=2)
    order: list[str] = []
    with trio.fail_after(90):
        async with open_sandbox_pool(ownership, engine=engine, policy=pol) as pool:

            async def hold(name: str, seconds: float) -> None:
                async with pool.lease(image) as sb:
                    order.append(f"{name}+")
                    assert count_containers(ownership.owner) <= 2
                    await sb.exec(f"sleep {seconds}")
                    order.append(f"{name}-")

            async with trio.open_nursery() as n:
                n.start_soon(hold, "a", 1.0)
                n.start_soon(hold, "b", 1.0)
                await trio.sleep(0.3)
                while len(order) < 2:
                    await trio.sleep(0.05)
                n.start_soon(hold, "c", 0.1)
            assert order.index("c+") > min(order.index("a-"), order.index("b-"))
            assert pool.statistics().created <= 2


async def test_pool_grows_with_demand_and_keeps_warm_containers(engine, image, ownership):
    pol = WarmPolicy(min_warm=0, max_warm=4, max_containers=16, max_starting=4)
    with trio.fail_after(90):
        async with open_sandbox_pool(ownership, engine=engine, policy=pol) as pool:
            async with trio.open_nursery() as n:
                for _ in range(4):
                    n.start_soon(_one_exec, pool, image)
            with trio.fail_after(30):
                while pool.statistics().idle < 4:  # the burst of 4 is remembered: 4 kept warm
                    await trio.sleep(0.1)
            created = pool.statistics().created
            async with trio.open_nursery() as n:
                for _ in range(4):
                    n.start_soon(_one_exec, pool, image)
            st = pool.statistics()
            assert st.created == created  # the second burst was served warm
            assert st.leases == 8  # (no wall-clock bound: "warm" is the unchanged created count)


async def _one_exec(pool, image) -> None:
    async with pool.lease(image) as sb:
        assert (await sb.exec("true")).ok


async def test_prometheus_metrics_on_a_given_registry(engine, image, ownership):
    reg = CollectorRegistry()
    with trio.fail_after(60):
        async with open_sandbox_pool(ownership, engine=engine, registry=reg, policy=WarmPolicy(min_warm=0)) as pool:
            async with pool.lease(image) as sb:
                await sb.exec("true")
                await sb.exec("sleep 5", timeout=0.5)
            value = reg.get_sample_value
            assert value("fleetrl_sandbox_leases_total") == 1
            assert value("fleetrl_sandbox_exec_seconds_count") == 2
            assert value("fleetrl_sandbox_exec_timeouts_total") == 1
            assert value("fleetrl_sandbox_containers_created_total") >= 1
            assert value("fleetrl_sandbox_leases_active") == 0
            assert value("fleetrl_sandbox_pool_containers") is not None
            assert value("fleetrl_sandbox_oom_kills_total") == 0


async def test_bad_image_and_closed_pool_errors(engine, ownership):
    with trio.fail_after(60):
        async with open_sandbox_pool(ownership, engine=engine, policy=WarmPolicy(min_warm=0)) as pool:
            with pytest.raises(SandboxStartError, match="nope:latest"):
                async with pool.lease("nope:latest"):
                    pass
            with pytest.raises(SandboxStartError, match="nope:latest"):
                await pool.prewarm("nope:latest", n=1)
            with pytest.raises(TypeError, match="Limits"):
                async with pool.lease("x", {"pids": 3}):  # type: ignore[arg-type]
                    pass
            while pool.statistics().containers:  # the failed background starts finish
                await trio.sleep(0.05)
        with pytest.raises(PoolClosedError):
            async with pool.lease("x"):
                pass


async def test_a_final_exec_returns_the_container_without_a_reset_round_trip(engine, image, ownership):
    pol = WarmPolicy(min_warm=1, max_warm=1, max_containers=1)
    with trio.fail_after(60):
        async with open_sandbox_pool(ownership, engine=engine, policy=pol) as pool:
            async with pool.lease(image) as sb:
                first = sb.id
                r = await sb.exec("echo secret > /work/s; nohup sleep 99 >/dev/null 2>&1 &", final=True)
                assert r.ok and sb.clean
            assert pool.statistics().idle == 1  # back at once: nothing was left to reset
            async with pool.lease(image) as sb:
                assert sb.id == first
                r = await sb.exec("ls -A /work; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
                assert b"s\n" not in r.stdout and b"sleep 99" not in r.stdout
            st = pool.statistics()
            assert st.execs == 2 and st.resets_failed == 0
