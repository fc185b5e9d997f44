"""One attempt's outcome classification, against an in-memory sandbox pool and model
(no Docker): every way an attempt can end maps to a scored trajectory or the right
failure kind."""

from __future__ import annotations

from contextlib import asynccontextmanager
from types import SimpleNamespace

import msgspec
import pytest
import structlog
import trio

from fleetrl.actors.envworker.config import EnvWorkerConfig
from fleetrl.actors.envworker.cursor import TaskCursor
from fleetrl.actors.envworker.group import AttemptTicket
from fleetrl.actors.envworker.attempt import Failed
from fleetrl.actors.envworker.worker import _Worker
from fleetrl.daemon.examples import example_generation
from fleetrl.daemon.messages import Trajectory
from fleetrl.daemon.metrics import ActorMetrics, MetricsRegistry
from fleetrl.harness.builtin import CompletionHarness
from fleetrl.harness.model import ModelUnavailable
from fleetrl.harness.tasks import Evaluator, Setup, Task
from fleetrl.sandboxes import SandboxStartError

from .conftest import Result


class MemorySandbox:
    """Commands are looked up in `answers` (default: exit 0, no output)."""

    def __init__(self, answers):
        self.answers = answers
        self.files = {}

    async def exec(self, cmd, *, timeout=None, stdin=None, env=None, workdir=None):
        await trio.sleep(0)
        return self.answers.get(cmd, Result(0))

    async def write_files(self, files):
        self.files.update(files)

    async def read_file(self, path, *, max_bytes=1 << 20):
        return self.files[path].encode()


class MemoryPool:
    def __init__(self, answers=None, broken=False):
        self.answers = answers or {}
        self.broken = broken
        self.leases = 0

    @asynccontextmanager
    async def lease(self, image, limits):
        if self.broken:
            raise SandboxStartError("engine unreachable")
        self.leases += 1
        yield MemorySandbox(self.answers)


class ScriptedModel:
    """Answers with a fixed generation, or raises ModelUnavailable."""

    def __init__(self, fail=False):
        from fleetrl.actors.model import build_byte_tokenizer
        from fleetrl.harness.model import HFChatTokenizer

        self.fail = fail
        self._tok = HFChatTokenizer(build_byte_tokenizer())

    @property
    def tokenizer(self):
        return self._tok

    def for_attempt(self, attempt_id):
        return self

    async def generate(self, prompt_ids, params):
        if self.fail:
            raise ModelUnavailable("no sampler alive")
        return example_generation(3, 2, vocab=259)


class Returns42:
    async def run(self, task, sandbox, model):
        return 42


def worker(harness, *, pool=None, model=None, **cfg) -> _Worker:
    config = msgspec.convert({"model": {"kind": "local", "model_dir": "unused"}, **cfg}, EnvWorkerConfig)
    ctx = SimpleNamespace(log=structlog.get_logger(), metrics=ActorMetrics(MetricsRegistry(), "env"),
                          draining=False)
    return _Worker(config, ctx, harness=harness, model=model or ScriptedModel(), pool=pool or MemoryPool(),
                   out=None, failures_out=None, cursor=TaskCursor())


TASK = Task(id="t", prompt="def f(x):\n", evaluator=Evaluator(command="check", reward="json"),
            setup=Setup(commands=["prep"]))
TICKET = AttemptTicket(group_id="g", task_id="t", slot=0, try_no=1)


@pytest.mark.parametrize("answers, model_fails, harness, expect", [
    ({"check": Result(0, b'{"reward": 0.25}\n')}, False, CompletionHarness(max_tokens=3), 0.25),
    ({"check": Result(1, b'{"reward": 0.0}\n')}, False, CompletionHarness(max_tokens=3), 0.0),  # scored 0
    ({"check": Result(0, b"garbage\n")}, False, CompletionHarness(max_tokens=3), "evaluator_error"),
    ({"prep": Result(2, b"", b"no such file")}, False, CompletionHarness(max_tokens=3), "sandbox_error"),
    ({}, True, CompletionHarness(max_tokens=3), "sampler_error"),
    ({}, False, Returns42(), "harness_crash"),
])
async def test_attempt_outcomes(answers, model_fails, harness, expect):
    w = worker(harness, pool=MemoryPool(answers), model=ScriptedModel(fail=model_fails))
    with trio.fail_after(30):
        out = await w.attempt(TASK, TICKET)
    if isinstance(expect, float):
        assert isinstance(out, Trajectory), out
        assert out.reward == expect and out.attempt_id == "g/0.1" and out.group_id == "g"
        (seg,) = out.segments
        assert seg.token_ids == example_generation(3, 2, vocab=259).token_ids
    else:
        assert isinstance(out, Failed) and out.kind == expect, out


