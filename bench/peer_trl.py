"""Benchmark: fleetrl's daemon against TRL's GRPOTrainer, the same model, tasks, settings
and machine, one after the other in one run.

What a user choosing between the two would compare. Both systems

* start from the same warm tiny model (the embedded recipe's, built into
  ``.fleetrl/models`` if absent, as `make run` does);
* train on the synthetic coding tasks' training stream (seed 0), ``--groups`` groups of
  ``--group-size`` attempts per optimizer step, for ``--steps`` steps;
* with the same optimizer and schedule (AdamW, betas 0.9/0.999, eps 1e-8, no weight
  decay, ``--lr`` with cosine decay to 10 %, no warm-up, gradient clip 1.0), the same
  loss shape (advantage = reward minus the group mean, no std scaling; token-mean loss
  over the batch; no KL term) and the same sampling (temperature 1.0, top-p 0.95, at
  most 48 new tokens, stop at <eos>);
* get their rewards from the same checker in the same sandbox: each task's own checker
  run by fleetrl's checker driver inside fleetrl's Docker sandbox image with the
  daemon's limits (256 MiB, 1 CPU). The daemon scores through its environment workers;
  TRL's reward function leases a sandbox from a warm pool and scores the whole batch in
  one exec (`bench/peer_trl_run.py`);
* are evaluated the same way before and after: sampled pass@1 on the same ``--eval-n``
  fresh held-out tasks (task seed 1, sampling seed 0), by the same sampler code.

fleetrl runs as a real `fleetrl serve` of ``--config`` (default configs/tiny.toml: three
samplers fp32/bf16/fp8 following the trainer through deltas, staleness up to 2, the
three corrections) without its held-out evaluator, with the step budget and the
settings above. TRL runs in its own process, its own generation (transformers
``generate``; no vLLM), with 2 torch threads (``--trl-threads``): its fastest setting on
these 2-core machines when nothing else runs (2.1 s per step against 3.2 s with one
thread; docs/results/peers.md). fleetrl runs as shipped (one torch thread per actor
thread, ``[daemon] compute_threads``).

Printed per system: wall-clock (launch to exit, and to the last step), seconds per step
and trained groups per minute between the first and the last step (start-up excluded:
both pay it once), groups with reward variance per minute, generated tokens per second
(every attempt sampled, trained or not), peak resident memory of its process tree
(containers excluded: both use the same sandboxes), and fresh pass@1 before and after
with the gain paired per task (95% bootstrap). Then the ratios fleetrl / TRL, and one
JSON line.

What could not be made equal (also in docs/results/peers.md):

* fleetrl trains only groups with reward variance (``skip_zero_variance``): a step holds
  ``--groups`` groups that all carry a gradient, and zero-variance groups are sampled
  and dropped; TRL's step holds ``--groups`` prompts whatever their rewards (zero-variance
  groups get zero advantage). Both counts are printed.
* fleetrl samples asynchronously (up to 2 versions stale, corrected by the trainer);
  TRL samples with the weights it trains (on-policy).
* fleetrl's samplers run fp32, bf16 and fp8; TRL generates in fp32.
* The cosine's last step: fleetrl reaches the floor at the last step, transformers'
  schedule one step after it.

Run: .venv/bin/python bench/peer_trl.py [--steps 60] [--out DIR] [--only fleetrl|trl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cpu import cpu_model

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1.5
"""The issue's goal: fleetrl's trained groups per minute at least 1.5x TRL's."""


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def machine() -> str:
    """The CPU model and core count (what the figures depend on)."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


# -- memory --------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and every descendant (sum of VmRSS)."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
        todo += _children(p)
    return total


class PeakMemory:
    """Samples a process tree's resident memory every ``every_s`` in a thread; `peak`."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self.peak = 0
        self._pid: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def watch(self, pid: int) -> None:
        self._pid = pid
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._pid is not None:
                self.peak = max(self.peak, tree_rss_bytes(self._pid))
            self._stop.wait(self.every_s)

    def stop(self) -> int:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak


# -- evaluation ----------------------------------------------------------------------

def evaluate(backend: Any, n: int) -> dict[str, Any]:
    from fleetrl.actors.recipe.evaluate import EvalSampling, evaluate_pass_at_1

    r = evaluate_pass_at_1("", split="fresh", n=n, task_seed=1, sampling=EvalSampling(seed=0), backend=backend)
    return {"pass_at_1": r.pass_at_1.rate, "low": r.pass_at_1.low, "high": r.pass_at_1.high,
            "mean_reward": r.mean_reward, "passes": [1.0 if x == 1.0 else 0.0 for x in r.rewards]}


