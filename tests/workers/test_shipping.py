"""Shipping a harness to remote workers (actors/workers/shipping.py): signed, by import
path or pickled by value; refused unsigned, tampered, under another key, or pickled over
a connection without TLS. The pickled harness is unpickled in a fresh interpreter that
cannot import the user's module, as on a worker host."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
from .userharness_src import SOURCE

from fleetrl.actors.workers.shipping import UnsafeHarness, new_key, open_harness, ship_harness, sign
from fleetrl.harness.builtin import CompletionHarness


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "acme_harness.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "acme_harness"
    sys.modules.pop("acme_harness", None)


def test_fleetrl_s_own_harness_travels_by_import_path_and_loads_with_its_config():
    key = new_key()
    msg = ship_harness("fleetrl.harness.builtin:CompletionHarness", {"max_tokens": 7}, key)
    assert msg.kind == "import" and msg.payload == b'{"max_tokens": 7}'
    harness = open_harness(msg, key, secure=False)  # no code is unpickled: plain ws:// is allowed
    assert harness == CompletionHarness(max_tokens=7)


def test_a_user_harness_is_pickled_by_value_and_runs_where_its_module_is_absent(user_module, tmp_path):
    key = new_key()
    msg = ship_harness(f"{user_module}:EchoingHarness", {"max_tokens": 5, "marker": "m-1"}, key)
    assert msg.kind == "pickle"
    assert sys.modules[user_module]  # loaded here, in the daemon
    blob = tmp_path / "wire.bin"
    blob.write_bytes(msgspec.msgpack.encode(msg))
    key_file = tmp_path / "key.bin"
    key_file.write_bytes(key)
    # a fresh interpreter in another directory: `acme_harness` is not importable there
    code = f"""
import importlib.util, msgspec
assert importlib.util.find_spec("acme_harness") is None
from fleetrl.daemon.worker_messages import HarnessShipped
from fleetrl.actors.workers.shipping import open_harness
msg = msgspec.msgpack.decode(open({str(blob)!r}, "rb").read(), type=HarnessShipped)
h = open_harness(msg, open({str(key_file)!r}, "rb").read(), secure=True)
print(type(h).__name__, h.marker, h.inner.max_tokens, h.sandbox_use)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["EchoingHarness", "m-1", "5", "files"]


def test_a_pickled_harness_is_refused_without_tls_unsigned_tampered_or_under_another_key(user_module):
    key = new_key()
    msg = ship_harness(f"{user_module}:EchoingHarness", {}, key)
    with pytest.raises(UnsafeHarness, match="not TLS"):
        open_harness(msg, key, secure=False)
    with pytest.raises(UnsafeHarness, match="unsigned"):
        open_harness(msgspec.structs.replace(msg, mac=b""), key, secure=True)
    with pytest.raises(UnsafeHarness, match="signature does not match"):
        open_harness(msg, new_key(), secure=True)
    tampered = msgspec.structs.replace(msg, payload=msg.payload[:-1] + bytes([msg.payload[-1] ^ 1]))
    with pytest.raises(UnsafeHarness, match="signature does not match"):
        open_harness(tampered, key, secure=True)
    relabelled = msgspec.structs.replace(msg, kind="import")  # the kind is signed too
    with pytest.raises(UnsafeHarness, match="signature does not match"):
        open_harness(relabelled, key, secure=True)
    ok = open_harness(msg, key, secure=True)
    assert type(ok).__name__ == "EchoingHarness"


def test_an_import_config_that_is_not_an_object_is_named():
    key = new_key()
    payload = b"[1, 2]"
    msg = msgspec.structs.replace(ship_harness("fleetrl.harness.builtin:CompletionHarness", {}, key),
                                  payload=payload, mac=sign(key, "import", "fleetrl.harness.builtin:CompletionHarness",
                                                            payload))
    with pytest.raises(ValueError, match="must be a JSON object"):
        open_harness(msg, key, secure=True)


def test_a_struct_harness_of_user_code_is_refused_at_ship_time_with_the_way_out(user_module):
    with pytest.raises(ValueError, match='msgspec Struct.*ship_harness = "import"'):
        ship_harness(f"{user_module}:StructHarness", {}, new_key())
    # by import path it is fine (its module must then be installed on the workers)
    assert ship_harness(f"{user_module}:StructHarness", {}, new_key(), mode="import").kind == "import"


def test_a_harness_that_does_not_load_is_an_error_naming_it():
    with pytest.raises(ValueError, match="no_such_module"):
        ship_harness("no_such_module:Harness", {}, new_key())
