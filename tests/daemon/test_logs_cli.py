"""Log output and CLI command-group discovery."""

from __future__ import annotations

import io
import json
from importlib.metadata import EntryPoint

import pytest
import structlog

from fleetrl.daemon import cli
from fleetrl.daemon.logs import close_logging, configure_logging


@pytest.fixture
def restore_structlog():
    yield
    close_logging()
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_json_lines_carry_actor_and_run_id_in_stream_and_file(tmp_path, restore_structlog):
    out = io.StringIO()
    assert configure_logging(fmt="auto", run_id="run-x", log_dir=tmp_path, stream=out)
    log = structlog.get_logger()
    log.info("from the daemon")
    with structlog.contextvars.bound_contextvars(actor="trainer"):
        log.warning("from an actor", step=3)
    log.debug("filtered out at info level")
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [(e["event"], e["actor"], e["run_id"]) for e in lines] == [
        ("from the daemon", "daemon", "run-x"), ("from an actor", "trainer", "run-x")]
    assert lines[1]["step"] == 3 and lines[1]["level"] == "warning"
    file_lines = [json.loads(x) for x in (tmp_path / "daemon.jsonl").read_text().splitlines()]
    assert file_lines == lines


def test_console_format_is_readable(tmp_path, restore_structlog):
    out = io.StringIO()
    assert not configure_logging(fmt="console", run_id="run-y", stream=out)
    structlog.get_logger().info("hello", n=1)
    text = out.getvalue()
    assert "hello" in text and "run_id=run-y" in text and "actor=daemon" in text
    assert not text.lstrip().startswith("{")


def test_a_broken_command_group_does_not_break_the_others(capsys, monkeypatch, test_actors):
    eps = [EntryPoint("broken", "no_such_module_for_fleetrl:register", cli.ENTRY_POINT_GROUP),
           EntryPoint("hello", "daemon_test_actors:register", cli.ENTRY_POINT_GROUP)]
    parser = cli.build_parser(load_groups=False)
    sub = next(a for a in parser._actions if a.dest == "command")
    cli._load_groups(sub, eps)
    err = capsys.readouterr().err
    assert "command group 'broken' (no_such_module_for_fleetrl:register) is unavailable" in err
    assert parser.parse_args(["hello"]).func(None) == 0
    assert parser.parse_args(["config", "check", "x.toml"]).file == "x.toml"


def test_a_command_loads_only_the_group_named_like_it(capsys, monkeypatch, test_actors):
    eps = [EntryPoint("broken", "no_such_module_for_fleetrl:register", cli.ENTRY_POINT_GROUP),
           EntryPoint("hello", "daemon_test_actors:register", cli.ENTRY_POINT_GROUP)]
    assert cli.groups_needed(["serve", "--config", "x.toml"], eps) == []
    assert cli.groups_needed(["config", "check", "hello"], eps) == []
    assert cli.groups_needed(["hello", "--flag"], eps) == [eps[1]]
    assert cli.groups_needed(["--help"], eps) == eps
    assert cli.groups_needed([], eps) == eps
    assert cli.groups_needed(["unknown"], eps) == eps  # a group may register another name
    monkeypatch.setattr(cli, "entry_points", lambda group: eps)
    assert cli.main(["hello"]) == 0
    assert "broken" not in capsys.readouterr().err  # never imported
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr()
    assert "broken" not in out.err  # the overview loads no group: each is listed by its entry point
    assert "command group no_such_module_for_fleetrl:register" in out.out and "    hello " in out.out


def test_no_command_prints_help_and_returns_2(capsys):
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().err


def test_actor_metrics_are_get_or_create_and_labelled():
    from prometheus_client.parser import text_string_to_metric_families

    from fleetrl.daemon.metrics import ActorMetrics, MetricsRegistry

    reg = MetricsRegistry()
    a, b = ActorMetrics(reg, "a"), ActorMetrics(reg, "b")
    a.counter("items_total", "Items").inc(2)
    a.counter("items_total", "Items").inc()  # a restarted actor asks again
    b.counter("items_total", "Items").inc(5)
    a.gauge("depth", "Depth", {"queue": "q1"}).set(7)
    with pytest.raises(ValueError, match="already exists as Counter"):
        a.gauge("items_total", "Items")
    fams = {f.name: f for f in text_string_to_metric_families(reg.render().decode())}
    got = {s.labels["actor"]: s.value for s in fams["fleetrl_items"].samples
           if s.name == "fleetrl_items_total"}
    assert got == {"a": 3.0, "b": 5.0}
    assert fams["fleetrl_depth"].samples[0].labels == {"actor": "a", "queue": "q1"}


def test_package_exports_are_lazy_and_real():
    import fleetrl.daemon as pkg
    from fleetrl.daemon import supervisor

    assert pkg.Supervisor is supervisor.Supervisor
    assert sorted(pkg.__all__) == pkg.__all__ and "ActorContext" in pkg.__all__
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pkg.Nope  # noqa: B018
