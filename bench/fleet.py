"""Benchmark: the sampler fleet.

Part 1 (this file so far): the torch reference backend.

* tokens/s of `TorchBackend.generate` vs Hugging Face transformers `generate` on the same
  tiny Llama (default: the embedded recipe's shape, hidden 192, 4 layers), the same
  batch of prompts and the same sampling (temperature 1, top_p 0.95, a fixed number of
  new tokens, no early stop), both in fp32, measured in the same run; ratio = ours / HF.
  Our backend also reports every token's support, which HF generate does not.
* tokens/s of the torch backend in bf16, fp16 and fp8;
* measured mismatch per precision: the k3 estimate of KL(q^S || p^S) between each
  sampler's reported log-probs and the fp32 trainer's replay (transformers forward +
  fleetrl.grpo.replay_logprobs), over the generated tokens;
* version switch: wall time of `apply_update` with every weight of a new version.

The model is randomly initialised; `--init-std` (default 0.1, larger than the usual
0.02) gives it peaked next-token distributions, closer to a trained model's, so that
top-p supports are truncated and the mismatch figures are not those of flat logits.
`--threads` sets torch's intra-op threads for both sides (default 1: tiny matmuls gain
nothing from more, and on a shared machine spinning threads distort the timing).

Ends with one JSON line. Run: .venv/bin/python bench/fleet.py [--batch 8] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, build_tiny_llama, read_state_dict, save_tiny_llama
from fleetrl.actors.samplers import (
    SamplingParams,
    TorchBackend,
    TorchBackendConfig,
    WeightVersion,
    measure_mismatch,
)

TOP_P = 0.95


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


def bench_torch_vs_transformers(model_dir: Path, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """tokens/s of our backend (each dtype) and of transformers generate (fp32)."""
    from fleetrl.actors.model import load_tiny_llama

    n_tokens = len(prompts) * new_tokens
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=TOP_P, seed=0)
    ours: dict[str, float] = {}
    for dtype in ("fp32", "bf16", "fp16", "fp8"):
        backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype))

        def run(backend=backend):
            gens = backend.generate(prompts, params)
            assert sum(g.num_tokens for g in gens) == n_tokens

        ours[dtype] = n_tokens / time_median(run, repeats)

    hf = load_tiny_llama(model_dir)
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=TOP_P, top_k=0,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        assert out.shape[1] - ids.shape[1] == new_tokens

    hf_tps = n_tokens / time_median(run_hf, repeats)
    return {
        "tokens": n_tokens,
        "transformers_fp32_tokens_per_s": hf_tps,
        "torch_backend_tokens_per_s": ours,
        "ratio_torch_fp32_vs_transformers": ours["fp32"] / hf_tps,
    }


def bench_mismatch(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """k3 KL of each precision's reported log-probs against the fp32 trainer's replay."""
    from fleetrl.actors.model import load_tiny_llama

    trainer = load_tiny_llama(model_dir)
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, top_p=TOP_P, seed=1)
    out = {}
    for dtype in ("fp32", "bf16", "fp16", "fp8"):
        backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype))
        report = measure_mismatch(trainer, prompts, backend.generate(prompts, params), 1.0)
        out[dtype] = {"tokens": report.tokens, "k3_kl": report.k3_kl,
                      "mean_log_ratio": report.mean_log_ratio, "max_abs_log_ratio": report.max_abs_log_ratio}
    return out


def bench_version_switch(model_dir: Path, other_dir: Path, repeats: int) -> dict:
    """Milliseconds to apply a full new version (every tensor) in each dtype."""
    new = {k: v.to(torch.bfloat16) for k, v in read_state_dict(other_dir).items()}
    out = {}
    for dtype in ("fp32", "bf16", "fp16", "fp8"):
        backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype))
        version = iter(range(1, 10_000))
        out[dtype] = 1e3 * time_median(lambda b=backend: b.apply_update(new, WeightVersion(next(version), "x")), repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--init-std", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = TinyLlamaSpec(hidden_size=args.hidden, num_layers=args.layers, initializer_range=args.init_std)
    prompts = make_prompts(args.batch, args.prompt_len, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_llama(build_tiny_llama(spec, seed=0), Path(tmp) / "model")
        other_dir = save_tiny_llama(build_tiny_llama(spec, seed=1), Path(tmp) / "other")
        speed = bench_torch_vs_transformers(model_dir, prompts, args.new_tokens, args.repeats)
        mismatch = bench_mismatch(model_dir, prompts, args.new_tokens)
        switch = bench_version_switch(model_dir, other_dir, args.repeats)

    print(f"model: hidden {args.hidden}, {args.layers} layers; batch {args.batch} x prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, top_p {TOP_P}, {args.threads} torch thread(s)")
    print(f"transformers generate (fp32)   {speed['transformers_fp32_tokens_per_s']:9.1f} tokens/s")
    for dtype, tps in speed["torch_backend_tokens_per_s"].items():
        print(f"torch backend ({dtype:4s})          {tps:9.1f} tokens/s")
    print(f"ratio torch fp32 / transformers {speed['ratio_torch_fp32_vs_transformers']:8.2f}x "
          "(ours also reports every token's support)")
    print("mismatch vs fp32 trainer (k3 KL per token, max |log p - log q|):")
    for dtype, m in mismatch.items():
        print(f"  {dtype:4s} k3 {m['k3_kl']:.3e}  max|dlog| {m['max_abs_log_ratio']:.3e}  ({m['tokens']} tokens)")
    print("version switch, all weights (apply_update):")
    for dtype, ms in switch.items():
        print(f"  {dtype:4s} {ms:8.2f} ms")
    print(json.dumps({
        "bench": "fleet",
        "config": vars(args) | {"top_p": TOP_P},
        "torch_vs_transformers": speed,
        "mismatch_k3_vs_fp32_trainer": mismatch,
        "version_switch_ms": switch,
    }))


if __name__ == "__main__":
    main()
