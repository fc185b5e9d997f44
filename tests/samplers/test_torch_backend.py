"""The torch reference backend against the trainer (transformers fp32 + support replay)."""

from __future__ import annotations

import math
import threading
import time

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.model import BOS_ID, EOS_ID, VOCAB_SIZE, build_tiny_llama, read_state_dict, save_tiny_llama
from fleetrl.actors.samplers import (
    BadGenerateRequest,
    BadWeightUpdate,
    NumericalFailure,
    SamplerBackend,
    TorchBackend,
    TorchBackendConfig,
    WeightVersion,
    measure_mismatch,
    trainer_logprobs,
)
from fleetrl.daemon.messages import Generation, SamplingParams
from fleetrl.grpo import replay_logprobs

from .conftest import PROMPTS, SPEC


def backend(model_dir, dtype="fp32", **kw) -> TorchBackend:
    return TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype, **kw))


def tokens(gen) -> list[int]:
    return gen.token_ids.to_numpy().tolist()


def support_tensors(gen) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded support (ids -1, log-probs -inf) as torch tensors."""
    ids, lps = gen.support.padded()
    return torch.from_numpy(ids), torch.from_numpy(lps)


def support_sizes(gen) -> list[int]:
    return torch.from_numpy(gen.support.offsets.to_numpy().copy()).diff().tolist()


def full_logits(model, prompt, gen):
    """The trainer's fp32 logits at the positions that predicted each generated token."""
    ids = torch.tensor([list(prompt) + tokens(gen)])
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1 : -1].float()


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 0.9, None), (0.7, 0.95, 20), (1.0, 1.0, None)])
def test_fp32_logprobs_equal_trainer_replay(model_dir, trainer, temperature, top_p, top_k):
    params = SamplingParams(max_tokens=24, temperature=temperature, top_p=top_p, top_k=top_k, seed=1)
    gens = backend(model_dir).generate(PROMPTS, params)
    worst = 0.0
    for prompt, gen in zip(PROMPTS, gens):
        assert gen.num_tokens == 24 and set(gen.versions.to_numpy().tolist()) == {0}
        logp = trainer_logprobs(trainer, prompt, gen, temperature)
        worst = max(worst, float((logp - gen.logprobs.to_torch()).abs().max()))
        # every member of every support, not only the sampled token
        ids, lps = support_tensors(gen)
        _, logp_k = replay_logprobs((full_logits(trainer, prompt, gen) / temperature)[None],
                                    gen.token_ids.to_torch()[None], ids[None])
        valid = ids >= 0
        worst = max(worst, float((logp_k[0][valid] - lps[valid]).abs().max()))
    assert worst < 1e-5


def test_greedy_follows_transformers_generate(model_dir, trainer):
    gens = backend(model_dir).generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0, stop_ids=(EOS_ID,)))
    for prompt, gen in zip(PROMPTS, gens):
        with torch.no_grad():
            out = trainer.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=EOS_ID)
        assert tokens(gen) == out[0, len(prompt):].tolist()
        assert gen.logprobs.to_numpy().tolist() == [0.0] * gen.num_tokens  # greedy: the support is the argmax alone
        assert gen.support.offsets.to_numpy().tolist() == list(range(gen.num_tokens + 1))


def test_sampled_steps_report_the_full_forward_distribution(model_dir, trainer):
    """top_p = 1: every step reports the whole vocabulary; its log q equals the trainer's
    log_softmax at that position, which checks the KV cache along sampled paths."""
    gens = backend(model_dir).generate(PROMPTS, SamplingParams(max_tokens=16, seed=4))
    for prompt, gen in zip(PROMPTS, gens):
        ids, lps = support_tensors(gen)
        assert ids.shape == (16, VOCAB_SIZE) and bool((ids >= 0).all())
        ref = torch.log_softmax(full_logits(trainer, prompt, gen), -1).gather(1, ids)
        assert float((ref - lps).abs().max()) < 1e-5


