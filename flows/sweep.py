"""A parameter sweep: algorithms x seeds of one experiment under overrides of the params file,
run as its own experiment `<experiment>-<name>` in `sweeps/<name>/` (its params, partition,
checkpoints, metrics and comparison report), logged to MLflow under that experiment name.

Meant for the Prefect UI (deployment `pfl-sweep/sweep`, "Custom run"); from a shell, with
options or as JSON:

    python -m flows.sweep mnist --algorithms ditto fedavg --set algorithms.ditto.mu=0.01,0.1,1
    python -m flows.sweep mnist --algorithms fedavg ditto --set local.optimizer.lr=0.1,0.2 --name lr
    python -m flows.sweep mnist --algorithms fedavg --seeds 7 8      # runs the params file does not configure
    python -m flows.sweep mnist --algorithms fedavg ditto --set local.optimizer.lr=0.1,0.3,1 \
        --set algorithms.ditto.mu=0.1,1 --per-method   # each method's best point on validation (~5 min)
    python -m flows.sweep '{"name": "lr", "experiment": "mnist", "algorithms": ["fedavg", "ditto"],
                            "overrides": {"federation.rounds": 50}, "grid": {"local.optimizer.lr": [0.1, 0.2]}}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from flows.environment import local_defaults
from flows.precheck import pin_numerics_first

def arguments() -> argparse.ArgumentParser:
    """The command line of a sweep given by options (the other form is one JSON argument)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--root", default=".", help="where its sweeps/<name>/ folder goes (as flows.pipeline's)")
    parser.add_argument("--algorithms", nargs="+", metavar="RUN", help="default: the experiment's")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help="default: the experiment's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=V1[,V2...]",
                        help="a grid over a key (repeatable), e.g. algorithms.ditto.mu=0.01,0.1,1 or "
                             "local.optimizer.lr=0.1,0.2")
    parser.add_argument("--name", help="the sweep's name (default: from the --set keys, or 'runs')")
    parser.add_argument("--per-method", action="store_true",
                        help="also name each method's best point on validation (over its variants and every "
                             "experiment of the grid), tagged winner/<method> on the parent run")
    return parser


if __name__ == "__main__":  # --help and command-line errors answer first; then Prefect and MLflow load
    local_defaults()
    as_json = len(sys.argv) == 2 and sys.argv[1].startswith("{")
    with contextlib.suppress(ValueError, AttributeError):  # a bad JSON sweep is refused by main, in one line
        first = json.loads(sys.argv[1]) if as_json else vars(arguments().parse_args())
        params_path = first.get("params_path" if as_json else "params", "params.yaml")
        pin_numerics_first("sweep", params_path, [first["experiment"]], runs=first.get("algorithms") or [])

import yaml
from prefect import flow
from pydantic import ValidationError

from flows.pipeline import pipeline_flow
from flows.stage import check_prefect_api, prefect_api, stage_main
from flows.tune import SWEEPS
from pfl_tasks.algorithms import build, validate_params
from pfl_tasks.config import SweepConfig, load_params, parse_params, read_params
from pfl_tasks.errors import ConfigError, RunStopped
from pfl_tasks.files import atomic_write_text
from pfl_tasks.grid import parse_assignment, sweep_params, variant_runs
from pfl_tasks.reports.results import selection_metric
from pfl_tasks.reports.text import best_line, interval
from pfl_tasks.reports.verdicts import best_per_method, winner_on_validation
from pfl_tasks.tracking import MlflowRun, open_store, tracking_uri



