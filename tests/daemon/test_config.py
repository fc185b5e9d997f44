"""Config loading: good configs, and one clear message (file, line, key) per bad one."""

from __future__ import annotations

import subprocess

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.daemon.cli import main
from fleetrl.daemon.config import (
    RestartPolicy, default_config_path, key_line, load_config, load_config_text)
from fleetrl.daemon.faults import ConfigError, ExitCode
from fleetrl.daemon.ticker import TickerConfig

GOOD = """\
[daemon]
grace_s = 3

[http]
port = 8123

[supervisor.restart]
intensity = 7

[actors.sink]
factory = "daemon_test_actors:consumer"
config = {tag = "t", delay_s = 0.5}

[actors.source]
factory = "daemon_test_actors:producer"
after = ["sink"]
inbox = 2
restart = {backoff_base_s = 0.25}

[actors.source.config]
tag = "t"
target = "sink"
"""


def test_default_config_loads_and_runs_the_heartbeat():
    cfg = load_config(default_config_path())
    assert [s.name for s in cfg.actors] == ["heartbeat", "sandbox_janitor"]
    assert isinstance(cfg.actors[0].config, TickerConfig)
    assert cfg.http.host == "127.0.0.1"


def test_good_config_is_typed_ordered_and_frozen(test_actors):
    cfg = load_config_text(GOOD)
    assert [s.name for s in cfg.actors] == ["sink", "source"]
    src = cfg.actor("source")
    assert src.config == test_actors.ProducerConfig(tag="t", target="sink")
    assert src.inbox == 2 and cfg.actor("sink").inbox == 16
    assert src.restart == RestartPolicy(backoff_base_s=0.25, intensity=7)
    assert cfg.daemon.grace_s == 3.0
    with pytest.raises(AttributeError):
        cfg.daemon.grace_s = 1  # type: ignore[misc]


def test_actors_start_after_their_dependencies_whatever_the_file_order(test_actors):
    text = GOOD.replace("[actors.sink]", "[actors.zzz_sink]").replace(
        '"sink"', '"zzz_sink"')
    # move the producer first in the file
    head, sink_part = text.split("[actors.zzz_sink]")
    sink_block, src_block = sink_part.split("[actors.source]", 1)
    cfg = load_config_text(head + "[actors.source]" + src_block + "\n[actors.zzz_sink]" + sink_block)
    assert [s.name for s in cfg.actors] == ["zzz_sink", "source"]


BAD = [
    # (mutation of GOOD, expected key, expected line, message fragment)
    (("grace_s = 3", "grace_s = 3\ngrase_s = 1"), "daemon.grase_s", 3, "unknown key"),
    (("port = 8123", 'port = "8123"'), "http.port", 5, "expected `int`, got `str`"),
    (("port = 8123", "port = 70000"), "http.port", 5, "<= 65535"),
    (("intensity = 7", "intensity = 0"), "supervisor.restart.intensity", 8, ">= 1"),
    (("delay_s = 0.5}", "delay_s = 0.5, speed = 2}"), "actors.sink.config.speed", 12,
     "unknown key for ConsumerConfig"),
    (('target = "sink"', "target = 5"), "actors.source.config.target", 22,
     "expected `str`, got `int`"),
    (("backoff_base_s = 0.25", "backoff_base_s = -1"), "actors.source.restart.backoff_base_s",
     18, "> 0"),
    (('after = ["sink"]', 'after = ["nobody"]'), "actors.source.after", 16,
     "no actor named 'nobody'"),
    (('"daemon_test_actors:consumer"', '"daemon_test_actors:nope"'), "actors.sink.factory",
     11, "not found"),
    (('"daemon_test_actors:consumer"', '"no_such_module_xyz:run"'), "actors.sink.factory",
     11, "cannot import"),
    (('"daemon_test_actors:consumer"', '"not a path"'), "actors.sink.factory", 11,
     "expected `str` matching"),
    (("inbox = 2", "inbox = 0"), "actors.source.inbox", 17, ">= 1"),
    (("[http]", "[htp]"), "htp", 4, "unknown key"),
]


