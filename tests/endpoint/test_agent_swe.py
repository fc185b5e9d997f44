"""configs/agent-swe.toml, shortened (issue 18, acceptance): mini-swe-agent from PyPI,
unchanged, runs as the external harness of an environment worker against the daemon's
endpoint (every call through the sampler pool) on repository tasks that the
repo_tasks actor builds from iniconfig's sdist and checks in sandboxes; the trainer
trains a few steps from its groups.

Checked: the shipped config is the one run (only paths, sizes and budgets change here);
the tasks are built and checked once and reused by a second start; every group the
worker emitted reached the trainer and went into a train step's batch: the harness's
attempts, each model call a row of its own with the context the sampler saw (a
retokenisation break is never trained as one stream; breaks are reported by cause); no
container is left behind.

The tiny model does not fix bugs: every reward is 0, so every advantage is 0 and the
trainer builds each batch and skips its optimizer update ("zero advantage"; the config's
``skip_zero_variance = false`` lets such groups into batches at all). With a model that
solves some tasks the same path updates the weights (tests/endpoint/test_external_trains.py
shows that path with reward variance)."""

from __future__ import annotations

import tomllib
from functools import partial
from pathlib import Path

import pytest
import trio
from helpers import read_jsonl, supervisor_for

from fleetrl.actors.runs.tomlw import dumps
from fleetrl.harness.chat import BREAK_CAUSES

from .test_external_worker import containers_of

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
BATCHES = 3
GROUP = 2


def shortened(tmp_path: Path, model_dir: Path) -> str:
    doc = tomllib.loads((REPO / "configs" / "agent-swe.toml").read_text())
    del doc["daemon"]["state_dir"]
    doc["daemon"]["grace_s"] = 60.0
    doc["logging"] = {"file": False}
    del doc["actors"]["warm_start"]  # the test's own tiny model (4,096-token context)
    a = doc["actors"]
    a["repo_tasks"]["config"] |= {"out": str(tmp_path / "repo.jsonl"), "packages": ["iniconfig"]}
    a["trainer"]["after"] = []
    a["trainer"]["config"] |= {"model_dir": str(model_dir), "checkpoint_every": 1000}
    a["pool"]["config"] |= {"weights_dir": str(tmp_path / "state" / "actors" / "trainer" / "weights"),
                            "attempts_per_step": GROUP, "join": False}
    a["pool"]["config"]["samplers"][0]["model_dir"] = str(model_dir)
    a["endpoint"]["config"]["model"]["tokenizer_dir"] = str(model_dir)
    env = a["env"]["config"]
    env |= {"tasks": {"kind": "jsonl", "path": str(tmp_path / "repo.jsonl"), "repeat": True},
            "group_size": GROUP, "max_concurrent_attempts": GROUP, "drain_grace_s": 5.0}
    argv = env["harness_config"]["argv"]
    for i, a_ in enumerate(argv):  # two model calls of 48 tokens per attempt
        argv[i] = {"agent.step_limit=4": "agent.step_limit=2",
                   "model.model_kwargs.max_tokens=256": "model.model_kwargs.max_tokens=48"}.get(a_, a_)
    env["harness_config"]["timeout_s"] = 240
    return dumps(doc)


async def test_mini_swe_agent_through_the_shipped_config_trains_steps(tmp_path, long_model_dir, image):
    text = shortened(tmp_path, long_model_dir)
    assert "agent.step_limit=2" in text and "mini_textbased.yaml" in text
    sup, state = supervisor_for(tmp_path, text)
    with state, trio.fail_after(1200):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            repo = (await sup.wait_handle("repo_tasks")).statistics()
            trainer = await sup.wait_handle("trainer")
            env = await sup.wait_handle("env")
            metrics = state.path / "actors" / "trainer" / "metrics.jsonl"
            while not metrics.exists() or len(read_jsonl(metrics)) < BATCHES:
                await trio.sleep(0.5)
            sup.request_shutdown("test")
        env_stats, trainer_stats = env.statistics(), trainer.statistics()
    assert repo.tasks >= 1 and not repo.reused
    assert not containers_of(state.path)
    steps = read_jsonl(state.path / "actors" / "trainer" / "metrics.jsonl")
    assert len(steps) >= BATCHES, steps
    # every group the worker emitted reached the trainer (admitted: in a batch or still queued)
    # (the trainer also counts the failed attempts reported to it: "attempt_failed")
    received = sum(k for outcome, k in trainer_stats.groups.items() if outcome != "attempt_failed")
    assert env_stats.groups.get("emitted", 0) == received, (env_stats, trainer_stats)
    assert trainer_stats.groups.get("admitted", 0) >= BATCHES
    for s in steps:
        # one group of the harness's attempts; each model call a row with its own context,
        # so a retokenisation break is never trained across; breaks reported by cause
        assert s["groups"] == 1 and s["trajectories"] == GROUP and s["rows"] >= GROUP and s["tokens"] > 0, s
        assert set(s.get("retokenization_breaks", {})) <= set(BREAK_CAUSES), s
        assert s["reward_mean"] == 0.0 and s["skipped_reason"] == "zero advantage", s

    # a second start reuses the checked task file (no sandbox)
    sup2, state2 = supervisor_for(tmp_path, text, state="state2")
    with state2, trio.fail_after(300):
        async with trio.open_nursery() as n:
            await n.start(partial(sup2.run, handle_signals=False))
            again = (await sup2.wait_handle("repo_tasks")).statistics()
            sup2.request_shutdown("test")
    assert again.reused and again.tasks == repo.tasks
