"""The rollout browser's data and routes: the trainer's rollout log listed and filtered
(task, mean reward, failure kind), a group laid out with each call's text, tokens, masks
and tool calls (the tiny model's byte tokenizer), and the routes on a real daemon: 401
without a session, 400 on a bad filter, 404 for a group the log no longer keeps."""

from __future__ import annotations

import json
import random
from functools import partial

import httpx
import numpy as np
import trio

from fleetrl.actors.dashboard.rollouts import RolloutSource, Texts, group_view, list_groups, load_group, read_index
from fleetrl.actors.trainer.rollout_log import IndexLine, RolloutLog
from fleetrl.actors.trainer.step import RowDetail
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.messages import (RolloutFailed, RolloutGroup, SamplerIdentity, SupportCSR, TokenSegment,
                                     Trajectory)
from fleetrl.daemon.protocol import Tensor
from fleetrl.daemon.state import StateDir, read_control
from fleetrl.daemon.supervisor import Supervisor

SAMPLER = SamplerIdentity(sampler_id="torch-fp8", backend="torch", device_kind="cpu", dtype="float8_e4m3fn")


def _seg(prompt: list[int], tokens: list[int], version: int = 2) -> TokenSegment:
    n = len(tokens)
    lq = np.log(np.linspace(0.9, 0.2, n)).astype(np.float32)
    return TokenSegment(
        prompt_ids=Tensor.from_numpy(np.asarray(prompt, dtype=np.int64)),
        token_ids=Tensor.from_numpy(np.asarray(tokens, dtype=np.int64)),
        logprobs=Tensor.from_numpy(lq),
        support=SupportCSR(ids=Tensor.from_numpy(np.asarray(tokens, dtype=np.int64)),
                           logprobs=Tensor.from_numpy(np.zeros(n, dtype=np.float32)),
                           offsets=Tensor.from_numpy(np.arange(n + 1, dtype=np.int64))),
        versions=Tensor.from_numpy(np.full(n, version, dtype=np.int64)), sampler=SAMPLER, finish_reason="stop")


