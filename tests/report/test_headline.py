"""The run's headline printed at the end of a run (actors/report/headline.py, pure), from
the summary.json the report writes (it decodes back into a `Summary`)."""

from __future__ import annotations

import msgspec

from fleetrl.actors.evaluator.records import EvalRecord
from fleetrl.actors.report.headline import headline
from fleetrl.actors.report.summary import Summary


def _eval(version: int, split: str, p: float, lo: float, hi: float) -> EvalRecord:
    return EvalRecord(version=version, step=version, split=split, n=400, passed=int(400 * p), pass_at_1=p,
                      ci_low=lo, ci_high=hi, mean_reward=p, time=0.0)


SUMMARY = Summary(steps=400, skipped_steps=3, groups=3200, trajectories=25600, reward_start=0.4121,
                  reward_end=0.5533,
                  heldout_start={"fresh": _eval(0, "fresh", 0.322, 0.281, 0.366)},
                  heldout_end={"fresh": _eval(400, "fresh", 0.415, 0.372, 0.459)},
                  wall_clock_s=1300.0, trainer_busy_s=900.0, training_s=1198.0, usd_per_rollout=7.5e-06)


def test_the_headline_says_steps_pass_at_1_with_intervals_reward_and_cost():
    assert headline(SUMMARY) == [
        "run: 400 steps (3 skipped), 3,200 groups; 19m58 of training",
        "held-out pass@1 fresh: 32.2% [28.1-36.6] at v0 -> 41.5% [37.2-45.9] at v400",
        "training reward: 0.412 -> 0.553 (mean of 5 steps); $7.5e-06 per rollout",
    ]


def test_the_summary_file_decodes_back_and_a_single_evaluation_is_said_once():
    back = msgspec.json.decode(msgspec.json.encode(SUMMARY), type=Summary)
    assert headline(back) == headline(SUMMARY)
    one = msgspec.structs.replace(SUMMARY, heldout_start=SUMMARY.heldout_end, reward_start=None, training_s=None,
                                  skipped_steps=0)
    assert headline(one) == ["run: 400 steps, 3,200 groups", "held-out pass@1 fresh: 41.5% [37.2-45.9] at v400"]
