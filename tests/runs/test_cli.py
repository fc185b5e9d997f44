"""`fleetrl ablate` / `fleetrl bench async` command-line errors (none of these start a run)."""

from __future__ import annotations

import argparse
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
    assert main(["ablate", "--config", str(no_trainer), "--variants", "b", "--out", str(tmp_path / "o")]) == 2
    assert "no trainer actor (factory = 'fleetrl.actors.trainer:run')" in capsys.readouterr().err
    assert main(["ablate", "--config", str(no_trainer), "--variants", "a", "--out", str(tmp_path / "o")]) == 2
    assert "expected exactly one trainer (factory = 'fleetrl.actors.trainer:run'), found none" in capsys.readouterr().err


def test_the_groups_register_under_the_fleetrl_parser():
    parser = argparse.ArgumentParser(prog="fleetrl")
    sub = parser.add_subparsers(dest="command")
    register_ablate(sub)
    register_bench(sub)
    args = parser.parse_args(["ablate", "--config", "c.toml", "--steps", "3", "--variants", "a,b"])
    assert (args.config, args.steps, args.variants, args.out) == ("c.toml", 3, "a,b", ".fleetrl/ablation")
    args = parser.parse_args(["bench", "async", "--config", "c.toml", "--groups", "96"])
    assert (args.bench_command, args.groups, args.out) == ("async", 96, ".fleetrl/bench-async")


def test_the_recorded_command_line():
    parser = argparse.ArgumentParser(prog="fleetrl")
    register_ablate(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ablate", "--config", "my cfg.toml", "--steps", "3"])
    assert _command_line(args) == "fleetrl ablate --config 'my cfg.toml' --steps 3 --out .fleetrl/ablation"
