"""train_step speed: prompt-shared forward vs the plain full-row forward, on CPU.

The embedded recipe's step: the default tiny model (`TinyLlamaSpec()`, ~1.9M
parameters), 16 groups x 8 attempts = 128 rows, each group's prompt ~50 byte tokens
(40-60), completions 5-30 tokens, supports of 1-16 tokens. Baseline: `train_step` with
``share_prompts=False`` (every row forwarded in full); ours: ``share_prompts=True``
(each distinct prompt once, `fleetrl.actors.trainer.prefix`). Both run on the same model
and batch, interleaved, after a warm-up; the median of each is reported, with the
logits gap between the paths as a check that the speed-up is not a different
computation. ``speedup`` is the ratio of the medians; ``pair_speedup`` the median of the
per-repeat ratios (each plain run next to its shared run), which drifting load on a
shared machine disturbs less.

    nice .venv/bin/python bench/train_step.py [--groups 16 --attempts 8 --repeats 7 --threads 1]

On a machine shared with other jobs, ``--threads 1`` avoids OpenMP threads waiting on a
descheduled sibling, which inflates every op and blurs the ratio.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

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
    return build_batch(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--attempts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

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
    print(json.dumps({
        "bench": "train_step", "rows": B, "distinct_prompts": D, "prompt_pad": P, "T": T,
        "tokens": batch.n_tokens, "threads": torch.get_num_threads(), "repeats": args.repeats,
        "plain_s": round(med["plain"], 4), "shared_s": round(med["shared"], 4),
        "speedup": round(speedup, 3), "pair_speedup": round(pair, 3),
        "positions_ratio": round(plain_positions / shared_positions, 3),
        "max_logit_diff": gap,
    }))


if __name__ == "__main__":
    main()
