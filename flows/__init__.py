"""Prefect flows and the thin entry points that `dvc.yaml` stages call. Each entry point sets
the environment's defaults (`flows.environment`) before Prefect and MLflow load; importing a
flow changes no environment."""

import importlib.util
import sys

if importlib.util.find_spec("torch") is None:  # not the project's virtualenv
    sys.exit("flows needs the project's virtualenv: run `make venv`, then `source .venv/bin/activate` "
             "(or call .venv/bin/python)")
