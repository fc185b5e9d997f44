"""``[daemon] compute_threads``: read from the raw TOML before torch loads, set in the
environment, and so followed by every thread of the process (daemon/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.faults import ConfigError
from fleetrl.daemon.threads import THREAD_VARIABLES, apply_compute_threads, compute_threads_of

HEAD = '[daemon]\nstate_dir = "s"\n'
ACTOR = '\n[actors.beat]\nfactory = "fleetrl.daemon.ticker:run"\n'


@pytest.mark.parametrize(("text", "want"), [
    (HEAD + "compute_threads = 1\n", 1),
    (HEAD + "compute_threads = 3\n", 3),
    (HEAD, None),                                   # absent
    ("", None),                                     # no [daemon]
    (HEAD + "compute_threads = 0\n", None),         # invalid: load_config names it
    (HEAD + "compute_threads = true\n", None),
    (HEAD + 'compute_threads = "2"\n', None),
    ("[daemon\nbroken", None),                      # not TOML: load_config names it
])
def test_peek_reads_only_a_valid_value(tmp_path, text, want):
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert compute_threads_of(path) == want


def test_peek_of_a_missing_file_is_none(tmp_path):
    assert compute_threads_of(tmp_path / "nope.toml") is None


def test_apply_sets_every_variable_or_nothing():
    env: dict[str, str] = {"OMP_NUM_THREADS": "8"}
    apply_compute_threads(None, env)
    assert env == {"OMP_NUM_THREADS": "8"}
    apply_compute_threads(2, env)
    assert {k: env[k] for k in THREAD_VARIABLES} == dict.fromkeys(THREAD_VARIABLES, "2")


def test_config_validates_the_key():
    assert load_config_text(HEAD + "compute_threads = 2\n" + ACTOR).daemon.compute_threads == 2
    assert load_config_text(HEAD + ACTOR).daemon.compute_threads is None
    with pytest.raises(ConfigError) as err:
        load_config_text(HEAD + "compute_threads = 0\n" + ACTOR, source="run.toml")
    assert err.value.key == "daemon.compute_threads" and err.value.line == 3


PROBE = """
import sys, threading
from fleetrl.daemon.cli import _serve_threads_first
_serve_threads_first(sys.argv[1:])
import torch
seen = []
t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
t.start(); t.join()
print(seen[0], torch.get_num_threads())
"""


def _threads_seen(args: list[str]) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    out = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    return int(out[0]), int(out[1])


def test_serve_sets_threads_before_torch_loads_in_every_thread(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(HEAD + "compute_threads = 1\n" + ACTOR)
    assert _threads_seen(["serve", "--config", str(path)]) == (1, 1)
    assert _threads_seen(["serve", f"--config={path}"]) == (1, 1)
    if (os.cpu_count() or 1) > 1:  # without the key torch keeps its default (one per core)
        path.write_text(HEAD + ACTOR)
        assert _threads_seen(["serve", "--config", str(path)]) != (1, 1)
        assert _threads_seen(["status"]) != (1, 1)  # only serve reads it
