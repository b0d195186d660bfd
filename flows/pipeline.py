"""Whole-pipeline flows, for scheduled runs in the Prefect UI and for params files outside
`dvc.yaml`:

- `pfl-repro`: `dvc repro` itself, so only stale stages run and DVC records every output; the
  stages' own flow runs report to the same Prefect server.
- `pfl-pipeline`: every stage of one params file in this one process (one Prefect start):
  prepare -> tune -> train -> learn2pfed -> tables -> compare. For example the optional Fashion-MNIST
  experiment:

    python -m flows.pipeline --params params-fmnist.yaml
    python -m flows.pipeline --params params-fmnist.yaml fmnist-dir0.1 --estimate   # its time here, first
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flows.environment import local_defaults
from flows.precheck import pin_numerics_first


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--root", default=".", help="where its data, models, metrics, plots and reports go")
    parser.add_argument("experiments", nargs="*", help="default: every experiment of the params file")
    parser.add_argument("--estimate", action="store_true",
                        help="print the run's wall-clock time on this machine, writing nothing here: time 3 rounds "
                             "and an evaluation of each algorithm, and measure the other costs by running the "
                             "pipeline itself in a temporary folder on the first seed, for two evaluation intervals a run")
    return parser


if __name__ == "__main__":  # --help and a command-line error answer before Prefect and MLflow load, which read their settings then
    local_defaults()
    first = arguments().parse_args()
    pin_numerics_first("pipeline", first.params, first.experiments, algorithms=True)

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.compare import compare
from flows.learn2pfed import run_experiment as learn2pfed_experiment
from flows.prepare import PARTITIONS, prepare
from flows.stage import prefect_api, stage_main
from flows.tables import write_tables
from flows.train import train_experiment
from flows.tune import tune_flow
import yaml
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import Params, load_params, params_snapshot, read_params
from pfl_tasks.errors import ConfigError
from pfl_tasks.estimate import Probe, probe_params, probe_runs, report, time_steps, whole
from pfl_tasks.tracking import tracking_uri

STEP_OPTIONS = dict(cache_policy=NO_CACHE, persist_result=False)
prepare_step = task(prepare, **STEP_OPTIONS, task_run_name="prepare-{dataset}")
tables_step = task(write_tables, **STEP_OPTIONS, task_run_name="tables")
compare_step = task(compare, **STEP_OPTIONS, task_run_name="compare")


@flow(name="pfl-repro", flow_run_name="dvc-repro", persist_result=False)
def repro_flow(targets: list[str] | None = None, root: str = ".") -> None:
    """`dvc repro [targets]` in `root`, its output streamed to this flow run's log."""
    logger = get_run_logger()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", *(targets or [])], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        logger.info(line.rstrip())
    if proc.wait():
        raise RuntimeError(f"dvc repro exited with status {proc.returncode}")


def checked_params(params_path: str, experiments: list[str] | None) -> tuple[Params, list[str]]:
    """The validated params and the experiments to run (default: all); a ConfigError names the key."""
    params = validate_params(load_params(params_path))
    for experiment in experiments or []:
        try:
            params.experiment(experiment)
        except ConfigError as err:
            raise ConfigError(f"{params_path}: {err}") from None
    return params, experiments or list(params.experiments)


@flow(name="pfl-pipeline", flow_run_name="pipeline-{params_path}", persist_result=False)
def pipeline_flow(params_path: str = "params.yaml", root: str = ".", experiments: list[str] | None = None) -> dict:
    """Every stage for `experiments` (default: all, and then the tables too); returns each
    experiment's ranking. Its stages run one snapshot of the params (`params_snapshot`)."""
    with params_snapshot():
        params, chosen = checked_params(params_path, experiments)
        for dataset in sorted({params.experiments[e].dataset for e in chosen}):
            prepare_step(dataset, params_path, Path(root) / PARTITIONS)
        for experiment in chosen:
            if experiment in params.tuning:
                tune_flow(experiment, params_path, root)
            train_experiment(experiment, params_path, root, "restart")
            if experiment in params.learn2pfed:
                learn2pfed_experiment(experiment, params_path, root, "restart")
        if experiments is None and params.tables:
            tables_step(params_path, root)
        return compare_step(chosen, params_path, root=root)


