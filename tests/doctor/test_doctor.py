"""`fleetrl doctor`: every shipped config is clean (exit 0); each hazardous variant of a
shipped config, changed in one setting, is named by its hazard id (exit 1); a run's state
directory, written in the formats the trainer and the workers write, shows its measured
hazards; a malformed config or state directory exits 2 naming the key or the file."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fleetrl.actors.doctor import HAZARDS, check_config
from fleetrl.actors.doctor.cli import main
from fleetrl.actors.trainer.step import StepMetrics
from fleetrl.daemon.config import load_config
from fleetrl.daemon.examples import example_generation
from fleetrl.daemon.messages import TokenSegment
from fleetrl.daemon.protocol import Tensor
from fleetrl.harness.atif_write import atif_file_name, atif_from_attempt, encode_atif
from fleetrl.harness.chat import ChatMessage
from fleetrl.harness.recording import AttemptRecord, CallRecord

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").glob("*.toml")) + ["daemon/default.toml"]


def variant(tmp_path: Path, base: str, *edits: tuple[str, str], name: str = "variant.toml") -> Path:
    """``configs/<base>`` with each ``old`` (found exactly once) replaced by ``new``."""
    text = (REPO / "configs" / base).read_text(encoding="utf-8")
    for old, new in edits:
        assert text.count(old) == 1, f"{old!r} is not in configs/{base} exactly once"
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def doctor(capsys: pytest.CaptureFixture[str], config: Path | str, *more: str) -> tuple[int, dict | None, str]:
    """Run the command in this process: (exit code, its JSON, stderr)."""
    rc = main(["doctor", "--config", str(config), "--json", *more])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if out.out.strip() else None), out.err


def ids(body: dict | None) -> set[str]:
    assert body is not None
    return {h["id"] for h in body["hazards"]}


# -- shipped configs ----------------------------------------------------------------------

@pytest.mark.parametrize("config", SHIPPED)
def test_every_shipped_config_has_no_hazard(config):
    assert check_config(load_config(REPO / config)) == []


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/tiny.toml", "configs/agent-swe.toml"])
def test_the_installed_command_passes_shipped_configs(config, fleetrl_bin):
    out = subprocess.run([fleetrl_bin, "doctor", "--config", config], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"OK: no hazard in {config}"


# -- hazardous variants: one setting changed each ---------------------------------------------

TINY_EVAL = "temperature = 1.0\ntop_p = 0.95\nmax_tokens = 48"
TINY_HARNESS = "harness_config = { max_tokens = 48, temperature = 1.0, top_p = 0.95 }"
TINY_CORRECTIONS = 'corrections = { normalization = "token" }  '
TINY_POOL_STALENESS = 'max_staleness = 2\nweights_dir = ".fleetrl/actors/trainer/weights"\nattempts_per_step = 64'
TINY_TRAINER_TEMPERATURE = "temperature = 1.0\nmax_steps = 400"
TINY_MODEL = 'model = { kind = "pool", pool = "pool", tokenizer_dir = ".fleetrl/models/tiny" }'
TOOLS_ENDPOINT = "context_length = 1024\ndefault_max_tokens = 96"

VARIANTS = {
    "evaluator-temperature": ("tiny.toml", [(TINY_EVAL, TINY_EVAL.replace("1.0", "0.7"))],
                              {"evaluator-sampling-mismatch"}),
    "harness-greedy": ("tiny.toml", [(TINY_HARNESS, TINY_HARNESS.replace("temperature = 1.0", "temperature = 0.0"))],
                       {"greedy-harness", "evaluator-sampling-mismatch"}),
    "harness-top-k-1": ("tiny.toml", [(TINY_HARNESS, TINY_HARNESS.replace(" }", ", top_k = 1 }"))],
                        {"greedy-harness", "evaluator-sampling-mismatch"}),
    "endpoint-refuse-admits-0": ("agent-tools.toml", [(TOOLS_ENDPOINT, TOOLS_ENDPOINT + "\nsampling = { policy = "
                                                      '"refuse", temperature_range = [0.0, 2.0] }')],
                                 {"endpoint-admits-greedy"}),
    "endpoint-override-other-policy": ("agent-tools.toml", [(TOOLS_ENDPOINT, TOOLS_ENDPOINT + "\nsampling = { policy = "
                                                            '"override", temperature = 0.7, top_p = 0.95 }')],
                                       {"evaluator-sampling-mismatch", "trainer-temperature-mismatch"}),
    "trainer-temperature": ("tiny.toml", [(TINY_TRAINER_TEMPERATURE, TINY_TRAINER_TEMPERATURE.replace("1.0", "0.8"))],
                            {"trainer-temperature-mismatch"}),
    "harness-config-typo": ("tiny.toml", [(TINY_HARNESS, TINY_HARNESS.replace("top_p", "topp"))],
                            {"harness-config-invalid"}),
    "top-k-above-cap": ("tiny.toml", [(TINY_HARNESS, TINY_HARNESS.replace(" }", ", top_k = 1000 }"))],
                        {"top-k-above-cap"}),
    "max-support-1": ("tiny.toml", [("attempts_per_step = 64 ", "max_support = 1\nattempts_per_step = 64 ")],
                      {"single-token-support"}),
    "pool-staleness": ("tiny.toml", [(TINY_POOL_STALENESS, TINY_POOL_STALENESS.replace("= 2", "= 3"))],
                       {"pool-staleness-above-trainer"}),
    "pacing-too-many": ("tiny.toml", [("attempts_per_step = 64 ", "attempts_per_step = 96 ")], {"pacing-step-size"}),
    "pacing-stalls": ("tiny.toml", [("attempts_per_step = 64 ", "attempts_per_step = 16 ")], {"pacing-step-size"}),
    "pacing-not-multiple": ("tiny.toml", [("attempts_per_step = 64 ", "attempts_per_step = 60 ")],
                            {"pacing-step-size"}),
    "zero-variance-mirror": ("tiny.toml", [(TINY_MODEL, TINY_MODEL.replace(" }", ", trainer_skips_zero_variance = "
                                                                                 "false }"))],
                             {"pacing-zero-variance-mirror"}),
    "shared-pool": ("tiny.toml", [('score_batching = { max_groups = 8, linger_s = 0.25, slots = 2 }',
                                   'score_batching = { max_groups = 8, linger_s = 0.25, slots = 2 }\n\n'
                                   '[actors.env2]\nfactory = "fleetrl.actors.envworker:run"\n'
                                   'after = ["pool", "trainer"]\n'
                                   '[actors.env2.config]\n' + TINY_MODEL + '\n' + TINY_HARNESS + '\ngroup_size = 8')],
                    {"pacing-shared-pool"}),
    "announce-missing": ("tiny.toml", [('announce_to = ["pool", "evaluator"]', 'announce_to = ["pool"]')],
                         {"announce-missing"}),
    "unknown-actor": ("tiny.toml", [('stale_reports_to = "pool"', 'stale_reports_to = "pools"')], {"unknown-actor"}),
    "weighting-none": ("tiny.toml", [(TINY_CORRECTIONS, 'corrections = { normalization = "token", '
                                                        'weighting = "none" }')],
                       {"corrections-weighting-none"}),
    "centering-off": ("tiny.toml", [(TINY_CORRECTIONS, 'corrections = { normalization = "token", centering = false }')],
                      {"corrections-centering-off"}),
    "band-without-1": ("tiny.toml", [(TINY_CORRECTIONS, 'corrections = { normalization = "token", mask_low = 1.2 }')],
                       {"corrections-mask-band"}),
    "band-tight": ("tiny.toml", [(TINY_CORRECTIONS, 'corrections = { normalization = "token", mask_low = 0.98, '
                                                    'mask_high = 1.02 }')], {"corrections-mask-band"}),
    "seq-mask-without-1": ("tiny.toml", [(TINY_CORRECTIONS, 'corrections = { normalization = "token", '
                                                            'seq_mask = [1.01, 1.1] }')], {"corrections-mask-band"}),
    "tis-uncapped": ("tiny.toml", [(TINY_CORRECTIONS, 'corrections = { normalization = "token", weighting = "tis", '
                                                      'tis_cap = inf }')], {"corrections-uncapped-weights"}),
    "alarms-off": ("tiny.toml", [(TINY_CORRECTIONS, TINY_CORRECTIONS + "\nalarms = { masked_tokens = 1.0 }")],
                   {"alarms-off"}),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_hazardous_variant_is_named_by_its_id(name, tmp_path, capsys):
    base, edits, expected = VARIANTS[name]
    path = variant(tmp_path, base, *edits)
    rc, body, err = doctor(capsys, path)
    assert rc == 1, err
    assert ids(body) == expected
    for h in body["hazards"]:
        assert set(h) == {"id", "where", "message", "fix", "file", "line"}
        assert h["file"] == str(path) and h["line"] is not None and h["where"].startswith("actors.")
        assert h["message"] and h["fix"]


def test_the_hazard_names_the_key_and_its_line(tmp_path, capsys):
    path = variant(tmp_path, "tiny.toml", (TINY_CORRECTIONS, 'corrections = { normalization = "token", '
                                                             'weighting = "none" }'))
    rc = main(["doctor", "--config", str(path)])
    out = capsys.readouterr().out
    line = next(i for i, t in enumerate(path.read_text().splitlines(), start=1) if 'weighting = "none"' in t)
    assert rc == 1
    assert f"[corrections-weighting-none] {path}:{line}: actors.trainer.config.corrections.weighting" in out
    assert "fix: " in out and out.rstrip().endswith(f"1 hazard in {path}")


@pytest.mark.slow
def test_the_installed_command_exits_1_with_json(tmp_path, fleetrl_bin):
    path = variant(tmp_path, "tiny.toml", ('stale_reports_to = "pool"', 'stale_reports_to = "pools"'),
                   (TINY_POOL_STALENESS, TINY_POOL_STALENESS.replace("= 2", "= 3")))
    out = subprocess.run([fleetrl_bin, "doctor", "--config", str(path), "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    body = json.loads(out.stdout)
    assert body["ok"] is False and ids(body) == {"unknown-actor", "pool-staleness-above-trainer"}


# -- malformed input: exit 2 ----------------------------------------------------------------

def test_a_malformed_config_exits_2_naming_the_key(tmp_path, capsys):
    path = variant(tmp_path, "tiny.toml", (TINY_CORRECTIONS, 'corrections = { normalization = "token", '
                                                             'weighting = "nonee" }'))
    rc, body, err = doctor(capsys, path)
    assert rc == 2 and body is None
    assert err.startswith(f"fleetrl: {path}:") and "actors.trainer.config.corrections.weighting" in err


@pytest.mark.slow
def test_the_installed_command_exits_2_as_serve_would(tmp_path, fleetrl_bin):
    path = variant(tmp_path, "tiny.toml", ("group_size = 8", "group_size = 0"))
    doc = subprocess.run([fleetrl_bin, "doctor", "--config", str(path)], capture_output=True, text=True, timeout=300)
    check = subprocess.run([fleetrl_bin, "config", "check", str(path)], capture_output=True, text=True, timeout=300)
    assert doc.returncode == check.returncode == 2
    assert doc.stderr == check.stderr and "actors.env.config.group_size" in doc.stderr


def test_a_missing_state_dir_exits_2(tmp_path, capsys):
    rc, body, err = doctor(capsys, REPO / "configs" / "tiny.toml", "--state-dir", str(tmp_path / "nowhere"))
    assert rc == 2 and body is None and "nowhere" in err and "not found" in err


# -- a run's state directory ------------------------------------------------------------------

def write_metrics(state: Path, steps: list[dict], *, trainer: str = "trainer", tail: bytes = b"") -> Path:
    """``metrics.jsonl`` as the trainer writes it (`Trainer.train`: one `StepMetrics` JSON
    line per step); keys StepMetrics does not have (yet) are added to the line as such."""
    path = state / "actors" / trainer / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as fh:
        for i, kw in enumerate(steps):
            known = {k: v for k, v in kw.items() if k in StepMetrics.__struct_fields__}
            m = StepMetrics(**{"step": i + 1, "version": i + 1, "groups": 8, "trajectories": 64, "rows": 64,
                               "tokens": 3000, **known})
            extra = {k: v for k, v in kw.items() if k not in StepMetrics.__struct_fields__}
            line = msgspec.json.encode(m) if not extra else msgspec.json.encode({**msgspec.to_builtins(m), **extra})
            fh.write(line + b"\n")
        fh.write(tail)
    return path


def test_masked_tokens_above_the_alarm(tmp_path, capsys):
    path = write_metrics(tmp_path, [{"frac_masked_tokens": 0.01}, {"frac_masked_tokens": 0.4},
                                    {"frac_masked_tokens": 0.3}, {"frac_masked_tokens": 0.02}])
    rc, body, _ = doctor(capsys, REPO / "configs" / "tiny.toml", "--state-dir", str(tmp_path))
    assert rc == 1 and ids(body) == {"masked-tokens-above-alarm"}
    (h,) = body["hazards"]
    assert h["file"] == str(path) and h["line"] == 2 and h["where"] == "frac_masked_tokens"
    assert "2 of the 4 recent steps" in h["message"] and "0.25" in h["message"]
    assert body["read"]["trainers"] == [{"trainer": "trainer", "file": str(path), "steps": 4}]


def test_a_clean_run_has_no_hazard_and_a_half_written_line_is_left_out(tmp_path, capsys):
    write_metrics(tmp_path, [{"frac_masked_tokens": 0.01}] * 3, tail=b'{"step": 4, "frac_mask')
    rc, body, _ = doctor(capsys, REPO / "configs" / "tiny.toml", "--state-dir", str(tmp_path))
    assert rc == 0 and body["hazards"] == [] and body["ok"] is True


def test_a_malformed_metrics_line_exits_2_naming_file_and_line(tmp_path, capsys):
    path = write_metrics(tmp_path, [{}], tail=b"not json\n")
    write_metrics(tmp_path, [{}])
    rc, body, err = doctor(capsys, REPO / "configs" / "tiny.toml", "--state-dir", str(tmp_path))
    assert rc == 2 and body is None and f"{path}:2:" in err


def test_only_the_recent_steps_count(tmp_path, capsys):
    write_metrics(tmp_path, [{"frac_masked_tokens": 0.9}] + [{"frac_masked_tokens": 0.0}] * 10)
    rc, body, _ = doctor(capsys, REPO / "configs" / "tiny.toml", "--state-dir", str(tmp_path), "--steps", "10")
    assert rc == 0, body
    rc, body, _ = doctor(capsys, REPO / "configs" / "tiny.toml", "--state-dir", str(tmp_path), "--steps", "11")
    assert rc == 1 and ids(body) == {"masked-tokens-above-alarm"}


def test_skipped_steps_and_the_fields_of_other_releases(tmp_path, capsys):
    write_metrics(tmp_path, [
        {"skipped": True, "skipped_reason": "every token masked", "frac_masked_tokens": 1.0},
        {"excluded_rows": {"greedy": 40}, "frac_excluded_rows": 40 / 104, "unrecorded_rows": 0,
         "alarms": ["excluded_rows"]},
        {"frac_masked_sequences": 0.9},
    ])
    rc, body, _ = doctor(capsys, REPO / "configs" / "tiny.toml", "--state-dir", str(tmp_path))
    assert rc == 1
    # the step that masked every token is a skipped step, not also a masked-token one (as the trainer's alarms)
    assert ids(body) == {"skipped-steps", "excluded-rows-above-alarm", "masked-sequences-above-alarm"}
    skipped = next(h for h in body["hazards"] if h["id"] == "skipped-steps")
    assert "'every token masked'" in skipped["message"] and skipped["line"] == 1


def test_skipped_steps_are_grouped_by_reason_and_counts_alone_are_read(tmp_path, capsys):
    excluded = "every model call excluded: no token can carry a gradient"
    write_metrics(tmp_path, [
        {"skipped": True, "skipped_reason": f"{excluded} (3 greedy)", "tokens": 0},
        {"skipped": True, "skipped_reason": f"{excluded} (5 greedy)", "tokens": 0},
        {"excluded_rows": {"greedy": 10, "top_k_1": 10}},  # a line without frac_excluded_rows: 20 / (20 + 64)
    ])
    rc, body, _ = doctor(capsys, REPO / "configs" / "tiny.toml", "--state-dir", str(tmp_path))
    assert rc == 1 and ids(body) == {"skipped-steps"}, body  # 0.238 <= 0.25
    (h,) = body["hazards"]
    assert f"2 of the 3 recent steps (lines 1-3) took no optimizer step: {excluded!r}" in h["message"]
    assert "temperature > 0" in h["fix"]


def test_unrecorded_rows_where_the_calls_temperature_is_unknown(tmp_path, capsys):
    write_metrics(tmp_path, [{"unrecorded_rows": 3}])
    rc, body, _ = doctor(capsys, REPO / "configs" / "tiny.toml", "--state-dir", str(tmp_path))
    assert rc == 0, body  # the built-in harness samples at the trainer's temperature
    rc, body, _ = doctor(capsys, REPO / "configs" / "agent-tools.toml", "--state-dir", str(tmp_path))
    assert rc == 1 and ids(body) == {"unrecorded-rows"}  # an external harness chooses its own


def test_weighting_none_trains_on_tokens_out_of_band(tmp_path, capsys):
    path = variant(tmp_path, "tiny.toml", (TINY_CORRECTIONS, 'corrections = { normalization = "token", '
                                                             'weighting = "none" }'))
    write_metrics(tmp_path / "state", [{"frac_out_of_band": 0.5}])
    rc, body, _ = doctor(capsys, path, "--state-dir", str(tmp_path / "state"))
    assert rc == 1 and ids(body) == {"corrections-weighting-none", "out-of-band-unmasked"}


def test_whole_vocabulary_tail_mass(tmp_path, capsys):
    write_metrics(tmp_path, [{"vocabulary_tokens": 100, "tail_mass_mean": 0.2, "tail_mass_max": 0.5},
                             {"vocabulary_tokens": 0}])
    rc, body, _ = doctor(capsys, REPO / "configs" / "tiny.toml", "--state-dir", str(tmp_path))
    assert rc == 1 and ids(body) == {"support-tail-mass"}
    assert "actors.pool.config.max_support" in body["hazards"][0]["fix"]


def write_atif(directory: Path, *, files: int, k: int, tokens: int = 20) -> None:
    """Scored attempts as the worker writes them with ``atif = {support = true}``
    (`AtifFiles._write`: `atif_from_attempt(..., support=True)`, `encode_atif`), each call
    with a support of ``k`` members at every position."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        seg = TokenSegment.from_generation(Tensor.from_numpy(np.arange(5, dtype=np.int64)),
                                           example_generation(tokens, k, vocab=259, seed=i))
        call = CallRecord(index=0, kind="chat", segment=seg, text="y", messages=(ChatMessage("user", "x"),))
        record = AttemptRecord(attempt_id=f"t#{i}@env/{i}.0", task_id="t", calls=(call,))
        trajectory = record.trajectory(group_id=f"t#{i}@env", reward=1.0, metrics={})
        (directory / atif_file_name(trajectory.attempt_id)).write_bytes(
            encode_atif(atif_from_attempt(record, trajectory, support=True)))


