"""Cost of the OpenAI endpoint and of the external-harness path (issue 18).

    .venv/bin/python bench/harness.py [--model recipe|test] [--calls 30] [--warmup 3] [--max-tokens 16]
                                      [--api completions|chat] [--attempts 12] [--concurrency 4] [--rounds 2]
                                      [--tasks FILE.jsonl] [--threads 1] [--skip-calls] [--skip-attempts]

Builds the tiny model locally (``create_tiny_llama`` + ``save_byte_tokenizer`` in a
temporary directory; ``--model recipe``: the embedded recipe's shape, hidden 192, 4
layers; ``--model test``: the tests' shape, hidden 64, 2 layers) and loads it in a torch
sampler backend behind a `LocalModelClient` (an environment worker's own backend).
The endpoint (``create_app``) over that same client is served on 127.0.0.1 by
hypercorn's Trio worker, in this process. Two measurements:

1. Per call. The same prompt ids and the same `SamplingParams` (``--max-tokens``,
   temperature 1, top_p 1, ``<eos>`` stops, one fixed seed, so every call generates
   the same tokens) go
     baseline: straight to the client's ``generate`` (what a built-in harness does);
     ours:     through the endpoint with the official ``openai`` client (sync, in a
               worker thread, connection kept alive), ``--api`` completions (a string
               prompt) or chat (one user message), with a per-attempt key from
               `AttemptRegistry`.
   The prompt ids of the baseline are those the endpoint recorded for a first, untimed call;
   the calls alternate (baseline, ours, ours, baseline, ...) after ``--warmup`` calls of
   each, so a change of load hits both alike. Printed: median and p90 latency of each,
   the overhead (difference of the medians, and the median of the differences of the
   calls run back to back) and the ratio; checks every endpoint call
   recorded the baseline's tokens.
2. Attempts per second. The same tasks (``--tasks``, a JSONL task file; default four
   small completion tasks written to a temporary file: three functions checked by a
   Python one-liner, one passed once the harness has written its file) run ``--attempts``
   times per path, ``--concurrency`` at once, each attempt in a real Docker sandbox
   leased from one warm pool and run by ``run_attempt`` (prepare, harness, the task's
   evaluator):
     baseline: the built-in ``CompletionHarness`` (``--max-tokens``), calling the
               client directly and writing ``solution.py`` with ``write_files``;
     ours:     an ``ExternalHarness`` running a small Python script that makes the
               same call (a completion of the task's prompt, ``--max-tokens``) with the
               official ``openai`` client against the endpoint, then writes prompt +
               answer as ``solution.py`` into the sandbox with ``docker exec``.
   Neither path uses the worker's group scoring (bench/rollouts.py measures that): the
   difference is the harness path alone. Each path runs ``--rounds`` times, alternating;
   the best round counts. Printed: attempts/s, the whole machine's busy CPU per attempt
   (/proc/stat), tokens per attempt, mean reward, and the ratio; and the wall time of
   the script's interpreter starting and importing ``openai`` alone (median of three),
   which every external attempt pays.
   A third path runs the same script forked from a fork server that imported
   ``openai`` once (``ExternalCommand.preload``; fleetrl.harness.forkserver): its
   attempts/s against the script started afresh is the preload's speed-up.

Then a table with the ratios, and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import structlog
import trio

from fleetrl.actors.envworker.model import LocalModelClient
from fleetrl.actors.model import TinyLlamaSpec, create_tiny_llama, save_byte_tokenizer
from fleetrl.daemon.messages import SamplingParams
from fleetrl.harness.builtin import CompletionHarness
from fleetrl.harness.external import ExternalCommand, ExternalHarness, run_attempt
from fleetrl.harness.model import HFChatTokenizer
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app
from fleetrl.harness.task_codec import load_tasks_jsonl
from fleetrl.sandboxes import DEFAULT_IMAGE, Ownership, WarmPolicy, ensure_image, open_sandbox_pool

MODEL_NAME = "tiny"
SEED = 1234
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"

SHAPES = {
    "recipe": TinyLlamaSpec(),  # the embedded recipe's shape (configs/tiny.toml)
    "test": TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                          max_position_embeddings=1024, initializer_range=0.1),  # tests/conftest.py's
}

TASKS = [
    {"id": "add", "prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
     "evaluator": {"command": "python3 -c 'from solution import add; assert add(2, 3) == 5'", "timeout_s": 20}},
    {"id": "largest", "prompt": "def largest(xs):\n    \"\"\"The largest element of a non-empty list.\"\"\"\n",
     "evaluator": {"command": "python3 -c 'from solution import largest; assert largest([3, 9, 2]) == 9'",
                   "timeout_s": 20}},
    {"id": "reverse", "prompt": "def reverse(s):\n    \"\"\"The string s backwards.\"\"\"\n",
     "evaluator": {"command": "python3 -c 'from solution import reverse; assert reverse(\"abc\") == \"cba\"'",
                   "timeout_s": 20}},
    {"id": "written", "prompt": "# a Python module\n",
     "evaluator": {"command": "test -s solution.py && head -n 1 solution.py | grep -qx '# a Python module'",
                   "timeout_s": 20}},
]
"""The default tasks: three a random tiny model fails, and one that passes once the
harness has written the prompt into ``solution.py`` (both paths must score 1 on it)."""

EXTERNAL_SCRIPT = '''\
"""One attempt of an external harness (written by bench/harness.py): one completion of the
task's prompt with the official openai client (OPENAI_BASE_URL / OPENAI_API_KEY from the
environment), then prompt + answer written as the task's solution file in the sandbox
with docker exec, as the sandbox user, in its work dir."""
import json, os, subprocess, sys
import openai
task = json.load(open(os.environ["FLEETRL_TASK_FILE"], encoding="utf-8"))
prompt = open(os.environ["FLEETRL_PROMPT_FILE"], encoding="utf-8").read()
client = openai.OpenAI(max_retries=0, timeout=120)
r = client.completions.create(model=os.environ["FLEETRL_MODEL"], prompt=prompt, max_tokens=int(sys.argv[1]),
                              temperature=1.0, top_p=1.0)
name = (task.get("metadata") or {}).get("solution_file") or "solution.py"
subprocess.run(["docker", "exec", "-i", "-u", os.environ["FLEETRL_SANDBOX_USER"], "-w",
                os.environ["FLEETRL_SANDBOX_WORKDIR"], os.environ["FLEETRL_SANDBOX_CONTAINER"],
                "sh", "-c", 'cat > "$1"', "sh", name],
               input=(prompt + r.choices[0].text).encode(), check=True, timeout=60)
'''


# -- helpers -----------------------------------------------------------------------------------


@asynccontextmanager
async def served(app):
    """``app`` served on a free port of 127.0.0.1 the way the daemon serves its control
    plane (`fleetrl.daemon.control.serve_control`); yields its base URL."""
    from fleetrl.daemon.control import serve_control

    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve_control, app, "127.0.0.1", 0, shutdown_trigger=stop.wait))
        try:
            yield f"http://{host}:{port}"
        finally:
            stop.set()


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat: all but idle and iowait)."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


# -- 1. per call -------------------------------------------------------------------------------


async def per_call(client: LocalModelClient, registry: AttemptRegistry, base: str, args) -> dict:
    import openai

    sampling = {"max_tokens": args.max_tokens, "temperature": 1.0, "top_p": 1.0, "seed": SEED}

    def endpoint_call(oa: openai.OpenAI) -> float:
        t0 = time.perf_counter()
        if args.api == "chat":
            oa.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], **sampling)
        else:
            oa.completions.create(model=MODEL_NAME, prompt=PROMPT, **sampling)
        return time.perf_counter() - t0

    # the prompt ids the endpoint builds for this request, from a recorded first call
    key = registry.open_attempt("bench-first", "bench")
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    await trio.to_thread.run_sync(endpoint_call, oa)
    (first,) = registry.close_attempt(key).calls
    ids = list(first.prompt_ids)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0,
                            stop_ids=(client.tokenizer.eos_id,), seed=SEED)
    gen = await client.generate(ids, params)
    direct_tokens = gen.token_ids.to_numpy().tolist()

    async def direct_call() -> float:
        t0 = time.perf_counter()
        await client.generate(ids, params)
        return time.perf_counter() - t0

    key = registry.open_attempt("bench-calls", "bench")
    oa = oa.with_options(api_key=key)  # the same connection pool, this attempt's key
    direct, endpoint = [], []
    for i in range(args.warmup + args.calls):
        d_first = i % 2 == 0  # alternate the order: baseline then ours, ours then baseline
        for which in ("direct", "endpoint") if d_first else ("endpoint", "direct"):
            if which == "direct":
                t = await direct_call()
            else:
                t = await trio.to_thread.run_sync(endpoint_call, oa)
            if i >= args.warmup:
                (direct if which == "direct" else endpoint).append(t)
    record = registry.close_attempt(key)
    oa.close()
    same = (first.token_ids == direct_tokens
            and all(c.token_ids == direct_tokens and list(c.prompt_ids) == ids for c in record.calls))
    d_med, e_med = statistics.median(direct), statistics.median(endpoint)
    paired = statistics.median(e - d for d, e in zip(direct, endpoint))  # each pair ran back to back
    return {"api": args.api, "calls": args.calls, "warmup": args.warmup, "max_tokens": args.max_tokens,
            "prompt_tokens": len(ids), "generated_tokens": len(direct_tokens),
            "direct_median_ms": round(d_med * 1e3, 3), "direct_p90_ms": round(_percentile(direct, 0.9) * 1e3, 3),
            "endpoint_median_ms": round(e_med * 1e3, 3),
            "endpoint_p90_ms": round(_percentile(endpoint, 0.9) * 1e3, 3),
            "overhead_ms": round((e_med - d_med) * 1e3, 3), "overhead_paired_ms": round(paired * 1e3, 3),
            "ratio": round(e_med / d_med, 3),
            "same_tokens": same, "recorded_calls": len(record.calls)}


# -- 2. attempts per second --------------------------------------------------------------------


async def run_path(pool, harness, model, tasks, attempts: int, concurrency: int) -> dict:
    limiter = trio.CapacityLimiter(concurrency)
    results: list[tuple[str, float, str, int]] = []
    errors: list[str] = []

    async def one(i: int) -> None:
        task = tasks[i % len(tasks)]
        async with limiter:
            try:
                async with pool.lease(task.image) as sb:
                    r = await run_attempt(harness, task, sb, model)
            except Exception as err:  # noqa: BLE001 - counted and reported, the other attempts go on
                errors.append(f"{task.id}: {type(err).__name__}: {err}")
                return
        tokens = sum(len(c.token_ids) for c in r.episode.record.calls)
        results.append((task.id, r.reward, r.episode.final_state, tokens))
        if r.episode.final_state != "submitted":
            errors.append(f"{task.id}: {r.episode.final_state}: {r.episode.error}")

    m0, t0 = _machine_busy_s(), time.perf_counter()
    async with trio.open_nursery() as n:
        for i in range(attempts):
            n.start_soon(one, i)
    wall = time.perf_counter() - t0
    machine = _machine_busy_s() - m0
    by_task: dict[str, list[float]] = {}
    for tid, reward, _, _ in results:
        by_task.setdefault(tid, []).append(reward)
    return {"wall_s": round(wall, 3), "attempts_per_s": round(attempts / wall, 3),
            "machine_cpu_ms_per_attempt": round(machine / attempts * 1e3, 1),
            "tokens_per_attempt": round(statistics.fmean(r[3] for r in results), 2) if results else 0.0,
            "mean_reward": round(statistics.fmean(r[1] for r in results), 3) if results else 0.0,
            "reward_by_task": {k: round(statistics.fmean(v), 3) for k, v in sorted(by_task.items())},
            "submitted": sum(r[2] == "submitted" for r in results), "failed": len(errors),
            "errors": errors[:5]}


async def script_startup_s() -> float:
    """Wall time of this interpreter starting and importing openai (what every external
    attempt pays before its first call), median of three."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        await trio.run_process([sys.executable, "-c", "import openai"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def attempts_per_s(client: LocalModelClient, registry: AttemptRegistry, base: str, tasks, workdir: Path,
                         args) -> dict:
    script = workdir / "external_attempt.py"
    script.write_text(EXTERNAL_SCRIPT)
    builtin = CompletionHarness(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0)
    external = ExternalHarness(ExternalCommand(argv=(sys.executable, str(script), str(args.max_tokens)),
                                               timeout_s=120), registry=registry, base_url=base,
                               model_name=MODEL_NAME)
    # the same script forked from a server that imported openai once (ExternalCommand.preload)
    preloaded = ExternalHarness(ExternalCommand(argv=(sys.executable, str(script), str(args.max_tokens)),
                                                timeout_s=120, preload=("openai",)), registry=registry,
                                base_url=base, model_name=MODEL_NAME)
    owner = f"bench-harness-{os.getpid()}"
    c = args.concurrency
    policy = WarmPolicy(min_warm=0, max_warm=c, max_containers=c + 4)
    best: dict[str, dict] = {}
    images = sorted({t.image for t in tasks})
    async with open_sandbox_pool(Ownership.for_state_dir(workdir / "state", owner=owner), policy=policy) as pool:
        for image in images:
            await pool.prewarm(image, n=c)
        paths = (("builtin", builtin, client), ("external", external, None), ("preloaded", preloaded, None))
        for r in range(args.rounds):
            for name, harness, model in paths:
                res = await run_path(pool, harness, model, tasks, args.attempts, c)
                print(f"round {r + 1} {name:8s}: {res['attempts_per_s']:7.2f} attempts/s  wall {res['wall_s']:6.2f} s"
                      f"  machine cpu/attempt {res['machine_cpu_ms_per_attempt']:7.1f} ms  tokens/attempt "
                      f"{res['tokens_per_attempt']:5.1f}  mean reward {res['mean_reward']:.2f}  "
                      f"failed {res['failed']}", flush=True)
                for e in res["errors"]:
                    print(f"    {e}", flush=True)
                if name not in best or res["wall_s"] < best[name]["wall_s"]:
                    best[name] = res
    await preloaded.aclose()
    b, e, p = best["builtin"], best["external"], best["preloaded"]
    startup = await script_startup_s()
    print(f"the script's Python start-up with `import openai` alone: {startup * 1e3:.0f} ms (median of 3)", flush=True)
    return {"attempts": args.attempts, "script_startup_ms": round(startup * 1e3, 1), "tasks": [t.id for t in tasks],
            "concurrency": c, "rounds": args.rounds, "builtin": b, "external": e, "preloaded": p,
            "ratio": round(e["attempts_per_s"] / b["attempts_per_s"], 3),
            "preloaded_ratio": round(p["attempts_per_s"] / b["attempts_per_s"], 3),
            "preload_speedup": round(p["attempts_per_s"] / e["attempts_per_s"], 3), "sandbox_owner": owner}


