"""The tool evaluation's rollouts (`fleetrl.actors.recipe.tool_eval`): one multi-turn
rollout per task through the example harness's loop, each counting the tool calls it
made (the evaluator records them per task: the tool-use rate) beside its reward."""

from __future__ import annotations

import numpy as np

from fleetrl.actors.model.byte_tokenizer import EOS_ID, build_byte_tokenizer
from fleetrl.actors.recipe.tool_eval import sample_tool_rollouts
from fleetrl.harness.synthetic_tools import generate_tool_tasks

from .test_tool_warmup import HERMES


class _Ids:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def to_numpy(self) -> np.ndarray:
        return np.asarray(self.ids)


class _Gen:
    def __init__(self, ids: list[int]) -> None:
        self.token_ids = _Ids(ids)


class _ScriptedBackend:
    """Answers as a policy would: a task whose path is in ``lookups`` calls read_file
    (twice when in ``twice``), then answers what the tool returned; any other guesses."""

    def __init__(self, tok, tasks, lookups: set[str], twice: set[str]) -> None:
        self.tok, self.tasks, self.lookups, self.twice = tok, tasks, lookups, twice
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        out = []
        for ids in prompts:
            text = self.tok.decode(ids, skip_special_tokens=False)
            path = next(t.metadata["path"] for t in self.tasks if t.metadata["path"] in text)
            results = text.count("<|tool|>")
            if path in self.lookups and results < (2 if path in self.twice else 1):
                reply = f'<tool_call>{{"name": "read_file", "arguments": {{"path": "{path}"}}}}</tool_call>'
            elif results:
                reply = text.rsplit("<|tool|>\n", 1)[1].split("<eos>", 1)[0]  # what the tool returned
            else:
                reply = "z"
            out.append(_Gen(self.tok.encode(reply, add_special_tokens=False) + [EOS_ID]))
        return out


def test_rollouts_count_each_tasks_tool_calls_beside_its_reward():
    tok = build_byte_tokenizer()
    tok.chat_template = HERMES
    by_path = {}  # tasks with distinct files (the scripted policy tells them apart by path)
    for t in generate_tool_tasks(100, split="fresh", seed=1):
        by_path.setdefault(t.metadata["path"], t)
    tasks = list(by_path.values())[:6]
    paths = [t.metadata["path"] for t in tasks]
    assert len(paths) == 6
    backend = _ScriptedBackend(tok, tasks, lookups=set(paths[:3]), twice={paths[1]})
    rollouts = sample_tool_rollouts(backend, tasks, tok)
    assert [r.tool_calls for r in rollouts] == [1, 2, 1, 0, 0, 0]
    # a lookup reads the code back and passes; a guess passes only when it is the code
    for task, r in zip(tasks, rollouts, strict=True):
        looked = r.tool_calls > 0
        assert r.answer == (task.metadata["code"] if looked else "z")
        assert r.reward == (1.0 if r.answer == task.metadata["code"] else 0.0)
        assert len(r.texts) == r.tool_calls + 1 and r.parse_failures == 0
