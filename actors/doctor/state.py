"""Reading a run's recent figures from its state directory (the doctor's only file I/O
besides the config).

* each trainer's ``actors/<trainer>/metrics.jsonl`` (one `StepMetrics` JSON line per
  step, written by `fleetrl.actors.trainer.core.Trainer.train`): its last ``steps``
  lines, each as a dict, so that fields of other releases are read when present and
  never required. A half-written last line (a crash mid-write) is left out; any other
  line that is not a JSON object is an error naming the file and line.
* each local environment worker's ATIF files when it writes supports (``atif =
  {support = true}``; `fleetrl.actors.envworker.atif_files`): the newest ``atif_files``
  files, and in them the size of every recorded support (``metrics.extra.fleetrl.support``,
  `fleetrl.daemon.tokens.SupportCSR.from_json`), by rule.

A missing file is no figure (a run that has not trained yet); a state directory that is
not a directory, or a file that cannot be read or parsed, is a `DoctorInputError`.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np

from fleetrl.actors.envworker.atif_files import SUFFIX, atif_dir
from fleetrl.actors.workers.config import RemoteWorkersConfig
from fleetrl.daemon.config import Config
from fleetrl.daemon.tokens import SupportCSR

from .hazards import MetricsLine, RunFigures, SupportFigures, TrainerFigures
from .errors import DoctorInputError
from .wiring import wiring

__all__ = ["ATIF_FILES", "STEPS", "read_metrics", "read_run", "read_supports"]

STEPS = 50
"""Recent steps read by default (``--steps``)."""
ATIF_FILES = 200
"""Newest ATIF files read per worker."""


def read_run(config: Config, state_dir: Path, *, steps: int = STEPS, atif_files: int = ATIF_FILES) -> RunFigures:
    """The figures of the run of ``config`` in ``state_dir`` (module docstring)."""
    state_dir = Path(state_dir)
    if not state_dir.is_dir():
        raise DoctorInputError(f"state directory {state_dir}: "
                               + ("not a directory" if state_dir.exists() else "not found"))
    w = wiring(config)
    trainers = []
    for name in w.trainers:
        path = state_dir / "actors" / name / "metrics.jsonl"
        trainers.append(TrainerFigures(trainer=name, path=str(path), lines=tuple(read_metrics(path, steps))))
    supports = []
    for feed in w.feeds:
        out = None if isinstance(feed.cfg, RemoteWorkersConfig) else feed.cfg.atif_output()
        if out is not None and out.support:
            supports.append(read_supports(atif_dir(state_dir, feed.name, out), feed.name, atif_files))
    return RunFigures(state_dir=str(state_dir), trainers=tuple(trainers), supports=tuple(supports))


def read_metrics(path: Path, steps: int = STEPS) -> list[MetricsLine]:
    """The last ``steps`` lines of a ``metrics.jsonl`` (none when it does not exist)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise DoctorInputError(f"{path}: cannot read: {exc}") from None
    lines = raw.split(b"\n")
    last = len(lines) if raw.endswith(b"\n") else len(lines) - 1  # a last line without newline may be cut
    kept: deque[MetricsLine] = deque(maxlen=max(steps, 1))
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            data = json.loads(text)
        except ValueError as exc:
            if i > last:
                continue  # half written
            raise DoctorInputError(f"{path}:{i}: not a JSON line: {exc}") from None
        if not isinstance(data, dict):
            raise DoctorInputError(f"{path}:{i}: not a JSON object (a StepMetrics line)")
        kept.append(MetricsLine(line=i, data=data))
    return list(kept)


def _supports_of(doc: Any) -> list[Any]:
    steps = doc.get("steps") if isinstance(doc, dict) else None
    out = []
    for step in steps if isinstance(steps, list) else ():
        metrics = step.get("metrics") if isinstance(step, dict) else None
        extra = metrics.get("extra") if isinstance(metrics, dict) else None
        own = extra.get("fleetrl") if isinstance(extra, dict) else None
        if isinstance(own, dict) and "support" in own:
            out.append(own["support"])
    return out


def read_supports(directory: Path, worker: str, newest: int = ATIF_FILES) -> SupportFigures:
    """The support sizes recorded in the newest ``newest`` ATIF files of ``directory``."""
    try:
        files = [p for p in directory.iterdir() if p.name.endswith(SUFFIX) and p.is_file()]
    except FileNotFoundError:
        files = []
    except OSError as exc:
        raise DoctorInputError(f"{directory}: cannot list: {exc}") from None
    dated = []
    for p in files:
        try:
            dated.append((p.stat().st_mtime_ns, p.name, p))
        except FileNotFoundError:
            continue  # removed by the worker's bound since the listing
    files = [p for _, _, p in sorted(dated)[-newest:]] if newest > 0 else []
    listed: Counter[int] = Counter()
    vocabulary = 0
    for path in files:
        try:
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            continue  # removed by the worker's bound since the listing
        except (OSError, ValueError) as exc:
            raise DoctorInputError(f"{path}: cannot read an ATIF document: {exc}") from None
        for i, obj in enumerate(_supports_of(doc)):
            try:
                csr = SupportCSR.from_json(obj, where=f"{path}: agent step {i}: support")
            except ValueError as exc:
                raise DoctorInputError(str(exc)) from None
            sizes = np.diff(csr.offsets.to_numpy())
            if csr.rule == "vocabulary":
                vocabulary += int(sizes.size)
            else:
                listed.update(int(k) for k in sizes.tolist())
    return SupportFigures(worker=worker, path=str(directory), files=len(files), listed=dict(listed),
                          vocabulary=vocabulary)
