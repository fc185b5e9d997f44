"""Micro-batches and data-parallel sums: `split_rows` cuts a batch into valid batches under
a token budget, and `train_step` over 4 micro-batches, or over 2 ranks of a replicated
model (threads joined by an in-memory collective), lands where one batch does."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, create_tiny_llama, load_master_weights
from fleetrl.actors.trainer.batch import Batch, build_batch, micro_batch_cost, select_rows, split_rows
from fleetrl.actors.trainer.collective import LocalCollective, gather_bytes
from fleetrl.actors.trainer.step import build_optimizer, train_step
from fleetrl.grpo import CorrectionConfig

V = 259
SPEC = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                     initializer_range=0.3)  # peaked enough that a temperature gap masks tokens
# a tight band, a sequence mask and a trainer temperature unlike the samplers': some
# tokens and sequences are masked
CORR = CorrectionConfig(mask_low=0.8, mask_high=1.25, seq_mask=(0.9, 1.1))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(create_tiny_llama(tmp_path_factory.mktemp("mb") / "tiny", SPEC, seed=0))


def _seg(groups, rng: np.random.Generator, prompt, n: int, version: int = 0):
    toks = rng.integers(3, V - 1, n).tolist()
    lq = [math.log(0.7), math.log(0.3)]
    sup = [[(t, lq[0]), (t + 1, lq[1])] for t in toks]
    return groups.segment(list(prompt), toks, [lq[0]] * n, sup, [version] * n)


@st.composite
def _specs(draw):
    """1-4 groups of 1-4 attempts; prompts 1-20 tokens shared per group (sometimes not),
    attempts of 1-2 segments of 1-12 tokens; a budget from 1 to 200 tokens."""
    seed = draw(st.integers(0, 2**32 - 1))
    groups = draw(st.lists(st.tuples(st.integers(1, 20), st.lists(st.tuples(st.integers(1, 12), st.booleans()),
                                                                   min_size=1, max_size=4), st.booleans()),
                           min_size=1, max_size=4))
    return seed, groups, draw(st.integers(1, 200))


def _build(groups, seed, spec) -> Batch:
    rng = np.random.default_rng(seed)
    grps = []
    for g, (plen, attempts, shared) in enumerate(spec):
        prompt = [BOS_ID, *rng.integers(3, V, plen - 1).tolist()]
        trajs = []
        for a, (n, two) in enumerate(attempts):
            p = prompt if shared else [BOS_ID, *rng.integers(3, V, plen).tolist()]
            segs = [_seg(groups, rng, p, n, version=g)]
            if two:
                segs.append(_seg(groups, rng, p + segs[0].token_ids.to_numpy().tolist() + [10], 2, version=g + 1))
            trajs.append((segs, float(rng.random())))
        grps.append(groups.group_of(f"g{g}", trajs))
    return build_batch(grps)


def _rows(batch: Batch) -> list[tuple]:
    """Every row's unpadded content, independent of padding and indexing."""
    out = []
    for b in range(batch.tokens.shape[0]):
        L, n = int(batch.attention_mask[b].sum()), int(batch.loss_mask[b].sum())
        d = int(batch.prefix_index[b])
        P = int(batch.prompt_lengths[d])
        sup = batch.support_ids[b, :n]
        out.append((tuple(batch.input_ids[b, :L].tolist()), tuple(batch.prompt_ids[d, :P].tolist()),
                    tuple(batch.positions[b, :n].tolist()), tuple(batch.tokens[b, :n].tolist()),
                    tuple(batch.sampler_logprobs[b, :n].tolist()),
                    tuple(tuple(r[r >= 0].tolist()) for r in sup),
                    tuple(tuple(batch.support_logprobs[b, t, :int((sup[t] >= 0).sum())].tolist()) for t in range(n)),
                    tuple(batch.versions[b, :n].tolist()), float(batch.advantages[b]),
                    batch.sampler_keys[int(batch.row_sampler[b])],
                    float(batch.rewards[int(batch.row_trajectory[b])])))
    return out


