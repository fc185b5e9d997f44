"""Cost-aware vs least-loaded routing: measured dollars per 1k generated tokens.

Two samplers of different price and speed serve the same workload (same requests,
same arrival times) through `SamplerPool`, once per policy; the pool's own registry
measures each sampler's busy time and tokens, and the bench prints $ per 1k tokens for
each policy, their ratio, the share of tokens the cheap sampler generated, and the
mean latency. Ends with one JSON line.

The samplers are simulated (service time = tokens / per-slot speed, on Trio's virtual
clock): on this shared 2-core machine two real backends would compete for the same
cores, so their price/speed ratio would reflect the machine's load rather than the
devices being modelled. Everything else (routing, the registry's cost measurement,
the request path) is the real code. `--real` runs the same comparison with two real
torch backends of a tiny model (fp32 "fast, dear" vs bf16 "slow, cheap") instead.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import numpy as np
import trio
import trio.testing

from fleetrl.actors.pool.local import LocalSampler
from fleetrl.actors.pool.pool import SamplerPool
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor


class SimSampler:
    """A sampler that takes tokens / tokens_per_s seconds per request, `capacity` at once."""

    def __init__(self, sampler_id: str, tokens_per_s: float, capacity: int) -> None:
        self.sampler_id = sampler_id
        self.tokens_per_s = tokens_per_s
        self.slots = trio.Semaphore(capacity)
        self.identity = m.SamplerIdentity(sampler_id=sampler_id, backend="sim", device_kind="sim",
                                          dtype="bfloat16")

    async def generate(self, req: m.GenerateRequest, started):
        async with self.slots:
            started()
            n = req.params.max_tokens
            await trio.sleep(n / self.tokens_per_s)
        ids = np.arange(n, dtype=np.int64) % 200
        return m.Generation(
            request_id=req.request_id, token_ids=Tensor.from_numpy(ids),
            logprobs=Tensor.from_numpy(np.zeros(n, np.float32)),
            support=m.SupportCSR(ids=Tensor.from_numpy(ids), logprobs=Tensor.from_numpy(np.zeros(n, np.float32)),
                                 offsets=Tensor.from_numpy(np.arange(n + 1, dtype=np.int64))),
            versions=Tensor.from_numpy(np.zeros(n, np.int64)), sampler=self.identity, finish_reason="length")

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass


def workload(n: int, rate_per_s: float, seed: int) -> list[tuple[float, m.GenerateRequest]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        req = m.GenerateRequest(request_id=f"r{i}", attempt_id=f"a{i}",
                                prompt_ids=Tensor.from_numpy(np.array([1, 2, 3], np.int64)),
                                params=m.SamplingParams(max_tokens=rng.randint(16, 256), seed=i))
        out.append((t, req))
    return out


async def run_policy(policy: str, samplers: list[tuple], reqs, max_latency_s: float) -> dict:
    pool = SamplerPool(policy=policy, max_latency_s=max_latency_s)
    for handle, price, capacity in samplers:
        pool.add(handle, handle.identity, price_per_hour=price, capacity=capacity, remote=False)
    latencies: list[float] = []
    t0 = trio.current_time()

    async def one(at: float, req: m.GenerateRequest) -> None:
        await trio.sleep_until(t0 + at)
        start = trio.current_time()
        res = await pool.generate(req)
        assert isinstance(res, m.Generation), res
        latencies.append(trio.current_time() - start)

    async with trio.open_nursery() as n:
        for at, req in reqs:
            n.start_soon(one, at, req)
    now = trio.current_time()
    recs = pool.registry.records()
    tokens = sum(r.tokens for r in recs)
    usd = sum(r.price_per_hour / 3600 * r.busy_total(now) for r in recs)
    return {"usd_per_1k_tokens": usd / tokens * 1000, "tokens": tokens,
            "tokens_by_sampler": {r.sampler_id: r.tokens for r in recs},
            "mean_latency_s": sum(latencies) / len(latencies), "max_latency_s": max(latencies)}


def simulated(args) -> dict:
    reqs = workload(args.requests, args.rate, args.seed)
    out = {}
    for policy in ("least_loaded", "cost_aware"):
        samplers = [(SimSampler("fast-dear", 100.0, 4), 4.0, 4), (SimSampler("slow-cheap", 50.0, 2), 0.6, 2)]
        out[policy] = trio.run(run_policy, policy, samplers, reqs, args.max_latency_s,
                               clock=trio.testing.MockClock(autojump_threshold=0))
    return out


def real(args) -> dict:
    import tempfile

    import torch

    from fleetrl.actors.model import TinyLlamaSpec, create_tiny_llama
    from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig

    torch.set_num_threads(1)
    d = tempfile.mkdtemp()
    create_tiny_llama(d, TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                       intermediate_size=128, max_position_embeddings=512), seed=1)
    reqs = [(0.0, r) for _, r in workload(args.requests, 1.0, args.seed)]
    reqs = [(t, m.GenerateRequest(request_id=r.request_id, attempt_id=r.attempt_id, prompt_ids=r.prompt_ids,
                                  params=m.SamplingParams(max_tokens=min(r.params.max_tokens, 48), seed=1)))
            for t, r in reqs]
    out = {}
    for policy in ("least_loaded", "cost_aware"):
        fast = LocalSampler("fp32-dear", TorchBackend(TorchBackendConfig(model_dir=d, dtype="fp32")))
        slow = LocalSampler("bf16-cheap", TorchBackend(TorchBackendConfig(model_dir=d, dtype="bf16")))
        out[policy] = trio.run(run_policy, policy, [(fast, 4.0, 1), (slow, 0.6, 1)], reqs, args.max_latency_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=1.2, help="requests per second (simulated)")
    ap.add_argument("--max-latency-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true", help="two real torch backends instead of simulated ones")
    args = ap.parse_args()
    out = real(args) if args.real else simulated(args)
    ll, ca = out["least_loaded"], out["cost_aware"]
    for policy, r in out.items():
        print(f"{policy:>13}: ${r['usd_per_1k_tokens']:.6f} per 1k tokens, {r['tokens']} tokens "
              f"{r['tokens_by_sampler']}, latency mean {r['mean_latency_s']:.2f} s max {r['max_latency_s']:.2f} s",
              file=sys.stderr)
    ratio = ca["usd_per_1k_tokens"] / ll["usd_per_1k_tokens"]
    print(f"cost-aware / least-loaded $ per 1k tokens: {ratio:.3f}", file=sys.stderr)
    print(json.dumps({"bench": "routing", "mode": "real" if args.real else "simulated",
                      "requests": args.requests,
                      "least_loaded_usd_per_1k": ll["usd_per_1k_tokens"],
                      "cost_aware_usd_per_1k": ca["usd_per_1k_tokens"],
                      "cost_ratio": ratio,
                      "least_loaded_mean_latency_s": ll["mean_latency_s"],
                      "cost_aware_mean_latency_s": ca["mean_latency_s"]}))


if __name__ == "__main__":
    main()
