# Two commands matter: `make demo` and `make test`. Both bootstrap .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The demo needs the servers (the `server` extra); the tests also need the dev tools and torch.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP      := $(VENV)/.installed
# Extras the test suite exercises (torch: the CPU build for the TorchAdapter tests;
# trl: transformers and TRL for tests/jobside/test_trl_*.py, on CPU; kubernetes: lightkube for
# tests/kube; otel: OpenTelemetry for the tracing tests).
TEST_EXTRAS ?= server,dev,torch,trl,kubernetes,otel
API_DIR     := src/tslice/api
# Every pip install: no byte-compiling of what it installs (torch, transformers, verl: about a
# minute and a half of CPU on 2 cores per venv); Python compiles what a test imports, once.
PIP_INSTALL := -m pip install --quiet --disable-pip-version-check --no-compile
# ... which needs Python to write what it compiled: with PYTHONDONTWRITEBYTECODE set (as on
# these machines and CI runners) every server process a test starts compiled grpc, protobuf,
# pydantic and tslice from source again (the suite took 704 s on a clean clone, 490 s where
# an older install had left the .pyc files).
unexport PYTHONDONTWRITEBYTECODE
# pytest-xdist workers for the suites below (CI has 2 cores); PYTEST_WORKERS=0 runs them in
# the pytest process itself (pdb, -x). --dist loadfile keeps a module's tests, and the
# servers its module-scoped fixtures start, on one worker; --no-loadscope-reorder keeps the
# collection's order (the slow modules first, tests/conftest.py) where xdist would send the
# modules with most tests first, and so the one-test 20-40 s modules last, together. A plain
# `pytest` runs serially.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: all venv demo test test-tools test-oldest oldest-venv oldest-install jobside-venvs jobside-deps test-floor test-newest test-protobuf test-jobside unit \
	test-ray test-verl verl-venv lint typecheck \
	api api-check api-tools dist bench clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)
	@$(PY) $(PIP_INSTALL) --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(PY)
	@$(PY) $(PIP_INSTALL) -e ".[server]"
	@touch $@

# A test install covers the demo's too.
$(STAMP): pyproject.toml | $(PY)
	@$(PY) $(PIP_INSTALL) -e ".[$(TEST_EXTRAS)]"
	@touch $@ $(DEMO_STAMP)

venv: $(STAMP)

## The main job: two simulated RL jobs time-sliced on two simulated pools.
demo: $(DEMO_STAMP)
	$(VENV)/bin/tslice demo

## Everything CI checks: lint, types, layer contracts, generated code, tests.
test: $(STAMP) api-tools test-tools
	$(VENV)/bin/ruff check src tests bench examples scripts deploy
	$(VENV)/bin/ruff format --check src tests bench examples scripts deploy
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q $(XDIST)

## The oldest supported Python, servers + dev tools (no torch: its tests skip), in its own venv.
OLDEST_PYTHON ?= python3.10
OLDEST_VENV   := .venv-oldest
# (tests/jobside runs on this Python in test-floor, with the oldest grpcio and protobuf.)
# On 3.10 CI runs the servers' and the workload library's tests (tests/agent,
# tests/orchestrator, tests/workload, the wire pins). The job side on 3.10 is test-floor's
# (tests/jobside against real servers); the suites of whole clusters of real processes
# (integration, security, fuzzing, chaos, faults, the benchmarks' short forms, Kubernetes
# and Slurm modes), the CLI's, the simulator's and the manifests' test behaviour, not the
# language: `make test` runs them.
OLDEST_SKIPS := tests/jobside tests/integration tests/security tests/fuzz tests/chaos \
	tests/faults tests/bench tests/kube tests/slurm tests/deploy tests/client tests/cli \
	tests/sim tests/test_serving.py
# (mypy is not run again here: `make test`'s mypy already checks for 3.10, python_version
# in pyproject.toml.)
test-oldest: api-tools oldest-install
	$(OLDEST_VENV)/bin/python -m pytest -q $(XDIST) $(addprefix --ignore=,$(OLDEST_SKIPS))
