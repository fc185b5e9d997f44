"""The harness's errors: one root, and the builtins callers catch today kept as bases."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from fleetrl.harness import errors
from fleetrl.harness.errors import HarnessError

HARNESS = Path(__file__).resolve().parents[2] / "harness"


def harness_modules():
    for path in sorted(HARNESS.glob("*.py")):
        if path.stem != "__init__":
            yield importlib.import_module(f"fleetrl.harness.{path.stem}")


def test_every_error_class_of_the_harness_derives_from_harness_error():
    found = []
    for module in harness_modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                found.append(cls.__qualname__)
                assert issubclass(cls, HarnessError), f"{module.__name__}.{cls.__qualname__}"
    # the private ones too: how a task struct names a field, a trace line that is skipped
    assert {"HarnessError", "TaskError", "FieldProblem", "ApiError", "ModelUnavailable", "_Skip"} <= set(found)


@pytest.mark.parametrize("name", ["TaskError", "EvaluatorOutputError", "SyntheticTaskError", "FieldProblem"])
def test_errors_callers_catch_as_value_error_still_are(name):
    assert issubclass(getattr(errors, name), ValueError)


def test_the_old_homes_of_the_errors_still_name_them():
    from fleetrl.harness import model, openai_api, protocol, synthetic, tasks

    assert model.ModelUnavailable is errors.ModelUnavailable
    assert protocol.SetupFailed is errors.SetupFailed
    assert openai_api.ApiError is errors.ApiError
    assert synthetic.SyntheticTaskError is errors.SyntheticTaskError
    assert (tasks.TaskError, tasks.EvaluatorOutputError) == (errors.TaskError, errors.EvaluatorOutputError)