def where_results(params_path: str, root: str, experiments: list[str] | None) -> str:
    """Where each result of a pipeline run is, as a table."""
    params = load_params(params_path)
    root_dir, uri = Path(root), tracking_uri(params.tracking.mlflow_uri)
    rows = []
    for experiment in experiments or list(params.experiments):
        exp = params.experiment(experiment)
        run, seed = exp.algorithms[0], exp.seeds[0]
        rows += [
            ("ranking and per-client spread", root_dir / "reports/compare" / f"{experiment}.md"),
            ("learning curves (one CSV a run)", root_dir / "plots" / experiment / run / f"seed-{seed}.csv"),
            ("headline metrics (one JSON a run)", root_dir / "metrics" / experiment / run / f"seed-{seed}.json"),
            ("checkpoint", root_dir / "models" / experiment / run / f"seed-{seed}" / "checkpoint.pt"),
            ("MLflow runs, per-client CSVs", f"experiment '{experiment}' in {uri}: mlflow ui --backend-store-uri "
                                             f"{uri} --host 127.0.0.1"),
        ]
    width = max(len(what) for what, _ in rows)
    return "\n".join(f"{what:<{width}}  {where}" for what, where in rows)


def probe(params_path: str, params: Params, chosen: list[str], experiments: list[str]) -> Probe:
    """The estimate's other costs: this file's pipeline (`probe_params`) run in a temporary
    folder with its own MLflow store, timed."""
    with tempfile.TemporaryDirectory(prefix="pfl-estimate-") as tmp:
        store = f"sqlite:///{Path(tmp).resolve() / 'mlflow.db'}"
        probe_file = Path(tmp) / "params.yaml"
        probe_file.write_text(yaml.safe_dump(probe_params(read_params(params_path), params, chosen, store),
                                             sort_keys=False))
        print(f"{params_path}: measuring the other costs: the pipeline on each experiment's first seed, two "
              f"evaluation intervals a run, in {tmp}", file=sys.stderr, flush=True)
        project = str(Path(__file__).resolve().parent.parent)  # run from here, as the file's paths are relative to here
        env = {**os.environ, "MLFLOW_TRACKING_URI": store,
               "PYTHONPATH": os.pathsep.join(filter(None, [project, os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "flows.pipeline", "--params", str(probe_file), "--root", tmp,
                               *experiments], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - start
        if done.returncode:
            print("\n".join(done.stdout.splitlines()[-20:]), file=sys.stderr)
            raise ConfigError(f"{params_path}: the estimate's probe, this file's pipeline on one seed for two "
                              f"evaluation intervals a run, failed (exit {done.returncode}; its last lines are above)")
        return Probe(wall, probe_runs(store))


def estimate_text(params_path: str, params: Params, chosen: list[str], experiments: list[str]) -> str:
    """The whole run's estimate (pfl_tasks/estimate.py)."""
    timings, platform = {}, ""
    for experiment in chosen:
        platform, timings[experiment] = time_steps(params, experiment, progress=lambda line: print(
            line, file=sys.stderr, flush=True))
    measured = probe(params_path, params, chosen, experiments)
    return report(params_path, platform, measured, *whole(params, chosen, timings, measured))


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)

    def work():
        params, chosen = checked_params(args.params, args.experiments or None)  # before the Prefect server starts
        if args.estimate:
            print(estimate_text(args.params, params, chosen, args.experiments), flush=True)
            return
        with prefect_api():
            pipeline_flow(args.params, args.root, args.experiments or None)
        print("\nWhere the results are (one run shown per kind):\n" +
              where_results(args.params, args.root, args.experiments or None))

    return stage_main("pipeline", work)


if __name__ == "__main__":
    sys.exit(main())
