"""The rollout log: the last trained groups, token by token, for the rollout browser.

``<trainer state>/rollouts/`` holds one file per trained group, ``g-<n>.json``
(`GroupEntry`: each attempt's reward and advantage, and per model call the prompt ids it
added to the conversation, the generated ids with the sampler's log q^S, the trainer's
replayed log p^S and the positions the corrections masked, the weight versions, the
sampler), and ``index.jsonl``, one `IndexLine` per group written or failed attempt
received. Only the newest ``keep`` group files are kept; the index is rewritten to its
last ``2 * keep`` lines when it reaches ``4 * keep``. A group's number ``n`` goes on from
the index after a restart (a step replayed after a crash logs its groups again under new
numbers; the browser shows the newest).

`group_entry` and `failure_line` are pure; `RolloutLog` does the file I/O (in the
trainer's step thread, after the step: a few JSON files per step). The dashboard reads
the directory (`fleetrl.actors.dashboard.rollouts`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from fleetrl.daemon.messages import RolloutFailed, RolloutGroup, SamplerIdentity, SamplingRecord
from fleetrl.grpo import group_advantages

from .step import RowDetail

__all__ = ["AttemptEntry", "CallEntry", "GroupEntry", "IndexLine", "RolloutLog", "failure_line", "group_entry"]

INDEX = "index.jsonl"


class CallEntry(msgspec.Struct, frozen=True, kw_only=True):
    prompt_shared: int
    """Leading prompt ids equal to the conversation so far (the attempt's previous call's
    prompt and generated ids; 0 for its first call): ``prompt_ids`` holds the rest (the
    task's prompt, then tool output and user turns; everything after a retokenisation break)."""
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """The sampler's log q^S of each generated token."""
    trainer_logprobs: list[float] | None
    """The trainer's replayed log p^S of each (None: the step ran no forward)."""
    masked: list[int]
    """Positions in ``token_ids`` that the corrections masked out of the loss."""
    versions: list[int]
    sampler: SamplerIdentity
    finish_reason: str
    cost_usd: float
    sampling: SamplingRecord | None = None
    """What the call was sampled with (temperature, top_p, top_k, seed); None: not recorded."""


class AttemptEntry(msgspec.Struct, frozen=True, kw_only=True):
    attempt_id: str
    reward: float
    advantage: float
    metrics: dict[str, float]
    calls: list[CallEntry]


class GroupEntry(msgspec.Struct, frozen=True, kw_only=True):
    n: int
    step: int
    """The optimizer step that trained it (a skipped step: the steps taken before it)."""
    version: int
    """The weight version the step produced (skipped: the version it was trained against)."""
    skipped: str | None
    """Why its step took no optimizer step (None: it did)."""
    time: float
    group_id: str
    task_id: str
    attempts: list[AttemptEntry]


class IndexLine(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    kind: str
    """"group" (a trained group: ``file``) or "failed" (an attempt that produced no trajectory)."""
    n: int = -1
    time: float
    group_id: str
    task_id: str
    step: int = -1
    rewards: list[float] = []
    tokens: int = 0
    masked: int = 0
    samplers: list[str] = []
    file: str = ""
    attempt_id: str = ""
    reason: str = ""
    detail: str = ""


def _shared(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def group_entry(group: RolloutGroup, details: dict[tuple[int, int], RowDetail], *, n: int, step: int,
                version: int, skipped: str | None, std_normalize: bool, leave_one_out: bool,
                now: float) -> GroupEntry:
    """The log entry of ``group``; ``details`` by (trajectory, segment) index (missing:
    no trainer log-probs, nothing masked)."""
    import torch

    adv = group_advantages(torch.tensor(group.rewards, dtype=torch.float64), std_normalize=std_normalize,
                           leave_one_out=leave_one_out).tolist()
    attempts = []
    for ti, (traj, a) in enumerate(zip(group.trajectories, adv)):
        calls, so_far = [], []
        for si, seg in enumerate(traj.segments):
            prompt = [int(x) for x in seg.prompt_ids.to_numpy()]
            tokens = [int(x) for x in seg.token_ids.to_numpy()]
            k = _shared(prompt, so_far)
            d = details.get((ti, si))
            calls.append(CallEntry(
                prompt_shared=k, prompt_ids=prompt[k:], token_ids=tokens,
                logprobs=[float(x) for x in seg.logprobs.to_numpy()],
                trainer_logprobs=None if d is None else d.trainer_logprobs,
                masked=[] if d is None else d.masked, versions=[int(x) for x in seg.versions.to_numpy()],
                sampler=seg.sampler, finish_reason=str(seg.finish_reason), cost_usd=float(seg.cost_usd),
                sampling=seg.sampling))
            so_far = prompt + tokens
        attempts.append(AttemptEntry(attempt_id=traj.attempt_id, reward=float(traj.reward), advantage=float(a),
                                     metrics=dict(traj.metrics), calls=calls))
    return GroupEntry(n=n, step=step, version=version, skipped=skipped, time=now, group_id=group.group_id,
                      task_id=group.task_id, attempts=attempts)


def index_line(entry: GroupEntry, file: str) -> IndexLine:
    calls = [c for a in entry.attempts for c in a.calls]
    return IndexLine(kind="group", n=entry.n, time=entry.time, group_id=entry.group_id, task_id=entry.task_id,
                     step=entry.step, rewards=[a.reward for a in entry.attempts],
                     tokens=sum(len(c.token_ids) for c in calls), masked=sum(len(c.masked) for c in calls),
                     samplers=sorted({c.sampler.sampler_id for c in calls}), file=file)


def failure_line(msg: RolloutFailed, now: float) -> IndexLine:
    return IndexLine(kind="failed", time=now, group_id=msg.group_id, task_id=msg.task_id,
                     attempt_id=msg.attempt_id, reason=str(msg.reason), detail=msg.detail[:2000])


class RolloutLog:
    """The rollout log's files (module docstring); ``keep`` > 0 group files."""

    def __init__(self, directory: Path, *, keep: int, std_normalize: bool = False,
                 leave_one_out: bool = False) -> None:
        self.dir = Path(directory)
        self.keep = keep
        self.adv = dict(std_normalize=std_normalize, leave_one_out=leave_one_out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lines = 0
        self._lock = threading.Lock()  # the step's thread logs groups, the actor's failures
        self.next_n = 0
        index = self.dir / INDEX
        if index.exists():
            for raw in index.read_bytes().splitlines():
                self._lines += 1
                try:
                    line = msgspec.json.decode(raw, type=IndexLine)
                except msgspec.DecodeError:
                    continue  # a half-written last line of a crash
                self.next_n = max(self.next_n, line.n + 1)

    def groups(self, groups: Sequence[RolloutGroup], detail: Sequence[RowDetail] | None, *, step: int,
               version: int, skipped: str | None) -> None:
        """Log the groups of one step; ``detail``: the step's rows (`Batch.row_origin`
        indexes ``groups``)."""
        by_group: dict[int, dict[tuple[int, int], RowDetail]] = {}
        for d in detail or ():
            gi, ti, si = d.origin
            by_group.setdefault(gi, {})[(ti, si)] = d
        now = time.time()
        lines = []
        for gi, group in enumerate(groups):
            entry = group_entry(group, by_group.get(gi, {}), n=self.next_n, step=step, version=version,
                                skipped=skipped, now=now, **self.adv)
            name = f"g-{entry.n}.json"
            tmp = self.dir / (name + ".tmp")
            tmp.write_bytes(msgspec.json.encode(entry))
            os.replace(tmp, self.dir / name)
            lines.append(index_line(entry, name))
            stale = self.dir / f"g-{entry.n - self.keep}.json"
            if entry.n >= self.keep:
                stale.unlink(missing_ok=True)
            self.next_n += 1
        self._append(lines)

    def failed(self, msg: RolloutFailed) -> None:
        self._append([failure_line(msg, time.time())])

    def _append(self, lines: Sequence[IndexLine]) -> None:
        if not lines:
            return
        with self._lock:
            self._append_locked(lines)

    def _append_locked(self, lines: Sequence[IndexLine]) -> None:
        index = self.dir / INDEX
        with index.open("ab") as fh:
            fh.write(b"".join(msgspec.json.encode(x) + b"\n" for x in lines))
        self._lines += len(lines)
        if self._lines >= 4 * self.keep:
            kept = index.read_bytes().splitlines()[-2 * self.keep:]
            tmp = self.dir / (INDEX + ".tmp")
            tmp.write_bytes(b"".join(x + b"\n" for x in kept))
            os.replace(tmp, index)
            self._lines = len(kept)
