"""The rollout browser's data: the trainer's rollout log (`fleetrl.actors.trainer.rollout_log`)
listed, filtered and laid out for the page.

`list_groups` (pure) merges the index's trained groups and failed attempts by group id,
newest first, filtered by task (substring), mean reward range and failure kind.
`group_view` (pure apart from the tokenizer) lays one group out: per attempt its reward
and advantage, per model call the text it added to the conversation (the task's prompt
for the first call, tool output and user turns after), each generated token as
``[text, log q^S, log p^S or None, masked, version]``, the answer's text and the tool
calls parsed from it, the sampler, versions and finish reason. `Texts` decodes token ids
with the model's tokenizer (``tokenizer_dir``; without one, ids show as ``<id>``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from fleetrl.actors.trainer.rollout_log import INDEX, GroupEntry, IndexLine
from fleetrl.harness.tool_calls import parse_tool_calls

__all__ = ["RolloutSource", "Texts", "group_view", "list_groups", "load_group", "read_index"]


def read_index(directory: Path) -> list[IndexLine]:
    """The index's lines (a torn or foreign line is passed over); [] when there is none."""
    try:
        raw = (Path(directory) / INDEX).read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in raw.splitlines():
        try:
            out.append(msgspec.json.decode(line, type=IndexLine))
        except msgspec.DecodeError:
            continue
    return out


def load_group(directory: Path, n: int) -> GroupEntry | None:
    """Group ``n``'s entry, or None when the log no longer keeps it."""
    try:
        return msgspec.json.decode((Path(directory) / f"g-{n}.json").read_bytes(), type=GroupEntry)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def list_groups(lines: Sequence[IndexLine], *, task: str = "", reward_min: float | None = None,
                reward_max: float | None = None, failure: str = "", limit: int = 200) -> dict[str, Any]:
    """Groups newest first (see the module docstring), at most ``limit``; also every
    failure kind seen (for the filter's choices) and how many groups matched.

    ``failure``: "" any group; "any" groups with a failed attempt; otherwise that kind.
    A group whose attempts all failed (or that was never trained) has ``n`` None."""
    groups: dict[str, dict[str, Any]] = {}
    kinds: set[str] = set()
    for x in lines:
        g = groups.setdefault(x.group_id, {"group_id": x.group_id, "task_id": x.task_id, "n": None, "step": None,
                                           "rewards": [], "mean_reward": None, "tokens": 0, "masked": 0,
                                           "samplers": [], "failures": [], "time": x.time})
        g["time"] = max(g["time"], x.time)
        if x.kind == "group":
            g.update(n=x.n, step=x.step, rewards=x.rewards, tokens=x.tokens, masked=x.masked, samplers=x.samplers,
                     mean_reward=sum(x.rewards) / len(x.rewards) if x.rewards else None)
        elif x.kind == "failed":
            kinds.add(x.reason)
            g["failures"].append({"attempt_id": x.attempt_id, "reason": x.reason, "detail": x.detail})
    picked = []
    for g in sorted(groups.values(), key=lambda g: g["time"], reverse=True):
        if task and task not in g["task_id"]:
            continue
        mean = g["mean_reward"]
        if (reward_min is not None or reward_max is not None) and mean is None:
            continue
        if reward_min is not None and mean < reward_min or reward_max is not None and mean > reward_max:
            continue
        reasons = {f["reason"] for f in g["failures"]}
        if failure == "any" and not reasons or failure not in ("", "any") and failure not in reasons:
            continue
        picked.append(g)
    return {"groups": picked[:limit], "matched": len(picked), "failure_kinds": sorted(kinds)}


class Texts:
    """Token ids to text with a Hugging Face tokenizer (None: ``<id>``); pieces cached."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tok = tokenizer
        self._pieces: dict[int, str] = {}

    @classmethod
    def load(cls, directory: str | None) -> Texts:
        if directory is None:
            return cls(None)
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(directory))

    def piece(self, i: int) -> str:
        if self.tok is None:
            return f"<{i}>"
        got = self._pieces.get(i)
        if got is None:
            got = self._pieces[i] = self.tok.decode([i], skip_special_tokens=False)
        return got

    def text(self, ids: Sequence[int]) -> str:
        if self.tok is None:
            return "".join(f"<{i}>" for i in ids)
        return self.tok.decode(list(ids), skip_special_tokens=False)


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 4)


def group_view(entry: GroupEntry, texts: Texts, failures: Sequence[IndexLine] = ()) -> dict[str, Any]:
    """``entry`` laid out for the page (module docstring); ``failures``: the index's
    failed attempts of its group."""
    attempts = []
    for a in entry.attempts:
        calls = []
        for k, c in enumerate(a.calls):
            masked = set(c.masked)
            p = c.trainer_logprobs
            tokens = [[texts.piece(t), _finite(c.logprobs[i]), None if p is None else _finite(p[i]),
                       int(i in masked), c.versions[i] if i < len(c.versions) else None]
                      for i, t in enumerate(c.token_ids)]
            text = texts.text(c.token_ids)
            parsed = parse_tool_calls(text, make_id=lambda: "")
            calls.append({
                "context": texts.text(c.prompt_ids), "context_kind": "prompt" if k == 0 else "added",
                "shared": c.prompt_shared, "tokens": tokens, "text": text,
                "tool_calls": [{"name": t.name, "arguments": t.arguments} for t in parsed.tool_calls],
                "tool_call_error": parsed.failed,
                "sampler": f"{c.sampler.sampler_id} ({c.sampler.backend}/{c.sampler.dtype})",
                "versions": [min(c.versions), max(c.versions)] if c.versions else [],
                "finish_reason": c.finish_reason, "cost_usd": c.cost_usd, "masked": len(masked),
                "trained": p is not None})
        attempts.append({"attempt_id": a.attempt_id, "reward": a.reward, "advantage": round(a.advantage, 4),
                         "metrics": a.metrics, "calls": calls})
    return {"n": entry.n, "step": entry.step, "version": entry.version, "skipped": entry.skipped,
            "group_id": entry.group_id, "task_id": entry.task_id, "time": entry.time, "attempts": attempts,
            "failures": [{"attempt_id": f.attempt_id, "reason": f.reason, "detail": f.detail} for f in failures
                         if f.kind == "failed" and f.group_id == entry.group_id]}


class RolloutSource:
    """The rollout log of one run as the routes read it (blocking: call from a thread);
    the tokenizer is loaded at the first group shown."""

    def __init__(self, directory: Path, tokenizer_dir: str | None) -> None:
        self.dir = Path(directory)
        self.tokenizer_dir = tokenizer_dir
        self._texts: Texts | None = None

    def listing(self, **filters: Any) -> dict[str, Any]:
        return list_groups(read_index(self.dir), **filters)

    def group(self, n: int) -> dict[str, Any] | None:
        entry = load_group(self.dir, n)
        if entry is None:
            return None
        if self._texts is None:
            self._texts = Texts.load(self.tokenizer_dir)
        failures = [x for x in read_index(self.dir) if x.kind == "failed" and x.group_id == entry.group_id]
        return group_view(entry, self._texts, failures)
