"""TrainerConfig bounds and malformed-group checks: errors name what is wrong and where."""

from __future__ import annotations

import pytest

from fleetrl.actors.trainer import TrainerConfig
from fleetrl.actors.trainer.batch import BadBatch, check_group
from fleetrl.daemon.config import ConfigError, load_config_text
from fleetrl.grpo import CorrectionConfig


def test_defaults_and_toml_decoding():
    cfg = load_config_text("""
[http]
enabled = false
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
[actors.trainer.config]
model_dir = "/m"
lr = 1e-4
betas = [0.9, 0.95]
corrections = {weighting = "tis"}
advantage = {std_normalize = true}
""").actor("trainer").config
    assert isinstance(cfg, TrainerConfig)
    assert cfg.lr == 1e-4 and cfg.betas == (0.9, 0.95)
    assert cfg.corrections == CorrectionConfig(weighting="tis") and cfg.advantage.std_normalize
    assert cfg.buffer.max_staleness == 2 and cfg.buffer.capacity == 256


@pytest.mark.parametrize("bad, where", [
    ("lr = 0.0", "lr"),
    ("groups_per_step = 0", "groups_per_step"),
    ("corrections = {weighting = \"bogus\"}", "weighting"),
    ("unknown = 1", "unknown"),
])
def test_bad_toml_names_the_field(bad, where):
    with pytest.raises(ConfigError, match=where):
        load_config_text(f"""
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
config = {{model_dir = "/m", {bad}}}
""")


@pytest.mark.parametrize("kw, msg", [
    ({"lr": -1.0}, r"TrainerConfig.lr must be in"),
    ({"betas": (0.9, 1.0)}, r"TrainerConfig.betas\[1\]"),
    ({"grad_clip": 0.0}, r"TrainerConfig.grad_clip"),
    ({"groups_per_step": 8, "buffer_capacity": 4}, r"buffer_capacity \(4\) must be >= groups_per_step \(8\)"),
    ({"model_dir": ""}, r"TrainerConfig.model_dir"),
    ({"checkpoint_every": True}, r"TrainerConfig.checkpoint_every must be an int"),
])
def test_direct_construction_checks_bounds(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TrainerConfig(**{"model_dir": "/m", **kw})


def _seg(groups, **over):
    base = dict(prompt=[1, 2], tokens=[5, 6], logprobs=[-0.1, 0.0],
                support=[[(5, -0.1), (7, -2.3514)], [(6, 0.0)]], versions=[0, 0])
    base.update(over)
    return groups.segment(base["prompt"], base["tokens"], base["logprobs"], base["support"], base["versions"])


def test_check_group_accepts_a_good_group(groups):
    check_group(groups.group_of("ok", [([_seg(groups)], 1.0), ([_seg(groups)], 0.0)]), vocab_size=300)


@pytest.mark.parametrize("over, msg", [
    ({"tokens": [5, 9]}, r"segment 0: generated token 1 \(id 9\) is not in its reported support"),
    ({"prompt": []}, r"segment 0: empty prompt"),
    ({"support": [[(5, -0.1), (7, -0.5)], [(6, 0.0)]]}, r"segment 0: the support of token 0 has probability 1.51"),
    ({"logprobs": [-0.3, 0.0]}, r"segment 0: logprobs\[0\] = -0.3\d* disagrees"),
    ({"tokens": [5, 400], "support": [[(5, -0.1), (7, -2.3514)], [(400, 0.0)]]}, r"segment 0: token_ids\[1\] = 400 is not a token id in \[0, 300\)"),
])
def test_check_group_names_the_bad_segment(groups, over, msg):
    bad = groups.group_of("bad", [([_seg(groups)], 1.0), ([_seg(groups, **over)], 0.0)])
    with pytest.raises(BadBatch, match=r"group 'bad', attempt 'bad-a1', " + msg):
        check_group(bad, vocab_size=300)


def test_check_group_rejects_non_finite_reward(groups):
    bad = groups.group_of("nan", [([_seg(groups)], float("nan")), ([_seg(groups)], 0.0)])
    with pytest.raises(BadBatch, match="reward nan is not finite"):
        check_group(bad, vocab_size=300)
