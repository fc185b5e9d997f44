"""Hand-made run logs: a state directory with a trainer metrics.jsonl and an eval.jsonl,
written with the same encoder the trainer uses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from fleetrl.actors.trainer.step import StepMetrics


def step_metrics(step: int, **kw) -> StepMetrics:
    base = dict(
        version=step, groups=4, trajectories=32, rows=32, tokens=900, loss=0.1,
        grad_norm=0.5 + 0.1 * step, reward_mean=0.2 + 0.05 * step, pass_rate=0.1 + 0.04 * step,
        mismatch_kl_k3=1e-3,
        mismatch_kl_by_sampler={"torch/float32": 1e-7 * step, "torch/bfloat16": 1e-3,
                                "torch/fp8": 1e-2},
        tokens_by_sampler={"torch/float32": 300, "torch/bfloat16": 300, "torch/fp8": 300},
        staleness_hist={0: 2, 1: 1, 2: 1}, step_s=2.0, publish_s=0.5, delta_ratio=8.0,
        delta_density=0.05, delta_bytes=1000,
    )
    base.update(kw)
    return StepMetrics(step=step, **base)


def eval_row(version: int, step: int, split: str, passed: int, n: int = 200, t: float = 1000.0,
             **kw) -> dict:
    p = passed / n
    row = {"version": version, "step": step, "split": split, "n": n, "passed": passed,
           "pass_at_1": p, "ci_low": max(0.0, p - 0.05), "ci_high": min(1.0, p + 0.05),
           "mean_reward": min(1.0, p + 0.1), "time": t}
    row.update(kw)
    return row


def metrics_line(m: StepMetrics, **extra) -> bytes:
    raw = msgspec.json.decode(msgspec.json.encode(m))
    raw.update(extra)
    return msgspec.json.encode(raw) + b"\n"


@pytest.fixture
def make_state(tmp_path: Path) -> Callable[..., Path]:
    """make_state(steps=..., evals=..., tail=b"") -> a state dir with both logs."""

    def make(steps: list[StepMetrics] | None = None, evals: list[dict] | None = None,
             tail: bytes = b"") -> Path:
        state = tmp_path / "state"
        (state / "actors" / "trainer").mkdir(parents=True, exist_ok=True)
        (state / "actors" / "evaluator").mkdir(parents=True, exist_ok=True)
        steps = steps if steps is not None else [step_metrics(i) for i in range(1, 11)]
        lines = [metrics_line(m) for m in steps]
        (state / "actors" / "trainer" / "metrics.jsonl").write_bytes(b"".join(lines) + tail)
        evals = evals if evals is not None else default_evals()
        (state / "actors" / "evaluator" / "eval.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in evals))
        return state

    return make


def default_evals() -> list[dict]:
    return [
        eval_row(0, 0, "fresh", 70, t=1000.0), eval_row(0, 0, "general", 40, t=1010.0),
        eval_row(5, 5, "fresh", 90, t=1300.0), eval_row(5, 5, "general", 44, t=1310.0),
        eval_row(10, 10, "fresh", 120, t=1600.0), eval_row(10, 10, "general", 46, t=1612.5),
    ]


@pytest.fixture
def h():
    """The helpers above, for the test modules (importlib mode: no conftest imports)."""
    import types

    return types.SimpleNamespace(step_metrics=step_metrics, eval_row=eval_row,
                                 metrics_line=metrics_line, default_evals=default_evals)
