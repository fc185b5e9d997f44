"""The report's HTML page: a pure function of the summary and the plot file names.

Self-contained (inline CSS, no scripts, nothing fetched); images are relative links to
the PNGs written beside the page.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from urllib.parse import quote

from .records import EvalRow
from .summary import FP32_REFERENCE, REWARD_WINDOW, SPLITS, MismatchMultiple, MismatchRow, Summary

__all__ = ["MISMATCH_COLUMNS", "fmt_eval", "fmt_multiple", "mismatch_rows", "render_html", "summary_rows"]

MISMATCH_COLUMNS = ("sampler", "tokens", "steps", "k3 KL per token", "outside the band",
                    "log-ratio std", "max |log-ratio|")

_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.8em; text-align: left; }
th { background: #f3f3f3; }
figure { margin: 2em 0; }
figcaption { color: #555; }
img { max-width: 100%; }
.note { color: #a33; }
"""


def fmt_eval(row: EvalRow | None) -> str:
    """``"41.5% [36.4, 46.8] (n=200, step 12)"``, or ``"n/a"``."""
    if row is None:
        return "n/a"
    return (f"{100 * row.pass_at_1:.1f}% [{100 * row.ci_low:.1f}, {100 * row.ci_high:.1f}] "
            f"(n={row.n}, step {row.step})")


def _fmt(v: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def _num(v: float) -> str:
    return "n/a" if v != v else f"{v:.3g}"  # NaN: a diverged step


def fmt_multiple(mm: MismatchMultiple | None) -> str:
    """``"12.3x (fleet 1.2e-03 vs 1.0e-04: its torch/float32 samplers in the same steps, 10 steps)"``."""
    if mm is None:
        return f"n/a (no {FP32_REFERENCE} sampler in the fleet)"
    detail = f"fleet {mm.fleet_kl:.2e} vs {mm.reference_kl:.2e}: {mm.reference}, {mm.steps} steps"
    if mm.multiple is None:
        return f"n/a (the reference measured 0; {detail})"
    return f"{mm.multiple:.3g}x ({detail})"


def mismatch_rows(rows: tuple[MismatchRow, ...]) -> list[tuple[str, ...]]:
    """The cells of the mismatch table (`MISMATCH_COLUMNS`), one row per kind or sampler."""
    out = []
    for r in rows:
        f = r.figures
        name = f"{r.key} ({r.label})" if r.label else r.key
        out.append((name, str(f.tokens), str(r.steps), _num(f.kl_k3), f"{100 * f.frac_out_of_band:.2f}%",
                    _num(f.log_ratio_std), _num(f.log_ratio_max_abs)))
    return out


def summary_rows(s: Summary) -> list[tuple[str, str]]:
    """(label, value) rows of the summary table, in display order."""
    rows = []
    for split in SPLITS:
        rows.append((f"held-out pass@1, {split}, start", fmt_eval(s.heldout_start.get(split))))
        rows.append((f"held-out pass@1, {split}, end", fmt_eval(s.heldout_end.get(split))))
    rows += [
        (f"training reward, first {REWARD_WINDOW} steps", _fmt(s.reward_start, ".3f")),
        (f"training reward, last {REWARD_WINDOW} steps", _fmt(s.reward_end, ".3f")),
        ("optimizer steps", str(s.steps)),
        ("skipped steps", str(s.skipped_steps)),
        ("groups trained", str(s.groups)),
        ("rollouts trained", str(s.trajectories)),
        ("wall-clock, first to last held-out evaluation", _fmt(s.wall_clock_s, ".0f", " s")),
        ("trainer busy time (steps + publishing)", f"{s.trainer_busy_s:.0f} s"),
        ("training wall-clock (what time_budget_s counts)", _fmt(s.training_s, ".0f", " s")),
        ("$ per rollout", "not priced" if s.usd_per_rollout is None else f"${s.usd_per_rollout:.6f}"),
        ("retokenization breaks (trained, by cause)",
         ", ".join(f"{cause} {n}" for cause, n in s.retokenization_breaks.items()) or "none"),
        ("sampler-trainer mismatch, all samplers (k3 KL per token)",
         "n/a" if s.fleet_mismatch_kl is None else f"{s.fleet_mismatch_kl:.3g}"),
        ("fleet mismatch as a multiple of a homogeneous fp32 fleet's", fmt_multiple(s.mismatch_multiple)),
    ]
    return rows


def render_html(s: Summary, plots: Mapping[str, tuple[str, str]], *, title: str,
                trajectories: tuple[str, int] | None = None) -> str:
    """The page: a summary table, then each plot (file name -> (title, caption)).
    ``trajectories``: (relative link, count) of the run's rollout files (ATIF), listed
    under the rollouts trained."""
    esc = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head><body>",
        f"<h1>{esc(title)}</h1>",
        "<h2>Summary</h2>",
        "<table>",
    ]
    for label, value in summary_rows(s):
        out.append(f"<tr><th>{esc(label)}</th><td>{esc(value)}</td></tr>")
        if label == "rollouts trained" and trajectories is not None:
            href, n = trajectories
            out.append(f'<tr><th>rollout trajectories (ATIF files)</th><td><a href="{esc(quote(href))}/">'
                       f"{n} file{'s' if n != 1 else ''} in {esc(href)}/</a></td></tr>")
    out.append("</table>")
    for path in s.truncated:
        out.append(f'<p class="note">{esc(path)}: its last line was cut short (the run was '
                   "interrupted while writing) and is left out.</p>")
    if s.mismatch_by_kind or s.mismatch_by_sampler:
        out.append("<h2>Sampler mismatch</h2>")
        out.append("<p>Every trained token of the run, by the sampler kind and by the sampler that "
                   "produced it: the k3 estimate of KL(sampler || trainer), the fraction of tokens whose "
                   "ratio p/q lies outside the correction band, and the spread of log p - log q.</p>")
        for caption, rows in (("by sampler kind", s.mismatch_by_kind), ("by sampler", s.mismatch_by_sampler)):
            if not rows:
                continue
            out.append(f"<table><caption>{esc(caption)}</caption><tr>"
                       + "".join(f"<th>{esc(c)}</th>" for c in MISMATCH_COLUMNS) + "</tr>")
            for cells in mismatch_rows(rows):
                out.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
            out.append("</table>")
    out.append("<h2>Plots</h2>")
    for name, (ptitle, caption) in plots.items():
        out += [
            "<figure>",
            f'<a href="{esc(quote(name))}"><img src="{esc(quote(name))}" alt="{esc(ptitle)}"></a>',
            f"<figcaption><b>{esc(ptitle)}.</b> {esc(caption)}</figcaption>",
            "</figure>",
        ]
    out.append("</body></html>")
    return "\n".join(out) + "\n"
