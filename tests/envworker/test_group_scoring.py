"""Cheap rollouts: lazy leases and group scoring (one exec_many per group).

Counted against an in-memory sandbox pool (no Docker): a group of a ``"files"``
harness costs one lease and one ``exec_many``; other harnesses keep one lease each,
taken only when the harness first touches the sandbox. Against real Docker sandboxes:
the same completions get the same rewards scored per attempt and per group, and a
wrong, hanging or process-killing solution scores 0 without harming its siblings.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import ClassVar

import msgspec
import pytest
import structlog
import trio

from fleetrl.actors.envworker.config import EnvWorkerConfig
from fleetrl.actors.envworker.cursor import TaskCursor
from fleetrl.actors.envworker.sandboxing import GroupScorer, group_scoring_spec, scoring_spec
from fleetrl.actors.envworker.worker import _Worker
from fleetrl.daemon.examples import example_generation
from fleetrl.daemon.messages import RolloutFailed, RolloutGroup
from fleetrl.daemon.metrics import ActorMetrics, MetricsRegistry
from fleetrl.harness.builtin import CompletionHarness
from fleetrl.harness.protocol import sandbox_use_of
from fleetrl.harness.synthetic import make_task, reference_solution, solution_text
from fleetrl.harness.tasks import Evaluator, Setup, Task

from .conftest import Result


class CountingSandbox:
    """Scores a solution file by its text: ``k/4`` where k is its number of 'x'."""

    def __init__(self, pool: CountingPool) -> None:
        self.pool = pool
        self.files: dict[str, bytes | str] = {}

    async def exec(self, cmd, *, timeout=None, stdin=None, env=None, workdir=None):
        await trio.sleep(0)
        self.pool.execs += 1
        if cmd == "score":
            return Result(0, f"{str(self.files.get('/work/solution.py', '')).count('x')}/4\n".encode())
        return Result(0)

    async def exec_many(self, programs, *, final=False):
        await trio.sleep(0)
        self.pool.exec_many.append(len(programs))
        out = []
        for p in programs:
            assert p.cmd == "score" and p.workdir == "/work"
            assert p.files["/work/given.txt"] == "setup file"  # the task's setup files go with each
            out.append(Result(0, f"{str(p.files['/work/solution.py']).count('x')}/4\n".encode()))
        return out

    async def write_files(self, files):
        await trio.sleep(0)
        self.pool.writes += 1
        self.files.update(files)

    async def read_file(self, path, *, max_bytes=1 << 20):
        return self.files[path]


class CountingPool:
    def __init__(self) -> None:
        self.leases = 0
        self.held = 0
        self.max_held = 0
        self.execs = 0
        self.writes = 0
        self.exec_many: list[int] = []

    @asynccontextmanager
    async def lease(self, image, limits):
        self.leases += 1
        self.held += 1
        self.max_held = max(self.max_held, self.held)
        try:
            yield CountingSandbox(self)
        finally:
            self.held -= 1


class SlotModel:
    """A model client whose per-attempt view knows its slot (the test harness uses it)."""

    def __init__(self, attempt_id: str = "") -> None:
        from fleetrl.actors.model import build_byte_tokenizer
        from fleetrl.harness.model import HFChatTokenizer

        self.attempt_id = attempt_id
        self._tok = HFChatTokenizer(build_byte_tokenizer())

    @property
    def tokenizer(self):
        return self._tok

    def for_attempt(self, attempt_id):
        view = SlotModel.__new__(SlotModel)
        view.attempt_id, view._tok = attempt_id, self._tok
        return view

    async def generate(self, prompt_ids, params):
        await trio.sleep(0)
        return example_generation(3, 2, vocab=259)


class SlotSolutions(msgspec.Struct, frozen=True):
    """The completion harness, then the solution file replaced by ``by_slot[slot]`` (a
    fixed completion per attempt, so two scoring paths can be compared)."""

    sandbox_use: ClassVar[str] = "files"
    by_slot: tuple[str, ...]

    async def run(self, task, sandbox, model):
        episode = await CompletionHarness(max_tokens=3).run(task, sandbox, model)
        slot = int(model.attempt_id.rsplit("/", 1)[1].split(".")[0])
        name = str(task.metadata.get("solution_file") or "solution.py")
        await sandbox.write_files({f"{task.workdir}/{name}": self.by_slot[slot]})
        return episode


class Toucher(msgspec.Struct, frozen=True):
    """A ``"lazy"`` harness that runs a command in its sandbox."""

    sandbox_use: ClassVar[str] = "lazy"

    async def run(self, task, sandbox, model):
        episode = await CompletionHarness(max_tokens=3).run(task, sandbox, model)
        await sandbox.exec("true", timeout=5)
        return episode


def worker(harness, pool, **cfg) -> tuple[_Worker, trio.MemoryReceiveChannel]:
    config = msgspec.convert({"model": {"kind": "local", "model_dir": "unused"}, **cfg}, EnvWorkerConfig)
    ctx = SimpleNamespace(log=structlog.get_logger(), metrics=ActorMetrics(MetricsRegistry(), "env"),
                          draining=False, name="env")
    send, recv = trio.open_memory_channel(100)
    w = _Worker(config, ctx, harness=harness, model=SlotModel(), pool=pool, out=send, failures_out=send,
                cursor=TaskCursor())
    return w, recv


TASK = Task(id="t", prompt="def f(x):\n", evaluator=Evaluator(command="score", reward="fraction"),
            setup=Setup(files={"given.txt": "setup file"}))
SOLUTIONS = ("x", "xxxx", "", "xx", "xxx", "x", "xxxx", "")


async def run_group(w: _Worker, recv, task: Task, timeout: float = 60):
    index = w.cursor.take()
    with trio.fail_after(timeout):
        await w.group(index, task, trio.Semaphore(0))
    msgs = []
    while True:
        try:
            msgs.append(recv.receive_nowait())
        except trio.WouldBlock:
            return msgs


def test_completion_harness_declares_files_only_use():
    assert sandbox_use_of(CompletionHarness()) == "files"
    assert sandbox_use_of(object()) == "eager"

    class Bad:
        sandbox_use = "sometimes"
    with pytest.raises(ValueError, match="Bad.sandbox_use = 'sometimes'"):
        sandbox_use_of(Bad())


async def test_a_group_costs_one_lease_and_one_exec_many():
    pool = CountingPool()
    w, recv = worker(SlotSolutions(by_slot=SOLUTIONS), pool, group_size=8, max_concurrent_attempts=8)
    (group,) = await run_group(w, recv, TASK)
    assert isinstance(group, RolloutGroup)
    assert group.rewards == tuple(s.count("x") / 4 for s in SOLUTIONS)
    assert pool.leases == 1 and pool.exec_many == [8]  # a regression to per-attempt scoring fails here
    assert pool.execs == 0 and pool.writes == 0


async def test_per_attempt_path_gives_the_same_rewards_at_one_lease_each():
    pool = CountingPool()
    w, recv = worker(SlotSolutions(by_slot=SOLUTIONS), pool, group_size=8, max_concurrent_attempts=8,
                     group_scoring=False)
    (group,) = await run_group(w, recv, TASK)
    assert group.rewards == tuple(s.count("x") / 4 for s in SOLUTIONS)
    assert pool.leases == 8 and pool.exec_many == [] and pool.execs == 8


async def test_setup_commands_take_the_lazy_per_attempt_path():
    pool = CountingPool()
    task = msgspec.structs.replace(TASK, setup=Setup(files={"given.txt": "setup file"}, commands=["prep"]))
    w, recv = worker(SlotSolutions(by_slot=SOLUTIONS[:3]), pool, group_size=3, max_concurrent_attempts=3)
    (group,) = await run_group(w, recv, task)
    assert group.rewards == (0.25, 1.0, 0.0)
    assert pool.leases == 3 and pool.exec_many == [] and pool.execs == 6  # "prep" and "score" each


async def test_lazy_harness_holds_no_sandbox_while_the_model_generates():
    class SlowModel(SlotModel):
        async def generate(self, prompt_ids, params):
            assert pool.held == 0, "a sandbox is held during generation"
            return await super().generate(prompt_ids, params)

    pool = CountingPool()
    w, recv = worker(Toucher(), pool, group_size=4, max_concurrent_attempts=4)
    w.model = SlowModel()
    (group,) = await run_group(w, recv, TASK)
    assert isinstance(group, RolloutGroup) and pool.leases == 4


async def test_scoring_failure_is_a_sandbox_error_of_every_attempt_of_the_batch():
    class Broken(CountingPool):
        @asynccontextmanager
        async def lease(self, image, limits):
            from fleetrl.sandboxes import SandboxStartError
            raise SandboxStartError("engine unreachable")
            yield

    w, recv = worker(SlotSolutions(by_slot=SOLUTIONS[:2]), Broken(), group_size=2, max_concurrent_attempts=2,
                     retry={"max_tries": {"sandbox_error": 1}})
    msgs = await run_group(w, recv, TASK)
    assert len(msgs) == 2 and all(isinstance(m, RolloutFailed) and m.reason == "sandbox_error" for m in msgs)
    assert all("engine unreachable" in m.detail for m in msgs)


async def test_a_file_the_sandbox_would_refuse_is_that_attempts_harness_crash():
    pool = CountingPool()
    sols = ("x", "xx", "xxx")

    class Escapes(SlotSolutions):
        async def run(self, task, sandbox, model):
            episode = await super().run(task, sandbox, model)
            if model.attempt_id.endswith("/1.1"):
                await sandbox.write_files({"/etc/evil": "x"})
            return episode
    w, recv = worker(Escapes(by_slot=sols), pool, group_size=3, max_concurrent_attempts=3)
    msgs = await run_group(w, recv, TASK)
    (failed,) = [m for m in msgs if isinstance(m, RolloutFailed)]
    assert failed.reason == "harness_crash" and "/etc/evil" in failed.detail and failed.attempt_id.endswith("/1.1")
    (group,) = [m for m in msgs if isinstance(m, RolloutGroup)]
    assert group.rewards == (0.25, 0.75) and pool.exec_many == [2]


def test_scoring_spec_merges_setup_and_attempt_files_and_refuses_outside_paths():
    spec = scoring_spec(TASK, {"/work/solution.py": "x", "given.txt": "overwritten"})
    assert spec.cmd == "score" and spec.workdir == "/work" and spec.timeout == TASK.evaluator.timeout_s
    assert dict(spec.files) == {"/work/given.txt": "overwritten", "/work/solution.py": "x"}
    assert scoring_spec(TASK, {"/etc/passwd": "x"}) is None
    assert scoring_spec(TASK, {"../escape": "x"}) is None
    assert scoring_spec(TASK, {"a/../b.py": "x"}) is None  # Sandbox.write_files refuses '..' too
    assert scoring_spec(TASK, {"/tmp/scratch": "x"}) is not None


# -- group commands -----------------------------------------------------------------------

GTASK = msgspec.structs.replace(TASK, evaluator=Evaluator(command="score", reward="fraction", timeout_s=7.0,
                                                          group_command="gscore"))


class GroupSandbox(CountingSandbox):
    """Runs "gscore" like a group command that reports only the first `pool.report`
    attempts and then dies without the closing line; "score" programs as before."""

    async def exec_many(self, programs, *, final=False):
        if programs[0].cmd != "gscore":
            return await super().exec_many(programs, final=final)
        await trio.sleep(0)
        (p,) = programs
        self.pool.group_specs.append(p)
        n = len({k.split("/")[3] for k in p.files if k.startswith("/work/.fleetrl-group/")})
        out = "".join(f"@@fleetrl-attempt {k} exit=0\n"
                      f"{str(p.files[f'/work/.fleetrl-group/{k}/solution.py']).count('x')}/4\n"
                      for k in range(min(n, self.pool.report)))
        return [Result(0, out.encode())]


class GroupPool(CountingPool):
    def __init__(self, report: int) -> None:
        super().__init__()
        self.report = report
        self.group_specs: list = []

    @asynccontextmanager
    async def lease(self, image, limits):
        self.leases += 1
        yield GroupSandbox(self)


def test_group_scoring_spec_places_each_attempt_under_its_index():
    spec = group_scoring_spec(GTASK, [{"/work/solution.py": "x"}, {"solution.py": "xx", "sub/a.txt": "b"}])
    assert spec.cmd == "gscore" and spec.workdir == "/work" and spec.timeout == 2 * 7.0
    assert dict(spec.files) == {"/work/given.txt": "setup file", "/work/.fleetrl-group/0/solution.py": "x",
                                "/work/.fleetrl-group/1/solution.py": "xx", "/work/.fleetrl-group/1/sub/a.txt": "b"}
    assert group_scoring_spec(TASK, [{"solution.py": "x"}]) is None  # no group command
    assert group_scoring_spec(GTASK, [{"solution.py": "x"}, {"/tmp/scratch": "x"}]) is None  # cannot be placed
    assert group_scoring_spec(GTASK, [{"../up": "x"}]) is None
    assert group_scoring_spec(GTASK, []) is None


@pytest.mark.parametrize("report", [8, 5, 0])
async def test_group_command_scores_the_group_and_what_it_misses_is_scored_alone(report):
    pool = GroupPool(report)
    w, recv = worker(SlotSolutions(by_slot=SOLUTIONS), pool, group_size=8, max_concurrent_attempts=8)
    (group,) = await run_group(w, recv, GTASK)
    assert group.rewards == tuple(s.count("x") / 4 for s in SOLUTIONS)
    assert len(pool.group_specs) == 1 and pool.leases == 1
    # the closing line never came, so the last reported section is not trusted either
    alone = 8 - max(0, report - 1)
    assert pool.exec_many == ([alone] if alone else [])


# -- real Docker --------------------------------------------------------------------------

HANG = "def f(x):\n    while True:\n        pass\n"
KILL_ALL = "import os\nos.kill(-1, 9)\n"  # kills every process of the sandbox user: the checker (no output:
# an evaluator_error on either path) and, in a batch, the runner (its siblings are run again alone)


@pytest.mark.docker
async def test_group_scoring_equals_per_attempt_scoring_in_docker(tmp_path):
    from fleetrl.sandboxes import Ownership, WarmPolicy, open_sandbox_pool

    task = make_task(3, "train", 0)
    good = solution_text(task, reference_solution(task))
    sols = (good, "def f(x):\n    return 0\n", HANG, good, KILL_ALL, good)
    outcomes = {}
    own = Ownership.for_state_dir(tmp_path, owner="test-group-scoring")
    async with open_sandbox_pool(own, policy=WarmPolicy(min_warm=0, max_warm=2, max_containers=8)) as pool:
        for mode in (True, False):
            w, recv = worker(SlotSolutions(by_slot=sols), pool, group_size=len(sols),
                             max_concurrent_attempts=len(sols), group_scoring=mode, sandbox={"memory_mb": 256},
                             retry={"max_tries": {"evaluator_error": 1}})
            msgs = await run_group(w, recv, task, timeout=400)
            (group,) = [m for m in msgs if isinstance(m, RolloutGroup)]
            by_slot = {int(t.attempt_id.rsplit("/", 1)[1].split(".")[0]): t.reward for t in group.trajectories}
            by_slot.update({int(m.attempt_id.rsplit("/", 1)[1].split(".")[0]): m.reason
                            for m in msgs if isinstance(m, RolloutFailed)})
            outcomes[mode] = by_slot
    assert outcomes[True] == outcomes[False]
    # siblings unharmed by a wrong, a hanging, and a process-killing solution
    assert outcomes[True] == {0: 1.0, 1: outcomes[True][1], 2: 0.0, 3: 1.0, 4: "evaluator_error", 5: 1.0}
    assert outcomes[True][1] < 1.0


ESCAPE = (  # a correct solution that leaves a sleeping process outside its process group; it
    # loads only once that process exists (else a quick check could kill the forker first)
    "import os, time\n"
    "r, w = os.pipe()\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(120)\n"
    "        os._exit(0)\n"
    "    os.write(w, b'x')\n"
    "    os._exit(0)\n"
    "os.read(r, 1)\n"
)


@pytest.mark.docker
async def test_the_synthetic_group_checker_stops_at_a_stray_process(tmp_path):
    """One run of the task's group command scores the attempts before and including a
    solution that leaves a process behind; the rest are scored alone in reset
    sandboxes, with the rewards a per-attempt scoring gives."""
    from fleetrl.actors.envworker import sandbox_limits
    from fleetrl.sandboxes import Ownership, WarmPolicy, open_sandbox_pool

    task = make_task(3, "train", 0)
    assert task.evaluator.group_command is not None
    good = solution_text(task, reference_solution(task))
    sols = [good, "def f(x):\n    return 0\n", ESCAPE + good, good, HANG]
    cfg = msgspec.convert({"model": {"kind": "local", "model_dir": "unused"}, "sandbox": {"memory_mb": 256}},
                          EnvWorkerConfig)
    own = Ownership.for_state_dir(tmp_path, owner="test-group-stray")
    async with open_sandbox_pool(own, policy=WarmPolicy(min_warm=0, max_warm=1, max_containers=2)) as pool:
        async with trio.open_nursery() as nursery:
            scorer = GroupScorer(pool, task, sandbox_limits(task, cfg.sandbox), nursery=nursery, scopes=set())
            results: list = [None] * len(sols)

            async def one(i: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
                task_status.started()
                results[i] = await scorer.score({"solution.py": sols[i]})  # joins the batch in index order

            for _ in sols:
                scorer.join()
            with trio.fail_after(300):
                async with trio.open_nursery() as inner:
                    for i in range(len(sols)):
                        await inner.start(one, i)
    assert [r.reward for r in results] == [1.0, results[1].reward, 1.0, 1.0, 0.0]
    assert results[1].reward < 1.0
    assert scorer.group_runs == 1 and scorer.group_reported == 3  # attempts 3 and 4 were scored alone
