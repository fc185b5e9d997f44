"""Writing a tokenizer directory that every Hugging Face reader loads alike.

`save_fast_tokenizer` writes ``tokenizer.json`` and ``tokenizer_config.json`` with the
class named `PreTrainedTokenizerFast` and the chat template inline, the layout that both
transformers 4.x (which vLLM releases may pin) and 5.x read; transformers 5 would
otherwise write its own class name and a separate ``chat_template.jinja`` that older
readers ignore. Both the byte tokenizer and the real-size tokenizer are saved this way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["save_fast_tokenizer"]


def save_fast_tokenizer(fast: Any, directory: str | os.PathLike[str], chat_template: str) -> None:
    """Save the transformers fast tokenizer `fast` into `directory` with `chat_template`
    inline in its ``tokenizer_config.json`` (see the module docstring)."""
    out = Path(directory)
    fast.save_pretrained(os.fspath(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
