"""sampler_support / sample_from_support / replay_logprobs: invariants 3 and 4 of
docs/reference/corrections.md, checked against float64 oracles computed here."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.grpo import (
    BadLossInput,
    replay_logprobs,
    sample_from_support,
    sample_from_vocabulary,
    sampler_support,
    vocabulary_listing,
)

settings.load_profile("grpo")

seeds = st.integers(0, 2**31 - 1)
top_ps = st.floats(0.05, 1.0)


def random_logits(seed: int, N: int, V: int, *, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(N, V, generator=g, dtype=torch.float64)
    if ties:  # few distinct values: many exact ties
        z = torch.round(z)
    return z


def members(ids_row: torch.Tensor) -> list[int]:
    return [int(i) for i in ids_row if int(i) >= 0]


@given(seed=seeds, N=st.integers(1, 6), V=st.integers(1, 40), top_p=top_ps, ties=st.booleans(),
       temperature=st.floats(0.2, 3.0))
def test_support_is_the_minimal_nucleus(seed, N, V, top_p, ties, temperature):
    z = random_logits(seed, N, V, ties=ties)
    ids, lq = sampler_support(z, temperature=temperature, top_p=top_p, top_k=None)
    q = torch.softmax(z / temperature, -1)
    for n in range(N):
        S = members(ids[n])
        assert S, "support must be non-empty"
        assert all(i == -1 for i in ids[n, len(S):].tolist()), "padding only on the right"
        assert torch.isneginf(lq[n, len(S):]).all()
        assert len(set(S)) == len(S)
        assert S[0] == int(torch.argmax(z[n])), "argmax first (lowest id among ties)"
        # order: decreasing q, ties by lower id
        keys = [(-float(q[n, v]), v) for v in S]
        assert keys == sorted(keys)
        mass = float(q[n, S].sum())
        assert mass >= top_p - 1e-9
        if len(S) > 1:
            assert float(q[n, S[:-1]].sum()) < top_p + 1e-9, "dropping the smallest member must fall below top_p"
        # every token outside S is no more likely than the smallest member
        outside = [v for v in range(V) if v not in S]
        if outside:
            assert float(q[n, outside].max()) <= float(q[n, S[-1]]) + 1e-15
        # renormalised log q^S
        expect = torch.log(q[n, S] / q[n, S].sum())
        torch.testing.assert_close(lq[n, : len(S)], expect, rtol=1e-9, atol=1e-9)
        assert math.isclose(float(lq[n, : len(S)].exp().sum()), 1.0, rel_tol=1e-9)


@given(seed=seeds, V=st.integers(1, 30), p1=top_ps, p2=top_ps, ties=st.booleans())
def test_supports_nest_as_top_p_decreases(seed, V, p1, p2, ties):
    lo, hi = sorted((p1, p2))
    z = random_logits(seed, 3, V, ties=ties)
    small, _ = sampler_support(z, temperature=1.0, top_p=lo, top_k=None)
    big, _ = sampler_support(z, temperature=1.0, top_p=hi, top_k=None)
    for n in range(3):
        s, b = members(small[n]), members(big[n])
        assert b[: len(s)] == s, "a smaller nucleus is a prefix of a larger one"


@given(seed=seeds, N=st.integers(1, 5), V=st.integers(1, 30))
def test_top_p_one_without_top_k_is_the_full_softmax(seed, N, V):
    z = random_logits(seed, N, V)
    ids, lq = sampler_support(z, temperature=1.0, top_p=1.0, top_k=None)
    assert ids.shape == (N, V)
    full = torch.log_softmax(z, -1)
    torch.testing.assert_close(lq, full.gather(1, ids), rtol=1e-12, atol=1e-12)
    assert sorted(ids[0].tolist()) == list(range(V))


@given(seed=seeds, N=st.integers(1, 5), V=st.integers(1, 30), top_p=top_ps, top_k=st.integers(1, 8))
def test_top_k_caps_the_nucleus(seed, N, V, top_p, top_k):
    z = random_logits(seed, N, V)
    capped, lq = sampler_support(z, temperature=1.0, top_p=top_p, top_k=top_k)
    uncapped, _ = sampler_support(z, temperature=1.0, top_p=top_p, top_k=None)
    assert capped.shape[1] <= top_k
    for n in range(N):
        assert members(capped[n]) == members(uncapped[n])[:top_k]
        k = len(members(capped[n]))
        assert math.isclose(float(lq[n, :k].exp().sum()), 1.0, rel_tol=1e-9)


def test_temperature_zero_is_greedy_with_lowest_id_on_ties():
    z = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    ids, lq = sampler_support(z, temperature=0, top_p=0.3, top_k=None)
    assert ids.tolist() == [[1], [0]]
    assert lq.tolist() == [[0.0], [0.0]]


def test_ties_are_broken_by_lower_id_and_k_is_the_largest_support():
    z = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [9.0, 0.0, 0.0, 0.0, 0.0]])
    ids, lq = sampler_support(z, temperature=1.0, top_p=0.5, top_k=None)
    # row 0: three tied tokens of mass ~0.29 each; two reach 0.5
    assert ids.tolist() == [[1, 2], [0, -1]]
    assert torch.isneginf(lq[1, 1])
    assert lq.dtype == torch.float32


def test_zero_probability_tokens_are_never_in_a_support():
    z = torch.tensor([[0.0, -math.inf, 1.0, -math.inf]])
    ids, lq = sampler_support(z, temperature=1.0, top_p=1.0, top_k=None)
    assert ids.tolist() == [[2, 0]]
    assert torch.isfinite(lq).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0, "top_p": 0.9, "top_k": None}, "temperature"),
        ({"temperature": math.nan, "top_p": 0.9, "top_k": None}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0, "top_k": None}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5, "top_k": None}, "top_p"),
        ({"temperature": 1.0, "top_p": 0.9, "top_k": 0}, "top_k"),
        ({"temperature": 1.0, "top_p": 0.9, "top_k": 2.5}, "top_k"),
    ],
)
def test_bad_sampling_parameters_are_named(kwargs, message):
    with pytest.raises(BadLossInput, match=message):
        sampler_support(torch.zeros(2, 3), **kwargs)


@pytest.mark.parametrize(
    "logits, message",
    [
        (torch.zeros(3), "2-D"),
        (torch.tensor([[0.0, math.nan]]), "row 0"),
        (torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]), "row 1 has no finite logit"),
        (torch.zeros(2, 3, dtype=torch.long), "floating point"),
    ],
)
def test_bad_logits_are_named(logits, message):
    with pytest.raises(BadLossInput, match=message):
        sampler_support(logits, temperature=1.0, top_p=0.9, top_k=None)


@given(seed=seeds, V=st.integers(2, 30), top_p=top_ps)
def test_sampled_token_is_in_its_support_with_its_logprob(seed, V, top_p):
    z = random_logits(seed, 8, V)
    ids, lq = sampler_support(z, temperature=1.0, top_p=top_p, top_k=None)
    tok, lqa = sample_from_support(ids, lq, generator=torch.Generator().manual_seed(seed))
    for n in range(8):
        S = members(ids[n])
        assert int(tok[n]) in S
        assert float(lqa[n]) == float(lq[n, S.index(int(tok[n]))])


def test_sample_from_support_follows_q_s():
    z = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    ids, lq = sampler_support(z, temperature=1.0, top_p=0.9, top_k=None)
    n = 20000
    tok, _ = sample_from_support(ids.expand(n, -1), lq.expand(n, -1), generator=torch.Generator().manual_seed(1))
    freq = torch.bincount(tok, minlength=4).double() / n
    expect = torch.zeros(4, dtype=torch.float64)
    expect[ids[0]] = lq[0].double().exp()
    # 5 binomial standard deviations at n = 20000 is < 0.018
    assert (freq - expect).abs().max() < 0.018
    assert freq[3] == 0


def test_sample_from_support_rejects_an_empty_row():
    with pytest.raises(BadLossInput, match="row 1 is empty"):
        sample_from_support(torch.tensor([[1, -1], [-1, -1]]), torch.tensor([[0.0, -math.inf]] * 2))


# ---------------------------------------------------------------- replay (invariant 4)


def random_replay_case(seed: int, B: int, T: int, V: int, K: int):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    K = min(K, V)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * T)]).reshape(B, T, K)
    tok = ids[..., 0].clone()
    return z, tok, ids


@given(seed=seeds, B=st.integers(1, 3), T=st.integers(1, 4), V=st.integers(1, 20), K=st.integers(1, 8),
       pad=st.integers(0, 3))
def test_replay_is_invariant_to_permutation_and_padding(seed, B, T, V, K, pad):
    z, tok, ids = random_replay_case(seed, B, T, V, K)
    lp, lpS = replay_logprobs(z, tok, ids)
    g = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(ids.shape[-1], generator=g)
    padded = torch.cat([ids[..., perm], torch.full((B, T, pad), -1)], dim=-1)
    # shuffle padding in between members too: replay must not assume right padding
    shuffle = torch.randperm(padded.shape[-1], generator=g)
    padded = padded[..., shuffle]
    lp2, lpS2 = replay_logprobs(z, tok, padded)
    torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-12)
    for b in range(B):
        for t in range(T):
            got = {int(v): float(x) for v, x in zip(padded[b, t], lpS2[b, t]) if int(v) >= 0}
            want = {int(v): float(x) for v, x in zip(ids[b, t], lpS[b, t])}
            assert got.keys() == want.keys()
            for v in want:
                assert math.isclose(got[v], want[v], rel_tol=0, abs_tol=1e-12)
            assert all(math.isinf(float(x)) and float(x) < 0 for v, x in zip(padded[b, t], lpS2[b, t]) if int(v) < 0)


@given(seed=seeds, B=st.integers(1, 3), T=st.integers(1, 4), V=st.integers(1, 20), K=st.integers(1, 8))
def test_replay_is_log_softmax_restricted_to_the_support(seed, B, T, V, K):
    z, tok, ids = random_replay_case(seed, B, T, V, K)
    lp, lpS = replay_logprobs(z, tok, ids)
    for b in range(B):
        for t in range(T):
            S = ids[b, t].tolist()
            expect = torch.log_softmax(z[b, t, S], -1)
            torch.testing.assert_close(lpS[b, t], expect, rtol=1e-12, atol=1e-12)
            assert math.isclose(float(lp[b, t]), float(expect[0]), abs_tol=1e-12)


def test_full_support_replay_equals_log_softmax_and_none_means_full_vocab():
    z, tok, _ = random_replay_case(3, 2, 3, 7, 1)
    ids = torch.arange(7).expand(2, 3, 7)
    lp_full, none = replay_logprobs(z, tok, None)
    lp_sup, _ = replay_logprobs(z, tok, ids)
    assert none is None
    torch.testing.assert_close(lp_full, torch.log_softmax(z, -1).gather(-1, tok[..., None]).squeeze(-1))
    torch.testing.assert_close(lp_sup, lp_full, rtol=1e-12, atol=1e-12)


def test_replay_gradient_flows_only_into_support_logits():
    z, tok, ids = random_replay_case(5, 1, 1, 10, 3)
    z.requires_grad_(True)
    lp, _ = replay_logprobs(z, tok, ids)
    lp.sum().backward()
    outside = [v for v in range(10) if v not in ids[0, 0].tolist()]
    assert (z.grad[0, 0, outside] == 0).all()
    p = torch.softmax(z.detach()[0, 0, ids[0, 0]], -1)
    e = torch.zeros(3, dtype=torch.float64)
    e[0] = 1
    torch.testing.assert_close(z.grad[0, 0, ids[0, 0]], e - p)


def test_replay_rejects_bad_ids():
    z = torch.zeros(1, 2, 5)
    with pytest.raises(BadLossInput, match="support_ids must be token ids"):
        replay_logprobs(z, torch.zeros(1, 2, dtype=torch.long), torch.tensor([[[0, 5]], [[0, 1]]]).reshape(1, 2, 2))
    with pytest.raises(BadLossInput, match="tokens must be token ids"):
        replay_logprobs(z, torch.tensor([[0, 7]]), None)
    with pytest.raises(BadLossInput, match=r"support_ids must be \[B, T, K\]"):
        replay_logprobs(z, torch.zeros(1, 2, dtype=torch.long), torch.zeros(2, 2, 1, dtype=torch.long))


@pytest.mark.parametrize("top_p, size", [(0.25, 1), (0.5, 2), (0.75, 3), (0.7500001, 4), (1.0, 4)])
def test_mass_exactly_at_top_p_stops_the_nucleus(top_p, size):
    """Uniform over 4 tokens: cumulative masses 0.25, 0.5, 0.75, 1 are exact in binary."""
    ids, lq = sampler_support(torch.zeros(1, 4, dtype=torch.float64), temperature=1.0, top_p=top_p, top_k=None)
    assert ids.tolist() == [list(range(size))]
    torch.testing.assert_close(lq, torch.full((1, size), -math.log(size), dtype=torch.float64))


# ---------------------------------------------------------------- the cap at real vocabularies


@given(seed=seeds, N=st.integers(1, 5), V=st.integers(1, 60), top_p=top_ps, top_k=st.integers(1, 12),
       ties=st.booleans(), dead=st.integers(0, 5))
def test_a_binding_cap_orders_only_the_most_likely_and_equals_the_full_sort(seed, N, V, top_p, top_k, ties, dead):
    """With top_k < V only the top_k most likely tokens are ordered (torch.topk plus the
    lowest-id rule at a tied cut); the result is the first top_k of the stable full sort,
    ties and zero-probability tokens included."""
    z = random_logits(seed, N, V, ties=ties)
    z[:, :min(dead, V - 1)] = -math.inf
    ids, lq = sampler_support(z, temperature=0.7, top_p=top_p, top_k=top_k)
    full = torch.log_softmax(z / 0.7, -1)
    order = torch.sort(full, dim=-1, descending=True, stable=True).indices
    for n in range(N):
        S = members(ids[n])
        finite = int(torch.isfinite(z[n]).sum())
        cum = full[n, order[n]].exp().cumsum(0)
        size = min(int((cum < top_p).sum()) + 1, finite, top_k)
        assert S == order[n, :size].tolist()
        expect = full[n, S] - torch.logsumexp(full[n, S], 0)
        torch.testing.assert_close(lq[n, :len(S)].double(), expect, rtol=1e-9, atol=1e-9)


def test_a_cut_through_tied_tokens_takes_the_lowest_ids():
    z = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0]])
    ids, _ = sampler_support(z, temperature=1.0, top_p=1.0, top_k=3)
    assert ids.tolist() == [[5, 1, 2]]


@given(seed=seeds, N=st.integers(1, 4), V=st.integers(1, 50), k=st.integers(1, 20), ties=st.booleans(),
       temperature=st.floats(0.3, 2.0))
def test_vocabulary_listing_is_the_top_k_of_q_with_log_q_and_the_tail(seed, N, V, k, ties, temperature):
    z = random_logits(seed, N, V, ties=ties)
    ids, lq, tail = vocabulary_listing(z, temperature=temperature, k=k)
    full = torch.log_softmax(z / temperature, -1)
    order = torch.sort(full, dim=-1, descending=True, stable=True).indices
    assert ids.shape == (N, min(k, V))
    for n in range(N):
        listed = members(ids[n])
        assert listed == order[n, :min(k, V)].tolist()
        torch.testing.assert_close(lq[n, :len(listed)].double(), full[n, listed], rtol=1e-12, atol=1e-12)
        assert math.isclose(float(tail[n]) + float(full[n, listed].exp().sum()), 1.0, abs_tol=1e-12)


def test_sample_from_vocabulary_follows_q_and_reports_log_q():
    z = torch.tensor([[2.0, 1.0, 0.5, -3.0, -math.inf]])
    n = 20000
    tok, lq = sample_from_vocabulary(z.expand(n, -1), temperature=1.0, generator=torch.Generator().manual_seed(3))
    q = torch.softmax(z[0].double(), -1)
    freq = torch.bincount(tok, minlength=5).double() / n
    assert (freq - q).abs().max() < 0.018  # 5 binomial standard deviations
    assert freq[4] == 0
    torch.testing.assert_close(lq.double(), q.log()[tok], rtol=1e-6, atol=1e-6)


def test_the_whole_vocabulary_is_not_greedy():
    with pytest.raises(BadLossInput, match="temperature 0 is greedy"):
        vocabulary_listing(torch.zeros(1, 3), temperature=0.0, k=2)
    with pytest.raises(BadLossInput, match="k must be an int >= 1"):
        vocabulary_listing(torch.zeros(1, 3), temperature=1.0, k=0)
