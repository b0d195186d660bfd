"""`compare` stage: per experiment, a report built from MLflow alone — a ranking with 95% CIs,
significance marks, plateau, compute and communication columns, learning curves, metric against
compute, and per-client distributions (the protocol: pfl_tasks/reports.py).

Writes `reports/compare/<experiment>.md` with its PNGs in `reports/figures/`. Without names,
every experiment of the params file that MLflow has runs of.

    python -m flows.compare [experiment ...] [--params params.yaml] [--tracking-uri URI]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import flows  # noqa: F401  (environment defaults)
from flows.stage import stage_main
from pfl_tasks.config import load_params
from pfl_tasks.reports import ComparisonError, configured_runs, write_report
from pfl_tasks.tracking import tracking_uri as configured_uri

REPORTS = Path("reports/compare")
FIGURES = Path("reports/figures")


def compare(experiments: list[str] | None = None, params_path: str = "params.yaml", tracking_uri: str | None = None,
            root: str = ".") -> dict[str, list]:
    from mlflow.tracking import MlflowClient

    params = load_params(params_path)
    uri = tracking_uri or configured_uri(params.tracking.mlflow_uri)
    client = MlflowClient(tracking_uri=uri)
    if experiments is None:  # every configured experiment that has runs
        experiments = [e for e in params.experiments if client.get_experiment_by_name(e) is not None]
        if not experiments:
            raise ComparisonError(f"MLflow at {uri} has none of the experiments {sorted(params.experiments)}")
    root = Path(root)
    rankings = {}
    for experiment in experiments:
        only = configured_runs(params, experiment, root) if experiment in params.experiments else None
        results = rankings[experiment] = write_report(client, experiment, root / REPORTS, root / FIGURES, only)
        ranked = [r for r in results if r.ranked]
        best = f"best {ranked[0].method} ({ranked[0].personalized[0]:.4f})" if ranked else "none ranked"
        print(f"{experiment}: {len(ranked)} methods ranked, {best} -> {root / REPORTS / experiment}.md")
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
