"""The daemon's side of the remote workers' conversation, spoken to by a hand-written peer
over a real WebSocket (a real daemon with the workers actor): a first message that is not
a `WorkerJoin`, a wrong token, and a sampler token are refused with the reason; a welcome
carries the settings, the tokenizer files and a signed harness; no task goes out before
the worker says it is ready; a frame that does not decode, a group or a failure of a task
the worker does not hold, and a `TaskEnded` for a task not assigned to it are each
answered with `Rejected` naming what is wrong, and nothing reaches the trainer; a worker
that hangs up has its task handed to the next worker, under the same number."""

from __future__ import annotations

import random
from functools import partial

import msgspec
import trio

from fleetrl.actors.pool.remote_client import connect
from fleetrl.actors.workers.config import RemoteWorkersConfig
from fleetrl.actors.workers.shipping import open_harness
from fleetrl.daemon import messages as m
from fleetrl.daemon import worker_messages as w
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.credentials import CredentialStore
from fleetrl.daemon.examples import example_trajectory
from fleetrl.daemon.protocol import Rejected
from fleetrl.daemon.state import StateDir, read_control
from fleetrl.daemon.supervisor import Supervisor
from fleetrl.harness.builtin import CompletionHarness
from fleetrl.harness.tasks import Task

from .test_remote_workers import _config

CODEC = w.WORKERS


async def _next(ws, *skip: type) -> object:
    """The next message that is not a heartbeat (or of the `skip` types)."""
    while True:
        with trio.fail_after(30):
            msg = CODEC.decode(await ws.get_message())
        if not isinstance(msg, (m.Heartbeat, *skip)):
            return msg


async def _join(url: str, token: str, groups: int = 1):
    ws_cm = connect(url)
    ws = await ws_cm.__aenter__()
    await ws.send_message(CODEC.encode(w.WorkerJoin(token=token, name="by-hand", groups=groups)))
    return ws_cm, ws, await _next(ws)