def model_backend(model_dir: Path, weights_dir: Path | None = None) -> Any:
    """A torch fp32 sampler of ``model_dir``, moved to the newest version in ``weights_dir``."""
    import trio

    from fleetrl.actors.pool.local import AsyncStoreSource, WeightSync
    from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
    from fleetrl.actors.weights import LocalDirStore, StoreSource

    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))
    if weights_dir is not None:
        sync = WeightSync(backend, AsyncStoreSource(StoreSource(LocalDirStore(weights_dir))))
        version = trio.run(sync.sync)
        say(f"[peer trl] fleetrl's final weights: version {version.version}")
    return backend


# -- the two arms ----------------------------------------------------------------------

WARM_START = "fleetrl.actors.warm_start:run"


def fleetrl_config(config: Path, state: Path, models: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The fleetrl arm's config: ``config`` without its evaluator (and, with
    ``--model-dir``, without its warm start), the settings of the module docstring."""
    from fleetrl.actors.runs.ablate import load_toml
    from fleetrl.actors.runs.variants import (EVALUATOR, drop_actors, pool_config, relocate, set_max_steps,
                                              trainer_config)

    cfg = drop_actors(load_toml(config), EVALUATOR)
    if args.model_dir is not None:  # the model is given: nothing to build, the link points at it
        cfg = drop_actors(cfg, WARM_START)
    cfg = set_max_steps(cfg, args.steps)
    tr = trainer_config(cfg)
    tr.update(lr=args.lr, lr_schedule="cosine", lr_min_ratio=0.1, lr_warmup_steps=0, groups_per_step=args.groups,
              grad_clip=1.0, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, temperature=1.0)
    for actor in cfg["actors"].values():
        if actor.get("factory") == "fleetrl.actors.envworker:run":
            c = actor["config"]
            c["group_size"] = args.group_size
            c["tasks"] = {"kind": "synthetic", "seed": 0}
            c["harness_config"] = {**c.get("harness_config", {}), "max_tokens": 48, "temperature": 1.0,
                                   "top_p": 0.95}
    pool_config(cfg)["attempts_per_step"] = args.groups * args.group_size
    return relocate(cfg, str(state), shared={"models": str(models)})


def run_fleetrl(args: argparse.Namespace, out: Path, models: Path, warm: Path) -> dict[str, Any]:
    from fleetrl.actors.runs.serve import run_serve
    from fleetrl.actors.runs.tomlw import dumps

    state = out / "state"
    if args.model_dir is not None:  # the configs name the model by the warm start's link
        models = out / "models"
        models.mkdir(parents=True, exist_ok=True)
        link = models / "tiny"
        if not link.is_symlink():
            link.symlink_to(warm)
    cfg = fleetrl_config(args.config, state, models, args)
    path = out / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# bench/peer_trl.py: the fleetrl arm\n" + dumps(cfg), encoding="utf-8")
    trainer = next(n for n, a in cfg["actors"].items() if a.get("factory") == "fleetrl.actors.trainer:run")
    metrics = state / "actors" / trainer / "metrics.jsonl"
    say(f"[peer trl] fleetrl: fleetrl serve --config {path}")
    mem = PeakMemory()
    # run_serve starts the daemon; the memory watcher finds it by its command line
    threading.Thread(target=_follow_serve, args=(path, mem), daemon=True).start()

    def progress(s: Any) -> None:
        if s.step % 10 == 0:
            say(f"[peer trl] fleetrl: step {s.step} at {s.at_s:.0f} s")

    res = run_serve(path, state, out / "serve.log", metrics_path=metrics, timeout_s=args.timeout, on_step=progress)
    peak = mem.stop()
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    trained = [r for r in rows if not r.get("skipped")]
    steps = [(s.at_s, s.step) for s in res.steps]
    return {"exit_code": res.exit_code, "timed_out": res.timed_out, "wall_s": res.wall_s,
            "step_times": [t for t, _ in steps], "groups": [int(r.get("groups", 0)) for r in trained],
            "groups_with_variance": [int(r.get("groups", 0)) for r in trained],
            "groups_sampled": [int(r.get("groups_received", 0)) for r in rows],
            "tokens": [int(r.get("tokens_received", 0)) for r in rows],
            "reward_mean": [r.get("reward_mean") for r in trained], "peak_rss": peak,
            "weights_dir": str(state / "actors" / trainer / "weights"), "n_steps": len(trained)}


def _follow_serve(config: Path, mem: PeakMemory) -> None:
    """Find the `fleetrl serve` process of ``config`` and hand its pid to ``mem``."""
    needle = str(config).encode()
    for _ in range(600):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"serve" in cmd and needle in cmd:
                mem.watch(int(entry))
                return
        time.sleep(0.1)


def run_trl(args: argparse.Namespace, out: Path, warm: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / "peer_trl_run.py"), "--model-dir", str(warm), "--out", str(out),
           "--steps", str(args.steps), "--groups", str(args.groups), "--group-size", str(args.group_size),
           "--lr", str(args.lr), "--threads", str(args.trl_threads)]
    say("[peer trl] TRL: " + " ".join(cmd))
    out.mkdir(parents=True, exist_ok=True)
    mem = PeakMemory()
    t0 = time.time()
    with (out / "trl.log").open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        mem.watch(proc.pid)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    wall = time.time() - t0
    peak = mem.stop()
    steps_path = out / "steps.jsonl"
    rows = [json.loads(x) for x in steps_path.read_text().splitlines() if x.strip()] if steps_path.exists() else []
    return {"exit_code": code, "timed_out": code == -9, "wall_s": wall,
            "step_times": [r["time"] - t0 for r in rows], "groups": [r["groups"] for r in rows],
            "groups_with_variance": [r["groups_with_variance"] for r in rows],
            "groups_sampled": [r["groups"] for r in rows], "tokens": [r["tokens"] for r in rows],
            "reward_mean": [r["reward_mean"] for r in rows], "peak_rss": peak,
            "model_dir": str(out / "model"), "n_steps": len(rows)}


# -- figures -----------------------------------------------------------------------------

def throughput(run: dict[str, Any]) -> dict[str, Any]:
    """Rates between the first and the last step: what steps 2..N did in that time."""
    times = run["step_times"]
    fig: dict[str, Any] = {"steps": run["n_steps"], "wall_s": run["wall_s"], "peak_rss_mib": run["peak_rss"] / 2**20,
                           "first_step_s": times[0] if times else None, "last_step_s": times[-1] if times else None}
    if len(times) < 2 or len(run["groups"]) < 2:
        return fig
    span = times[-1] - times[0]
    minutes = span / 60
    fig.update(
        s_per_step=span / (len(times) - 1),
        groups_per_min=sum(run["groups"][1:]) / minutes,
        variance_groups_per_min=sum(run["groups_with_variance"][1:]) / minutes,
        sampled_groups_per_min=sum(run["groups_sampled"][1:]) / minutes,
        tokens_per_s=sum(run["tokens"][1:]) / span,
        groups_per_min_total=sum(run["groups"]) / (times[-1] / 60),
    )
    return fig


def gain(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    from fleetrl.actors.runs.paired import paired_interval

    m, lo, hi = paired_interval(after["passes"], before["passes"])
    return {"before": before["pass_at_1"], "after": after["pass_at_1"], "gain": m, "low": lo, "high": hi}


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def report(result: dict[str, Any]) -> None:
    fl, trl = result["fleetrl"], result["trl"]
    rows = [("wall, launch to exit (s)", "wall_s", ".0f"), ("first step at (s)", "first_step_s", ".0f"),
            ("s per step (steady)", "s_per_step", ".2f"), ("trained groups / min", "groups_per_min", ".1f"),
            ("  with reward variance / min", "variance_groups_per_min", ".1f"),
            ("sampled groups / min", "sampled_groups_per_min", ".1f"),
            ("generated tokens / s", "tokens_per_s", ".0f"),
            ("trained groups / min, from launch", "groups_per_min_total", ".1f"),
            ("peak memory (MiB)", "peak_rss_mib", ".0f")]
    print(f"{'':36} {'fleetrl':>10} {'TRL':>10} {'ratio':>7}")
    for label, key, spec in rows:
        a, b = fl["speed"].get(key), trl["speed"].get(key)
        ratio = a / b if a is not None and b else None
        print(f"{label:36} {_fmt(a, spec):>10} {_fmt(b, spec):>10} {_fmt(ratio, '.2f'):>7}")
    print(f"fresh pass@1 ({result['eval_n']} tasks), before -> after, gain [95% paired bootstrap]:")
    for name, r in (("fleetrl", fl), ("TRL", trl)):
        g = r.get("pass")
        if g:
            print(f"  {name:8} {100 * g['before']:.1f}% -> {100 * g['after']:.1f}%: "
                  f"{100 * g['gain']:+.1f} [{100 * g['low']:+.1f}, {100 * g['high']:+.1f}] points")
    d = result.get("fleetrl_minus_trl")
    if d:
        print(f"  fleetrl minus TRL after training: {100 * d['gain']:+.1f} [{100 * d['low']:+.1f}, "
              f"{100 * d['high']:+.1f}] points")
    r = result["ratios"].get("groups_per_min")
    if r is not None:
        print(f"trained groups per minute, fleetrl / TRL: {r:.2f}x (goal >= {GOAL}x at equal or better pass@1 gain)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.toml", help="fleetrl's config")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--groups", type=int, default=8, help="groups per optimizer step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--eval-n", type=int, default=400)
    ap.add_argument("--trl-threads", type=int, default=2, help="TRL's torch intra-op threads")
    ap.add_argument("--only", choices=("fleetrl", "trl"), default=None, help="run one system only")
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a new one under /tmp)")
    ap.add_argument("--models", type=Path, default=ROOT / ".fleetrl" / "models",
                    help="warm model cache (default: the one `make run` uses)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="start both from this model instead of the warm one (fleetrl's format; the config's "
                         "model paths must be the warm start's link, .fleetrl/models/tiny, as in configs/tiny.toml)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per system")
    args = ap.parse_args(argv)
    for name in ("steps", "groups", "group_size", "eval_n", "trl_threads"):
        if getattr(args, name) < 1 or (name == "steps" and args.steps < 2):
            ap.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'steps' else 1}")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        ap.error(f"--model-dir {args.model_dir}: no config.json there (a model directory fleetrl's samplers load)")
    if args.group_size < 2:
        ap.error("--group-size must be at least 2 (a group's advantages need two attempts)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import tempfile

    import torch

    from fleetrl.actors.recipe import ensure_warm_model

    torch.set_num_threads(1)
    out = (args.out or Path(tempfile.mkdtemp(prefix="fleetrl-peer-trl-"))).absolute()
    out.mkdir(parents=True, exist_ok=True)
    say(f"[peer trl] work directory {out}")
    warm = (args.model_dir.absolute() if args.model_dir is not None
            else ensure_warm_model(args.models, log=lambda line: say(f"[peer trl] {line}"), threads=2))
    result: dict[str, Any] = {"bench": "peer_trl", "steps": args.steps, "groups": args.groups,
                              "group_size": args.group_size, "lr": args.lr, "eval_n": args.eval_n,
                              "trl_threads": args.trl_threads, "machine": machine(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    say("[peer trl] evaluating the warm model")
    before = evaluate(model_backend(warm), args.eval_n)
    result["warm_pass_at_1"] = before["pass_at_1"]
    after: dict[str, dict[str, Any]] = {}
    for name in ("fleetrl", "trl"):
        if args.only not in (None, name):
            result[name] = {"speed": {}}
            continue
        run = (run_fleetrl(args, out / name, args.models, warm) if name == "fleetrl"
               else run_trl(args, out / name, warm))
        entry: dict[str, Any] = {"exit_code": run["exit_code"], "timed_out": run["timed_out"],
                                 "speed": throughput(run), "reward_mean": run["reward_mean"]}
        if run["exit_code"] == 0 and run["n_steps"] >= args.steps:
            say(f"[peer trl] evaluating {name}'s final model")
            backend = (model_backend(warm, Path(run["weights_dir"])) if name == "fleetrl"
                       else model_backend(Path(run["model_dir"])))
            after[name] = evaluate(backend, args.eval_n)
            entry["pass"] = gain(before, after[name])
        else:
            say(f"[peer trl] {name} did not finish {args.steps} steps (exit {run['exit_code']}); see {out / name}")
        result[name] = entry
    if len(after) == 2:
        from fleetrl.actors.runs.paired import paired_interval

        m, lo, hi = paired_interval(after["fleetrl"]["passes"], after["trl"]["passes"])
        result["fleetrl_minus_trl"] = {"gain": m, "low": lo, "high": hi}
    fs, ts = result["fleetrl"]["speed"], result["trl"]["speed"]
    result["ratios"] = {k: (fs[k] / ts[k] if fs.get(k) is not None and ts.get(k) else None)
                        for k in ("groups_per_min", "variance_groups_per_min", "tokens_per_s", "groups_per_min_total",
                                  "peak_rss_mib")}
    result["goal"] = GOAL
    report(result)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
