"""mini-swe-agent (PyPI, unchanged) as an external harness: its text-based agent calls
the tiny model through the endpoint (hypercorn on 127.0.0.1, the torch sampler behind
it) and acts in a real Docker sandbox through FleetrlSandboxEnvironment; the attempt is
recorded token-exactly and scored by the task's evaluator. Also the environment class
alone in a sandbox: user, work dir, timeout, submission, no network."""

from __future__ import annotations


import numpy as np
import pytest
import trio
from fakes import FakeModel, TorchClient, serving

from fleetrl.actors.model import TinyLlamaSpec, create_tiny_llama, save_byte_tokenizer
from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig
from fleetrl.harness.external import ExternalCommand, ExternalHarness, run_attempt
from fleetrl.harness.model import HFChatTokenizer
from fleetrl.harness.mswea_env import (
    SUBMIT_MARKER,
    FleetrlSandboxEnvironment,
    SandboxEnvConfig,
    build_exec_argv,
    mini_swe_agent_command,
    mini_swe_agent_env,
)
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app
from fleetrl.harness.tasks import Evaluator, Limits, Setup, Task

import minisweagent  # noqa: E402,F401  (a test dependency: the acceptance runs it, so a missing one fails)

SPEC = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                     max_position_embeddings=4096, initializer_range=0.1)


# --------------------------------------------------------------------------- pure parts


def test_exec_argv_runs_as_the_sandbox_user_in_the_workdir_under_a_kill_timeout():
    cfg = SandboxEnvConfig(container="c0ffee", user="1000:1000", cwd="/work", env={"PAGER": "cat"})
    assert build_exec_argv(cfg, "ls -la", timeout=5) == [
        "docker", "exec", "-u", "1000:1000", "-w", "/work", "-e", "PAGER=cat", "c0ffee",
        "timeout", "-s", "KILL", "5", "bash", "-c", "ls -la"]
    assert build_exec_argv(cfg, "x", cwd="/work/sub")[6:8] == ["-e", "PAGER=cat"]
    assert "/work/sub" in build_exec_argv(cfg, "x", cwd="/work/sub")


@pytest.mark.parametrize("kw, match", [
    ({"container": ""}, "FLEETRL_SANDBOX_CONTAINER"), ({"user": "0:0"}, "unprivileged"), ({"user": "root"}, "unprivileged"),
    ({"cwd": "work"}, "absolute"), ({"timeout": 0}, "timeout"), ({"interpreter": []}, "interpreter"),
])
def test_env_config_errors_name_the_setting(kw, match, monkeypatch):
    monkeypatch.delenv("FLEETRL_SANDBOX_CONTAINER", raising=False)
    base = {"container": "c"} | kw
    with pytest.raises(ValueError, match=match):
        FleetrlSandboxEnvironment(**base)


def test_env_config_rejects_settings_of_other_environment_classes():
    with pytest.raises(ValueError, match="image"):
        FleetrlSandboxEnvironment(container="c", image="python:3.11")


def test_env_defaults_come_from_the_attempt_environment(monkeypatch):
    monkeypatch.setenv("FLEETRL_SANDBOX_CONTAINER", "abc")
    monkeypatch.setenv("FLEETRL_SANDBOX_USER", "1000:1000")
    monkeypatch.setenv("FLEETRL_SANDBOX_WORKDIR", "/srv/w")
    env = FleetrlSandboxEnvironment(timeout=3)
    assert (env.config.container, env.config.user, env.config.cwd, env.config.timeout) == ("abc", "1000:1000", "/srv/w", 3)
    assert env.get_template_vars()["system"] and env.serialize()["info"]["config"]["environment"]["container"] == "abc"


def test_mini_command_is_configured_only_by_its_own_settings():
    argv = mini_swe_agent_command(step_limit=2, max_tokens=8)
    ExternalCommand(argv=argv)  # its placeholders are all known
    assert "environment.environment_class=fleetrl.harness.mswea_env.FleetrlSandboxEnvironment" in argv
    assert "agent.step_limit=2" in argv and "model.model_kwargs.max_tokens=8" in argv
    with pytest.raises(ValueError):
        mini_swe_agent_command(step_limit=0, max_tokens=8)


# --------------------------------------------------------------------------- in a sandbox


@pytest.mark.docker
async def test_environment_class_acts_in_the_sandbox(sandbox_factory):
    from minisweagent.exceptions import Submitted

    with trio.fail_after(90):
        async with sandbox_factory() as sb:
            env = FleetrlSandboxEnvironment(container=sb.id, user=sb.limits.user, cwd="/work", timeout=10)

            def actions():
                who = env.execute({"command": "id -u; pwd; echo hi > f.txt; echo err >&2; exit 4"})
                slow = env.execute({"command": "sleep 30; echo never"}, timeout=1)
                net = env.execute({"command": "cat < /dev/tcp/1.1.1.1/53 && echo open || echo closed"})
                try:
                    env.execute({"command": f"echo {SUBMIT_MARKER}; cat f.txt"})
                except Submitted as s:
                    return who, slow, net, s.messages[0]
                raise AssertionError("the submission did not end the task")

            who, slow, net, submitted = await trio.to_thread.run_sync(actions)
            left = await sb.exec(["cat", "/work/f.txt"])
    # stdout and stderr are merged (their interleaving is the engine's)
    assert who["returncode"] == 4 and sorted(who["output"].split()) == sorted(["1000", "/work", "err"])
    assert slow["returncode"] == 137 and "timed out" in slow["exception_info"] and "never" not in slow["output"]
    assert "closed" in net["output"].split()  # the probe's verdict; bash's own error may come after it
    assert submitted["extra"]["submission"] == "hi\n"
    assert left.stdout == b"hi\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model_dir = create_tiny_llama(root / "model", SPEC, seed=5)
    save_byte_tokenizer(root / "model", model_max_length=4096)
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))
    return backend, HFChatTokenizer.from_pretrained(root / "model")


