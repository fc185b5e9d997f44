"""The TRL arm of `bench/peer_trl.py`: TRL's GRPOTrainer on the warm tiny model, its own
generation (transformers ``generate``, no vLLM), rewards from fleetrl's synthetic
checkers run in fleetrl's Docker sandboxes (the same checker, image and limits the
daemon's environment workers use).

Run by `bench/peer_trl.py` as a subprocess (its own process, so that its memory and
time are its own); by hand:

    .venv/bin/python bench/peer_trl_run.py --model-dir DIR --out OUT --steps 60

Writes ``OUT/steps.jsonl`` (one line per optimizer step: wall-clock time, groups and
groups with reward variance, generated tokens, mean reward, seconds spent scoring) and
the trained model to ``OUT/model`` (the format fleetrl's samplers load).

The reward function is called by TRL once per generation batch (``groups`` prompts x
``group_size`` completions, in prompt order); it scores the whole batch in one leased
sandbox with one exec, through a Trio loop in a background thread that keeps a warm
sandbox pool open for the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

LIMITS_MEMORY_MB = 256
"""The daemon's environment workers' sandbox limits (configs/tiny.toml: memory_mb 256, cpus 1.0)."""
LIMITS_CPUS = 1.0


class SandboxScorer:
    """Scores completions of synthetic tasks in a warm sandbox pool owned by a Trio loop
    running in a background thread; `score` is called from TRL's (synchronous) thread."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: Any = None
        self._pool: Any = None
        self._stop: Any = None
        self._thread = threading.Thread(target=self._main, name="sandbox-scorer", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"the sandbox pool did not start: {self._error}") from self._error

    def _main(self) -> None:
        import trio

        async def main() -> None:
            from fleetrl.sandboxes.pool import open_sandbox_pool
            from fleetrl.sandboxes.sweep import Ownership
            from fleetrl.sandboxes.warm import WarmPolicy

            ownership = Ownership.for_state_dir(self.state_dir, owner="peer-trl", run="peer-trl")
            async with open_sandbox_pool(ownership, policy=WarmPolicy(min_warm=1, max_warm=1,
                                                                      max_containers=2)) as pool:
                self._pool = pool
                self._token = trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()

        try:
            import trio

            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self._error = exc
        finally:
            self._ready.set()

    def score(self, tasks: list[Any], completions: list[str]) -> tuple[list[float], float]:
        """(rewards, seconds): every completion checked by its task's checker in one exec."""
        import trio

        from fleetrl.actors.evaluator.scoring import score_in_sandbox
        from fleetrl.sandboxes.limits import Limits

        limits = Limits(memory_bytes=LIMITS_MEMORY_MB * 1024 * 1024, cpus=LIMITS_CPUS)

        async def run() -> tuple[list[float], float]:
            async with self._pool.lease(limits=limits) as sb:
                scores = await score_in_sandbox(sb, tasks, completions, parallel=2)
            return list(scores.rewards), scores.seconds

        return trio.from_thread.run(run, trio_token=self._token)

    def close(self) -> None:
        if self._token is not None and self._stop is not None:
            import trio

            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout=120)


class StepLog:
    """What the reward function saw for the current step; written out at each step's end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending: dict[str, Any] = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def note_batch(self, task_ids: list[str], rewards: list[float], tokens: int, score_s: float) -> None:
        by_task: dict[str, list[float]] = defaultdict(list)
        for tid, r in zip(task_ids, rewards, strict=True):
            by_task[tid].append(r)
        p = self.pending
        p["groups"] = p.get("groups", 0) + len(by_task)
        p["groups_with_variance"] = p.get("groups_with_variance", 0) + sum(
            1 for rs in by_task.values() if max(rs) != min(rs))
        p["completions"] = p.get("completions", 0) + len(rewards)
        p["tokens"] = p.get("tokens", 0) + tokens
        p["reward_sum"] = p.get("reward_sum", 0.0) + sum(rewards)
        p["passed"] = p.get("passed", 0) + sum(1 for r in rewards if r == 1.0)
        p["score_s"] = p.get("score_s", 0.0) + score_s

    def step_end(self, step: int) -> None:
        p, self.pending = self.pending, {}
        n = p.get("completions", 0)
        row = {"step": step, "time": time.time(), "groups": p.get("groups", 0),
               "groups_with_variance": p.get("groups_with_variance", 0), "tokens": p.get("tokens", 0),
               "reward_mean": p.get("reward_sum", 0.0) / n if n else None,
               "pass_rate": p.get("passed", 0) / n if n else None, "score_s": p.get("score_s", 0.0)}
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="the warm model (fleetrl's format: transformers + byte tokenizer)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--groups", type=int, default=8, help="prompts (groups) per optimizer step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine")
    ap.add_argument("--lr-min-ratio", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--task-seed", type=int, default=0, help="the training stream's seed (the daemon's tasks.seed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fleetrl.actors.model.tiny_llama import save_tiny_llama
    from fleetrl.harness.synthetic import generate_tasks

    out: Path = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    n_prompts = args.steps * args.groups
    tasks = generate_tasks(n_prompts, split="train", seed=args.task_seed)
    by_id = {t.id: t for t in tasks}
    data = Dataset.from_list([{"prompt": t.prompt, "task_id": t.id} for t in tasks])
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    log = StepLog(out / "steps.jsonl")
    scorer = SandboxScorer(out / "sandbox-state")

    def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
               task_id: list[str], **_: Any) -> list[float]:
        rewards, score_s = scorer.score([by_id[t] for t in task_id], list(completions))
        log.note_batch(list(task_id), rewards, sum(len(c) for c in completion_ids), score_s)
        return rewards

    class Steps(TrainerCallback):
        def on_step_end(self, _args: Any, state: Any, _control: Any, **_: Any) -> None:
            log.step_end(state.global_step)

    sched: dict[str, Any] = ({"lr_scheduler_type": "cosine_with_min_lr",
                              "lr_scheduler_kwargs": {"min_lr_rate": args.lr_min_ratio}}
                             if args.lr_schedule == "cosine" else {"lr_scheduler_type": "constant"})
    batch = args.groups * args.group_size
    config = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, fp16=False, seed=args.seed, report_to="none",
        max_steps=args.steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=args.group_size, steps_per_generation=1, num_iterations=1, shuffle_dataset=False,
        learning_rate=args.lr, warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        weight_decay=0.0, max_grad_norm=args.grad_clip, **sched,
        max_completion_length=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=0,
        beta=0.0, scale_rewards="none", loss_type="dapo", logging_steps=1, save_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[Steps()])
    try:
        ready = time.time()
        trainer.train()
        done = time.time()
    finally:
        scorer.close()
    save_tiny_llama(trainer.model, out / "model")
    (out / "run.json").write_text(json.dumps({
        "started": started, "ready": ready, "train_end": done, "saved": time.time(),
        "trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
        "torch": torch.__version__, "threads": args.threads}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
