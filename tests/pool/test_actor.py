"""The pool actor under the real supervisor and control plane: a remote joins through
the mounted endpoint, requests go through the in-process client, metrics are exported."""

from __future__ import annotations

import json

import httpx
import trio

from fleetrl.actors.pool.remote_client import RemoteClientConfig, run_remote
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.daemon import messages as m

from .conftest import request, running_pool


async def test_pool_actor_serves_local_and_joined_remote(tmp_path, model_dir):
    async with running_pool(tmp_path, f"""
heartbeat_s = 0.5
[[actors.pool.config.samplers]]
id = "cpu0"
model_dir = "{model_dir}"
price_per_hour = 0.5
""") as (pool, sup, state, n):
        while "cpu0" not in pool.handles:
            await trio.sleep(0.02)
        token = (state.path / "actors" / "pool" / "fleet_token").read_text().strip()
        assert (state.path / "actors" / "pool" / "fleet_token").stat().st_mode & 0o077 == 0
        ctl = json.loads((state.path / "control.json").read_text())
        url = f"ws://{ctl['host']}:{ctl['port']}/fleet/join"
        backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="fp16"))
        remote_cfg = RemoteClientConfig(join_url=url, token=token, price_per_hour=3.0)
        remote_scope = trio.CancelScope()

        async def remote():
            with remote_scope:
                await run_remote(remote_cfg, backend)

        n.start_soon(remote)
        while not any(s.startswith("remote-") for s in pool.handles):
            await trio.sleep(0.02)
        out = {}

        async def ask(i):
            out[i] = await pool.generate(request(i))

        async with trio.open_nursery() as reqs:
            for i in range(6):
                reqs.start_soon(ask, i)
        assert all(isinstance(g, m.Generation) for g in out.values())
        assert {g.sampler.dtype for g in out.values()} == {"float32", "float16"}
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://{ctl['host']}:{ctl['port']}/metrics",
                                 headers={"Authorization": f"Bearer {state.token}"})
        text = r.text
        assert 'fleetrl_sampler_up{actor="pool",backend="torch",device="cpu",dtype="float32",' \
               'remote="false",sampler="cpu0"} 1.0' in text
        assert "fleetrl_sampler_usd_per_1k_tokens" in text and 'remote="true"' in text
        remote_scope.cancel()