# -- main --------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig

    load0 = os.getloadavg()[0]
    spec = SHAPES[args.model]
    with tempfile.TemporaryDirectory(prefix="fleetrl-bench-harness-") as tmp:
        workdir = Path(tmp)
        model_dir = create_tiny_llama(workdir / "model", spec, seed=7)
        save_byte_tokenizer(model_dir, model_max_length=spec.max_position_embeddings)
        backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))
        tok = HFChatTokenizer.from_pretrained(model_dir)
        client = LocalModelClient(backend, tok, sampler_id="bench", concurrency=args.model_concurrency)
        registry = AttemptRegistry(tok)
        app = create_app(client, registry, EndpointConfig(model_name=MODEL_NAME,
                                                          context_length=spec.max_position_embeddings))
        if args.tasks:
            report = load_tasks_jsonl(args.tasks)
        else:
            path = workdir / "tasks.jsonl"
            path.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
            report = load_tasks_jsonl(path)
        if report.errors or not report.tasks:
            raise SystemExit(f"bad task file: {report.errors[:3] or 'no tasks'}")
        tasks = report.tasks
        calls = attempts = None
        async with served(app) as base:
            if not args.skip_calls:
                calls = await per_call(client, registry, base, args)
                print(f"per call ({args.api}, {calls['prompt_tokens']} prompt tokens, {calls['generated_tokens']} "
                      f"generated, {args.calls} calls each): direct median {calls['direct_median_ms']:.2f} ms "
                      f"p90 {calls['direct_p90_ms']:.2f} ms; endpoint median {calls['endpoint_median_ms']:.2f} ms "
                      f"p90 {calls['endpoint_p90_ms']:.2f} ms; same tokens: {calls['same_tokens']}", flush=True)
            if not args.skip_attempts:
                if any(t.image == DEFAULT_IMAGE for t in tasks):
                    await trio.to_thread.run_sync(ensure_image, DEFAULT_IMAGE)  # built once, then cached
                attempts = await attempts_per_s(client, registry, base, tasks, workdir, args)
    load1 = os.getloadavg()[0]

    print(f"\nmodel {args.model} (hidden {spec.hidden_size}, {spec.num_layers} layers), torch threads {args.threads}, "
          f"load {load0:.1f} -> {load1:.1f}")
    print(f"{'':34s} {'baseline':>12s} {'ours':>12s} {'ours/baseline':>14s}")
    if calls:
        print(f"{'call latency, median (ms)':34s} {calls['direct_median_ms']:12.2f} "
              f"{calls['endpoint_median_ms']:12.2f} {calls['ratio']:13.2f}x")
        print(f"{'call latency, p90 (ms)':34s} {calls['direct_p90_ms']:12.2f} {calls['endpoint_p90_ms']:12.2f} "
              f"{calls['endpoint_p90_ms'] / calls['direct_p90_ms']:13.2f}x")
        print(f"{'overhead per call, median (ms)':34s} {'':12s} {calls['overhead_ms']:12.2f}")
        print(f"{'  median of paired differences':34s} {'':12s} {calls['overhead_paired_ms']:12.2f}")
    if attempts:
        b, e = attempts["builtin"], attempts["external"]
        print(f"{'attempts/s':34s} {b['attempts_per_s']:12.2f} {e['attempts_per_s']:12.2f} {attempts['ratio']:13.2f}x")
        print(f"{'machine CPU per attempt (ms)':34s} {b['machine_cpu_ms_per_attempt']:12.1f} "
              f"{e['machine_cpu_ms_per_attempt']:12.1f} "
              f"{e['machine_cpu_ms_per_attempt'] / max(b['machine_cpu_ms_per_attempt'], 1e-9):13.2f}x")
        print(f"{'mean reward':34s} {b['mean_reward']:12.2f} {e['mean_reward']:12.2f}")
        p = attempts["preloaded"]
        print(f"{'attempts/s, external preloaded':34s} {e['attempts_per_s']:12.2f} {p['attempts_per_s']:12.2f} "
              f"{attempts['preload_speedup']:13.2f}x   (baseline here: the external script started afresh)")
        print(f"{'  machine CPU per attempt (ms)':34s} {e['machine_cpu_ms_per_attempt']:12.1f} "
              f"{p['machine_cpu_ms_per_attempt']:12.1f} "
              f"{p['machine_cpu_ms_per_attempt'] / max(e['machine_cpu_ms_per_attempt'], 1e-9):13.2f}x")
    print("baseline: direct generate / built-in CompletionHarness; ours: the endpoint with the openai client / "
          "an external script through the endpoint")
    return {"bench": "harness", "model": args.model, "hidden": spec.hidden_size, "layers": spec.num_layers,
            "threads": args.threads, "per_call": calls, "attempts": attempts,
            "load_before": round(load0, 2), "load_after": round(load1, 2)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="recipe", help="the tiny model's shape")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per call (both parts)")
    ap.add_argument("--api", choices=("completions", "chat"), default="completions", help="per-call route")
    ap.add_argument("--calls", type=int, default=30, help="timed calls per path (part 1)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per path first (part 1)")
    ap.add_argument("--attempts", type=int, default=12, help="attempts per path and round (part 2)")
    ap.add_argument("--concurrency", type=int, default=4, help="attempts at once (part 2)")
    ap.add_argument("--model-concurrency", type=int, default=2, help="generate calls at once in the backend")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per path, alternating; the best counts (part 2)")
    ap.add_argument("--tasks", help="a JSONL task file (default: four small built-in tasks)")
    ap.add_argument("--skip-calls", action="store_true", help="skip part 1")
    ap.add_argument("--skip-attempts", action="store_true", help="skip part 2 (no Docker needed)")
    a = ap.parse_args()
    for name in ("threads", "max_tokens", "calls", "attempts", "concurrency", "model_concurrency", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        ap.error("--warmup must be >= 0")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    out = trio.run(main, a)
    print(json.dumps(out))
