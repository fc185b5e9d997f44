"""Cost of sandboxed rollouts of a single-shot harness: per-attempt sandboxes vs lazy
leases with group scoring (issue 8).

    .venv/bin/python bench/rollouts.py [--groups 8] [--group-size 8] [--concurrency 16] [--rounds 2]

The same synthetic attempts (``groups x group-size``, default 64; fixed completions,
no model: half the slots write the reference solution, the others a wrong or a broken
one) go through the environment worker's real attempt path (`_Worker.group`) against
real Docker sandboxes of one warm pool per mode:

  baseline: ``lazy_sandbox = false, group_scoring = false``: every attempt leases a
            sandbox, prepares it (setup files), the harness writes its file, the
            evaluator runs in it, the pool resets it (about four engine round trips);
  batched:  lazy leases and group scoring, the task's ``group_command`` removed: the
            harness writes into a recorder; each group is scored with one ``exec_many``
            in one leased sandbox (one engine round trip per group, a sandbox reset and
            a checker process per attempt);
  ours:     the defaults: the same, but the synthetic task's ``group_command`` scores
            the whole group in one checker process (docs/guides/tasks.md, "Group evaluation");
  shared:   ours, plus ``score_batching = {max_groups = 8}``: the groups' checkers run
            in batches of up to 8 groups, one lease and one engine exec per batch
            (docs/reference/envworkers.md, "Scoring several groups at once"; configs/tiny.toml).

Each mode runs ``--rounds`` times (alternating; the first round of each also warms its
pool), and the best round counts. Printed: attempts/s, CPU seconds of this process and
of dockerd per attempt (when /proc shows dockerd), the whole machine's busy CPU per
attempt (/proc/stat: worker, engine, runc and containers together), leases and engine
execs, and the ratios; the CPU seconds the sandbox containers used per attempt (cgroup v1 cpuacct,
when readable); checks every mode gave the same rewards. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import msgspec
import structlog
import trio

from fleetrl.actors.envworker.config import EnvWorkerConfig
from fleetrl.actors.envworker.cursor import TaskCursor
from fleetrl.actors.envworker.worker import _Worker
from fleetrl.actors.model import build_byte_tokenizer
from fleetrl.daemon.messages import RolloutGroup
from fleetrl.daemon.metrics import ActorMetrics, MetricsRegistry
from fleetrl.harness.model import HFChatTokenizer
from fleetrl.harness.protocol import Episode
from fleetrl.harness.recording import AttemptRecorder
from fleetrl.harness.synthetic import make_task, reference_solution, solution_text
from fleetrl.sandboxes import Engine, Ownership, WarmPolicy, open_sandbox_pool

TOKENIZER = HFChatTokenizer(build_byte_tokenizer())


class FixedCompletion(msgspec.Struct, frozen=True):
    """Writes a fixed solution chosen by slot (no model call); files-only like the
    completion harness."""

    sandbox_use: ClassVar[str] = "files"

    async def run(self, task, sandbox, model) -> Episode:
        slot = int(model.attempt_id.rsplit("/", 1)[1].split(".")[0])
        if slot % 2 == 0:
            text = solution_text(task, reference_solution(task))
        elif slot % 4 == 1:
            text = task.prompt + "    return 0\n"
        else:
            text = task.prompt + "    return x +\n"  # a syntax error
        await sandbox.write_files({f"{task.workdir}/solution.py": text})
        record = AttemptRecorder(model.attempt_id, task.id, TOKENIZER).finish()
        return Episode(task_id=task.id, turns=(), final_state="submitted", record=record)


class NoModel:
    attempt_id = ""

    def for_attempt(self, attempt_id: str) -> NoModel:
        view = NoModel()
        view.attempt_id = attempt_id
        return view


class CountingEngine(Engine):
    """The Docker engine, counting the exec round trips (``exec_create``) and file
    uploads (``put_archive``) made through it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"exec_create": 0, "put_archive": 0}
        for name in self.counts:
            real = getattr(self.api, name)

            def counted(*a, _real=real, _name=name, **kw):
                self.counts[_name] += 1
                return _real(*a, **kw)
            setattr(self.api, name, counted)


CPUACCT = Path("/sys/fs/cgroup/cpuacct/docker")


def _container_cpu_ns() -> dict[str, int]:
    """CPU nanoseconds used so far by each Docker container (cgroup v1), by id."""
    out: dict[str, int] = {}
    if CPUACCT.is_dir():
        for d in CPUACCT.iterdir():
            try:
                out[d.name] = int((d / "cpuacct.usage").read_text())
            except (OSError, ValueError):
                continue
    return out