@flow(name="pfl-sweep", flow_run_name="sweep-{sweep.name}", persist_result=False)
def sweep_flow(sweep: SweepConfig, root: str = ".") -> dict:
    """Validates the sweep into params (errors name the key), writes them to
    `<root>/sweeps/<name>/params.yaml` and runs the pipeline there; returns, per experiment of the
    sweep, the ranking (on test) and the method best on validation (its MethodResult), the
    sweep's choice."""
    raw = checked_sweep_params(sweep)
    if sweep.experiment in load_params(sweep.params_path).tuning:
        print(f"sweep {sweep.name}: runs {sweep.params_path}'s values, not the per-method choices of "
              f"tuning/{sweep.experiment}.json")
    root = Path(root) / SWEEPS / sweep.name
    params_path = root / "params.yaml"
    atomic_write_text(params_path, yaml.safe_dump(raw, sort_keys=False))
    rankings = pipeline_flow(str(params_path), str(root))
    results = {}
    for experiment, ranking in rankings.items():
        winner = winner_on_validation(ranking)
        chosen = "none ranked" if winner is None else f"{winner.method} ({winner.val:.4f})"
        print(f"sweep {sweep.name}: {experiment}: chosen on validation: {chosen}; on test: {best_line(ranking)} "
              f"({root / 'reports' / 'compare' / experiment}.md)")
        results[experiment] = {"ranking": ranking, "winner_on_validation": winner}
    if len(rankings) > 1:
        print(f"sweep {sweep.name}: every variant on every experiment: {root / 'reports' / 'markdown' / sweep.name}.md")
    if sweep.per_method:
        best = best_per_method(rankings, variant_runs(sweep.grid, swept_runs(sweep)))
        for method, (experiment, r) in best.items():
            print(f"sweep {sweep.name}: {method}: best on validation {r.method} in {experiment} ({r.val:.4f}); "
                  f"its test {interval(r.personalized)}")
        results["per_method"] = write_per_method(root, sweep.name, best)
    return results


PER_METHOD = "per_method"  # a sweep's per-method choices: <its folder>/per_method.{json,md}


def write_per_method(root: Path, name: str, best: dict[str, tuple]) -> dict[str, dict]:
    """Each method's variant best on validation (`best_per_method`), as `per_method.json` and a
    table `per_method.md` in the sweep's folder: what `--per-method` chose, kept beside its runs."""
    chosen = {method: {"experiment": e, "variant": r.method, "val": r.val,
                       "test": dict(zip(("mean", "ci_low", "ci_high"), r.personalized))}
              for method, (e, r) in best.items()}
    atomic_write_text(root / f"{PER_METHOD}.json", json.dumps(chosen, indent=1))
    atomic_write_text(root / f"{PER_METHOD}.md", "\n".join([
        f"# {name}: each method at its variant best on validation (`--per-method`)", "",
        "Chosen on the validation metric at each run's selected round, never on test; the test column is what "
        "that choice scores.", "",
        "| method | chosen variant | experiment | validation | test (95% CI) |", "|---|---|---|---|---|",
        *(f"| {method} | {c['variant']} | {c['experiment']} | {c['val']:.4f} | {interval(tuple(c['test'].values()))} |"
          for method, c in chosen.items())]) + "\n")
    print(f"sweep {name}: per-method choices: {root / PER_METHOD}.json, {root / PER_METHOD}.md")
    return chosen


def swept_runs(sweep: SweepConfig) -> list[str]:
    """The run names the sweep varies: its `algorithms`, else its experiment's (else every entry)."""
    raw = read_params(sweep.params_path)
    return sweep.algorithms or raw["experiments"][sweep.experiment].get("algorithms") or list(raw.get("algorithms") or {})


def checked_sweep_params(sweep: SweepConfig) -> dict:
    """`sweep_params`, validated. Each hyper-parameter value the grid gives is first checked
    against its run's algorithm, so that an error names the key as given (`algorithms.ditto.mew`),
    not the variant the sweep would make of it (`algorithms.ditto_mew1.mew`)."""
    entries = read_params(sweep.params_path).get("algorithms") or {}
    for key, values in sweep.grid.items():
        for run, entry in entries.items():
            if key.startswith(f"algorithms.{run}.") and "." not in key.removeprefix(f"algorithms.{run}."):
                for value in values:
                    build(run, {**(entry or {}), key.removeprefix(f"algorithms.{run}."): value},
                          where=f"sweep.grid: algorithms.{run}")
    raw = sweep_params(sweep)
    validate_params(parse_params(raw))
    return raw


