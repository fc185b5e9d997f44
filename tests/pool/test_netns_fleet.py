"""Two remote sampler hosts in their own network namespaces (ip netns + veth), reaching
the daemon only through a userspace TCP fault proxy with latency: each joins and follows
the weights over the proxy; a blip that resets every connection mid-run is survived (the
samplers rejoin and catch up); SIGKILL of one host while it holds requests re-routes
them; no request is lost and the survivor serves the newest version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
import trio
from faultproxy import FaultProxy
from fakes import NullControlPlane
from netns import netns

from fleetrl.actors.model.tiny_llama import read_state_dict
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.pool.remote_server import fleet_app
from fleetrl.actors.weights import MemoryStore, Publisher, PublisherConfig
from fleetrl.actors.weights.http import blob_app
from fleetrl.daemon import messages as m
from fleetrl.daemon.control import MountTable, build_app, serve_control

from .conftest import request

TOKEN = "fleet-secret"


async def _until(pred, what: str, timeout_s: float = 90.0) -> None:
    with trio.fail_after(timeout_s):
        while not pred():
            await trio.sleep(0.05)


async def test_two_sampler_hosts_behind_a_fault_proxy_survive_a_blip_and_a_sigkill(model_dir, tmp_path):
    store = MemoryStore()
    pub = Publisher(store, PublisherConfig(run="run-1"))
    weights = {k: v.to(torch.bfloat16) for k, v in read_state_dict(model_dir).items()}
    pub.publish(weights)
    pool = SamplerPool(policy="least_loaded", max_staleness=0)
    mounts = MountTable()
    mounts.add("/fleet", fleet_app(pool, token=TOKEN, run_id="run-1", heartbeat_s=0.5, heartbeat_timeout_s=5.0),
               auth=False, owner="pool")
    mounts.add("/weights", blob_app(store), auth=True, owner="trainer")
    stop = trio.Event()
    procs: list[subprocess.Popen] = []
    with netns(1) as host_a, netns(2) as host_b, trio.fail_after(300):
        async with trio.open_nursery() as outer:
            _, port = await outer.start(lambda task_status: serve_control(
                build_app(NullControlPlane(), "control-token", mounts), "127.0.0.1", 0,
                shutdown_trigger=stop.wait, task_status=task_status))
            async with trio.open_nursery() as n:
                proxies = []
                for ns in (host_a, host_b):  # each host reaches the daemon through its own proxy
                    proxy = FaultProxy("127.0.0.1", port, latency_s=0.01, listen_host=ns.host_ip)
                    _, pport = await n.start(proxy.serve)
                    proxies.append(proxy)
                    argv = ns.argv(sys.executable, "-m", "fleetrl.actors.pool.cli",
                                   "--join", f"ws://{ns.host_ip}:{pport}/fleet/join", "--token", TOKEN,
                                   "--backend", "torch", "--dtype", "bf16", "--model", str(model_dir),
                                   "--weights", f"http://{ns.host_ip}:{pport}/weights",
                                   "--weights-token", "control-token", "--capacity", "2", "--name", ns.name)
                    log = open(tmp_path / f"{ns.name}.log", "wb")
                    procs.append(subprocess.Popen(argv, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
                    log.close()

                def announce() -> None:
                    pool.announce(m.WeightVersionAvailable(version=pub.version, digest=pub.digest.hex(), base=None,
                                                           blobs=()), n)

                def at_newest() -> list[str]:
                    return [r.identity.sampler_id for r in pool.registry.records()
                            if r.alive and r.digest == pub.digest.hex()]

                announce()
                await _until(lambda: len(at_newest()) == 2, "both hosts joined at version 0")
                out: dict[str, m.Generation | m.GenerateFailed] = {}

                async def ask(r) -> None:
                    out[r.request_id] = await pool.generate(r)

                async with trio.open_nursery() as reqs:
                    for i in range(6):
                        reqs.start_soon(ask, request(i))
                assert {g.sampler.sampler_id for g in out.values()} == set(at_newest())

                # a blip: every connection of both hosts reset; then a new version to follow
                name = "model.layers.0.mlp.down_proj.weight"
                weights[name] = weights[name].clone()
                weights[name][1, :8] += 0.25
                pub.publish(weights)
                assert sum(p.reset_all() for p in proxies) >= 2
                announce()
                await _until(lambda: len(at_newest()) == 2, "both rejoined at version 1")
                assert all(p.connections > 2 for p in proxies)

                # SIGKILL host A's sampler while both hosts hold requests
                out.clear()
                both = at_newest()
                async with trio.open_nursery() as reqs:
                    for i in range(10, 18):
                        reqs.start_soon(ask, request(i, max_tokens=40, min_version=1))
                    await _until(lambda: all(pool.registry.get(s).running > 0 for s in both),
                                 "both hosts hold requests", 60)
                    os.killpg(procs[0].pid, signal.SIGKILL)
                assert sorted(out) == [f"r{i}" for i in range(10, 18)]  # nothing lost
                assert all(isinstance(g, m.Generation) for g in out.values()), out
                assert all(set(g.versions.to_numpy().tolist()) == {1} for g in out.values())
                assert pool.rerouted >= 1 and len(at_newest()) == 1  # host A is gone, host B serves
                n.cancel_scope.cancel()
            stop.set()
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()

