"""RolloutGroups -> padded tensors: every array lines up with the generated tokens."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.actors.trainer.batch import BadBatch, build_batch
from fleetrl.actors.trainer.config import AdvantageConfig
from fleetrl.daemon import messages as m


def _hand_group(g):
    bf16 = m.SamplerIdentity(sampler_id="b", backend="vllm", device_kind="H100", dtype="bfloat16")
    s1 = g.segment([1, 10, 11], [20, 21, 22], [-0.5, -0.1, -1.0],
                   [[(20, -0.5), (30, -0.9467)], [(21, -0.1), (31, -2.35), (32, -4.0)], [(22, -1.0), (5, -0.46)]],
                   [4, 4, 5])
    s2 = g.segment([1, 10, 11, 20, 21, 22, 99], [23], [0.0], [[(23, 0.0)]], [5], bf16)
    s3 = g.segment([1, 12], [24, 25], [-0.2, -0.3], [[(24, -0.2), (26, -1.7)], [(25, -0.3), (27, -1.35)]], [3, 3])
    empty = g.segment([1, 12], [], [], [], [])
    return g.group_of("g1", [([s1, s2], 1.0), ([s3, empty], 0.0)])


def test_rows_positions_supports_and_advantages_line_up(groups):
    b = build_batch([_hand_group(groups)])
    assert b.tokens.shape == (3, 3)  # three non-empty segments, longest generation 3
    assert b.support_ids.shape == (3, 3, 3)  # K = largest support
    # row 0: prompt [1,10,11] + [20,21,22]
    assert b.input_ids[0].tolist() == [1, 10, 11, 20, 21, 22, 0, 0]
    assert b.attention_mask[0].tolist() == [1] * 6 + [0, 0]
    assert b.positions[0].tolist() == [2, 3, 4]
    # the input token right after each position is the generated token it predicts
    for r in range(3):
        n = int(b.loss_mask[r].sum())
        assert torch.equal(b.input_ids[r, b.positions[r, :n] + 1], b.tokens[r, :n])
    assert b.tokens[0].tolist() == [20, 21, 22]
    assert b.loss_mask.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    assert b.sampler_logprobs[0].tolist() == pytest.approx([-0.5, -0.1, -1.0])
    assert b.support_ids[0].tolist() == [[20, 30, -1], [21, 31, 32], [22, 5, -1]]
    assert b.support_logprobs[0, 0, :2].tolist() == pytest.approx([-0.5, -0.9467])
    assert b.support_logprobs[0, 0, 2] == -math.inf
    # the sampled token's support log-prob equals its reported log-prob at every real position
    hit = (b.support_ids == b.tokens.unsqueeze(-1)) & b.loss_mask.unsqueeze(-1)
    assert torch.equal(hit.sum(-1).bool(), b.loss_mask)
    assert torch.allclose(torch.where(hit, b.support_logprobs, 0.0).sum(-1)[b.loss_mask],
                          b.sampler_logprobs[b.loss_mask])
    # row 1: the follow-up call of the same attempt, 7-token prompt
    assert b.positions[1, 0] == 6 and b.input_ids[1, 7] == 23
    assert b.versions.tolist() == [[4, 4, 5], [5, -1, -1], [3, 3, -1]]
    # both segments of attempt 0 carry its advantage; the empty segment gives no row
    assert b.advantages.tolist() == [0.5, 0.5, -0.5]
    assert b.row_trajectory.tolist() == [0, 0, 1]
    assert b.sampler_keys == ("torch/float32", "vllm/bfloat16")
    assert b.row_sampler.tolist() == [0, 1, 0]
    assert b.token_sampler[1].tolist() == [1, 1, 1]
    assert b.rewards.tolist() == [1.0, 0.0]
    assert b.n_tokens == 6 and b.n_groups == 1


def test_advantage_options(groups):
    grp = groups.group_of("g", [([groups.versioned("x", 0).trajectories[0].segments[0]], r)
                                for r in (0.0, 0.0, 1.0, 1.0)])
    plain = build_batch([grp]).advantages
    assert plain.tolist() == [-0.5, -0.5, 0.5, 0.5]
    loo = build_batch([grp], AdvantageConfig(leave_one_out=True)).advantages
    assert loo.tolist() == pytest.approx([-2 / 3, -2 / 3, 2 / 3, 2 / 3])
    std = build_batch([grp], AdvantageConfig(std_normalize=True)).advantages
    assert std.tolist() == pytest.approx([-1, -1, 1, 1], abs=1e-5)


def test_empty_prompt_is_named(groups):
    seg = groups.segment([], [5], [0.0], [[(5, 0.0)]], [0])
    with pytest.raises(BadBatch, match=r"group 'bad', attempt 'bad-a0', segment 0: empty prompt"):
        build_batch([groups.group_of("bad", [([seg], 1.0), ([seg], 0.0)])])


def test_on_policy_fp32_samples_have_zero_log_ratio(model_dir, groups):
    """Data sampled by the fp32 torch backend at the trainer's own weights: log ratio ~0
    and nothing masked. A position off by one would give large log ratios."""
    from fleetrl.actors.model import BOS_ID, load_master_weights
    from fleetrl.grpo import CorrectionConfig, policy_loss

    g1 = groups.sampled(model_dir, "on1", [BOS_ID, *b"def f(x):"], [0.0, 1.0, 0.0], seed=1)
    g2 = groups.sampled(model_dir, "on2", [BOS_ID, *b"return"], [1.0, 0.0], seed=2, max_tokens=7)
    batch = build_batch([g1, g2])
    model = load_master_weights(model_dir)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    V = logits.shape[-1]
    lg = logits.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, V))
    _, metrics = policy_loss(lg, batch.tokens, batch.sampler_logprobs, batch.support_ids,
                             batch.support_logprobs, batch.advantages, batch.loss_mask,
                             CorrectionConfig(weighting="mask", mask_low=0.99, mask_high=1.01))
    assert metrics["tokens_counted"] == batch.n_tokens > 10
    assert abs(metrics["log_ratio_max"]) < 1e-3 and abs(metrics["log_ratio_min"]) < 1e-3
    assert metrics["frac_masked_tokens"] == 0.0
    # shifting the positions by one must be caught by the same check
    shifted = (batch.positions + 1).clamp(max=batch.input_ids.shape[1] - 1)
    lg2 = logits.gather(1, shifted.unsqueeze(-1).expand(-1, -1, V))
    _, bad = policy_loss(lg2, batch.tokens, batch.sampler_logprobs, batch.support_ids,
                         batch.support_logprobs, batch.advantages, batch.loss_mask,
                         CorrectionConfig(weighting="mask", mask_low=0.99, mask_high=1.01))
    assert bad["frac_masked_tokens"] > 0.5


@st.composite
def _segments(draw):
    """(prompt, tokens, per-token support rows) with normalised log-probs."""
    prompt = draw(st.lists(st.integers(0, 255), min_size=1, max_size=6))
    n = draw(st.integers(0, 5))
    tokens, support = [], []
    for _ in range(n):
        ids = draw(st.lists(st.integers(0, 255), min_size=1, max_size=4, unique=True))
        w = draw(st.lists(st.floats(0.1, 10.0), min_size=len(ids), max_size=len(ids)))
        lps = [math.log(x / sum(w)) for x in w]
        pick = draw(st.integers(0, len(ids) - 1))
        tokens.append(ids[pick])
        support.append(list(zip(ids, lps)))
    return prompt, tokens, support


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(st.lists(_segments(), min_size=1, max_size=3), min_size=1, max_size=4))
def test_batch_round_trips_every_segment(groups, shapes):
    """Each non-empty segment can be read back exactly from its row of the batch."""
    trajs = []
    expected = []
    for ti, segs in enumerate(shapes):
        built = []
        for prompt, tokens, support in segs:
            lps = [dict(row)[t] for t, row in zip(tokens, support)]
            built.append(groups.segment(prompt, tokens, lps, support, [ti] * len(tokens)))
            if tokens:
                expected.append((prompt, tokens, lps, support, ti))
        trajs.append((built, float(ti % 2)))
    b = build_batch([groups.group_of("h", trajs)])
    assert b.tokens.shape[0] == len(expected)
    for r, (prompt, tokens, lps, support, ti) in enumerate(expected):
        n = len(tokens)
        assert b.loss_mask[r].tolist() == [True] * n + [False] * (b.tokens.shape[1] - n)
        assert b.input_ids[r, :len(prompt)].tolist() == prompt
        assert b.input_ids[r, b.positions[r, :n] + 1].tolist() == tokens
        assert b.positions[r, 0] == len(prompt) - 1
        assert b.tokens[r, :n].tolist() == tokens
        assert b.sampler_logprobs[r, :n].tolist() == pytest.approx(lps, abs=1e-6)
        assert b.versions[r, :n].tolist() == [ti] * n and b.row_trajectory[r] == ti
        for t, row in enumerate(support):
            k = len(row)
            assert b.support_ids[r, t, :k].tolist() == [i for i, _ in row]
            assert b.support_logprobs[r, t, :k].tolist() == pytest.approx([lp for _, lp in row], abs=1e-6)
            assert (b.support_ids[r, t, k:] == -1).all() and (b.support_logprobs[r, t, k:] == -math.inf).all()
        assert int(b.attention_mask[r].sum()) == len(prompt) + n


def test_retokenization_breaks_of_the_trajectories_are_summed_by_cause(groups):
    """The worker's per-trajectory break counts reach the batch (and so the step's metrics
    and the report); each segment stays a row of its own."""
    import msgspec

    g = groups.versioned("x", 0)
    marked = [msgspec.structs.replace(t, metrics={**t.metrics, "retokenization_breaks": 2.0,
                                                   "retokenization_breaks/history_truncated": 1.0,
                                                   "retokenization_breaks/answer_rewritten": 1.0})
              for t in g.trajectories]
    batch = build_batch([msgspec.structs.replace(g, trajectories=tuple(marked))])
    n = len(marked)
    assert batch.retokenization_breaks == {"history_truncated": n, "answer_rewritten": n}
    assert build_batch([g]).retokenization_breaks == {}