def _check_valid(mb: Batch) -> None:
    """The layout build_batch guarantees, on a micro-batch."""
    B = mb.tokens.shape[0]
    lens = mb.attention_mask.sum(-1)
    gen = mb.loss_mask.sum(-1)
    assert mb.input_ids.shape == (B, int(lens.max())) and mb.tokens.shape == (B, int(gen.max()))
    assert mb.support_ids.shape[2] == int((mb.support_ids >= 0).sum(-1).max())
    assert mb.prompt_ids.shape == (len(set(mb.prefix_index.tolist())), int(mb.prompt_lengths.max()))
    assert sorted(set(mb.prefix_index.tolist())) == list(range(mb.prompt_ids.shape[0]))
    assert sorted(set(mb.row_trajectory.tolist())) == list(range(mb.rewards.numel()))
    assert sorted(set(mb.row_group.tolist())) == list(range(mb.n_groups))
    for b in range(B):
        n = int(gen[b])
        assert mb.loss_mask[b, :n].all() and not mb.loss_mask[b, n:].any()
        assert int(mb.positions[b, 0]) == int(mb.prompt_lengths[int(mb.prefix_index[b])]) - 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_specs())
def test_split_rows_keeps_rows_in_order_within_the_budget(groups, drawn):
    seed, spec, budget = drawn
    batch = _build(groups, seed, spec)
    parts = split_rows(batch, budget)
    assert [r for mb in parts for r in _rows(mb)] == _rows(batch)  # in order, none split, none lost
    lengths = batch.attention_mask.sum(-1).tolist()
    for mb in parts:
        _check_valid(mb)
        cost = micro_batch_cost(mb.attention_mask.sum(-1).tolist())
        assert cost <= budget or mb.tokens.shape[0] == 1  # only a lone row may exceed it
    # a run of consecutive rows with one prompt that fits the budget is never cut
    cut_after = set(np.cumsum([mb.tokens.shape[0] for mb in parts])[:-1].tolist())
    prefix = batch.prefix_index.tolist()
    start = 0
    for b in range(1, len(prefix) + 1):
        if b == len(prefix) or prefix[b] != prefix[start]:
            if micro_batch_cost(lengths[start:b]) <= budget:
                assert not any(start < c < b for c in cut_after), (start, b, cut_after)
            start = b
    # whole-batch figures are counted once over the parts
    sums = [mb.summary() for mb in parts]
    assert torch.equal(torch.cat([s.rewards for s in sums]), batch.rewards)
    assert torch.equal(torch.cat([s.group_oldest for s in sums]), batch.summary().group_oldest)
    assert sum(s.n_groups for s in sums) == batch.n_groups


def test_split_rows_packs_greedily_and_refuses_a_bad_budget(groups):
    batch = _build(groups, 0, [(5, [(3, False)] * 3, True), (4, [(2, False)] * 2, True)])
    lengths = batch.attention_mask.sum(-1).tolist()
    assert lengths == [8, 8, 8, 6, 6]
    assert [mb.tokens.shape[0] for mb in split_rows(batch, 10**6)] == [5]
    assert [mb.tokens.shape[0] for mb in split_rows(batch, 24)] == [3, 2]  # groups kept whole
    assert [mb.tokens.shape[0] for mb in split_rows(batch, 16)] == [2, 1, 2]  # a group larger than the budget
    assert [mb.tokens.shape[0] for mb in split_rows(batch, 1)] == [1] * 5  # every row alone, over budget
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match="max_tokens"):
            split_rows(batch, bad)


def test_select_rows_reindexes_prompts_trajectories_and_groups(groups):
    batch = _build(groups, 1, [(6, [(4, True), (2, False)], True), (3, [(5, False)], True)])
    part = select_rows(batch, [3, 1])
    assert _rows(part) == [_rows(batch)[3], _rows(batch)[1]]
    _check_valid(part)
    assert part.summary().n_groups == 0  # row 0 is elsewhere: the whole-batch figures are too
    assert select_rows(batch, [0]).summary().n_groups == batch.n_groups
    with pytest.raises(IndexError):
        select_rows(batch, [batch.tokens.shape[0]])
    with pytest.raises(ValueError, match="twice"):
        select_rows(batch, [1, 1])


def _sampled_batch(tiny_dir, groups) -> Batch:
    prompts = ([BOS_ID, *b"def f(x):"], [BOS_ID, *b"x ="], [BOS_ID, *b"print("])
    grps = [groups.sampled(tiny_dir, f"s{i}", p, [1.0, 0.0, 0.5, 0.0][:4 - (i % 2)], seed=40 + i,
                           dtype="bf16" if i else "fp32", max_tokens=12, version=i)
            for i, p in enumerate(prompts)]
    return build_batch(grps)


def _budget_for(batch: Batch, parts: int) -> int:
    """The smallest token budget that cuts ``batch`` into ``parts`` micro-batches (bisection)."""
    lo, hi = 1, micro_batch_cost(batch.attention_mask.sum(-1).tolist())
    while lo < hi:
        mid = (lo + hi) // 2
        if len(split_rows(batch, mid)) <= parts:
            hi = mid
        else:
            lo = mid + 1
    assert len(split_rows(batch, lo)) == parts
    return lo


