# The two commands (see README.md). Both set everything up first; set-up is
# idempotent and quick when already done.
VENV ?= .venv
CONFIG ?= configs/tiny.toml
PYTEST_ARGS ?=

# the inner loop: the unit and property tests of the pure parts (about 2.5 minutes on 2
# cores); `make test` and .ci/run keep running everything
FAST_TESTS ?= tests/grpo tests/daemon tests/weights tests/simulate tests/harness tests/doctor \
	tests/test_imports.py tests/test_errors.py tests/test_docs_links.py tests/test_actor_template.py

.PHONY: setup run test test-fast bench clean

setup:
	@bash scripts/setup.sh

# the embedded default (docs/guides/tiny-run.md); `make run CONFIG=run.toml` for your own
run: setup
	$(VENV)/bin/fleetrl serve --config $(CONFIG)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(VENV)/bin/python -m pytest -m "not docker and not slow" $(FAST_TESTS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .fleetrl .pytest_cache
