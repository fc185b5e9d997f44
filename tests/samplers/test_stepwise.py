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
