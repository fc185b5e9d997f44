"""The byte-level tokenizer: ids are bytes, specials follow, and the saved directory
loads in transformers with the same behaviour."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from fleetrl.actors.model.byte_tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_byte_tokenizer,
    byte_symbols,
    save_byte_tokenizer,
)

TOK = build_byte_tokenizer()


def test_layout_bytes_then_specials():
    assert (PAD_ID, BOS_ID, EOS_ID) == (256, 257, 258)
    assert VOCAB_SIZE == 259 == len(TOK)
    assert [TOK.convert_ids_to_tokens(i) for i in (PAD_ID, BOS_ID, EOS_ID)] == list(SPECIAL_TOKENS)
    symbols = byte_symbols()
    assert len(set(symbols)) == 256
    assert symbols[ord("a")] == "a" and symbols[ord(" ")] != " "  # space is remapped, as in byte-level BPE


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_ids_are_the_utf8_bytes_after_bos(text):
    ids = TOK(text)["input_ids"]
    if any(s in text for s in SPECIAL_TOKENS):
        return  # a literal special token string becomes its special id (tested below)
    assert ids == [BOS_ID, *text.encode("utf-8")]
    assert TOK.decode(ids[1:]) == text


def test_special_strings_and_decoding():
    ids = TOK("a<eos>b", add_special_tokens=False)["input_ids"]
    assert ids == [ord("a"), EOS_ID, ord("b")]
    assert TOK.decode(ids, skip_special_tokens=True) == "ab"
    assert TOK.decode([0xFF]) == "\ufffd"  # a lone invalid byte decodes to the replacement char


def test_saved_directory_loads_in_transformers(tmp_path):
    save_byte_tokenizer(tmp_path, model_max_length=1234)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "chat_template" in config
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "def f(x):\n    return x * 2  # héllo ✓"
    assert loaded(text)["input_ids"] == TOK(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert loaded.model_max_length == 1234
    chat = loaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<bos><|user|>\nhi<eos>\n<|assistant|>\n"


def test_special_token_text_encodes_to_its_id_for_the_chat_layout():
    """The chat template writes <bos>/<eos> as text; ``encode`` (no added specials) maps
    that text to the special ids, as apply_chat_template(tokenize=True) does."""
    from fleetrl.harness.model import HFChatTokenizer

    tok = HFChatTokenizer(TOK)
    assert tok.encode("<bos><|user|>\nhi<eos>\n") == [BOS_ID, *b"<|user|>\nhi", EOS_ID, *b"\n"]
    assert tok.encode("<pad>") == [PAD_ID] and tok.encode("<eo") == [*b"<eo"]
    assert tok.eos_token == "<eos>"


def test_saved_template_renders_tools_in_transformers(tmp_path):
    save_byte_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "run", "arguments": {"cmd": "ls"}}}]},
            {"role": "tool", "content": "a.txt", "tool_call_id": "c"}]
    text = loaded.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == ('<bos><|system|>\n# Tools\n{"type": "function", "function": {"name": "run", "parameters": '
                    '{"type": "object"}}}\nTo call a tool, answer <tool_call>{"name": ..., "arguments": {...}}'
                    '</tool_call><eos>\n<|user|>\nhi<eos>\n<|assistant|>\n<tool_call>{"name": "run", "arguments": '
                    '{"cmd": "ls"}}</tool_call><eos>\n<|tool|>\na.txt<eos>\n<|assistant|>\n')
