"""A run's outputs beside MLflow: its headline file (the headline, pinned to its MLflow run) and
curve, per-client CSVs, the learning-curve PNG, the console line of an evaluation and the
progress bar."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import torch

from pfl_tasks.engine.evaluate import NOISE_ONLY
from pfl_tasks.files import atomic_write_text
from pfl_tasks.selection import PRIMARY


# each client's metrics at the last round and at the round selected on validation: MLflow artifacts
CLIENTS_CSV = {"last": "clients_last.csv", "selected": "clients_selected.csv"}


def write_client_tables(folder: Path, tables: dict[str, dict], names: tuple[str, ...] = ()) -> None:
    """`CLIENTS_CSV`'s files in `folder`, from the per-client metrics of the last and selected
    rounds; `names`: the clients' own ids, where the data has them."""
    for when, name in CLIENTS_CSV.items():
        write_csv(folder / name, per_client_rows(tables[when], names))


def per_client_rows(metrics: dict[str, dict[str, dict[str, torch.Tensor]]], names: tuple[str, ...] = ()) -> list[dict]:
    """One row per client: its own id (`client`, given `names`), its validation and test sizes
    and metrics (`test_personalized_acc`, ...)."""
    rows = []
    for k in range(len(next(iter(metrics.values()))["personalized"]["n"])):
        row = {"client_id": k, **({"client": names[k]} if names else {})}
        for split, models in metrics.items():
            row[f"n_{split}"] = int(models["personalized"]["n"][k])
            for kind, values_of in models.items():
                row.update({f"{split}_{kind}_{m}": float(v[k]) for m, v in values_of.items()
                            if m != "n" and m not in NOISE_ONLY})
        rows.append(row)
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    from io import StringIO

    buf = StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def json_text(record: dict) -> str:
    """Strict JSON: a non-finite number (an infinite test loss) is written as null."""

    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return value if not isinstance(value, float) or math.isfinite(value) else None

    return json.dumps(clean(record), indent=1, sort_keys=True, allow_nan=False)


# a run's headline file, a DVC output: its headline under short keys (`dvc metrics show <path>`
# fits a terminal; MLflow has every summary): the round selected on validation, the personalized
# model's mean metric there (accuracy or MSE, the task's) on validation and test, the global
# model's on test, the worst 10% of clients on test (the plateau verdict is the reports', under
# the configured `verdicts.plateau`)
HEADLINE = {"round": "selected/round", "val": "selected/val/personalized/{m}_mean",
            "test": "selected/test/personalized/{m}_mean", "global": "selected/test/global/{m}_mean",
            "worst10": "selected/test/personalized/{m}_worst10"}


PINNED_RUN = "mlflow_run"  # the MLflow run the numbers are, as a one-item list: DVC's tables skip lists


def headline(final: dict[str, float]) -> dict[str, float]:
    metric = "mse" if "selected/test/personalized/mse_mean" in final else "acc"
    return {short: final[key.format(m=metric)] for short, key in HEADLINE.items() if key.format(m=metric) in final}


def pin(run_id: str) -> dict[str, list[str]]:
    return {PINNED_RUN: [run_id]}


def pinned_run(record: dict) -> str | None:
    """The MLflow run a headline file's numbers are."""
    return (record.get(PINNED_RUN) or [None])[0]


def dvc_curve(history: list[dict], task: str) -> list[dict]:
    """The per-round curve DVC plots: the mean metric (accuracy or MSE) over clients, of the
    personalized model on validation and test and of the global one on test."""
    metric = PRIMARY[task]
    return [{"round": h["round"], **{name: h.get(f"{name}/{metric}_mean") for name in
                                     ("val/personalized", "test/personalized", "test/global")}} for h in history]


def evaluation_line(record: dict, task: str) -> str:
    """An evaluation's mean metric over clients on the split that selects (validation; test
    where there is none), naming model and split: `acc val personalized 0.9520, global 0.8757`.
    The console shows no test number while a run trains or tunes."""
    metric = PRIMARY[task]
    split = "val" if f"val/personalized/{metric}_mean" in record else "test"
    parts = [f"{kind} {record[key]:.4f}" for kind in ("personalized", "global")
             if (key := f"{split}/{kind}/{metric}_mean") in record]
    return f"{metric} {split} " + ", ".join(parts)


def write_dvc_outputs(metrics_path: Path, curve_path: Path, final: dict, history: list[dict]) -> None:
    """The curve, then the metrics: the metrics file says a run finished, so it comes last (a
    kill between the two leaves an unfinished run, which the rerun resumes and writes again)."""
    if history:
        write_csv(curve_path, history)
    else:  # diverged before its first evaluation: no curve, not an earlier run's
        curve_path.unlink(missing_ok=True)
    atomic_write_text(metrics_path, json_text(final))


def learning_curve_png(path: Path, history: list[dict], task: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = PRIMARY[task]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    rounds = [h["round"] for h in history]
    for split in ("val", "test"):
        for kind in ("personalized", "global"):
            key = f"{split}/{kind}/{metric}_mean"
            if key in history[0]:
                ax.plot(rounds, [h[key] for h in history], marker="o", label=f"{kind}, {split}",
                        linestyle="-" if split == "test" else "--")
    ax.set(xlabel="round", ylabel=f"{metric} (mean over clients)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def progress(desc: str, total: int, done: int, unit: str):
    """A terminal progress bar (done/total, rate, ETA, latest metric as postfix); off when
    stderr (tqdm's stream) is not a terminal or under CI, where the per-evaluation log lines remain."""
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=desc, unit=unit, dynamic_ncols=True,
                disable=True if os.environ.get("CI") else None)
