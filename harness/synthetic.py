"""The synthetic coding tasks of the embedded default, as `Task`s.

Each task asks a model to complete `def f(x):` from a few input/output examples; its
hidden tests (other inputs) run in the sandbox and the reward is the fraction passed.
The families, the splits and how one task is drawn are in `synthetic_families`; this
module turns a draw into a `Task` (prompt, setup, evaluator), streams tasks
deterministically with a resumable cursor, and gives the supervised warm-up its
reference completions. docs/synthetic-tasks.md describes the format end to end.

Prompt and completion (a raw completion, no chat template)::

    # f(0)=3 f(1)=4 f(4)=7 f(9)=12 f(13)=16     <- prompt: the examples on one line
    def f(x):
        return x + 3                             <- completion: the body ...
    <eos>                                        <- ... then the stop marker

The prompt is compact (about 50 bytes) because the model is a ~2M-parameter byte-level
model: every byte is a token, and the examples are what it must read (docs/warmup.md
has the measurements that chose this layout over a verbose one).

The model writes the indented body after the signature line and stops with the
tokenizer's end-of-sequence token (`STOP_MARKER`, "<eos>": the byte tokenizer encodes
that text to its EOS id). `reference_solution` returns exactly that text.

Evaluation: the harness writes `solution.py` in the workdir (the prompt followed by
the completion, the convention of `fleetrl.harness.humaneval_tasks`); the evaluator
`python3 -I -S .synthetic_check.py` (a stdlib-only script written by setup) prints
its verdicts and, last, `passed/total` (reward kind "fraction"). It runs the solution
in a forked child, one test at a time with a per-test deadline; a test that times out
or kills the child fails and a fresh child runs the remaining tests, so code that
raises, loops, exits, prints junk or defines the wrong name only loses points.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from .synthetic_families import (
    FAMILIES,
    FAMILY_BY_NAME,
    SPLITS,
    DrawnTask,
    Split,
    TaskFamilySpec,
    draw_task,
)
from .tasks import GROUP_DIR, Evaluator, Limits, Setup, Source, Task, reward_from_evaluator

__all__ = [
    "CHECK_FILE",
    "ENTRY_POINT",
    "FAMILIES",
    "EXAMPLES_PREFIX",
    "SIGNATURE",
    "SOLUTION_FILE",
    "SPLITS",
    "STOP_MARKER",
    "CheckConfig",
    "LocalCheck",
    "Split",
    "SyntheticTaskError",
    "TaskFamilySpec",
    "TaskStream",
    "check_script",
    "generate_tasks",
    "is_eval_reserved",
    "make_task",
    "prompt_for",
    "reference_solution",
    "run_check_locally",
    "score_completion_locally",
    "solution_text",
    "task_stream",
]

ENTRY_POINT: Final = "f"
SIGNATURE: Final = f"def {ENTRY_POINT}(x):"
EXAMPLES_PREFIX: Final = "# "
"""Starts the prompt's first line, a comment listing the examples as `f(x)=y`."""
STOP_MARKER: Final = "<eos>"
"""Ends a completion: the byte tokenizer's EOS token as text. The checker cuts the
solution at its first occurrence, so a sampler may return it or strip it."""
SOLUTION_FILE: Final = "solution.py"
"""Where the harness writes prompt + completion (same convention as human-eval tasks)."""
CHECK_FILE: Final = ".synthetic_check.py"
EVAL_RESERVED_BUCKETS: Final = 8
"""One prompt in this many (by hash) is reserved for the fresh evaluation split and
never appears in the training stream."""
MAX_SPLIT_DRAWS: Final = 10_000


class SyntheticTaskError(ValueError):
    """A Task given to a synthetic-task function is not a valid synthetic task."""


