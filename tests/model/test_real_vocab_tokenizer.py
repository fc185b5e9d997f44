"""The real-size tokenizer: exactly 151,936 ids that all decode, exact round trips, the
ChatML-like chat template with tools, and the harness's chat code over it (tool calls
parsed back, prompts extended token for token). The tokenizer comes from the on-disk
cache (trained once per machine); the second lookup must not train."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from fleetrl.actors.model import REAL_VOCAB_SIZE, bpe_tokenizer, chatml, load_bpe_tokenizer
from fleetrl.actors.model.bpe_tokenizer import (
    END_OF_TEXT_ID,
    IM_END_ID,
    IM_START_ID,
    TOOL_CALL_CLOSE_ID,
    TOOL_CALL_OPEN_ID,
    bpe_tokenizer_file,
)
from fleetrl.actors.model.tokenizer_cache import MANIFEST
from fleetrl.harness.chat import ChatHistory, ChatMessage, ToolCall
from fleetrl.harness.model import HFChatTokenizer
from fleetrl.harness.tool_calls import parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "run", "description": "run a shell command",
                                            "parameters": {"type": "object",
                                                           "properties": {"cmd": {"type": "string"}}}}}]
CALL = ToolCall(id="call_1", name="run", arguments='{"cmd": "ls -l"}')
ANSWER_TEXT = 'Let me look.<tool_call>{"name": "run", "arguments": {"cmd": "ls -l"}}</tool_call>'

SAMPLES = [
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.\n",
    "naïve café — 日本語のテキスト, emoji 🤖🎉, RTL שלום, "
    "e\u0301 combining, zero\u200bwidth, NUL \x00, tabs\t\t.",
    "def f(x: int) -> int:\r\n\treturn x ** 2  # squared   \n\n\n    if __name__ == '__main__':\n        f(1_000)\n",
    "   leading and trailing blanks   ",
    "",
]


@pytest.fixture(scope="module")
def real_tok():
    return load_bpe_tokenizer()


def test_exactly_the_real_vocabulary_size_with_added_tokens_last(real_tok):
    assert len(real_tok) == REAL_VOCAB_SIZE == 151_936
    assert [real_tok.convert_tokens_to_ids(t) for t in chatml.ADDED_TOKENS] == [
        END_OF_TEXT_ID, IM_START_ID, IM_END_ID, TOOL_CALL_OPEN_ID, TOOL_CALL_CLOSE_ID] == list(range(151_931, 151_936))
    assert (real_tok.eos_token, real_tok.eos_token_id) == ("<|im_end|>", IM_END_ID)
    assert (real_tok.pad_token, real_tok.pad_token_id) == ("<|endoftext|>", END_OF_TEXT_ID)
    assert real_tok.bos_token_id is None


def test_every_id_decodes(real_tok):
    ids = list(range(REAL_VOCAB_SIZE))
    tokens = real_tok.convert_ids_to_tokens(ids)
    assert all(isinstance(t, str) and t for t in tokens)
    assert len(set(tokens)) == REAL_VOCAB_SIZE
    texts = real_tok.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    assert all(texts), [i for i, t in enumerate(texts) if not t][:10]
    assert texts[IM_END_ID] == "<|im_end|>" and texts[TOOL_CALL_OPEN_ID] == "<tool_call>"
    assert isinstance(real_tok.decode(ids), str)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trips_exactly(real_tok, text):
    ids = real_tok.encode(text, add_special_tokens=False)
    assert real_tok.decode(ids) == text
    assert all(0 <= i < REAL_VOCAB_SIZE for i in ids)


def test_merges_make_code_short(real_tok):
    """Real merges, not bytes: common code words are single tokens."""
    text = "    def __init__(self, value):\n        return self.value\n"
    ids = real_tok.encode(text, add_special_tokens=False)
    assert len(ids) < len(text.encode()) / 2
    assert real_tok.encode(" return", add_special_tokens=False) == [real_tok.convert_tokens_to_ids("Ġreturn")]


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_any_text_round_trips(real_tok, text):
    assert real_tok.decode(real_tok.encode(text, add_special_tokens=False)) == text


def test_special_strings_encode_to_their_ids_and_decode_skips_only_the_special_ones(real_tok):
    ids = real_tok.encode("a<|im_end|>b<tool_call>c</tool_call>", add_special_tokens=False)
    assert IM_END_ID in ids and TOOL_CALL_OPEN_ID in ids and TOOL_CALL_CLOSE_ID in ids
    assert real_tok.decode(ids, skip_special_tokens=True) == "ab<tool_call>c</tool_call>"
    assert real_tok.encode("hi") == real_tok.encode("hi", add_special_tokens=False)  # no bos added


def conversation() -> list[ChatMessage]:
    return [ChatMessage("system", "You are terse."), ChatMessage("user", "list the files")]


def test_saved_chat_template_renders_tools_and_calls(real_vocab_model_dir):
    tok = HFChatTokenizer.from_pretrained(real_vocab_model_dir)
    msgs = [*conversation(), ChatMessage("assistant", "Let me look.", tool_calls=(CALL,)),
            ChatMessage("tool", "a.txt", tool_call_id="call_1"), ChatMessage("assistant", "One file.")]
    text = tok.render(msgs, TOOLS, add_generation_prompt=True)
    tools_line = json.dumps(TOOLS[0], ensure_ascii=False)
    assert text == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n" + tools_line + "\n"
        'To call a tool, answer <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
        "<|im_start|>user\nlist the files<|im_end|>\n"
        "<|im_start|>assistant\n" + ANSWER_TEXT + "<|im_end|>\n"
        "<|im_start|>tool\na.txt<|im_end|>\n"
        "<|im_start|>assistant\nOne file.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tok.render(conversation(), None, add_generation_prompt=False)
    assert plain == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nlist the files<|im_end|>\n"
    assert (tok.bos_id, tok.eos_id, tok.eos_token, tok.vocab_size) == (None, IM_END_ID, "<|im_end|>", REAL_VOCAB_SIZE)
    hf = AutoTokenizer.from_pretrained(real_vocab_model_dir)
    assert hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False) \
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_generated_tool_calls_parse_back_and_the_next_prompt_extends_the_tokens(real_vocab_model_dir):
    """What the harness does with an answer: decode the generated ids (specials skipped),
    parse the tool calls, then build the next prompt from the earlier ids."""
    tok = HFChatTokenizer.from_pretrained(real_vocab_model_dir)
    generated = [*tok.encode(ANSWER_TEXT), tok.eos_id]
    parsed = parse_tool_calls(tok.decode(generated), make_id=lambda: "call_1")
    assert parsed.failed is None
    assert parsed.content == "Let me look."
    assert parsed.tool_calls == (CALL,)

    history = ChatHistory(tok)
    first = history.plan(conversation(), TOOLS)
    assert first.ids == tok.encode(first.text) and first.text.endswith("<|im_start|>assistant\n")
    answer = ChatMessage("assistant", parsed.content, tool_calls=parsed.tool_calls)
    history.add(0, conversation(), first, generated, answer, context_tokens=len(generated) - 1)
    follow = [*conversation(), answer, ChatMessage("tool", "a.txt\nb.txt", tool_call_id="call_1")]
    second = history.plan(follow, TOOLS)
    assert (second.extends, second.cause) == (0, None)
    assert second.reused == len(first.ids) + len(generated)
    assert second.ids[:second.reused] == [*first.ids, *generated]
    assert second.ids == tok.encode(second.text)  # the reused tokens are also the fresh tokenisation


def test_second_lookup_uses_the_cache(monkeypatch, real_tok):
    """The module fixture put the tokenizer in the cache: looking it up again must not train."""
    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer was rebuilt")

    monkeypatch.setattr(bpe_tokenizer, "train_bpe_tokenizer", no_training)
    path = bpe_tokenizer_file()
    again = load_bpe_tokenizer()
    assert len(again) == REAL_VOCAB_SIZE
    build = json.loads((path.parent / MANIFEST).read_text())["build"]
    assert build["vocab_size"] == REAL_VOCAB_SIZE
    assert 256 + build["merges"] + build["filled"] + len(chatml.ADDED_TOKENS) == REAL_VOCAB_SIZE
