"""policy_loss forward+backward speed vs a plain GRPO token loss, on CPU.

Baseline: the usual GRPO token loss, ``-(A * log_softmax(z)[a])`` averaged over the
loss mask. Ours: :func:`fleetrl.grpo.policy_loss` with support replay (K members per
position), two-sided mask + TIS, a sequence mask and exact score centering; and, for
reference, ours over the full vocabulary (no support). Same logits, same tokens, same
machine, interleaved repeats; the median of each is reported. Goal: ours / plain <= 1.5.

    .venv/bin/python bench/loss_speed.py [--B 16 --T 256 --V 32000 --K 64 --repeats 5 --threads 0]

On a machine shared with other jobs, ``--threads 1`` avoids OpenMP threads waiting on a
descheduled sibling, which inflates every small op and blurs the ratio.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fleetrl.grpo import CorrectionConfig, policy_loss, sample_from_support, sampler_support


def plain_grpo(logits, tokens, advantages, loss_mask):
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    per_tok = -advantages.unsqueeze(-1) * lp
    return (per_tok * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def make_inputs(B: int, T: int, V: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, T, V, generator=g)
    ids_rows, lq_rows = [], []
    flat = logits.reshape(B * T, V)
    for start in range(0, B * T, 256):  # the sampler's view: a perturbed copy, nucleus capped at K
        chunk = flat[start : start + 256] + 0.1 * torch.randn(flat[start : start + 256].shape, generator=g)
        ids, lq = sampler_support(chunk, temperature=1.0, top_p=0.95, top_k=K)
        pad = K - ids.shape[1]
        ids_rows.append(torch.nn.functional.pad(ids, (0, pad), value=-1))
        lq_rows.append(torch.nn.functional.pad(lq, (0, pad), value=-float("inf")))
    ids = torch.cat(ids_rows)
    lq = torch.cat(lq_rows)
    tok, lqa = sample_from_support(ids, lq, generator=g)
    return dict(
        logits=logits,
        tokens=tok.reshape(B, T),
        sampler_logprobs=lqa.reshape(B, T),
        support_ids=ids.reshape(B, T, K),
        support_logprobs=lq.reshape(B, T, K),
        advantages=torch.randn(B, generator=g),
        loss_mask=torch.rand(B, T, generator=g) < 0.9,
    )


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    x = make_inputs(args.B, args.T, args.V, args.K, args.seed)
    config = CorrectionConfig(weighting="tis+mask", tis_cap=2.0, mask_low=0.5, mask_high=5.0,
                              seq_mask=(0.5, 2.0), centering=True)
    # full-vocabulary run: q over the vocabulary, padded with -inf off the support
    B, T, V = x["logits"].shape
    full_q = torch.full((B, T, V + 1), -1e4)  # every token possible; column V takes the padding
    full_q.scatter_(-1, x["support_ids"].masked_fill(x["support_ids"] < 0, V), x["support_logprobs"])
    full_q = torch.log_softmax(full_q[..., :V], -1)
    full_slp = full_q.gather(-1, x["tokens"].unsqueeze(-1)).squeeze(-1)

    def leaf():
        return x["logits"].clone().requires_grad_(True)

    def run_plain():
        z = leaf()
        plain_grpo(z, x["tokens"], x["advantages"], x["loss_mask"]).backward()

    def run_ours():
        z = leaf()
        loss, _ = policy_loss(z, x["tokens"], x["sampler_logprobs"], x["support_ids"], x["support_logprobs"],
                              x["advantages"], x["loss_mask"], config)
        loss.backward()

    def run_ours_full():
        z = leaf()
        loss, _ = policy_loss(z, x["tokens"], full_slp, None, full_q, x["advantages"], x["loss_mask"], config)
        loss.backward()

    # the clone of the leaf is in every variant; time it alone to report it
    runs = {"plain": run_plain, "ours_support": run_ours, "ours_full_vocab": run_ours_full, "clone_only": leaf}
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["ours_support"] / med["plain"]
    ratio_full = med["ours_full_vocab"] / med["plain"]
    print(f"B={args.B} T={args.T} V={args.V} K={args.K} threads={torch.get_num_threads()} repeats={args.repeats}")
    print(f"{'variant':<18}{'median s':>10}{'min s':>10}{'vs plain':>10}")
    for name in runs:
        print(f"{name:<18}{med[name]:>10.3f}{min(times[name]):>10.3f}{med[name] / med['plain']:>10.2f}")
    print(f"policy_loss (support replay + centering) / plain GRPO = {ratio:.2f}x (goal <= 1.5x)")
    print(json.dumps({
        "bench": "loss_speed", "B": args.B, "T": args.T, "V": args.V, "K": args.K,
        "threads": torch.get_num_threads(), "repeats": args.repeats,
        "plain_s": round(med["plain"], 4), "ours_support_s": round(med["ours_support"], 4),
        "ours_full_vocab_s": round(med["ours_full_vocab"], 4), "clone_s": round(med["clone_only"], 4),
        "ratio": round(ratio, 3), "ratio_full_vocab": round(ratio_full, 3), "goal_ratio": 1.5,
        "meets_goal": ratio <= 1.5,
    }))


if __name__ == "__main__":
    main()
