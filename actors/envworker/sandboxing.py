"""How an attempt gets (or does not get) a sandbox: lazy leases and group scoring.

* `LazySandbox`: a `SandboxLike` proxy for harnesses that declare ``sandbox_use =
  "lazy"`` or ``"files"`` (harness.protocol). It leases a sandbox from the worker's pool
  and prepares it (the task's setup files and commands) on the harness's first call,
  so no container is held while the model generates. The time spent leasing and
  preparing is added back to the harness's budget (``budget``: its cancel scope).
* `FileRecorder`: the "sandbox" of a ``"files"`` harness whose task has no setup
  commands: it only records what the harness writes.
* `GroupScorer`: scores the recorded files of one group's attempts in one leased
  sandbox. When the task's evaluator has a ``group_command`` (harness.tasks), ONE run
  of it scores every attempt (each attempt's files under ``GROUP_DIR/<k>/``; the
  command isolates the attempts, e.g. the synthetic checker: docs/reference/synthetic-tasks.md);
  attempts its output does not report are scored as below. Otherwise ONE
  ``Sandbox.exec_many``: each attempt is one program: files = the task's setup files +
  the attempt's files, cmd = the task's evaluator, timeout = the evaluator's; the
  runner resets the sandbox before each program, so an attempt sees nothing of its
  siblings (docs/reference/sandboxes.md, "Batches"). Rewards come from the same
  ``tasks.reward_from_evaluator`` as one exec each. With the worker's
  `score_batches.ScoreBatcher` (``score_batching.max_groups > 1``) those programs run
  as a job batched with other groups' jobs in one lease and one ``exec_many``.

`scoring_spec` and `group_scoring_spec` are pure (task + files -> `ExecSpec`, or None
when they cannot be batched that way).
"""

from __future__ import annotations

import posixpath
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import msgspec
import trio

from fleetrl.harness.protocol import SetupFailed, prepare_sandbox
from fleetrl.harness.tasks import GROUP_DIR, EvaluatorOutputError, Task, reward_from_evaluator, split_group_output
from fleetrl.sandboxes import ExecSpec, Limits, SandboxError

from .errors import FilesOnlyError
from .score_batches import ScoreBatcher

__all__ = ["FileRecorder", "FilesOnlyError", "GroupScorer", "LazySandbox", "Scored", "ScoringFailed",
           "group_scoring_spec", "scoring_spec"]


class Scored(msgspec.Struct, frozen=True):
    """An evaluator that ran: reward, exit code (-1 when killed)."""

    reward: float
    exit_code: int


class ScoringFailed(msgspec.Struct, frozen=True):
    """No reward: ``kind`` is ``sandbox_error``, ``evaluator_error`` or (a file the
    sandbox refuses) ``harness_crash`` (envworker.policy)."""

    kind: str
    detail: str


def _placed(task: Task, path: str, *, tmp: bool) -> str | None:
    """The absolute path a file written at `path` lands at, or None where it may not be
    placed: a ``..`` component, or outside the workdir (and /tmp, when `tmp`)."""
    wd = posixpath.normpath(task.workdir)
    full = posixpath.normpath(posixpath.join(wd, path))
    if ".." in path.split("/") or not (full.startswith(wd + "/") or (tmp and full.startswith("/tmp/"))):
        return None
    return full


def scoring_spec(task: Task, files: Mapping[str, bytes | str]) -> ExecSpec | None:
    """The `ExecSpec` that scores an attempt at `task` that wrote `files` (paths absolute
    or relative to the workdir): the task's setup files, then the attempt's (which win),
    then the evaluator's hidden ``files`` (which win over both), then the task's
    evaluator command. None when a path is one ``Sandbox.write_files`` refuses
    (a ``..`` component, or outside the workdir and /tmp): on the per-attempt path the
    harness's ``write_files`` raises then, a harness crash."""
    merged: dict[str, bytes | str] = {}
    for name, content in [*task.setup.files.items(), *files.items()]:
        full = _placed(task, name, tmp=True)
        if full is None:
            return None
        merged[full] = content
    merged.update(_evaluator_files(task))
    return ExecSpec(cmd=task.evaluator.command, timeout=task.evaluator.timeout_s, workdir=task.workdir,
                    files=merged)


def _evaluator_files(task: Task) -> dict[str, bytes | str]:
    """The evaluator's hidden files at their absolute paths (the task's validation put
    them under the workdir or /tmp); written after the attempt's, so they win."""
    wd = posixpath.normpath(task.workdir)
    return {name if name.startswith("/") else posixpath.join(wd, name): content
            for name, content in task.evaluator.files.items()}


