"""`compare` stage: per experiment, a report built from MLflow alone — a ranking with mean ± std
over seeds, learning curves (personalized and global) and per-client distributions.

Writes `reports/compare/<experiment>.md` with its PNGs in `reports/figures/`. Without names,
every experiment of the params file that MLflow has runs of.

    python -m flows.compare [experiment ...] [--params params.yaml] [--tracking-uri URI]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import flows  # noqa: F401  (environment defaults)
from pfl_tasks.compare import ComparisonError, write_report
from flows.stage import stage_main
from pfl_tasks.config import load_params

REPORTS = Path("reports/compare")
FIGURES = Path("reports/figures")


def configured_runs(params, experiment: str) -> set[tuple[str, int]]:
    """(algorithm, seed) of every run the params file configures for `experiment`, Learn2pFed's
    included: older runs under names since removed stay out of the report."""
    exp = params.experiment(experiment)
    names = list(exp.algorithms)
    if experiment in params.learn2pfed:
        names += [f"learn2pfed-{s}" for s in params.learn2pfed[experiment].supervision]
    return {(name, seed) for name in names for seed in exp.seeds}


def compare(experiments: list[str] | None = None, params_path: str = "params.yaml", tracking_uri: str | None = None,
            root: str = ".") -> dict[str, list]:
    from mlflow.tracking import MlflowClient

    params = load_params(params_path)
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", params.tracking.mlflow_uri)
    client = MlflowClient(tracking_uri=uri)
    if experiments is None:  # every configured experiment that has runs
        experiments = [e for e in params.experiments if client.get_experiment_by_name(e) is not None]
        if not experiments:
            raise ComparisonError(f"MLflow at {uri} has none of the experiments {sorted(params.experiments)}")
    root = Path(root)
    rankings = {}
    for experiment in experiments:
        only = configured_runs(params, experiment) if experiment in params.experiments else None
        rankings[experiment] = write_report(client, experiment, root / REPORTS, root / FIGURES, only)
        best = rankings[experiment][0]
        print(f"{experiment}: {len(rankings[experiment])} methods ranked, best {best.method} "
              f"({best.personalized[0]:.4f}) -> {root / REPORTS / experiment}.md")
    return rankings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiments", nargs="*", help="MLflow experiments (default: every configured one with runs)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else params.yaml's tracking.mlflow_uri")
    args = parser.parse_args(argv)
    return stage_main("compare", lambda: compare(args.experiments or None, args.params, args.tracking_uri))


if __name__ == "__main__":
    sys.exit(main())
