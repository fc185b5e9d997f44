"""Harbor tasks in real Docker sandboxes: the hand-written task in
tests/harness/harbor_tasks/hello-upper (its FROM python:3.11-slim mapped to the local
fleetrl-sandbox:py311) is built, prepared and scored.

Checked: the image is built once and then reused; before verification the sandbox
holds the Dockerfile's work-dir files but no /tests and none of the test files; doing
nothing scores 0, also when the agent plants a reward file and a test file of its own;
the reference solution scores 1, also through the attempt path (`external.run_attempt`)
with an agent that runs solve.sh and saw no test file; a test.sh writing reward.json
(several lines, partial credit) scores it; one writing no reward file is an evaluator
error naming the files; an unknown FROM is an error naming the image, the Dockerfile
line and the fix; a fleetrl task exported as a Harbor directory and then edited is
built and scored as a plain Harbor task; the ``harbor`` task source builds and serves
a directory of tasks, skipping a broken one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import structlog
import trio

from fleetrl.actors.envworker.config import HarborTasks
from fleetrl.actors.envworker.sources import open_task_source
from fleetrl.harness.errors import EvaluatorOutputError
from fleetrl.harness.external import run_attempt
from fleetrl.harness.harbor import (
    harbor_build_plan,
    harbor_task,
    harbor_task_and_plan,
    read_harbor_dir,
)
from fleetrl.harness.harbor_export import write_harbor_dir
from fleetrl.harness.protocol import Episode, evaluate_in_sandbox, prepare_sandbox
from fleetrl.harness.recording import AttemptRecord
from fleetrl.harness.trace_import import TemplateError, load_template_harbor
from fleetrl.harness.tasks import Evaluator, Setup, Task
from fleetrl.sandboxes import Limits, open_sandbox
from fleetrl.sandboxes.harbor_image import (
    BASES_LABEL,
    HarborImageError,
    ensure_harbor_image,
)

pytestmark = pytest.mark.docker

HELLO = Path(__file__).parents[1] / "harness" / "harbor_tasks" / "hello-upper"
MAP = {"python:3.11-slim": "fleetrl-sandbox:py311"}


async def sh(sb, cmd: str) -> tuple[int, str]:
    r = await sb.exec(cmd, timeout=30)
    return r.exit_code, r.stdout.decode() + r.stderr.decode()


@pytest.fixture
def hello(tmp_path) -> Path:
    return Path(shutil.copytree(HELLO, tmp_path / "hello-upper"))


def build(path: Path, docker_client, image_map=MAP):
    hdir = read_harbor_dir(path)
    return hdir, ensure_harbor_image(harbor_build_plan(hdir, image_map), client=docker_client)


async def test_hand_written_task_builds_hides_its_tests_and_scores(docker_client, engine, ownership, image):
    hdir, built = await trio.to_thread.run_sync(build, HELLO, docker_client)
    task = harbor_task(hdir, MAP)
    assert built.tag == task.image
    again = await trio.to_thread.run_sync(lambda: ensure_harbor_image(harbor_build_plan(hdir, MAP),
                                                                       client=docker_client))
    assert not again.built  # same content, same bases: reused
    assert docker_client.images.get(task.image).labels[BASES_LABEL] == docker_client.images.get(image).id

    with trio.fail_after(120):
        async with open_sandbox(engine, image=task.image, limits=Limits(workdir=task.workdir),
                                ownership=ownership) as sb:
            await prepare_sandbox(task, sb)
            assert await sh(sb, "cat /app/greeting.txt") == (0, "hello harbor\n")
            code, out = await sh(sb, "ls /tests; ls -R /tmp; grep -rl EXPECTED_SUFFIX /app /tmp /fleetrl-harbor /home /opt /srv")
            assert "check_outputs" not in out and "test.sh" not in out, out

            reward, _, out = await evaluate_in_sandbox(task, sb)
            assert reward == 0.0, out

            # the agent plants a reward and a test of its own: the evaluator starts afresh
            await sb.write_files({"/tmp/fleetrl-harbor/logs/verifier/reward.txt": "1\n",
                                  "/tmp/fleetrl-harbor/tests/check_outputs.py": "import sys; sys.exit(0)\n",
                                  "/tmp/fleetrl-harbor/incoming/check_outputs.py": "import sys; sys.exit(0)\n"})
            reward, _, out = await evaluate_in_sandbox(task, sb)
            assert reward == 0.0, out

            # the reference solution, run as an agent would
            await sb.write_files({"/tmp/solve.sh": hdir.solution["solve.sh"]})
            assert (await sh(sb, "bash /tmp/solve.sh"))[0] == 0
            reward, code, out = await evaluate_in_sandbox(task, sb)
            assert (reward, code, out) == (1.0, 0, '{"reward": 1}\n')
            assert (await sh(sb, "cat /logs/verifier/test-stdout.txt"))[1].startswith("want 'HELLO HARBOR!'")


async def test_reward_json_and_a_missing_reward(hello, docker_client, engine, ownership, image):
    (hello / "tests" / "test.sh").write_text(
        '#!/bin/bash\nif [ -f /app/partial ]; then\n  printf \'{\\n  "reward": 0.5,\\n  "lines": 2\\n}\\n\' '
        '> /logs/verifier/reward.json\nfi\necho "ran as $(id -u) in $PWD"\n')
    hdir, _ = await trio.to_thread.run_sync(build, hello, docker_client)
    task = harbor_task(hdir, MAP)
    assert task.image == harbor_task(read_harbor_dir(HELLO), MAP).image  # tests are not part of the image
    with trio.fail_after(120):
        async with open_sandbox(engine, image=task.image, limits=Limits(workdir=task.workdir),
                                ownership=ownership) as sb:
            await prepare_sandbox(task, sb)
            with pytest.raises(EvaluatorOutputError, match="wrote neither /logs/verifier/reward.txt nor "
                                                           "/logs/verifier/reward.json"):
                await evaluate_in_sandbox(task, sb)
            await sb.write_files({"partial": ""})
            reward, _, out = await evaluate_in_sandbox(task, sb)
            assert reward == 0.5 and out == '{  "reward": 0.5,  "lines": 2}\n'
            assert "ran as 1000 in /app" in (await sh(sb, "cat /logs/verifier/test-stdout.txt"))[1]


async def test_unknown_from_is_a_clear_error(hello, docker_client):
    (hello / "environment" / "Dockerfile").write_text("# base\nFROM registry.invalid/nothing:404\nWORKDIR /app\n")
    with pytest.raises(HarborImageError) as err:
        await trio.to_thread.run_sync(build, hello, docker_client, {})
    text = str(err.value)
    assert "'registry.invalid/nothing:404' is not available locally" in text
    assert "Dockerfile line 2: 'FROM registry.invalid/nothing:404'" in text
    assert "--map-image registry.invalid/nothing:404=fleetrl-sandbox:py311" in text


def test_a_harbor_template_names_an_image_that_exists(hello, docker_client, image):
    """`traces import --template-harbor` / the ingest actor's ``harbor:`` templates build
    the template's image (with the image map), so the tasks made on it can run; an
    unmapped FROM that is not local is a TemplateError naming the image."""
    template = load_template_harbor(str(hello), MAP)
    docker_client.images.get(template.image)  # raises ImageNotFound if it was not built
    assert template.image == harbor_task(read_harbor_dir(hello), MAP).image
    with pytest.raises(TemplateError, match="python:3.11-slim"):
        load_template_harbor(str(hello), {})


async def test_an_exported_task_runs_as_a_harbor_task(tmp_path, docker_client, engine, ownership, image):
    task = Task(id="count/off-by-one", prompt="Fix count.py.",
                setup=Setup(files={"count.py": "def count(xs):\n    return len(xs) - 1\n"},
                            commands=["echo built > marker.txt"]),
                evaluator=Evaluator(command="python3 -c 'import count; assert count.count([1, 2]) == 2'"))
    out = write_harbor_dir(task, tmp_path / "count")
    (out / "environment" / "NOTES").write_text("edited after export\n")  # no longer fleetrl's own export
    hdir = read_harbor_dir(out)
    plain, plan = harbor_task_and_plan(hdir)
    assert plan is not None and plain.image == plan.tag
    await trio.to_thread.run_sync(lambda: ensure_harbor_image(plan, client=docker_client))
    with trio.fail_after(120):
        async with open_sandbox(engine, image=plain.image, limits=Limits(workdir=plain.workdir),
                                ownership=ownership) as sb:
            await prepare_sandbox(plain, sb)
            assert await sh(sb, "cat marker.txt") == (0, "built\n")
            reward, _, out_text = await evaluate_in_sandbox(plain, sb)
            assert reward == 0.0, out_text
            await sb.write_files({"count.py": "def count(xs):\n    return len(xs)\n"})
            reward, _, out_text = await evaluate_in_sandbox(plain, sb)
            assert reward == 1.0, out_text


async def test_the_harbor_task_source_builds_and_serves(tmp_path, docker_client, image):
    broken = tmp_path / "set" / "broken"
    shutil.copytree(HELLO, tmp_path / "set" / "hello-upper")
    shutil.copytree(HELLO, broken)
    (broken / "instruction.md").unlink()
    cfg = HarborTasks(paths=(str(tmp_path / "set"),), image_map=MAP, repeat=False)
    source = await trio.to_thread.run_sync(open_task_source, cfg, structlog.get_logger())
    task = source.get(0)
    assert task.id == "harbor:hello-upper" and source.get(1) is None
    assert docker_client.images.get(task.image)


class OracleHarness:
    """An agent that runs the task's reference solution; it records what it could see."""

    def __init__(self, solve_sh: bytes) -> None:
        self.solve_sh = solve_sh
        self.seen = ""

    async def run(self, task, sandbox, model) -> Episode:
        r = await sandbox.exec("ls -a /app /tests/ /tmp/fleetrl-harbor 2>&1; echo", timeout=30)
        self.seen = r.stdout.decode()
        await sandbox.write_files({"/tmp/solve.sh": self.solve_sh})
        r = await sandbox.exec("bash /tmp/solve.sh", timeout=30)
        assert r.exit_code == 0, r.stderr
        return Episode(task_id=task.id, turns=(), final_state="submitted",
                       record=AttemptRecord(attempt_id="oracle", task_id=task.id))


async def test_the_attempt_path_scores_the_reference_solution(docker_client, engine, ownership, image):
    hdir, _ = await trio.to_thread.run_sync(build, HELLO, docker_client)
    task = harbor_task(hdir, MAP)
    harness = OracleHarness(hdir.solution["solve.sh"])
    with trio.fail_after(120):
        async with open_sandbox(engine, image=task.image, limits=Limits(workdir=task.workdir),
                                ownership=ownership) as sb:
            result = await run_attempt(harness, task, sb)
    assert (result.reward, result.eval_exit_code) == (1.0, 0)
    assert "greeting.txt" in harness.seen and "check_outputs" not in harness.seen and "test.sh" not in harness.seen
    assert "cannot access '/tests/'" in harness.seen and "cannot access '/tmp/fleetrl-harbor'" in harness.seen
