"""`fleetrl ablate`: run every ablation arm as a real `fleetrl serve`, then compare.

Layout under ``--out DIR``::

    shared/models/            the warm-model cache all arms share (built by the first)
    <arm>/config.toml         the arm's config (variants.py transforms of yours)
    <arm>/state/              its state directory (metrics, evaluations, report, logs)
    <arm>/serve.log           the daemon's stdout and stderr
    ablation.md               the table (markdown) and the command that made it
    ablation.json             the same numbers, machine-readable
    compare_*.png             one comparison plot per metric

Arms run one after another on the same machine with the same budget and seeds.
"""

from __future__ import annotations

import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from .compare import ArmResult, arm_result, markdown_table, text_table
from .plots import COMPARISONS, write_comparisons
from .serve import StepSeen, run_serve
from .tomlw import dumps
from .variants import (EVALUATOR, TRAINER, Variant, VariantError, actors_by_factory,
                       apply_variant, trainer_config)

__all__ = ["SHARED", "Arm", "load_toml", "prepare_arm", "read_arm", "run_ablation", "write_outputs"]

#: state-directory subfolders every arm shares (the warm-model cache)
SHARED = ("models",)

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_toml(path: Path) -> dict[str, Any]:
    """Parse a config file; a missing or malformed file is a `VariantError` naming it."""
    try:
        with Path(path).open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise VariantError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise VariantError(f"{path}: not valid TOML: {exc}") from None


class Arm(msgspec.Struct, frozen=True, kw_only=True):
    """One prepared run: where its config, state and log live."""

    key: str
    name: str
    label: str
    config: Path
    state: Path
    log: Path
    metrics: Path
    evals: Path | None


def _actor_file(cfg: dict[str, Any], factory: str, name: str, state: Path) -> Path | None:
    names = actors_by_factory(cfg, factory)
    return state / "actors" / names[0] / name if names else None


def prepare_arm(cfg: dict[str, Any], variant: Variant, out_dir: Path, *, steps: int | None,
                trainer: str = TRAINER, evaluator: str = EVALUATOR) -> Arm:
    """Write ``<out>/<arm>/config.toml`` for ``variant`` and check that the daemon accepts
    it. ``trainer`` / ``evaluator``: the factories whose actors write ``metrics.jsonl`` /
    ``eval.jsonl`` (fleetrl's own by default; a user's own actors work the same way)."""
    out_dir = out_dir.absolute()
    arm_dir = out_dir / variant.name
    state = arm_dir / "state"
    shared = {s: str(out_dir / "shared" / s) for s in SHARED}
    arm_cfg = apply_variant(cfg, variant, state_dir=str(state), steps=steps, shared=shared)
    arm_dir.mkdir(parents=True, exist_ok=True)
    path = arm_dir / "config.toml"
    path.write_text(f"# fleetrl ablate: arm {variant.label}\n" + dumps(arm_cfg), encoding="utf-8")
    from fleetrl.daemon.config import load_config
    from fleetrl.daemon.faults import ConfigError

    try:
        load_config(path)
    except ConfigError as exc:
        raise VariantError(f"arm {variant.name}: the daemon refuses its config: {exc}") from None
    metrics = _actor_file(arm_cfg, trainer, "metrics.jsonl", state)
    if metrics is None:
        raise VariantError(f"{variant.name}: the config has no trainer actor (factory = {trainer!r})")
    return Arm(key=variant.key, name=variant.name, label=variant.label, config=path, state=state,
               log=arm_dir / "serve.log", metrics=metrics,
               evals=_actor_file(arm_cfg, evaluator, "eval.jsonl", state))


def read_arm(arm: Arm) -> tuple[list, list]:
    """(steps, evaluations) logged by an arm's run."""
    from fleetrl.actors.report.records import read_evals, read_metrics

    steps = list(read_metrics(arm.metrics).rows)
    evals = list(read_evals(arm.evals).rows) if arm.evals else []
    return steps, evals


