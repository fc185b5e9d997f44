"""The endpoint and a built-in harness over the real tiny model and torch sampler backend.

The model client is the shared `fakes.TorchClient`: the backend's blocking ``generate``
in a worker thread, its result converted to the wire `Generation`.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
import trio
from fakes import FakeSandbox, TorchClient, serving

from fleetrl.harness.builtin import ShellAgentHarness
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app
from fleetrl.harness.tasks import Evaluator, Limits, Task

@pytest.fixture(scope="module")
def tiny(tiny_served):
    backend, tok, _ = tiny_served
    return backend, tok


async def test_openai_client_against_the_tiny_model_is_recorded_token_exactly(tiny):
    backend, tok = tiny
    model = TorchClient(backend, tok)
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig(model_name="tiny", context_length=1024))
    key = registry.open_attempt("a", "t")
    with trio.fail_after(180):
        async with serving(app) as base:
            def converse():
                with openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60) as c:
                    return _converse(c)

            def _converse(c):
                msgs = [{"role": "user", "content": "write a function"}]
                for i in range(3):
                    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, seed=100 + i,
                                                  top_p=0.9, stream=i == 1)
                    text = ("".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if i == 1
                            else r.choices[0].message.content)
                    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
                comp = c.completions.create(model="tiny", prompt="def f(x):\n", max_tokens=8, seed=1)
                return comp
            comp = await trio.to_thread.run_sync(converse)
    record = registry.close_attempt(key)
    assert len(record.calls) == 4 and record.n_new_segments == 2  # the chat, then the completion
    for i in (1, 2):
        prev, call = record.calls[i - 1], record.calls[i]
        assert call.extends == i - 1
        assert call.prompt_ids[: len(prev.prompt_ids) + len(prev.token_ids)] == prev.prompt_ids + prev.token_ids
    # the recorded tokens are the model's: a seeded rerun of the backend gives them again
    for call, (prompt, bp) in zip(record.calls, model.requests):
        assert call.prompt_ids == prompt
        (again,) = backend.generate([prompt], bp)
        assert again.token_ids.to_numpy().tolist() == call.token_ids
        assert np.allclose(call.segment.logprobs.to_numpy(), again.logprobs.to_numpy(), atol=1e-6)
    assert record.calls[0].segment.sampler.backend == "torch"
    assert comp.choices[0].text == record.calls[3].text


async def test_shell_agent_with_the_tiny_model(tiny):
    backend, tok = tiny
    task = Task(id="t", prompt="list the files", evaluator=Evaluator(command="true"), limits=Limits(max_turns=2))
    with trio.fail_after(120):
        episode = await ShellAgentHarness(max_tokens=10).run(task, FakeSandbox(), TorchClient(backend, tok))
    # a random tiny model proposes no valid command: two format reminders, then the turn limit
    assert episode.final_state == "turn_limit" and episode.n_calls == 2
    c0, c1 = episode.record.calls
    assert c1.extends == 0 and c1.prompt_ids[: len(c0.prompt_ids) + len(c0.token_ids)] == c0.prompt_ids + c0.token_ids
