"""A remote sampler with an issued `sampler` token, over TLS: it joins (wss://) and
follows the weights (https://) with that one token, verifying the daemon's certificate
against the CA it was given; a `weights-read` token cannot join; revoking the sampler's
token takes it out of the pool at the next heartbeat, and it does not rejoin."""

from __future__ import annotations

import ssl
import time

import pytest
import torch
import trio
from tls import make_ca

from fleetrl.actors.model.tiny_llama import read_state_dict
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.pool.remote_client import JoinRefused, RemoteClientConfig, run_remote, serve_once
from fleetrl.actors.pool.remote_server import fleet_app
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.actors.weights import MemoryStore, Publisher, PublisherConfig
from fleetrl.actors.weights.http import blob_app
from fleetrl.daemon import messages as m
from fleetrl.daemon.control import MountTable, build_app, serve_control
from fleetrl.daemon.credentials import CredentialStore

from .conftest import request as request_for
from .test_remote import _Plane

HEARTBEAT_S = 0.5


async def test_sampler_token_joins_and_follows_over_tls_and_revocation_ends_it(model_dir, tmp_path):
    ca = make_ca(tmp_path / "pki")
    creds = CredentialStore(tmp_path / "state", admin_token="control-token")
    sampler, token = creds.create("sampler", "gpu-1")
    _, reader = creds.create("weights-read", "cache")

    def may_join(t: str) -> bool:
        c = creds.identify(t)
        return c is not None and c.role in ("sampler", "admin")

    store = MemoryStore()
    pub = Publisher(store, PublisherConfig(run="run-1"))
    pub.publish({k: v.to(torch.bfloat16) for k, v in read_state_dict(model_dir).items()})
    pool = SamplerPool()
    mounts = MountTable()
    mounts.add("/fleet", fleet_app(pool, token=None, run_id="run-1", heartbeat_s=HEARTBEAT_S,
                                   credentials=may_join), auth=False, owner="pool")
    mounts.add("/weights", blob_app(store), auth=True, owner="trainer", roles=("sampler", "worker", "weights-read"))
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="bf16"))
    stop = trio.Event()
    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            host, port = await n.start(lambda task_status: serve_control(
                build_app(_Plane(), "control-token", mounts, creds), "127.0.0.1", 0,
                shutdown_trigger=stop.wait, task_status=task_status, certfile=str(ca.cert), keyfile=str(ca.key)))
            base = f"{host}:{port}"

            def config(tok: str, ca_file=ca.ca_cert) -> RemoteClientConfig:
                return RemoteClientConfig(join_url=f"wss://{base}/fleet/join", token=tok, dtype="bf16",
                                          weights_url=f"https://{base}/weights", ca_file=str(ca_file))

            # a weights-read token reads weights but may not join
            with pytest.raises(JoinRefused, match="wrong fleet token"):
                await serve_once(config(reader), backend)
            # a client that trusts another CA does not even reach the join
            with trio.fail_after(10), pytest.raises(JoinRefused, match="cannot verify the TLS certificate") as info:
                await serve_once(config(token, ca_file=ca.other_ca_cert), backend)  # at once, not after a timeout
            assert isinstance(info.value.__cause__.__cause__, ssl.SSLCertVerificationError)
            assert pool.handles == {}

            pool.announce(m.WeightVersionAvailable(version=pub.version, digest=pub.digest.hex(), base=None,
                                                   blobs=()), n)
            ended: list[BaseException] = []

            async def remote() -> None:
                try:
                    await run_remote(config(token), backend)  # no weights_token: the sampler token serves
                except JoinRefused as exc:
                    ended.append(exc)
            n.start_soon(remote)
            while not [r for r in pool.registry.records() if r.alive and r.version == pub.version]:
                await trio.sleep(0.02)
            assert backend.weight_version.digest == pub.digest.hex()  # fetched over https with the sampler token
            sid = next(iter(pool.handles))

            t0 = time.monotonic()
            creds.revoke(sampler.id)
            await pool.wait_dead(sid)
            while not ended:
                await trio.sleep(0.02)
            took = time.monotonic() - t0
            assert "token revoked" in str(ended[0])
            assert took < 5 * HEARTBEAT_S, took  # within about one heartbeat (generous for a loaded machine)
            await trio.sleep(3 * HEARTBEAT_S)
            assert pool.handles == {}  # it did not rejoin
            stop.set()


async def test_a_tls_daemon_s_child_sampler_and_an_issued_sampler_token_join_its_pool(tmp_path, model_dir):
    """The pool actor under the real supervisor, serving TLS: its child sampler joins over
    wss:// verifying the daemon's own certificate (control.json names it), and a sampler
    token issued into the state directory joins through the pool's credential check."""
    from .conftest import running_pool

    ca = make_ca(tmp_path / "pki")
    async with running_pool(tmp_path, f"""
join = true
heartbeat_s = {HEARTBEAT_S}
wait_for_processes = true
[[actors.pool.config.samplers]]
id = "kid"
model_dir = "{model_dir}"
process = true
dtype = "fp32"
""", timeout_s=300, http=f'tls_cert = "{ca.cert}"\ntls_key = "{ca.key}"') as (pool, sup, state, _n):
        assert pool.registry.get("kid").alive  # joined over wss:// with the pinned certificate
        answer = await pool.generate(request_for(1))
        assert isinstance(answer, m.Generation) and answer.sampler.sampler_id == "kid"
        host, port = sup.control_address
        _, token = CredentialStore(state.path).create("sampler", "outside")
        cfg = RemoteClientConfig(join_url=f"wss://{host}:{port}/fleet/join", token=token, dtype="fp32",
                                 ca_file=str(ca.ca_cert))
        outside = TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))
        scope = trio.CancelScope()

        async def join() -> None:
            with scope:
                await serve_once(cfg, outside)
        _n.start_soon(join)
        while not [sid for sid in pool.handles if sid.startswith("remote-")]:
            await trio.sleep(0.05)
        scope.cancel()


def _child_env(var: str) -> str | None:
    """`var` in the environment of this process's child sampler (found under /proc)."""
    import os
    from pathlib import Path

    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"fleetrl.actors.pool.cli" not in argv or str(os.getpid()).encode() not in argv:
                continue
            env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        return env.get(var.encode(), b"").decode() or None
    return None


async def test_a_child_sampler_reads_weights_with_a_weights_read_token_revoked_when_the_pool_ends(
        tmp_path, model_dir):
    """Child samplers read the delta store with a `weights-read` token issued for this
    pool start (not the daemon's admin token): active while the pool runs, revoked after."""
    from .conftest import running_pool

    async with running_pool(tmp_path, f"""
join = true
weights_dir = "{tmp_path / 'weights'}"
wait_for_processes = true
[[actors.pool.config.samplers]]
id = "kid"
model_dir = "{model_dir}"
process = true
dtype = "fp32"
""", timeout_s=300) as (pool, sup, state, _n):
        store = CredentialStore(state.path)
        token = _child_env("FLEETRL_TOKEN")
        assert token is not None and token != state.token  # never the admin token
        cred = store.identify(token)
        assert cred is not None and cred.role == "weights-read" and cred.name == "pool-pool-children"
    assert store.identify(token) is None  # revoked when the pool ended
    assert [c.name for c in store.list() if c.active] == []