def _progress(arm: Arm, budget: int | None, log: Log) -> Callable[[StepSeen], None]:
    def on_step(s: StepSeen) -> None:
        of = f"/{budget}" if budget else ""
        log(f"[ablate] {arm.name}: step {s.step}{of}, {s.groups} groups, {s.at_s:.0f} s")
    return on_step


def run_arm(arm: Arm, *, timeout_s: float, budget: int | None,
            log: Log = _stderr) -> tuple[ArmResult, list, list]:
    """Run one arm to its end; returns its result and its (steps, evaluations)."""
    from fleetrl.actors.report.records import ReportInputError

    log(f"[ablate] {arm.label}: fleetrl serve --config {arm.config} (log: {arm.log})")
    res = run_serve(arm.config, arm.state, arm.log, metrics_path=arm.metrics, timeout_s=timeout_s,
                    on_step=_progress(arm, budget, log))
    error = ""
    if res.timed_out:
        error = f"timed out after {timeout_s:g} s"
    elif res.exit_code != 0:
        error = f"fleetrl serve exited {res.exit_code} (see {arm.log})"
    try:
        steps, evals = read_arm(arm)
    except ReportInputError as exc:
        steps, evals, error = [], [], (error + "; " if error else "") + str(exc)
    result = arm_result(key=arm.key, name=arm.name, label=arm.label, exit_code=res.exit_code,
                        wall_s=res.wall_s, steps=steps, evals=evals, error=error)
    log(f"[ablate] {arm.name}: exit {res.exit_code} after {res.wall_s:.0f} s"
        + (f" ({error})" if error else ""))
    return result, steps, evals


def write_outputs(results: Sequence[ArmResult], runs: dict[str, tuple[list, list]], out_dir: Path, *,
                  command: str, config: Path, steps: int | None) -> Path:
    """ablation.md, ablation.json and the comparison plots; returns the markdown path."""
    write_comparisons({r.label: runs[r.name][0] for r in results},
                      {r.label: runs[r.name][1] for r in results}, out_dir)
    budget = "the config's" if steps is None else str(steps)
    md = [
        "Made by:",
        "",
        "```",
        command,
        "```",
        "",
        f"Config: `{config}`; steps per arm: {budget}; finished {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        markdown_table(results),
        "reward AUC: area under the training-reward curve / its length (mean height). "
        "grad-norm std: population std of the pre-clip gradient norm over trained steps. "
        "Pass@1: the last held-out evaluation of each arm, 95% interval in brackets.",
        "",
        "Plots: " + ", ".join(f"`{n}`" for n in COMPARISONS),
        "",
    ]
    for r in results:
        if r.error:
            md.append(f"- {r.label}: {r.error}")
    path = out_dir / "ablation.md"
    path.write_text("\n".join(md) + "\n", encoding="utf-8")
    (out_dir / "ablation.json").write_bytes(
        msgspec.json.format(msgspec.json.encode({"command": command, "config": str(config),
                                                 "steps": steps, "arms": list(results)})) + b"\n")
    return path


def run_ablation(config: Path, out_dir: Path, variants: Sequence[Variant], *, steps: int | None,
                 timeout_s: float, command: str, log: Log = _stderr, trainer: str = TRAINER,
                 evaluator: str = EVALUATOR) -> tuple[list[ArmResult], Path]:
    """Prepare every arm (all configs are checked before the first run), run them in
    order, write the outputs; returns the results and the markdown path."""
    cfg = load_toml(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = [prepare_arm(cfg, v, out_dir, steps=steps, trainer=trainer, evaluator=evaluator)
            for v in variants]
    budget = steps
    if budget is None and trainer == TRAINER:
        budget = trainer_config(cfg).get("max_steps")
    results, runs = [], {}
    for arm in arms:
        result, steps_logged, evals = run_arm(arm, timeout_s=timeout_s, budget=budget, log=log)
        results.append(result)
        runs[arm.name] = (steps_logged, evals)
    md = write_outputs(results, runs, out_dir, command=command, config=config, steps=steps)
    log(text_table(results).rstrip("\n"))
    return results, md
