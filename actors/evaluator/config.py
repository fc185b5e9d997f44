"""EvaluatorConfig: the held-out evaluator's settings (``[actors.NAME.config]``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = ["EvalSandboxSettings", "EvaluatorConfig"]

PosInt = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]


class EvalSandboxSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The one sandbox each scoring run leases."""

    memory_mb: Annotated[int, msgspec.Meta(ge=64)] = 1024
    cpus: PosFloat = 1.0
    timeout_s: PosFloat = 600.0
    """Wall clock of one scoring run (all tasks of one split)."""
    parallel: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    """Checkers the driver runs at once inside the sandbox."""


class EvaluatorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Held-out pass@1 of the trainer's versions (docs/guides/tiny-run.md)."""

    model_dir: str
    """The model directory the trainer started from (architecture and tokenizer)."""
    weights_dir: str
    """The trainer's delta store (``<state>/actors/trainer/weights``), followed like a sampler."""
    tasks: Literal["synthetic", "tool_lookup"] = "synthetic"
    """The task family evaluated: the synthetic coding tasks (completions scored in a
    sandbox), or the tool-lookup family (multi-turn rollouts with the example harness's
    loop in process, `fleetrl.actors.recipe.tool_eval`; split ``fresh`` only, and give
    ``max_tokens`` room for a tool call, e.g. 96)."""
    n: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 200
    """Tasks per evaluation set."""
    splits: tuple[Literal["fresh", "general"], ...] = ("fresh", "general")
    task_seed: Annotated[int, msgspec.Meta(ge=0)] = 1
    """Seed of the fixed sets: ``generate_tasks(n, split=..., seed=task_seed)``."""
    every_versions: Annotated[int, msgspec.Meta(ge=1)] = 10
    """Evaluate when the trainer's newest version is this many past the last evaluated one."""
    temperature: Annotated[float, msgspec.Meta(gt=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.95
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 48
    sampling_seed: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The same sampling seed at every evaluation: versions differ only by their weights."""
    batch_size: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 100
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    trainer: str = "trainer"
    """The trainer actor, whose ``metrics.jsonl`` maps a version to its step."""
    final_on_drain: bool = True
    """When the daemon drains: evaluate the newest version (if not yet evaluated)."""
    report_dir: str | None = None
    """After the final evaluation, write the run's report here (HTML + PNG plots)."""
    progress: bool = False
    """Print each evaluation's pass@1 on stderr (through tqdm, under the trainer's bar)."""
    sandbox: EvalSandboxSettings = EvalSandboxSettings()

    def __post_init__(self) -> None:
        for name in ("model_dir", "weights_dir", "trainer"):
            if not getattr(self, name):
                raise ValueError(f"EvaluatorConfig.{name} must not be empty")
        if not self.splits:
            raise ValueError("EvaluatorConfig.splits must name at least one of 'fresh', 'general'")
        if len(set(self.splits)) != len(self.splits):
            raise ValueError(f"EvaluatorConfig.splits has duplicates: {list(self.splits)}")
        if self.tasks == "tool_lookup" and self.splits != ("fresh",):
            raise ValueError('EvaluatorConfig.splits must be ["fresh"] with tasks = "tool_lookup" (it has no '
                             "general split)")
        if self.report_dir == "":
            raise ValueError("EvaluatorConfig.report_dir must be a path or absent")
