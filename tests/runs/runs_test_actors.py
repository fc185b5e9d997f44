"""An actor the orchestration tests run by import path (``runs_test_actors:scripted``).

It stands in for a whole training run inside a real `fleetrl serve`: it writes the
trainer's ``metrics.jsonl`` (lines with `StepMetrics` fields; the readers validate them
against `StepMetrics`; plain JSON here so the daemon does not import torch) and held-out
rows in the evaluator's format, then, if told to, asks the daemon to shut down, as the
trainer does at its step budget.
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
    grad_norm: float = 1.0
    fresh_gain: int = 10
    shutdown_when_done: bool = True


def _eval(fh, version: int, split: str, passed: int, n: int = 50) -> None:
    p = passed / n
    fh.write(json.dumps({"version": version, "step": version, "split": split, "n": n, "passed": passed,
                         "pass_at_1": p, "ci_low": max(0.0, p - 0.1), "ci_high": min(1.0, p + 0.1),
                         "mean_reward": p, "time": time.time()}) + "\n")
    fh.flush()


async def scripted(cfg: ScriptConfig, ctx: ActorContext, *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    metrics = ctx.state_dir / "metrics.jsonl"
    with (ctx.state_dir / "eval.jsonl").open("a") as evals:
        _eval(evals, 0, "fresh", 10)
        _eval(evals, 0, "general", 5)
        step = 0
        while (cfg.steps == 0 or step < cfg.steps) and not ctx.draining:
            step += 1
            m = dict(step=step, version=step, groups=cfg.groups_per_step,
                     trajectories=8 * cfg.groups_per_step,
                     reward_mean=min(1.0, cfg.reward0 + cfg.reward_slope * step),
                     grad_norm=cfg.grad_norm * (1 + 0.1 * (step % 2)),
                     mismatch_kl_k3=1e-3, frac_masked_tokens=0.01, staleness_hist={"0": cfg.groups_per_step})
            with metrics.open("a") as fh:
                fh.write(json.dumps(m) + "\n")
            with trio.move_on_after(cfg.interval_s):
                await ctx.wait_draining()
        _eval(evals, step, "fresh", 10 + cfg.fresh_gain)
        _eval(evals, step, "general", 6)
    if cfg.shutdown_when_done and not ctx.draining:
        ctx.request_shutdown(f"scripted run logged {step} steps")
    await ctx.wait_draining()
