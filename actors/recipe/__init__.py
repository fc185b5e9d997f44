"""fleetrl.actors.recipe: the embedded default's warm start.

`ensure_warm_model(cache_dir, recipe)` gives the directory of the tiny Llama after a
short supervised warm-up on the synthetic task format, cached by recipe (built once,
atomically). `evaluate_pass_at_1` measures a model's sampled pass@1 on the fresh and
generalisation sets with a Wilson interval (`pass_rate_with_ci`). docs/reference/warmup.md
describes the recipe and its measured effect.
"""

from fleetrl.actors.recipe.evaluate import (
    EvalResult,
    EvalSampling,
    PassRate,
    evaluate_pass_at_1,
    pass_rate_with_ci,
    sample_completions,
    score_completions,
)
from fleetrl.actors.recipe.warm_model import (
    DEFAULT_RECIPE,
    TOOL_RECIPE,
    WarmManifest,
    WarmRecipe,
    check_warm_dir,
    ensure_warm_model,
    recipe_key,
    task_family_digest,
    weights_digest,
)
from fleetrl.actors.recipe.warmup import (
    WarmupConfig,
    WarmupResult,
    collate,
    completion_loss,
    encode_example,
    lr_at,
    run_warmup,
    warmup_loss,
)

__all__ = [
    "DEFAULT_RECIPE",
    "EvalResult",
    "TOOL_RECIPE",
    "EvalSampling",
    "PassRate",
    "WarmManifest",
    "WarmRecipe",
    "WarmupConfig",
    "WarmupResult",
    "check_warm_dir",
    "collate",
    "completion_loss",
    "encode_example",
    "ensure_warm_model",
    "evaluate_pass_at_1",
    "lr_at",
    "pass_rate_with_ci",
    "recipe_key",
    "run_warmup",
    "sample_completions",
    "score_completions",
    "task_family_digest",
    "warmup_loss",
    "weights_digest",
]
