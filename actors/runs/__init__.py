"""fleetrl.actors.runs: whole runs of the daemon, compared.

`variants` (the ablation arms, regimes and seeds as pure config transforms), `tomlw`
(writing them back as TOML), `compare` (one run's numbers), `collapse` (did a run
collapse), `paired` (arms against the reference, paired per seed, with intervals),
`tables` (the markdown), `serve` (one `fleetrl serve` subprocess, watched), `ablate`
(``fleetrl ablate``), `bench_async` (``fleetrl bench async``), `plots` (comparison PNGs
with one band per arm over seeds). docs/guides/ablation.md is the guide.
"""

from .collapse import Collapse, detect_collapse
from .compare import RunStats, grad_norm_max, grad_norm_std, reward_auc, run_stats
from .paired import ArmComparison, compare_arms
from .variants import (REGIMES, VARIANTS, Regime, Variant, VariantError, apply_seed, apply_variant, parse_seeds,
                       regime_names, variant_names)

__all__ = [
    "ArmComparison", "Collapse", "REGIMES", "RunStats", "VARIANTS", "Regime", "Variant", "VariantError",
    "apply_seed", "apply_variant", "compare_arms", "detect_collapse", "grad_norm_max", "grad_norm_std",
    "parse_seeds", "regime_names", "reward_auc", "run_stats", "variant_names",
]
