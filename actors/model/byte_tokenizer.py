"""Byte-level tokenizer for the tiny model: one token per byte, plus special tokens.

Token ids 0..255 are the bytes themselves (id == byte value), so any text, in any
language or encoding, round-trips without an unknown token; the special tokens follow
from id 256. The tokenizer is an ordinary `tokenizers` byte-level BPE with no merges,
saved through transformers' `PreTrainedTokenizerFast`, so transformers, vLLM and any
other Hugging Face-compatible engine load the saved directory unchanged.
"""

from __future__ import annotations

import os
from typing import Final

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from .tokenizer_files import save_fast_tokenizer

PAD: Final = "<pad>"
BOS: Final = "<bos>"
EOS: Final = "<eos>"
SPECIAL_TOKENS: Final[tuple[str, ...]] = (PAD, BOS, EOS)
N_BYTES: Final = 256
PAD_ID: Final = N_BYTES + SPECIAL_TOKENS.index(PAD)
BOS_ID: Final = N_BYTES + SPECIAL_TOKENS.index(BOS)
EOS_ID: Final = N_BYTES + SPECIAL_TOKENS.index(EOS)
VOCAB_SIZE: Final = N_BYTES + len(SPECIAL_TOKENS)

# A plain-text chat layout, so an OpenAI-style chat endpoint (ours or vLLM's) can turn
# messages into tokens without a model-specific template. Roles are written as text;
# each turn ends with <eos>, which is also the token that ends a generation.
#
# Tool calls follow the Hermes/Qwen format most open models use: with ``tools``, the
# first turn is a system turn listing them (one JSON line each, after the system
# message's content when the conversation opens with one) and saying how to call one;
# an assistant message's calls follow its content as
# ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (parsed back by
# ``fleetrl.harness.tool_calls``); a tool result is a ``<|tool|>`` turn. Without tools
# and tool calls the text is that of the plain layout, byte for byte.
#
# Rendered by transformers' sandboxed jinja environment (trim_blocks, lstrip_blocks,
# its own ``tojson``: ``json.dumps`` with ensure_ascii=False), as vLLM renders it too:
# no block tag may be followed by a newline of the text (trim_blocks would drop it).
TOOL_INSTRUCTION: Final = (
    'To call a tool, answer <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
)
CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% if tools %}"
    "<|system|>\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    + TOOL_INSTRUCTION + "{{ eos_token }}\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and tools and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|assistant|>\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{% set args = call['function']['arguments'] %}"
    '<tool_call>{"name": {{ call[\'function\'][\'name\'] | tojson }}, "arguments": '
    "{% if args is string %}{{ args }}{% else %}{{ args | tojson }}{% endif %}"
    "}</tool_call>"
    "{% endfor %}"
    "{{ eos_token }}\n"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_symbols() -> list[str]:
    """The printable character that stands for each byte value 0..255 (index = byte).

    This is the byte-to-character table that byte-level BPE tokenizers (and
    `pre_tokenizers.ByteLevel`) use: bytes that are printable Latin-1 characters
    stand for themselves; the others are moved, in order, to code points from 256.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    keep = set(printable)
    symbols: list[str] = []
    moved = 0
    for b in range(N_BYTES):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(N_BYTES + moved))
            moved += 1
    return symbols


def build_byte_tokenizer(model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """A fresh byte-level tokenizer: ids 0..255 are bytes, then <pad>, <bos>, <eos>.

    Encoding prepends <bos> (add_special_tokens=True, the default); it never appends
    <eos>. Decoding turns byte tokens back into text (invalid UTF-8 becomes U+FFFD).
    """
    symbols = byte_symbols()
    if sorted(symbols) != sorted(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("byte table disagrees with tokenizers' ByteLevel alphabet")
    vocab = {symbol: b for b, symbol in enumerate(symbols)}
    for i, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = N_BYTES + i

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B",
        special_tokens=[(BOS, BOS_ID)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    if (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) != (PAD_ID, BOS_ID, EOS_ID):
        raise RuntimeError("special token ids moved; the byte tokenizer layout is broken")
    return fast


def save_byte_tokenizer(directory: str | os.PathLike[str], model_max_length: int = 4096) -> None:
    """Write tokenizer.json and tokenizer_config.json into `directory`, the chat template
    inline in the config (`tokenizer_files.save_fast_tokenizer`: the layout transformers
    4.x and 5.x both read)."""
    save_fast_tokenizer(build_byte_tokenizer(model_max_length), directory, CHAT_TEMPLATE)
