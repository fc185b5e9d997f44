"""The built-in harnesses with the fake model and an in-memory sandbox, and once each
against a real Docker sandbox scored by the task's evaluator."""

from __future__ import annotations

import secrets

import pytest
import trio
from fakes import FakeModel, FakeSandbox, result

from fleetrl.harness.builtin import (
    CompletionHarness,
    ShellAgentHarness,
    cap_output,
    extract_code,
    parse_command,
)
from fleetrl.harness.humaneval_tasks import load_humaneval_tasks
from fleetrl.harness.protocol import Harness, SetupFailed, evaluate_in_sandbox, prepare_sandbox
from fleetrl.harness.synthetic import make_task, reference_solution
from fleetrl.harness.tasks import Evaluator, Limits, Setup, Task


def shell_task(max_turns: int = 6, timeout_s: float = 600.0, **kw) -> Task:
    return Task(id="shell-1", prompt="Create hello.txt containing hi.",
                evaluator=Evaluator(command="grep -qx hi hello.txt"),
                limits=Limits(max_turns=max_turns, timeout_s=timeout_s), **kw)


def test_harnesses_implement_the_protocol():
    assert isinstance(CompletionHarness(), Harness) and isinstance(ShellAgentHarness(), Harness)


def test_command_parsing_and_output_capping():
    assert parse_command("I will list.\n```bash\nls -la\n```\nthen more") == "ls -la"
    assert parse_command("```python\nprint(1)\n```\n```sh\necho a\n```") == "echo a"
    assert parse_command("```\n  submit  \n```") == "submit"
    assert parse_command("no block here") is None and parse_command("```bash\n\n```") is None
    assert extract_code("text\n```python\ndef f():\n    pass\n```") == "def f():\n    pass\n"
    assert extract_code("plain") == "plain"
    capped = cap_output("a" * 50 + "b" * 50, 20)
    assert capped.startswith("a" * 10) and capped.endswith("b" * 10) and "80 characters omitted" in capped
    assert cap_output("short", 20) == "short"


async def test_completion_harness_writes_prompt_plus_completion(tok):
    task = synthetic_task_for_test()
    body = reference_solution(task)  # "    return ...\n<eos>": <eos> encodes to the stop id
    model = FakeModel(tok, replies=[body])
    sandbox = FakeSandbox()
    with trio.fail_after(10):
        episode = await CompletionHarness(max_tokens=64).run(task, sandbox, model)
    assert episode.final_state == "submitted" and episode.n_calls == 1
    call = episode.record.calls[0]
    assert call.kind == "completion" and call.prompt_ids == [tok.bos_id, *tok.encode(task.prompt)]
    assert call.token_ids[-1] == tok.eos_id and call.text == body.removesuffix("<eos>")
    assert sandbox.files["/work/solution.py"].decode() == task.prompt + call.text
    assert episode.turns[0].action == "write solution.py"


async def test_completion_harness_asks_instruction_tasks_as_a_chat(tok):
    task = load_humaneval_tasks(ids=["HumanEval/0"], instruct=True)[0]
    reply = "Here it is:\n```python\ndef has_close_elements(numbers, threshold):\n    return False\n```\n"
    model = FakeModel(tok, replies=[reply])
    sandbox = FakeSandbox()
    episode = await CompletionHarness().run(task, sandbox, model)
    call = episode.record.calls[0]
    assert call.kind == "chat" and call.prompt_ids == tok.encode(tok.render(call.messages, None, True))
    assert sandbox.files["/work/solution.py"] == b"def has_close_elements(numbers, threshold):\n    return False\n"


def _shell(cmd: str, sb: FakeSandbox):
    if cmd.startswith("echo hi > "):
        sb.files["/work/hello.txt"] = b"hi\n"
        return result(0, "")
    if cmd == "cat hello.txt":
        return result(0, sb.files["/work/hello.txt"].decode())
    return result(127, "", f"sh: {cmd.split()[0]}: not found")


async def test_shell_agent_runs_commands_until_submit_with_token_exact_turns(tok):
    replies = [
        "Let me write it.\n```bash\necho hi > hello.txt\n```",
        "Hmm, thinking.",  # no command: a format reminder, uses a turn
        "```bash\ncat hello.txt\n```",
        "```bash\nfrobnicate --now\n```",
        "Done.\n```bash\nsubmit\n```",
    ]
    model = FakeModel(tok, replies=replies)
    sandbox = FakeSandbox(_shell)
    with trio.fail_after(10):
        episode = await ShellAgentHarness().run(shell_task(), sandbox, model)
    assert episode.final_state == "submitted" and episode.error is None
    assert [t.action for t in episode.turns] == ["echo hi > hello.txt", None, "cat hello.txt", "frobnicate --now",
                                                "submit"]
    assert sandbox.commands == [("echo hi > hello.txt", "/work"), ("cat hello.txt", "/work"),
                                ("frobnicate --now", "/work")]
    obs = [t.observation for t in episode.turns]
    assert obs[0] == "exit code: 0\n" and obs[2] == "exit code: 0\nhi\n"
    assert "No command found" in obs[1] and obs[3].startswith("exit code: 127\n\n[stderr]\nsh: frobnicate")
    assert obs[4] is None
    calls = episode.record.calls
    assert len(calls) == 5 and episode.record.n_new_segments == 1
    for i, call in enumerate(calls):
        assert call.prompt_ids == model.prompts[i] == tok.encode(tok.render(call.messages, None, True))
        if i:
            assert call.extends == i - 1
            assert call.prompt_ids[: len(calls[i - 1].prompt_ids)] == calls[i - 1].prompt_ids
    # the observation of each turn is the next call's last message
    assert calls[1].messages[-1].content == obs[0] and calls[1].messages[-2].content == calls[0].text
    assert calls[0].messages[0].role == "system" and "/work" in calls[0].messages[0].content


