"""The warm-up has a real effect: lower completion loss on unseen tasks and a
sampled pass@1 clearly above the random init's, on a small model and budget."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from fleetrl.actors.model import TinyLlamaSpec, build_byte_tokenizer, build_tiny_llama, load_tiny_llama, save_tiny_llama
from fleetrl.actors.recipe.evaluate import EvalSampling, evaluate_pass_at_1
from fleetrl.actors.recipe.warm_model import MANIFEST, WarmManifest, WarmRecipe, ensure_warm_model
from fleetrl.actors.recipe.warmup import WarmupConfig, collate, completion_loss, encode_example
from fleetrl.harness.synthetic import generate_tasks

SMALL = WarmRecipe(
    model=TinyLlamaSpec(hidden_size=96, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=288,
                        max_position_embeddings=256),
    init_seed=0,
    warmup=WarmupConfig(steps=150, batch_size=32, lr=5e-3, warmup_steps=5),
)
EVAL_N = 300


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("effect")
    init = save_tiny_llama(build_tiny_llama(SMALL.model, seed=SMALL.init_seed), root / "init")
    warm = ensure_warm_model(root / "cache", SMALL, threads=1)
    return init, warm


def held_out_loss(model_dir: Path) -> float:
    tok = build_byte_tokenizer()
    batch = collate([encode_example(t, tok) for t in generate_tasks(64, split="fresh", seed=11)])
    model = load_tiny_llama(model_dir)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    return completion_loss(logits, batch.labels_BT).item()


def test_warm_up_lowers_the_completion_loss_on_unseen_tasks(dirs: tuple[Path, Path]) -> None:
    init, warm = dirs
    before, after = held_out_loss(init), held_out_loss(warm)
    assert before > 4.0  # about log(259): the random init knows nothing
    assert after < before / 5
    losses = msgspec.json.decode((warm / MANIFEST).read_bytes(), type=WarmManifest).losses
    assert len(losses) == SMALL.warmup.steps
    assert sum(losses[-10:]) / 10 < sum(losses[:5]) / 5 / 5


def test_warm_up_raises_sampled_pass_at_1_clearly_above_zero(dirs: tuple[Path, Path]) -> None:
    init, warm = dirs
    sampling = EvalSampling(temperature=1.0, top_p=0.95, max_tokens=32, seed=0)
    before = evaluate_pass_at_1(init, split="fresh", n=EVAL_N, task_seed=5, sampling=sampling)
    after = evaluate_pass_at_1(warm, split="fresh", n=EVAL_N, task_seed=5, sampling=sampling)
    assert before.pass_at_1.successes == 0 and before.stopped < 0.2
    assert after.stopped > 0.9  # the format (body, then <eos>) is learnt
    # the 95% intervals do not overlap: a real effect, not sampling luck
    assert after.pass_at_1.low > before.pass_at_1.high, (before.pass_at_1, after.pass_at_1)
    assert after.mean_reward > before.mean_reward + 0.1
