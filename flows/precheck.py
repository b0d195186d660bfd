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

import contextlib
import gc
import sys

from pfl_tasks.config import load_params, unknown
from pfl_tasks.errors import ConfigError, SourceError
from pfl_tasks.numerics import pin
from pfl_tasks.store_process import sqlite_path, start as start_store_process
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


def pin_numerics_first(stage: str, params_path: str, experiments=(), datasets=(), stored: bool = False,
                       runs=(), algorithms: bool = False) -> None:
    """For an entry point that loads torch, Prefect or MLflow before it reads its params: pin
    `engine.numerics` from the params file first, and check the names the command line gives
    (`experiments`: configured, or with `stored` held by the sqlite store; `datasets`; `runs`, a
    sweep's --algorithms) and the files of your own data they train on, and with `algorithms`
    every run's hyper-parameters and tuning grid (torch loads for it: about 1 s), or exit 2
    with the one line."""
    try:
        params = load_params(params_path)
        pin(params.engine.numerics)
        check_runs(params, runs)
        for name in params.experiments if algorithms else ():  # by name, without torch: a typo answers at once
            for i, run in enumerate(params.experiments[name].algorithms or params.algorithms):
                check_runs(params, [run], f"experiments.{name}.algorithms[{i}]")
        check_names(params, params_path, experiments, datasets, stored)
        if algorithms:
            from pfl_tasks.algorithms import validate_params

            validate_params(params)
    except ConfigError as err:
        print(f"{stage} failed: {err}", file=sys.stderr)
        sys.exit(2)


def check_names(params, params_path: str, experiments, datasets, stored: bool) -> None:
    """A ConfigError naming the first unknown experiment or dataset (the closest name, all of
    them), or a missing file of your own data among the datasets they use."""
    have = set(params.experiments) | (set(stored_experiments(params)) if stored else set())
    for experiment in experiments:
        if experiment not in have:
            raise ConfigError(f"{params_path}: {unknown('experiment', experiment, have)}")
    for dataset in datasets:
        if dataset not in params.datasets:
            raise ConfigError(f"{params_path}: {unknown('dataset', dataset, params.datasets)}")
    used = {*datasets, *(params.experiments[e].dataset for e in experiments if e in params.experiments)}
    for dataset in sorted(used or {e.dataset for e in params.experiments.values()}):
        source = params.datasets[dataset].source
        if source.name == "file" and not source.path.is_file():
            raise ConfigError(f"{params_path}: datasets.{dataset}.source.path: {source.path}: no such file "
                              "(relative to the project root)")
        if source.name == "file":
            from pfl_tasks.data.sources import check_columns, sniff

            try:
                sniff(source.path)
                check_columns(source)
            except SourceError as err:
                raise ConfigError(str(err)) from None


def stored_experiments(params) -> list[str]:
    """The experiment names a sqlite store holds, read with sqlite3 (MLflow's import takes
    seconds); none for a store that is not there, or not sqlite."""
    import sqlite3

    path = sqlite_path(tracking_uri(params.tracking.mlflow_uri))
    if path is None or not path.is_file():
        return []
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as store:
            return [name for (name,) in store.execute("SELECT name FROM experiments")]
    except sqlite3.Error:
        return []  # unreadable: the stage's own check of the store says so


def registered_algorithms() -> set[str]:
    """The names of the algorithms `pfl_tasks.algorithms` registers, read from their modules'
    source (a class under `@register` with a `name = "..."`): importing them loads torch (1-2 s)."""
    import ast
    from pathlib import Path

    names = set()
    for module in (Path(__file__).resolve().parents[1] / "pfl_tasks" / "algorithms").glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(d, "id", None) == "register" for d in node.decorator_list):
                names |= {item.value.value for item in node.body if isinstance(item, ast.Assign)
                          and [getattr(t, "id", None) for t in item.targets] == ["name"]
                          and isinstance(item.value, ast.Constant)}
    return names


def check_runs(params, runs, where: str = "--algorithms") -> None:
    """A ConfigError naming the first of `runs` (a sweep's --algorithms, an experiment's list)
    that names no algorithm, by itself or through its entry under `algorithms`."""
    known = registered_algorithms() if runs else set()
    for run in runs:
        if (params.algorithms.get(run) or {}).get("algorithm", run) not in known:
            raise ConfigError(f"{where}: {unknown('algorithm', run, known | set(params.algorithms))}")