def _tool_group(tok) -> RolloutGroup:
    """Attempt 0 calls a tool, gets its output, answers; attempt 1 answers at once."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompt = enc("Write f.")
    call = enc('Let me look.<tool_call>{"name": "run", "arguments": {"cmd": "ls"}}</tool_call>')
    output = enc("\nf.py\n")
    answer = enc("def f(): pass")
    t0 = Trajectory(attempt_id="a0", task_id="task-7", group_id="g7", reward=1.0,
                    segments=(_seg(prompt, call), _seg(prompt + call + output, answer, version=3)))
    t1 = Trajectory(attempt_id="a1", task_id="task-7", group_id="g7", reward=0.0, segments=(_seg(prompt, answer),))
    return RolloutGroup(group_id="g7", task_id="task-7", trajectories=(t0, t1))


def test_listing_merges_failures_and_filters_by_task_reward_and_failure_kind():
    def group(gid, task, rewards, n, t):
        return IndexLine(kind="group", n=n, time=t, group_id=gid, task_id=task, step=n, rewards=rewards, tokens=8,
                         masked=1, samplers=["s"], file=f"g-{n}.json")

    def failed(gid, task, reason, t):
        return IndexLine(kind="failed", time=t, group_id=gid, task_id=task, attempt_id=gid + "-x", reason=reason,
                         detail="why")
    lines = [group("g1", "add", [0.0, 1.0], 1, 1.0), failed("g2", "sort", "timeout", 2.0),
             group("g2", "sort", [1.0, 1.0], 2, 3.0), failed("g3", "add", "sandbox", 4.0)]
    every = list_groups(lines)
    assert [g["group_id"] for g in every["groups"]] == ["g3", "g2", "g1"]  # newest first
    assert every["failure_kinds"] == ["sandbox", "timeout"] and every["matched"] == 3
    g2 = every["groups"][1]
    assert g2["n"] == 2 and g2["mean_reward"] == 1.0 and [f["reason"] for f in g2["failures"]] == ["timeout"]
    assert every["groups"][0]["n"] is None  # never trained: nothing to open
    names = lambda **kw: [g["group_id"] for g in list_groups(lines, **kw)["groups"]]  # noqa: E731
    assert names(task="add") == ["g3", "g1"]
    assert names(reward_min=0.75) == ["g2"] and names(reward_max=0.5) == ["g1"]
    assert names(failure="any") == ["g3", "g2"] and names(failure="timeout") == ["g2"]
    assert names(failure="oom") == [] and names(limit=1) == ["g3"]


def test_a_group_is_laid_out_with_text_masks_and_tool_calls(tmp_path, tiny_model_dir):
    texts = Texts.load(str(tiny_model_dir))
    log = RolloutLog(tmp_path, keep=10)
    detail = [RowDetail(origin=(0, 0, 1), trainer_logprobs=[-0.5] * len(texts.tok.encode("def f(): pass",
                                                                                      add_special_tokens=False)),
                        masked=[0, 2])]
    log.groups([_tool_group(texts.tok)], detail, step=4, version=4, skipped=None)
    log.failed(RolloutFailed(attempt_id="a2", task_id="task-7", reason="timeout", detail="slow", group_id="g7"))
    view = group_view(load_group(tmp_path, 0), texts, read_index(tmp_path))
    assert (view["group_id"], view["task_id"], view["step"]) == ("g7", "task-7", 4)
    assert view["failures"] == [{"attempt_id": "a2", "reason": "timeout", "detail": "slow"}]
    a0, a1 = view["attempts"]
    assert a0["reward"] == 1.0 and a0["advantage"] == 0.5 and a1["advantage"] == -0.5
    first, second = a0["calls"]
    assert first["context"] == "Write f." and first["context_kind"] == "prompt"
    assert first["tool_calls"] == [{"name": "run", "arguments": '{"cmd": "ls"}'}]
    assert second["context"] == "\nf.py\n" and second["context_kind"] == "added"  # the tool's output
    assert second["text"] == "def f(): pass" and "".join(t[0] for t in second["tokens"]) == "def f(): pass"
    assert [t[3] for t in second["tokens"]][:3] == [1, 0, 1] and second["masked"] == 2
    assert second["tokens"][0][2] == -0.5 and second["tokens"][0][4] == 3  # log p, version
    assert first["trained"] is False and first["tokens"][0][2] is None  # no detail for that row
    assert second["sampler"] == "torch-fp8 (torch/float8_e4m3fn)" and second["versions"] == [3, 3]
    # without a tokenizer the ids show as such
    assert group_view(load_group(tmp_path, 0), Texts(None))["attempts"][1]["calls"][0]["text"].startswith("<")


CONFIG = """
[daemon]
grace_s = 30.0
checkpoint_interval_s = 1000.0
[http]
enabled = true
host = "127.0.0.1"
port = 0
[actors.ui]
factory = "fleetrl.actors.dashboard:run"
config = {{refresh_s = 0.2, pool = "nobody", tokenizer_dir = "{tok}"}}
"""


async def test_the_routes_answer_only_a_session_and_name_what_is_wrong(tmp_path, tiny_model_dir):
    state = StateDir(tmp_path / "state").open()
    log = RolloutLog(state.path / "actors" / "trainer" / "rollouts", keep=1)
    for _ in range(2):  # the log keeps only the newest: group 0 is gone
        log.groups([_tool_group(Texts.load(str(tiny_model_dir)).tok)], None, step=1, version=1, skipped=None)
    sup = Supervisor(load_config_text(CONFIG.format(tok=tiny_model_dir), source="test.toml"), state,
                     rng=random.Random(0))
    with state, trio.fail_after(60):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await sup.wait_handle("ui")
            _, port = read_control(state.path)
            base = f"http://127.0.0.1:{port}/ui"
            async with httpx.AsyncClient() as c:
                for route in ("/rollouts", "/rollouts/1", "/rollouts?task=x"):
                    r = await c.get(base + route)
                    assert r.status_code == 401 and "g7" not in r.text, route
                await c.post(base + "/login", data={"token": state.token})
                listing = (await c.get(base + "/rollouts")).json()
                assert [g["n"] for g in listing["groups"]] == [1] and listing["matched"] == 1
                group = (await c.get(base + "/rollouts/1")).json()
                assert group["attempts"][0]["calls"][1]["context"] == "\nf.py\n"
                gone = await c.get(base + "/rollouts/0")
                assert gone.status_code == 404 and "keeps the newest" in gone.json()["error"]
                bad = await c.get(base + "/rollouts?reward_min=lots")
                assert bad.status_code == 400 and "bad filter" in bad.json()["error"]
                assert (await c.get(base + "/rollouts?limit=0")).status_code == 400
                assert (await c.get(base + "/static/rollouts.js")).status_code == 200
            sup.request_shutdown("test")
    assert json.loads(json.dumps(RolloutSource(state.path / "nowhere", None).listing()))["groups"] == []
