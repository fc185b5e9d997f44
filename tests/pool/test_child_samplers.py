"""Samplers run as child processes of the daemon (``process = true``): real `fleetrl
sampler` processes started by the pool actor under the real supervisor, real signals.

A child joins under its configured id, with its credentials in its environment only;
SIGKILLed while it holds requests, it is restarted and the requests are answered; the
daemon's shutdown stops and reaps it; a SIGKILLed daemon leaves no child behind; a child
that never joins is killed, restarted, and given up on per the restart policy. The join
endpoint's reserved ids: claimed by a token, duplicates refused, the same child's second
connection replaces its first.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import msgspec
import pytest
import trio
from fleetrl.actors.pool import LocalSamplerConfig, PoolConfig, SamplerPool
from fleetrl.actors.pool.actor import _backend_factory, _launch
from fleetrl.actors.pool.children import (
    Launch,
    ProcessSampler,
    SamplerProcessFailed,
    child_argv,
    child_env,
)
from fleetrl.actors.pool.cli import build_parser
from fleetrl.actors.pool.errors import JoinRefused
from fleetrl.actors.pool.remote_client import (
    RemoteClientConfig,
    build_backend,
    serve_once,
    vllm_engine,
)
from fleetrl.actors.samplers.vllm_setup import VllmBackendConfig, VllmEngineConfig
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT
from fleetrl.actors.pool.remote_server import Reservations, fleet_app
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.daemon import messages as m
from fleetrl.daemon.config import RestartPolicy
from fleetrl.daemon.control import MountTable, build_app, serve_control
from fleetrl.harness.processes import read_parent_map
from helpers import read_jsonl, wait_until

from .conftest import pool_daemon_config, request, running_pool
from .test_remote import _local, _Plane


def _alive(pid: int) -> bool:
    """A live (not zombie) process of that pid."""
    return pid in read_parent_map()


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _environ(pid: int) -> dict[str, str]:
    pairs = [e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in e]
    return dict(pairs)


def _metric(sup, name: str, sampler: str) -> float | None:
    text = sup.metrics_text().decode()
    found = re.search(rf'^fleetrl_{name}{{actor="pool",sampler="{sampler}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else None


async def _until(pred, what: str, timeout: float, step: float = 0.05) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(step)


async def test_child_sampler_is_sigkilled_mid_request_restarted_and_loses_nothing(tmp_path, model_dir):
    pids: list[int] = []
    async with running_pool(tmp_path, f"""
heartbeat_s = 0.5
heartbeat_timeout_s = 20.0
process_grace_s = 5.0
wait_for_processes = true
process_restart = {{ backoff_base_s = 0.2, jitter = 0.0 }}
[[actors.pool.config.samplers]]
id = "kid"
model_dir = "{model_dir}"
process = true
dtype = "fp32"
capacity = 2
price_per_hour = 1.5
""", timeout_s=420) as (pool, sup, state, _nursery):
        # wait_for_processes: the pool is handed out only once its child has joined
        assert "kid" in pool.handles and pool.registry.get("kid").alive
        pid = int(_metric(sup, "sampler_process_pid", "kid"))
        pids.append(pid)
        assert _metric(sup, "sampler_process_starts", "kid") == 1
        # joined under its configured id, as a remote member, with its configured price
        rec = pool.registry.get("kid")
        assert (rec.remote, rec.price_per_hour, rec.capacity, rec.identity.backend) == (True, 1.5, 2, "torch")
        # credentials in its environment, never on its command line
        argv, env = _cmdline(pid), _environ(pid)
        assert "--token" not in argv and "--weights-token" not in argv
        assert env["FLEETRL_FLEET_TOKEN"] and env["FLEETRL_FLEET_TOKEN"] not in " ".join(argv)
        assert state.token not in " ".join(argv)
        assert argv[argv.index("--parent-pid") + 1] == str(os.getpid())
        assert os.getpgid(pid) == pid  # a session of its own

        out: dict[str, m.Generation | m.GenerateFailed] = {}

        async def ask(r):
            out[r.request_id] = await pool.generate(r)

        async with trio.open_nursery() as reqs:
            for i in range(6):
                reqs.start_soon(ask, request(i, max_tokens=200))
            await _until(lambda: pool.registry.get("kid").running > 0, "the child holds a request", 120, 0.005)
            os.kill(pid, signal.SIGKILL)
            # it is restarted (a new process) while the requests wait for a sampler
            await _until(lambda: (_metric(sup, "sampler_process_starts", "kid") or 0) >= 2, "a restart", 60)
        assert sorted(out) == [f"r{i}" for i in range(6)]  # nothing lost
        assert all(isinstance(g, m.Generation) for g in out.values()), out
        assert {g.sampler.sampler_id for g in out.values()} == {"kid"}  # the only sampler: its second process
        assert pool.rerouted >= 1
        assert _metric(sup, "sampler_process_exits", "kid") == 1
        new_pid = int(_metric(sup, "sampler_process_pid", "kid"))
        pids.append(new_pid)
        assert new_pid != pid and not _alive(pid) and not Path(f"/proc/{pid}").exists()  # reaped
        assert pool.registry.get("kid").alive and _alive(new_pid)
        log = state.path / "actors" / "pool" / "samplers" / "kid.log"
        assert log.read_text().count(" of sampler kid: ") == 2  # one header per start
    # the daemon's shutdown stopped the child (SIGTERM: it left) and reaped it
    assert not any(Path(f"/proc/{p}").exists() for p in pids)
    assert "SIGTERM: leaving" in log.read_text()


def test_a_sigkilled_daemon_leaves_no_child_sampler(tmp_path, model_dir, fleetrl_bin):
    cfg = tmp_path / "pool.toml"
    cfg.write_text(pool_daemon_config(f"""
