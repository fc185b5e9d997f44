"""``[logging] console``: the stream gets all lines, only warnings, or none; the log
file always gets every line (a progress bar can own the terminal)."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.faults import ConfigError
from fleetrl.daemon.logs import close_logging, configure_logging


@pytest.fixture
def restore_structlog():
    yield
    close_logging()
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


@pytest.mark.parametrize("fmt", ["json", "console"])
@pytest.mark.parametrize(("console", "shown"), [("all", ["info line", "warning line"]),
                                                 ("warnings", ["warning line"]), ("none", [])])
def test_console_setting_filters_the_stream_not_the_file(tmp_path, restore_structlog, fmt, console, shown):
    out = io.StringIO()
    configure_logging(fmt=fmt, run_id="r", log_dir=tmp_path, stream=out, console=console)
    log = structlog.get_logger()
    log.info("info line")
    log.warning("warning line")
    text = out.getvalue()
    for event in ("info line", "warning line"):
        assert (event in text) == (event in shown)
    in_file = [json.loads(x)["event"] for x in (tmp_path / "daemon.jsonl").read_text().splitlines()]
    assert in_file == ["info line", "warning line"]


def test_console_setting_is_validated():
    assert load_config_text('[logging]\nconsole = "warnings"\n').logging.console == "warnings"
    with pytest.raises(ConfigError, match=r"logging.console"):
        load_config_text('[logging]\nconsole = "quiet"\n', source="x.toml")
