"""The package layout: each top-level folder is a subpackage of `fleetrl`."""
import importlib

import pytest
import trio


@pytest.mark.parametrize("name", ["daemon", "actors", "harness", "sandboxes", "grpo"])
def test_subpackages_import(name):
    mod = importlib.import_module(f"fleetrl.{name}")
    assert mod.__name__ == f"fleetrl.{name}"


async def test_trio_mode_runs_async_tests():
    with trio.fail_after(1):
        await trio.sleep(0)
