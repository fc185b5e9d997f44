"""Parsing metrics.jsonl / eval.jsonl: valid lines, a cut-short last line, and file:line errors."""

from __future__ import annotations

import json
import math

import msgspec
import pytest

from fleetrl.actors.report.records import (ReportInputError, parse_evals, parse_metrics,
                                           read_evals, read_metrics)


def test_metrics_round_trip_the_trainer_encoding(h):
    ms = [h.step_metrics(i) for i in (1, 2, 3)]
    log = parse_metrics(b"".join(h.metrics_line(m) for m in ms).decode())
    assert list(log.rows) == ms
    assert not log.truncated
    assert log.rows[0].staleness_hist == {0: 2, 1: 1, 2: 1}


def test_non_finite_floats_written_as_null_read_back_as_nan(h):
    # msgspec writes NaN/inf as null: a skipped step with a non-finite gradient
    m = h.step_metrics(1, grad_norm=float("inf"), skipped=True, skipped_reason="non-finite gradient",
                       mismatch_kl_by_sampler={"torch/fp8": float("nan")})
    line = msgspec.json.encode(m).decode()
    assert '"grad_norm":null' in line
    row = parse_metrics(line + "\n").rows[0]
    assert math.isnan(row.grad_norm)
    assert math.isnan(row.mismatch_kl_by_sampler["torch/fp8"])


def test_unknown_keys_are_ignored(h):
    # a newer trainer may append fields (schema evolution): older readers keep working
    text = h.metrics_line(h.step_metrics(1), some_future_field=[1, 2]).decode()
    assert parse_metrics(text).rows[0] == h.step_metrics(1)


def test_cut_short_last_line_is_dropped_and_flagged(h):
    good = b"".join(h.metrics_line(h.step_metrics(i)) for i in (1, 2)).decode()
    cut = h.metrics_line(h.step_metrics(3)).decode()[:40]  # no newline: the writer died
    log = parse_metrics(good + cut, "m.jsonl")
    assert [r.step for r in log.rows] == [1, 2]
    assert log.truncated


def test_complete_last_line_without_newline_is_kept(h):
    text = h.metrics_line(h.step_metrics(1)).decode().rstrip("\n")
    log = parse_metrics(text)
    assert len(log.rows) == 1 and not log.truncated


@pytest.mark.parametrize("bad, why", [
    ('{"step": 1, "loss": ', "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"step": "one"}', "Expected `int`, got `str`"),
    ('{"loss": 0.1}', "missing required field `step`"),
    ('{"step": 2, "staleness_hist": {"x": 1}}', "staleness_hist key 'x'"),
    ('{"step": 2, "usd_per_rollout": "cheap"}', "Expected `float`, got `str` - at `$.usd_per_rollout`"),
    ("", "empty line"),
])
def test_malformed_metrics_line_names_file_and_line(h, bad, why):
    text = h.metrics_line(h.step_metrics(1)).decode() + bad + "\n" + h.metrics_line(h.step_metrics(3)).decode()
    with pytest.raises(ReportInputError) as exc:
        parse_metrics(text, "run/metrics.jsonl")
    assert str(exc.value).startswith("run/metrics.jsonl:2: ")
    assert why in str(exc.value)


def test_malformed_last_line_with_newline_is_an_error_not_a_truncation(h):
    text = h.metrics_line(h.step_metrics(1)).decode() + '{"step": \n'
    with pytest.raises(ReportInputError, match=r"^m:2: not valid JSON"):
        parse_metrics(text, "m")


def test_evals_parse_and_validate(h):
    rows = h.default_evals()
    log = parse_evals("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r.version, r.split, r.passed) for r in log.rows] == [
        (r["version"], r["split"], r["passed"]) for r in rows]


@pytest.mark.parametrize("change, why", [
    ({"split": "train"}, "Invalid enum value 'train' - at `$.split`"),
    ({"passed": 201}, "need 0 <= passed <= n"),
    ({"pass_at_1": 1.5}, "pass_at_1 must be in [0, 1]"),
    ({"ci_low": 0.9, "ci_high": 0.1}, "need ci_low <= ci_high"),
    ({"time": "noon"}, "Expected `float`, got `str`"),
])
def test_malformed_eval_line_names_file_and_line(h, change, why):
    rows = h.default_evals()
    rows[3].update(change)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    with pytest.raises(ReportInputError) as exc:
        parse_evals(text, "e.jsonl")
    assert str(exc.value).startswith("e.jsonl:4: ")
    assert why in str(exc.value)


def test_missing_files_read_as_empty_logs(tmp_path):
    assert read_metrics(tmp_path / "nope.jsonl").rows == ()
    assert read_evals(tmp_path / "nope.jsonl").rows == ()


def test_read_reports_the_real_path(tmp_path, h):
    p = tmp_path / "metrics.jsonl"
    p.write_bytes(h.metrics_line(h.step_metrics(1)) + b"{oops}\n")
    with pytest.raises(ReportInputError, match=rf"^{p}:2: "):
        read_metrics(p)


def test_non_finite_mismatch_figures_read_back_as_nan(h):
    from fleetrl.actors.trainer.step import MismatchFigures
    from fleetrl.daemon.messages import SamplerIdentity

    fig = MismatchFigures(tokens=3, kl_k3=float("inf"), frac_out_of_band=1.0, log_ratio_mean=float("nan"),
                          log_ratio_std=float("nan"), log_ratio_max_abs=800.0)
    ident = SamplerIdentity(sampler_id="s", backend="torch", device_kind="cpu", dtype="float8_e4m3fn")
    m = h.step_metrics(1, mismatch_by_kind={"torch/float8_e4m3fn": fig}, mismatch_by_sampler_id={"s": fig},
                       sampler_identities=(ident,), log_ratio_std=float("nan"))
    row = parse_metrics(msgspec.json.encode(m).decode() + "\n").rows[0]
    for f in (row.mismatch_by_kind["torch/float8_e4m3fn"], row.mismatch_by_sampler_id["s"]):
        assert math.isnan(f.kl_k3) and math.isnan(f.log_ratio_std) and f.log_ratio_max_abs == 800.0
        assert f.tokens == 3
    assert row.sampler_identities == (ident,) and math.isnan(row.log_ratio_std)