def _run(tiny_dir, batch, kind, **kw):
    model = load_master_weights(tiny_dir)
    opt = (torch.optim.SGD(model.parameters(), lr=0.5) if kind == "sgd"
           else build_optimizer(model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01))
    m = train_step(model, opt, batch, corrections=kw.pop("corrections", CORR), temperature=1.15, grad_clip=1.0,
                   pass_threshold=1.0, step=3, trainer_version=2, **kw)
    return m, {k: v.detach().clone() for k, v in model.state_dict().items()}


SAME = ("groups", "trajectories", "rows", "tokens", "reward_mean", "pass_rate", "staleness_hist",
        "tokens_by_sampler", "frac_masked_tokens", "frac_masked_sequences", "step", "skipped")
CLOSE = ("loss", "grad_norm", "mismatch_kl_k3", "log_ratio_mean", "weight_mean", "centering_norm")


def assert_same_metrics(a, b, rel=1e-5) -> None:
    for f in SAME:
        assert getattr(a, f) == getattr(b, f), f
    for f in CLOSE:
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=rel, abs=1e-9), f
    assert set(a.mismatch_kl_by_sampler) == set(b.mismatch_kl_by_sampler)
    for k, v in a.mismatch_kl_by_sampler.items():
        assert v == pytest.approx(b.mismatch_kl_by_sampler[k], rel=1e-4, abs=1e-10), k


def assert_same_weights(start, one, other, kind) -> None:
    """SGD: the updates agree to 1e-5 relative per tensor, up to the fp32 rounding of the
    weights themselves (1e-6 of their norm). AdamW: the weights to 1e-5 relative per
    tensor (its first update g / (|g| + eps) amplifies the rounding of gradients near
    eps; measured ~1e-6)."""
    moved = 0.0
    for k, w in one.items():
        update = w - start[k]
        moved = max(moved, float(update.norm() / start[k].norm()))
        if kind == "sgd":
            assert float((other[k] - w).norm()) <= 1e-5 * float(update.norm()) + 1e-6 * float(w.norm()), k
        else:
            assert float((other[k] - w).norm() / w.norm()) < 1e-5, k
    assert moved > 1e-4  # the step really moved the weights


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_four_micro_batches_equal_one_batch(tiny_dir, groups, kind, normalization):
    batch = _sampled_batch(tiny_dir, groups)
    budget = _budget_for(batch, 4)
    corr = CorrectionConfig(mask_low=0.8, mask_high=1.25, seq_mask=(0.9, 1.1), normalization=normalization)
    start = load_master_weights(tiny_dir).state_dict()
    one, w_one = _run(tiny_dir, batch, kind, corrections=corr)
    four, w_four = _run(tiny_dir, batch, kind, corrections=corr, micro_batch_tokens=budget)
    assert not one.skipped and one.step == 4
    assert 0 < one.frac_masked_tokens < 0.5 and one.mismatch_kl_k3 > 0  # the corrections are at work
    assert 0 < one.frac_masked_sequences < 1
    assert set(one.tokens_by_sampler) == {"torch/float32", "torch/bfloat16"}
    assert one.staleness_hist == {2: 1, 1: 1, 0: 1}
    assert_same_metrics(one, four)
    assert_same_weights(start, w_one, w_four, kind)


def test_micro_batches_skip_like_one_batch(tiny_dir, groups):
    batch = _sampled_batch(tiny_dir, groups)
    zero = Batch(**{**batch.__dict__, "advantages": torch.zeros_like(batch.advantages)})
    m, w = _run(tiny_dir, zero, "adamw", micro_batch_tokens=40)
    assert m.skipped and m.skipped_reason == "zero advantage" and m.step == 3
    masked, _ = _run(tiny_dir, batch, "adamw", micro_batch_tokens=40,
                     corrections=CorrectionConfig(mask_low=4.0, mask_high=5.0))
    assert masked.skipped and masked.skipped_reason == "every token masked" and masked.frac_masked_tokens == 1.0
    assert masked.tokens == batch.n_tokens and masked.groups == 3
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        _run(tiny_dir, batch, "adamw", micro_batch_tokens=0)


