"""Shared recipes for the recipe tests: small models so the suite stays fast."""

from __future__ import annotations

import pytest

from fleetrl.actors.model import TinyLlamaSpec
from fleetrl.actors.recipe.warm_model import WarmRecipe
from fleetrl.actors.recipe.warmup import WarmupConfig

MICRO_SPEC = TinyLlamaSpec(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64, max_position_embeddings=256
)
"""A model small enough that building and saving it costs well under a second."""


@pytest.fixture
def micro_recipe() -> WarmRecipe:
    return WarmRecipe(model=MICRO_SPEC, init_seed=1, warmup=WarmupConfig(steps=3, batch_size=2, warmup_steps=1))

