"""`fleetrl ablate`: run every ablation arm, in every regime and seed, as a real
`fleetrl serve`, then compare each arm with the reference arm (a), paired per seed.

Two trees. ``--out DIR`` gets the results (small, meant to be kept)::

    ablation.md, ablation.json          every regime's tables, the fleets' mismatch
                                        multiple, the command that made them
    <regime>/ablation.md, .json         that regime's tables: arms, paired differences
                                        against (a) with intervals, runs
    <regime>/compare_*.png              one plot per metric, one band per arm over seeds
    <regime>/seed-<s>/<arm>/            config.toml (what ran), metrics.jsonl and
                                        eval.jsonl (copied from the run), run.json

``--work DIR`` gets what the runs need while they run (large: weights, checkpoints)::

    shared/seed-<s>/models/             seed s's warm-model cache, shared by its arms
    <regime>/seed-<s>/<arm>/state/      the run's state directory
    <regime>/seed-<s>/<arm>/serve.log   the daemon's stdout and stderr

Runs go seed by seed, regime by regime, arm by arm, one at a time, each with the same
step budget. The reference arm does not depend on the regime (variants.py): it runs
once per seed, in the first regime, and the other regimes read the same run. Every
config is checked by the daemon's own loader before the first run starts.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from .compare import RunStats, run_stats
from .paired import ArmComparison, compare_arms
from .plots import COMPARISONS, write_comparisons
from .serve import StepSeen, run_serve
from .tables import DEFINITIONS, arms_table, diff_table, runs_table, text_table
from .tomlw import dumps
from .variants import (EVALUATOR, TRAINER, Regime, Variant, VariantError, actors_by_factory, apply_seed,
                       apply_variant, pool_config, set_eval_tasks, trainer_config)

__all__ = ["SHARED", "Arm", "Ablation", "MISMATCH_GOAL", "load_toml", "mismatch_multiple", "prepare_arm",
           "read_arm", "run_ablation"]

#: state-directory subfolders every arm of a seed shares (the warm-model cache)
SHARED = ("models",)
#: the hard fleet's mismatch KL should be at least this multiple of the mild fleet's
MISMATCH_GOAL = 4.0

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
    """One prepared run: where its config, state, log and records live."""

    regime: str
    seed: int
    key: str
    name: str
    label: str
    config: Path
    """The config it runs (in the record directory)."""
    state: Path
    log: Path
    metrics: Path
    evals: Path | None
    record: Path
    """``<out>/<regime>/seed-<s>/<arm>/``."""
    reused_from: str = ""
    """``<regime>/seed-<s>/<arm>`` of the run whose results this arm reads (the
    reference arm in the second and later regimes); empty: it runs."""

    @property
    def path(self) -> str:
        return f"{self.regime}/seed-{self.seed}/{self.name}"


def _actor_file(cfg: dict[str, Any], factory: str, name: str, state: Path) -> Path | None:
    names = actors_by_factory(cfg, factory)
    return state / "actors" / names[0] / name if names else None


def prepare_arm(cfg: dict[str, Any], variant: Variant, out_dir: Path, work_dir: Path, *, regime: Regime,
                seed: int, steps: int | None, trainer: str = TRAINER,
                evaluator: str = EVALUATOR) -> tuple[Arm, dict[str, Any]]:
    """Write ``<out>/<regime>/seed-<s>/<arm>/config.toml`` for ``variant`` on the seeded
    config ``cfg`` and check that the daemon accepts it; returns the arm and its config.
    ``trainer`` / ``evaluator``: the factories whose actors write ``metrics.jsonl`` /
    ``eval.jsonl`` (fleetrl's own by default; a user's own actors work the same way)."""
    rel = Path(regime.key) / f"seed-{seed}" / variant.name
    record, run_dir = out_dir.absolute() / rel, work_dir.absolute() / rel
    state = run_dir / "state"
    shared = {s: str(work_dir.absolute() / "shared" / f"seed-{seed}" / s) for s in SHARED}
    arm_cfg = apply_variant(cfg, variant, state_dir=str(state), steps=steps, shared=shared, regime=regime)
    record.mkdir(parents=True, exist_ok=True)
    path = record / "config.toml"
    path.write_text(f"# fleetrl ablate: regime {regime.key}, seed {seed}, arm {variant.label}\n" + dumps(arm_cfg),
                    encoding="utf-8")
    from fleetrl.daemon.config import load_config
    from fleetrl.daemon.faults import ConfigError

    try:
        load_config(path)
    except ConfigError as exc:
        raise VariantError(f"arm {rel}: the daemon refuses its config: {exc}") from None
    metrics = _actor_file(arm_cfg, trainer, "metrics.jsonl", state)
    if metrics is None:
        raise VariantError(f"{variant.name}: the config has no trainer actor (factory = {trainer!r})")
    arm = Arm(regime=regime.key, seed=seed, key=variant.key, name=variant.name, label=variant.label, config=path,
              state=state, log=run_dir / "serve.log", metrics=metrics,
              evals=_actor_file(arm_cfg, evaluator, "eval.jsonl", state), record=record)
    return arm, arm_cfg


def read_arm(metrics: Path, evals: Path | None) -> tuple[list, list]:
    """(steps, evaluations) logged by a run."""
    from fleetrl.actors.report.records import read_evals, read_metrics

    steps = list(read_metrics(metrics).rows)
    rows = list(read_evals(evals).rows) if evals else []
    return steps, rows


def _progress(arm: Arm, budget: int | None, log: Log) -> Callable[[StepSeen], None]:
    def on_step(s: StepSeen) -> None:
        of = f"/{budget}" if budget else ""
        log(f"[ablate] {arm.path}: step {s.step}{of}, {s.groups} groups, {s.at_s:.0f} s")
    return on_step


def _copy(src: Path | None, dst: Path) -> None:
    if src is not None and src.exists():
        shutil.copyfile(src, dst)


def _write_record(arm: Arm, stats: RunStats, metrics: Path | None, evals: Path | None) -> None:
    _copy(metrics, arm.record / "metrics.jsonl")
    _copy(evals, arm.record / "eval.jsonl")
    (arm.record / "run.json").write_bytes(msgspec.json.format(msgspec.json.encode(stats)) + b"\n")


def run_arm(arm: Arm, *, timeout_s: float, budget: int | None,
            log: Log = _stderr) -> tuple[RunStats, list, list]:
    """Run one arm to its end; returns its numbers and its (steps, evaluations), and
    copies its logs into its record directory."""
    from fleetrl.actors.report.records import ReportInputError

    log(f"[ablate] {arm.label} ({arm.path}): fleetrl serve --config {arm.config} (log: {arm.log})")
    res = run_serve(arm.config, arm.state, arm.log, metrics_path=arm.metrics, timeout_s=timeout_s,
                    on_step=_progress(arm, budget, log))
    error = ""
    if res.timed_out:
        error = f"timed out after {timeout_s:g} s"
    elif res.exit_code != 0:
        error = f"fleetrl serve exited {res.exit_code} (see {arm.log})"
    try:
        steps, evals = read_arm(arm.metrics, arm.evals)
    except ReportInputError as exc:
        steps, evals, error = [], [], (error + "; " if error else "") + str(exc)
    stats = run_stats(regime=arm.regime, seed=arm.seed, key=arm.key, name=arm.name, label=arm.label,
                      exit_code=res.exit_code, wall_s=res.wall_s, steps=steps, evals=evals, budget=budget,
                      timed_out=res.timed_out, error=error)
    _write_record(arm, stats, arm.metrics, arm.evals)
    log(f"[ablate] {arm.path}: exit {res.exit_code} after {res.wall_s:.0f} s"
        + (f" ({error})" if error else "") + (f"; collapsed: {stats.collapse.reason}" if stats.collapse.collapsed else ""))
    return stats, steps, evals


def _finished_record(arm: Arm, config_text: str | None) -> RunStats | None:
    """The record an earlier invocation left for this arm, if it finished cleanly with
    the same config (``--resume``)."""
    try:
        stats = msgspec.json.decode((arm.record / "run.json").read_bytes(), type=RunStats)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    if stats.exit_code != 0 or stats.error or config_text is None:
        return None
    if config_text != arm.config.read_text(encoding="utf-8") or not (arm.record / "metrics.jsonl").exists():
        return None
    return stats


def mismatch_multiple(hard_kl: float | None, mild_kl: float | None) -> float | None:
    """The hard fleet's mean mismatch KL over the mild fleet's (None: either is missing
    or the mild one is 0)."""
    if hard_kl is None or mild_kl is None or not mild_kl > 0:
        return None
    return hard_kl / mild_kl


def _fleet_kl(runs: Sequence[RunStats], fleet_key: str) -> float | None:
    xs = [r.kl_mean for r in runs if r.key == fleet_key and r.kl_mean is not None]
    return statistics.fmean(xs) if xs else None


def _samplers(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        return [dict(s) for s in pool_config(cfg).get("samplers", []) if isinstance(s, dict)]
    except VariantError:
        return []


def _kinds_line(runs: Sequence[RunStats], key: str) -> str:
    """Arm ``key``'s share of tokens and mean KL per sampler kind, over its seeds."""
    mine = [r for r in runs if r.key == key]
    tokens: dict[str, int] = {}
    kls: dict[str, list[float]] = {}
    for r in mine:
        for k, n in r.tokens_by_sampler.items():
            tokens[k] = tokens.get(k, 0) + n
        for k, v in r.kl_by_sampler.items():
            kls.setdefault(k, []).append(v)
    total = sum(tokens.values())
    if not total:
        return "n/a"
    return "; ".join(f"{k} {100 * n / total:.0f}% of tokens, KL {statistics.fmean(kls[k]):.2e}" if k in kls
                     else f"{k} {100 * n / total:.0f}% of tokens" for k, n in sorted(tokens.items()))


