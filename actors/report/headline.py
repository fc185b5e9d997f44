"""The run's headline in a few lines, for the terminal at the end of a run (pure).

    run: 400 steps (3 skipped), 3,200 groups; 19m58 of training
    held-out pass@1 fresh: 32.2% [28.1-36.6] at v0 -> 41.5% [37.2-45.9] at v400
    training reward: 0.412 -> 0.553 (mean of 5 steps); $0.0000075 per rollout
"""

from __future__ import annotations

from .summary import REWARD_WINDOW, SPLITS, Summary

__all__ = ["headline"]


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{(s % 3600) // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}"


def _pass(row: object) -> str:
    return (f"{100 * row.pass_at_1:.1f}% [{100 * row.ci_low:.1f}-{100 * row.ci_high:.1f}] "  # type: ignore[attr-defined]
            f"at v{row.version}")  # type: ignore[attr-defined]


def headline(summary: Summary) -> list[str]:
    """The summary's headline figures (see the module docstring)."""
    run = f"run: {summary.steps} steps"
    if summary.skipped_steps:
        run += f" ({summary.skipped_steps} skipped)"
    run += f", {summary.groups:,} groups"
    if summary.training_s is not None:
        run += f"; {_clock(summary.training_s)} of training"
    lines = [run]
    for split in SPLITS:
        start, end = summary.heldout_start.get(split), summary.heldout_end.get(split)
        if start is None or end is None:
            continue
        if start.version == end.version:
            lines.append(f"held-out pass@1 {split}: {_pass(end)}")
        else:
            lines.append(f"held-out pass@1 {split}: {_pass(start)} -> {_pass(end)}")
    if summary.reward_start is not None and summary.reward_end is not None:
        line = (f"training reward: {summary.reward_start:.3f} -> {summary.reward_end:.3f} "
                f"(mean of {REWARD_WINDOW} steps)")
        if summary.usd_per_rollout is not None:
            line += f"; ${summary.usd_per_rollout:.2g} per rollout"
        lines.append(line)
    return lines
