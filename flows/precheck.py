"""A stage's params checked before its heavy imports (torch, Prefect, MLflow: 3-5 s of a stage's
start when they loaded one after the other), so that a config error answers early: the params file's own schema and the experiment the
command line names in 0.3 s, then every run's algorithm and hyper-parameters once torch is in
(1.2 s on a quiet 2-core VM, where torch's import is 1.0 s). Each heavy entry point, run as a
command, parses its command line first (`--help` and its errors), then calls this
(`python -m flows.train nosuch`); the stage's own checks of its inputs follow the imports. Once
the params file reads, the MLflow store process starts (`pfl_tasks.store_process`): MLflow's
imports and the store's opening then run on another core beside the stage's own (torch's, and
Prefect's when it orchestrates)."""

from __future__ import annotations

import gc
import sys

from pfl_tasks.config import load_params
from pfl_tasks.errors import ConfigError
from pfl_tasks.numerics import pin
from pfl_tasks.store_process import start as start_store_process
from pfl_tasks.tracking import tracking_uri


def check_params_first(stage: str, params_path: str, experiment: str) -> None:
    """Exit 2 with `stage_main`'s one line when the params file, or the experiment the command
    line names, is wrong."""
    try:
        params = load_params(params_path)
        params.experiment(experiment)
        pin(params.engine.numerics)  # before torch loads, and before the store process starts
        start_store_process(tracking_uri(params.tracking.mlflow_uri))  # MLflow loads beside torch
        from pfl_tasks.algorithms import validate_params  # torch, but not yet Prefect or MLflow

        validate_params(params)  # each run's algorithm and hyper-parameters
    except ConfigError as err:
        print(f"{stage} failed: {err}", file=sys.stderr)
        gc.freeze()  # the interpreter's exit then skips collecting torch's objects (0.3-0.5 s)
        sys.exit(2)


def pin_numerics_first(stage: str, params_path: str) -> None:
    """For an entry point that loads torch before it reads its params: pin `engine.numerics`
    from the params file first, or exit 2 with the one line."""
    try:
        pin(load_params(params_path).engine.numerics)
    except ConfigError as err:
        print(f"{stage} failed: {err}", file=sys.stderr)
        sys.exit(2)
