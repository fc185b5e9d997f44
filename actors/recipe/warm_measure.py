"""Measure a warm model: build (or find) it, then pass@1 before and after the warm-up.

``python -m fleetrl.actors.recipe.warm_measure --cache-dir DIR [--eval N] [--recipe R]``
reproduces the measurements of docs/results/warmup.md: the random initialisation and
the warm model on held-out tasks (both splits of the synthetic family, the fresh split
of the tool-lookup family), and the sampler's speed; progress and a table on stderr,
one JSON line with the figures on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from fleetrl.actors.model import build_tiny_llama, save_tiny_llama
from fleetrl.harness.synthetic import generate_tasks

from .warm_model import DEFAULT_RECIPE, MANIFEST, TOOL_RECIPE, WarmManifest, ensure_warm_model

__all__ = ["main"]


def _measure(model_dir: Path, label: str, n: int, task_seed: int, sample_seed: int) -> dict[str, object]:
    from fleetrl.actors.recipe.evaluate import EvalSampling, evaluate_pass_at_1

    out: dict[str, object] = {}
    for split in ("fresh", "general"):
        result = evaluate_pass_at_1(
            model_dir, split=split, n=n, task_seed=task_seed, sampling=EvalSampling(seed=sample_seed)
        )
        rate = result.pass_at_1
        print(f"{label:>12} {split:>8}: pass@1 {rate}  mean reward {result.mean_reward:.3f}  "
              f"stopped {100 * result.stopped:.0f}%  ({result.sample_seconds:.1f} s sampling, "
              f"{result.score_seconds:.1f} s scoring)", file=sys.stderr)
        out[split] = {
            "pass_at_1": rate.rate, "ci95": [rate.low, rate.high], "successes": rate.successes, "n": rate.n,
            "mean_reward": result.mean_reward, "stopped": result.stopped,
            "sample_s": result.sample_seconds, "score_s": result.score_seconds,
        }
    return out


def _measure_tools(model_dir: Path, label: str, n: int, task_seed: int, sample_seed: int) -> dict[str, object]:
    from fleetrl.actors.recipe.tool_eval import TOOL_SAMPLING, evaluate_tool_pass_at_1

    result = evaluate_tool_pass_at_1(model_dir, n=n, task_seed=task_seed,
                                     sampling=msgspec.structs.replace(TOOL_SAMPLING, seed=sample_seed))
    rate = result.pass_at_1
    print(f"{label:>12}    fresh: pass@1 {rate}  answered {100 * result.stopped:.0f}%  "
          f"({result.sample_seconds:.1f} s sampling)", file=sys.stderr)
    return {"fresh": {"pass_at_1": rate.rate, "ci95": [rate.low, rate.high], "successes": rate.successes, "n": rate.n,
                      "answered": result.stopped, "sample_s": result.sample_seconds}}


def _sampling_speed(model_dir: Path, batch: int, rounds: int, sample_seed: int) -> dict[str, float]:
    """Tokens per second of the torch sampler backend (fp32) on batches of `batch` fresh
    prompts with the RL phase's sampling settings: wall-clock and per CPU-second."""
    from fleetrl.actors.model import EOS_ID, build_byte_tokenizer
    from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
    from fleetrl.daemon.messages import SamplingParams

    tok = build_byte_tokenizer()
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))
    tasks = generate_tasks(batch * rounds, split="fresh", seed=sample_seed + 1000)
    prompts = [tok(t.prompt, add_special_tokens=True)["input_ids"] for t in tasks]
    tokens = 0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for r in range(rounds):
        params = SamplingParams(max_tokens=48, temperature=1.0, top_p=0.95, stop_ids=(EOS_ID,), seed=sample_seed + r)
        tokens += sum(g.num_tokens for g in backend.generate(prompts[r * batch:(r + 1) * batch], params))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    out = {"batch": batch, "tokens": tokens, "wall_s": wall, "cpu_s": cpu,
           "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu}
    print(f"sampling speed (torch fp32, batch {batch}): {tokens / wall:.0f} tokens/s wall, "
          f"{tokens / cpu:.0f} tokens per CPU-second ({tokens} tokens)", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    """Build (or find) the warm model and measure pass@1 before and after warm-up.

    `python -m fleetrl.actors.recipe.warm_measure --cache-dir DIR [--eval N]`: prints
    progress and a table to stderr, then one JSON line with the figures (it reproduces
    the measurements of docs/results/warmup.md).
    """
    parser = argparse.ArgumentParser(prog="python -m fleetrl.actors.recipe.warm_measure", description=main.__doc__)
    parser.add_argument("--cache-dir", required=True, type=Path, help="where warm models are cached")
    parser.add_argument("--eval", type=int, default=200, metavar="N", help="tasks per evaluation set (0: none)")
    parser.add_argument("--eval-seed", type=int, default=1, help="task seed of the evaluation sets")
    parser.add_argument("--sample-seed", type=int, default=0, help="seed of the sampling RNG")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the random-init evaluation")
    parser.add_argument("--speed-batch", type=int, default=32, metavar="B",
                        help="measure sampling speed on batches of B prompts (0: skip)")
    parser.add_argument("--recipe", choices=("default", "tool_lookup"), default="default",
                        help="DEFAULT_RECIPE (synthetic coding) or TOOL_RECIPE (tool lookup: fresh split only)")
    args = parser.parse_args(argv)
    if args.eval < 0:
        parser.error("--eval must be >= 0")
    recipe = TOOL_RECIPE if args.recipe == "tool_lookup" else DEFAULT_RECIPE
    measure = _measure_tools if recipe.tasks == "tool_lookup" else _measure
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    report: dict[str, object] = {"recipe": msgspec.to_builtins(recipe), "torch_threads": torch.get_num_threads()}
    started = time.perf_counter()
    path = ensure_warm_model(args.cache_dir, recipe, log=lambda line: print(line, file=sys.stderr))
    report["ensure_s"] = time.perf_counter() - started
    report["model_dir"] = str(path)
    manifest = msgspec.json.decode((path / MANIFEST).read_bytes(), type=WarmManifest)
    report["warmup_s"] = manifest.warmup_seconds
    report["loss_first"], report["loss_last"] = manifest.losses[0], manifest.losses[-1]
    if args.eval:
        if not args.no_baseline:
            with tempfile.TemporaryDirectory(prefix="fleetrl-init-") as tmp:
                init_dir = save_tiny_llama(build_tiny_llama(recipe.model, seed=recipe.init_seed), Path(tmp) / "init")
                report["random_init"] = measure(init_dir, "random init", args.eval, args.eval_seed, args.sample_seed)
        t0 = time.perf_counter()
        report["warm"] = measure(path, "warm", args.eval, args.eval_seed, args.sample_seed)
        report["warm_eval_s"] = time.perf_counter() - t0
    if args.speed_batch > 0 and recipe.tasks == "synthetic":
        report["sampling_speed"] = _sampling_speed(path, args.speed_batch, 3, args.sample_seed)
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
