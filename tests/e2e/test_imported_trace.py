"""An imported failed trace is executed: a FAILED mini-swe-agent trajectory
(tests/fixtures/traces/mswea-limits.traj.json, ``exit_status`` ``LimitsExceeded``) is
turned into a task on the hand-written Harbor task tests/harness/harbor_tasks/hello-upper
(its image built with FROM python:3.11-slim mapped to fleetrl-sandbox:py311), and that
task is run in real Docker sandboxes and scored by the Harbor verifier.

Checked: with ``only_failed`` the successful trajectory is left out and the failed one
makes one task holding the session's conversation cut before its first assistant reply,
on the Harbor task's image, work dir, evaluator and limits; the built-in
`ShellAgentHarness`, driven by a scripted model that runs a solution, scores 1, and a
script that submits at once scores 0 (the model saw the trace's conversation after the
harness's own system message); the two attempts make a group whose GRPO advantages are
not zero; the real mini-swe-agent, as an `ExternalHarness` against the token-recording
endpoint with scripted answers (the approach of tests/external/test_mswea.py), solves
the same task for reward 1 and its record holds both model calls, the first asking the
session's request. The trainer's side of such groups is tests/ingest/test_ingest_trains.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio
from fakes import FakeModel, serving

from fleetrl.daemon.messages import RolloutGroup
from fleetrl.grpo.advantages import group_advantages
from fleetrl.harness.builtin import ShellAgentHarness
from fleetrl.harness.external import ExternalCommand, ExternalHarness, run_attempt
from fleetrl.harness.harbor import harbor_build_plan, harbor_task, read_harbor_dir
from fleetrl.harness.mswea_env import SUBMIT_MARKER, mini_swe_agent_command, mini_swe_agent_env
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app
from fleetrl.harness.tasks import Task
from fleetrl.harness.trace_import import read_sessions, tasks_from_sessions
from fleetrl.sandboxes import Engine, open_sandbox
from fleetrl.sandboxes import Limits as SandboxLimits
from fleetrl.sandboxes.harbor_image import ensure_harbor_image

import minisweagent  # noqa: E402,F401  (a test dependency: a missing one fails, as in tests/external)

pytestmark = pytest.mark.docker

TESTS = Path(__file__).resolve().parents[1]
HELLO = TESTS / "harness" / "harbor_tasks" / "hello-upper"
TRACES = TESTS / "fixtures" / "traces"
MAP = {"python:3.11-slim": "fleetrl-sandbox:py311"}
# what hello-upper's check_outputs.py wants: greeting.txt upper-cased + EXPECTED_SUFFIX ("!")
SOLVE = "tr a-z A-Z < /app/greeting.txt | sed 's/$/!/' > /app/shout.txt"


@pytest.fixture
def engine(docker_client) -> Engine:
    return Engine(docker_client)


@pytest.fixture
def template(docker_client, image) -> Task:
    """The hello-upper Harbor task, its image built (or reused when already built)."""
    hdir = read_harbor_dir(HELLO)
    built = ensure_harbor_image(harbor_build_plan(hdir, MAP), client=docker_client)
    task = harbor_task(hdir, MAP)
    assert built.tag == task.image
    return task


def _read(name: str):
    path = TRACES / f"{name}.traj.json"
    read = read_sessions(path.read_bytes(), "mini-swe-agent", str(path))
    assert not read.problems and len(read.sessions) == 1, read.problems
    return read.sessions[0]


@pytest.fixture
def failed_session():
    return _read("mswea-limits")


@pytest.fixture
def imported(template, failed_session) -> Task:
    """The one task that the failed trajectory makes (the successful one is left out)."""
    out = tasks_from_sessions([_read("mswea-submitted"), failed_session], template=template, only_failed=True)
    assert (out.report.sessions, out.report.tasks, out.report.failed, out.report.filtered_out) == (2, 1, 1, 1)
    assert not out.report.skipped, out.report.render()
    return out.tasks[0]


def _sandbox(engine, task: Task, ownership):
    return open_sandbox(engine, image=task.image, limits=SandboxLimits(workdir=task.workdir), ownership=ownership)


def test_a_failed_trace_becomes_a_task_on_the_harbor_template(imported, template, failed_session):
    task, session = imported, failed_session
    assert session.outcome == "failure" and session.id == "mswea-limits"
    # the session's conversation, cut before its first assistant reply
    roles = [m.role for m in session.messages]
    assert roles[:3] == ["system", "user", "assistant"]
    assert task.prompt is None and task.messages == session.messages[:2]
    assert task.messages[-1].content == "Please solve this issue: Make the tests pass"
    # the sandbox and the grader are the Harbor task's
    assert (task.image, task.workdir) == (template.image, "/app") and task.image.startswith("fleetrl-harbor/")
    assert task.evaluator == template.evaluator and "bash /tests/test.sh" in task.evaluator.command
    assert task.setup == template.setup and task.limits == template.limits
    assert task.id.startswith("trace:") and task.id != template.id
    assert (task.source.kind, task.source.trace_id, task.source.from_turn) == ("trace", "mswea-limits", 0)
    assert task.metadata["trace.outcome"] == "failure" and task.metadata["trace.template"] == "harbor:hello-upper"


async def test_the_builtin_shell_agent_runs_the_imported_task(imported, tok, engine, ownership):
    task = imported
    scripts = {
        "solve": [f"I will write it.\n```bash\n{SOLVE}\n```", "```bash\ncat /app/shout.txt\n```",
                  "Done.\n```bash\nsubmit\n```"],
        "nothing": ["```bash\nsubmit\n```"],
    }
    results = {}
    with trio.fail_after(240):
        for name, replies in scripts.items():
            model = FakeModel(tok, replies=replies)
            async with _sandbox(engine, task, ownership) as sb:
                results[name] = await run_attempt(ShellAgentHarness(), task, sb, model)
    solved, nothing = results["solve"], results["nothing"]
    ep = solved.episode
    assert ep.final_state == "submitted" and ep.n_calls == 3, ep.error
    assert ep.turns[1].observation == "exit code: 0\nHELLO HARBOR!\n"
    assert (solved.reward, solved.eval_exit_code, solved.eval_stdout) == (1.0, 0, '{"reward": 1}\n')
    assert nothing.episode.final_state == "submitted" and nothing.episode.n_calls == 1
    assert (nothing.reward, nothing.eval_stdout) == (0.0, '{"reward": 0}\n')
    # the model was asked the trace's conversation, after the harness's own system message
    first = ep.record.calls[0].messages
    assert first[0].role == "system" and "/app" in first[0].content
    assert [(m.role, m.content) for m in first[1:]] == [(m.role, m.content) for m in task.messages]

    # the two attempts as one GRPO group: rewards 1 and 0, so the advantages are not zero
    group = RolloutGroup(group_id="g0", task_id=task.id, trajectories=tuple(
        r.episode.record.trajectory(group_id="g0", reward=r.reward) for r in (solved, nothing)))
    assert [len(t.segments) for t in group.trajectories] == [3, 1]  # one segment a model call
    assert solved.episode.record.n_new_segments == 1  # each call extends the one before
    assert all(t.n_generated > 0 for t in group.trajectories)
    adv_G = group_advantages(torch.tensor([t.reward for t in group.trajectories]))
    assert adv_G.tolist() == [0.5, -0.5]


async def test_mini_swe_agent_runs_the_imported_task(imported, tok, engine, ownership, tmp_path):
    task = imported
    replies = [f"THOUGHT: upper-case it.\n\n```mswea_bash_command\n{SOLVE} && cat /app/shout.txt\n```",
               f"THOUGHT: finished.\n\n```mswea_bash_command\necho {SUBMIT_MARKER}\n```"]
    model = FakeModel(tok, replies=replies)
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig(model_name="tiny", context_length=8192))
    argv = mini_swe_agent_command(step_limit=5, max_tokens=200, action_timeout_s=20)
    cmd = ExternalCommand(argv=argv, env=mini_swe_agent_env(str(tmp_path / "mswea")), timeout_s=100)
    with trio.fail_after(150):
        async with serving(app) as base, _sandbox(engine, task, ownership) as sb:
            harness = ExternalHarness(cmd, registry=registry, base_url=base, model_name="tiny")
            result = await run_attempt(harness, task, sb)
    ep = result.episode
    assert ep.final_state == "submitted", (ep.error, ep.stderr_tail.decode()[-2000:])
    assert (result.reward, result.eval_exit_code, result.eval_stdout) == (1.0, 0, '{"reward": 1}\n')
    record = ep.record
    assert record.task_id == task.id and len(registry) == 0 and ep.n_calls == 2
    c0, c1 = record.calls
    # mini-swe-agent's own system prompt; its task text is the session's request
    assert c0.messages[0].role == "system" and "mswea_bash_command" in c0.messages[0].content
    assert "Please solve this issue: Make the tests pass" in c0.messages[1].content
    assert c1.extends == 0 and "HELLO HARBOR!" in c1.messages[-1].content
    for call in record.calls:
        assert call.prompt_ids == tok.encode(tok.render(call.messages, None, True)) and call.token_ids
    traj = record.trajectory(group_id="g1", reward=result.reward)
    assert len(traj.segments) == 2 and traj.reward == 1.0
