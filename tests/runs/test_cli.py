"""`fleetrl ablate` / `fleetrl bench async` command-line errors (none of these start a run)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from fleetrl.actors.runs.cli import _command_line, main, register_ablate, register_bench

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")


@pytest.mark.parametrize("argv, code, message", [
    (["ablate"], 2, "the following arguments are required: --config"),
    (["ablate", "--config", TINY, "--steps", "0"], 2, "argument --steps: must be >= 1, got 0"),
    (["ablate", "--config", TINY, "--steps", "ten"], 2, "argument --steps: expected a whole number, got 'ten'"),
    (["ablate", "--config", TINY, "--timeout", "-1"], 2, "argument --timeout: must be > 0"),
    (["ablate", "--config", TINY, "--variants", "a,q"], 2, "unknown variant 'q' (known: a/sync_fp32"),
    (["ablate", "--config", TINY, "--variants", "b,c"], 2, "must include the reference arm (a)"),
    (["ablate", "--config", TINY, "--regime", "mild,wild"], 2, "unknown regime 'wild' (known: mild, hard)"),
    (["ablate", "--config", TINY, "--seeds", "0"], 2, "seeds '0': a count must be >= 1"),
    (["ablate", "--config", TINY, "--seeds", "a,b"], 2, "seeds 'a,b': expected a count (2), a list (0,1)"),
    (["ablate", "--config", TINY, "--eval-tasks", "0"], 2, "argument --eval-tasks: must be >= 1, got 0"),
    (["bench"], 2, "usage: fleetrl bench"),
    (["bench", "async"], 2, "the following arguments are required: --config"),
    (["bench", "async", "--config", TINY, "--groups", "x"], 2, "argument --groups: expected a whole number"),
    (["bench", "async", "--config", TINY, "--groups", "12"], 2, "--groups must be at least two steps' worth (16"),
])
def test_argument_errors(argv, code, message, capsys):
    assert main(argv) == code
    assert message in capsys.readouterr().err


def test_config_errors_name_the_file(tmp_path, capsys):
    assert main(["ablate", "--config", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "o")]) == 2
    assert f"{tmp_path / 'missing.toml'}: config file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon\n")
    assert main(["bench", "async", "--config", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert f"{bad}: not valid TOML" in capsys.readouterr().err
    no_trainer = tmp_path / "nt.toml"
    no_trainer.write_text('[actors.heartbeat]\nfactory = "fleetrl.daemon.ticker:run"\n')
    assert main(["ablate", "--config", str(no_trainer), "--variants", "a", "--out", str(tmp_path / "o")]) == 2
    assert "expected exactly one trainer (factory = 'fleetrl.actors.trainer:run'), found none" in capsys.readouterr().err


def test_the_hard_regime_refuses_a_model_vllm_cannot_run(tmp_path, capsys):
    text = Path(TINY).read_text().replace("threads = 2 ", 'recipe = { model = { num_heads = 4, num_kv_heads = 4 } }\nthreads = 2 ')
    cfg = tmp_path / "heads.toml"
    cfg.write_text(text)
    assert main(["ablate", "--config", str(cfg), "--regime", "hard", "--out", str(tmp_path / "o"),
                 "--work", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "head size 48" in err and "vLLM's CPU build only runs head sizes 32, 64" in err
    assert not (tmp_path / "w").exists()  # nothing ran


def test_help_documents_arms_regimes_seeds_and_outputs(capsys):
    assert main(["ablate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--seeds SEEDS", "a count (2: seeds 0 and 1), a list (0,3) or a range (0..3)",
                 "--regime LIST", "mild, hard, or both as mild,hard", "e async_tis", "a sync_fp32",
                 "hard the config's fleet plus a vLLM bf16 sampler run as a child process",
                 "max_staleness 8", "at least 4x the mild fleet's", "seed s adds s to the config's training task seed",
                 "ablation-<today, UTC> in docs/results", "--work DIR", "--eval-tasks N", "--resume",
                 "one band per arm over seeds"):
        assert text in out, text


def test_the_groups_register_under_the_fleetrl_parser():
    parser = argparse.ArgumentParser(prog="fleetrl")
    sub = parser.add_subparsers(dest="command")
    register_ablate(sub)
    register_bench(sub)
    args = parser.parse_args(["ablate", "--config", "c.toml", "--steps", "3", "--variants", "a,b"])
    assert (args.config, args.steps, args.variants, args.seeds, args.regime) == ("c.toml", 3, "a,b", "1", "mild")
    assert args.out == str(Path("docs/results") / f"ablation-{time.strftime('%Y-%m-%d', time.gmtime())}")
    assert (args.work, args.eval_tasks, args.resume) == (".fleetrl/ablation", 400, False)
    args = parser.parse_args(["ablate", "--config", "c.toml"])
    assert args.variants == "a,b,c,d,e"
    args = parser.parse_args(["bench", "async", "--config", "c.toml", "--groups", "96"])
    assert (args.bench_command, args.groups, args.out) == ("async", 96, ".fleetrl/bench-async")


def test_the_recorded_command_line():
    parser = argparse.ArgumentParser(prog="fleetrl")
    register_ablate(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ablate", "--config", "my cfg.toml", "--steps", "3", "--seeds", "0,1", "--regime",
                              "mild,hard", "--out", "o"])
    assert _command_line(args) == ("fleetrl ablate --config 'my cfg.toml' --steps 3 --seeds 0,1 --regime mild,hard "
                                   "--variants a,b,c,d,e --eval-tasks 400 --out o --work .fleetrl/ablation")
