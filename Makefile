# Two commands matter: `make demo` and `make test`. Both bootstrap .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The demo needs the core install only; the tests also need the dev tools and torch.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP      := $(VENV)/.installed
# Extras the test suite exercises (torch: the CPU build for the TorchAdapter tests).
TEST_EXTRAS ?= dev,torch
API_DIR     := src/tslice/api

.PHONY: all venv demo test test-oldest unit lint typecheck api api-check bench clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(PY)
	@$(PY) -m pip install --quiet -e .
	@touch $@

# A test install covers the demo's too.
$(STAMP): pyproject.toml | $(PY)
	@$(PY) -m pip install --quiet -e ".[$(TEST_EXTRAS)]"
	@touch $@ $(DEMO_STAMP)

venv: $(STAMP)

## The main job: two simulated RL jobs time-sliced on two simulated pools.
demo: $(DEMO_STAMP)
	$(VENV)/bin/tslice demo

## Everything CI checks: lint, types, layer contracts, generated code, tests.
test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples scripts
	$(VENV)/bin/ruff format --check src tests bench examples scripts
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

export GENERATE_INTO := import pathlib, sys; sys.path.insert(0, "scripts"); import gen_api; gen_api.generate(pathlib.Path(sys.argv[1]))
## Fail when src/tslice/api does not match what proto/ generates (fix: `make api`).
api-check: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PY) -c "$$GENERATE_INTO" "$$tmp" && \
	if diff -r -q -x __pycache__ "$$tmp" $(API_DIR); then \
	  echo "$(API_DIR) matches proto/"; \
	else \
	  echo "$(API_DIR) is stale against proto/: run \`make api\` and commit the result" >&2; \
	  exit 1; \
	fi

bench: $(STAMP)
	$(PY) bench/handoff.py
	$(PY) bench/offload.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .mypy_cache .ruff_cache .pytest_cache src/*.egg-info
