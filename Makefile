# Two entry points for a fresh machine: `make run` (the pipeline) and `make test` (the suite).
# Both create .venv and install the pinned dependencies first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PATH := $(CURDIR)/$(BIN):$(PATH)  # stage commands call `python` from the venv

export DVC_NO_ANALYTICS := 1
export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION := false

.PHONY: run quick test venv bench ray check-algo

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt -c requirements.lock
	touch $@

run: venv  # dvc.yaml from params.yaml, then dvc repro with one Prefect server (UI URL printed)
	$(BIN)/python -m flows.repro

quick: venv  # the quickstart (about 50 s): params-quick.yaml end to end, its outputs in quickstart/
	$(BIN)/python -m flows.pipeline --params params-quick.yaml --root quickstart

ray: $(VENV)/.ray-installed  # the optional Ray task runner

$(VENV)/.ray-installed: requirements-ray.txt requirements.lock $(VENV)/.installed
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements-ray.txt -c requirements.lock
	touch $@

test: venv ray
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

check-algo: venv  # one algorithm's registry-parametrized checks: make check-algo NAME=ditto
	$(BIN)/python -m pytest -q tests/test_engine.py tests/test_device.py --algorithm $(NAME)

bench: venv  # P1-P4 ratios and a profile, then the whole make run timed on a fresh clone with the
             # edit check (about 8 minutes, then make run's time plus 2): bench/results/<date>-<host>{,-repro}.{json,md}
	$(BIN)/python -m bench.run $(BENCH_ARGS)
	$(BIN)/python -m bench.repro