def test_support_invariants(model_dir, trainer):
    top_p = 0.8
    gens = backend(model_dir).generate(PROMPTS, SamplingParams(max_tokens=24, top_p=top_p, seed=2))
    sizes = []
    for prompt, gen in zip(PROMPTS, gens):
        ids, lps = support_tensors(gen)
        q = torch.softmax(full_logits(trainer, prompt, gen), -1)
        for t in range(gen.num_tokens):
            k = int((ids[t] >= 0).sum())
            sizes.append(k)
            members, member_lps = ids[t, :k], lps[t, :k]
            assert tokens(gen)[t] in members.tolist()
            assert math.isclose(float(member_lps.double().exp().sum()), 1.0, abs_tol=1e-5)
            assert bool((member_lps[:-1] >= member_lps[1:]).all())  # most likely first
            mass = q[t, members]
            assert float(mass.sum()) >= top_p - 1e-5  # reaches top_p ...
            assert float(mass[:-1].sum()) < top_p + 1e-5  # ... and is minimal
            assert int(q[t].argmax()) == int(members[0])
    assert min(sizes) < max(sizes) < VOCAB_SIZE  # the test model gives varied, truncated supports

    capped = backend(model_dir).generate(PROMPTS, SamplingParams(max_tokens=8, top_p=0.99, top_k=3, seed=2))
    for gen in capped:
        assert max(support_sizes(gen)) <= 3


def test_seeds_make_generation_reproducible(model_dir):
    be = backend(model_dir)
    params = SamplingParams(max_tokens=12, top_p=0.95, seed=7)
    first = be.generate(PROMPTS, params)
    assert be.generate(PROMPTS, params) == first
    other = be.generate(PROMPTS, msgspec.structs.replace(params, seed=8))
    assert [g.token_ids for g in other] != [g.token_ids for g in first]
    unseeded = be.generate(PROMPTS, msgspec.structs.replace(params, seed=None))
    assert be.generate(PROMPTS, msgspec.structs.replace(params, seed=unseeded[0].seed)) == unseeded


def test_stop_ids_and_max_tokens_end_rows_of_a_mixed_batch(model_dir):
    be = backend(model_dir)
    free = be.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0))
    assert [(g.num_tokens, g.finish_reason) for g in free] == [(16, "length")] * 3
    stop = tokens(free[0])[5]
    stopped = be.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, stop_ids=(stop,)))
    ended_early = 0
    for f, s in zip(free, stopped):
        if stop in tokens(f):
            end = tokens(f).index(stop) + 1
            assert tokens(s) == tokens(f)[:end] and s.finish_reason == "stop"
            ended_early += 1
        else:
            assert tokens(s) == tokens(f) and s.finish_reason == "length"
    assert ended_early >= 1 and stopped[0].num_tokens <= 6


def test_context_length_ends_generation(model_dir):
    be = backend(model_dir)
    limit = SPEC.max_position_embeddings
    near_full = [BOS_ID] + [65] * (limit - 4)
    gens = be.generate([near_full, [BOS_ID]], SamplingParams(max_tokens=10, temperature=0.0))
    assert (gens[0].num_tokens, gens[0].finish_reason) == (3, "length")
    assert gens[1].num_tokens == 10
    with pytest.raises(BadGenerateRequest, match=r"prompts\[1\] has 512 tokens"):
        be.generate([[BOS_ID], [65] * limit], SamplingParams(max_tokens=1))


def test_bad_requests_are_refused(model_dir):
    be = backend(model_dir)
    with pytest.raises(BadGenerateRequest, match=r"prompts\[0\]\[1\] = 300"):
        be.generate([[BOS_ID, 300]], SamplingParams(max_tokens=2))
    with pytest.raises(BadGenerateRequest, match=r"stop_ids\[0\] = 999"):
        be.generate([[BOS_ID]], SamplingParams(max_tokens=2, stop_ids=(999,)))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8"])
def test_lower_precisions_show_small_nonzero_mismatch(model_dir, trainer, dtype):
    params = SamplingParams(max_tokens=32, top_p=0.95, seed=3)
    exact = measure_mismatch(trainer, PROMPTS, backend(model_dir).generate(PROMPTS, params), 1.0)
    low = measure_mismatch(trainer, PROMPTS, backend(model_dir, dtype).generate(PROMPTS, params), 1.0)
    assert exact.tokens == low.tokens == 96
    assert exact.k3_kl < 1e-9
    assert 1e-8 < low.k3_kl < 0.1, low
    assert low.max_abs_log_ratio > 1e-4


