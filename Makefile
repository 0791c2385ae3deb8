# Two commands matter: `make demo` and `make test`. Both bootstrap .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The demo needs the servers (the `server` extra); the tests also need the dev tools and torch.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP      := $(VENV)/.installed
# Extras the test suite exercises (torch: the CPU build for the TorchAdapter tests).
TEST_EXTRAS ?= server,dev,torch
API_DIR     := src/tslice/api

.PHONY: all venv demo test test-oldest test-floor test-newest test-protobuf test-jobside unit \
	lint typecheck \
	api api-check api-tools dist bench clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(PY)
	@$(PY) -m pip install --quiet -e ".[server]"
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
test: $(STAMP) api-tools
	$(VENV)/bin/ruff check src tests bench examples scripts
	$(VENV)/bin/ruff format --check src tests bench examples scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

## The oldest supported Python, servers + dev tools (no torch: its tests skip), in its own venv.
OLDEST_PYTHON ?= python3.10
OLDEST_VENV   := .venv-oldest
test-oldest: api-tools
	@test -x $(OLDEST_VENV)/bin/python || $(OLDEST_PYTHON) -m venv $(OLDEST_VENV)
	@$(OLDEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	@$(OLDEST_VENV)/bin/python -m pip install --quiet -e ".[server,dev]"
	$(OLDEST_VENV)/bin/mypy
	$(OLDEST_VENV)/bin/python -m pytest -q

## The job side alone (`pip install tslice`, no extras) on the oldest grpcio/protobuf it
## supports (test-floor: the floors in pyproject.toml, pinned) and on the newest
## (test-newest), running tests/jobside against servers from .venv (real processes).
FLOOR_VENV  := build/venv-floor
NEWEST_VENV := build/venv-newest
JOBSIDE_TEST_DEPS := pytest pytest-asyncio pytest-timeout
JOBSIDE_TESTS ?= tests/jobside
test-floor: $(STAMP)
	@$(MAKE) --no-print-directory test-jobside JOBSIDE_VENV=$(FLOOR_VENV) \
	  JOBSIDE_PINS="$$($(PY) scripts/floor_pins.py)"
test-newest: $(STAMP)
	@$(MAKE) --no-print-directory test-jobside JOBSIDE_VENV=$(NEWEST_VENV) \
	  JOBSIDE_PINS="--upgrade grpcio protobuf typing_extensions"
## protobuf 5 and 6 between those two (the first release of each major: the one that
## lacks the most), grpcio at its floor: the import checks and the stack smoke test.
PROTOBUF_BETWEEN ?= 5.26.1 6.30.0
test-protobuf: $(STAMP)
	@for version in $(PROTOBUF_BETWEEN); do \
	  $(MAKE) --no-print-directory test-jobside JOBSIDE_VENV=build/venv-protobuf \
	    JOBSIDE_PINS="$$($(PY) scripts/floor_pins.py protobuf==$$version)" \
	    JOBSIDE_TESTS="tests/jobside/test_imports.py tests/jobside/test_stack.py" || exit 1; \
	done
# (called by the three above) one job-side venv: tslice without extras, the pins, pytest.
test-jobside:
	@test -x $(JOBSIDE_VENV)/bin/python || $(PY) -m venv $(JOBSIDE_VENV)
	@$(JOBSIDE_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	  -e . $(JOBSIDE_PINS) $(JOBSIDE_TEST_DEPS)
	@$(JOBSIDE_VENV)/bin/python -c "import grpc, google.protobuf as p, typing_extensions; \
	  from importlib.metadata import version as v; \
	  print('job side on grpcio', grpc.__version__, 'protobuf', p.__version__, \
	  'typing_extensions', v('typing_extensions'), '(no extras)')"
	TSLICE_SERVER_PYTHON=$(abspath $(PY)) $(JOBSIDE_VENV)/bin/python -m pytest -q $(JOBSIDE_TESTS)

unit: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples scripts
	$(VENV)/bin/ruff format --check src tests bench examples scripts

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## Regenerate src/tslice/api from proto/ (the pinned generator runs in build/gen-api-venv).
api: $(STAMP)
	$(PY) scripts/gen_api.py

## Make the generator venv now (the staleness test then installs nothing).
api-tools: $(STAMP)
	@$(PY) scripts/gen_api.py --tools >/dev/null

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

## The release artefacts: wheel + sdist (python -m build), twine check, and the wheel
## installed in a clean venv, first without extras (the job side), then with [server].
dist: $(STAMP)
	rm -rf dist && mkdir -p build
	@$(PY) -m build --outdir dist . >build/build.log 2>&1 || { cat build/build.log; exit 1; }
	@ls dist
	$(VENV)/bin/twine check --strict dist/*
	scripts/check_dist.sh $(PY) dist build/dist-check

bench: $(STAMP)
	$(PY) bench/handoff.py
	$(PY) bench/offload.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) build dist .mypy_cache .ruff_cache .pytest_cache src/*.egg-info
