"""fleetrl.actors.report: a run's metrics and held-out evaluations -> PNG plots + HTML.

`write_report(state_dir, out_dir) -> Path` (the HTML page) is what the daemon calls at
the end of a run and what ``fleetrl report STATE_DIR`` runs. Pure parts: `records`
(parsing, file:line errors), `summary` (the numbers), `html` (the page); `plots` draws.
docs/guides/report.md says what each plot shows.
"""

from .records import EvalRow, Log, ReportInputError, parse_evals, parse_metrics, read_evals, read_metrics
from .report import REPORT_FILE, write_report
from .summary import (MismatchMultiple, Summary, bound_ratio_band, fleet_kl, fleet_mismatch_multiple,
                      run_mismatch_multiple, summarize)

__all__ = [
    "EvalRow", "Log", "MismatchMultiple", "REPORT_FILE", "ReportInputError", "Summary",
    "bound_ratio_band", "fleet_kl", "fleet_mismatch_multiple", "parse_evals", "parse_metrics", "read_evals",
    "read_metrics", "run_mismatch_multiple", "summarize", "write_report",
]