async def test_shell_agent_stops_at_the_turn_limit(tok):
    model = FakeModel(tok, replies=["```bash\nls\n```"] * 3)
    sandbox = FakeSandbox()
    episode = await ShellAgentHarness().run(shell_task(max_turns=3), sandbox, model)
    assert episode.final_state == "turn_limit" and episode.n_calls == 3 and len(sandbox.commands) == 3
    assert episode.turns[-1].observation == "exit code: 0\nran: ls"


async def test_shell_agent_caps_command_output(tok):
    model = FakeModel(tok, replies=["```bash\nbig\n```", "```bash\nsubmit\n```"])
    sandbox = FakeSandbox(lambda cmd, sb: result(0, "x" * 10_000))
    episode = await ShellAgentHarness(max_output_chars=100).run(shell_task(), sandbox, model)
    assert len(episode.turns[0].observation) < 200 and "omitted" in episode.turns[0].observation


async def test_shell_agent_times_out(tok, autojump_clock):
    model = FakeModel(tok, replies=["```bash\nsleep 1000\n```", "```bash\nls\n```"], delay=1.0)
    sandbox = FakeSandbox(exec_delay=1000)
    start = trio.current_time()
    episode = await ShellAgentHarness(command_timeout_s=100).run(shell_task(timeout_s=5), sandbox, model)
    # the command got the 4 s left as its own timeout (not a cancellation); the next
    # model call was then cut by the episode's deadline
    assert episode.final_state == "timeout" and episode.n_calls == 1
    assert trio.current_time() - start == pytest.approx(5.0)
    assert episode.turns[0].observation.startswith("exit code: killed (timeout)")


async def test_model_failure_ends_the_episode_with_an_error(tok):
    model = FakeModel(tok, fail=True)
    for harness in (ShellAgentHarness(), CompletionHarness()):
        episode = await harness.run(shell_task(), FakeSandbox(), model)
        assert episode.final_state == "error" and "no sampler is serving" in episode.error
        assert episode.record.calls == ()


async def test_prepare_and_evaluate_with_a_fake_sandbox(tok):
    task = shell_task(setup=Setup(files={"a/b.txt": "x"}, commands=["true", "false"]))
    sandbox = FakeSandbox(lambda cmd, sb: result(0 if cmd == "true" else 1, "", "boom"))
    with pytest.raises(SetupFailed, match=r"setup.commands\[1\] 'false' exited 1: boom"):
        await prepare_sandbox(task, sandbox)
    assert sandbox.files == {"/work/a/b.txt": b"x"}
    reward, code, _ = await evaluate_in_sandbox(task, FakeSandbox(lambda c, sb: result(0, "")))
    assert (reward, code) == (1.0, 0)


def synthetic_task_for_test() -> Task:
    return make_task(7, "train", 0)


# --------------------------------------------------------------------------- Docker


@pytest.fixture
def ownership(tmp_path):
    import docker

    from fleetrl.sandboxes import Ownership
    from fleetrl.sandboxes.sweep import LABEL_OWNER

    own = Ownership.for_state_dir(tmp_path, owner=f"test-harness-{secrets.token_hex(4)}", run="test-run")
    yield own
    client = docker.from_env()
    left = client.containers.list(all=True, filters={"label": f"{LABEL_OWNER}={own.owner}"})
    for c in left:
        c.remove(force=True)
    assert not left, f"containers left behind: {[c.short_id for c in left]}"


@pytest.mark.docker
async def test_both_harnesses_in_a_real_sandbox_scored_by_the_evaluator(tok, ownership):
    from fleetrl.sandboxes import DEFAULT_IMAGE, open_sandbox_pool

    task = synthetic_task_for_test()
    with trio.fail_after(240):
        async with open_sandbox_pool(ownership) as pool:
            async with pool.lease(DEFAULT_IMAGE) as sb:
                await prepare_sandbox(task, sb)
                model = FakeModel(tok, replies=[reference_solution(task)])
                episode = await CompletionHarness().run(task, sb, model)
                reward, code, stdout = await evaluate_in_sandbox(task, sb)
            assert episode.final_state == "submitted" and reward == 1.0, stdout
            async with pool.lease(DEFAULT_IMAGE) as sb:
                shell = shell_task()
                model = FakeModel(tok, replies=["```bash\nprintf 'hi\\n' > hello.txt && cat hello.txt\n```",
                                                "```bash\nsubmit\n```"])
                episode = await ShellAgentHarness().run(shell, sb, model)
                reward2, _, _ = await evaluate_in_sandbox(shell, sb)
                wrong = await ShellAgentHarness().run(
                    shell_task(max_turns=1), sb, FakeModel(tok, replies=["```bash\necho no > hello.txt\n```"]))
                reward3, _, _ = await evaluate_in_sandbox(shell, sb)
    assert episode.final_state == "submitted" and episode.turns[0].observation == "exit code: 0\nhi\n"
    assert reward2 == 1.0 and wrong.final_state == "turn_limit" and reward3 == 0.0
