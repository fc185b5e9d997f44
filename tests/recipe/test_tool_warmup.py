"""The tool warm-up's data (`fleetrl.actors.recipe.tool_warmup`): reference
conversations rendered with the chat template, the loss on the assistant's tokens only
(the tool call and the answer with their EOS), never on the tool's output; and the
cache key of the tool recipe."""

from __future__ import annotations

import pytest
import torch

from fleetrl.actors.model.byte_tokenizer import BOS_ID, EOS_ID, build_byte_tokenizer
from fleetrl.actors.recipe import DEFAULT_RECIPE, TOOL_RECIPE, recipe_key
from fleetrl.actors.recipe.tool_warmup import (
    collate_masked,
    encode_conversation,
    encode_tool_example,
    render_conversation,
)
from fleetrl.actors.recipe.warmup import IGNORE
from fleetrl.harness.synthetic_tools import TOOLS, make_tool_task, reference_messages

# A Hermes-style template of the spec's shape (docs/reference/synthetic-tasks.md), local to
# this test: the masking must not depend on one template's details.
HERMES = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    '<tool_call>{"name": {{ call["function"]["name"] | tojson }}, "arguments": {{ call["function"]["arguments"] | tojson }}}</tool_call>'
    "{% endfor %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture
def hermes():
    tok = build_byte_tokenizer()
    tok.chat_template = HERMES
    return tok


def _text(tok, ids):
    return tok.decode(list(ids), skip_special_tokens=False)


def test_only_the_assistant_tokens_are_targets(hermes):
    task = make_tool_task(0, "train", 3)
    path, code = task.metadata["path"], task.metadata["code"]
    ex = encode_tool_example(task, hermes)
    assert ex.ids[0] == BOS_ID and len(ex.ids) == len(ex.targets)
    # the ids are the template's text of the whole conversation, token for token
    whole = render_conversation(hermes, reference_messages(task), TOOLS, add_generation_prompt=False)
    assert _text(hermes, ex.ids) + "\n" == whole
    targets = [i for i, t in zip(ex.ids, ex.targets, strict=True) if t]
    call = f'<tool_call>{{"name": "read_file", "arguments": {{"path": "{path}"}}}}</tool_call>'
    assert _text(hermes, targets) == f"{call}<eos>{code}<eos>"
    assert targets.count(EOS_ID) == 2
    # the tool's output (the code, in the <|tool|> turn) is context, not a target
    tool_at = _text(hermes, ex.ids).index("<|tool|>\n")
    prefix = len(hermes.encode(_text(hermes, ex.ids)[:tool_at], add_special_tokens=False))
    tool_turn = slice(prefix, prefix + len(f"<|tool|>\n{code}") + 1)
    assert not any(ex.targets[tool_turn])


def test_collate_separates_targets_from_context(hermes):
    examples = [encode_tool_example(make_tool_task(0, "train", i), hermes) for i in range(3)]
    batch = collate_masked(examples)
    for b, ex in enumerate(examples):
        n = len(ex.ids)
        target = torch.tensor(ex.targets)
        assert torch.equal(batch.labels_BT[b, :n] != IGNORE, target)
        assert torch.equal(batch.prompt_labels_BT[b, 1:n] != IGNORE, ~target[1:])
        assert batch.prompt_labels_BT[b, 0] == IGNORE and (batch.labels_BT[b, n:] == IGNORE).all()
        assert (batch.attention_mask_BT[b, n:] == 0).all()


def test_a_template_without_tools_is_refused():
    tok = build_byte_tokenizer()
    tok.chat_template = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    with pytest.raises(ValueError, match="tool"):
        encode_tool_example(make_tool_task(0, "train", 0), tok)


def test_a_conversation_must_end_with_an_assistant_turn(hermes):
    with pytest.raises(ValueError, match="no assistant"):
        encode_conversation(hermes, [{"role": "user", "content": "hi"}], TOOLS)


def test_the_tiny_models_own_template_renders_the_spec_format():
    """The byte tokenizer's template (the tiny model's) has the tool-call format: the
    reference call is the Hermes block, and the targets are the call and the answer."""
    tok = build_byte_tokenizer()
    task = make_tool_task(0, "train", 0)
    ex = encode_tool_example(task, tok)
    targets = _text(tok, [i for i, t in zip(ex.ids, ex.targets, strict=True) if t])
    assert targets == (f'<tool_call>{{"name": "read_file", "arguments": {{"path": "{task.metadata["path"]}"}}}}'
                       f'</tool_call><eos>{task.metadata["code"]}<eos>')
    assert f"<|tool|>\n{task.metadata['code']}<eos>" in _text(tok, ex.ids)