def _mini_harness(registry, base, state_dir, *, step_limit: int, max_tokens: int, timeout_s: float,
                  extra: tuple[str, ...] = ()) -> ExternalHarness:
    argv = mini_swe_agent_command(step_limit=step_limit, max_tokens=max_tokens, action_timeout_s=20, extra=extra)
    cmd = ExternalCommand(argv=argv, env=mini_swe_agent_env(str(state_dir)), timeout_s=timeout_s)
    return ExternalHarness(cmd, registry=registry, base_url=base, model_name="tiny")


@pytest.mark.docker
async def test_mini_swe_agent_runs_a_task_in_our_sandbox_against_the_tiny_model(tiny, sandbox_factory, tmp_path):
    backend, tok = tiny
    model = TorchClient(backend, tok)
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig(model_name="tiny", context_length=4096))
    task = Task(id="mswea-tiny", prompt="Create the file done.txt holding the word done.",
                setup=Setup(files={"README": "a task\n"}),
                evaluator=Evaluator(command="test \"$(cat done.txt 2>/dev/null)\" = done"), limits=Limits(max_turns=2))
    with trio.fail_after(150):
        async with serving(app) as base, sandbox_factory() as sb:
            harness = _mini_harness(registry, base, tmp_path / "mswea", step_limit=2, max_tokens=8, timeout_s=120,
                                   extra=("model.model_kwargs.seed=7",))
            result = await run_attempt(harness, task, sb)
    ep = result.episode
    assert ep.final_state == "submitted", (ep.error, ep.stderr_tail.decode()[-2000:])
    # the agent made its calls and ended by its own rules (the step limit: a random model sends no action)
    assert ep.n_calls == 2
    assert result.reward == 0.0 and result.eval_exit_code == 1
    record = ep.record
    assert record.task_id == "mswea-tiny" and len(registry) == 0
    first, second = record.calls
    # its prompts are mini-swe-agent's own (system + instance templates, then its format-error message)
    assert first.messages[0].role == "system" and "mswea_bash_command" in first.messages[0].content
    assert first.messages[1].content.startswith("Please solve this issue: Create the file done.txt")
    # token-exact: each prompt is the endpoint's tokenisation of the messages it was sent. mini-swe-agent
    # drops an answer without an action from its history (it sends its format-error message after the
    # task instead), so the second call does not extend the first: a new segment, with the reason said
    assert first.extends is None and second.extends is None and second.new_segment_reason
    assert [m.role for m in second.messages] == ["system", "user", "user"]
    assert second.messages[:2] == first.messages
    for call in record.calls:
        assert call.prompt_ids == tok.encode(tok.render(call.messages, None, True))
    assert first.prompt_ids[0] == tok.bos_id and len(first.prompt_ids) > 2500  # a ~3,000-character prompt
    # the generated ids and log-probs are the sampler's: a seeded rerun of the backend gives them again
    assert [c.prompt_ids for c in record.calls] == [p for p, _ in model.requests]
    for call, (prompt, bp) in zip(record.calls, model.requests):
        assert len(call.token_ids) <= 8 and bp.seed == 7  # mini-swe-agent's model_kwargs reached the sampler
        (again,) = backend.generate([prompt], bp)
        assert again.token_ids.to_numpy().tolist() == call.token_ids
        assert np.allclose(call.segment.logprobs.to_numpy(), again.logprobs.to_numpy(), atol=1e-6)
        assert call.segment.sampler.backend == "torch"
    traj = record.trajectory(group_id="g", reward=result.reward)
    assert len(traj.segments) == 2 and traj.reward == 0.0


@pytest.mark.docker
async def test_mini_swe_agent_action_and_submission_in_the_sandbox(tok, sandbox_factory, tmp_path):
    """With scripted answers, mini-swe-agent's actions really change the sandbox (as its
    user, in its work dir) and its own submission command ends the run; the evaluator scores 1."""
    replies = ["THOUGHT: write it.\n\n```mswea_bash_command\nprintf done > done.txt && id -u > who.txt\n```",
               f"THOUGHT: finished.\n\n```mswea_bash_command\necho {SUBMIT_MARKER}\n```"]
    model = FakeModel(tok, replies=replies)
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig(model_name="tiny", context_length=8192))
    task = Task(id="mswea-scripted", prompt="Create the file done.txt holding the word done.",
                evaluator=Evaluator(command="test \"$(cat done.txt)\" = done && test \"$(cat who.txt)\" = 1000"))
    with trio.fail_after(120):
        async with serving(app) as base, sandbox_factory() as sb:
            harness = _mini_harness(registry, base, tmp_path / "mswea", step_limit=5, max_tokens=200, timeout_s=100)
            result = await run_attempt(harness, task, sb)
    ep = result.episode
    assert ep.final_state == "submitted", (ep.error, ep.stderr_tail.decode()[-2000:])
    assert ep.n_calls == 2 and result.reward == 1.0
    c0, c1 = ep.record.calls
    assert c1.extends == 0  # the observation message extends the first call exactly
    assert "<returncode>0</returncode>" in c1.messages[-1].content
