"""The report's forms of one fixed ranking (its markdown, CSV and LaTeX) as committed in
`tests/golden/`: text, numbers and marks byte for byte, so that moving the reports' code
changes none of them. A change meant to alter a form regenerates the files:
`REGENERATE_GOLDEN=1 python -m pytest tests/test_report_forms.py` (then read the diff)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from conftest import ranked_result
from pfl_tasks.reports.paper import column_cells, csv_rows, latex
from pfl_tasks.reports.text import markdown

GOLDEN = Path(__file__).parent / "golden"


def forms() -> dict[str, str]:
    """One experiment's ranking: a best, a method within its top group, one outranked, a
    global-only one, Learn2pFed beside its untrained Θ, and a diverged run; with its tuning."""
    clients = {0: np.array([0.9, 0.8, 0.85]), 1: np.array([0.88, 0.82, 0.86])}
    sizes = {0: np.array([30.0, 20.0, 10.0]), 1: np.array([30.0, 20.0, 10.0])}
    results = [
        replace(ranked_result("ditto", 0.86), clients=clients, sizes=sizes, weighted=(0.87, 0.85, 0.89)),
        replace(ranked_result("fedavg_ft", 0.85, p_vs_best=0.3), weighted=(0.86, 0.84, 0.88), p_vs_best_weighted=0.01),
        ranked_result("learn2pfed-train", 0.84, p_vs_best=0.02),
        replace(ranked_result("fedavg", 0.80, p_vs_best=0.001, plateaued=(True, False)), global_only=True,
                global_=(0.80, 0.79, 0.81)),
        replace(ranked_result("learn2pfed-val", 0.83, p_vs_best=0.4), initial_test=0.845),
        replace(ranked_result("local", 0.70, p_vs_best=0.001), diverged=[(1, 7)], personalized=None),
    ]
    tuning = {"experiment": "e", "metric": "acc", "selected_on": "validation/personalized/acc_mean", "seeds": [0, 1],
              "rounds_fraction": 0.5, "seconds": 90,
              "methods": {"ditto": {"grid": {"local.optimizer.lr": [0.01, 0.1]},
                                    "tried": {"local.optimizer.lr": [0.01, 0.1, 1.0]},
                                    "chosen": {"local.optimizer.lr": 0.1}, "val": 0.86, "se": 0.004,
                                    "best": {"local.optimizer.lr": 1.0}, "best_val": 0.861, "at_edge": [],
                                    "edge_reasons": {}, "points": {"a": 0.8, "b": 0.86, "c": 0.861},
                                    "points_se": {"a": None, "b": 0.004, "c": 0.0}}}}
    text = markdown("e", "acc", results, {"learning curves": "../figures/e-curves.png"}, tuning,
                    {"learn2pfed-train": "fedavg"})
    rows = {m: {"e": c} for m, c in column_cells(results, "acc").items()}
    return {"report.md": text, "report.csv": "\n".join(",".join(map(str, r.values())) for r in csv_rows(rows, ["e"])),
            "report.tex": latex(rows, ["e"], "e: a fixed ranking")}


def test_the_report_s_forms_are_the_committed_ones():
    for name, text in forms().items():
        if os.environ.get("REGENERATE_GOLDEN"):
            (GOLDEN / name).write_text(text)
        assert text == (GOLDEN / name).read_text(), f"{name} differs from tests/golden/{name}"
