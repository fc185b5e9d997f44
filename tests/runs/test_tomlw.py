"""The TOML writer: tomllib reads back exactly what it wrote."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.runs.tomlw import dumps

keys = st.text(min_size=1, max_size=8)
scalars = (st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1)
           | st.floats(allow_nan=False) | st.text(max_size=20))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12,
)
docs = st.dictionaries(keys, values | st.lists(st.dictionaries(keys, values, max_size=3), min_size=1, max_size=3),
                       max_size=6)


@settings(max_examples=120, deadline=None)
@given(docs)
def test_round_trip(doc):
    assert tomllib.loads(dumps(doc)) == doc


def test_special_floats_and_strings():
    doc = {"a": math.inf, "b": -math.inf, "c": 1e-8, "d": 2.0, "e": 'quote " back \\ tab\t del\x7f nul\x00 é 😀'}
    back = tomllib.loads(dumps(doc))
    assert back == doc
    assert math.isnan(tomllib.loads(dumps({"x": math.nan}))["x"])


def test_arrays_of_tables_with_sub_tables():
    doc = {"actors": {"pool": {"config": {"samplers": [{"id": "a", "opts": {"k": 1}}, {"id": "b"}]}}}}
    text = dumps(doc)
    assert "[[actors.pool.config.samplers]]" in text
    assert tomllib.loads(text) == doc


def test_unsupported_values_name_the_key():
    with pytest.raises(TypeError, match=r"actors\.x\.when: TOML cannot hold a NoneType"):
        dumps({"actors": {"x": {"when": None}}})
    with pytest.raises(TypeError, match="has key 1"):
        dumps({"t": {1: "a"}})


def test_the_tiny_config_round_trips():
    path = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
    doc = tomllib.loads(path.read_text())
    assert tomllib.loads(dumps(doc)) == doc


def test_keys_that_need_quotes():
    doc = {"0\n": {"a b": 1, "": 2, "x.y": [{"é": True}]}}
    assert tomllib.loads(dumps(doc)) == doc
