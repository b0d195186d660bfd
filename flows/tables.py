"""`tables` stage: the paper-style comparison tables of `params.yaml: tables`.

Rows are methods (every algorithm of the `train` stage and Learn2pFed's runs), columns are
experiments. The runs and every number come from the same place as the `compare` report
(`pfl_tasks.reports`): per configured (method, seed) the run its metrics file in this workspace
names, else the newest that finished or diverged (`RUNS_COUNTED`); a cell is the personalized
test metric at the round selected on validation, mean over clients and seeds [95% CI], in bold
for the column's best, marked ≈ when not significantly different from it, † when the
personalized model is the global one and ✓ on the column's best on validation; a method not
ranked says why ("diverged at round R", "too few rounds aggregated: A of R").
Writes `reports/markdown/<table>.md`, the same table for a paper as `<table>.tex` (a booktabs
tabular) and `<table>.csv` (long form, every number unrounded), and a JSON per row
`reports/tables/<table>/<method>.json` (`dvc metrics show --md reports/tables/<table>`: a row per
method), and logs the table and
every cell's numbers to MLflow (experiment `tables`).

    python -m flows.tables
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from flows.environment import local_defaults
from flows.precheck import pin_numerics_first


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    return parser


if __name__ == "__main__":  # --help and a command-line error answer before Prefect and MLflow load, which read their settings then
    local_defaults()
    pin_numerics_first("tables", arguments().parse_args().params)  # numpy's code paths too

from flows.stage import stage_main
from pfl_tasks.config import Params, TableConfig, VerdictConfig, load_params
from pfl_tasks.errors import ConfigError
from pfl_tasks.files import atomic_write_text
from pfl_tasks.reports.paper import column_cells, write_paper_table
from pfl_tasks.reports.results import collect, configured_runs, primary_metric, results_store
from pfl_tasks.reports.text import interval, protocol_lines
from pfl_tasks.reports.verdicts import summarize
from pfl_tasks.tracking import MlflowRun, flatten, tracking_uri

REPORTS = Path("reports")


def build_table(client, params: Params, table: TableConfig, root: Path) -> dict[str, dict[str, dict]]:
    """method -> experiment -> cell."""
    unknown = sorted(set(table.experiments) - set(params.experiments))
    if unknown:
        raise ConfigError(f"tables: experiment(s) {unknown} are not under 'experiments'")
    columns = {}
    for experiment in table.experiments:
        newest = collect(client, experiment, configured_runs(params, experiment, root))
        metric = primary_metric(newest)
        columns[experiment] = column_cells(summarize(client, newest, metric, params.verdicts), metric)
    found = {m for column in columns.values() for m in column}
    missing = sorted(set(table.methods or []) - found)
    if missing:
        raise ConfigError(f"tables: no runs of method(s) {missing} (found: {sorted(found)})")
    methods = table.methods or sorted(found)
    return {m: {exp: column[m] for exp, column in columns.items() if m in column} for m in methods}


def _text(c: dict | None) -> str:
    if c is None:
        return "–"
    if "status" in c:
        return c["status"]
    text = interval((c['mean'], c['ci_low'], c['ci_high']))
    return f"{f'**{text}**' if c['best'] else text}{c['marks']}"


def markdown(name: str, rows: dict[str, dict[str, dict]], columns: list[str], rule: VerdictConfig) -> str:
    lines = [
        f"# {name}",
        "",
        *protocol_lines(rule),
        "",
        "| method | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    lines += [f"| {method} | " + " | ".join(_text(row.get(col)) for col in columns) + " |" for method, row in rows.items()]
    return "\n".join(lines) + "\n"


def write_dvc_table(folder: Path, rows: dict) -> None:
    """The table as JSON: a file per method (`dvc metrics show <folder>` prints a row each),
    holding per experiment the cell's mean, 95% CI and seeds (the marks are in the markdown)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.json"):  # methods no longer in the table
        stale.unlink()
    for method, cells in rows.items():
        numbers = {experiment: {key: cell[key] for key in ("mean", "ci_low", "ci_high", "seeds") if key in cell}
                   for experiment, cell in cells.items()}
        atomic_write_text(folder / f"{method}.json", json.dumps(numbers, indent=1, sort_keys=True))


def write_tables(params_path: str = "params.yaml", root: str = ".") -> list[Path]:
    """Every table whose experiments all have runs; each other one is skipped with a line
    naming what it lacks (a ComparisonError when no table can be built)."""
    params, root = load_params(params_path), Path(root)
    configured = {e for table in params.tables.values() for e in table.experiments} & set(params.experiments)
    client, held = results_store(tracking_uri(params.tracking.mlflow_uri), sorted(configured), params_path,
                                 every=False)
    for name, table in params.tables.items():
        lacking = [e for e in table.experiments if e not in held]
        if lacking:
            print(f"tables: {name} skipped: no runs of experiment(s) {lacking} yet (train them first)", file=sys.stderr)
    # every table built before any is written: an error leaves no partial outputs
    tables = {name: build_table(client, params, table, root) for name, table in params.tables.items()
              if set(table.experiments) <= set(held)}
    written = []
    for name, rows in tables.items():
        text = markdown(name, rows, params.tables[name].experiments, params.verdicts)
        blob = json.dumps(rows, indent=1, sort_keys=True)
        md, columns = root / REPORTS / "markdown" / f"{name}.md", params.tables[name].experiments
        atomic_write_text(md, text)
        write_paper_table(md.parent / name, rows, columns,
                          f"{name}: written by `python -m flows.tables` (reports/markdown/{name}.md says how to read it)")
        write_dvc_table(root / REPORTS / "tables" / name, rows)
        with MlflowRun(params.tracking.mlflow_uri, "tables", name, None, params.tracking.retry_seconds) as tracker, \
                tempfile.TemporaryDirectory() as tmp:
            tracker.log_params_and_tags(flatten({"verdicts": params.verdicts.model_dump()}), {})
            (Path(tmp) / md.name).write_text(text)
            (Path(tmp) / f"{name}.json").write_text(blob)
            tracker.log_artifacts(Path(tmp))
            tracker.finish()
        print(text)
        written.append(md)
    return written


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    return stage_main("tables", lambda: write_tables(args.params))


if __name__ == "__main__":
    sys.exit(main())