class ThreadCollective:
    """An in-memory collective of ``world`` threads: a barrier and a shared sum."""

    def __init__(self, world: int) -> None:
        self.world_size = world
        self._barrier = threading.Barrier(world)
        self._slots: list = [None] * world

    def rank_view(self, rank: int):
        parent = self

        class View:
            world_size = parent.world_size

            def __init__(self):
                self.rank = rank

            def all_reduce_sum(self, tensor):
                parent._slots[rank] = tensor.clone()
                parent._barrier.wait()
                total = sum(parent._slots[1:], parent._slots[0].clone())
                parent._barrier.wait()
                return total

        return View()


def test_gather_bytes_over_ranks():
    coll = ThreadCollective(3)
    out: dict[int, list[bytes]] = {}
    data = [b"", b"abc", bytes(range(256))]

    def run(r):
        out[r] = gather_bytes(coll.rank_view(r), data[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert out == {r: data for r in range(3)}
    assert gather_bytes(LocalCollective(), b"x") == [b"x"]


def _two_ranks(tiny_dir, batch, *, cut: int = 4, details=(None, None), **kw):
    """`_run` on two thread ranks holding rows ``[:cut]`` and ``[cut:]``; each rank's result."""
    shares = [select_rows(batch, range(cut)), select_rows(batch, range(cut, batch.tokens.shape[0]))]
    coll = ThreadCollective(2)
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def rank(r):
        try:
            results[r] = _run(tiny_dir, shares[r], "sgd", collective=coll.rank_view(r), detail=details[r], **kw)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            coll._barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results[0], results[1]


def test_token_detail_is_one_per_row_whatever_the_split_and_is_what_the_loss_masked(tiny_dir, groups):
    """The rollout log's per-token detail: one `RowDetail` per row of the whole batch, the
    same in one batch, four micro-batches and two ranks; its masked positions are those
    whose replayed-over-reported ratio falls outside the band or whose sequence's
    geometric mean does, and they add up to the step's ``frac_masked_tokens``."""
    batch = _sampled_batch(tiny_dir, groups)
    one: list = []
    m, _ = _run(tiny_dir, batch, "sgd", detail=one)
    assert [d.origin for d in one] == list(batch.row_origin) and len(one) == batch.tokens.shape[0]
    masked = 0
    for b, d in enumerate(one):
        n = int(batch.loss_mask[b].sum())
        assert len(d.trainer_logprobs) == n
        r = np.asarray(d.trainer_logprobs, dtype=np.float64) - batch.sampler_logprobs[b, :n].double().numpy()
        out = (r < math.log(CORR.mask_low)) | (r > math.log(CORR.mask_high))
        seq_out = not (math.log(CORR.seq_mask[0]) <= r.mean() <= math.log(CORR.seq_mask[1]))
        want = list(range(n)) if seq_out else np.flatnonzero(out).tolist()
        assert d.masked == want, (b, d.masked, want)
        masked += len(d.masked)
    assert 0 < masked < batch.n_tokens
    assert masked == round(m.frac_masked_tokens * m.tokens)
    four: list = []
    _run(tiny_dir, batch, "sgd", detail=four, micro_batch_tokens=_budget_for(batch, 4))
    ranks: tuple[list, list] = ([], [])
    _two_ranks(tiny_dir, batch, details=ranks, micro_batch_tokens=40)
    assert ranks[0] == ranks[1]  # every rank gets every rank's rows
    for other in (four, ranks[0]):
        got = {d.origin: d for d in other}
        assert sorted(got) == sorted(batch.row_origin)
        for d in one:
            assert got[d.origin].masked == d.masked
            assert got[d.origin].trainer_logprobs == pytest.approx(d.trainer_logprobs, abs=1e-4)
    # a batch's rows come from (group, attempt, segment) of the groups it was built from
    assert batch.row_origin[0] == (0, 0, 0) and select_rows(batch, [2, 0]).row_origin == (batch.row_origin[2],
                                                                                             batch.row_origin[0])


@pytest.mark.parametrize("micro", [None, 40])
def test_two_replicated_ranks_equal_one(tiny_dir, groups, micro):
    """Two threads, each a rank with its own copy of the model and its half of the rows
    (rank 0 holds row 0, so the batch's groups and rewards), summing through the
    collective: the same weights and metrics as one process on the whole batch."""
    batch = _sampled_batch(tiny_dir, groups)
    start = load_master_weights(tiny_dir).state_dict()
    one, w_one = _run(tiny_dir, batch, "sgd")
    (m0, w0), (m1, w1) = _two_ranks(tiny_dir, batch, micro_batch_tokens=micro)
    assert_same_metrics(one, m0)
    assert_same_metrics(m0, m1, rel=0)  # every rank reports the same
    assert_same_weights(start, w_one, w0, "sgd")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # the replicas stay identical
