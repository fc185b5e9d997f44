"""An actor the orchestration tests run by import path (``runs_test_actors:scripted``).

It stands in for a whole training run inside a real `fleetrl serve`: it writes the
trainer's ``metrics.jsonl`` (lines with `StepMetrics` fields; the readers validate them
against `StepMetrics`; plain JSON here so the daemon does not import torch) and held-out
rows in the evaluator's format, with per-task rewards, then, if told to, asks the daemon
to shut down, as the trainer does at its step budget.

Everything it writes is a function of its config, ``seed`` included (the ablation sets
``seed`` in the trainer's config and ``n`` in the evaluator's; here both are this
actor), so a test can tell from the logs which seed and arm a run was.
"""

from __future__ import annotations

import json
import time

import msgspec
import trio

from fleetrl.daemon.actor import ActorContext


class ScriptConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    steps: int = 3
    """Steps to log; 0: log steps until drained."""
    interval_s: float = 0.05
    groups_per_step: int = 4
    reward0: float = 0.2
    reward_slope: float = 0.1
    collapse_at: int = 0
    """From this step on (0: never) the reward is 0.01: the run collapses."""
    grad_norm: float = 1.0
    fresh_gain: int = 10
    """Tasks (of ``n``) the final evaluation solves beyond the first one's."""
    kl: float = 1e-3
    """``mismatch_kl_k3`` of every step."""
    seed: int = 0
    """Adds ``0.01 * seed`` to every reward and ``seed`` solved tasks to every evaluation."""
    n: int = 50
    """Held-out tasks per evaluation."""
    shutdown_when_done: bool = True


def _eval(fh, version: int, split: str, passed: int, n: int) -> None:
    passed = max(0, min(n, passed))
    p = passed / n
    rewards = [1.0] * passed + [0.0] * (n - passed)  # the first `passed` tasks pass
    fh.write(json.dumps({"version": version, "step": version, "split": split, "n": n, "passed": passed,
                         "pass_at_1": p, "ci_low": max(0.0, p - 0.1), "ci_high": min(1.0, p + 0.1),
                         "mean_reward": p, "time": time.time(), "rewards": rewards}) + "\n")
    fh.flush()


async def scripted(cfg: ScriptConfig, ctx: ActorContext, *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    metrics = ctx.state_dir / "metrics.jsonl"
    with (ctx.state_dir / "eval.jsonl").open("a") as evals:
        _eval(evals, 0, "fresh", 10 + cfg.seed, cfg.n)
        _eval(evals, 0, "general", 5 + cfg.seed, cfg.n)
        step = 0
        while (cfg.steps == 0 or step < cfg.steps) and not ctx.draining:
            step += 1
            reward = min(1.0, cfg.reward0 + cfg.reward_slope * step + 0.01 * cfg.seed)
            if cfg.collapse_at and step >= cfg.collapse_at:
                reward = 0.01
            m = dict(step=step, version=step, groups=cfg.groups_per_step,
                     trajectories=8 * cfg.groups_per_step, reward_mean=reward,
                     grad_norm=cfg.grad_norm * (1 + 0.1 * (step % 2)),
                     mismatch_kl_k3=cfg.kl, mismatch_kl_by_sampler={"torch/float32": cfg.kl, "vllm/bfloat16": 2 * cfg.kl},
                     tokens_by_sampler={"torch/float32": 10, "vllm/bfloat16": 30}, frac_masked_tokens=0.01,
                     staleness_hist={"0": cfg.groups_per_step})
            with metrics.open("a") as fh:
                fh.write(json.dumps(m) + "\n")
            with trio.move_on_after(cfg.interval_s):
                await ctx.wait_draining()
        _eval(evals, step, "fresh", 10 + cfg.seed + cfg.fresh_gain, cfg.n)
        _eval(evals, step, "general", 6 + cfg.seed, cfg.n)
    if cfg.shutdown_when_done and not ctx.draining:
        ctx.request_shutdown(f"scripted run logged {step} steps")
    await ctx.wait_draining()
