"""Sampled pass@1 on the tool-lookup family, with the example harness's loop in process.

One rollout per task, as examples/harnesses/tool_agent.py runs it through the endpoint:
the conversation (the request) is rendered with the model's chat template and the
family's tools, one completion is sampled (stopped at EOS), its text is parsed by the
template's tool-call parser (`fleetrl.harness.tool_calls.parse_tool_calls`, as the
endpoint parses it); tool calls are answered by `synthetic_tools.run_tool` on the task's
own files (the text the harness's ``read_file`` returns in the sandbox) and the next call
sees the assistant message and the tool messages; the first answer without a tool call
(or whose tool call did not parse: the endpoint returns it as plain content) is the
final answer, scored as the task's evaluator scores ``answer.txt`` (exact match of the
stripped answer). ``max_turns`` calls without an answer score 0.

Differences from the live path, on purpose: every call's prompt is rendered from the
messages (the endpoint reuses the exact ids of earlier answers when the template's text
extends them, the same ids whenever the answer re-renders identically); tools read
only the task's files, not the sandbox's whole file system; nothing runs in a sandbox
(the only tool reads a file and scoring compares strings). Calls of all tasks at the
same turn are decoded as one batch, with a fixed seed per (turn, chunk), so two versions
are compared on the same tasks and seeds.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from transformers import PreTrainedTokenizerFast

from fleetrl.actors.model.byte_tokenizer import EOS_ID
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.daemon.messages import SamplingParams
from fleetrl.harness.synthetic_tools import (
    MAX_TURNS,
    TOOLS,
    ToolSplit,
    answer_reward,
    generate_tool_tasks,
    run_tool,
)
from fleetrl.harness.tasks import Task

from .evaluate import EvalResult, EvalSampling, pass_rate_with_ci
from .tool_warmup import render_conversation

__all__ = ["TOOL_SAMPLING", "ToolRollout", "evaluate_tool_pass_at_1", "sample_tool_rollouts"]

TOOL_SAMPLING = EvalSampling(max_tokens=96)
"""The RL phase's settings with room for a tool call (about 80 tokens)."""


class ToolRollout(msgspec.Struct, frozen=True, kw_only=True):
    """One task's rollout: the final answer (None: no answer within the turn limit),
    each call's generated text, how many tool calls did not parse, how many were made
    (parsed and run), the reward."""

    answer: str | None
    texts: tuple[str, ...]
    parse_failures: int
    reward: float
    tool_calls: int = 0


def sample_tool_rollouts(backend: TorchBackend, tasks: Sequence[Task], tokenizer: PreTrainedTokenizerFast,
                         sampling: EvalSampling = TOOL_SAMPLING, *, max_turns: int = MAX_TURNS) -> list[ToolRollout]:
    """One rollout per task (module docstring)."""
    from fleetrl.harness.tool_calls import parse_tool_calls  # the template's tool-call format

    ids = itertools.count()
    messages: list[list[dict[str, Any]]] = [[{"role": "user", "content": t.prompt}] for t in tasks]
    texts: list[list[str]] = [[] for _ in tasks]
    answers: list[str | None] = [None] * len(tasks)
    failures = [0] * len(tasks)
    calls = [0] * len(tasks)
    active = list(range(len(tasks)))
    for turn in range(max_turns):
        if not active:
            break
        prompts = [tokenizer.encode(render_conversation(tokenizer, messages[i], TOOLS, add_generation_prompt=True),
                                    add_special_tokens=False) for i in active]
        generated: list[list[int]] = []
        for chunk, start in enumerate(range(0, len(active), sampling.batch_size)):
            params = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                    top_p=sampling.top_p, stop_ids=(EOS_ID,),
                                    seed=sampling.seed + 10_000 * turn + chunk)
            for gen in backend.generate(prompts[start:start + sampling.batch_size], params):
                out = gen.token_ids.to_numpy().tolist()
                generated.append(out[:out.index(EOS_ID)] if EOS_ID in out else out)
        still = []
        for i, out in zip(active, generated, strict=True):
            text = tokenizer.decode(out, skip_special_tokens=True)
            texts[i].append(text)
            parsed = parse_tool_calls(text, make_id=lambda: f"call_{next(ids)}")
            if parsed.failed is not None:
                failures[i] += 1
            if parsed.failed is not None or not parsed.tool_calls:
                answers[i] = parsed.content
                continue
            messages[i].append({"role": "assistant", "content": parsed.content, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls]})
            calls[i] += len(parsed.tool_calls)
            for c in parsed.tool_calls:
                messages[i].append({"role": "tool", "tool_call_id": c.id,
                                    "content": run_tool(tasks[i], c.name, c.arguments)})
            still.append(i)
        active = still
    return [ToolRollout(answer=answers[i], texts=tuple(texts[i]), parse_failures=failures[i],
                        reward=answer_reward(tasks[i], answers[i]), tool_calls=calls[i]) for i in range(len(tasks))]


def evaluate_tool_pass_at_1(model_dir: str | os.PathLike[str], *, split: ToolSplit = "fresh", n: int,
                            task_seed: int, sampling: EvalSampling = TOOL_SAMPLING,
                            backend: TorchBackend | None = None,
                            tokenizer: PreTrainedTokenizerFast | None = None) -> EvalResult:
    """Sampled pass@1 of the model in ``model_dir`` (or ``backend``) on
    ``generate_tool_tasks(n, split=split, seed=task_seed)``; ``stopped`` is the fraction of
    rollouts that gave a final answer, ``completions`` the answers ("" for none)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if split != "fresh":
        raise ValueError("the tool-lookup family's evaluation split is 'fresh'")
    tasks = generate_tool_tasks(n, split=split, seed=task_seed)
    if backend is None:
        backend = TorchBackend(TorchBackendConfig(model_dir=os.fspath(model_dir)))
    if tokenizer is None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(os.fspath(model_dir))
    t0 = time.perf_counter()
    rollouts = sample_tool_rollouts(backend, tasks, tokenizer, sampling)
    t1 = time.perf_counter()
    rewards = [r.reward for r in rollouts]
    solved = sum(1 for r in rewards if r == 1.0)
    return EvalResult(split=split, task_seed=task_seed, pass_at_1=pass_rate_with_ci(solved, n),
                      mean_reward=sum(rewards) / n, stopped=sum(r.answer is not None for r in rollouts) / n,
                      sample_seconds=t1 - t0, score_seconds=0.0, rewards=tuple(rewards),
                      completions=tuple(r.answer or "" for r in rollouts))