def run_sweep(sweep: SweepConfig, root: str = ".") -> None:
    """The sweep from a shell: validated before anything starts (an error names the key), then
    run under one MLflow parent run (experiment `<experiment>-<name>`, run `sweep-<name>`)
    whose children are its training runs (tags `mlflow.parentRunId`, `sweep`); the parent ends
    FINISHED, FAILED, or KILLED by a signal, as its children do. The parent holds the grid
    (params `grid.<key>`) and, once the sweep ends, its choice (`record_choice`)."""
    params = parse_params(checked_sweep_params(sweep))
    check_prefect_api()
    open_store(tracking_uri(params.tracking.mlflow_uri), params.tracking.retry_seconds)
    parent = None
    try:
        parent = MlflowRun(params.tracking.mlflow_uri, sweep.experiment_name, f"sweep-{sweep.name}", None,
                           params.tracking.retry_seconds, tags={"sweep": sweep.name})
        parent.log_params_and_tags({f"grid.{key}": json.dumps(values) for key, values in sweep.grid.items()}, {})
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "sweep.json").write_text(sweep.model_dump_json(indent=1, exclude={"tags"}))
            parent.log_artifacts(Path(tmp))
        with prefect_api():
            results = sweep_flow(sweep.model_copy(update={"tags": {"mlflow.parentRunId": parent.run_id,
                                                                   "sweep": sweep.name}}), root)
        record_choice(parent, results)
    except BaseException as exc:
        if parent is not None:
            status = "KILLED" if isinstance(exc, (RunStopped, KeyboardInterrupt)) else "FAILED"
            try:
                parent.finish(status, f"{type(exc).__name__}: {exc}", bound=5.0)
            except Exception as err:  # the store failing too: the first error is the one to see
                print(f"sweep {sweep.name}: MLflow parent run {parent.run_id} left RUNNING ({err})", file=sys.stderr)
        raise
    parent.finish()


def record_choice(parent: MlflowRun, results: dict) -> None:
    """The sweep's choice on its MLflow parent run: tag `winner` (the variant best on validation,
    `ditto_mu0.1`), tag `selection_metric` (what it was chosen on) and that metric's value for
    the winner; a sweep of several experiments (a grid over another key) suffixes each key
    with `/<experiment>`. With `per_method`, tag `winner/<method>`: its best variant on
    validation, `<variant>@<experiment>`."""
    experiments = {k: v for k, v in results.items() if k != "per_method"}
    for method, choice in results.get("per_method", {}).items():
        parent.log_params_and_tags({}, {f"winner/{method}": f"{choice['variant']}@{choice['experiment']}"})
    for experiment, outcome in experiments.items():
        winner = outcome["winner_on_validation"]
        if winner is None:
            continue
        suffix = f"/{experiment}" if len(experiments) > 1 else ""
        metric = selection_metric(winner.metric)
        parent.log_params_and_tags({}, {f"winner{suffix}": winner.method, f"selection_metric{suffix}": metric})
        parent.log_metrics({f"{metric}{suffix}": winner.val}, step=0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) == 1 and argv[0].startswith("{"):
            sweep, root = SweepConfig.model_validate(json.loads(argv[0])), "."
        else:
            sweep, root = from_command_line(argv)
        checked_sweep_params(sweep)
    except ValueError as err:  # ConfigError, pydantic's, JSON's
        print(f"sweep failed: {err}", file=sys.stderr)
        return 2
    return stage_main("sweep", lambda: run_sweep(sweep, root))


def from_command_line(argv: list[str]) -> tuple[SweepConfig, str]:
    """The sweep the options ask for (a grid over keys, and algorithms and seeds of the
    experiment, configured or not) and its root; an error names the option."""
    args = arguments().parse_args(argv)
    load_params(args.params).experiment(args.experiment)  # an unknown experiment names the choices
    grid = dict(parse_assignment(text) for text in args.set)
    name = args.name or "_".join(key.rsplit(".", 1)[-1] for key in grid) or "runs"
    try:
        sweep = SweepConfig(name=name, experiment=args.experiment, algorithms=args.algorithms, seeds=args.seeds,
                            grid=grid, params_path=args.params, per_method=args.per_method)
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(f"--{first['loc'][0]} {getattr(args, str(first['loc'][0]), name)!r}: {first['msg']}") from None
    return sweep, args.root


if __name__ == "__main__":
    sys.exit(main())