@pytest.mark.parametrize("mutation,key,line,fragment", BAD)
def test_bad_config_names_key_and_line(test_actors, mutation, key, line, fragment):
    text = GOOD.replace(*mutation)
    assert text != GOOD
    with pytest.raises(ConfigError) as err:
        load_config_text(text, source="run.toml")
    assert err.value.key == key
    assert err.value.line == line
    assert fragment in str(err.value)
    assert str(err.value).startswith(f"run.toml:{line}: {key}: ")


def test_dependency_cycle_is_named(test_actors):
    text = GOOD.replace('config = {tag = "t", delay_s = 0.5}',
                        'after = ["source"]\nconfig = {tag = "t"}')
    with pytest.raises(ConfigError, match="dependency cycle among actors: sink -> source"):
        load_config_text(text)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found") as err:
        load_config(tmp_path / "absent.toml")
    assert str(err.value) == f"{tmp_path / 'absent.toml'}: config file not found"
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\ngrace_s = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML") as err:
        load_config(bad)
    assert err.value.line == 2


def test_factory_must_have_the_actor_shape(tmp_path, test_actors):
    for factory, fragment in [("daemon_test_actors:register", "not an async function"),
                              ("trio:sleep", "actor signature")]:
        text = f'[actors.a]\nfactory = "{factory}"\n'
        with pytest.raises(ConfigError, match=fragment):
            load_config_text(text)


@pytest.mark.parametrize("body,fragment", [
    ("[daemon]\nbogus = 1\n", "daemon.bogus: unknown key"),
    ("[daemon]\ngrace_s = 'x'\n", "daemon.grace_s: expected `float`, got `str`"),
    ("[daemon]\ncheckpoint_keep = 0\n", "daemon.checkpoint_keep: expected `int` >= 1"),
])
def test_config_check_prints_one_message_and_exits_2(tmp_path, capsys, body, fragment):
    path = tmp_path / "c.toml"
    path.write_text(body)
    assert main(["config", "check", str(path)]) == ExitCode.CONFIG == 2
    err = capsys.readouterr().err.strip().splitlines()
    mine = [line for line in err if "command group" not in line]
    assert mine == [f"fleetrl: {path}:2: {fragment}"]


def test_config_check_cli_process(tmp_path, fleetrl_bin):
    ok = subprocess.run([fleetrl_bin, "config", "check", str(default_config_path())],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("OK: ")
    missing = subprocess.run([fleetrl_bin, "config", "check", str(tmp_path / "nope.toml")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert f"fleetrl: {tmp_path / 'nope.toml'}: config file not found" in missing.stderr


# -- key_line against generated TOML --------------------------------------------------
_ident = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(_ident, st.dictionaries(_ident, st.integers(), min_size=1, max_size=4),
                       min_size=1, max_size=4), st.booleans())
def test_key_line_finds_every_key(tables, dotted):
    lines: list[str] = []
    where: dict[tuple[str, str], int] = {}
    if dotted:  # keys written as dotted keys at top level
        for t, kv in tables.items():
            for k, v in kv.items():
                lines.append(f"{t}.{k} = {v}")
                where[(t, k)] = len(lines)
    else:
        for t, kv in tables.items():
            lines.append(f"[{t}]  # table")
            for k, v in kv.items():
                lines.append(f"  {k} = {v}")
                where[(t, k)] = len(lines)
            lines.append("")
    text = "\n".join(lines)
    import tomllib
    assert tomllib.loads(text) == tables
    for (t, k), line in where.items():
        assert key_line(text, [t, k]) == line
        assert key_line(text, [t, k, "deeper"]) == line


def test_msgspec_structs_are_frozen():
    from fleetrl.daemon import config as c
    for typ in (c.DaemonSection, c.HttpSection, c.SupervisorSection, c.LoggingSection,
                c.RestartPolicy, c.Config, c.ActorSpec):
        assert typ.__struct_config__.frozen, typ
    with pytest.raises(AttributeError):
        msgspec.structs.replace(c.RestartPolicy(), intensity=2).intensity = 3  # type: ignore[misc]
