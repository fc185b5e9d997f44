"""The trainer's LM head at a real vocabulary: memory and time per generated token,
chunked (ours) against the plain head (the baseline: what the trainer did before).

For each ``--tokens`` N (generated positions of one micro-batch) at hidden size
``--hidden`` (0.6B's 1024) and V = 151,936, one forward and backward of the loss over
the head, each arm in a fresh subprocess whose peak RSS (``ru_maxrss``) is read after it:

* **plain**: the head's logits ``[N, V]`` (``h @ W^T``), divided by the temperature,
  `policy_loss` with a 512-member support gathered from them; the backward forms the
  dense ``[N, V]`` gradient;
* **chunked**: `actors/trainer/head.py` (`SupportHead`, chunks of ``logits_chunk_mb``)
  and `policy_loss_gathered` on the same inputs: only the gathered logits are kept.

The model below the head is left out: it costs the same in both arms. Peak RSS counts
the process (torch, the inputs, ``W`` and its gradient: the same in both arms), so the
per-token figure is the difference of two N. Prints a table with the ratios and ends
with one JSON line.

    .venv/bin/python bench/trainer_head.py [--tokens 1024,4096] [--hidden 1024] [--chunk-mb 256]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import time

V = 151_936
K = 512


def _arm(kind: str, n: int, hidden: int, chunk_mb: int, out: mp.Queue) -> None:
    import torch

    from fleetrl.actors.trainer.head import SupportHead, chunk_positions
    from fleetrl.grpo import CorrectionConfig, SupportLogits, policy_loss, policy_loss_gathered

    torch.manual_seed(0)
    h = (torch.randn(n, hidden) / hidden ** 0.5).requires_grad_(True)
    w = (0.05 * torch.randn(V, hidden)).requires_grad_(True)
    ids = torch.stack([torch.randperm(V)[:K] for _ in range(8)]).repeat(n // 8 + 1, 1)[:n]
    tok = ids[:, 0].clone()
    lq = torch.log_softmax(torch.randn(n, K), -1)
    args = dict(advantages=torch.ones(1), loss_mask=torch.ones(1, n, dtype=torch.bool),
                config=CorrectionConfig(weighting="tis+mask", centering=True))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if kind == "plain":
        logits = (h @ w.t()).float() / 1.0
        loss, _ = policy_loss(logits[None], tok[None], lq[:, 0][None], ids[None], lq[None], **args)
    else:
        zS, za, _ = SupportHead.apply(h, w, None, ids, tok, 1.0, chunk_positions(V, chunk_mb << 20), False)
        loss, _ = policy_loss_gathered(SupportLogits(support=zS[None], sampled=za[None]), tok[None], lq[:, 0][None],
                                       ids[None], lq[None], vocab_size=V, **args)
    loss.backward()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out.put({"arm": kind, "tokens": n, "seconds": dt, "peak_rss_mb": peak / 1024, "before_mb": base / 1024})


def run_arm(kind: str, n: int, hidden: int, chunk_mb: int) -> dict:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_arm, args=(kind, n, hidden, chunk_mb, q))
    p.start()
    try:
        result = q.get(timeout=1800)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk-mb", type=int, default=256)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.tokens.split(",")]
    if len(sizes) < 2:
        ap.error("--tokens needs two sizes at least (memory per token is their difference)")
    rows = [run_arm(kind, n, args.hidden, args.chunk_mb) for n in sizes for kind in ("plain", "chunked")]
    per_token = {}
    for kind in ("plain", "chunked"):
        a, b = (next(r for r in rows if r["arm"] == kind and r["tokens"] == n) for n in (sizes[0], sizes[-1]))
        per_token[kind] = (b["peak_rss_mb"] - a["peak_rss_mb"]) * 1024 / (sizes[-1] - sizes[0])
    print(f"V = {V}, hidden {args.hidden}, support {K}, chunks of {args.chunk_mb} MiB")
    print(f"{'tokens':>7} {'arm':>8} {'peak RSS MB':>12} {'seconds':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['arm']:>8} {r['peak_rss_mb']:>12.0f} {r['seconds']:>8.2f}")
    for n in sizes:
        p, c = (next(r for r in rows if r["arm"] == k and r["tokens"] == n) for k in ("plain", "chunked"))
        print(f"{n} tokens: chunked / plain peak RSS {c['peak_rss_mb'] / p['peak_rss_mb']:.3f}, "
              f"time {c['seconds'] / p['seconds']:.3f}")
    print(f"memory per generated token: plain {per_token['plain']:.0f} KB, chunked {per_token['chunked']:.1f} KB "
          f"(ratio {per_token['chunked'] / per_token['plain']:.4f})")
    print(json.dumps({"bench": "trainer_head", "vocab": V, "hidden": args.hidden, "support": K,
                      "chunk_mb": args.chunk_mb, "rows": rows, "kb_per_token": per_token}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
