"""A ranked table's forms for a paper: its cells, long-form CSV and booktabs LaTeX."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER
from pfl_tasks.files import atomic_write_text
from pfl_tasks.outputs import write_csv
from pfl_tasks.reports.results import MethodResult
from pfl_tasks.reports.text import marks, unranked_note
from pfl_tasks.reports.verdicts import ordered, winner_on_validation


def column_cells(results: list[MethodResult], metric: str) -> dict[str, dict]:
    """A table's column: method -> its cell (`flows.tables`, and the report's own .csv/.tex).
    A ranked cell holds its rank by the client mean (1: the best, the reference of ≈) and
    whether it is the column's best on validation (✓); an unranked one says why."""
    chosen, rank = winner_on_validation(results), {r.method: i for i, r in enumerate(ordered(results), 1)}
    cells = {}
    for r in results:
        better = "higher" if HIGHER_IS_BETTER[metric] else "lower"
        if not r.ranked:
            cells[r.method] = {"metric": metric, "better": better, "status": unranked_note(r)}
            continue
        point, low, high = r.personalized
        cells[r.method] = {"metric": metric, "better": better, "rank": rank[r.method], "best": rank[r.method] == 1, "mean": point,
                           "ci_low": low, "ci_high": high, "seeds": len(r.seeds),
                           "not_worse_than_best": r.indistinguishable(), "global_only": r.global_only,
                           "best_on_validation": r is chosen, "marks": marks(r, r is chosen),
                           **({"weighted": r.weighted[0]} if r.weighted else {})}
    return cells


CSV_FIELDS = ("method", "experiment", "metric", "better", "rank", "best", "mean", "ci_low", "ci_high", "seeds", "weighted",
              "not_worse_than_best", "global_only", "best_on_validation", "status")


def csv_rows(rows: dict[str, dict[str, dict]], columns: list[str]) -> list[dict]:
    """The table in long form, a row per (method, experiment), every number unrounded (for a
    paper's own formatting or plots): `metric` (acc, mse) and which way is `better` (higher,
    lower), `rank` by the client mean and `best` (rank 1), which
    `not_worse_than_best` (≈) is relative to; `status` says why a cell is not ranked."""
    return [{"method": method, "experiment": experiment,
             **{key: row[experiment].get(key, "") for key in CSV_FIELDS[2:]}}
            for method, row in rows.items() for experiment in columns if experiment in row]


LATEX_MARKS = {"≈": r"$^{\approx}$", "†": r"$^{\dagger}$", "✓": r"$^{\checkmark}$"}  # \checkmark: amssymb


def latex(rows: dict[str, dict[str, dict]], columns: list[str], comment: str) -> str:
    """The table as a booktabs `tabular` (a paper's `\\input`) under a `% comment` line, rendered
    and escaped by pandas' Styler: each column headed by its experiment, metric and direction,
    mean [95% CI] to 3 decimals with the markdown's marks, the column's best in bold; an
    unranked cell says why in a footnote-sized line."""

    def text(c: dict | None) -> str:
        if c is None:
            return "--"
        return c["status"] if "status" in c else f"{c['mean']:.3f} [{c['ci_low']:.3f}, {c['ci_high']:.3f}]"

    def heading(col: str) -> str:
        metric = next((row[col]["metric"] for row in rows.values() if col in row), None)
        if metric is None:
            return col
        return f"{col} ({'accuracy' if metric == 'acc' else 'MSE'}, {'higher' if HIGHER_IS_BETTER[metric] else 'lower'} is better)"

    table = pd.DataFrame([[method, *(text(row.get(col)) for col in columns)] for method, row in rows.items()],
                         columns=["Method", *map(heading, columns)])
    styler = table.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1)
    for i, row in enumerate(rows.values()):
        for col in columns:
            cell = row.get(col) or {}
            marks = "".join(LATEX_MARKS.get(mark, "") for mark in cell.get("marks", ""))
            bold = (lambda v: r"\textbf{" + v + "}") if cell.get("best") else (lambda v: v)
            wrap = ((lambda v: r"{\footnotesize " + v + "}") if "status" in cell
                    else (lambda v, m=marks, b=bold: b(v) + m))
            styler.format(wrap, subset=pd.IndexSlice[[i], [heading(col)]], escape="latex")
    body = styler.to_latex(hrules=True, column_format="l" + "c" * len(columns))
    return f"% {comment}\n{body}"


def write_paper_table(stem: Path, rows: dict[str, dict[str, dict]], columns: list[str], comment: str) -> None:
    """`stem`.csv (`csv_rows`) and `stem`.tex (`latex`): a table's forms for a paper."""
    write_csv(stem.parent / f"{stem.name}.csv", csv_rows(rows, columns))
    atomic_write_text(stem.parent / f"{stem.name}.tex", latex(rows, columns, comment))
