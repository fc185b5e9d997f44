"""write_report and `fleetrl report` on hand-made run logs: real PNGs, resolving links,
the right numbers in the table, file:line errors."""

from __future__ import annotations

import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import msgspec
import pytest
from PIL import Image

from fleetrl.actors.report import ReportInputError, write_report
from fleetrl.actors.report.cli import main as report_main
from fleetrl.actors.report.plots import PLOTS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.cells: list[str] = []
        self._in_cell = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.links.append(a["src"])
        if tag == "a":
            self.links.append(a["href"])
        if tag in ("td", "th"):
            self._in_cell = True
            self.cells.append("")

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data):
        if self._in_cell:
            self.cells[-1] += data


def _table(page: Path) -> tuple[dict[str, str], list[str]]:
    p = _Page()
    p.feed(page.read_text())
    return dict(zip(p.cells[0::2], p.cells[1::2])), p.links


def _valid_png(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        im.load()
        return im.size


def test_report_from_a_hand_made_run(make_state, h, tmp_path):
    steps = [h.step_metrics(i, cost_usd=0.032, trajectories=32) for i in range(1, 11)]
    steps[3] = msgspec.structs.replace(steps[3], retokenization_breaks={"history_truncated": 2})
    steps[7] = msgspec.structs.replace(steps[7], retokenization_breaks={"history_truncated": 1,
                                                                       "answer_rewritten": 4})
    state = make_state(steps=steps)
    page = write_report(state, tmp_path / "out")
    assert page == tmp_path / "out" / "index.html"
    table, links = _table(page)
    # every plot exists, is a decodable PNG, and is linked by a relative path that resolves
    for name in PLOTS:
        w, hgt = _valid_png(page.parent / name)
        assert w > 300 and hgt > 200
        assert name in links
    for link in links:
        assert not link.startswith(("/", "http")), link
        assert (page.parent / link).is_file(), link
    assert table["held-out pass@1, fresh, start"] == "35.0% [30.0, 40.0] (n=200, step 0)"
    assert table["held-out pass@1, fresh, end"] == "60.0% [55.0, 65.0] (n=200, step 10)"
    assert table["held-out pass@1, general, start"] == "20.0% [15.0, 25.0] (n=200, step 0)"
    assert table["held-out pass@1, general, end"] == "23.0% [18.0, 28.0] (n=200, step 10)"
    assert table["training reward, first 5 steps"] == "0.350"
    assert table["training reward, last 5 steps"] == "0.600"
    assert table["optimizer steps"] == "10"
    assert table["groups trained"] == "40"
    assert table["wall-clock, first to last held-out evaluation"] == "612 s"
    assert table["trainer busy time (steps + publishing)"] == "25 s"
    assert table["$ per rollout"] == "$0.001000"
    assert table["retokenization breaks (trained, by cause)"] == "answer_rewritten 4, history_truncated 3"
    assert (page.parent / "summary.json").is_file()


def test_plots_differ_with_the_data(make_state, h, tmp_path):
    a = write_report(make_state(), tmp_path / "a").parent
    b = write_report(make_state(steps=[h.step_metrics(i, grad_norm=5.0 - i * 0.3) for i in range(1, 11)]),
                     tmp_path / "b").parent
    assert (a / "grad_norm.png").read_bytes() != (b / "grad_norm.png").read_bytes()
    assert (a / "staleness.png").read_bytes() == (b / "staleness.png").read_bytes()


def test_crashed_run_with_cut_short_line_still_reports(make_state, tmp_path):
    state = make_state(tail=b'{"step": 11, "version": 11, "gro')
    page = write_report(state, tmp_path / "out")
    text = page.read_text()
    assert "metrics.jsonl: its last line was cut short" in text
    table, _ = _table(page)
    assert table["optimizer steps"] == "10"


def test_run_without_evaluator_or_steps(make_state, tmp_path):
    state = make_state(steps=[], evals=[])
    (state / "actors" / "evaluator" / "eval.jsonl").unlink()
    page = write_report(state, tmp_path / "out")
    table, links = _table(page)
    assert table["held-out pass@1, fresh, end"] == "n/a"
    for name in PLOTS:
        _valid_png(page.parent / name)


def test_malformed_line_is_reported_with_file_and_line(make_state, h, tmp_path):
    state = make_state()
    p = state / "actors" / "evaluator" / "eval.jsonl"
    lines = p.read_text().splitlines(keepends=True)
    lines.insert(2, '{"version": 1, "split": "fresh"}\n')
    p.write_text("".join(lines))
    with pytest.raises(ReportInputError, match=rf"^{p}:3: .*missing required field"):
        write_report(state, tmp_path / "out")


def test_not_a_state_dir(tmp_path):
    with pytest.raises(ReportInputError, match="no such state directory"):
        write_report(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportInputError, match="found neither"):
        write_report(tmp_path / "empty", tmp_path / "out")


def test_logs_of_actors_with_other_names_are_found(make_state, tmp_path):
    state = make_state()
    (state / "actors" / "trainer").rename(state / "actors" / "learner")
    table, _ = _table(write_report(state, tmp_path / "out"))
    assert table["optimizer steps"] == "10"
    (state / "actors" / "other").mkdir()
    (state / "actors" / "other" / "metrics.jsonl").write_text("")
    with pytest.raises(ReportInputError, match="several metrics.jsonl"):
        write_report(state, tmp_path / "out2")


# -- the command line ---------------------------------------------------------------------
def test_cli_writes_into_state_report_by_default(make_state, capsys):
    state = make_state()
    assert report_main(["report", str(state)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(state / "report" / "index.html")
    assert Path(out).is_file()


def test_cli_errors(make_state, tmp_path, capsys):
    assert report_main(["report"]) == 2
    assert "STATE_DIR" in capsys.readouterr().err
    assert report_main(["report", str(tmp_path / "nope")]) == 1
    assert "no such state directory" in capsys.readouterr().err
    state = make_state()
    (state / "actors" / "trainer" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    assert report_main(["report", str(state), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "metrics.jsonl:2: not valid JSON" in err


def test_fleetrl_report_command_runs_in_a_subprocess(make_state, tmp_path):
    """Through the real `fleetrl` entry point when the command group is installed,
    else the module's own main (same parser)."""
    from importlib.metadata import entry_points

    state = make_state()
    installed = any(ep.name == "report" for ep in entry_points(group="fleetrl.commands"))
    mod = "fleetrl.daemon.cli" if installed else "fleetrl.actors.report.cli"
    res = subprocess.run([sys.executable, "-m", mod, "report", str(state), "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(tmp_path / "r" / "index.html")


def test_report_shows_the_sampler_mismatch(make_state, h, tmp_path):
    import json

    from fleetrl.actors.trainer.step import MismatchFigures
    from fleetrl.daemon.messages import SamplerIdentity

    def fig(tokens, kl, out):
        return MismatchFigures(tokens=tokens, kl_k3=kl, frac_out_of_band=out, log_ratio_mean=0.0,
                               log_ratio_std=kl ** 0.5, log_ratio_max_abs=10 * kl ** 0.5)

    ids = (SamplerIdentity(sampler_id="fp32-0", backend="torch", device_kind="cpu", dtype="float32"),
           SamplerIdentity(sampler_id="fp8-0", backend="torch", device_kind="H100", dtype="float8_e4m3fn"))
    steps = [h.step_metrics(i, mismatch_kl_by_sampler={"torch/float32": 1e-6, "torch/float8_e4m3fn": 1e-2},
                            tokens_by_sampler={"torch/float32": 100, "torch/float8_e4m3fn": 300},
                            mismatch_by_kind={"torch/float32": fig(100, 1e-6, 0.0),
                                              "torch/float8_e4m3fn": fig(300, 1e-2, 0.02 * i)},
                            mismatch_by_sampler_id={"fp32-0": fig(100, 1e-6, 0.0), "fp8-0": fig(300, 1e-2, 0.02 * i)},
                            sampler_identities=ids)
             for i in range(1, 6)]
    page = write_report(make_state(steps=steps), tmp_path / "out")
    table, _ = _table(page)
    # fleet: (100 * 1e-6 + 300 * 1e-2) / 400 per step; reference: the fp32 sampler's 1e-6
    assert table["fleet mismatch as a multiple of a homogeneous fp32 fleet's"].startswith(
        f"{(1e-4 + 3) / 400 / 1e-6:.3g}x")
    text = page.read_text()
    assert "<h2>Sampler mismatch</h2>" in text
    assert "<td>fp8-0 (torch/H100/float8_e4m3fn)</td><td>1500</td><td>5</td><td>0.01</td><td>6.00%</td>" in text
    summary = json.loads((page.parent / "summary.json").read_text())
    assert summary["mismatch_multiple"]["steps"] == 5
    assert [r["key"] for r in summary["mismatch_by_sampler"]] == ["fp32-0", "fp8-0"]
    other = write_report(make_state(steps=[msgspec.structs.replace(s, mismatch_by_sampler_id={}) for s in steps]),
                         tmp_path / "other")
    assert (page.parent / "mismatch_kl.png").read_bytes() != (other.parent / "mismatch_kl.png").read_bytes()
