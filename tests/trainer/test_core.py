"""`Trainer` (the actor's blocking core): failed steps lose nothing, versions continue
across restarts of the same state directory, a bad device is named."""

from __future__ import annotations

import pytest
import torch

from fleetrl.actors.model import BOS_ID
from fleetrl.actors.trainer import Trainer, TrainerConfig


class _Boom(RuntimeError):
    pass


class FailingTrainer(Trainer):
    """A trainer whose step fails before the weights change (e.g. an out-of-memory)."""

    def train(self, groups):
        raise _Boom("step failed")


def test_failed_step_puts_the_batch_back(model_dir, groups, tmp_path):
    cfg = TrainerConfig(model_dir=model_dir, groups_per_step=2)
    t = FailingTrainer(cfg, tmp_path, "run-1")
    t.start(None)
    for i in range(3):
        t.buffer.offer(groups.versioned(f"g{i}", 0), t.version)
    with pytest.raises(_Boom):
        t.take_and_train()
    assert t.buffer.queued_ids == ("g0", "g1", "g2") and not t.buffer.was_trained("g0")
    assert t.buffer.counters.trained == 0 and t.step == 0


def test_versions_continue_in_the_same_state_dir(model_dir, groups, tmp_path):
    cfg = TrainerConfig(model_dir=model_dir, groups_per_step=1, lr=1e-2, checkpoint_every=100)
    t = Trainer(cfg, tmp_path, "run-1")
    t.start(None)
    assert t.version == 0
    t.buffer.offer(groups.sampled(model_dir, "a", [BOS_ID, *b"hi"], [1.0, 0.0], seed=3), t.version)
    m, _ = t.take_and_train()
    assert (m.step, m.version, t.version) == (1, 1, 1)
    # a restart from the *initial* state (no checkpoint written: checkpoint_every=100)
    t2 = Trainer(cfg, tmp_path, "run-1")
    t2.start(None)
    assert t2.step == 0 and t2.version == 2  # never reuses version 1 for other weights


def test_bad_device_is_named(model_dir, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")  # the error path needs a machine without it
    with pytest.raises(ValueError, match="TrainerConfig.device is 'cuda' but CUDA is not available"):
        Trainer(TrainerConfig(model_dir=model_dir, device="cuda"), tmp_path, "r")
    with pytest.raises(ValueError, match="TrainerConfig.device 'warp-drive' is not a torch device"):
        Trainer(TrainerConfig(model_dir=model_dir, device="warp-drive"), tmp_path, "r")


def test_record_batches_writes_what_the_first_steps_trained(model_dir, groups, tmp_path):
    import json

    cfg = TrainerConfig(model_dir=model_dir, groups_per_step=1, lr=1e-2, checkpoint_every=100, record_batches=1)
    t = Trainer(cfg, tmp_path, "run-1")
    t.start(None)
    prompt = [BOS_ID, *b"hi"]
    first = groups.sampled(model_dir, "a", prompt, [1.0, 0.0], seed=3)
    for group in (first, groups.sampled(model_dir, "b", prompt, [1.0, 0.0], seed=4)):
        t.buffer.offer(group, t.version)
        t.take_and_train()
    assert sorted(p.name for p in (tmp_path / "batches").iterdir()) == ["step-1.json"]  # the first step only
    record = json.loads((tmp_path / "batches" / "step-1.json").read_text())
    assert record["step"] == 1 and record["rewards"] == [1.0, 0.0]
    for row, traj in zip(record["rows"], first.trajectories, strict=True):
        (seg,) = traj.segments
        assert row["prompt_ids"] == prompt  # the context: never in the loss
        assert row["loss_tokens"] == seg.token_ids.to_numpy().tolist()  # exactly the generated tokens
        assert row["versions"] == [0] * len(row["loss_tokens"])


def test_metrics_lines_count_every_group_received_once(model_dir, groups, tmp_path):
    """groups_received / tokens_received: every group offered since the previous line
    (a zero-variance one too), counted in exactly one line."""
    import json

    cfg = TrainerConfig(model_dir=model_dir, groups_per_step=1, checkpoint_every=100)
    t = Trainer(cfg, tmp_path, "run-1")
    t.start(None)
    prompt = [BOS_ID, *b"hi"]
    a = groups.sampled(model_dir, "a", prompt, [1.0, 0.0], seed=3)
    flat = groups.sampled(model_dir, "flat", prompt, [1.0, 1.0], seed=4)
    b = groups.sampled(model_dir, "b", prompt, [0.0, 1.0], seed=5)
    for g in (a, flat):
        t.note_received(g)
        t.buffer.offer(g, t.version)
    m1, _ = t.take_and_train()
    t.note_received(b)
    t.buffer.offer(b, t.version)
    m2, _ = t.take_and_train()
    tokens = {g.group_id: sum(x.n_generated for x in g.trajectories) for g in (a, flat, b)}
    assert all(n > 0 for n in tokens.values())
    assert (m1.groups, m1.groups_received, m1.tokens_received) == (1, 2, tokens["a"] + tokens["flat"])
    assert (m2.groups, m2.groups_received, m2.tokens_received) == (1, 1, tokens["b"])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["groups_received"] for x in lines] == [2, 1]


def test_a_step_due_for_a_daemon_checkpoint_leaves_the_own_file_to_it(model_dir, groups, tmp_path):
    """checkpoint_every and daemon_checkpoint_every due at one step: the trainer does not
    serialise the same state twice (the actor asks the daemon for its checkpoint, and
    writes the own file only if that one fails); other steps write the own file."""
    from fleetrl.actors.trainer import checkpoint as ck
    from fleetrl.actors.trainer.core import LOCAL_CKPT_KEY

    cfg = TrainerConfig(model_dir=model_dir, groups_per_step=1, checkpoint_every=1, daemon_checkpoint_every=2,
                        max_steps=3)
    t = Trainer(cfg, tmp_path, "run-1")
    t.start(None)

    def own_step() -> int | None:
        local, _ = t.local.load_latest()
        return None if local is None else ck.decode(local.actors[LOCAL_CKPT_KEY]).step

    due, written = [], []
    for i in range(3):
        t.buffer.offer(groups.sampled(model_dir, f"g{i}", [BOS_ID, *b"hi"], [1.0, 0.0], seed=i), t.version)
        m, _ = t.take_and_train()
        assert m.step == i + 1
        due.append(t.daemon_checkpoint_due)
        written.append(own_step())
    # step 2: the daemon's is due (the own file stays at step 1); step 3 ends the budget: no
    # daemon checkpoint is requested at a step that ends the run, so the own file is written
    assert due == [False, True, False] and written == [1, 1, 3]
