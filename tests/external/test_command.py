"""ExternalHarness with small external commands: argv/env handling, exit codes, the
wall-clock limit and the killed process tree (real processes, real signals), and a
script using the official openai client against the endpoint that writes a file in a
real Docker sandbox, scored by the task's evaluator."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import msgspec
import pytest
import trio
from fakes import FakeModel, serving

from fleetrl.harness.external import ExternalCommand, ExternalEpisode, ExternalHarness, expand_argv, run_attempt
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app
from fleetrl.harness.processes import process_tree, read_parent_map, tail_bytes
from fleetrl.harness.protocol import Harness
from fleetrl.harness.tasks import Evaluator, Limits, Setup, Task

PY = sys.executable
SCRIPTS = Path(__file__).parent / "scripts"


class NoSandbox:
    """A sandbox without a container (the command does not act in it)."""

    async def exec(self, cmd, *, timeout=None, stdin=None, env=None, workdir=None):
        raise AssertionError("the harness must not exec in the sandbox here")

    async def write_files(self, files):
        raise AssertionError("not used")

    async def read_file(self, path, *, max_bytes=1 << 20):
        raise AssertionError("not used")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def _harness(tok, argv, **kw) -> tuple[ExternalHarness, AttemptRegistry]:
    registry = AttemptRegistry(tok)
    return ExternalHarness(ExternalCommand(argv=tuple(argv), **kw), registry=registry,
                           base_url="http://127.0.0.1:9"), registry


# --------------------------------------------------------------------------- pure parts


def test_expand_argv_keeps_each_element_one_argument():
    out = expand_argv(["agent", "--task", "{prompt}", "{{literal}}", "-C{workdir}"],
                      {"prompt": "a b; rm -rf / $(x)", "workdir": "/work"})
    assert out == ["agent", "--task", "a b; rm -rf / $(x)", "{literal}", "-C/work"]


@pytest.mark.parametrize("bad, why", [("{nope}", "unknown placeholder {nope}"), ("{prompt!r}", "unknown placeholder"),
                                      ("{prompt", "bad placeholder syntax")])
def test_command_rejects_bad_placeholders_naming_the_element(bad, why):
    with pytest.raises(ValueError, match=r"argv\[1\].*" + why.replace("{", r"\{").replace("}", r"\}")):
        ExternalCommand(argv=("agent", bad))


@pytest.mark.parametrize("kw, field", [
    ({"argv": ()}, "argv"), ({"argv": ("a",), "timeout_s": 0}, "timeout_s"),
    ({"argv": ("a",), "timeout_s": float("inf")}, "timeout_s"), ({"argv": ("a",), "kill_grace_s": -1}, "kill_grace_s"),
    ({"argv": ("a",), "env": {"OPENAI_API_KEY": "x"}}, "OPENAI_API_KEY"), ({"argv": ("a",), "env": {"A=B": "x"}}, "A=B"),
])
def test_command_rejects_bad_config_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ExternalCommand(**kw)


def test_command_config_from_toml_like_dict_rejects_unknown_fields():
    with pytest.raises(msgspec.ValidationError, match="timeout"):
        msgspec.convert({"argv": ["a"], "timeout": 3}, ExternalCommand)
    assert msgspec.convert({"argv": ["a", "{prompt}"], "timeout_s": 3}, ExternalCommand).timeout_s == 3


def test_process_tree_follows_descendants_only():
    parents = {1: 0, 10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert process_tree(parents, 10) == [10, 11, 13, 12]
    assert process_tree(parents, 99) == [99]


def test_read_parent_map_sees_this_process():
    assert read_parent_map()[os.getpid()] == os.getppid()


def test_tail_bytes_keeps_the_last_bytes():
    buf = bytearray()
    for chunk in (b"abc", b"defg", b"h"):
        tail_bytes(buf, chunk, 5)
    assert buf == b"defgh"


# --------------------------------------------------------------------------- processes


async def test_environment_exit_code_and_output(tok):
    harness, registry = _harness(tok, [PY, str(SCRIPTS / "env_probe.py"), "{prompt}", "{task_id}"], env={"EXTRA": "1"})
    assert isinstance(harness, Harness)
    task = Task(id="t1", prompt="do it now", evaluator=Evaluator(command="true"), limits=Limits(max_turns=4))
    os.environ["SECRET_OF_OURS"] = "x"
    try:
        with trio.fail_after(30):
            ep = await harness.run(task, NoSandbox(), None)
    finally:
        del os.environ["SECRET_OF_OURS"]
    assert isinstance(ep, ExternalEpisode)
    seen = msgspec.json.decode(ep.stdout_tail)
    assert seen["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1"
    assert seen["OPENAI_API_KEY"].startswith("fleetrl-")
    assert registry.is_closed(seen["OPENAI_API_KEY"]) and len(registry) == 0
    assert seen["SECRET_OF_OURS"] is None and seen["EXTRA"] == "1"
    assert (seen["FLEETRL_TASK_ID"], seen["FLEETRL_SANDBOX_WORKDIR"], seen["FLEETRL_MAX_TURNS"]) == ("t1", "/work", "4")
    assert seen["argv"] == ["do it now", "t1"] and seen["task"] == "t1" and seen["prompt"] == "do it now"
    assert ep.exit_code == 3 and ep.final_state == "error" and "exited 3" in ep.error and "bye" in ep.error
    assert ep.n_calls == 0 and ep.stderr_tail == b"bye"


async def test_missing_program_is_a_clear_error_and_closes_the_attempt(tok):
    harness, registry = _harness(tok, ["/nonexistent/agent-cli"])
    task = Task(id="t", prompt="p", evaluator=Evaluator(command="true"))
    with trio.fail_after(10), pytest.raises(ValueError, match="cannot start '/nonexistent/agent-cli'"):
        await harness.run(task, NoSandbox(), None)
    assert len(registry) == 0




async def _hang_pids(path, nursery_cancel=False) -> list[int]:
    for _ in range(200):
        if path.exists() and path.read_text():
            pids = [int(p) for p in path.read_text().split()]
            parents = read_parent_map()
            return sorted({q for p in pids for q in process_tree(parents, p)})
        await trio.sleep(0.05)
    raise AssertionError("the hanging command did not start")


async def test_command_past_its_limit_has_its_process_tree_killed(tok, tmp_path):
    pidfile = tmp_path / "pids"
    harness, registry = _harness(tok, [PY, str(SCRIPTS / "hanger.py"), str(pidfile)], timeout_s=3, kill_grace_s=0.5)
    task = Task(id="t", prompt="p", evaluator=Evaluator(command="true"))
    seen: list[int] = []

    async def watch():
        seen.extend(await _hang_pids(pidfile))

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            n.start_soon(watch)
            ep = await harness.run(task, NoSandbox(), None)
    assert ep.final_state == "timeout" and ep.timed_out and ep.exit_code is None
    assert "limit of 3 s" in ep.error
    assert len(seen) == 4  # the command, its two children, the grandchild in its own session
    assert set(seen) <= set(ep.killed_pids)
    assert not [p for p in seen if _alive(p)]
    assert len(registry) == 0


async def test_cancelling_the_caller_kills_the_process_tree(tok, tmp_path):
    pidfile = tmp_path / "pids"
    harness, registry = _harness(tok, [PY, str(SCRIPTS / "hanger.py"), str(pidfile)], timeout_s=600, kill_grace_s=0.2)
    task = Task(id="t", prompt="p", evaluator=Evaluator(command="true"))
    seen: list[int] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            n.start_soon(harness.run, task, NoSandbox(), None)
            seen.extend(await _hang_pids(pidfile))
            n.cancel_scope.cancel()
    assert len(seen) == 4 and not [p for p in seen if _alive(p)]
    assert len(registry) == 0  # the attempt was closed all the same


# --------------------------------------------------------------------------- endpoint + sandbox



@pytest.mark.docker
async def test_openai_client_script_two_calls_and_a_file_scored_by_the_evaluator(tok, sandbox_factory):
    model = FakeModel(tok, replies=["hello", "world"])
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig(model_name="tiny"))
    task = Task(id="two-calls", prompt="say hello", setup=Setup(files={"notes.txt": "x"}),
                evaluator=Evaluator(command="test \"$(cat answer.txt)\" = 'hello|world' && test -f notes.txt"))
    with trio.fail_after(90):
        async with serving(app) as base, sandbox_factory() as sb:
            harness = ExternalHarness(ExternalCommand(argv=(PY, str(SCRIPTS / "two_calls.py")), timeout_s=60), registry=registry,
                                      base_url=base, model_name="tiny")
            result = await run_attempt(harness, task, sb)
            owner = await sb.exec(["stat", "-c", "%u", "/work/answer.txt"])
    ep = result.episode
    assert ep.final_state == "submitted" and ep.exit_code == 0, ep.stderr_tail.decode()
    assert result.reward == 1.0 and result.eval_exit_code == 0
    assert owner.stdout.strip() == b"1000"
    c0, c1 = ep.record.calls
    assert (c0.text, c1.text) == ("hello", "world")
    assert c1.extends == 0 and c1.prompt_ids[: len(c0.prompt_ids) + len(c0.token_ids)] == c0.prompt_ids + c0.token_ids
    assert [c.prompt_ids for c in ep.record.calls] == model.prompts  # what the model saw is what was recorded
    assert [t.call for t in ep.turns] == list(ep.record.calls)
    assert ep.record.task_id == "two-calls"


@pytest.mark.docker
async def test_timeout_also_stops_what_the_harness_started_in_the_sandbox(tok, sandbox_factory):
    harness, registry = _harness(tok, [PY, str(SCRIPTS / "sandbox_ticker.py")], timeout_s=4, kill_grace_s=0.2)
    task = Task(id="ticker", prompt="p", evaluator=Evaluator(command="test -s tick"))
    with trio.fail_after(90):
        async with sandbox_factory() as sb:
            result = await run_attempt(harness, task, sb)
            before = await sb.exec(["wc", "-c", "tick"])
            await trio.sleep(0.5)
            after = await sb.exec(["wc", "-c", "tick"])
    ep = result.episode
    assert ep.final_state == "timeout" and ep.stdout_tail == b"ticking\n"
    assert result.reward == 1.0  # the state it left is scored
    assert before.stdout == after.stdout  # the loop it started in the sandbox no longer runs


def test_the_guide_names_every_variable_and_placeholder():
    from fleetrl.harness.external import ENV_VARS, PLACEHOLDERS

    guide = (Path(__file__).parents[2] / "docs" / "guides" / "external-harness.md").read_text()
    assert not [v for v in ENV_VARS if f"`{v}`" not in guide]
    assert not [p for p in PLACEHOLDERS if f"`{{{p}}}`" not in guide]


def test_relative_paths_of_a_command_resolve_against_the_daemons_directory():
    cmd = ExternalCommand(argv=(".venv/bin/mini", "-c", "x.yaml", "./agent.py", "../up/a", "{task_file}", "plain"),
                          cwd="work")
    got = cmd.relative_to("/srv/run")
    assert got.argv == ("/srv/run/.venv/bin/mini", "-c", "x.yaml", "/srv/run/agent.py", "/srv/up/a", "{task_file}",
                        "plain")
    assert got.cwd == "/srv/run/work"
    bare = ExternalCommand(argv=("python3", "/abs/agent.py"))
    assert bare.relative_to("/srv/run") == bare  # a bare name is found in PATH, absolute paths stay
