# The two commands (see README.md). Both set everything up first; set-up is
# idempotent and quick when already done.
VENV ?= .venv
CONFIG ?=
PYTEST_ARGS ?=

.PHONY: setup run test bench clean

setup:
	@bash scripts/setup.sh

run: setup
	$(VENV)/bin/fleetrl serve $(if $(CONFIG),--config $(CONFIG),)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .fleetrl .pytest_cache
