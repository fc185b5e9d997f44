"""The sampling contract end to end: an external harness (a real process using the official
openai client) calls the endpoint at its own sampling settings; what each call was sampled
with travels with its tokens to the trainer, which scores every row at its own temperature.

Before the contract, the trainer divided every row's logits by its one configured
temperature (1.0): a harness at temperature 0.7 then had its tokens' log q computed at 0.7
and their log p at 1.0, so the importance ratios were biased wherever the model is
uncertain, with no error and no metric (`test_..._ratios_are_exactly_one` shows the
size of that bias by scoring the same rows without their record: the old behaviour);
and a harness at temperature 0 (greedy) gave one-token supports whose gradient is exactly
zero, trained silently as rows of nothing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import trio
from fakes import TorchClient, serving

from fleetrl.actors.model import load_model
from fleetrl.actors.trainer.batch import build_batch
from fleetrl.actors.trainer.step import RowDetail, build_optimizer, train_step
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor
from fleetrl.grpo import CorrectionConfig
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app
from fleetrl.harness.sampling_policy import SamplingPolicy

SCRIPT = Path(__file__).parent / "scripts" / "sampled_calls.py"


@pytest.fixture(scope="module")
def tiny(tiny_served):
    return tiny_served


async def _harness_attempts(tiny, policy: SamplingPolicy, *, temperature: float, top_p: float, attempts: int = 2,
                            calls: int = 2) -> tuple[list[list[m.TokenSegment]], list[list[dict]]]:
    """Run the external harness ``attempts`` times against the endpoint; each attempt's
    recorded segments and what the harness saw of each call."""
    backend, tok, _ = tiny
    registry = AttemptRegistry(tok)
    app = create_app(TorchClient(backend, tok), registry,
                     EndpointConfig(model_name="tiny", context_length=1024, sampling=policy))
    segments, seen = [], []
    with trio.fail_after(240):
        async with serving(app) as base:
            for a in range(attempts):
                key = registry.open_attempt(f"a{a}", "t")
                env = {**os.environ, "OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": key}
                done = await trio.run_process([sys.executable, str(SCRIPT), str(temperature), str(top_p), str(calls),
                                               str(100 * a)], env=env, capture_stdout=True, capture_stderr=True,
                                              check=False)
                assert done.returncode == 0, done.stderr.decode()
                seen.append(json.loads(done.stdout))
                segments.append([c.segment for c in registry.close_attempt(key).calls])
    return segments, seen


def _group(segments: list[list[m.TokenSegment]], *, drop_record: bool = False) -> m.RolloutGroup:
    trajs = []
    for i, segs in enumerate(segments):
        if drop_record:  # a record of the old kind: no sampling settings
            segs = [msgspec.structs.replace(s, sampling=None) for s in segs]
        trajs.append(m.Trajectory(attempt_id=f"a{i}", task_id="t", group_id="g", segments=tuple(segs),
                                  reward=float(i % 2)))
    return m.RolloutGroup(group_id="g", task_id="t", trajectories=tuple(trajs))


def _step(model_dir: str, group: m.RolloutGroup) -> tuple[object, list[RowDetail], object]:
    """One train step of the trainer's fp32 model at version 0 on ``group`` (trainer
    temperature 1.0, the default); its metrics, row details and batch."""
    torch.manual_seed(0)
    model = load_model(model_dir)
    opt = build_optimizer(model, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    batch = build_batch([group])
    detail: list[RowDetail] = []
    metrics = train_step(model, opt, batch, corrections=CorrectionConfig(), temperature=1.0, grad_clip=1.0,
                         pass_threshold=1.0, step=0, trainer_version=0, detail=detail)
    return metrics, detail, batch


def _ratios(detail: list[RowDetail], group: m.RolloutGroup) -> np.ndarray:
    out = []
    for d in detail:
        g, t, s = d.origin
        q = group.trajectories[t].segments[s].logprobs.to_numpy().astype(np.float64)
        out.append(np.exp(np.asarray(d.trainer_logprobs, dtype=np.float64) - q))
    return np.concatenate(out)


async def test_a_harness_at_temperature_0_7_top_p_0_9_trains_with_ratios_exactly_one(tiny):
    _, _, model_dir = tiny
    segments, seen = await _harness_attempts(tiny, SamplingPolicy(), temperature=0.7, top_p=0.9)
    assert all(c == {"status": 200, "overridden": "-"} for calls in seen for c in calls)
    for segs in segments:
        for seg in segs:
            assert (seg.sampling.temperature, seg.sampling.top_p, seg.sampling.top_k) == (0.7, 0.9, 512)
    group = _group(segments)
    metrics, detail, batch = _step(model_dir, group)
    ratios = _ratios(detail, group)
    assert ratios.size == metrics.tokens > 40
    assert abs(ratios.mean() - 1.0) < 1e-3 and np.abs(ratios - 1.0).max() < 1e-3
    assert metrics.frac_masked_tokens == 0.0 and metrics.frac_out_of_band == 0.0 and metrics.unrecorded_rows == 0
    assert batch.row_temperature.tolist() == pytest.approx([0.7] * batch.tokens.shape[0])
    # the old behaviour, for scale: the same rows without their record are scored at the
    # trainer's 1.0, and their ratios are off wherever the model was uncertain
    old = _group(segments, drop_record=True)
    m_old, d_old, _ = _step(model_dir, old)
    off = _ratios(d_old, old)
    assert m_old.unrecorded_rows == batch.tokens.shape[0]
    print(f"scored at their own 0.7: mean p/q {ratios.mean():.6f}; at the trainer's 1.0 (the old behaviour): "
          f"mean p/q {off.mean():.4f}, {np.mean((off < 0.5) | (off > 2.0)):.1%} outside [0.5, 2], "
          f"max |p/q - 1| {np.abs(off - 1.0).max():.3f}, masked {m_old.frac_masked_tokens:.1%}")
    assert np.abs(off - 1.0).max() > 0.05 and np.abs(np.log(off)).mean() > 20 * np.abs(np.log(ratios)).mean()


async def test_the_same_harness_under_override_samples_at_the_runs_settings_and_says_so(tiny):
    _, _, model_dir = tiny
    policy = SamplingPolicy(policy="override", temperature=1.0, top_p=1.0)
    segments, seen = await _harness_attempts(tiny, policy, temperature=0.7, top_p=0.9)
    assert all(c["overridden"] == "temperature=0.7->1.0, top_p=0.9->1.0" for calls in seen for c in calls)
    assert {(s.sampling.temperature, s.sampling.top_p) for segs in segments for s in segs} == {(1.0, 1.0)}
    group = _group(segments)
    metrics, detail, _ = _step(model_dir, group)
    assert abs(_ratios(detail, group).mean() - 1.0) < 1e-3 and metrics.frac_masked_tokens == 0.0


def _no_zero_gradient_rows(batch) -> None:
    """Every trained row can carry a gradient: sampled at a temperature > 0, with at least
    one position whose support has a choice (else log p^S = 0 at every token)."""
    assert bool((batch.row_temperature > 0).all())
    choice = ((batch.support_ids >= 0).sum(-1) > 1) & batch.loss_mask
    assert bool(choice.any(-1).all())


@pytest.mark.parametrize("policy", ["honour", "override", "refuse"])
async def test_a_greedy_harness_is_refused_overridden_or_excluded_and_counted_never_a_zero_gradient_row(tiny, policy):
    _, _, model_dir = tiny
    segments, seen = await _harness_attempts(tiny, SamplingPolicy(policy=policy), temperature=0.0, top_p=1.0)
    calls = [c for attempt in seen for c in attempt]
    if policy == "refuse":
        assert calls == [{"status": 400, "param": "temperature"}] * len(calls)
        assert all(segs == [] for segs in segments)  # nothing was generated or recorded
        return
    group = _group(segments)
    metrics, _, batch = _step(model_dir, group)
    n_calls = sum(len(s) for s in segments)
    if policy == "override":
        assert all(c["overridden"] == "temperature=0.0->1.0" for c in calls)
        assert batch.tokens.shape[0] == n_calls and metrics.excluded_rows == {} and not metrics.skipped
        _no_zero_gradient_rows(batch)
    else:  # honour: the greedy calls are recorded as greedy and left out, counted with their reason
        assert all(s.sampling.greedy for segs in segments for s in segs)
        assert batch.tokens.shape[0] == 0 and batch.excluded_rows == {"greedy": n_calls}
        assert metrics.excluded_rows == {"greedy": n_calls} and metrics.frac_excluded_rows == 1.0
        assert metrics.excluded_tokens == sum(int(s.token_ids.shape[0]) for segs in segments for s in segs)
        assert metrics.skipped and "every model call excluded" in metrics.skipped_reason
        assert "greedy" in metrics.skipped_reason


def test_a_mixed_group_trains_its_sampled_calls_and_excludes_its_greedy_ones(tiny):
    """Built from the backend directly: one attempt sampled at 0.8, one greedy; the batch
    holds the sampled rows only, every one of which can carry a gradient."""
    backend, _, model_dir = tiny
    prompt = [2, *b"def add(a, b):"]
    sampled = backend.generate([prompt], m.SamplingParams(max_tokens=10, temperature=0.8, seed=1))[0]
    greedy = backend.generate([prompt], m.SamplingParams(max_tokens=10, temperature=0.0))[0]
    p = Tensor.from_numpy(np.asarray(prompt, dtype=np.int64))
    group = _group([[m.TokenSegment.from_generation(p, sampled)], [m.TokenSegment.from_generation(p, greedy)]])
    metrics, _, batch = _step(model_dir, group)
    assert batch.tokens.shape[0] == 1 and batch.excluded_rows == {"greedy": 1}
    assert batch.row_temperature.tolist() == pytest.approx([0.8])
    _no_zero_gradient_rows(batch)
    assert metrics.excluded_rows == {"greedy": 1} and metrics.frac_excluded_rows == 0.5 and not metrics.skipped