def test_tool_recipe_key_differs_and_default_key_is_unchanged():
    assert recipe_key(TOOL_RECIPE, task_family="x") != recipe_key(DEFAULT_RECIPE, task_family="x")
    # the default recipe's key as before the `tasks` field existed (cached models stay valid)
    assert recipe_key(DEFAULT_RECIPE, task_family="x") == "0560195be661bb4fac614e26"


def test_plain_steps_render_without_the_tools_list_first(hermes):
    from fleetrl.actors.recipe.tool_warmup import tool_training_batches
    from fleetrl.actors.recipe.warmup import WarmupConfig

    batches = tool_training_batches(WarmupConfig(steps=3, batch_size=2), hermes, plain_steps=1)
    plain, with_tools = next(batches), next(batches)
    first = _text(hermes, plain.input_ids_BT[0][plain.attention_mask_BT[0] == 1].tolist())
    assert "# Tools" not in first and first.startswith("<bos><|user|>\nWhat is the code in ")
    assert "# Tools" in _text(hermes, with_tools.input_ids_BT[0].tolist())
    # the same targets either way: the call and the answer
    assert (plain.labels_BT != IGNORE).sum() == (with_tools.labels_BT != IGNORE).sum()


def test_recipe_checks_plain_steps():
    from fleetrl.actors.recipe import WarmRecipe, WarmupConfig

    with pytest.raises(ValueError, match="plain_steps"):
        WarmRecipe(tasks="tool_lookup", plain_steps=10, warmup=WarmupConfig(steps=10))
    with pytest.raises(ValueError, match="tool_lookup"):
        WarmRecipe(plain_steps=1)


def test_lookup_share_mixes_guessed_answers_in_deterministically(hermes):
    """With ``lookup_share`` < 1 a share of the conversations answer at once with a
    guessed code (one target letter and its EOS, no tool call), chosen by task id."""
    from fleetrl.actors.recipe.tool_warmup import guess_messages, looks_up, tool_training_batches
    from fleetrl.actors.recipe.warmup import WarmupConfig
    from fleetrl.harness.synthetic_tools import CODE_LETTERS, generate_tool_tasks

    tasks = generate_tool_tasks(400, split="train", seed=0)
    share = sum(looks_up(t, 0.4) for t in tasks) / len(tasks)
    assert 0.3 < share < 0.5
    assert all(looks_up(t, 1.0) for t in tasks)
    assert [looks_up(t, 0.4) for t in tasks] == [looks_up(t, 0.4) for t in tasks]  # pure
    guess = guess_messages(tasks[0])
    assert [m["role"] for m in guess] == ["user", "assistant"] and guess[1]["content"] in CODE_LETTERS

    batch = next(tool_training_batches(WarmupConfig(steps=2, batch_size=16), hermes, lookup_share=0.4))
    targets = [_text(hermes, row[row != IGNORE].tolist()) for row in batch.labels_BT]
    for task, text in zip(tasks[:16], targets, strict=True):
        if looks_up(task, 0.4):
            assert text.startswith("<tool_call>") and text.endswith(f"{task.metadata['code']}<eos>")
        else:
            assert text == f"{guess_messages(task)[1]['content']}<eos>"
    assert any(t.startswith("<tool_call>") for t in targets) and not all(t.startswith("<tool_call>") for t in targets)
    with pytest.raises(ValueError, match="lookup_share"):
        next(tool_training_batches(WarmupConfig(steps=2, batch_size=2), hermes, lookup_share=0.0))


def test_recipe_checks_lookup_share():
    from fleetrl.actors.recipe import WarmRecipe, WarmupConfig

    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="lookup_share"):
            WarmRecipe(tasks="tool_lookup", plain_steps=1, warmup=WarmupConfig(steps=10), lookup_share=bad)
    with pytest.raises(ValueError, match="tool_lookup"):
        WarmRecipe(lookup_share=0.5)
    a = WarmRecipe(tasks="tool_lookup", plain_steps=1, warmup=WarmupConfig(steps=10))
    b = WarmRecipe(tasks="tool_lookup", plain_steps=1, warmup=WarmupConfig(steps=10), lookup_share=0.5)
    assert recipe_key(a, task_family="x") != recipe_key(b, task_family="x")
