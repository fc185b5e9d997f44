"""The tokenizer a remote worker renders prompts with, sent in its welcome.

The daemon sends every regular file of the tokenizer directory except weights (a model
directory often is the tokenizer directory); the worker writes them to a directory of
its own and loads them like any Hugging Face tokenizer directory.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["WEIGHT_SUFFIXES", "read_tokenizer_files", "write_tokenizer_files"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")


def read_tokenizer_files(directory: str | Path, *, max_bytes: int) -> dict[str, bytes]:
    """The files of `directory` (not weights, not subdirectories) by name; ValueError when
    there are none or they add up to more than `max_bytes`."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"tokenizer_dir {str(d)!r} is not a directory")
    files: dict[str, bytes] = {}
    total = 0
    for p in sorted(d.iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name.endswith(WEIGHT_SUFFIXES):
            continue
        total += p.stat().st_size
        if total > max_bytes:
            raise ValueError(f"the tokenizer files in {d} exceed max_tokenizer_mb={max_bytes / 2**20:g} "
                             f"(at {p.name}); raise it or point tokenizer_dir at the tokenizer alone")
        files[p.name] = p.read_bytes()
    if not files:
        raise ValueError(f"tokenizer_dir {str(d)!r} holds no tokenizer files")
    return files


def write_tokenizer_files(files: dict[str, bytes], directory: str | Path) -> Path:
    """Write `files` into `directory` (created; other files there are left alone); a name
    that is not a plain file name is refused."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ValueError(f"tokenizer file name {name!r} is not a plain file name")
        tmp = d / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(d / name)
    return d
