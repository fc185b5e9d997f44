"""fleetrl.actors.runs: whole runs of the daemon, compared.

`variants` (the ablation arms as pure config transforms), `tomlw` (writing them back as
TOML), `compare` (the table's numbers), `serve` (one `fleetrl serve` subprocess,
watched), `ablate` (``fleetrl ablate``), `bench_async` (``fleetrl bench async``),
`plots` (comparison PNGs). docs/guides/ablation.md is the guide.
"""

from .compare import ArmResult, grad_norm_std, markdown_table, reward_auc, text_table
from .variants import VARIANTS, Variant, VariantError, apply_variant, variant_names

__all__ = [
    "ArmResult", "VARIANTS", "Variant", "VariantError", "apply_variant", "grad_norm_std",
    "markdown_table", "reward_auc", "text_table", "variant_names",
]
