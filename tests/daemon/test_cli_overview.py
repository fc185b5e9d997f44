"""`fleetrl --help` (and a bare `fleetrl`) list every command without loading the command
groups, whose imports (torch, transformers) take seconds: the overview imports neither,
names every installed group, and says of each group what the group itself says."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import entry_points

from fleetrl.daemon.cli import BUILTIN_COMMANDS, ENTRY_POINT_GROUP, GROUP_HELP, build_parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a.help for a in sub._choices_actions}


def test_the_overview_names_every_command_and_imports_no_group():
    code = ("import sys; from fleetrl.daemon.cli import main; rc = main(['--help']); "
            "print('IMPORTED', sorted(m for m in ('torch', 'transformers', 'fleetrl.actors') if m in sys.modules), rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("IMPORTED [] 0"), out.stdout[-500:]
    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | BUILTIN_COMMANDS
    for name in names:
        assert f"    {name} " in out.stdout or f"    {name}\n" in out.stdout, (name, out.stdout)
    bare = subprocess.run([sys.executable, "-m", "fleetrl.daemon.cli"], capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and "worker" in bare.stderr  # no command: the overview on stderr, usage error


def test_each_group_s_line_is_what_the_group_itself_says():
    loaded = _subcommands(build_parser())  # every group loaded, as a named command does
    groups = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert set(GROUP_HELP) == groups
    for name in groups:
        assert GROUP_HELP[name] == loaded[name], name


def test_a_named_group_still_loads_its_own_options():
    out = subprocess.run([sys.executable, "-m", "fleetrl.daemon.cli", "worker", "--help"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "--join URL" in out.stdout