def group_scoring_spec(task: Task, attempts: list[Mapping[str, bytes | str]]) -> ExecSpec | None:
    """The `ExecSpec` of one run of the task's ``group_command`` over `attempts` (each
    one's recorded files): the setup files in the workdir, attempt ``k``'s files under
    ``<workdir>/GROUP_DIR/<k>/`` at their paths relative to the workdir; the timeout is
    the evaluator's per attempt. None when the task has no group command, or an attempt
    wrote a file that cannot be placed there (outside the workdir, e.g. /tmp, or a path
    ``scoring_spec`` refuses): such a group is scored one program per attempt."""
    command = task.evaluator.group_command
    setup = scoring_spec(task, {})  # the task's setup files and the evaluator's, placed
    if command is None or not attempts or setup is None:
        return None
    wd = posixpath.normpath(task.workdir)
    merged = dict(setup.files)
    for k, files in enumerate(attempts):
        for name, content in files.items():
            full = _placed(task, name, tmp=False)
            if full is None:
                return None
            merged[posixpath.join(wd, GROUP_DIR, str(k), posixpath.relpath(full, wd))] = content
    merged.update(_evaluator_files(task))
    return ExecSpec(cmd=command, timeout=task.evaluator.timeout_s * len(attempts), workdir=task.workdir,
                    files=merged)


def _score(task: Task, exit_code: int | None, stdout: bytes | None) -> Scored | ScoringFailed:
    code = -1 if exit_code is None else int(exit_code)
    try:
        return Scored(reward_from_evaluator(task, code, (stdout or b"").decode(errors="replace")), code)
    except EvaluatorOutputError as exc:
        return ScoringFailed("evaluator_error", str(exc))