async def test_the_hub_refuses_and_rejects_what_is_wrong_and_requeues_a_dropped_task(
        tmp_path, tiny_model_dir, actors_module):
    test_actors = actors_module("workers_test_actors", "RECEIVED")
    text = _config(tmp_path, tiny_model_dir, None, tls=False).replace(
        'harness = "acme_harness:EchoingHarness"\nharness_config = {max_tokens = 6, temperature = 1.0, delay_s = 2.0}',
        'harness = "fleetrl.harness.builtin:CompletionHarness"\nharness_config = {max_tokens = 6}')
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(load_config_text(text, source="test.toml"), state, rng=random.Random(0))
    store = CredentialStore(state.path)
    _, token = store.create("worker")
    _, sampler_token = store.create("sampler")
    with state, trio.fail_after(120):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            hub = await sup.wait_handle("remote")
            _, port = read_control(state.path)
            url = f"ws://127.0.0.1:{port}/workers/join"

            async with connect(url) as ws:  # a first message that is not a join
                await ws.send_message(CODEC.encode(m.Heartbeat(sampler_id="x", sent_at=0.0)))
                refused = await _next(ws)
                assert isinstance(refused, m.Refused) and "must be WorkerJoin" in refused.reason
            for bad in ("frl_nope_nope", sampler_token):
                cm, ws, refused = await _join(url, bad)
                assert isinstance(refused, m.Refused) and "wrong worker token" in refused.reason
                await cm.__aexit__(None, None, None)

            cm, ws, welcome = await _join(url, token)
            try:
                assert isinstance(welcome, w.WorkerWelcome) and welcome.actor == "remote"
                assert "tokenizer.json" in welcome.tokenizer or "tokenizer_config.json" in welcome.tokenizer
                assert not any(name.endswith(".safetensors") for name in welcome.tokenizer)
                settings = msgspec.msgpack.decode(welcome.settings, type=RemoteWorkersConfig)
                assert settings.group_size == 4
                shipped = await _next(ws)
                assert open_harness(shipped, welcome.harness_key, secure=False) == CompletionHarness(max_tokens=6)
                with trio.move_on_after(1.5):  # not ready yet: no task
                    assert not isinstance(await _next(ws), w.TaskAssigned)
                assert hub.statistics().tasks_assigned == 0
                (joining,) = hub.statistics().worker_rows  # its row in /status: not ready yet
                assert (joining.worker, joining.host, joining.remote, joining.health) == (
                    welcome.worker_id, "by-hand", True, "joining")
                assert joining.address.startswith("127.0.0.1:") and joining.sandboxes_limit == 4
                assert joining.groups_running == 0 and joining.attempts_running is None
                assert joining.sandboxes_warm is None and joining.sandboxes_leased is None  # on its own host

                await ws.send_message(CODEC.encode(m.Heartbeat(sampler_id=welcome.worker_id, sent_at=0.0)))
                assigned = await _next(ws)
                assert isinstance(assigned, w.TaskAssigned) and assigned.index == 0
                task = msgspec.msgpack.decode(assigned.task, type=Task)
                assert task.id == "parity-0"

                await ws.send_message(b"\x93not a message")
                rejected = await _next(ws)
                assert isinstance(rejected, Rejected), rejected
                stranger = msgspec.structs.replace(example_trajectory(8, 2, n_segments=1, vocab=256),
                                                   task_id="parity-5", group_id="parity-5#5@remote")
                await ws.send_message(CODEC.encode(m.RolloutGroup(group_id="parity-5#5@remote", task_id="parity-5",
                                                                  trajectories=(stranger,))))
                rejected = await _next(ws)
                assert isinstance(rejected, Rejected) and "not the group of a task this worker holds" in rejected.detail
                await ws.send_message(CODEC.encode(m.RolloutFailed(attempt_id="a", task_id="parity-5", reason="timeout",
                                                                   detail="", group_id="parity-5#5@remote")))
                rejected = await _next(ws)
                assert isinstance(rejected, Rejected) and "not held by this worker" in rejected.detail
                await ws.send_message(CODEC.encode(w.TaskEnded(index=7, outcome="finished")))
                rejected = await _next(ws)
                assert isinstance(rejected, Rejected) and "task 7 is not assigned" in rejected.detail
                assert not test_actors.RECEIVED["trained"] and not test_actors.RECEIVED["trained/failed"]
                assert len(hub.book.held) == 1
                # a failure of the task it holds is forwarded and counted in its row, by kind
                await ws.send_message(CODEC.encode(m.RolloutFailed(
                    attempt_id="parity-0#0@remote/1.1", task_id="parity-0", reason="sandbox_error", detail="",
                    group_id="parity-0#0@remote")))
                with trio.fail_after(30):
                    while not test_actors.RECEIVED["trained/failed"]:
                        await trio.sleep(0.05)
                # what it says it runs shows in its row
                await ws.send_message(CODEC.encode(w.WorkerLoad(attempts_running=3, sandboxes_warm=1,
                                                                sandboxes_leased=2)))
                with trio.fail_after(30):
                    while hub.statistics().worker_rows[0].attempts_running is None:
                        await trio.sleep(0.05)
                (up,) = hub.statistics().worker_rows
                assert (up.attempts_running, up.sandboxes_warm, up.sandboxes_leased) == (3, 1, 2)
                assert up.health == "up" and up.groups_running == 1 and up.groups == {}
                assert up.failures == {"sandbox_error": 1}  # the rejected ones are not counted
                assert up.last_seen_s is not None and up.last_seen_s >= 0
            finally:
                await cm.__aexit__(None, None, None)  # hangs up holding task 0

            with trio.fail_after(30):
                while hub.book.held:
                    await trio.sleep(0.05)
            assert [idx for idx, _ in hub.book.requeued] == [0]
            cm, ws, welcome = await _join(url, token)
            try:
                await _next(ws)  # the harness
                await ws.send_message(CODEC.encode(m.Heartbeat(sampler_id=welcome.worker_id, sent_at=0.0)))
                again = await _next(ws)
                assert isinstance(again, w.TaskAssigned) and again.index == 0  # the same task, the same number
                assert hub.statistics().reruns == 1
                second, first = hub.statistics().worker_rows  # the live worker, then the one that hung up
                assert (second.worker, second.health, second.groups_running) == (welcome.worker_id, "up", 1)
                assert first.worker != second.worker and first.health == "lost" and first.ended
                assert first.groups == {"abandoned": 1} and first.failures == {"sandbox_error": 1}
                assert first.groups_running == 0 and first.attempts_running is None  # gone: runs nothing
            finally:
                await cm.__aexit__(None, None, None)
            sup.request_shutdown("test")
