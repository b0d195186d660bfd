"""A stage's params checked before its heavy imports (Prefect, MLflow, torch: 5 s of a stage's
start), so that a config error answers early: the params file's own schema and the experiment the
command line names in 0.4 s, then every run's algorithm and hyper-parameters once torch is in
(3.5 s). Each heavy entry point calls it first when run as a command (`python -m flows.train
nosuch`); the stage's own checks of its inputs follow the imports."""

from __future__ import annotations

import argparse
import sys

from pfl_tasks.config import load_params
from pfl_tasks.errors import ConfigError


def params_path(argv: list[str]) -> str:
    """`--params` as the stage's own parser reads it (`--params X`, `--params=X`)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--params", default="params.yaml")
    return parser.parse_known_args(argv)[0].params


def check_params_first(stage: str, argv: list[str] | None = None) -> None:
    """Exit 2 with `stage_main`'s one line when the params file, or the experiment named first on
    the command line, is wrong; `--help` and everything else are left to the stage."""
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        return
    try:
        params = load_params(params_path(argv))
        if argv and not argv[0].startswith("-"):
            params.experiment(argv[0])
        from pfl_tasks.algorithms import validate_params  # torch, but not yet Prefect or MLflow

        validate_params(params)  # each run's algorithm and hyper-parameters
    except ConfigError as err:
        print(f"{stage} failed: {err}", file=sys.stderr)
        sys.exit(2)