class FileRecorder:
    """Records the files a ``"files"`` harness writes (see the module docstring)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes | str] = {}

    async def write_files(self, files: Mapping[str, bytes | str]) -> None:
        await trio.lowlevel.checkpoint()
        for path, content in files.items():
            if not isinstance(path, str) or not isinstance(content, (str, bytes, bytearray)):
                raise TypeError(f"write_files: {path!r} -> {type(content).__name__}: paths must be str and "
                                "contents bytes or str")
        self.files.update({k: bytes(v) if isinstance(v, bytearray) else v for k, v in files.items()})

    async def exec(self, cmd: Any, *, timeout: Any = None, stdin: Any = None, env: Any = None,
                   workdir: Any = None) -> Any:
        raise FilesOnlyError(f"harness declared sandbox_use = 'files' but called exec({cmd!r})")

    async def read_file(self, path: str, *, max_bytes: int = 1 << 20) -> bytes:
        raise FilesOnlyError(f"harness declared sandbox_use = 'files' but called read_file({path!r})")


class LazySandbox:
    """Leases and prepares a sandbox on first use (see the module docstring).

    Use as ``async with LazySandbox(...) as sb``: leaving releases the lease (if one was
    taken). ``setup_error`` holds a `SetupFailed` raised while preparing, so the worker
    classifies it as a sandbox error even when the harness swallowed the exception."""

    def __init__(self, pool: Any, task: Task, limits: Limits, *, setup_timeout_s: float) -> None:
        self._pool = pool
        self._task = task
        self._limits = limits
        self._setup_timeout_s = setup_timeout_s
        self._stack = AsyncExitStack()
        self._sb: Any = None
        self._lock = trio.Lock()
        self.budget: trio.CancelScope | None = None
        self.setup_error: SetupFailed | None = None
        self.sandbox_error: SandboxError | None = None

    @property
    def leased(self) -> bool:
        return self._sb is not None

    async def __aenter__(self) -> LazySandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.__aexit__(*exc)  # type: ignore[arg-type]

    async def get(self) -> Any:
        """The leased, prepared sandbox (leased now if it was not yet)."""
        async with self._lock:
            if self._sb is None:
                deadline = self.budget.deadline if self.budget is not None else None
                if self.budget is not None:
                    self.budget.deadline = float("inf")  # leasing and setup are not the harness's time
                t0 = trio.current_time()
                try:
                    sb = await self._stack.enter_async_context(self._pool.lease(self._task.image, self._limits))
                    try:
                        await prepare_sandbox(self._task, sb, timeout_s=self._setup_timeout_s)
                    except SetupFailed as exc:
                        self.setup_error = exc
                        raise
                    self._sb = sb
                except SandboxError as exc:
                    self.sandbox_error = exc
                    raise
                finally:
                    if self.budget is not None and deadline is not None:
                        self.budget.deadline = deadline + (trio.current_time() - t0)
            return self._sb

    async def exec(self, cmd: Any, *, timeout: Any = None, stdin: Any = None, env: Any = None,
                   workdir: Any = None) -> Any:
        return await (await self.get()).exec(cmd, timeout=timeout, stdin=stdin, env=env, workdir=workdir)

    async def write_files(self, files: Mapping[str, bytes | str]) -> None:
        await (await self.get()).write_files(files)

    async def read_file(self, path: str, *, max_bytes: int = 1 << 20) -> bytes:
        return await (await self.get()).read_file(path, max_bytes=max_bytes)


class _Entry:
    __slots__ = ("done", "files", "result")

    def __init__(self, files: Mapping[str, bytes | str]) -> None:
        self.files = dict(files)
        self.done = trio.Event()
        self.result: Scored | ScoringFailed | None = None


class GroupScorer:
    """Batches the scoring of one group's attempts (see the module docstring).

    Every attempt that may be scored here calls `join` when it starts and then exactly
    one of `score` (its recorded files; waits for the result) or `leave` (it ended
    without reaching scoring). A batch is run as soon as every joined attempt has
    either submitted or left, so attempts that are still generating are waited for,
    and a retry that starts later forms a batch of its own. No timers: the batch is
    complete by construction."""

    def __init__(self, pool: Any, task: Task, limits: Limits, *, nursery: trio.Nursery,
                 scopes: set[trio.CancelScope], batcher: ScoreBatcher | None = None) -> None:
        self._pool = pool
        self._batcher = batcher
        self._nursery = nursery
        self._scopes = scopes
        self._task = task
        self._limits = limits
        self._active = 0
        self._waiting: list[_Entry] = []
        self.batches: list[int] = []
        """Size of each batch run (for metrics and tests)."""
        self.group_runs = 0
        """Batches scored by the task's ``group_command`` (for metrics and tests)."""
        self.group_reported = 0
        """Attempts those runs reported (the others were scored alone)."""

    def join(self) -> None:
        self._active += 1

    def leave(self) -> None:
        self._active -= 1
        self._maybe_flush()

    async def score(self, files: Mapping[str, bytes | str]) -> Scored | ScoringFailed:
        """Score one attempt's recorded files (call after `join`)."""
        entry = _Entry(files)
        self._waiting.append(entry)
        self._active -= 1
        self._maybe_flush()
        await entry.done.wait()
        assert entry.result is not None
        return entry.result

    def _maybe_flush(self) -> None:
        if self._active == 0 and self._waiting:
            batch, self._waiting = self._waiting, []
            self._nursery.start_soon(self._run_guarded, batch)

    async def _run_guarded(self, batch: list[_Entry]) -> None:
        results: list[Scored | ScoringFailed] | None = None
        scope = trio.CancelScope()
        self._scopes.add(scope)  # the worker cancels these with the attempts at the drain deadline
        try:
            with scope:
                try:
                    results = await self._run(batch)
                except SandboxError as exc:
                    results = [ScoringFailed("sandbox_error", f"{type(exc).__name__}: {exc}")] * len(batch)
        finally:
            self._scopes.discard(scope)
            if results is None:
                results = [ScoringFailed("sandbox_error", "scoring cancelled")] * len(batch)
            for e, r in zip(batch, results):
                e.result = r
                e.done.set()

    async def _run(self, batch: list[_Entry]) -> list[Scored | ScoringFailed]:
        specs = [scoring_spec(self._task, e.files) for e in batch]
        self.batches.append(len(batch))
        out: list[Scored | ScoringFailed | None] = [None] * len(batch)
        together = [i for i, s in enumerate(specs) if s is not None]
        group = group_scoring_spec(self._task, [batch[i].files for i in together]) if len(together) > 1 else None
        if together:
            async with self._programs() as run:
                if group is not None:
                    (r,) = await run([group])
                    together = self._take_group_output(r, together, out)
                if together:
                    rs = await run([specs[i] for i in together])
                    for i, r in zip(together, rs):
                        out[i] = _score(self._task, r.exit_code, r.stdout)
        for i, s in enumerate(specs):
            if s is None:  # what Sandbox.write_files refuses, in the harness, on the per-attempt path
                out[i] = ScoringFailed("harness_crash", "the harness wrote a file outside the work dir "
                                       f"{self._task.workdir} and /tmp: {sorted(batch[i].files)}")
        return [r for r in out if r is not None]

    @asynccontextmanager
    async def _programs(self) -> AsyncIterator[Callable[[list[ExecSpec]], Awaitable[list[Any]]]]:
        """How this group's programs run: in one lease of its own (each call one
        ``exec_many(final=True)``), or as jobs of the worker's `ScoreBatcher` (batched
        with other groups' jobs)."""
        if self._batcher is not None:
            batcher = self._batcher

            async def shared(specs: list[ExecSpec]) -> list[Any]:
                return await batcher.exec_many(self._task.image, self._limits, specs)
            yield shared
            return
        async with self._pool.lease(self._task.image, self._limits) as sb:
            async def own(specs: list[ExecSpec]) -> list[Any]:
                return await sb.exec_many(specs, final=True)
            yield own

    def _take_group_output(self, r: Any, together: list[int], out: list[Scored | ScoringFailed | None]) -> list[int]:
        """Score the attempts the group command's run `r` reported; the others are left."""
        self.group_runs += 1
        reported = split_group_output((r.stdout or b"").decode(errors="replace"), len(together))
        for k, (code, text) in reported.items():
            out[together[k]] = _score(self._task, code, text.encode())
        self.group_reported += len(reported)
        return [i for k, i in enumerate(together) if k not in reported]
