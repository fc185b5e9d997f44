"""The trainer's rollout log (`actors/trainer/rollout_log.py`): each trained group's
attempts token by token, with the trainer's log-probs and the masked positions of the
step that trained it, failed attempts indexed, the newest ``keep`` groups kept, numbering
continued after a restart."""

from __future__ import annotations

import msgspec
import pytest

from fleetrl.actors.model import BOS_ID
from fleetrl.actors.trainer.config import TrainerConfig
from fleetrl.actors.trainer.core import Trainer
from fleetrl.actors.trainer.rollout_log import GroupEntry, IndexLine, RolloutLog, group_entry
from fleetrl.actors.trainer.step import RowDetail
from fleetrl.daemon.messages import RolloutFailed
from fleetrl.grpo import CorrectionConfig


def _index(d) -> list[IndexLine]:
    return [msgspec.json.decode(x, type=IndexLine) for x in (d / "index.jsonl").read_bytes().splitlines()]


def _two_calls(groups):
    """A group of two attempts; the first made two calls, the second extending the first
    with a tool's output (ids 10, 11), so only those are new in its prompt."""
    sup = [[(66, -0.1), (70, -2.35)], [(67, -0.2), (71, -1.7)]]
    first = groups.segment([BOS_ID, 65], [66, 67], [-0.1, -0.2], sup, [3, 3])
    second = groups.segment([BOS_ID, 65, 66, 67, 10, 11], [66, 67], [-0.1, -0.2], sup, [4, 4])
    other = groups.segment([BOS_ID, 65], [66, 67], [-0.1, -0.2], sup, [3, 4])
    return groups.group_of("g7", [([first, second], 1.0), ([other], 0.0)], task_id="t7")


def test_a_group_entry_holds_each_call_s_new_prompt_ids_tokens_and_detail(groups):
    g = _two_calls(groups)
    detail = {(0, 1): RowDetail(origin=(0, 0, 1), trainer_logprobs=[-0.5, -0.25], masked=[1])}
    e = group_entry(g, detail, n=4, step=9, version=9, skipped=None, std_normalize=False, leave_one_out=False,
                    now=1.0)
    assert (e.n, e.step, e.group_id, e.task_id) == (4, 9, "g7", "t7")
    a, b = e.attempts
    assert (a.attempt_id, a.reward, a.advantage, b.advantage) == ("g7-a0", 1.0, 0.5, -0.5)
    first, second = a.calls
    assert (first.prompt_shared, first.prompt_ids) == (0, [BOS_ID, 65])
    assert (second.prompt_shared, second.prompt_ids) == (4, [10, 11])  # the tool's output
    assert second.token_ids == [66, 67] and second.versions == [4, 4]
    assert second.trainer_logprobs == [-0.5, -0.25] and second.masked == [1]
    assert first.trainer_logprobs is None and first.masked == []  # no detail: not trained
    assert second.logprobs == pytest.approx([-0.1, -0.2]) and second.sampler.sampler_id == "s0"


def test_the_log_keeps_the_newest_groups_indexes_failures_and_numbers_on(groups, tmp_path):
    log = RolloutLog(tmp_path, keep=3)
    for step in range(5):
        log.groups([groups.versioned(f"g{step}", 0)], None, step=step, version=step, skipped=None)
    log.failed(RolloutFailed(attempt_id="a9", task_id="t9", reason="timeout", detail="slow", group_id="g9"))
    files = sorted(p.name for p in tmp_path.glob("g-*.json"))
    assert files == ["g-2.json", "g-3.json", "g-4.json"]
    lines = _index(tmp_path)
    assert [x.kind for x in lines] == ["group"] * 5 + ["failed"]
    assert lines[-1].reason == "timeout" and lines[-1].group_id == "g9" and lines[-1].attempt_id == "a9"
    assert lines[4].file == "g-4.json" and lines[4].rewards == [0.0, 1.0] and lines[4].tokens == 4
    # the index is cut to its last 2 x keep lines once it reaches 4 x keep
    for step in range(5, 11):
        log.groups([groups.versioned(f"g{step}", 0)], None, step=step, version=step, skipped=None)
    assert len(_index(tmp_path)) <= 12 and _index(tmp_path)[-1].n == 10
    # a restart goes on numbering after the index (a torn last line is skipped)
    with (tmp_path / "index.jsonl").open("ab") as fh:
        fh.write(b'{"kind": "gro')
    again = RolloutLog(tmp_path, keep=3)
    assert again.next_n == 11


def test_trained_steps_log_their_groups_with_the_step_s_masks(model_dir, groups, tmp_path):
    prompts = ([BOS_ID, *b"def f(x):"], [BOS_ID, *b"x ="])
    batch = [groups.sampled(model_dir, f"s{i}", p, [1.0, 0.0, 0.5], seed=3 + i, max_tokens=8)
             for i, p in enumerate(prompts)]
    cfg = TrainerConfig(model_dir=model_dir, groups_per_step=2, lr=1e-2, checkpoint_every=100, rollout_log=50,
                        temperature=1.3, corrections=CorrectionConfig(mask_low=0.8, mask_high=1.25))
    t = Trainer(cfg, tmp_path, "run-1")
    t.start(None)
    m = t.train(batch)
    assert not m.skipped and m.frac_masked_tokens > 0
    t.note_failed(RolloutFailed(attempt_id="x", task_id="task-s0", reason="sandbox", detail="gone", group_id="s0"))
    lines = _index(tmp_path / "rollouts")
    assert [(x.kind, x.group_id, x.step) for x in lines] == [("group", "s0", 1), ("group", "s1", 1),
                                                             ("failed", "s0", -1)]
    entries = [msgspec.json.decode((tmp_path / "rollouts" / x.file).read_bytes(), type=GroupEntry)
               for x in lines[:2]]
    calls = [c for e in entries for a in e.attempts for c in a.calls]
    assert all(c.trainer_logprobs is not None and len(c.trainer_logprobs) == len(c.token_ids) for c in calls)
    masked = sum(len(c.masked) for c in calls)
    assert masked == round(m.frac_masked_tokens * m.tokens) == sum(x.masked for x in lines[:2])
    assert entries[0].version == m.version and entries[0].skipped is None
    # off: no directory
    off = Trainer(TrainerConfig(model_dir=model_dir, groups_per_step=2, rollout_log=0), tmp_path / "off", "r")
    assert off.rollouts is None and not (tmp_path / "off" / "rollouts").exists()