## tslice itself into the oldest Python's venv (CI does this before `make dist` builds the
## wheel alongside: never two builds of the tree at once).
oldest-install: $(OLDEST_VENV)/.tslice
$(OLDEST_VENV)/.tslice: pyproject.toml $(OLDEST_VENV)/.installed
	@$(OLDEST_VENV)/bin/python $(PIP_INSTALL) --no-deps -e .
	@touch $@
## The oldest Python's venv with tslice's requirements but not tslice (CI makes it in the
## background while `make test` runs; tslice goes in at test-oldest, see scripts/requirements.py).
oldest-venv: $(OLDEST_VENV)/.installed
$(OLDEST_VENV)/.installed: pyproject.toml
	@test -x $(OLDEST_VENV)/bin/python || $(OLDEST_PYTHON) -m venv $(OLDEST_VENV)
	@$(OLDEST_VENV)/bin/python $(PIP_INSTALL) --upgrade pip
	@$(PYTHON) scripts/requirements.py server,dev >$(OLDEST_VENV)/requirements.txt
	@$(OLDEST_VENV)/bin/python $(PIP_INSTALL) -r $(OLDEST_VENV)/requirements.txt
	@touch $@

## The job side alone (`pip install tslice`, no extras) on the oldest grpcio/protobuf it
## supports (test-floor: the floors in pyproject.toml, pinned) and on the newest
## (test-newest), running tests/jobside against servers from .venv (real processes).
FLOOR_VENV  := build/venv-floor
NEWEST_VENV := build/venv-newest
JOBSIDE_TEST_DEPS := pytest pytest-asyncio pytest-timeout pytest-xdist
JOBSIDE_TESTS ?= tests/jobside
# The Python a job-side venv is made with; test-floor takes the oldest one where there is one
# (OLDEST_PYTHON, as test-oldest), so the floor is the floor of everything.
JOBSIDE_PYTHON ?= $(PY)
test-floor: $(STAMP)
	@floor_python=$(PY); \
	if $(OLDEST_PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then \
	  floor_python=$(OLDEST_PYTHON); fi; \
	$(MAKE) --no-print-directory test-jobside JOBSIDE_VENV=$(FLOOR_VENV) \
	  JOBSIDE_PYTHON=$$floor_python JOBSIDE_PINS="$$($(PY) scripts/floor_pins.py)"
test-newest: $(STAMP)
	@$(MAKE) --no-print-directory test-jobside JOBSIDE_VENV=$(NEWEST_VENV) \
	  JOBSIDE_PINS="--upgrade grpcio protobuf"
## (CI installs the floor, newest and Ray venvs' dependencies in the background while `make
## test` runs, with the system Python as .venv does not exist yet: tslice itself goes in at
## test-floor, test-newest and test-ray, which install everything anyway without it.)
jobside-venvs:
	@floor_python=$(PYTHON); \
	if $(OLDEST_PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then \
	  floor_python=$(OLDEST_PYTHON); fi; \
	$(MAKE) --no-print-directory jobside-deps JOBSIDE_VENV=$(FLOOR_VENV) \
	  JOBSIDE_PYTHON=$$floor_python JOBSIDE_PINS="$$($(PYTHON) scripts/floor_pins.py)"
	@$(MAKE) --no-print-directory jobside-deps JOBSIDE_VENV=$(NEWEST_VENV) JOBSIDE_PYTHON=$(PYTHON) \
	  JOBSIDE_PINS="--upgrade grpcio protobuf"
	@$(MAKE) --no-print-directory jobside-deps JOBSIDE_VENV=$(RAY_VENV) JOBSIDE_PYTHON=$(PYTHON) \
	  JOBSIDE_PINS="ray==$(RAY_VERSION)"
jobside-deps:
	@test -x $(JOBSIDE_VENV)/bin/python || $(JOBSIDE_PYTHON) -m venv $(JOBSIDE_VENV)
	@$(JOBSIDE_VENV)/bin/python $(PIP_INSTALL) $(JOBSIDE_PINS) $(JOBSIDE_TEST_DEPS)
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
	@test -x $(JOBSIDE_VENV)/bin/python || $(JOBSIDE_PYTHON) -m venv $(JOBSIDE_VENV)
	@$(JOBSIDE_VENV)/bin/python $(PIP_INSTALL) -e . $(JOBSIDE_PINS) $(JOBSIDE_TEST_DEPS)
	@$(JOBSIDE_VENV)/bin/python -c "import grpc, google.protobuf as p; \
	  import sys; print('job side on Python', sys.version.split()[0], 'grpcio', grpc.__version__, 'protobuf', p.__version__, \
	  '(no extras)')"
	TSLICE_SERVER_PYTHON=$(abspath $(PY)) $(JOBSIDE_VENV)/bin/python -m pytest -q $(XDIST) \
	  $(JOBSIDE_TESTS)

## tslice inside Ray actors (tests/jobside/test_ray_*.py), protobuf as Ray installs it: its
## own venv with Ray and the job side only, servers from .venv. No torch may come with Ray.
RAY_VENV    := build/venv-ray
RAY_VERSION ?= 2.60.0
test-ray: $(STAMP)
	@test -x $(RAY_VENV)/bin/python || $(PY) -m venv $(RAY_VENV)
	@$(RAY_VENV)/bin/python $(PIP_INSTALL) "ray==$(RAY_VERSION)" $(JOBSIDE_TEST_DEPS) -e .
	@if $(RAY_VENV)/bin/python -c "import torch" 2>/dev/null; then \
	  echo "the Ray venv has torch: Ray's install must not pull it" >&2; exit 1; fi
	@$(RAY_VENV)/bin/python -c "import google.protobuf, ray; \
	  print('ray', ray.__version__, 'protobuf', google.protobuf.__version__)"
	@# (serially, as test-verl: nearly all of the time is one module's Ray cluster)
	TSLICE_SERVER_PYTHON=$(abspath $(PY)) $(RAY_VENV)/bin/python -m pytest -q \
	  tests/jobside/test_ray_actors.py tests/jobside/test_ray_announce.py tests/jobside/test_ray_env.py \
	  tests/jobside/test_verl_launcher.py

## veRL's real trainer classes on CPU (tests/jobside/test_verl.py): its own venv (about 2 GB
## and 3 minutes the first time). torch==2.13.0 is named so that verl's tensordict does not
## resolve to a CUDA build; verl[verl-core] brings what verl.trainer.ppo.v1 imports.
VERL_VENV    := build/venv-verl
VERL_VERSION ?= 0.9.1
## (The venv alone, without .venv: CI makes it in the background while the suite runs.)
verl-venv: $(VERL_VENV)/.installed
$(VERL_VENV)/.installed: pyproject.toml
	@test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	@$(VERL_VENV)/bin/python $(PIP_INSTALL) torch==2.13.0 "verl[verl-core]==$(VERL_VERSION)" \
	  $(JOBSIDE_TEST_DEPS)
	@$(VERL_VENV)/bin/python -c "import torch, verl; assert torch.__version__.startswith('2.13.0'); \
	  print('verl', verl.__version__, 'torch', torch.__version__)"
	@touch $@
# tslice itself goes in here, not in the background (two editable builds of one tree at once
# would share its egg-info).
test-verl: $(STAMP) $(VERL_VENV)/.installed
	@$(VERL_VENV)/bin/python $(PIP_INSTALL) -e .
	TSLICE_SERVER_PYTHON=$(abspath $(PY)) $(VERL_VENV)/bin/python -m pytest -q \
	  tests/jobside/test_verl.py tests/jobside/test_verl_launcher.py

unit: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples scripts deploy
	$(VENV)/bin/ruff format --check src tests bench examples scripts deploy

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## Regenerate src/tslice/api from proto/ (the pinned generator runs in build/gen-api-venv).
api: $(STAMP)
	$(PY) scripts/gen_api.py

## The Debian programs the tests start (kubectl, promtool, chromium, tmux, Slurm and munge,
## systemd-analyze), installed when absent (root, or sudo; see the script).
test-tools:
	@scripts/test_tools.sh

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