@pytest.mark.parametrize("k, binds", [(8, True), (6, False)])
def test_the_support_cap_binding_in_the_recorded_supports(tmp_path, capsys, k, binds):
    path = variant(tmp_path, "tiny.toml", ("attempts_per_step = 64 ", "max_support = 8\nattempts_per_step = 64 "),
                   ("score_batching = {", "atif = { support = true }\nscore_batching = {"))
    state = tmp_path / "state"
    write_atif(state / "trajectories" / "env", files=3, k=k)
    rc, body, _ = doctor(capsys, path, "--state-dir", str(state))
    assert body["read"]["atif"] == [{"worker": "env", "dir": str(state / "trajectories" / "env"), "files": 3,
                                     "positions": 60}]
    if not binds:
        assert rc == 0 and body["hazards"] == []
        return
    assert rc == 1 and ids(body) == {"support-cap-binds"}
    (h,) = body["hazards"]
    assert h["where"] == "actors.pool.config.max_support"
    assert "60 of 60 recorded positions" in h["message"] and "top_p = 0.95" in h["message"]


# -- docs ---------------------------------------------------------------------------------

def test_the_guide_documents_every_hazard_id():
    guide = (REPO / "docs" / "guides" / "doctor.md").read_text(encoding="utf-8")
    missing = [hid for hid in HAZARDS if f"`{hid}`" not in guide]
    assert missing == []
