"""The warm-start actor: builds (or finds) the warm model, points the link at it before
anyone that is `after` it starts, replaces a stale link atomically, refuses to clobber a
real directory."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import pytest
import trio

from fleetrl.actors.recipe import WarmRecipe, check_warm_dir
from fleetrl.actors.warm_start import WarmStartConfig, point_link
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor

MICRO = ("{ model = { hidden_size = 32, num_layers = 1, num_heads = 2, num_kv_heads = 2, intermediate_size = 64, "
         "max_position_embeddings = 256 }, warmup = { steps = %d, batch_size = 2, warmup_steps = 1 } }")


def test_point_link_is_atomic_and_never_clobbers(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    link = tmp_path / "models" / "tiny"
    point_link(link, a)
    assert link.resolve() == a.resolve()
    point_link(link, b)  # a new recipe: the link moves
    assert link.resolve() == b.resolve()
    real = tmp_path / "real"
    real.mkdir()
    with pytest.raises(ValueError, match="exists and is not a symlink"):
        point_link(real, a)
    assert real.is_dir() and not real.is_symlink()


def test_config_is_checked():
    with pytest.raises(ValueError, match="WarmStartConfig.link must be a non-empty path"):
        WarmStartConfig(cache_dir="c", link="")
    with pytest.raises(ValueError, match="WarmStartConfig.threads must be an int >= 1"):
        WarmStartConfig(cache_dir="c", link="l", threads=0)
    assert isinstance(WarmStartConfig(cache_dir="c", link="l").recipe, WarmRecipe)


def _config(tmp_path: Path, steps: int) -> str:
    return f"""
[daemon]
grace_s = 600.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
[actors.warm_start]
factory = "fleetrl.actors.warm_start:run"
[actors.warm_start.config]
cache_dir = "{tmp_path / 'cache'}"
link = "{tmp_path / 'models' / 'tiny'}"
recipe = {MICRO % steps}
"""


async def test_builds_links_and_reports_started(tmp_path):
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(load_config_text(_config(tmp_path, 2), source="t.toml"), state, rng=random.Random(0))
    with state, trio.fail_after(300):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))  # once every actor has started
            link = tmp_path / "models" / "tiny"
            assert link.is_symlink() and check_warm_dir(link.resolve(), link.resolve().name[5:]) is None
            assert sup.status()["actors"]["warm_start"]["versions"]["model"] == link.resolve().name
            sup.request_shutdown("test")



def test_the_terminal_shows_the_run_the_warm_up_steps_and_the_cache(tmp_path, fleetrl_bin):
    """`fleetrl serve` with ``console = "warnings"`` and ``progress = true``: the first line
    names the run and where the log goes; the warm-up shows a bar of its steps with the
    loss; the next start says the cache had the model."""
    import subprocess
    import time

    cfg = tmp_path / "warm.toml"
    cfg.write_text(_config(tmp_path, 6).replace("[http]", '[logging]\nconsole = "warnings"\n[http]')
                   + "progress = true\n")
    state = tmp_path / "state"
    log = state / "logs" / "daemon.jsonl"
    for start in ("first", "second"):
        proc = subprocess.Popen([fleetrl_bin, "serve", "--config", str(cfg), "--state-dir", str(state)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with proc:
            first_line = proc.stderr.readline()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and (not log.exists() or log.read_text().count('"daemon running"')
                                                    < (1 if start == "first" else 2)):
                time.sleep(0.2)
            proc.terminate()
            rest = proc.stderr.read()
            assert proc.wait(60) == 0, rest
        assert first_line.startswith("fleetrl: run run-") and "starting 1 actors" in first_line, first_line
        assert f"every log line: {log}" in first_line
        if start == "first":
            assert "warm start: building the warm model" in rest, rest
            assert "warm-up: 100%" in rest and "6/6" in rest and "loss=" in rest, rest
        else:
            assert "warm start: warm model found in cache" in rest and "warm-up:" not in rest, rest
