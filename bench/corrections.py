"""Ablation of the off-policy corrections on a mismatch simulator.

A tiny autoregressive softmax policy (bigram table ``W[prev]`` plus a per-position
bias ``P[t]``, V tokens, T steps) is trained with :func:`fleetrl.grpo.policy_loss`
(GRPO groups, Adam) to emit a hidden target sequence; the reward of a sequence is the
fraction of its positions equal to the target (credit is assigned per sequence, so
each token's advantage is noisy, as in real GRPO). Rollouts come from a *sampler* whose policy differs from
the trainer's, the way a fleet's samplers do:

* ``stale8``: the trainer's parameters from 8 optimiser steps ago;
* ``bf16``: parameters rounded to bfloat16, logits computed in bfloat16;
* ``fp8``: parameters quantised to torch.float8_e4m3fn with per-row (per-channel)
  scales by ``fleetrl.actors.weights.quant`` (what fp8 samplers hold), stale by 1;
* ``noise``: Gaussian noise (sd 1) on the sampler's logits;
* ``fleet``: each group drawn from one of {bf16 stale 1, fp8 stale 2, noise stale 3};
* ``hard``: each group from one of {bf16 stale 8, fp8 with one scale per tensor stale
  8, noise sd 1 stale 8} (the ablation's hard regime: staleness 8, coarse fp8, and a
  third kind of numerics standing in for vLLM's).

Samplers use temperature 1 and nucleus ``top_p`` and report their support
(:func:`fleetrl.grpo.sampler_support`). Variants (same steps, seeds, data order):

* ``on-policy``: sampler == trainer, the reference line (rho == 1 exactly);
* ``no-corr``: weight 1, trainer uses its full softmax (what most trainers do);
* ``tis``: truncated IS (C = 2), full softmax;
* ``mask``: two-sided mask [0.5, 5], full softmax;
* ``mask+replay``: mask, trainer renormalised over the reported support;
* ``mask+replay+cent``: and exact score centering;
* ``tis+mask+replay+cent``: capped and masked, replay, centering (where centering is
  not a no-op: with an uncapped in-band IS weight the centering term vanishes exactly).

Printed per scenario: final reward (exact expected reward of the trainer's policy,
sampled with the same top_p, at the last step; mean +- std over seeds), reward-curve
area (mean of that over evaluation points), grad-norm mean and std over steps, the
mismatch KL(q || p) per token (exact, full vocabulary, sampler vs trainer), the
fraction of tokens masked, and collapse: in how many seeds, and from which step, the
evaluated reward collapsed (`fleetrl.actors.runs.collapse`: it fell below half its
peak, smoothed over 5 evaluations, and stayed there to the end for 3 evaluations or
more; or a loss or gradient went non-finite, a step the trainer, like fleetrl's, then
skips). With the ``on-policy`` baseline in the run, each variant's final reward and
area are also printed as ratios to the baseline's. Ends with one JSON line.

The default run is short (100 steps). Stability over a run is the long mode's
question: ``--long`` trains 1000 steps on the stale8, fleet and hard scenarios, always
with the on-policy baseline (any of ``--steps``, ``--scenarios``, ``--seeds``,
``--eval-every`` given explicitly wins).

    .venv/bin/python bench/corrections.py [--steps 100 --seeds 3 --scenarios all]
    .venv/bin/python bench/corrections.py --long
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from fleetrl.actors.runs.collapse import detect_collapse
from fleetrl.actors.weights.quant import dequantize_fp8, quantize_fp8
from fleetrl.grpo import CorrectionConfig, group_advantages, policy_loss, sample_from_support, sampler_support

VARIANTS: dict[str, tuple[CorrectionConfig, bool]] = {
    # name: (config, trainer replays the reported support)
    "on-policy": (CorrectionConfig(weighting="none", centering=False), True),
    "no-corr": (CorrectionConfig(weighting="none", centering=False), False),
    "tis": (CorrectionConfig(weighting="tis", tis_cap=2.0, centering=False), False),
    "mask": (CorrectionConfig(weighting="mask", mask_low=0.5, mask_high=5.0, centering=False), False),
    "mask+replay": (CorrectionConfig(weighting="mask", mask_low=0.5, mask_high=5.0, centering=False), True),
    "mask+replay+cent": (CorrectionConfig(weighting="mask", mask_low=0.5, mask_high=5.0, centering=True), True),
    "tis+mask+replay+cent": (
        CorrectionConfig(weighting="tis+mask", tis_cap=1.2, mask_low=0.5, mask_high=5.0, centering=True), True),
}


@dataclass(frozen=True)
class Scenario:
    name: str
    stale: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp8 (per-row scales) | fp8-tensor (one scale per tensor)
    noise: float = 0.0
    fleet: tuple[Scenario, ...] = ()
    """Members: each group is drawn by one of them, round-robin."""


FLEET_MEMBERS = (Scenario("bf16s1", stale=1, precision="bf16"), Scenario("fp8s2", stale=2, precision="fp8"),
                 Scenario("noise-s3", stale=3, noise=0.5))
HARD_MEMBERS = (Scenario("bf16s8", stale=8, precision="bf16"), Scenario("fp8ts8", stale=8, precision="fp8-tensor"),
                Scenario("noise-s8", stale=8, noise=1.0))
SCENARIOS = {
    "stale8": Scenario("stale8", stale=8),
    "bf16": Scenario("bf16", precision="bf16"),
    "fp8": Scenario("fp8", stale=1, precision="fp8"),
    "noise": Scenario("noise", noise=1.0),
    "fleet": Scenario("fleet", fleet=FLEET_MEMBERS),
    "hard": Scenario("hard", fleet=HARD_MEMBERS),
}
BASELINE = "on-policy"
LONG = {"steps": 1000, "scenarios": "stale8,fleet,hard", "seeds": 3, "eval_every": 20}
"""What ``--long`` sets (unless given explicitly)."""
COLLAPSE_WINDOW = 5
"""Evaluations the collapse test smooths over."""


@dataclass
class Args:
    V: int
    T: int
    groups: int
    G: int
    lr: float
    top_p: float
    steps: int
    eval_every: int
    eval_n: int


def sampler_params(history: deque, sc: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    W, P = history[-1 - min(sc.stale, len(history) - 1)]
    if sc.precision == "bf16":
        return W.bfloat16(), P.bfloat16()
    if sc.precision in ("fp8", "fp8-tensor"):
        scheme = "row" if sc.precision == "fp8" else "tensor"
        return tuple(dequantize_fp8(*quantize_fp8(x, scheme), scheme, dtype=torch.float32) for x in (W, P))
    return W, P


def rollout(W, P, n: int, a: Args, noise: float, g: torch.Generator):
    """Sample n sequences; returns tokens [n,T], log q^S [n,T], support ids/logprobs
    [n,T,V] (padded), and the sampler's full log q [n,T,V] (for the exact KL)."""
    prev = torch.zeros(n, dtype=torch.long)
    toks, lqa, sids, slq, fullq = [], [], [], [], []
    for t in range(a.T):
        z = W[prev] + P[t]  # computed in the sampler's dtype
        z = z.float()
        if noise:
            z = z + noise * torch.randn(z.shape, generator=g)
        ids, lq = sampler_support(z, temperature=1.0, top_p=a.top_p, top_k=None)
        tok, lp = sample_from_support(ids, lq, generator=g)
        pad = a.V - ids.shape[1]
        sids.append(torch.nn.functional.pad(ids, (0, pad), value=-1))
        slq.append(torch.nn.functional.pad(lq, (0, pad), value=-math.inf))
        fullq.append(torch.log_softmax(z, -1))
        toks.append(tok)
        lqa.append(lp)
        prev = tok
    return (torch.stack(toks, 1), torch.stack(lqa, 1), torch.stack(sids, 1), torch.stack(slq, 1),
            torch.stack(fullq, 1))


