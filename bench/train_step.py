"""Trainer step speed on CPU, in three parts (``--parts``, default all; one JSON line at the end):

1. ``prompts``: the prompt-shared forward against the plain full-row forward (below);
2. ``ranks``: tokens/s and peak memory per rank of the step on 1 and 2 FSDP2 rank
   processes, the scaling efficiency, and the in-process step as the baseline
   (`bench_ranks`);
3. ``families``: the torch sampler's decode tokens/s per model family against
   transformers' ``generate`` (`bench_families`).

Part 1. The embedded recipe's step: the default tiny model (`TinyLlamaSpec()`, ~1.9M
parameters), 16 groups x 8 attempts = 128 rows, each group's prompt ~50 byte tokens
(40-60), completions 5-30 tokens, supports of 1-16 tokens. Baseline: `train_step` with
``share_prompts=False`` (every row forwarded in full); ours: ``share_prompts=True``
(each distinct prompt once, `fleetrl.actors.trainer.prefix`). Both run on the same model
and batch, interleaved, after a warm-up; the median of each is reported, with the
logits gap between the paths as a check that the speed-up is not a different
computation. ``speedup`` is the ratio of the medians; ``pair_speedup`` the median of the
per-repeat ratios (each plain run next to its shared run), which drifting load on a
shared machine disturbs less.

    nice .venv/bin/python bench/train_step.py [--parts prompts,ranks,families] [--groups 16 --attempts 8
        --repeats 7 --threads 1 --rank-groups 4 --rank-repeats 3 --gen-batch 8 --gen-tokens 64]

On a machine shared with other jobs, ``--threads 1`` avoids OpenMP threads waiting on a
descheduled sibling, which inflates every op and blurs the ratio.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, build_tiny_llama
from fleetrl.actors.model.byte_tokenizer import VOCAB_SIZE
from fleetrl.actors.trainer.batch import Batch, build_batch
from fleetrl.actors.trainer.prefix import plain_logits, shared_prompt_logits
from fleetrl.actors.trainer.step import build_optimizer, train_step
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor
from fleetrl.grpo import CorrectionConfig

SAMPLER = m.SamplerIdentity(sampler_id="bench", backend="torch", device_kind="cpu", dtype="float32")


def _t(a: np.ndarray) -> Tensor:
    return Tensor.from_numpy(np.ascontiguousarray(a))


def _segment(rng: np.random.Generator, prompt: np.ndarray, n: int) -> m.TokenSegment:
    """``n`` generated tokens; each position's support is 1-16 distinct ids holding the token,
    with normalised random log-probs."""
    tokens = rng.integers(3, VOCAB_SIZE, n)
    ids, lps, lp_tok, offsets = [], [], [], [0]
    for tok in tokens:
        k = int(rng.integers(1, 17))
        others = rng.choice(np.setdiff1d(np.arange(3, VOCAB_SIZE), [tok]), k - 1, replace=False)
        members = np.concatenate([[tok], others])
        logits = rng.normal(size=k)
        lq = logits - np.log(np.exp(logits).sum())
        ids.append(members)
        lps.append(lq)
        lp_tok.append(lq[0])
        offsets.append(offsets[-1] + k)
    return m.TokenSegment(
        prompt_ids=_t(prompt.astype(np.int64)), token_ids=_t(tokens.astype(np.int64)),
        logprobs=_t(np.asarray(lp_tok, dtype=np.float32)),
        support=m.SupportCSR(ids=_t(np.concatenate(ids).astype(np.int64)),
                             logprobs=_t(np.concatenate(lps).astype(np.float32)),
                             offsets=_t(np.asarray(offsets, dtype=np.int64))),
        versions=_t(np.zeros(n, dtype=np.int64)), sampler=SAMPLER, finish_reason="stop")


def make_batch(groups: int, attempts: int, seed: int) -> Batch:
    return build_batch(make_groups(groups, attempts, seed))


def make_groups(groups: int, attempts: int, seed: int) -> list[m.RolloutGroup]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = np.concatenate([[BOS_ID], rng.integers(3, VOCAB_SIZE, int(rng.integers(39, 60)))])
        gid = f"bench-{g}"
        out.append(m.RolloutGroup(group_id=gid, task_id=f"task-{g}", trajectories=tuple(
            m.Trajectory(attempt_id=f"{gid}-a{i}", task_id=f"task-{g}", group_id=gid,
                         segments=(_segment(rng, prompt, int(rng.integers(5, 31))),),
                         reward=float(rng.integers(0, 2)))
            for i in range(attempts))))
    return out


def bench_prompts(args: argparse.Namespace) -> dict:
    """Part 1: the prompt-shared forward against the plain one (module docstring)."""
    batch = make_batch(args.groups, args.attempts, args.seed)
    model = build_tiny_llama(TinyLlamaSpec(), seed=args.seed).train()
    opt = build_optimizer(model, lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    B, T = batch.tokens.shape
    D, P = batch.prompt_ids.shape
    with torch.no_grad():
        gap = float((plain_logits(model, batch) - shared_prompt_logits(model, batch))[batch.loss_mask].abs().max())

    def run(share: bool) -> float:
        t0 = time.perf_counter()
        metrics = train_step(model, opt, batch, corrections=CorrectionConfig(), temperature=1.0, grad_clip=1.0,
                             pass_threshold=1.0, step=0, trainer_version=0, share_prompts=share)
        dt = time.perf_counter() - t0
        assert not metrics.skipped, metrics.skipped_reason
        return dt

    run(False), run(True)  # warm-up
    times: dict[str, list[float]] = {"plain": [], "shared": []}
    for _ in range(args.repeats):
        times["plain"].append(run(False))
        times["shared"].append(run(True))
    med = {k: statistics.median(v) for k, v in times.items()}
    speedup = med["plain"] / med["shared"]
    pair = statistics.median(p / q for p, q in zip(times["plain"], times["shared"]))
    plain_positions = int(batch.input_ids.numel())  # B x L positions forwarded by the plain path
    shared_positions = D * P + B * (T - 1)
    print(f"rows B={B} (groups {args.groups} x {args.attempts}), distinct prompts D={D} padded to P={P}, "
          f"L={batch.input_ids.shape[1]}, T={T}, generated tokens {batch.n_tokens}, "
          f"threads={torch.get_num_threads()}, repeats={args.repeats}")
    print(f"positions forwarded: plain {plain_positions}, shared {shared_positions} "
          f"({plain_positions / shared_positions:.2f}x fewer)")
    print(f"max |logit diff| shared vs plain at generated tokens: {gap:.2e}")
    print(f"{'variant':<10}{'median s':>10}{'min s':>10}")
    for name, ts in times.items():
        print(f"{name:<10}{med[name]:>10.3f}{min(ts):>10.3f}")
    print(f"train_step speed-up of shared over plain: {speedup:.2f}x (ratio of medians), "
          f"{pair:.2f}x (median of per-repeat ratios)")
    return {
        "rows": B, "distinct_prompts": D, "prompt_pad": P, "T": T,
        "tokens": batch.n_tokens, "threads": torch.get_num_threads(), "repeats": args.repeats,
        "plain_s": round(med["plain"], 4), "shared_s": round(med["shared"], 4),
        "speedup": round(speedup, 3), "pair_speedup": round(pair, 3),
        "positions_ratio": round(plain_positions / shared_positions, 3),
        "max_logit_diff": gap,
    }



RANKS_SPEC = TinyLlamaSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=1408,
                           max_position_embeddings=512)
"""Part 2's model: ~26M parameters (fp32 master 104 MB, with AdamW state ~420 MB), large
enough that the step is matmul-bound on a CPU and sharding its state shows."""


def _peak_rss_mb(pid: int) -> float:
    """Peak resident memory of process ``pid`` (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_ranks(args: argparse.Namespace) -> dict:
    """Part 2: the step on 1 and 2 FSDP2 rank processes (real `RankGroup`s, gloo, one
    thread each) against the in-process `train_step` (one thread), same model and groups."""
    import tempfile

    from fleetrl.actors.model import create_tiny_llama, load_master_weights
    from fleetrl.actors.trainer import RanksConfig, TrainerConfig
    from fleetrl.actors.trainer.rank_group import RankGroup
    from fleetrl.actors.trainer.rank_protocol import Start, Train, Trained

    groups = make_groups(args.rank_groups, args.attempts, args.seed)
    batch = build_batch(groups)
    tokens = batch.n_tokens
    positions = int(batch.attention_mask.sum())
    out: dict = {"params_m": None, "rows": int(batch.tokens.shape[0]), "tokens": tokens, "positions": positions,
                 "repeats": args.rank_repeats}
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        model_dir = create_tiny_llama(Path(tmp) / "model", RANKS_SPEC, seed=args.seed)
        model = load_master_weights(model_dir)
        out["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
        opt = build_optimizer(model, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            times = []
            for i in range(args.rank_repeats + 1):
                t0 = time.perf_counter()
                train_step(model, opt, batch, corrections=CorrectionConfig(), temperature=1.0, grad_clip=1.0,
                           pass_threshold=1.0, step=i, trainer_version=0)
                times.append(time.perf_counter() - t0)
        finally:
            torch.set_num_threads(before)
        del model, opt
        med = statistics.median(times[1:])
        out["in_process"] = {"step_s": round(med, 3), "tokens_per_s": round(tokens / med, 1)}
        for world in (1, 2):
            cfg = TrainerConfig(model_dir=str(model_dir), lr=1e-6,
                                ranks=RanksConfig(world_size=world, threads=1))
            group = RankGroup(cfg, Path(tmp) / f"state-{world}", "bench")
            try:
                ready = group.start(Start(resume=None, publish=False))
                times = []
                for i in range(args.rank_repeats + 1):
                    t0 = time.perf_counter()
                    reply = group.request(Train(step=i, lr=1e-6, trainer_version=0, groups=groups, publish=False),
                                          f"step {i}")
                    times.append(time.perf_counter() - t0)
                    assert isinstance(reply, Trained), reply
                peak = [round(_peak_rss_mb(pid), 1) for pid in ready.pids]
            finally:
                group.stop()
            med = statistics.median(times[1:])
            out[f"ranks_{world}"] = {"step_s": round(med, 3), "tokens_per_s": round(tokens / med, 1),
                                     "peak_rss_mb_per_rank": peak}
    t1, t2 = out["ranks_1"]["tokens_per_s"], out["ranks_2"]["tokens_per_s"]
    out["speedup_2_over_1"] = round(t2 / t1, 3)
    out["scaling_efficiency"] = round(t2 / (2 * t1), 3)
    out["ranks_1_over_in_process"] = round(t1 / out["in_process"]["tokens_per_s"], 3)
    print(f"\nranks: model {out['params_m']}M params, {out['rows']} rows, {tokens} generated tokens "
          f"({positions} positions) per step, one thread per rank, median of {args.rank_repeats}")
    print(f"{'variant':<14}{'step s':>9}{'tokens/s':>11}{'peak RSS MB per rank':>24}")
    print(f"{'in-process':<14}{out['in_process']['step_s']:>9.3f}{out['in_process']['tokens_per_s']:>11.1f}"
          f"{'-':>24}")
    for world in (1, 2):
        r = out[f"ranks_{world}"]
        print(f"{f'{world} rank(s)':<14}{r['step_s']:>9.3f}{r['tokens_per_s']:>11.1f}"
              f"{', '.join(map(str, r['peak_rss_mb_per_rank'])):>24}")
    print(f"2 ranks over 1: {out['speedup_2_over_1']:.2f}x, scaling efficiency {out['scaling_efficiency']:.0%}; "
          f"1 rank process over the in-process step: {out['ranks_1_over_in_process']:.2f}x")
    return out


def bench_families(args: argparse.Namespace) -> dict:
    """Part 3: the torch sampler backend's decode against transformers' ``generate`` (with
    its KV cache), per family: the same tiny model (``fleetrl model init --size tiny``), a
    batch of ``--gen-batch`` random prompts of 48 tokens, ``--gen-tokens`` sampled tokens
    each (temperature 1, no stop), fp32, one thread; best of ``--rank-repeats`` runs each.
    Ours also computes and reports each token's support and log-probs; generate does not."""
    import tempfile

    from fleetrl.actors.model import load_master_weights
    from fleetrl.actors.model.families import FAMILIES
    from fleetrl.actors.model.tiny_models import create_tiny_model
    from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig
    from fleetrl.daemon.messages import SamplingParams

    rng = np.random.default_rng(args.seed)
    prompts = [[BOS_ID, *map(int, rng.integers(3, VOCAB_SIZE, 47))] for _ in range(args.gen_batch)]
    n = args.gen_tokens
    out: dict = {"batch": args.gen_batch, "new_tokens": n}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
            for family in FAMILIES:
                model_dir = create_tiny_model(Path(tmp) / family, family, seed=args.seed)
                backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="fp32"))
                params = SamplingParams(max_tokens=n, temperature=1.0, seed=1)
                hf = load_master_weights(model_dir).eval()
                ids = torch.tensor(prompts)

                def ours() -> float:
                    t0 = time.perf_counter()
                    gens = backend.generate(prompts, params)
                    dt = time.perf_counter() - t0
                    assert all(g.token_ids.shape == (n,) for g in gens)
                    return dt

                def theirs() -> float:
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        res = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                          top_k=0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
                    dt = time.perf_counter() - t0
                    assert res.shape[1] == ids.shape[1] + n
                    return dt

                ours(), theirs()  # warm-up
                t_ours = min(ours() for _ in range(args.rank_repeats))
                t_hf = min(theirs() for _ in range(args.rank_repeats))
                tokens = args.gen_batch * n
                out[family] = {"ours_tokens_per_s": round(tokens / t_ours, 1),
                               "generate_tokens_per_s": round(tokens / t_hf, 1),
                               "ratio": round(t_hf / t_ours, 3)}
    finally:
        torch.set_num_threads(before)
    print(f"\nsampler decode per family: {args.gen_batch} prompts x {n} new tokens, fp32, one thread, "
          f"best of {args.rank_repeats}")
    print(f"{'family':<10}{'ours tok/s':>12}{'generate tok/s':>16}{'ours / generate':>17}")
    for family in FAMILIES:
        r = out[family]
        print(f"{family:<10}{r['ours_tokens_per_s']:>12.1f}{r['generate_tokens_per_s']:>16.1f}{r['ratio']:>16.2f}x")
    return out


PARTS = {"prompts": bench_prompts, "ranks": bench_ranks, "families": bench_families}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--attempts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rank-groups", type=int, default=4, help="part 2: groups per step")
    ap.add_argument("--rank-repeats", type=int, default=3, help="part 2: timed steps per variant")
    ap.add_argument("--gen-batch", type=int, default=8, help="part 3: prompts per generate call")
    ap.add_argument("--gen-tokens", type=int, default=64, help="part 3: new tokens per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; choose among {', '.join(PARTS)}")
    result = {"bench": "train_step"}
    for name in parts:
        result[name] = PARTS[name](args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
