"""Tracking layer: metric summaries and history, DVC metric/plot files, and MLflow runs."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER, summarize

PRIMARY = {"classification": "acc", "regression": "mse"}


def summarize_eval(per_client: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """Flat metrics such as `personalized/acc_mean`, `global/loss_worst10`."""
    flat = {}
    for kind, metrics in per_client.items():
        weights = metrics["n"]
        for metric, values in metrics.items():
            if metric == "n":
                continue
            for stat, value in summarize(values, weights, HIGHER_IS_BETTER[metric]).items():
                flat[f"{kind}/{metric}_{stat}"] = value
    return flat


def best_index(history: list[dict], task: str) -> int:
    key = f"personalized/{PRIMARY[task]}_mean"
    values = [h[key] for h in history]
    pick = max if HIGHER_IS_BETTER[PRIMARY[task]] else min
    return values.index(pick(values))


def final_metrics(history: list[dict], task: str) -> dict[str, float]:
    """`final/...` from the last evaluation, `best/...` from the best round by the
    personalized primary metric (accuracy or MSE), and that round's index."""
    last, best = history[-1], history[best_index(history, task)]
    out = {f"final/{k}": v for k, v in last.items() if k != "round"}
    out.update({f"best/{k}": v for k, v in best.items() if k != "round"})
    out["best/round"] = best["round"]
    out["final/round"] = last["round"]
    return out


def per_client_rows(per_client: dict[str, dict[str, torch.Tensor]]) -> list[dict]:
    rows = []
    n_clients = len(per_client["personalized"]["n"])
    for k in range(n_clients):
        row = {"client_id": k, "n_test": int(per_client["personalized"]["n"][k])}
        for kind, metrics in per_client.items():
            row.update({f"{kind}_{m}": float(v[k]) for m, v in metrics.items() if m != "n"})
        rows.append(row)
    return rows


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def write_csv(path: Path, rows: list[dict]) -> None:
    from io import StringIO

    buf = StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def write_dvc_outputs(metrics_path: Path, curve_path: Path, final: dict, history: list[dict]) -> None:
    atomic_write_text(metrics_path, json.dumps(final, indent=1, sort_keys=True))
    write_csv(curve_path, history)


def learning_curve_png(path: Path, history: list[dict], task: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = PRIMARY[task]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    rounds = [h["round"] for h in history]
    for kind in ("personalized", "global"):
        key = f"{kind}/{metric}_mean"
        if key in history[0]:
            ax.plot(rounds, [h[key] for h in history], marker="o", label=kind)
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


def source_hash() -> str:
    """Hash of the library's source: a checkpoint from other code is not resumed."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_tags(exp, partition: str, run_name: str, algorithm_class: str, citation: str, data_hash: str,
             config_hash: str, flow_run_id: str) -> dict[str, str]:
    """The MLflow tags a comparison filters and groups by."""
    return {
        "experiment": exp.name, "dataset": exp.dataset, "partition": partition, "model": exp.model.kind,
        "algorithm": run_name, "algorithm_class": algorithm_class, "citation": citation, "seed": str(exp.seed),
        "git_commit": git_commit(), "data_hash": data_hash, "config_hash": config_hash,
        "prefect_flow_run_id": flow_run_id,
    }


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)
    return flat


class MlflowRun:
    """One MLflow run per (experiment, algorithm); resumable by run id."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, run_id: str | None):
        import mlflow
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI", tracking_uri))
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        if run_id is not None:
            try:
                self.run_id = self.client.get_run(run_id).info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
                return
            except mlflow.exceptions.MlflowException:
                pass  # the store was reset: start a new run
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id

    def log_params_and_tags(self, params: dict[str, str], tags: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        existing = self.client.get_run(self.run_id).data.params
        fresh = [Param(k, v[:6000]) for k, v in params.items() if k not in existing]
        self.client.log_batch(self.run_id, params=fresh, tags=[RunTag(k, v) for k, v in tags.items()])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._log([(k, v, step) for k, v in metrics.items()])

    def log_series(self, key: str, values: list[float], first_step: int) -> None:
        self._log([(key, v, first_step + i) for i, v in enumerate(values)])

    def _log(self, points: list[tuple[str, float, int]]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v, step in points]
        for i in range(0, len(batch), 1000):  # MLflow's per-call limit
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_artifacts(self, directory: Path) -> None:
        self.client.log_artifacts(self.run_id, str(directory))

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
