"""`compare` stage: per experiment, a report built from MLflow alone — a ranking with 95% CIs,
significance marks, plateau, compute and communication columns, learning curves, metric against
compute, and per-client distributions (the protocol: pfl_tasks/reports/).

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

from flows.environment import local_defaults
from flows.precheck import pin_numerics_first


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiments", nargs="*", help="MLflow experiments (default: every configured one with runs)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else params.yaml's tracking.mlflow_uri")
    return parser


if __name__ == "__main__":  # --help and a command-line error answer before Prefect and MLflow load, which read their settings then
    local_defaults()
    first = arguments().parse_args()
    pin_numerics_first("compare", first.params, first.experiments, stored=True)  # numpy's code paths too

from flows.stage import stage_main
from pfl_tasks.config import load_params
from pfl_tasks.errors import ComparisonError
from pfl_tasks.files import OutputLock, atomic_write_text, remove_stale_temporaries
from pfl_tasks.outputs import json_text
from pfl_tasks.reports import write_report
from pfl_tasks.reports.results import configured_runs, downstream_methods, results_store
from pfl_tasks.reports.text import best_line
from pfl_tasks.reports.verdicts import flips
from pfl_tasks.tuning import checked_tuning
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
        remove_stale_temporaries(root / RANKING)  # what a killed writer left
        others = read_ranking(root / RANKING) if experiments_asked else {}  # kept for the experiments not compared
        for experiment in experiments:
            tuning = checked_tuning(params, experiment, root) if experiment in params.tuning else None
            results = rankings[experiment] = write_report(client, experiment, root / REPORTS, root / FIGURES,
                                                          pinned[experiment], tuning,
                                                          downstream_methods(params, experiment), params.verdicts)
            ranked, flipped = sum(r.ranked for r in results), flips(results)
            print(f"{experiment}: {ranked} methods ranked; client mean: {best_line(results)}; sample-weighted: "
                  f"{best_line(results, weighted=True)}; verdict flips between them: "
                  f"{', '.join(flipped) or 'none'} -> {root / REPORTS / experiment}.md")
        write_ranking(root / RANKING, rankings, others)
    return rankings


def read_ranking(path: Path) -> dict[str, dict]:
    """The ranking file's entries ({} when there is none); a garbled one is a ComparisonError
    naming it."""
    if not path.exists():
        return {}
    try:
        ranking = json.loads(path.read_text())
        if not isinstance(ranking, dict) or not all(isinstance(v, dict) for v in ranking.values()):
            raise ValueError("not a JSON object of experiments")
    except (OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ComparisonError(f"{path}: unreadable ({first}): delete it, or run `python -m flows.compare` "
                              "without names to write it anew") from None
    return ranking


def write_ranking(path: Path, rankings: dict[str, list], others: dict[str, dict]) -> None:
    """DVC metrics `<experiment>.<method>.mean` (the client mean: the number its report ranks
    by) and `.weighted` (sample-weighted): each ranked method's two statistics, mean over seeds;
    short keys, so that `dvc exp show` compares experiments in a terminal. `others`: the entries
    of the experiments not compared now, kept. Call as its one writer."""
    ranking = {**others, **{experiment: {r.method: {"mean": r.personalized[0],
                                                    **({"weighted": r.weighted[0]} if r.weighted else {})}
                                         for r in results if r.ranked}
                            for experiment, results in rankings.items()}}
    atomic_write_text(path, json_text(ranking))


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    return stage_main("compare", lambda: compare(args.experiments or None, args.params, args.tracking_uri))


if __name__ == "__main__":
    sys.exit(main())