async def test_sandbox_that_cannot_start_is_a_sandbox_error():
    with trio.fail_after(30):
        out = await worker(CompletionHarness(), pool=MemoryPool(broken=True)).attempt(TASK, TICKET)
    assert out == Failed("sandbox_error", "SandboxStartError: engine unreachable")


async def test_hanging_harness_times_out_on_the_task_clock(autojump_clock):
    class Hangs:
        async def run(self, task, sandbox, model):
            await trio.sleep_forever()

    task = msgspec.structs.replace(TASK, limits=msgspec.structs.replace(TASK.limits, timeout_s=5.0))
    w = worker(Hangs(), attempt_slack_s=1.0)
    with trio.fail_after(60):
        t0 = trio.current_time()
        out = await w.attempt(task, TICKET)
    assert out.kind == "timeout" and "within 6 s" in out.detail
    assert trio.current_time() - t0 == pytest.approx(6.0)


async def test_an_external_program_stopped_at_its_limit_is_a_timeout_not_a_reward():
    """An external command killed at its wall clock (a hung harness) is a typed ``timeout``
    failure even though the evaluator would have scored the sandbox (0 here)."""
    from fleetrl.harness.external import ExternalEpisode
    from fleetrl.harness.recording import AttemptRecord

    class StoppedAtLimit:
        async def run(self, task, sandbox, model):
            return ExternalEpisode(task_id=task.id, turns=(), final_state="timeout", timed_out=True,
                                   error="the command ran past its limit of 5 s and was killed",
                                   record=AttemptRecord(attempt_id="x", task_id=task.id))

    class ExitedByItself(StoppedAtLimit):
        async def run(self, task, sandbox, model):
            ep = await super().run(task, sandbox, model)
            return msgspec.structs.replace(ep, final_state="submitted", timed_out=False, error=None, exit_code=0)

    answers = {"check": Result(1, b'{"reward": 0.0}\n')}
    with trio.fail_after(30):
        stopped = await worker(StoppedAtLimit(), pool=MemoryPool(answers)).attempt(TASK, TICKET)
        exited = await worker(ExitedByItself(), pool=MemoryPool(answers)).attempt(TASK, TICKET)
    assert stopped == Failed("timeout", "the command ran past its limit of 5 s and was killed")
    assert isinstance(exited, Trajectory) and exited.reward == 0.0  # the model's verdict: scored


async def test_retokenization_breaks_are_counted_by_cause():
    """A harness that rewrites the model's answer before its next call breaks the token
    stream: the trajectory says how often and why, and the worker counts it in Prometheus."""
    from fleetrl.harness.chat import ChatMessage
    from fleetrl.harness.model import RecordedModel
    from fleetrl.harness.protocol import Episode
    from fleetrl.harness.recording import AttemptRecorder
    from fleetrl.daemon.messages import SamplingParams

    class RewritesItsHistory:
        async def run(self, task, sandbox, model):
            recorder = AttemptRecorder("x", task.id, model.tokenizer)
            rm = RecordedModel(model, recorder)
            q = [ChatMessage("user", "hello")]
            await rm.chat(q, SamplingParams(max_tokens=3))
            await rm.chat([*q, ChatMessage("assistant", "REWRITTEN"), ChatMessage("user", "go on")],
                          SamplingParams(max_tokens=3))
            return Episode(task_id=task.id, turns=(), final_state="submitted", record=recorder.finish())

    w = worker(RewritesItsHistory(), pool=MemoryPool({"check": Result(0, b'{"reward": 1.0}\n')}))
    with trio.fail_after(30):
        out = await w.attempt(TASK, TICKET)
    assert isinstance(out, Trajectory), out
    assert out.metrics["retokenization_breaks"] == 1.0
    assert out.metrics["retokenization_breaks/answer_rewritten"] == 1.0
    assert len(out.segments) == 2  # each trained with its own context
    w.metrics.breaks(out)
    from prometheus_client.exposition import generate_latest

    text = generate_latest(w.ctx.metrics.registry).decode()
    assert 'fleetrl_envworker_retokenization_breaks_total{actor="env",cause="answer_rewritten"} 1.0' in text, text
