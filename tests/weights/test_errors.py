"""One root for every error of the weights package, still caught as the builtins were."""

import importlib
import inspect
import pkgutil

import pytest

import fleetrl.actors.weights as weights
from fleetrl.actors.weights import codec, errors, follower, http, manifest, store, streams
from fleetrl.actors.weights.version import NO_VERSION, version_label


def _package_modules():
    return [importlib.import_module(f"{weights.__name__}.{m.name}")
            for m in pkgutil.iter_modules(weights.__path__)]


def test_every_exception_class_of_the_package_derives_from_delta_error():
    found = set()
    for mod in _package_modules():
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith(weights.__name__):
                found.add(obj)
                assert issubclass(obj, errors.DeltaError), f"{mod.__name__}.{name}"
                assert obj.__module__ == errors.__name__, f"{name} is defined outside errors.py"
    assert found == {getattr(errors, n) for n in errors.__all__}


def test_the_root_is_a_value_error_and_blob_not_found_a_key_error_too():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), ValueError)
    with pytest.raises(KeyError):
        raise errors.BlobNotFound("abc")
    assert str(errors.BlobNotFound("abc")) == "'abc'"  # KeyError's str, as before


@pytest.mark.parametrize(("module", "name"), [
    (codec, "DeltaError"), (codec, "DeltaFormatError"), (codec, "DeltaMismatchError"),
    (codec, "DeltaVerifyError"), (streams, "StreamError"), (manifest, "ManifestError"),
    (store, "BlobNotFound"), (follower, "BlobIntegrityError"), (http, "RangeError"),
    (http, "BlobIntegrityError"), (weights, "DeltaError"), (weights, "BlobNotFound"),
    (weights, "ManifestError"), (weights, "BlobIntegrityError"),
])
def test_errors_stay_importable_where_callers_import_them(module, name):
    assert getattr(module, name) is getattr(errors, name)


def test_a_range_error_is_a_delta_error():
    with pytest.raises(errors.DeltaError, match="not satisfiable"):
        http.parse_range("bytes=10-20", 5)


def test_version_label_names_no_version():
    assert version_label(NO_VERSION) == "none"
    assert version_label(7) == "7"
