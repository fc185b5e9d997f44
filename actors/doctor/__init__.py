"""fleetrl.actors.doctor: ``fleetrl doctor``, the hazards of a daemon config and of a run.

`check_config(cfg)` reads a loaded config (`fleetrl.daemon.config.load_config`) and
returns the `Hazard`s it holds: sampling settings that differ between the harness, the
endpoint, the trainer and the evaluator, staleness bounds the pacing cannot honour,
corrections and alarms switched off or weakened. `check_run(cfg, figures)` does the same
for a run's recent figures (`RunFigures`: the trainer's ``metrics.jsonl`` lines, the
support sizes of the workers' ATIF files), which `state.read_run` reads from its state
directory. `wiring` says which worker feeds which trainer through which pool with which
sampling settings. Everything but `state` and `cli` is pure. Every hazard id, its rule
and its fix: docs/guides/doctor.md.
"""

from .config_checks import check_config
from .errors import DoctorError, DoctorInputError
from .hazards import HAZARDS, Hazard, MetricsLine, RunFigures, SupportFigures, TrainerFigures, locate
from .run_checks import check_run

__all__ = [
    "HAZARDS", "DoctorError", "DoctorInputError", "Hazard", "MetricsLine", "RunFigures", "SupportFigures",
    "TrainerFigures", "check_config", "check_run", "locate",
]