def reward(tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fraction of positions equal to the target (one reward per sequence)."""
    return (tokens == target).float().mean(1)


def trainer_logits(W, P, tokens):
    prev = torch.cat([torch.zeros(tokens.shape[0], 1, dtype=torch.long), tokens[:, :-1]], 1)
    return W[prev] + P.unsqueeze(0)


def run_one(sc: Scenario, variant: str, seed: int, a: Args) -> dict:
    config, replay = VARIANTS[variant]
    g_init = torch.Generator().manual_seed(seed)
    W = (0.3 * torch.randn(a.V, a.V, generator=g_init)).requires_grad_(True)
    P = (0.3 * torch.randn(a.T, a.V, generator=g_init)).requires_grad_(True)
    target = torch.randint(0, a.V, (a.T,), generator=g_init)
    opt = torch.optim.Adam([W, P], lr=a.lr)
    g = torch.Generator().manual_seed(seed + 1)
    g_eval = torch.Generator()
    history: deque = deque(maxlen=16)
    evals, eval_steps, grad_norms, kls, masked, nonfinite = [], [], [], [], [], []
    for step in range(a.steps + 1):
        history.append((W.detach().clone(), P.detach().clone()))
        if step % a.eval_every == 0 or step == a.steps:
            with torch.no_grad():
                g_eval.manual_seed(10_000 + step)
                tok_e = rollout(W.detach(), P.detach(), a.eval_n, a, 0.0, g_eval)[0]
                evals.append(float(reward(tok_e, target).mean()))
                eval_steps.append(step)
        if step == a.steps:
            break
        # --- rollouts from the sampler(s)
        n = a.groups * a.G
        if sc.fleet:  # groups dealt round-robin to the members; each group from one sampler
            counts = [len(range(i, a.groups, len(sc.fleet))) for i in range(len(sc.fleet))]
            members = [(m, c * a.G) for m, c in zip(sc.fleet, counts) if c]
        else:
            members = [(sc, n)]
        parts = []
        for m, per in members:
            if variant == "on-policy":
                Ws, Ps, noise = W.detach(), P.detach(), 0.0
            else:
                (Ws, Ps), noise = sampler_params(history, m), m.noise
            parts.append(rollout(Ws, Ps, per, a, noise, g))
        tok, lqa, sids, slq, fullq = (torch.cat(x) for x in zip(*parts))
        K = int((sids >= 0).sum(-1).max())
        sids, slq = sids[..., :K], slq[..., :K]
        rewards = reward(tok, target)
        adv = group_advantages(rewards.reshape(a.groups, a.G)).reshape(-1)
        logits = trainer_logits(W, P, tok)
        mask = torch.ones_like(tok, dtype=torch.bool)
        if replay:
            loss, met = policy_loss(logits, tok, lqa, sids, slq if config.centering else None, adv, mask, config)
        else:
            loss, met = policy_loss(logits, tok, lqa, None, None, adv, mask, config)
        opt.zero_grad()
        loss.backward()
        norm = float(torch.sqrt(W.grad.square().sum() + P.grad.square().sum()))
        if not (math.isfinite(norm) and math.isfinite(float(loss.detach()))):
            nonfinite.append(step + 1)  # skipped, as fleetrl's trainer skips a non-finite gradient
        else:
            grad_norms.append(norm)
            opt.step()
        with torch.no_grad():
            lp = torch.log_softmax(logits.detach(), -1)
            kls.append(float((fullq.exp() * (fullq - lp)).sum(-1).mean()))
        masked.append(met["frac_masked_tokens"])
    collapse = detect_collapse(eval_steps, evals, nonfinite_steps=nonfinite, window=COLLAPSE_WINDOW)
    return {
        "final_reward": evals[-1],
        "area": sum(evals) / len(evals),
        "grad_norm_mean": statistics.fmean(grad_norms) if grad_norms else math.nan,
        "grad_norm_std": statistics.pstdev(grad_norms) if grad_norms else math.nan,
        "kl": statistics.fmean(kls),
        "masked": statistics.fmean(masked),
        "collapse_step": collapse.step if collapse.collapsed else None,
    }


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def ratio(x: float, base: float) -> float | None:
    return x / base if base > 0 else None


def collapse_text(steps: list[int | None]) -> str:
    """``"0/3"`` or ``"2/3 (steps 340, 520)"``: seeds that collapsed, and where."""
    hit = [s for s in steps if s is not None]
    return f"{len(hit)}/{len(steps)}" + (f" (step{'s' if len(hit) > 1 else ''} {', '.join(map(str, hit))})"
                                         if hit else "")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Ablation of fleetrl.grpo's off-policy corrections.")
    ap.add_argument("--long", action="store_true",
                    help=f"the long run: {LONG['steps']} steps, scenarios {LONG['scenarios']}, {LONG['seeds']} seeds, "
                         f"evaluated every {LONG['eval_every']} steps, with the {BASELINE} baseline "
                         "(explicit options win)")
    ap.add_argument("--steps", type=int, default=None, help="default 100 (--long: 1000)")
    ap.add_argument("--seeds", type=int, default=None, help="default 3")
    ap.add_argument("--scenarios", default=None, help="comma list of " + ",".join(SCENARIOS) + " or all (default all)")
    ap.add_argument("--variants", default="all", help="comma list of " + ",".join(VARIANTS) + " or all")
    ap.add_argument("--V", type=int, default=32)
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--eval-every", type=int, default=None, help="default 10 (--long: 20)")
    ap.add_argument("--eval-n", type=int, default=256)
    ns = ap.parse_args(argv)
    short = {"steps": 100, "scenarios": "all", "seeds": 3, "eval_every": 10}
    for key, value in (LONG if ns.long else short).items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    for key in ("steps", "seeds", "eval_every", "eval_n", "groups", "G", "V", "T"):
        if getattr(ns, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(ns, key)}")
    return ns


def main(argv: list[str] | None = None) -> None:
    ns = parse(argv)
    torch.set_num_threads(1)
    a = Args(V=ns.V, T=ns.T, groups=ns.groups, G=ns.G, lr=ns.lr, top_p=ns.top_p, steps=ns.steps,
             eval_every=ns.eval_every, eval_n=ns.eval_n)
    scenarios = list(SCENARIOS) if ns.scenarios == "all" else ns.scenarios.split(",")
    variants = list(VARIANTS) if ns.variants == "all" else ns.variants.split(",")
    for name in scenarios + variants:
        if name not in SCENARIOS and name not in VARIANTS:
            raise SystemExit(f"unknown scenario or variant {name!r}")
    if ns.long and BASELINE not in variants:
        variants.append(BASELINE)
    if BASELINE in variants:  # first, so that every other variant has its ratios
        variants.remove(BASELINE)
        variants.insert(0, BASELINE)
    t0 = time.perf_counter()
    print(f"policy: bigram softmax V={a.V} T={a.T}; {a.groups} groups x G={a.G}; Adam lr={a.lr}; "
          f"top_p={a.top_p}; {a.steps} steps{' (long run)' if ns.long else ''}; seeds 0..{ns.seeds - 1}; "
          f"mean +- std over seeds; evaluated every {a.eval_every} steps")
    results: dict = {}
    for sname in scenarios:
        sc = SCENARIOS[sname]
        print(f"\nscenario {sname}")
        print(f"{'variant':<22}{'final reward':>16}{'area':>16}{'grad norm':>18}{'KL(q||p)':>11}{'masked':>8}"
              f"  {'final/base':>10}{'area/base':>10}  collapsed")
        results[sname] = {}
        base = None
        for v in variants:
            runs = [run_one(sc, v, seed, a) for seed in range(ns.seeds)]
            numbers = [k for k in runs[0] if k != "collapse_step"]
            agg = {k: mean_std([r[k] for r in runs]) for k in numbers}
            steps = [r["collapse_step"] for r in runs]
            row = {k: [round(m, 5), round(s, 5)] for k, (m, s) in agg.items()}
            row["collapsed"] = sum(s is not None for s in steps)
            row["collapse_steps"] = steps
            if v == BASELINE:
                base = agg
            if base is not None:
                row["final_ratio"] = ratio(agg["final_reward"][0], base["final_reward"][0])
                row["area_ratio"] = ratio(agg["area"][0], base["area"][0])
            results[sname][v] = row
            fr, ar, gm, gs, kl, mk = (agg["final_reward"], agg["area"], agg["grad_norm_mean"],
                                      agg["grad_norm_std"], agg["kl"], agg["masked"])
            fratio, aratio = row.get("final_ratio"), row.get("area_ratio")
            print(f"{v:<22}{fr[0]:>9.3f} +-{fr[1]:.3f}{ar[0]:>9.3f} +-{ar[1]:.3f}"
                  f"{gm[0]:>10.3f} (sd {gs[0]:.3f}){kl[0]:>11.2e}{mk[0]:>8.3f}"
                  f"  {'-' if fratio is None else format(fratio, '.3f'):>10}"
                  f"{'-' if aratio is None else format(aratio, '.3f'):>10}  {collapse_text(steps)}")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    print(json.dumps({"bench": "corrections", "mode": "long" if ns.long else "default", "steps": a.steps,
                      "seeds": ns.seeds, "V": a.V, "T": a.T, "top_p": a.top_p, "eval_every": a.eval_every,
                      "baseline": BASELINE if BASELINE in variants else None, "results": results}))


if __name__ == "__main__":
    main()