def test_fp8_backend_holds_fp8_projections(model_dir):
    stored = backend(model_dir, "fp8", fp8_scheme="row").stored_dtypes()
    assert stored["model.layers.0.mlp.up_proj.weight"] == "float8_e4m3fn+scale"
    assert stored["model.layers.1.self_attn.q_proj.weight"] == "float8_e4m3fn+scale"
    assert stored["model.embed_tokens.weight"] == stored["lm_head.weight"] == "bfloat16"
    assert set(backend(model_dir, "fp16").stored_dtypes().values()) == {"float16"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16 also covers the fp32-accumulation copies
def test_inflight_update_between_steps(model_dir, dtype):
    """Three steps at v0, then a new LM head (all zeros: uniform logits) at v1."""
    be = backend(model_dir, dtype)
    run = be.start(PROMPTS, SamplingParams(max_tokens=10, seed=0))
    for _ in range(3):
        run.step()
    be.apply_update({"lm_head.weight": torch.zeros(VOCAB_SIZE, SPEC.hidden_size)}, WeightVersion(1, "v1"))
    while not run.done:
        run.step()
    uniform = -math.log(VOCAB_SIZE)
    for gen in run.results():
        assert gen.versions.to_numpy().tolist() == [0] * 3 + [1] * 7
        ids, lps = support_tensors(gen)
        assert float((lps[3:] - uniform).abs().max()) < 1e-6  # from the new weights
        assert bool((lps[:3, 0] > uniform + 0.1).all())  # the old weights were not uniform


def test_update_from_another_thread_lands_between_steps(model_dir, other_model_dir):
    be = backend(model_dir)
    new = read_state_dict(other_model_dir)
    run = be.start(PROMPTS, SamplingParams(max_tokens=300, seed=0))
    failure: list[BaseException] = []

    def decode():
        try:
            while not run.done:
                run.step()
        except BaseException as exc:  # surfaced to the test below
            failure.append(exc)

    worker = threading.Thread(target=decode)
    worker.start()
    deadline = time.monotonic() + 60
    while run.steps < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    be.apply_update(new, WeightVersion(1, "other"))
    worker.join(timeout=120)
    assert not worker.is_alive() and not failure
    for gen in run.results():
        versions = gen.versions.to_numpy()
        assert versions[0] == 0 and versions[-1] == 1  # non-decreasing is checked when the backend builds it


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_update_between_requests_equals_a_fresh_backend(model_dir, other_model_dir, dtype):
    be = backend(model_dir, dtype)
    new = {k: v.to(torch.bfloat16) if dtype == "bf16" else v for k, v in read_state_dict(other_model_dir).items()}
    be.apply_update(new, WeightVersion(5, "other"))
    assert be.weight_version == WeightVersion(5, "other")
    params = SamplingParams(max_tokens=12, top_p=0.9, seed=9)
    got = be.generate(PROMPTS, params)
    want = backend(other_model_dir, dtype).generate(PROMPTS, params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.logprobs, g.support.ids) == (w.token_ids, w.logprobs, w.support.ids)
        assert set(g.versions.to_numpy().tolist()) == {5}


def test_bad_updates_change_nothing(model_dir):
    be = backend(model_dir)
    params = SamplingParams(max_tokens=6, temperature=0.0, seed=0)
    before = be.generate(PROMPTS, params)
    head = torch.zeros(VOCAB_SIZE, SPEC.hidden_size)
    cases = [
        ({"lm_head.weights": head}, WeightVersion(1, "x"), "unknown weight name"),
        ({"lm_head.weight": head[:-1]}, WeightVersion(1, "x"), "shape"),
        ({"lm_head.weight": head.clone().fill_(math.nan)}, WeightVersion(1, "x"), "NaN"),
        ({"lm_head.weight": head.long()}, WeightVersion(1, "x"), "dtype"),
        ({"lm_head.weight": head}, WeightVersion(0, "x"), "not newer"),
    ]
    for tensors, version, message in cases:
        with pytest.raises(BadWeightUpdate, match=message):
            be.apply_update(tensors, version)
    with pytest.raises(BadWeightUpdate, match="missing"):
        be.load_version({"lm_head.weight": head}, WeightVersion(3, "x"))
    assert be.weight_version.version == 0
    assert be.generate(PROMPTS, params) == before


def test_backend_copies_what_it_is_given(model_dir, other_model_dir):
    be = backend(model_dir)
    new = read_state_dict(other_model_dir)
    be.load_version(new, WeightVersion(2, "other"))
    params = SamplingParams(max_tokens=6, temperature=0.0, seed=0)
    expected = be.generate(PROMPTS, params)
    for t in new.values():
        t.zero_()  # the caller reuses its buffers (the follower's shadow does)
    assert be.generate(PROMPTS, params) == expected


def test_health_and_protocol(model_dir):
    be = backend(model_dir, "bf16")
    assert isinstance(be, SamplerBackend)
    assert (be.identity.backend, be.identity.device_kind, be.identity.dtype) == ("torch", "cpu", "bfloat16")
    health = be.health()
    assert health.ok and health.version == be.weight_version and health.version.digest.startswith("sha256:")
    be.apply_update({"model.norm.weight": torch.ones(SPEC.hidden_size)}, WeightVersion(4, "d4"))
    assert be.health().version == WeightVersion(4, "d4")


def test_generation_crosses_process_boundaries(model_dir):
    gen = backend(model_dir, "fp8").generate(PROMPTS[:1], SamplingParams(max_tokens=5, top_p=0.9, seed=1))[0]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(gen), type=Generation) == gen


