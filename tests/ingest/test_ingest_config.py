"""The ingest actor's config and request options: bad values are named."""

from __future__ import annotations

import msgspec
import pytest

from fleetrl.actors.ingest import IngestConfig, IngestHandle
from fleetrl.actors.ingest.actor import format_of, watch_format


def test_config_defaults_and_checks():
    assert IngestConfig().store_dir == "ingest" and IngestConfig().watch_dir is None
    with pytest.raises(msgspec.ValidationError, match="default_template = 'x' is not a key of templates"):
        msgspec.convert({"default_template": "x"}, IngestConfig)
    with pytest.raises(msgspec.ValidationError, match="poll_s"):
        msgspec.convert({"poll_s": 0}, IngestConfig)
    with pytest.raises(msgspec.ValidationError, match="wach_dir"):
        msgspec.convert({"wach_dir": "x"}, IngestConfig)


def test_the_format_comes_from_the_query_then_the_content_type():
    assert format_of("atif", "application/vnd.fleetrl.fleetrl+jsonl", "auto") == "atif"
    assert format_of(None, "application/vnd.fleetrl.openai-log+jsonl", "auto") == "openai-log"
    assert format_of(None, "application/json; charset=utf-8; format=mini-swe-agent", "auto") == "mini-swe-agent"
    assert format_of(None, "application/x-ndjson", "fleetrl") == "fleetrl"
    assert watch_format("a.traj.json", "auto") == "mini-swe-agent" and watch_format("a.json", "auto") == "auto"


def test_request_options_are_checked():
    h = IngestHandle(store=None, cfg=IngestConfig(from_turn=1), templates={})  # type: ignore[arg-type]
    assert h.options({}).from_turn == 1 and h.options({"from_turn": "0"}).from_turn == 0
    assert h.options({"only_failed": "true"}).only_failed is True
    for bad, what in [({"from_turn": "-1"}, "from_turn"), ({"from_turn": "x"}, "from_turn"),
                      ({"at": "never"}, "at must be"), ({"only_failed": "yes"}, "only_failed"),
                      ({"template": "t"}, "template='t'"), ({"fmt": "atif"}, "unknown query parameter")]:
        with pytest.raises(ValueError, match=what):
            h.options(bad)
