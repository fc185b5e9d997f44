"""What the support cap (`max_support`) costs at a real vocabulary, per cap, against the
record it replaced (the whole vocabulary listed per token), at V = 151,936.

For each cap K in ``--caps`` and the baseline (no cap: the support of a ``top_p = 1``
call is the whole vocabulary, as before the cap), on the same random logits:

1. **record**: bytes per generated token of a `Generation` on the wire (msgpack,
   `SAMPLER.encode`) built by the torch backend's own record (`TokenLog`) from
   `sampler_support` + `sample_from_support` of ``--rows`` rows;
2. **sampler**: seconds per decode step of the sampler's support work for ``--rows`` rows
   (the support, the draw, the record of the step): what the cap adds to or saves from a
   decode step, beside the model's forward (not measured here);
3. **trainer**: seconds of the gathered loss forward and backward for ``--positions``
   positions at hidden size ``--hidden`` (0.6B's 1024): the chunked head
   (`actors/trainer/head.py`) and `policy_loss_gathered` with a K-member support, every
   correction on; the baseline pads supports to the vocabulary, as the trainer did.

Prints a table with each figure's ratio to the baseline and ends with one JSON line. The
mass a cap cuts from a real model's distribution cannot be measured here (no trained
model with this vocabulary is on this machine); docs/results/support-cap.md says what
that means for the default.

    .venv/bin/python bench/support_cap.py [--caps 64,128,256,512,1024,2048] [--rows 64] [--positions 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from fleetrl.actors.samplers.base import TokenLog
from fleetrl.actors.trainer.head import SupportHead
from fleetrl.daemon.messages import SAMPLER, SamplerIdentity
from fleetrl.grpo import CorrectionConfig, SupportLogits, policy_loss_gathered, sample_from_support, sampler_support

V = 151_936
IDENT = SamplerIdentity(sampler_id="bench", backend="torch", device_kind="cpu", dtype="float32")


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sampler_step(logits: torch.Tensor, cap: int | None, gen: torch.Generator) -> list[TokenLog]:
    """One decode step's support work for every row, as `torch_backend.DecodeRun` does it."""
    ids, lps = sampler_support(logits, temperature=1.0, top_p=1.0, top_k=cap)
    tok, tok_lp = sample_from_support(ids, lps, generator=gen)
    sizes = (ids >= 0).sum(-1).tolist()
    ids_np, lps_np = ids.numpy(), lps.numpy()
    logs = [TokenLog() for _ in range(logits.shape[0])]
    for j, (t, lp, k) in enumerate(zip(tok.tolist(), tok_lp.tolist(), sizes)):
        logs[j].add(t, lp, ids_np[j, :k], lps_np[j, :k], 0)
    return logs


def trainer_step(hidden: torch.Tensor, weight: torch.Tensor, logits_q: torch.Tensor, cap: int | None,
                 gen: torch.Generator) -> float:
    """Forward and backward of the chunked head and the gathered loss; returns the loss."""
    n = hidden.shape[0]
    ids, lq = sampler_support(logits_q, temperature=1.0, top_p=1.0, top_k=cap)
    tok, lqa = sample_from_support(ids, lq, generator=gen)
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    zS, za, lse = SupportHead.apply(h, w, None, ids.clamp(min=0), tok, 1.0, 441, False)
    K = ids.shape[1]
    loss, _ = policy_loss_gathered(SupportLogits(support=zS.reshape(1, n, K), sampled=za.reshape(1, n)),
                                   tok.reshape(1, n), lqa.reshape(1, n), ids.reshape(1, n, K), lq.reshape(1, n, K),
                                   torch.ones(1), torch.ones(1, n, dtype=torch.bool),
                                   CorrectionConfig(weighting="tis+mask", centering=True), vocab_size=V)
    loss.backward()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--caps", default="64,128,256,512,1024,2048")
    p.add_argument("--rows", type=int, default=64, help="rows of a decode step (concurrent requests)")
    p.add_argument("--positions", type=int, default=256, help="generated positions of the trainer's batch")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    caps: list[int | None] = [int(c) for c in args.caps.split(",")] + [None]
    g = torch.Generator().manual_seed(args.seed)
    step_logits = 2.0 * torch.randn(args.rows, V, generator=g)
    hidden = torch.randn(args.positions, args.hidden, generator=g) / args.hidden ** 0.5
    weight = 0.05 * torch.randn(V, args.hidden, generator=g)
    logits_q = (hidden @ weight.t()) + 0.05 * torch.randn(args.positions, V, generator=g)

    rows = []
    for cap in caps:
        logs = sampler_step(step_logits, cap, torch.Generator().manual_seed(1))
        wire = statistics.mean(len(SAMPLER.encode(log.generation(IDENT, 0))) for log in logs)
        s_time = _median(lambda: sampler_step(step_logits, cap, torch.Generator().manual_seed(1)), args.repeats)
        t_time = _median(lambda: trainer_step(hidden, weight, logits_q, cap, torch.Generator().manual_seed(2)),
                         args.repeats)
        rows.append({"cap": cap if cap is not None else V, "baseline": cap is None, "wire_bytes_per_token": wire,
                     "sampler_step_s": s_time, "trainer_s": t_time})
    base = rows[-1]
    print(f"V = {V}, {args.rows} rows per decode step, {args.positions} positions at hidden {args.hidden}")
    print(f"{'cap':>8} {'bytes/token':>12} {'x base':>8} {'sampler s/step':>15} {'x base':>8} "
          f"{'trainer s':>10} {'x base':>8}")
    for r in rows:
        r["wire_ratio"] = r["wire_bytes_per_token"] / base["wire_bytes_per_token"]
        r["sampler_ratio"] = r["sampler_step_s"] / base["sampler_step_s"]
        r["trainer_ratio"] = r["trainer_s"] / base["trainer_s"]
        name = "none" if r["baseline"] else str(r["cap"])
        print(f"{name:>8} {r['wire_bytes_per_token']:>12.0f} {r['wire_ratio']:>8.4f} {r['sampler_step_s']:>15.4f} "
              f"{r['sampler_ratio']:>8.3f} {r['trainer_s']:>10.3f} {r['trainer_ratio']:>8.3f}")
    print(json.dumps({"bench": "support_cap", "vocab": V, "rows": args.rows, "positions": args.positions,
                      "hidden": args.hidden, "threads": torch.get_num_threads(), "caps": rows},
                     default=lambda x: float(x) if isinstance(x, np.floating) else x))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
