"""Comparison reports: which runs count, and what every report says of them.

The per-experiment comparison (`flows.compare`) and the paper tables (`flows.tables`) both read
MLflow through `collect` and `summarize`, so they count the same runs: for each configured
(method, seed), the run its metrics file names, else its newest that finished or diverged
(`RUNS_COUNTED`), and nothing else.

The protocol (docs/protocol.md): a method's score is the test metric of its
personalized model at the round selected on validation, per client; the cell is the mean over
seeds of the client mean, with a 95% CI from a two-level bootstrap (seeds, then clients). The
best method is compared with each other one by a paired test over clients (`stats.TEST_NAME`);
methods it cannot tell apart at `verdicts.alpha` are marked. The same runs at the same rounds are also
scored sample-weighted (all correct over all test samples: published tables' statistic), with
its own CIs and tests, and a method whose verdict (against FedAvg, or in the top group) differs
between the two statistics is flagged (`flips`). A diverged run, or one that aggregated too few
of its rounds (`verdicts.min_aggregated`), is listed, never ranked. Each run's plateau is judged
here, on its validation curve, under `verdicts.plateau`; every report prints these rules.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from pfl_tasks.config import VerdictConfig
from pfl_tasks.files import atomic_write_text, remove_stale_temporaries
from pfl_tasks.reports.figures import FIGURES, save_figure
from pfl_tasks.reports.paper import column_cells, write_paper_table
from pfl_tasks.reports.results import MethodResult, collect, initial_validation, primary_metric
from pfl_tasks.reports.text import markdown
from pfl_tasks.reports.verdicts import summarize


def write_report(client, experiment: str, report_dir: Path, figure_dir: Path,
                 only: dict[tuple[str, int], str | None] | None = None, tuning: dict | None = None,
                 downstream: dict[str, str] | None = None, rule: VerdictConfig = VerdictConfig()) -> list[MethodResult]:
    """`report_dir/<experiment>.md`, its ranked table for a paper as `.tex` and `.csv`, and its PNGs
    in `figure_dir`, after removing what a killed writer left of their temporaries (call as their
    one writer); returns the ranking."""
    remove_stale_temporaries(*(report_dir / f"{experiment}.{suffix}" for suffix in ("md", "tex", "csv")),
                             *(figure_dir / f"{experiment}-{name}.png" for name, _, _ in FIGURES))
    newest = collect(client, experiment, only)
    metric = primary_metric(newest)
    results = [replace(r, initial_val=initial_validation(client, r.run_ids, metric)) if r.method in (downstream or {})
               else r for r in summarize(client, newest, metric, rule)]
    figures = {}
    for name, build, caption in FIGURES:
        fig = build(client, results, metric, f"{experiment}: {caption}")
        if fig is not None:
            png = figure_dir / f"{experiment}-{name}.png"
            save_figure(fig, png)
            figures[caption] = Path(os.path.relpath(png, report_dir)).as_posix()
    atomic_write_text(report_dir / f"{experiment}.md", markdown(experiment, metric, results, figures, tuning, downstream, rule))
    write_paper_table(report_dir / experiment, {m: {experiment: c} for m, c in column_cells(results, metric).items()},
                      [experiment], f"{experiment}: written by `python -m flows.compare` (its .md says how to read it)")
    return results