def _container_cpu_s(before: dict[str, int], after: dict[str, int]) -> float | None:
    """Container CPU between two readings (containers started in between count from 0)."""
    if not after:
        return None
    return sum(v - before.get(k, 0) for k, v in after.items()) / 1e9


def _dockerd_cpu_s() -> float | None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd":
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    return None


def _machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat: all but idle and iowait)."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


async def run_mode(pool, *, fast: bool, group_command: bool, groups: int, group_size: int, concurrency: int,
                   first_index: int, score_batch: int = 1) -> dict:
    cfg = msgspec.convert({"model": {"kind": "local", "model_dir": "unused"}, "group_size": group_size,
                           "max_concurrent_attempts": concurrency, "lazy_sandbox": fast, "group_scoring": fast,
                           "retry": {"max_tries": {"sandbox_error": 1, "evaluator_error": 1}},
                           "sandbox": {"memory_mb": 256, "cpus": 0.5},
                           "score_batching": {"max_groups": score_batch, "linger_s": 0.25, "slots": 2}},
                          EnvWorkerConfig)
    ctx = SimpleNamespace(log=structlog.get_logger(), metrics=ActorMetrics(MetricsRegistry(), "bench"),
                          draining=False, name="bench")
    send, recv = trio.open_memory_channel(10_000)
    w = _Worker(cfg, ctx, harness=FixedCompletion(), model=NoModel(), pool=pool, out=send, failures_out=send,
                cursor=TaskCursor())
    tasks = [make_task(0, "train", first_index + i) for i in range(groups)]
    if not group_command:
        tasks = [msgspec.structs.replace(t, evaluator=msgspec.structs.replace(t.evaluator, group_command=None))
                 for t in tasks]
    stats0, counts0 = pool.statistics(), dict(pool.engine.counts)
    c0 = _container_cpu_ns()
    cpu0, d0, m0, t0 = time.process_time(), _dockerd_cpu_s(), _machine_busy_s(), time.perf_counter()
    async with trio.open_nursery() as n:
        for task in tasks:
            n.start_soon(w.group, w.cursor.take(), task, trio.Semaphore(0))
    wall = time.perf_counter() - t0
    cpu, d1, machine = time.process_time() - cpu0, _dockerd_cpu_s(), _machine_busy_s() - m0
    containers = _container_cpu_s(c0, _container_cpu_ns())
    stats1 = pool.statistics()
    rewards, failed = [], 0
    while True:
        try:
            msg = recv.receive_nowait()
        except trio.WouldBlock:
            break
        if isinstance(msg, RolloutGroup):
            rewards.append((msg.task_id, list(msg.rewards)))
        else:
            failed += 1
    n_att = groups * group_size
    return {"wall_s": wall, "attempts_per_s": n_att / wall, "cpu_s_per_attempt": cpu / n_att,
            "dockerd_cpu_s_per_attempt": None if d0 is None or d1 is None else (d1 - d0) / n_att,
            "container_cpu_s_per_attempt": None if containers is None else containers / n_att,
            "machine_cpu_s_per_attempt": machine / n_att,
            "leases": stats1.leases - stats0.leases,
            "docker_execs": pool.engine.counts["exec_create"] - counts0["exec_create"],
            "file_uploads": pool.engine.counts["put_archive"] - counts0["put_archive"],
            "rewards": sorted(rewards), "failed": failed}  # by task: groups end in any order


