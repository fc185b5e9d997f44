"""``fleetrl model init``: write a random model of a supported family.

``fleetrl model init --family qwen3 --size tiny --out DIR [--seed N] [--force]`` writes
a directory that transformers, vLLM and fleetrl's torch sampler load: the model
(safetensors), its tokenizer and chat template (`tiny_models`). No hub, no network.

Sizes (`tiny_models.SIZES`): ``tiny`` (about 1.8M parameters over the 259-token byte
tokenizer), ``tiny-151k`` (the tiny shape over the 151,936-token BPE tokenizer, about
10M parameters, nearly all embedding) and ``0.6b`` (qwen3 only: Qwen3-0.6B's shape,
596M parameters, saved in bf16, about 1.2 GB). The BPE tokenizer is trained on the
Python standard library the first time (seconds) and cached
(``${XDG_CACHE_HOME:-~/.cache}/fleetrl/tokenizers``).

`register` is the ``fleetrl.commands`` entry point (docs/reference/models.md);
``python -m fleetrl.actors.model.cli`` runs the group on its own.

Exit codes: 0 written; 2 usage errors (unknown family or size, a size the family does
not have, an existing non-empty ``--out`` without ``--force``) and unwritable output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["cmd_init", "main", "register"]


def _fail(message: str) -> int:
    print(f"fleetrl model init: {message}", file=sys.stderr)
    return 2


def cmd_init(args: argparse.Namespace) -> int:
    """Write the model; returns the exit code."""
    from .errors import ModelError
    from .families import FAMILIES
    from .tiny_models import SIZES, create_tiny_model, parameter_count, tiny_spec

    if args.family not in FAMILIES:
        return _fail(f"unknown family {args.family!r}; supported: {', '.join(FAMILIES)}")
    if args.size not in SIZES:
        return _fail(f"unknown size {args.size!r}; known sizes: {', '.join(SIZES)}")
    try:
        spec = tiny_spec(args.family, args.size)
    except ValueError as exc:  # a size this family does not have
        return _fail(str(exc))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _fail(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        return _fail(f"--out {out} is not empty; pass --force to replace it")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        if spec.vocabulary == "bpe-151936":
            from .bpe_tokenizer import bpe_tokenizer_file

            bpe_tokenizer_file(on_build=lambda: print(
                "fleetrl model init: training the 151,936-token tokenizer on the Python standard library "
                "(once; cached for later calls)", file=sys.stderr, flush=True))
        path = create_tiny_model(out, args.family, spec, seed=args.seed)
    except ModelError as exc:  # the tokenizer's corpus or cache
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot write {out}: {exc.strerror or exc}")
    count = parameter_count(args.family, spec)
    print(f"{path}: {args.size} {args.family} model ({FAMILIES[args.family].architecture}), "
          f"{count:,} parameters, {spec.dtype}, seed {args.seed}")
    return 0


def _add_init(sub: Any) -> None:
    p = sub.add_parser("init", help="write a seeded random model (tiny, or Qwen3-0.6B's shape)",
                       description="Write a seeded random model of a supported family with its tokenizer and "
                                   "chat template (no hub, no network). Sizes: tiny (byte tokenizer, fp32), "
                                   "tiny-151k (the tiny shape over a 151,936-token BPE tokenizer, fp32), "
                                   "0.6b (qwen3 only: Qwen3-0.6B's shape, 596M parameters, bf16, ~1.2 GB). "
                                   "The BPE tokenizer is a stand-in with Qwen3's vocabulary size, not its "
                                   "tokens: trained on the Python standard library the first time and cached "
                                   "under ${XDG_CACHE_HOME:-~/.cache}/fleetrl/tokenizers.")
    p.add_argument("--family", required=True, metavar="F", help="llama, qwen2, qwen3 or mistral")
    p.add_argument("--size", default="tiny", metavar="S",
                   help="tiny (default), tiny-151k, or 0.6b (qwen3 only)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (created)")
    p.add_argument("--seed", type=int, default=0, help="random init seed (default 0)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=cmd_init)


def register(subparsers: Any) -> None:
    """Add the ``model`` command group (the ``fleetrl.commands`` entry point)."""
    p = subparsers.add_parser("model", help="model directories: write random models of each family",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def show(_args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=show)
    _add_init(p.add_subparsers(dest="model_command", metavar="{init}"))


def main(argv: list[str] | None = None) -> int:
    """Run ``fleetrl model ...`` without the installed entry points."""
    from fleetrl.daemon.cli import group_main

    return group_main([register], argv)


if __name__ == "__main__":
    sys.exit(main())
