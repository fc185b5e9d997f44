"""fleetrl.actors.report: a run's metrics and held-out evaluations -> PNG plots + HTML.

`write_report(state_dir, out_dir) -> Path` (the HTML page) is what the daemon calls at
the end of a run and what ``fleetrl report STATE_DIR`` runs. Pure parts: `records`
(parsing, file:line errors), `summary` (the numbers), `html` (the page); `plots` draws.
docs/guides/report.md says what each plot shows.
"""

from .records import EvalRow, Log, ReportInputError, parse_evals, parse_metrics, read_evals, read_metrics
from .report import REPORT_FILE, write_report
from .summary import Summary, bound_ratio_band, summarize

__all__ = [
    "EvalRow", "Log", "REPORT_FILE", "ReportInputError", "Summary",
    "bound_ratio_band", "parse_evals", "parse_metrics", "read_evals", "read_metrics",
    "summarize", "write_report",
]
