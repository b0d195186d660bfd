"""`tables` stage: the paper-style comparison tables of `params.yaml: tables`.

Rows are methods (every algorithm of the `train` stage and Learn2pFed's runs), columns are
experiments; a cell is the personalized test metric (accuracy, or MSE for regression) as
mean over clients, averaged over seeds, +- the std over clients (averaged over seeds) and
[+- the sample std over seeds]. Writes `reports/markdown/<table>.md` and the DVC metrics file
`reports/tables/<table>.json`, and logs both to MLflow (experiment `tables`).

    python -m flows.tables
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import flows  # noqa: F401  (environment defaults)
from flows.stage import stage_main
from pfl_tasks.config import ConfigError, TableConfig, load_params
from pfl_tasks.files import atomic_write_text
from pfl_tasks.tracking import MlflowRun

METRICS = Path("metrics")
REPORTS = Path("reports")


def method_results(root: Path, experiment: str) -> dict[str, list[dict]]:
    """method -> final metrics of each seed, from the train and learn2pfed stages' files."""
    found: dict[str, list[dict]] = {}
    for base in (root / METRICS / experiment, root / METRICS / "learn2pfed" / experiment):
        for path in sorted(base.glob("*/seed-*.json")):
            found.setdefault(path.parent.name, []).append(json.loads(path.read_text()))
    return found


def cell(seeds: list[dict]) -> dict[str, float]:
    metric = "acc" if "final/personalized/acc_mean" in seeds[0] else "mse"
    means = [s[f"final/personalized/{metric}_mean"] for s in seeds]
    return {
        "metric": metric,
        "mean": statistics.fmean(means),
        "std_clients": statistics.fmean(s[f"final/personalized/{metric}_std"] for s in seeds),
        "std_seeds": statistics.stdev(means) if len(means) > 1 else 0.0,
        "seeds": len(seeds),
    }


def build_table(root: Path, table: TableConfig) -> dict[str, dict[str, dict]]:
    results = {exp: method_results(root, exp) for exp in table.experiments}
    missing = [exp for exp, found in results.items() if not found]
    if missing:
        raise ConfigError(f"no metrics under {root / METRICS} for experiment(s) {missing}: run their stages first")
    found_any = {m for found in results.values() for m in found}
    unknown = sorted(set(table.methods or []) - found_any)
    if unknown:
        raise ConfigError(f"tables: no runs of method(s) {unknown} (found: {sorted(found_any)})")
    methods = table.methods or sorted(found_any)
    return {m: {exp: cell(found[m]) for exp, found in results.items() if m in found} for m in methods}


def markdown(name: str, rows: dict[str, dict[str, dict]], columns: list[str]) -> str:
    metrics = {c["metric"] for row in rows.values() for c in row.values()}
    what = " / ".join("accuracy (higher is better)" if m == "acc" else "MSE (lower is better)" for m in sorted(metrics))
    lines = [
        f"# {name}: personalized test {what}",
        "",
        "Mean over clients, averaged over seeds ± std over clients [± std over seeds].",
        "",
        "| method | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for method, row in rows.items():
        cells = [
            f"{c['mean']:.4g} ± {c['std_clients']:.3g} [± {c['std_seeds']:.2g}, {c['seeds']} seeds]" if c else "–"
            for c in (row.get(col) for col in columns)
        ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_tables(params_path: str = "params.yaml", root: str = ".") -> list[Path]:
    params, root = load_params(params_path), Path(root)
    written = []
    for name, table in params.tables.items():
        rows = build_table(root, table)
        text, blob = markdown(name, rows, table.experiments), json.dumps(rows, indent=1, sort_keys=True)
        md = root / REPORTS / "markdown" / f"{name}.md"
        atomic_write_text(md, text)
        atomic_write_text(root / REPORTS / "tables" / f"{name}.json", blob)
        with MlflowRun(params.tracking.mlflow_uri, "tables", name, None, params.tracking.retry_seconds) as tracker, \
                tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / md.name).write_text(text)
            (Path(tmp) / f"{name}.json").write_text(blob)
            tracker.log_artifacts(Path(tmp))
            tracker.finish()
        print(text)
        written.append(md)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    return stage_main("tables", lambda: write_tables(args.params))


if __name__ == "__main__":
    sys.exit(main())