async def main(args: argparse.Namespace) -> dict:
    load0 = os.getloadavg()[0]
    best: dict[str, dict] = {}
    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"fleetrl-bench-rollouts-{os.getpid()}"
    policy = WarmPolicy(min_warm=0, max_warm=args.concurrency, max_containers=args.concurrency + 4)
    async with open_sandbox_pool(Ownership.for_state_dir(state, owner="bench-rollouts"), policy=policy,
                                 engine=CountingEngine()) as base_pool, \
            open_sandbox_pool(Ownership.for_state_dir(state, owner="bench-rollouts-fast"), policy=policy,
                              engine=CountingEngine()) as fast_pool, \
            open_sandbox_pool(Ownership.for_state_dir(state, owner="bench-rollouts-batched"), policy=policy,
                              engine=CountingEngine()) as batched_pool, \
            open_sandbox_pool(Ownership.for_state_dir(state, owner="bench-rollouts-shared"), policy=policy,
                              engine=CountingEngine()) as shared_pool:
        for r in range(args.rounds):
            for name, pool, fast, grouped, shared in (
                    ("baseline", base_pool, False, False, 1), ("batched", batched_pool, True, False, 1),
                    ("ours", fast_pool, True, True, 1), ("shared", shared_pool, True, True, 8)):
                res = await run_mode(pool, fast=fast, group_command=grouped, groups=args.groups,
                                     group_size=args.group_size, concurrency=args.concurrency, first_index=0,
                                     score_batch=shared)
                print(f"round {r + 1} {name:8s}: {res['attempts_per_s']:6.2f} attempts/s  "
                      f"wall {res['wall_s']:6.1f} s  leases {res['leases']:4d}  docker execs {res['docker_execs']:4d}  "
                      f"cpu/attempt {res['cpu_s_per_attempt'] * 1e3:6.1f} ms  dockerd cpu/attempt "
                      f"{(res['dockerd_cpu_s_per_attempt'] or 0) * 1e3:6.1f} ms  container cpu/attempt "
                      f"{(res['container_cpu_s_per_attempt'] or 0) * 1e3:6.1f} ms  machine cpu/attempt "
                      f"{res['machine_cpu_s_per_attempt'] * 1e3:6.1f} ms", flush=True)
                if name not in best or res["wall_s"] < best[name]["wall_s"]:
                    best[name] = res
    b, bt, o, sh = best["baseline"], best["batched"], best["ours"], best["shared"]
    same = (b["rewards"] == bt["rewards"] == o["rewards"] == sh["rewards"]
            and b["failed"] == bt["failed"] == o["failed"] == sh["failed"] == 0)
    shared_ratio = o["machine_cpu_s_per_attempt"] / sh["machine_cpu_s_per_attempt"] if sh["machine_cpu_s_per_attempt"] else None
    speedup = o["attempts_per_s"] / b["attempts_per_s"]
    container_ratio = None
    if bt["container_cpu_s_per_attempt"] and o["container_cpu_s_per_attempt"]:
        container_ratio = bt["container_cpu_s_per_attempt"] / o["container_cpu_s_per_attempt"]
    print(f"\n{args.groups * args.group_size} attempts ({args.groups} groups of {args.group_size}), "
          f"concurrency {args.concurrency}, load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"attempts/s: baseline {b['attempts_per_s']:.2f}, batched {bt['attempts_per_s']:.2f}, "
          f"ours {o['attempts_per_s']:.2f}: {speedup:.2f}x the baseline")
    if container_ratio is not None:
        print(f"container CPU per attempt: batched {bt['container_cpu_s_per_attempt'] * 1e3:.1f} ms, ours "
              f"{o['container_cpu_s_per_attempt'] * 1e3:.1f} ms: {container_ratio:.2f}x less with the group command")
    n = args.groups * args.group_size
    print(f"docker execs per attempt: baseline {b['docker_execs'] / n:.2f}, ours {o['docker_execs'] / n:.2f}; "
          f"file uploads {b['file_uploads']} vs {o['file_uploads']}; leases {b['leases']} vs {o['leases']}")
    if b["cpu_s_per_attempt"] and o["cpu_s_per_attempt"]:
        print(f"worker-process CPU per attempt: {b['cpu_s_per_attempt'] * 1e3:.1f} ms vs "
              f"{o['cpu_s_per_attempt'] * 1e3:.1f} ms")
    if shared_ratio is not None:
        print(f"machine CPU per attempt: ours {o['machine_cpu_s_per_attempt'] * 1e3:.1f} ms, shared "
              f"{sh['machine_cpu_s_per_attempt'] * 1e3:.1f} ms: {shared_ratio:.2f}x less with groups sharing "
              f"execs ({o['docker_execs']} vs {sh['docker_execs']} docker execs)")
    print(f"same rewards on every path: {same}")
    for r in (b, bt, o, sh):
        r.pop("rewards")
    return {"bench": "rollouts", "attempts": args.groups * args.group_size, "group_size": args.group_size,
            "concurrency": args.concurrency, "baseline": b, "batched": bt, "ours": o, "shared": sh,
            "speedup": speedup, "container_cpu_ratio_batched_vs_ours": container_ratio,
            "machine_cpu_ratio_ours_vs_shared": shared_ratio,
            "same_rewards": same, "load_before": load0, "load_after": os.getloadavg()[0]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    out = trio.run(main, ap.parse_args())
    print(json.dumps(out))
