"""A parameter sweep: algorithms x seeds of one experiment under overrides of the params file,
run as its own experiment `<experiment>-<name>` in `sweeps/<name>/` (its params, partition,
checkpoints, metrics and comparison report), logged to MLflow under that experiment name.

Meant for the Prefect UI (deployment `pfl-sweep/sweep`, "Custom run"); from a shell, as JSON
or, simpler, through `flows.train`:

    python -m flows.sweep '{"name": "lr", "experiment": "digits", "algorithms": ["fedavg", "ditto"],
                            "overrides": {"federation.rounds": 50}, "grid": {"local.optimizer.lr": [0.1, 0.2]}}'
    python -m flows.train digits --algorithms fedavg ditto --set local.optimizer.lr=0.1,0.2 --name lr
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import flows  # noqa: F401  (environment defaults)
import yaml
from prefect import flow

from flows.pipeline import pipeline_flow
from flows.stage import prefect_api, stage_main
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import SweepConfig, load_params, parse_params
from pfl_tasks.files import atomic_write_text
from pfl_tasks.reports import winner_on_validation
from pfl_tasks.tracking import open_store, tracking_uri

SWEEPS = Path("sweeps")


@flow(name="pfl-sweep", flow_run_name="sweep-{sweep.name}", persist_result=False)
def sweep_flow(sweep: SweepConfig) -> dict:
    """Validates the sweep into params (errors name the key), writes them to
    `sweeps/<name>/params.yaml` and runs the pipeline there; returns, per experiment of the
    sweep, the ranking (on test) and the method best on validation, the sweep's choice."""
    raw = sweep.params()
    validate_params(parse_params(raw))
    root = SWEEPS / sweep.name
    params_path = root / "params.yaml"
    atomic_write_text(params_path, yaml.safe_dump(raw, sort_keys=False))
    rankings = pipeline_flow(str(params_path), str(root))
    results = {}
    for experiment, ranking in rankings.items():
        winner = winner_on_validation(ranking)
        print(f"sweep {sweep.name}: {experiment}: {winner} is best on validation "
              f"({root / 'reports' / 'compare' / experiment}.md)")
        results[experiment] = {"ranking": ranking, "winner_on_validation": winner}
    if len(rankings) > 1:
        print(f"sweep {sweep.name}: every variant on every experiment: {root / 'reports' / 'markdown' / sweep.name}.md")
    return results


def run_sweep(sweep: SweepConfig) -> None:
    """The sweep from a shell: validated before anything starts (an error names the key), then
    run under one MLflow parent run (experiment `<experiment>-<name>`, run `sweep-<name>`)
    whose children are its training runs (tags `mlflow.parentRunId`, `sweep`)."""
    from mlflow.tracking import MlflowClient

    validate_params(parse_params(sweep.params()))
    uri = tracking_uri(load_params(sweep.params_path).tracking.mlflow_uri)
    open_store(uri)
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(sweep.experiment_name)
    experiment_id = found.experiment_id if found else client.create_experiment(sweep.experiment_name)
    parent = client.create_run(experiment_id, run_name=f"sweep-{sweep.name}", tags={"sweep": sweep.name})
    client.log_dict(parent.info.run_id, sweep.model_dump(mode="json", exclude={"tags"}), "sweep.json")
    status = "FAILED"
    try:
        with prefect_api():
            sweep_flow(sweep.model_copy(update={"tags": {"mlflow.parentRunId": parent.info.run_id,
                                                         "sweep": sweep.name}}))
        status = "FINISHED"
    finally:
        client.set_terminated(parent.info.run_id, status)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        sweep = SweepConfig.model_validate(json.loads(argv[0]))
    except ValueError as err:
        print(f"sweep failed: {err}", file=sys.stderr)
        return 2
    return stage_main("sweep", lambda: run_sweep(sweep))


if __name__ == "__main__":
    sys.exit(main())
