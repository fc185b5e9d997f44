# The two commands (see README.md). Both set everything up first; set-up is
# idempotent and quick when already done.
VENV ?= .venv
CONFIG ?= configs/tiny.toml
PYTEST_ARGS ?=

.PHONY: setup run test bench clean

setup:
	@bash scripts/setup.sh

# the embedded default (docs/guides/tiny-run.md); `make run CONFIG=run.toml` for your own
run: setup
	$(VENV)/bin/fleetrl serve --config $(CONFIG)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .fleetrl .pytest_cache
