# Two commands matter: `make demo` and `make test`. Both bootstrap .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Extras the test suite exercises (torch: the CPU build for the TorchAdapter tests).
TEST_EXTRAS ?= dev,torch

.PHONY: all venv demo test test-oldest unit lint typecheck api api-check bench clean

all: test

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --quiet -e ".[$(TEST_EXTRAS)]"
	@touch $(STAMP)

venv: $(STAMP)

## The main job: two simulated RL jobs time-sliced on two simulated pools.
demo: $(STAMP)
	$(VENV)/bin/tslice demo

## Everything CI checks: lint, types, layer contracts, generated code, tests.
test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

## The oldest supported Python, core install (no torch: its tests skip), in its own venv.
OLDEST_PYTHON ?= python3.10
OLDEST_VENV   := .venv-oldest
test-oldest:
	@test -x $(OLDEST_VENV)/bin/python || $(OLDEST_PYTHON) -m venv $(OLDEST_VENV)
	@$(OLDEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	@$(OLDEST_VENV)/bin/python -m pip install --quiet -e ".[dev]"
	$(OLDEST_VENV)/bin/mypy
	$(OLDEST_VENV)/bin/python -m pytest -q

unit: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples scripts
	$(VENV)/bin/ruff format --check src tests bench examples scripts

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## Regenerate src/tslice/api from proto/.
api: $(STAMP)
	$(PY) scripts/gen_api.py

bench: $(STAMP)
	$(PY) bench/handoff.py
	$(PY) bench/offload.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .mypy_cache .ruff_cache .pytest_cache src/*.egg-info
