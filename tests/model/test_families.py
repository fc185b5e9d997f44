"""The supported-family table and reading a model directory: every family's tiny model
loads through `read_model_config` and as a trainer's fp32 master (transformers'
AutoModelForCausalLM), and a directory of another architecture is refused at load
time with a ModelDirError naming its ``architectures`` entry and the config path."""

from __future__ import annotations

import json

import pytest
import torch

from fleetrl.actors.model import (
    ARCHITECTURES,
    FAMILIES,
    BOS_ID,
    ModelDirError,
    TinyModelSpec,
    create_tiny_model,
    load_master_weights,
    load_model,
    read_llama_config,
    read_model_config,
    read_state_dict,
)

MICRO = TinyModelSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                      max_position_embeddings=64)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: create_tiny_model(root / f, f, MICRO, seed=1) for f in FAMILIES}


def test_table_names_the_four_families():
    assert dict(ARCHITECTURES) == {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                                   "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral"}
    assert all(FAMILIES[name].architecture == arch for arch, name in ARCHITECTURES.items())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_loads_as_fp32_master(family_dirs, family):
    path = family_dirs[family]
    config = read_model_config(path)
    assert config.model_type == family
    assert config.architectures == [FAMILIES[family].architecture]
    master = load_master_weights(path)
    assert type(master).__name__ == FAMILIES[family].architecture
    assert master.training
    assert all(p.dtype == torch.float32 and p.requires_grad for p in master.parameters())
    saved = read_state_dict(path)
    assert all(torch.equal(saved[k], v) for k, v in master.state_dict().items() if k in saved)
    # the master computes gradients for every parameter
    out = master(torch.tensor([[BOS_ID, 5, 6, 7]]), labels=torch.tensor([[BOS_ID, 5, 6, 7]]))
    out.loss.backward()
    assert all(p.grad is not None for p in master.parameters())


def _rewrite(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    for key, value in changes.items():
        if value is None:
            del raw[key]
    (path / "config.json").write_text(json.dumps(raw))


def test_unsupported_architecture_is_refused_at_load_naming_it(family_dirs, tmp_path):
    import shutil

    path = tmp_path / "gpt"
    shutil.copytree(family_dirs["llama"], path)
    _rewrite(path, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    for load in (read_model_config, load_model, load_master_weights):
        with pytest.raises(ModelDirError) as info:
            load(path)
        message = str(info.value)
        assert "'GPTNeoXForCausalLM'" in message and str(path / "config.json") in message
        assert "Qwen3ForCausalLM" in message  # it lists what is supported


def test_inconsistent_or_missing_entries_are_named(family_dirs, tmp_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(family_dirs["qwen2"], path)
    _rewrite(path, model_type="llama")
    with pytest.raises(ModelDirError, match="'Qwen2ForCausalLM' needs model_type 'qwen2'"):
        read_model_config(path)
    _rewrite(path, architectures=["Qwen2ForCausalLM", "LlamaForCausalLM"], model_type="qwen2")
    with pytest.raises(ModelDirError, match="exactly one"):
        read_model_config(path)
    _rewrite(path, architectures=None)  # no entry: model_type decides
    assert read_model_config(path).model_type == "qwen2"
    _rewrite(path, model_type="bert")
    with pytest.raises(ModelDirError, match="no 'architectures' entry and model_type 'bert'"):
        read_model_config(path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelDirError, match="JSON object"):
        read_model_config(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="as JSON"):
        read_model_config(path)
    (path / "config.json").unlink()
    with pytest.raises(ModelDirError, match="no config.json"):
        load_master_weights(path)


def test_read_llama_config_stays_llama_only(family_dirs):
    assert read_llama_config(family_dirs["llama"]).model_type == "llama"
    with pytest.raises(ModelDirError, match="model_type is 'qwen3', expected 'llama'"):
        read_llama_config(family_dirs["qwen3"])
