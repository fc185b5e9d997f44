"""`write_report`: a run's state directory -> PNG plots and an HTML page.

Reads ``<state>/actors/trainer/metrics.jsonl`` (the trainer's `StepMetrics`, one per
step) and ``<state>/actors/evaluator/eval.jsonl`` (held-out evaluations). Actors named
otherwise are found too, as long as there is only one file of each kind under
``<state>/actors/*/``. When the environment workers wrote their attempts as ATIF files
(``<state>/trajectories/``, docs/guides/atif.md), the page links them beside the
rollouts trained. docs/guides/report.md says how to read the result.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from .html import render_html
from .plots import (PLOTS, plot_delta_ratio, plot_grad_norm, plot_learning, plot_mismatch_kl,
                    plot_staleness)
from .records import Log, ReportInputError, read_evals, read_metrics
from .summary import summarize

__all__ = ["REPORT_FILE", "TRAJECTORIES_DIR", "find_log", "trajectory_files", "write_report"]

REPORT_FILE = "index.html"
TRAJECTORIES_DIR = "trajectories"
SUMMARY_FILE = "summary.json"


def find_log(state_dir: Path, name: str, actor: str) -> Path | None:
    """``<state>/actors/<actor>/<name>`` if it exists, else the only ``actors/*/<name>``."""
    preferred = state_dir / "actors" / actor / name
    if preferred.is_file():
        return preferred
    found = sorted(p for p in (state_dir / "actors").glob(f"*/{name}") if p.is_file())
    if len(found) > 1:
        raise ReportInputError(
            f"{state_dir}: several {name} files ({', '.join(str(p) for p in found)}); "
            f"expected one, preferably at actors/{actor}/{name}")
    return found[0] if found else None


def _run_title(state_dir: Path) -> str:
    rid = state_dir / "run_id"
    run_id = rid.read_text(encoding="utf-8").strip() if rid.is_file() else ""
    return f"fleetrl run report: {state_dir.name}" + (f" (run {run_id})" if run_id else "")


def write_report(state_dir: Path, out_dir: Path) -> Path:
    """Write the plots, ``summary.json`` and ``index.html`` into ``out_dir``; return the
    HTML path. Raises `ReportInputError` (naming file:line) on unreadable input."""
    state_dir = Path(state_dir)
    out_dir = Path(out_dir)
    if not state_dir.is_dir():
        raise ReportInputError(f"{state_dir}: no such state directory")
    mpath = find_log(state_dir, "metrics.jsonl", "trainer")
    epath = find_log(state_dir, "eval.jsonl", "evaluator")
    if mpath is None and epath is None:
        raise ReportInputError(
            f"{state_dir}: found neither actors/*/metrics.jsonl nor actors/*/eval.jsonl; "
            "is this the state directory of a run that trained?")
    mlog = read_metrics(mpath) if mpath else Log(path="")
    elog = read_evals(epath) if epath else Log(path="")
    steps, evals = list(mlog.rows), list(elog.rows)
    summary = summarize(steps, evals,
                        truncated=[log.path for log in (mlog, elog) if log.truncated])
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_learning(steps, evals, out_dir / "learning.png")
    plot_grad_norm(steps, out_dir / "grad_norm.png")
    plot_mismatch_kl(steps, out_dir / "mismatch_kl.png")
    plot_staleness(steps, out_dir / "staleness.png")
    plot_delta_ratio(steps, out_dir / "delta_ratio.png")
    (out_dir / SUMMARY_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
    page = out_dir / REPORT_FILE
    page.write_text(render_html(summary, PLOTS, title=_run_title(state_dir),
                                trajectories=trajectory_files(state_dir, out_dir)), encoding="utf-8")
    return page


def trajectory_files(state_dir: Path, out_dir: Path) -> tuple[str, int] | None:
    """``<state>/trajectories`` (the environment workers' ATIF files, ``atif`` in their
    config) as a link relative to ``out_dir`` and the number of files under it; None when
    there are none."""
    tdir = Path(state_dir) / TRAJECTORIES_DIR
    if not tdir.is_dir():
        return None
    n = sum(1 for p in tdir.rglob("*.atif.json") if p.is_file())
    if not n:
        return None
    return Path(os.path.relpath(tdir.resolve(), Path(out_dir).resolve())).as_posix(), n