def test_tied_embeddings_model(tmp_path):
    spec = msgspec.structs.replace(SPEC, tie_word_embeddings=True)
    model = build_tiny_llama(spec, seed=3)
    path = save_tiny_llama(model, tmp_path / "tied")
    gen = backend(path).generate(PROMPTS[:1], SamplingParams(max_tokens=8, seed=0))[0]
    logp = trainer_logprobs(model, PROMPTS[0], gen, 1.0)
    assert float((logp - gen.logprobs.to_torch()).abs().max()) < 1e-5


@pytest.mark.parametrize("scheme", ["tensor", "row", "block128"])
def test_fp8_dequantize_once_is_bit_identical_to_per_matmul(model_dir, scheme):
    params = SamplingParams(max_tokens=10, top_p=0.95, seed=6)
    once = backend(model_dir, "fp8", fp8_scheme=scheme).generate(PROMPTS, params)
    each = backend(model_dir, "fp8", fp8_scheme=scheme, fp8_dequantize_once=False).generate(PROMPTS, params)
    assert once == each


def test_fp16_overflow_is_refused_or_reported(model_dir):
    be = backend(model_dir, "fp16")
    with pytest.raises(BadWeightUpdate, match="overflows fp16"):
        be.apply_update({"lm_head.weight": torch.full((VOCAB_SIZE, SPEC.hidden_size), 1e5)}, WeightVersion(1, "x"))
    # representable weights whose logits overflow: the failure names the prompt and step
    be.apply_update({"lm_head.weight": torch.full((VOCAB_SIZE, SPEC.hidden_size), 6e4)}, WeightVersion(2, "y"))
    with pytest.raises(NumericalFailure, match=r"prompts\[0\]: non-finite logits at decode step 0 .*version 2"):
        be.generate(PROMPTS, SamplingParams(max_tokens=3, seed=0))
    health = be.health()
    assert not health.ok and "non-finite" in health.detail


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    prompts=st.lists(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=30), min_size=1, max_size=4),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_p=st.floats(0.05, 1.0),
    top_k=st.one_of(st.none(), st.integers(1, 40)),
    max_tokens=st.integers(1, 12),
    stop_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=20).map(tuple),
    seed=st.integers(0, 2**32),
)
def test_any_request_keeps_the_contract(fp32_backend, trainer, prompts, temperature, top_p, top_k, max_tokens,
                                        stop_ids, seed):
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop_ids=stop_ids, seed=seed)
    gens = fp32_backend.generate(prompts, params)
    assert len(gens) == len(prompts)
    for prompt, gen in zip(prompts, gens):
        assert 1 <= gen.num_tokens <= max_tokens
        assert not set(tokens(gen)[:-1]) & set(stop_ids)  # a stop id ends the row at once
        if gen.finish_reason == "stop":
            assert tokens(gen)[-1] in stop_ids
        else:
            assert gen.num_tokens == max_tokens
        sizes = support_sizes(gen)
        assert max(sizes) <= (top_k or VOCAB_SIZE) and (temperature > 0 or max(sizes) == 1)
        logp = trainer_logprobs(trainer, prompt, gen, temperature)
        if temperature == 0:
            assert float(logp.abs().max()) == 0.0  # one-member supports on both sides
        else:  # dividing by a temperature below 1 scales rounding differences up
            assert float((logp - gen.logprobs.to_torch()).abs().max()) < 1e-5 / min(temperature, 1.0)

