"""Writing a model directory atomically: weights, config and tokenizer appear together.

Everything is written into a temporary sibling directory that is renamed into place, so
a crash never leaves a half-written model where a reader (or a cache) would find it. An
existing directory is replaced.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["save_model_directory"]


def save_model_directory(model: Any, directory: str | os.PathLike[str],
                         write_tokenizer: Callable[[Path], None]) -> Path:
    """Save `model` (a transformers model: ``save_pretrained``, safetensors) and, through
    ``write_tokenizer(folder)``, its tokenizer into `directory`, atomically (module
    docstring); returns the absolute path."""
    out = Path(directory).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        write_tokenizer(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / "model")
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
