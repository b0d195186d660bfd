"""A parameter sweep: algorithms x seeds of one experiment under overrides of the params file,
run as its own experiment `<experiment>-<name>` in `sweeps/<name>/` (its params, partition,
checkpoints, metrics and comparison report), logged to MLflow under that experiment name.

Meant for the Prefect UI (deployment `pfl-sweep/sweep`, "Custom run"); from a shell:

    python -m flows.sweep '{"name": "lr", "experiment": "digits", "algorithms": ["fedavg", "ditto"],
                            "overrides": {"local.optimizer.lr": 0.1}}'
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
from pfl_tasks.config import SweepConfig, parse_params
from pfl_tasks.files import atomic_write_text
from pfl_tasks.reports import winner_on_validation

SWEEPS = Path("sweeps")


@flow(name="pfl-sweep", flow_run_name="sweep-{sweep.name}", persist_result=False)
def sweep_flow(sweep: SweepConfig) -> dict:
    """Validates the sweep into params (errors name the key), writes them to
    `sweeps/<name>/params.yaml` and runs the pipeline there; returns the ranking (on test) and
    the method best on validation, the sweep's choice."""
    raw = sweep.params()
    validate_params(parse_params(raw))
    root = SWEEPS / sweep.name
    params_path = root / "params.yaml"
    atomic_write_text(params_path, yaml.safe_dump(raw, sort_keys=False))
    rankings = pipeline_flow(str(params_path), str(root))
    winner = winner_on_validation(rankings[sweep.experiment_name])
    print(f"sweep {sweep.name}: {winner} is best on validation")
    return {"ranking": rankings[sweep.experiment_name], "winner_on_validation": winner}


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

    def work():
        with prefect_api():
            sweep_flow(sweep)

    return stage_main("sweep", work)


if __name__ == "__main__":
    sys.exit(main())
