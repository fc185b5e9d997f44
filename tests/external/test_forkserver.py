"""Harness programs forked from a preloading fork server (`ExternalCommand.preload`,
`fleetrl.harness.forkserver`): real processes, real signals.

The forked program sees what a fresh process would (its argv, environment, working
directory, an empty stdin, ``__name__ == "__main__"``, a session of its own, its exit
code or its traceback) but starts with the preloaded module already imported, in the
server; a run past its limit has its process tree killed as before; a server that dies
is started again for the next attempt, and an attempt whose server died under it fails
(its tree killed); a preload that fails or leaves threads running is a clear error;
bad ``preload`` settings are config errors."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import msgspec
import pytest
import trio

from fleetrl.harness.external import ExternalCommand, ExternalHarness
from fleetrl.harness.forkserver import ForkServer, ForkServerFailed
from fleetrl.harness.openai_api import AttemptRegistry
from fleetrl.harness.processes import run_command
from fleetrl.harness.tasks import Evaluator, Task

from .test_command import SCRIPTS, NoSandbox, _alive, _hang_pids

PY = sys.executable
PROBE = str(SCRIPTS / "preload_probe.py")
LIB = str(SCRIPTS / "probe_lib")


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "PYTHONPATH": LIB, **extra}


async def _probe(server: ForkServer | None, tmp_path: Path, code: int = 0, **kw):
    argv = [PY, PROBE, str(code)]
    out = await run_command(argv, env=_env(PROBE_VAR="v1"), cwd=str(tmp_path), timeout_s=60, grace_s=1,
                            cap=1 << 16, forkserver=server, **kw)
    return out, (json.loads(out.stdout) if out.stdout.strip() else None)


async def test_forked_program_sees_a_fresh_process_with_the_module_preloaded(tmp_path):
    server = ForkServer(PY, ["probe_mod"], _env())
    try:
        with trio.fail_after(60):
            out, seen = await _probe(server, tmp_path)
            again, seen2 = await _probe(server, tmp_path, code=3)
            crash, _ = await _probe(server, tmp_path, code=99)
    finally:
        await server.aclose()
    assert out.exit_code == 0 and not out.timed_out
    assert seen["preloaded"] and seen["imported_in"] != seen["pid"]  # imported once, in the server
    assert seen["imported_in"] == seen2["imported_in"] and seen["pid"] != seen2["pid"]
    assert seen["sid"] == seen["pid"]  # the leader of a session of its own
    assert seen["argv"] == [PROBE, "0"] and seen["cwd"] == str(tmp_path) and seen["var"] == "v1"
    assert seen["stdin"] == "" and seen["name"] == "__main__"
    assert out.stderr == b"to stderr\n"
    assert again.exit_code == 3
    assert crash.exit_code == 1 and b"RuntimeError: the probe failed" in crash.stderr
    assert server.starts == 1


async def test_without_a_server_the_same_program_imports_for_itself(tmp_path):
    with trio.fail_after(60):
        out, seen = await _probe(None, tmp_path)
    assert out.exit_code == 0 and not seen["preloaded"] and seen["imported_in"] == seen["pid"]


async def test_a_dead_server_is_started_again_and_a_run_it_dies_under_fails(tmp_path):
    server = ForkServer(PY, ["probe_mod"], _env())
    pidfile = tmp_path / "pids"
    try:
        with trio.fail_after(90):
            _, first = await _probe(server, tmp_path)
            os.kill(server._proc.pid, signal.SIGKILL)
            await server._proc.wait()
            _, second = await _probe(server, tmp_path)
            assert server.starts == 2 and second["imported_in"] != first["imported_in"]

            seen: list[int] = []
            errors: list[ForkServerFailed] = []
            async with trio.open_nursery() as n:
                async def kill_server():
                    seen.extend(await _hang_pids(pidfile))
                    os.kill(server._proc.pid, signal.SIGKILL)
                n.start_soon(kill_server)
                try:
                    await run_command([PY, str(SCRIPTS / "hanger.py"), str(pidfile)], env=_env(), cwd=str(tmp_path),
                                      timeout_s=60, grace_s=0.2, cap=1024, forkserver=server)
                except ForkServerFailed as err:
                    errors.append(err)
            assert len(errors) == 1 and "died while its child" in str(errors[0])
            assert len(seen) == 4 and not [p for p in seen if _alive(p)]  # the tree went with it
    finally:
        await server.aclose()


async def test_harness_with_preload_kills_the_tree_past_its_limit(tok, tmp_path):
    pidfile = tmp_path / "pids"
    command = ExternalCommand(argv=(PY, str(SCRIPTS / "hanger.py"), str(pidfile)), timeout_s=3, kill_grace_s=0.5,
                              preload=("json",), env={"PYTHONPATH": LIB})
    harness = ExternalHarness(command, registry=AttemptRegistry(tok), base_url="http://127.0.0.1:9")
    task = Task(id="t", prompt="p", evaluator=Evaluator(command="true"))
    seen: list[int] = []
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                async def watch():
                    seen.extend(await _hang_pids(pidfile))
                n.start_soon(watch)
                ep = await harness.run(task, NoSandbox(), None)
    finally:
        await harness.aclose()
    assert ep.final_state == "timeout" and ep.timed_out
    assert len(seen) == 4 and set(seen) <= set(ep.killed_pids) and not [p for p in seen if _alive(p)]
    assert harness.forkserver is not None and harness.forkserver.starts == 1
    assert harness.forkserver._proc is None  # closed with the harness


@pytest.mark.parametrize(("module", "why"), [
    ("no_such_module_here", "preloading 'no_such_module_here' failed: ModuleNotFoundError"),
    ("threaded_mod", "left threads running (started-at-import)"),
])
async def test_a_preload_that_fails_is_a_clear_error(tmp_path, module, why):
    server = ForkServer(PY, [module], _env())
    try:
        with trio.fail_after(60), pytest.raises(ForkServerFailed, match="did not start") as err:
            await _probe(server, tmp_path)
    finally:
        await server.aclose()
    assert why in str(err.value)


@pytest.mark.parametrize(("fields", "why"), [
    ({"argv": ["python"], "preload": ["openai"]}, "preload needs argv"),
    ({"argv": ["python", "-c", "print(1)"], "preload": ["openai"]}, "not interpreter options"),
    ({"argv": ["python", "-m"], "preload": ["openai"]}, "preload needs argv"),
    ({"argv": ["{prompt}", "x.py"], "preload": ["openai"]}, "cannot hold a placeholder"),
    ({"argv": ["python", "x.py"], "preload": ["open-ai"]}, "module name"),
])
def test_bad_preload_settings_are_config_errors(fields, why):
    with pytest.raises(msgspec.ValidationError, match=why):
        msgspec.convert(fields, ExternalCommand)
    assert msgspec.convert({"argv": ["python", "-m", "pkg.agent"], "preload": ["openai", "litellm.utils"]},
                           ExternalCommand).preload == ("openai", "litellm.utils")
