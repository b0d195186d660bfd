"""`compare` stage: per experiment, a report built from MLflow alone — a ranking with 95% CIs,
significance marks, plateau, compute and communication columns, learning curves, metric against
compute, and per-client distributions (the protocol: pfl_tasks/reports.py).

Writes `reports/compare/<experiment>.md` with its PNGs in `reports/figures/`, and each method's
two statistics (client mean, sample-weighted) in `reports/ranking.json` (DVC metrics). Without names,
every experiment of the params file that MLflow has runs of.

    python -m flows.compare [experiment ...] [--params params.yaml] [--tracking-uri URI]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import flows  # noqa: F401  (environment defaults)
from flows.stage import stage_main
from pfl_tasks.config import load_params
from pfl_tasks.files import OutputLock, atomic_write_text, remove_stale_temporaries
from pfl_tasks.outputs import json_text
from pfl_tasks.reports import best_line, configured_runs, flips, results_store, write_report
from pfl_tasks.tuning import read_tuning
from pfl_tasks.tracking import tracking_uri as configured_uri

REPORTS = Path("reports/compare")
FIGURES = Path("reports/figures")
RANKING = Path("reports/ranking.json")
LOCK = Path(".locks/compare.lock")  # one writer of a root's reports at a time


def compare(experiments: list[str] | None = None, params_path: str = "params.yaml", tracking_uri: str | None = None,
            root: str = ".") -> dict[str, list]:
    params, experiments_asked = load_params(params_path), experiments
    uri = tracking_uri or configured_uri(params.tracking.mlflow_uri)
    # without names: every configured experiment that has runs
    client, experiments = results_store(uri, experiments or list(params.experiments), params_path,
                                        every=experiments is not None)
    root = Path(root)
    # the runs the workspace's metrics files name: a garbled one is an error before anything is written
    pinned = {e: configured_runs(params, e, root) if e in params.experiments else None for e in experiments}
    rankings = {}
    with OutputLock(root / LOCK, "the comparison reports"):
        for experiment in experiments:
            tuning = read_tuning(root, experiment) if experiment in params.tuning else None
            results = rankings[experiment] = write_report(client, experiment, root / REPORTS, root / FIGURES,
                                                          pinned[experiment], tuning)
            ranked, flipped = sum(r.ranked for r in results), flips(results)
            print(f"{experiment}: {ranked} methods ranked; client mean: {best_line(results)}; sample-weighted: "
                  f"{best_line(results, weighted=True)}; verdict flips between them: "
                  f"{', '.join(flipped) or 'none'} -> {root / REPORTS / experiment}.md")
        write_ranking(root / RANKING, rankings, keep_others=bool(experiments_asked))
    return rankings


def write_ranking(path: Path, rankings: dict[str, list], keep_others: bool) -> None:
    """DVC metrics `<experiment>.<method>.mean` (the client mean: the number its report ranks
    by) and `.weighted` (sample-weighted): each ranked method's two statistics, mean over seeds;
    short keys, so that `dvc exp show` compares experiments in a terminal. `keep_others`: the
    experiments not compared now keep their entries. Call as its one writer: what a killed
    writer left of its temporaries is removed first."""
    remove_stale_temporaries(path)
    ranking = json.loads(path.read_text()) if keep_others and path.exists() else {}
    ranking.update({experiment: {r.method: {"mean": r.personalized[0],
                                            **({"weighted": r.weighted[0]} if r.weighted else {})}
                                 for r in results if r.ranked}
                    for experiment, results in rankings.items()})
    atomic_write_text(path, json_text(ranking))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiments", nargs="*", help="MLflow experiments (default: every configured one with runs)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else params.yaml's tracking.mlflow_uri")
    args = parser.parse_args(argv)
    return stage_main("compare", lambda: compare(args.experiments or None, args.params, args.tracking_uri))


if __name__ == "__main__":
    sys.exit(main())