[[actors.pool.config.samplers]]
id = "kid"
model_dir = "{model_dir}"
process = true
""").replace("file = false", "file = true"))
    state = tmp_path / "state"
    err = tmp_path / "daemon.stderr"
    with err.open("wb") as stderr:
        daemon = subprocess.Popen([fleetrl_bin, "serve", "--config", str(cfg), "--state-dir", str(state)],
                                  env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                                  stderr=stderr)
    try:
        joined = wait_until(lambda: [e for e in read_jsonl(state / "logs" / "daemon.jsonl")
                                     if e.get("event") == "sampler process joined"],
                            "the child joins", 240, proc=daemon, stderr=err)
        pid = joined[0]["pid"]
        assert read_parent_map()[pid] == daemon.pid
        daemon.kill()
        daemon.wait(30)
        wait_until(lambda: not _alive(pid), "the orphaned child ends", 30)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(30)


async def test_a_child_that_never_joins_is_killed_restarted_then_given_up(tmp_path, model_dir):
    with socket.socket() as s:  # a port nobody listens on: the child can never join
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = SamplerPool()
    child = ProcessSampler(LocalSamplerConfig(id="kid", model_dir=str(model_dir), process=True), pool=pool,
                           reservations=Reservations(), launch=Launch(join_url=f"ws://127.0.0.1:{port}/fleet/join"),
                           log_dir=tmp_path, start_timeout_s=3.0, grace_s=2.0,
                           policy=RestartPolicy(backoff_base_s=0.1, jitter=0.0, intensity=1, period_s=600.0))
    pids = []
    child.on_change = lambda c: pids.append(c.pid) if c.pid is not None else None
    with trio.fail_after(120), pytest.raises(SamplerProcessFailed) as failed:
        await child.run()
    assert "sampler 'kid'" in str(failed.value) and "did not join the pool within" in str(failed.value)
    assert str(tmp_path / "kid.log") in str(failed.value)
    stats = child.statistics()
    assert (stats.starts, stats.exits, stats.joins, stats.pid) == (2, 2, 0, None)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


async def test_reserved_ids_are_claimed_by_token_and_never_doubled(model_dir):
    pool = SamplerPool()
    reservations = Reservations()
    mounts = MountTable()
    mounts.add("/fleet", fleet_app(pool, token=None, run_id="run-1", heartbeat_s=0.3, heartbeat_timeout_s=10.0,
                                   refuse_linger_s=0.5, reservations=reservations), auth=False, owner="pool")
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))
    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            stop = trio.Event()
            host, port = await n.start(lambda task_status: serve_control(
                build_app(_Plane(), "control-token", mounts), "127.0.0.1", 0, shutdown_trigger=stop.wait,
                task_status=task_status))
            url = f"ws://{host}:{port}/fleet/join"

            def client(token: str, name: str) -> RemoteClientConfig:
                return RemoteClientConfig(join_url=url, token=token, capacity=2, name=name)

            kid = reservations.reserve("kid")
            first_ended = trio.Event()

            async def first() -> None:
                assert await serve_once(client(kid.token, "first"), backend)
                first_ended.set()

            n.start_soon(first)
            await _until(lambda: "kid" in pool.handles, "the reserved id joins", 60)
            first_handle = pool.handles["kid"]
            assert kid.handle is first_handle and kid.joins == 1
            answer = await pool.generate(request(1))
            assert isinstance(answer, m.Generation) and answer.sampler.sampler_id == "kid"

            # without a fleet token (token=None) only reserved tokens join
            with pytest.raises(JoinRefused, match="wrong fleet token"):
                await serve_once(client("anything", "stranger"), backend)
            # an id held by another live sampler is refused
            _local(pool, model_dir, sid="taken")
            other = reservations.reserve("taken")
            with pytest.raises(JoinRefused, match="sampler id 'taken' is already held by another live sampler"):
                await serve_once(client(other.token, "dup"), backend)
            assert pool.handles["taken"].sampler_id == "taken" and other.joins == 0

            # the same child joining again replaces its own earlier connection, which is closed
            second_scope = trio.CancelScope()

            async def second() -> None:
                with second_scope:
                    await serve_once(client(kid.token, "second"), backend)

            n.start_soon(second)
            await _until(lambda: kid.joins == 2, "the second connection joins", 60)
            assert pool.handles["kid"] is kid.handle is not first_handle
            with trio.fail_after(30):
                await first_ended.wait()  # the daemon closed the first connection
            assert first_handle.lost is not None
            assert pool.handles["kid"] is kid.handle  # and its end did not take out the second
            answer = await pool.generate(request(2))
            assert isinstance(answer, m.Generation) and answer.sampler.sampler_id == "kid"

            # a released reservation's token no longer joins
            reservations.release(kid)
            with pytest.raises(JoinRefused, match="wrong fleet token"):
                await serve_once(client(kid.token, "late"), backend)
            assert kid.token not in repr(kid)
            second_scope.cancel()
            stop.set()


def test_child_command_line_is_what_the_sampler_cli_reads(model_dir):
    sc = LocalSamplerConfig(id="f8", model_dir=str(model_dir), dtype="fp8", fp8_scheme="tensor", matmul="native",
                            capacity=3, max_batch=2, price_per_hour=0.25, process=True)
    launch = Launch(join_url="ws://127.0.0.1:9/fleet/join", weights_url="http://127.0.0.1:9/weights",
                    control_token="ctl-secret")
    argv = child_argv(sc, launch, parent_pid=123)
    assert argv[1:3] == ["-m", "fleetrl.actors.pool.cli"]
    args = build_parser().parse_args(argv[3:])
    assert (args.join, args.backend, args.dtype, args.model, args.fp8_scheme, args.matmul, args.capacity,
            args.max_batch, args.price_per_hour, args.name, args.parent_pid, args.weights) == (
        launch.join_url, "torch", "fp8", str(model_dir), "tensor", "native", 3, 2, 0.25, "f8", 123,
        launch.weights_url)
    env = child_env("join-secret", launch, base={"FLEETRL_TOKEN": "stale", "PATH": "/bin"})
    assert (env["FLEETRL_FLEET_TOKEN"], env["FLEETRL_TOKEN"], env["PATH"]) == ("join-secret", "ctl-secret", "/bin")
    assert "ctl-secret" not in repr(launch)
    # no delta store: no control token handed down, not even an inherited one
    bare = Launch(join_url=launch.join_url)
    assert "FLEETRL_TOKEN" not in child_env("t", bare, base={"FLEETRL_TOKEN": "stale"})
    assert "--weights" not in child_argv(sc, bare, parent_pid=1)
    assert "--ca-file" not in argv
    # a TLS daemon: the child verifies the daemon's own certificate
    tls = Launch(join_url="wss://127.0.0.1:9/fleet/join", ca_file="/state/daemon.pem")
    assert build_parser().parse_args(child_argv(sc, tls, parent_pid=1)[3:]).ca_file == "/state/daemon.pem"
    # the flags reach the torch backend, in a child and in the daemon's process alike
    cfg = RemoteClientConfig(join_url=launch.join_url, token="t", backend="torch", dtype="fp8",
                             model_dir=str(model_dir), fp8_scheme=args.fp8_scheme, matmul=args.matmul)
    for backend in (build_backend(cfg), _backend_factory(sc, DEFAULT_MAX_SUPPORT)()):
        assert (backend.config.fp8_scheme, backend.config.matmul) == ("tensor", "native")
    vllm = LocalSamplerConfig(id="v", model_dir=str(model_dir), backend="vllm", dtype="bf16", process=True,
                              vllm=VllmEngineConfig(max_model_len=2048, cpu_kv_cache_bytes=64 << 20))
    vargv = child_argv(vllm, launch, parent_pid=1)
    assert "--fp8-scheme" not in vargv
    # the pool's cap and a vLLM sampler's engine settings reach the child's backend config
    vargs = build_parser().parse_args(vargv[3:])
    assert vargs.max_support == DEFAULT_MAX_SUPPORT
    assert vllm_engine(vargs.vllm) == vllm.vllm
    small = Launch(join_url=launch.join_url, max_support=64)
    assert build_parser().parse_args(child_argv(sc, small, parent_pid=1)[3:]).max_support == 64
    assert VllmBackendConfig.of(str(model_dir), "bf16", 64, vllm.vllm).max_model_len == 2048
    with pytest.raises(ValueError, match="--vllm: .*max_model_len must be >= 2"):
        vllm_engine('{"max_model_len": 1}')
    with pytest.raises(ValueError, match="--vllm holds settings of the vllm backend, not of torch"):
        RemoteClientConfig(join_url=launch.join_url, token="t", vllm=VllmEngineConfig(max_num_seqs=2))
    with pytest.raises(ValueError, match="matmul must be auto, native, fp32 or fp16_accumulate"):
        RemoteClientConfig(join_url=launch.join_url, token="t", matmul="fast")
    with pytest.raises(ValueError, match="settings of the torch backend, not of vllm"):
        RemoteClientConfig(join_url=launch.join_url, token="t", backend="vllm", fp8_scheme="row")


def test_pool_config_refuses_what_child_samplers_cannot_use(tmp_path):
    def pool(**kw) -> PoolConfig:
        return msgspec.convert(kw, PoolConfig)

    with pytest.raises(msgspec.ValidationError, match=r"id\(s\) remote-3 look like the ids the pool gives"):
        pool(samplers=[{"id": "remote-3", "model_dir": "m", "process": True}])
    with pytest.raises(msgspec.ValidationError, match="sampler 'v': fp8_scheme and matmul are settings of the torch"):
        pool(samplers=[{"id": "v", "model_dir": "m", "backend": "vllm", "matmul": "fp32"}])
    with pytest.raises(msgspec.ValidationError, match='sampler .h.: matmul = "fp16_accumulate" needs dtype = "fp16"'):
        pool(samplers=[{"id": "h", "model_dir": "m", "dtype": "bf16", "matmul": "fp16_accumulate"}])
    with pytest.raises(msgspec.ValidationError, match="sampler 't': vllm holds settings of the vllm backend"):
        pool(samplers=[{"id": "t", "model_dir": "m", "vllm": {"max_model_len": 64}}])
    with pytest.raises(msgspec.ValidationError, match="max_model_len must be >= 2"):
        pool(samplers=[{"id": "v", "model_dir": "m", "backend": "vllm", "vllm": {"max_model_len": 1}}])
    assert pool(max_support=64, whole_vocabulary=True).max_support == 64
    with pytest.raises(msgspec.ValidationError, match="max_support"):
        pool(max_support=0)
    with pytest.raises(msgspec.ValidationError, match="weights_prefix 'weights/' must look like '/weights'"):
        pool(weights_prefix="weights/")
    with pytest.raises(msgspec.ValidationError, match="process_restart.intensity|intensity"):
        pool(process_restart={"intensity": 0})

    class NoControlPlane:  # a daemon with [http] enabled = false writes no control.json
        daemon_dir = tmp_path
        name = "pool"
        credentials = None  # a kernel without a token store: the children read weights with its token

    cfg = pool(samplers=[{"id": "v0", "model_dir": "m", "backend": "vllm", "process": True}])
    with pytest.raises(ValueError, match=r"samplers v0 have process = true: .* set \[http\] enabled = true"):
        _launch(cfg, NoControlPlane())
    (tmp_path / "control.json").write_text('{"host": "0.0.0.0", "port": 8123}')
    (tmp_path / "token").write_text("ctl\n")
    with_store = pool(samplers=cfg.samplers, weights_dir="w", join_prefix="/f")
    assert _launch(with_store, NoControlPlane()) == Launch(
        join_url="ws://127.0.0.1:8123/f/join", weights_url="http://127.0.0.1:8123/weights", control_token="ctl")
    assert _launch(cfg, NoControlPlane()) == Launch(join_url="ws://127.0.0.1:8123/fleet/join")


async def test_a_live_remote_taken_out_is_disconnected_and_joins_afresh(model_dir):
    """A remote the pool takes out while it is still connected (a failed health check, a
    request held too long) has its connection closed, so it reconnects and serves again
    instead of lingering connected but never routed to."""
    from fleetrl.actors.pool.remote_client import run_remote

    from .test_remote import TOKEN, _serve

    pool = SamplerPool()
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))
    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            url, stop = await _serve(n, pool, heartbeat_s=0.3, heartbeat_timeout_s=10.0, refuse_linger_s=0.5)
            cfg = RemoteClientConfig(join_url=url, token=TOKEN, backoff_base_s=0.1)
            n.start_soon(run_remote, cfg, backend)
            await _until(lambda: "remote-1" in pool.handles, "the remote joins", 60)
            pool.mark_dead("remote-1", "health check failed")
            await _until(lambda: "remote-2" in pool.handles, "the same remote joins again", 60)
            assert not pool.registry.get("remote-1").alive
            answer = await pool.generate(request(1))
            assert isinstance(answer, m.Generation) and answer.sampler.sampler_id == "remote-2"
            n.cancel_scope.cancel()
            stop.set()
