"""The pool actor under the real supervisor and control plane: a remote joins through
the mounted endpoint, requests go through the in-process client, metrics are exported."""

from __future__ import annotations

import json
import random
from functools import partial

import httpx
import trio

from fleetrl.actors.pool import pool_client
from fleetrl.actors.pool.remote_client import RemoteClientConfig, run_remote
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.daemon import messages as m
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor

from .conftest import request


async def test_pool_actor_serves_local_and_joined_remote(tmp_path, model_dir):
    cfg = load_config_text(f"""
[daemon]
grace_s = 5.0
checkpoint_interval_s = 1000.0
[http]
port = 0
[logging]
file = false
[actors.pool]
factory = "fleetrl.actors.pool:run"
[actors.pool.config]
heartbeat_s = 0.5
[[actors.pool.config.samplers]]
id = "cpu0"
model_dir = "{model_dir}"
price_per_hour = 0.5
""", source="test.toml")
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(cfg, state, rng=random.Random(0))
    with state, trio.fail_after(120):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            pool = await pool_client("pool")
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
            sup.request_shutdown("test")