@dataclass(frozen=True, slots=True)
class CheckConfig:
    """Deadlines of the checker, in seconds.

    `per_test_s` bounds one hidden test (a call of f that takes microseconds when it
    terminates); `startup_s` bounds starting a child and loading the solution;
    `budget_s` bounds the whole check (tests not reached by then fail), well under
    the evaluator's timeout so that the checker always prints its verdict itself.
    `memory_bytes` is the child's address-space limit (MemoryError beyond it).
    """

    per_test_s: float = 0.5
    startup_s: float = 5.0
    budget_s: float = 12.0
    memory_bytes: int = 256 * 1024 * 1024
    evaluator_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("per_test_s", "startup_s", "budget_s", "evaluator_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"CheckConfig.{name} must be > 0, got {value!r}")
        if self.budget_s + 5 > self.evaluator_timeout_s:
            raise ValueError(
                f"CheckConfig.budget_s ({self.budget_s}) must leave at least 5 s under "
                f"evaluator_timeout_s ({self.evaluator_timeout_s})"
            )
        if self.memory_bytes < 64 * 1024 * 1024:
            raise ValueError(f"CheckConfig.memory_bytes must be >= 64 MiB, got {self.memory_bytes}")


DEFAULT_CHECK: Final = CheckConfig()

# ---------------------------------------------------------------------------- prompt


def prompt_for(task: Task | DrawnTask) -> str:
    """The prompt of a synthetic task: one comment line with the shown examples
    (sorted by x, `f(x)=y` separated by spaces), then the signature line; the model
    continues with the body."""
    if isinstance(task, Task):
        _target_of(task)  # validates that it is one of ours
        assert task.prompt is not None
        return task.prompt
    examples = " ".join(f"{ENTRY_POINT}({x})={y}" for x, y in task.shown)
    return f"{EXAMPLES_PREFIX}{examples}\n{SIGNATURE}\n"


def is_eval_reserved(prompt: str) -> bool:
    """Whether a prompt belongs to the fresh evaluation split's share of the prompt
    space (a hash bucket); the training stream never produces such a prompt."""
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % EVAL_RESERVED_BUCKETS == 0


# ---------------------------------------------------------------------------- checker

_CHECKER = r'''
import os, select, time

SIGKILL = 9  # POSIX; not `import signal`, whose enum set-up doubles the start-up time


def solution_module(path):
    # solution.py cut at the stop marker; a bare body (first non-blank line
    # indented) is put under the prompt.
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as err:
        return None, "cannot read %s: %s" % (SOLUTION, type(err).__name__)
    cut = text.find(STOP)
    if cut >= 0:
        text = text[:cut]
    if text.startswith(PROMPT):
        return text, ""
    first = next((line for line in text.splitlines() if line.strip()), "")
    if first[:1] in (" ", "\t"):
        return PROMPT + text, ""
    return text, ""


def serve(module, requests, replies):
    # The forked child: load the solution, then answer one test per request line.
    # Its stdio goes to /dev/null; it never returns into the checker's code.
    try:
        os.setsid()
        try:  # die with the checker: a checker killed from outside must not leave us running
            import ctypes  # already loaded in group mode (protect)
            ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL (Linux)
        except Exception:
            pass
        if os.getppid() == 1:
            os._exit(1)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        try:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
        except Exception:
            pass
        out = os.fdopen(replies, "w", buffering=1)
        inp = os.fdopen(requests, "r")
        namespace = {"__name__": "__solution__"}
        try:
            exec(compile(module, SOLUTION, "exec"), namespace)
            fn = namespace[ENTRY]
            if not callable(fn):
                raise TypeError(ENTRY + " is not callable")
        except BaseException as err:
            out.write("load-error %s\n" % type(err).__name__)
            return
        out.write("ready\n")
        for line in inp:
            x, want = TESTS[int(line)]
            try:
                got = fn(x)
                # exact type: True for 1 or 1.0 for 1 is a wrong answer
                reply = "pass" if type(got) is type(want) and got == want else "wrong"
            except BaseException:
                reply = "raised"
            out.write(reply + "\n")
    finally:
        os._exit(0)


class Child:
    # A forked process running the solution (fork: no interpreter start-up per
    # child); killed with its whole process group when done or stuck.

    def __init__(self, module):
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.req_w)
            os.close(self.rep_r)
            serve(module, req_r, rep_w)
        os.close(req_r)
        os.close(rep_w)
        self.buf = b""
        self.status = None

    def send(self, index):
        try:
            os.write(self.req_w, b"%d\n" % index)
        except OSError:
            pass  # the child is gone; reply() sees end of file

    def reply(self, deadline):
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.rep_r], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.rep_r, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("ascii", "replace")

    def exited(self):
        pid, _ = os.waitpid(self.pid, os.WNOHANG)
        return pid != 0

    def close(self):
        for sig_target in (lambda: os.killpg(self.pid, SIGKILL), lambda: os.kill(self.pid, SIGKILL)):
            try:
                sig_target()
            except OSError:
                pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        os.close(self.req_w)
        os.close(self.rep_r)


def check(module, why):
    # The verdict lines of one solution (module text, or None and why not).
    end = time.monotonic() + BUDGET_S
    verdicts = ["skipped"] * len(TESTS)
    i = 0
    while module is not None and i < len(TESTS) and time.monotonic() < end:
        child = Child(module)
        try:
            hello = child.reply(min(end, time.monotonic() + STARTUP_S))
            if hello != "ready":
                why = "load failed: %s" % (hello or "no answer")
                break
            while i < len(TESTS) and time.monotonic() < end:
                child.send(i)
                got = child.reply(min(end, time.monotonic() + PER_TEST_S))
                i += 1
                if got is None:
                    verdicts[i - 1] = "died" if child.exited() else "timeout"
                    break  # a fresh child runs the remaining tests
                verdicts[i - 1] = got if got in ("pass", "wrong", "raised") else "garbled"
        finally:
            child.close()
    passed = verdicts.count("pass")
    detail = " ".join("%s:%s" % (x, v) for (x, _), v in zip(TESTS, verdicts))
    return "synthetic check: %s%s\n%d/%d\n" % (detail, (" (" + why + ")") if why else "", passed, len(TESTS))


def protect():
    # Group mode: not dumpable, so no solution process can read our memory or
    # open our stdout through /proc (same user), even one that escaped its group.
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0 (Linux)
    except Exception:
        pass


def strays(keep):
    # Live processes of our user that are neither us, our ancestors, PID 1 nor in
    # `keep` (those that ran before the first solution).
    uid, me, found = os.getuid(), os.getpid(), []
    mine, pid = set(), me
    while pid > 1 and pid not in mine:  # us and our ancestors
        mine.add(pid)
        try:
            with open("/proc/%d/stat" % pid, "rb") as fh:
                stat = fh.read()
            pid = int(stat[stat.rfind(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in mine or int(name) in keep or name == "1":
            continue
        try:  # the real uid from status: /proc/PID itself is root's when PID is not dumpable
            with open("/proc/%s/status" % name, "rb") as fh:
                status = fh.read()
            with open("/proc/%s/stat" % name, "rb") as fh:
                stat = fh.read()
            real_uid = int(status.split(b"\nUid:", 1)[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue  # gone
        if real_uid != uid:
            continue
        if stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] not in (b"Z", b"X"):
            found.append(int(name))
    return set(found)


def group(root):
    # Every attempt directory root/<k>/ in index order: all solutions are read first,
    # then each is checked in its own forked children as alone; each section is
    # printed whole after its header. A process of a solution that outlives its
    # check (escaped its process group) ends the run: the attempts not reported are
    # then checked alone by the caller, each in a fresh sandbox.
    protect()
    names = sorted((n for n in os.listdir(root) if n.isdigit()), key=int)
    solutions = [solution_module(os.path.join(root, n, SOLUTION)) for n in names]
    before = strays(set())
    for name, (module, why) in zip(names, solutions):
        text = check(module, why)
        os.write(1, ("@@fleetrl-attempt %s exit=0\n%s" % (name, text)).encode())
        left = strays(before)
        for _ in range(20):  # a killed process group takes a moment to be gone
            if not left:
                break
            time.sleep(0.005)
            left = strays(before)
        if left:
            break
    os.write(1, b"@@fleetrl-attempt end\n")


def main():
    import sys
    if len(sys.argv) == 3 and sys.argv[1] == "--group":
        group(sys.argv[2])
    else:
        os.write(1, check(*solution_module(SOLUTION)).encode())


main()
'''


def check_script(drawn: DrawnTask, prompt: str, check: CheckConfig = DEFAULT_CHECK) -> str:
    """The self-contained checker (stdlib only) for one task: its constants, then the
    fixed checker code. The last stdout line is `passed/total`."""
    header = [
        "# Generated by fleetrl.harness.synthetic: runs the hidden tests of one task",
        f"# against {SOLUTION_FILE}; prints the verdicts, then 'passed/total'.",
        f"SOLUTION = {SOLUTION_FILE!r}",
        f"PROMPT = {prompt!r}",
        f"STOP = {STOP_MARKER!r}",
        f"ENTRY = {ENTRY_POINT!r}",
        f"TESTS = {[list(t) for t in drawn.hidden]!r}",
        f"PER_TEST_S = {check.per_test_s!r}",
        f"STARTUP_S = {check.startup_s!r}",
        f"BUDGET_S = {check.budget_s!r}",
        f"MEMORY = {check.memory_bytes!r}",
    ]
    return "\n".join(header) + "\n" + _CHECKER


# ---------------------------------------------------------------------------- tasks


def _rng(seed: int, split: Split, index: int) -> random.Random:
    # A str seed is hashed with SHA-512 by random.seed: stable across processes and
    # Python versions, and task i depends on (seed, split, i) only (O(1) resume).
    return random.Random(f"fleetrl.synthetic/{split}/{seed}/{index}")


def _check_args(split: object, seed: object, index: object, name: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{name} must be an int >= 0, got {index!r}")


def make_task(seed: int, split: Split, index: int, *, check: CheckConfig = DEFAULT_CHECK) -> Task:
    """Task number `index` of the `split` stream of `seed` (pure and deterministic).

    train: parameters outside the held-out set, prompts outside the reserved hash
    bucket. fresh: the same families and parameters, prompts inside the reserved
    bucket (so never a training prompt). general: held-out parameters only.
    """
    _check_args(split, seed, index, "index")
    rng = _rng(seed, split, index)
    for _ in range(MAX_SPLIT_DRAWS):
        drawn = draw_task(rng, split)
        prompt = prompt_for(drawn)
        if split == "general" or is_eval_reserved(prompt) == (split == "fresh"):
            break
    else:  # pragma: no cover - probability (7/8)**10000
        raise RuntimeError(f"no {split} task found after {MAX_SPLIT_DRAWS} draws")
    fam = FAMILY_BY_NAME[drawn.family]
    metadata: dict[str, str | int | float | bool | None] = {
        "family": drawn.family,
        "params": ",".join(f"{n}={v}" for n, v in zip(fam.param_names, drawn.params, strict=True)),
        "split": split,
        "seed": seed,
        "index": index,
        "shown_inputs": ",".join(str(x) for x, _ in drawn.shown),
        "hidden_inputs": ",".join(str(x) for x, _ in drawn.hidden),
    }
    return Task(
        id=f"synthetic/{split}/{seed}/{index}",
        prompt=prompt,
        setup=Setup(files={CHECK_FILE: check_script(drawn, prompt, check)}),
        evaluator=Evaluator(
            command=f"python3 -I -S {CHECK_FILE}", timeout_s=check.evaluator_timeout_s, reward="fraction",
            group_command=f"python3 -I -S {CHECK_FILE} --group {GROUP_DIR}",
        ),
        limits=Limits(timeout_s=60.0, max_turns=1),
        metadata=metadata,
        source=Source(kind="synthetic", ref=f"{split}/{seed}/{index}"),
    )


def generate_tasks(
    n: int, *, split: Split, seed: int, start: int = 0, check: CheckConfig = DEFAULT_CHECK
) -> list[Task]:
    """Tasks `start .. start+n-1` of the `split` stream of `seed`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    _check_args(split, seed, start, "start")
    return [make_task(seed, split, start + i, check=check) for i in range(n)]


class TaskStream(Iterator[Task]):
    """The infinite, deterministic training stream of one seed.

    `cursor` is the index of the next task; a trainer checkpoints it and resumes with
    `task_stream(seed, start=cursor)`, which yields exactly the tasks it would have.
    """

    def __init__(
        self, seed: int, start: int = 0, split: Split = "train", check: CheckConfig = DEFAULT_CHECK
    ) -> None:
        _check_args(split, seed, start, "start")
        self.seed = seed
        self.split: Split = split
        self.cursor = start
        self.check = check

    def __next__(self) -> Task:
        task = make_task(self.seed, self.split, self.cursor, check=self.check)
        self.cursor += 1
        return task

    def __iter__(self) -> TaskStream:
        return self


def task_stream(seed: int, start: int = 0, *, check: CheckConfig = DEFAULT_CHECK) -> TaskStream:
    """The training stream of `seed` from task number `start` on."""
    return TaskStream(seed, start, check=check)


# ---------------------------------------------------------------------------- solutions


def _target_of(task: Task) -> tuple[TaskFamilySpec, tuple[int, ...]]:
    """The family and parameters a synthetic task asks for, from its metadata;
    SyntheticTaskError naming the field if the task is not one of ours."""
    meta = task.metadata
    where = f"task {task.id!r}"
    if task.source is None or task.source.kind != "synthetic":
        raise SyntheticTaskError(f"{where}: not a synthetic task (source.kind must be 'synthetic')")
    family = meta.get("family")
    if not isinstance(family, str) or family not in FAMILY_BY_NAME:
        raise SyntheticTaskError(f"{where}: metadata.family {family!r} is not a synthetic family")
    fam = FAMILY_BY_NAME[family]
    raw = meta.get("params")
    try:
        pairs = dict(item.split("=", 1) for item in str(raw).split(","))
        params = tuple(int(pairs[name]) for name in fam.param_names)
    except (ValueError, KeyError):
        raise SyntheticTaskError(
            f"{where}: metadata.params {raw!r} does not give {', '.join(fam.param_names)} as name=int"
        ) from None
    if task.prompt is None:
        raise SyntheticTaskError(f"{where}: prompt is missing")
    return fam, params


def reference_solution(task: Task) -> str:
    """The correct completion, exactly as the model must produce it: the indented
    body `    return <expr>` and a newline, then STOP_MARKER."""
    fam, params = _target_of(task)
    return f"    return {fam.expression(params)}\n{STOP_MARKER}"


def solution_text(task: Task, completion: str) -> str:
    """What the harness writes to SOLUTION_FILE for a completion: prompt + completion."""
    _target_of(task)
    assert task.prompt is not None  # checked by _target_of
    return task.prompt + completion


@dataclass(frozen=True, slots=True)
class LocalCheck:
    """What the evaluator command did when run locally: exit code and stdout."""

    exit_code: int
    stdout: str


def run_check_locally(task: Task, solution: str, *, python: str | None = None) -> LocalCheck:
    """Run a synthetic task's evaluator as the sandbox would, in a temporary
    directory on this machine: setup files written, `solution` written to
    SOLUTION_FILE, the evaluator command run there with `sh -c`.

    `python3` in the command is `python` (default: the interpreter running this code,
    symlinked under a private bin directory first on PATH, so no version-manager
    shim slows each call). Raises SyntheticTaskError for a task that is not
    synthetic or a checker that overruns the evaluator's timeout.
    """
    _target_of(task)
    interpreter = os.path.realpath(python if python is not None else sys.executable)
    with tempfile.TemporaryDirectory(prefix="fleetrl-synthetic-") as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        (bin_dir / "python3").symlink_to(interpreter)
        root = Path(tmp) / "work"
        root.mkdir()
        for rel, content in task.setup.files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")
        (root / SOLUTION_FILE).write_text(solution, encoding="utf-8")
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        try:
            done = subprocess.run(
                ["sh", "-c", task.evaluator.command],
                cwd=root,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=task.evaluator.timeout_s,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise SyntheticTaskError(
                f"task {task.id!r}: the checker ran past the evaluator timeout "
                f"({task.evaluator.timeout_s} s)"
            ) from None
    return LocalCheck(done.returncode, done.stdout.decode("utf-8", errors="replace"))


def score_completion_locally(task: Task, completion: str, *, python: str | None = None) -> float:
    """The reward of a model's `completion` for `task`, computed by the task's own
    evaluator in a local subprocess (see `run_check_locally`): the harness's
    SOLUTION_FILE (prompt + completion) is checked and the last stdout line,
    `passed/total`, read by `reward_from_evaluator`.

    For tests and quick evaluations; the real rewards are computed in Docker
    sandboxes by the environment workers. Raises `EvaluatorOutputError` if the
    checker's output is malformed (a checker bug, never the model's fault).
    """
    done = run_check_locally(task, solution_text(task, completion), python=python)
    return reward_from_evaluator(task, done.exit_code, done.stdout)
