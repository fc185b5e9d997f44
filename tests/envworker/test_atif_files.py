"""``atif`` in a worker's config: each scored attempt is written as an ATIF file whose
agent steps carry the token ids and log-probs of the trained `Trajectory`; the directory
is bounded; a file that cannot be written never fails the attempt (in-memory sandbox pool
and model, no Docker)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import structlog
import trio

from fleetrl.actors.envworker.atif_files import AtifFiles
from fleetrl.actors.envworker.config import AtifOutput, EnvWorkerConfig
from fleetrl.actors.envworker.cursor import TaskCursor
from fleetrl.actors.envworker.group import AttemptTicket
from fleetrl.actors.envworker.worker import _Worker
from fleetrl.daemon.messages import SamplingParams, Trajectory
from fleetrl.daemon.metrics import ActorMetrics, MetricsRegistry
from fleetrl.harness.atif import read_atif
from fleetrl.harness.chat import ChatMessage
from fleetrl.harness.model import RecordedModel
from fleetrl.harness.protocol import Episode
from fleetrl.harness.recording import AttemptRecorder
from fleetrl.harness.tasks import Evaluator, Task

from .conftest import Result
from .test_attempt_outcomes import MemoryPool, ScriptedModel

TASK = Task(id="t", prompt="say hi", evaluator=Evaluator(command="check", reward="json"))
ANSWERS = {"check": Result(0, b'{"reward": 0.75}\n')}


class TwoTurns:
    """Asks twice, the second prompt extending the first answer (one segment each call)."""

    async def run(self, task, sandbox, model):
        recorder = AttemptRecorder("x", task.id, model.tokenizer)
        rm = RecordedModel(model, recorder)
        q = [ChatMessage("system", "be brief"), ChatMessage("user", "héllo ✓")]
        first = await rm.chat(q, SamplingParams(max_tokens=3))
        await rm.chat([*q, ChatMessage("assistant", first.text, tool_calls=first.tool_calls),
                       ChatMessage("user", "again")], SamplingParams(max_tokens=3))
        return Episode(task_id=task.id, turns=(), final_state="submitted", record=recorder.finish())


def worker(tmp_path, harness, **cfg) -> _Worker:
    config = msgspec.convert({"model": {"kind": "local", "model_dir": "unused"}, **cfg}, EnvWorkerConfig)
    ctx = SimpleNamespace(log=structlog.get_logger(), metrics=ActorMetrics(MetricsRegistry(), "env"),
                          draining=False, daemon_dir=tmp_path, name="env")
    return _Worker(config, ctx, harness=harness, model=ScriptedModel(), pool=MemoryPool(ANSWERS),
                   out=None, failures_out=None, cursor=TaskCursor())


def ticket(slot: int) -> AttemptTicket:
    return AttemptTicket(group_id="t#0@env", task_id="t", slot=slot, try_no=1)


async def test_each_scored_attempt_is_written_with_the_trained_tokens(tmp_path):
    w = worker(tmp_path, TwoTurns(), atif=True)
    with trio.fail_after(30):
        out = await w.attempt(TASK, ticket(0))
    assert isinstance(out, Trajectory) and out.reward == 0.75
    (path,) = (tmp_path / "trajectories" / "env").iterdir()
    assert path.name.endswith(".atif.json")
    doc = json.loads(path.read_bytes())
    assert doc["session_id"] == out.attempt_id and doc["extra"]["reward"] == 0.75
    agents = [s for s in doc["steps"] if s.get("llm_call_count") == 1]
    assert len(agents) == len(out.segments) == 2
    for step, seg in zip(agents, out.segments):
        m = step["metrics"]
        assert m["prompt_token_ids"] == seg.prompt_ids.to_numpy().tolist()
        assert m["completion_token_ids"] == seg.token_ids.to_numpy().tolist()
        assert np.array_equal(np.asarray(m["logprobs"], dtype=np.float32), seg.logprobs.to_numpy())
        assert m["extra"]["fleetrl"]["weight_versions"] == seg.versions.to_numpy().tolist()
        assert m["extra"]["fleetrl"]["sampler"] == msgspec.structs.asdict(seg.sampler)
    (session,) = read_atif(path.read_bytes(), str(path)).sessions
    assert [m.role for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert session.messages[1].content == "héllo ✓" and session.score == 0.75
    assert w.runner.atif_files.written == 1


async def test_no_files_without_the_setting(tmp_path):
    w = worker(tmp_path, TwoTurns())
    with trio.fail_after(30):
        assert isinstance(await w.attempt(TASK, ticket(0)), Trajectory)
    assert w.runner.atif_files is None and not (tmp_path / "trajectories").exists()


async def test_the_directory_keeps_the_newest_files(tmp_path):
    w = worker(tmp_path, TwoTurns(), atif={"dir": "atif-out", "max_files": 2})
    with trio.fail_after(60):
        for slot in range(4):
            assert isinstance(await w.attempt(TASK, ticket(slot)), Trajectory)
    names = sorted(p.name for p in (tmp_path / "atif-out").iterdir())
    assert len(names) == 2 and all(n.startswith(("t_0_env_2.1-", "t_0_env_3.1-")) for n in names), names


async def test_a_file_that_cannot_be_written_does_not_fail_the_attempt(tmp_path):
    (tmp_path / "blocked").write_text("a file where the directory should be")
    w = worker(tmp_path, TwoTurns(), atif=str(tmp_path / "blocked" / "sub"))
    with trio.fail_after(30):
        out = await w.attempt(TASK, ticket(0))
    assert isinstance(out, Trajectory) and out.reward == 0.75
    assert (w.runner.atif_files.written, w.runner.atif_files.failed) == (0, 1)


def test_config_forms():
    base = {"model": {"kind": "local", "model_dir": "m"}}
    assert msgspec.convert(base, EnvWorkerConfig).atif_output() is None
    assert msgspec.convert({**base, "atif": True}, EnvWorkerConfig).atif_output() == AtifOutput()
    assert msgspec.convert({**base, "atif": "out"}, EnvWorkerConfig).atif_output() == AtifOutput(dir="out")
    assert msgspec.convert({**base, "atif": {"max_files": 5}}, EnvWorkerConfig).atif_output().max_files == 5
    with pytest.raises(msgspec.ValidationError, match="max_files"):
        msgspec.convert({**base, "atif": {"max_files": 0}}, EnvWorkerConfig)
    with pytest.raises(msgspec.ValidationError, match="empty string"):
        msgspec.convert({**base, "atif": ""}, EnvWorkerConfig)


async def test_files_already_there_count_towards_the_bound(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for i in range(3):
        (d / f"old{i}.atif.json").write_text("{}")
    files = AtifFiles(d, max_files=3, log=structlog.get_logger())
    w = worker(tmp_path, TwoTurns())
    w.runner.atif_files = files
    with trio.fail_after(30):
        await w.attempt(TASK, ticket(0))
    assert len(list(d.iterdir())) == 3 and files.written == 1
