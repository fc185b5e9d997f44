"""The torch backend's stepwise interface that the sampler pool's batcher drives:
`check_generate` (a request checked alone, nothing decoded) and
`DecodeRun.take_finished` (each prompt handed on as soon as it finishes)."""

from __future__ import annotations

import pytest

from fleetrl.actors.model import BOS_ID
from fleetrl.actors.samplers import BadGenerateRequest
from fleetrl.daemon.messages import SamplingParams

from .conftest import PROMPTS, SPEC


def test_take_finished_hands_on_each_prompt_once_as_it_finishes(fp32_backend):
    limit = SPEC.max_position_embeddings
    near_full = [BOS_ID] + [65] * (limit - 4)  # room for 3 tokens
    prompts = [*PROMPTS, near_full]
    params = SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=7)
    run = fp32_backend.start(prompts, params)
    seen: dict[int, tuple[int, object]] = {}
    while not run.done:
        run.step()
        for i, gen in run.take_finished():
            assert i not in seen, f"prompt {i} handed on twice"
            seen[i] = (run.steps, gen)
    assert sorted(seen) == list(range(len(prompts)))
    assert seen[3][0] == 3 and seen[3][1].num_tokens == 3  # the short one, at its own step
    assert all(seen[i][0] == 9 for i in range(3))
    assert run.take_finished() == []
    assert [seen[i][1] for i in range(len(prompts))] == run.results()
    assert run.results() == fp32_backend.generate(prompts, params)  # same as the one-shot call


def test_check_generate_refuses_what_generate_refuses_and_decodes_nothing(fp32_backend):
    limit = SPEC.max_position_embeddings
    assert fp32_backend.check_generate([[BOS_ID], [BOS_ID] + [65] * (limit - 3)],
                                       SamplingParams(max_tokens=5)) == [5, 2]
    cases = [
        ([[BOS_ID, 300]], SamplingParams(max_tokens=2), r"prompts\[0\]\[1\] = 300 is not a token id"),
        ([[BOS_ID]], SamplingParams(max_tokens=2, stop_ids=(999,)), r"stop_ids\[0\] = 999"),
        ([[65] * limit], SamplingParams(max_tokens=1), r"prompts\[0\] has 512 tokens"),
        ([[]], SamplingParams(max_tokens=1), r"prompts\[0\] is empty"),
    ]
    for prompts, params, match in cases:
        with pytest.raises(BadGenerateRequest, match=match):
            fp32_backend.check_generate(prompts, params)
        with pytest.raises(BadGenerateRequest, match=match):
            fp32_backend.generate(prompts, params)


def test_on_tokens_gets_every_token_of_every_prompt_before_it_finishes(fp32_backend):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop_ids=(101,))
    seen: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    run = fp32_backend.start(PROMPTS, params, on_tokens=lambda i, ids: seen[i].extend(ids))
    while not run.done:
        steps_before = {i: len(ids) for i, ids in seen.items()}
        run.step()
        for i, gen in run.take_finished():  # every token of a finished prompt was reported
            assert seen[i] == gen.token_ids.to_numpy().tolist()
        assert all(len(seen[i]) - steps_before[i] <= 1 for i in seen)  # one token per step
    assert [seen[i] for i in range(len(PROMPTS))] == [g.token_ids.to_numpy().tolist() for g in run.results()]
    assert run.results() == fp32_backend.generate(PROMPTS, params)  # the sink changes nothing


def test_abort_ends_one_prompt_at_a_step_boundary_and_the_others_decode_on(fp32_backend):
    params = SamplingParams(max_tokens=5, temperature=0.0)  # greedy: rows independent of each other
    alone = fp32_backend.generate(PROMPTS[1:], params)
    run = fp32_backend.start(PROMPTS, params)
    assert run.abort(0) is False  # nothing to abort before the prefill
    run.step()
    run.step()
    assert run.abort(0) is True and run.abort(0) is False
    [(i, gen)] = run.take_finished()
    assert i == 0 and gen.finish_reason == "abort" and gen.num_tokens == 2
    while not run.done:
        run.step()
    results = run.results()
    assert results[0] == gen
    assert [g.token_ids for g in results[1:]] == [g.token_ids for g in alone]
