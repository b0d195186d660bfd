"""`tune` stage: each method of one experiment tuned on validation (pfl_tasks/tuning.py).

Runs every grid point of `tuning.<experiment>` as experiment `<experiment>-tune` in
`sweeps/tune-<experiment>/` (its params, partition and runs, logged to MLflow under that name),
then writes the choices to `tuning/<experiment>.json`, which the `train-<experiment>` stage
reads. Finished points are kept, as a train stage keeps its runs. Nothing here shows a point's
test number: the grid is read on validation alone (the choices, and every point's score, are in
the tuning file, ordered as its grid).

    python -m flows.tune <experiment> [--params params.yaml] [--root .]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flows.environment import local_defaults
from flows.precheck import check_params_first


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--root", default=".", help="where its sweeps/ and tuning/ folders are (as flows.pipeline's)")
    return parser


if __name__ == "__main__":  # --help, and a command-line or config error, answer before Prefect, MLflow and torch load
    local_defaults()
    first = arguments().parse_args()
    check_params_first("tune", first.params, first.experiment)

import yaml
from prefect import flow

from flows.prepare import prepare
from flows.stage import check_prefect_api, prefect_api, stage_main
from flows.train import train_experiment
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import check_snapshot, load_params, read_params, snapshot_write
from pfl_tasks.data import PARTITIONS
from pfl_tasks.errors import ConfigError
from pfl_tasks.outputs import json_text
from pfl_tasks.reports.results import collect, configured_runs, primary_metric, results_store
from pfl_tasks.reports.verdicts import summarize
from pfl_tasks.tuning import choose, grids, tune_name, tuning_params, tuning_path, widened

SWEEPS = Path("sweeps")  # where sweeps, and tunings, run: each its own params, data, runs and report


def run_seconds(uri: str, results: list) -> float:
    """The training time of the runs that count, summed: the tuning's full cost, also when this
    invocation kept runs trained before (runs side by side each count their own time, so the
    stage's wall time is less)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    infos = [client.get_run(run_id).info for r in results for run_id in r.run_ids]
    return sum((i.end_time - i.start_time) / 1000 for i in infos if i.end_time)


def grid_results(name: str, params_path: str, root: Path) -> list:
    """The grid points' results (`MethodResult`s), read as `compare` reads a ranking's runs,
    without its test-ranked report or console line: a chooser sees validation alone."""
    from pfl_tasks.tracking import tracking_uri

    params = load_params(params_path)
    client, _ = results_store(tracking_uri(params.tracking.mlflow_uri), [name], params_path)
    newest = collect(client, name, configured_runs(params, name, root))
    return summarize(client, newest, primary_metric(newest), params.verdicts)


def checked_params(experiment: str, params_path: str):
    """The validated params, which must tune `experiment`; a ConfigError names the section."""
    params = validate_params(load_params(params_path))
    if experiment not in params.tuning:
        raise ConfigError(f"{params_path}: no tuning.{experiment} section (have: {sorted(params.tuning)})")
    return params


@flow(name="pfl-tune", flow_run_name="tune-{experiment}", persist_result=False)
def tune_flow(experiment: str, params_path: str = "params.yaml", root: str = ".") -> dict:
    """Trains the grid, chooses on validation, writes `<root>/tuning/<experiment>.json`; returns its content."""
    from pfl_tasks.tracking import tracking_uri

    params = checked_params(experiment, params_path)
    where = Path(root) / SWEEPS / f"tune-{experiment}"
    tune_params, name = where / "params.yaml", tune_name(experiment)
    tried, widenings = grids(params, experiment), params.tuning[experiment].extensions
    for widening in range(widenings + 1):  # the grid, then each widening past the edges chosen
        raw = tuning_params(read_params(params_path), params, experiment, tried)
        snapshot_write(tune_params, yaml.safe_dump(raw, sort_keys=False))
        prepare(params.experiments[experiment].dataset, str(tune_params), where / PARTITIONS)
        train_experiment(name, str(tune_params), str(where), "restart")  # trains the points not yet finished
        results = grid_results(name, str(tune_params), where)
        seconds = run_seconds(tracking_uri(params.tracking.mlflow_uri), results)
        wider = widened(params, experiment, choose(params, experiment, results, seconds, tried))
        if wider == tried or widening == widenings:
            break
        grown = sorted(run for run in tried if wider[run] != tried[run])
        print(f"{experiment}: widening the grids of {', '.join(grown)} past the edges chosen")
        tried = wider
    record = choose(params, experiment, results, seconds, tried)
    check_snapshot()  # a params file edited meanwhile: no tuning file from the old one
    snapshot_write(tuning_path(Path(root), experiment), json_text(record))
    for method, entry in record["methods"].items():
        edge = "".join(f" (at the grid's edge in {key}: {why})" for key, why in entry["edge_reasons"].items())
        chosen = entry["chosen"] if entry["chosen"] is not None else "none: no grid point finished"
        print(f"{experiment}: tuned {method}: {chosen}{edge}")
    print(f"{experiment}: {len(results)} grid points, {record['seconds'] / 60:.1f} min of training -> "
          f"{tuning_path(Path(root), experiment)}")
    return record


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)

    def work() -> None:
        checked_params(args.experiment, args.params)  # before the Prefect server starts
        check_prefect_api()
        with prefect_api():
            tune_flow(args.experiment, args.params, args.root)

    return stage_main("tune", work)


if __name__ == "__main__":
    sys.exit(main())