def _fleet_line(samplers: Sequence[dict[str, Any]]) -> str:
    parts = []
    for s in samplers:
        d = f"{s.get('id')}: {s.get('backend', 'torch')} {s.get('dtype', 'fp32')}"
        if s.get("dtype") == "fp8" and s.get("backend", "torch") == "torch":
            d += f" ({s.get('fp8_scheme', 'block128')} scales)"
        if s.get("process"):
            d += ", child process"
        parts.append(d)
    return "; ".join(parts) or "n/a"


class Ablation:
    """One invocation: the prepared arms, then their results (see `run_ablation`)."""

    def __init__(self, *, config: Path, out_dir: Path, work_dir: Path, variants: Sequence[Variant],
                 regimes: Sequence[Regime], seeds: Sequence[int], steps: int | None, eval_tasks: int | None,
                 command: str, trainer: str = TRAINER, evaluator: str = EVALUATOR) -> None:
        if not variants or not regimes or not seeds:
            raise VariantError("an ablation needs at least one arm, one regime and one seed")
        refs = [v for v in variants if v.reference]
        if len(refs) != 1:
            raise VariantError("the arms must include the reference arm (a) exactly once: every other arm is "
                               f"compared with it (arms given: {', '.join(v.name for v in variants)})")
        self.reference = refs[0]
        self.fleet_key = "b" if any(v.key == "b" for v in variants) else next(
            (v.key for v in variants if not v.reference), self.reference.key)
        self.config, self.out_dir, self.work_dir = config, out_dir, work_dir
        self.variants, self.regimes, self.seeds = list(variants), list(regimes), list(seeds)
        self.steps, self.eval_tasks, self.command = steps, eval_tasks, command
        cfg = load_toml(config)
        self.budget = steps
        if self.budget is None and trainer == TRAINER:
            self.budget = trainer_config(cfg).get("max_steps")
        self.arms: list[Arm] = []
        self.fleets: dict[str, list[dict[str, Any]]] = {}
        self._old_configs: dict[Path, str | None] = {}
        for seed in self.seeds:
            seeded = apply_seed(cfg, seed, trainer=trainer)
            if eval_tasks is not None:
                seeded = set_eval_tasks(seeded, eval_tasks, evaluator=evaluator)
            ref_arm: Arm | None = None
            for regime in self.regimes:
                for v in self.variants:
                    if v.reference and ref_arm is not None:
                        rel = Path(regime.key) / f"seed-{seed}" / v.name
                        self.arms.append(msgspec.structs.replace(
                            ref_arm, regime=regime.key, record=out_dir.absolute() / rel, reused_from=ref_arm.path))
                        continue
                    record_cfg = out_dir.absolute() / regime.key / f"seed-{seed}" / v.name / "config.toml"
                    self._old_configs[record_cfg] = record_cfg.read_text(encoding="utf-8") if record_cfg.exists() else None
                    arm, arm_cfg = prepare_arm(seeded, v, out_dir, work_dir, regime=regime, seed=seed, steps=steps,
                                               trainer=trainer, evaluator=evaluator)
                    self.arms.append(arm)
                    if v.reference:
                        ref_arm = arm
                    if v.key == self.fleet_key and regime.key not in self.fleets:
                        self.fleets[regime.key] = _samplers(arm_cfg)

    def run(self, *, timeout_s: float, resume: bool = False, log: Log = _stderr) -> dict[str, Any]:
        """Run (or, with ``resume``, reuse the finished records of) every arm, then write
        the outputs; returns the summary (also ``<out>/ablation.json``)."""
        done: dict[str, tuple[RunStats, list, list]] = {}
        for arm in self.arms:
            if arm.reused_from:
                stats, steps, evals = done[arm.reused_from]
                stats = msgspec.structs.replace(stats, regime=arm.regime, reused_from=arm.reused_from)
                arm.record.mkdir(parents=True, exist_ok=True)
                src = self._arm_at(arm.reused_from)
                _copy(src.config, arm.record / "config.toml")
                _write_record(arm, stats, src.record / "metrics.jsonl", src.record / "eval.jsonl")
                done[arm.path] = (stats, steps, evals)
                continue
            old = _finished_record(arm, self._old_configs.get(arm.config)) if resume else None
            if old is not None:
                log(f"[ablate] {arm.path}: finished in an earlier run; read from {arm.record}")
                evals_copy = arm.record / "eval.jsonl"
                steps, evals = read_arm(arm.record / "metrics.jsonl", evals_copy if evals_copy.exists() else None)
                done[arm.path] = (old, steps, evals)
                continue
            done[arm.path] = run_arm(arm, timeout_s=timeout_s, budget=self.budget, log=log)
        return self._write(done, log)

    def _arm_at(self, path: str) -> Arm:
        return next(a for a in self.arms if a.path == path)

    def _write(self, done: dict[str, tuple[RunStats, list, list]], log: Log) -> dict[str, Any]:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        budget = "the config's" if self.steps is None else str(self.steps)
        kls: dict[str, float | None] = {}
        regimes_out: dict[str, Any] = {}
        sections: list[str] = []
        for regime in self.regimes:
            arms = [a for a in self.arms if a.regime == regime.key]
            runs = [done[a.path][0] for a in arms]
            evals = {(a.seed, a.key): done[a.path][2] for a in arms}
            comparisons = compare_arms(runs, evals, reference=self.reference.key)
            kls[regime.key] = _fleet_kl(runs, self.fleet_key)
            rdir = self.out_dir / regime.key
            rdir.mkdir(parents=True, exist_ok=True)
            labels = list(dict.fromkeys(a.label for a in arms))
            write_comparisons({lb: [done[a.path][1] for a in arms if a.label == lb] for lb in labels},
                              {lb: [done[a.path][2] for a in arms if a.label == lb] for lb in labels}, rdir)
            body = self._regime_md(regime, runs, comparisons, kls[regime.key], plots_in="")
            (rdir / "ablation.md").write_text(
                f"# Ablation, regime {regime.key}\n\nMade by:\n\n```\n{self.command}\n```\n\n"
                f"Config: `{self.config}`; steps per arm: {budget}; finished {when}.\n\n{body}", encoding="utf-8")
            data = {"regime": regime.key, "label": regime.label, "command": self.command, "config": str(self.config),
                    "seeds": self.seeds, "steps": self.steps, "eval_tasks": self.eval_tasks,
                    "fleet": self.fleets.get(regime.key, []),
                    "fleet_kl": {"arm": self.fleet_key, "mean": kls[regime.key]},
                    "reference": self.reference.key, "runs": runs, "comparisons": comparisons}
            (rdir / "ablation.json").write_bytes(msgspec.json.format(msgspec.json.encode(data)) + b"\n")
            regimes_out[regime.key] = {"md": str(rdir / "ablation.md"), "json": str(rdir / "ablation.json"),
                                       "fleet_kl": kls[regime.key],
                                       "collapsed": [f"{r.key}/seed-{r.seed}" for r in runs if r.collapse.collapsed],
                                       "failed": [f"{r.key}/seed-{r.seed}" for r in runs
                                                  if r.exit_code != 0 or r.error]}
            sections.append(f"## Regime {regime.key}\n\n"
                            + self._regime_md(regime, runs, comparisons, kls[regime.key], plots_in=f"{regime.key}/"))
        if "hard" in kls and "mild" not in kls:
            kls["mild"] = self._earlier_kl("mild")
        multiple = mismatch_multiple(kls.get("hard"), kls.get("mild"))
        headline = self._multiple_line(multiple, kls)
        summary = {"ablation": str(self.out_dir), "command": self.command, "config": str(self.config),
                   "seeds": self.seeds, "steps": self.steps, "eval_tasks": self.eval_tasks,
                   "fleet_arm": self.fleet_key, "fleet_kl": kls, "mismatch_multiple": multiple,
                   "mismatch_goal": MISMATCH_GOAL, "regimes": regimes_out,
                   "ok": not any(v["failed"] for v in regimes_out.values())}
        md = [f"# Corrections ablation ({when})", "", "Made by:", "", "```", self.command, "```", "",
              f"Config: `{self.config}`; steps per arm: {budget}; seeds: {', '.join(map(str, self.seeds))}; "
              f"held-out tasks per set: {self.eval_tasks or 'as configured'}.", "", headline, "", *sections]
        (self.out_dir / "ablation.md").write_text("\n".join(md) + "\n", encoding="utf-8")
        (self.out_dir / "ablation.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
        log(text_table([done[a.path][0] for a in self.arms]).rstrip("\n"))
        return summary

    def _regime_md(self, regime: Regime, runs: Sequence[RunStats], comparisons: Sequence[ArmComparison],
                   kl: float | None, *, plots_in: str) -> str:
        fleet = self.fleets.get(regime.key, [])
        ref = self.reference.label
        kl_text = "n/a" if kl is None else f"{kl:.2e}"
        return "\n".join([
            f"{regime.label}. Fleet of the arms other than {ref}: {_fleet_line(fleet)}.",
            f"Fleet mismatch (mean k3 KL per token of arm ({self.fleet_key})): {kl_text}; by sampler kind: "
            f"{_kinds_line(runs, self.fleet_key)}.",
            "",
            "### Arms (mean over seeds [lowest, highest seed])",
            "",
            arms_table(runs),
            f"### Paired against {ref} (arm minus (a): mean over seeds [95% interval])",
            "",
            diff_table(comparisons),
            "### Runs",
            "",
            runs_table(runs),
            DEFINITIONS,
            "",
            "Plots (one band per arm over seeds): " + ", ".join(f"`{plots_in}{n}`" for n in COMPARISONS),
            "",
        ])

    def _earlier_kl(self, regime: str) -> float | None:
        """The fleet KL an earlier invocation wrote for ``regime`` in the same ``--out``."""
        try:
            data = msgspec.json.decode((self.out_dir / regime / "ablation.json").read_bytes())
            value = data["fleet_kl"]["mean"]
        except (OSError, msgspec.DecodeError, KeyError, TypeError):
            return None
        return float(value) if isinstance(value, (int, float)) else None

    @staticmethod
    def _multiple_line(multiple: float | None, kls: dict[str, float | None]) -> str:
        def kl(k: str) -> str:
            v = kls.get(k)
            return "n/a" if v is None else f"{v:.2e}"

        if multiple is None:
            return (f"Mismatch multiple of the hard fleet: n/a (mean k3 KL of the fleet arm: hard {kl('hard')}, "
                    f"mild {kl('mild')}; both regimes are needed).")
        verdict = "meets" if multiple >= MISMATCH_GOAL else "**misses**"
        return (f"Mismatch multiple of the hard fleet: **{multiple:.1f}x** the mild fleet's mean k3 KL "
                f"(hard {kl('hard')}, mild {kl('mild')}); {verdict} the goal of >= {MISMATCH_GOAL:g}x.")


def run_ablation(config: Path, out_dir: Path, variants: Sequence[Variant], *, regimes: Sequence[Regime],
                 seeds: Sequence[int], steps: int | None, timeout_s: float, command: str,
                 work_dir: Path | None = None, eval_tasks: int | None = None, resume: bool = False,
                 log: Log = _stderr, trainer: str = TRAINER, evaluator: str = EVALUATOR) -> dict[str, Any]:
    """Prepare every arm of every regime and seed (all configs are checked before the
    first run), run them in order, write the outputs; returns the summary. ``work_dir``
    (the runs' state) defaults to ``out_dir/work``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ablation = Ablation(config=config, out_dir=out_dir, work_dir=work_dir or out_dir / "work", variants=variants,
                        regimes=regimes, seeds=seeds, steps=steps, eval_tasks=eval_tasks, command=command,
                        trainer=trainer, evaluator=evaluator)
    return ablation.run(timeout_s=timeout_s, resume=resume, log=log)
