"""Tracking layer: metric summaries and history, DVC metric/plot files, and MLflow runs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import csv
import fcntl
import hashlib
import json
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER, summarize
from pfl_tasks.files import atomic_write_text

PRIMARY = {"classification": "acc", "regression": "mse"}


class ComparisonError(ValueError):
    """The tracked runs cannot make the comparison asked for (missing experiment or runs)."""


def summarize_eval(metrics: dict[str, dict[str, dict[str, torch.Tensor]]]) -> dict[str, float]:
    """Flat aggregates over clients, such as `val/personalized/acc_mean`, `test/global/loss_worst10`,
    from per-client metrics split -> model (personalized, global) -> metric -> [N]."""
    flat = {}
    for split, models in metrics.items():
        for kind, values_of in models.items():
            weights = values_of["n"]
            for metric, values in values_of.items():
                if metric == "n":
                    continue
                for stat, value in summarize(values, weights, HIGHER_IS_BETTER[metric]).items():
                    flat[f"{split}/{kind}/{metric}_{stat}"] = value
    return flat


def selected_index(history: list[dict], task: str) -> int:
    """The evaluation selected on validation: the best personalized mean of the primary metric
    on the clients' validation splits (the earliest of ties); the last one without validation."""
    key = f"val/personalized/{PRIMARY[task]}_mean"
    if key not in history[-1]:
        return len(history) - 1
    values = [h[key] for h in history]
    pick = max if HIGHER_IS_BETTER[PRIMARY[task]] else min
    return values.index(pick(values))


def final_metrics(history: list[dict], task: str) -> dict[str, float]:
    """`final/...` from the last evaluation and `selected/...` from the one selected on
    validation, with their rounds."""
    last, selected = history[-1], history[selected_index(history, task)]
    out = {f"final/{k}": v for k, v in last.items() if k != "round"}
    out.update({f"selected/{k}": v for k, v in selected.items() if k != "round"})
    out["selected/round"] = selected["round"]
    out["final/round"] = last["round"]
    return out


# a run has plateaued when its mean personalized validation metric over the evaluations of the
# last fifth of its rounds is better than over the fifth before by less than half a point of
# accuracy, or 1% of the MSE (window means: one noisy evaluation decides nothing)
PLATEAU_WINDOW = 0.2
PLATEAU_TOLERANCE = {"acc": 0.005, "mse": 0.01}


def plateau(history: list[dict], task: str) -> dict[str, float]:
    """`plateau/gain`, what the mean validation metric gained from the second-to-last fifth of
    the rounds to the last (absolute for accuracy, relative for MSE), and `plateau/reached` (1 or
    0, by PLATEAU_TOLERANCE); nothing when either window holds no evaluation."""
    metric = PRIMARY[task]
    key, total = f"val/personalized/{metric}_mean", history[-1]["round"]
    windows = [[h[key] for h in history if key in h and lo < h["round"] <= hi]
               for lo, hi in ((total * (1 - 2 * PLATEAU_WINDOW), total * (1 - PLATEAU_WINDOW)),
                              (total * (1 - PLATEAU_WINDOW), total))]
    if not all(windows):
        return {}
    before, last = (sum(w) / len(w) for w in windows)
    gain = last - before if HIGHER_IS_BETTER[metric] else (before - last) / before
    return {"plateau/gain": gain, "plateau/reached": float(gain < PLATEAU_TOLERANCE[metric])}


def personalized_is_global(metrics: dict[str, dict[str, dict[str, torch.Tensor]]]) -> bool:
    """Whether every client's personalized model scored as the global one on validation (FedAvg,
    FedDyn, an unsplit CFL): a personalized column that is a global model in disguise."""
    val = metrics["val"]
    if "global" not in val:
        return False
    return all(torch.allclose(val["personalized"][m], val["global"][m], rtol=1e-6, atol=1e-7)
               for m in val["personalized"])


def per_client_rows(metrics: dict[str, dict[str, dict[str, torch.Tensor]]]) -> list[dict]:
    """One row per client: its validation and test sizes and metrics (`test_personalized_acc`, ...)."""
    rows = []
    for k in range(len(next(iter(metrics.values()))["personalized"]["n"])):
        row = {"client_id": k}
        for split, models in metrics.items():
            row[f"n_{split}"] = int(models["personalized"]["n"][k])
            for kind, values_of in models.items():
                row.update({f"{split}_{kind}_{m}": float(v[k]) for m, v in values_of.items() if m != "n"})
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


# a run's DVC metrics file: its headline under short keys (`dvc metrics show` and `dvc exp show`
# fit a terminal; MLflow has every summary): the round selected on validation, the personalized
# model's mean metric there (accuracy or MSE, the task's) on validation and test, the global
# model's on test, the worst 10% of clients on test, the plateau verdict
HEADLINE = {"round": "selected/round", "val": "selected/val/personalized/{m}_mean",
            "test": "selected/test/personalized/{m}_mean", "global": "selected/test/global/{m}_mean",
            "worst10": "selected/test/personalized/{m}_worst10", "plateau": "plateau/reached"}
PINNED_RUN = "mlflow_run"  # the MLflow run the numbers are, as a one-item list: DVC's tables skip lists


def headline(final: dict[str, float]) -> dict[str, float]:
    metric = "mse" if "selected/test/personalized/mse_mean" in final else "acc"
    return {short: final[key.format(m=metric)] for short, key in HEADLINE.items() if key.format(m=metric) in final}


def pin(run_id: str) -> dict[str, list[str]]:
    return {PINNED_RUN: [run_id]}


def pinned_run(record: dict) -> str | None:
    """The MLflow run a DVC metrics file's numbers are."""
    return (record.get(PINNED_RUN) or [None])[0]


def dvc_curve(history: list[dict], task: str) -> list[dict]:
    """The per-round curve DVC plots: the mean metric (accuracy or MSE) over clients, of the
    personalized model on validation and test and of the global one on test."""
    metric = PRIMARY[task]
    return [{"round": h["round"], **{name: h.get(f"{name}/{metric}_mean") for name in
                                     ("val/personalized", "test/personalized", "test/global")}} for h in history]


def evaluation_line(record: dict, task: str) -> str:
    """An evaluation's mean metric over clients, naming model and split: `acc personalized val
    0.9520 test 0.9271, global test 0.8757`."""
    metric = PRIMARY[task]
    parts = {kind: " ".join(f"{split} {record[key]:.4f}" for split in ("val", "test")
                            if (key := f"{split}/{kind}/{metric}_mean") in record)
             for kind in ("personalized", "global")}
    return f"{metric} " + ", ".join(f"{kind} {text}" for kind, text in parts.items() if text)


def write_dvc_outputs(metrics_path: Path, curve_path: Path, final: dict, history: list[dict]) -> None:
    atomic_write_text(metrics_path, json_text(final))
    if history:
        write_csv(curve_path, history)
    else:  # diverged before its first evaluation: no curve, not an earlier run's
        curve_path.unlink(missing_ok=True)


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


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_tags(exp, task: str, partition: str, run_name: str, algorithm_class: str, citation: str, data_hash: str,
             config_hash: str, flow_run_id: str) -> dict[str, str]:
    """The MLflow tags a comparison filters and groups by: `algorithm` the registered algorithm
    (`ditto`), `variant` the run name it was configured under (`ditto`, a grid's `ditto_mu1`)."""
    return {
        "experiment": exp.name, "dataset": exp.dataset, "partition": partition, "model": exp.model.kind, "task": task,
        "algorithm": algorithm_class, "variant": run_name, "citation": citation, "seed": str(exp.seed),
        "git_commit": git_commit(), "data_hash": data_hash, "config_hash": config_hash,
        # the DVC experiment that ran it (`dvc exp run`; "workspace" for dvc repro or a shell)
        "dvc_experiment": os.environ.get("DVC_EXP_NAME", "workspace"),
        "dvc_baseline": os.environ.get("DVC_EXP_BASELINE_REV", git_commit()),
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


class TrackingError(RuntimeError):
    """The MLflow store is unreachable, unwritable, or stayed unavailable past the retry bound."""


def tracking_uri(configured: str) -> str:
    """MLFLOW_TRACKING_URI when set, else `tracking.mlflow_uri`; a relative sqlite path is the
    project's (DVC_ROOT, which `dvc exp run --temp` and `--queue` set to the project while the
    stages run in a temporary copy), so their runs land in the project's store."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", configured)
    path = _sqlite_path(uri)
    if path is not None and not path.is_absolute() and os.environ.get("DVC_ROOT"):
        return uri.replace(f"sqlite:///{path}", f"sqlite:///{Path(os.environ['DVC_ROOT']).resolve() / path}", 1)
    return uri


_UNREACHABLE = ("ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "MaxRetryError", "NewConnectionError")


def _transient(err: BaseException) -> bool:
    """A locked sqlite store, a server briefly down, overloaded or slow: worth another try (a
    permission or a missing file is not). MLflow wraps a failed request's error in an
    MlflowException raised while handling it, so the cause/context chain is read."""
    from mlflow.exceptions import MlflowException

    while err is not None:
        if isinstance(err, MlflowException) and err.error_code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"):
            return True
        if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__name__ in _UNREACHABLE \
                or "database is locked" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def retrying(call, what: str, bound: float, first_wait: float = 0.5, stopping: Callable[[], None] = lambda: None):
    """`call()`, retried with exponential backoff (0.5 s doubling to 8 s) while it fails
    transiently, for at most `bound` seconds; then TrackingError. The tries run on a thread of
    their own while this one waits in slices of 0.1 s, so that signals are handled at once and
    one by one (sqlite waits out a locked store for 20 s in C, where they would wait and merge),
    and `stopping()`, called between slices, may give the call up by raising (a stop request).
    A call given up tries no more; a try under way ends on its own."""
    deadline, given_up, result, latest = time.monotonic() + bound, threading.Event(), concurrent.futures.Future(), []

    def tries() -> None:
        pause = first_wait
        while not given_up.is_set():
            try:
                result.set_result(call())
                return
            except Exception as err:
                if not _transient(err):
                    result.set_exception(err)
                    return
                latest[:] = [err]
            time.sleep(pause)
            pause = min(2 * pause, 8.0)

    threading.Thread(target=tries, name=f"MLflow {what}", daemon=True).start()
    try:
        while not concurrent.futures.wait([result], timeout=min(0.1, max(deadline - time.monotonic(), 0.0))).done:
            if time.monotonic() >= deadline:
                last = str(latest[0]).strip().splitlines()[0][:200] if latest else "no answer"
                raise TrackingError(f"MLflow store unavailable for {bound:g} s ({what}: {last}); "
                                    "the run is checkpointed and resumes when rerun")
            stopping()
    except BaseException:
        given_up.set()
        raise
    return result.result()


@contextlib.contextmanager
def _store_lock(uri: str):
    """Serializes first use of a sqlite store across processes (MLflow migrates a new database
    on first use, and two processes doing so at once fail)."""
    path = _sqlite_path(uri)
    if path is None:
        yield
        return
    with open(f"{path}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def artifact_location(uri: str, experiment: str) -> str | None:
    """A new experiment's artifacts beside a sqlite store (`mlruns/` next to `mlflow.db`), not
    under the working directory, which `dvc exp run --temp` deletes; a server's: its default."""
    path = _sqlite_path(uri)
    if path is None:
        return None
    return (path.resolve().parent / "mlruns" / hashlib.sha1(experiment.encode()).hexdigest()[:12]).as_uri()


def local_artifact_dir(store_uri: str, artifact_uri: str) -> Path | None:
    """A run's artifact folder on this machine (None for a server's artifacts). A sqlite store
    records absolute paths: after the checkout moved, the same path below its `mlruns/` beside
    the store."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    parsed = urlparse(artifact_uri)
    if parsed.scheme not in ("", "file"):
        return None
    path, store = Path(url2pathname(parsed.path)), _sqlite_path(store_uri)
    if path.exists() or store is None or "mlruns" not in path.parts:
        return path
    below = path.parts[len(path.parts) - 1 - path.parts[::-1].index("mlruns"):]
    return store.resolve().parent.joinpath(*below)


def _sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?")[0])


def open_store(uri: str) -> None:
    """Fail fast, before any training, on a store that cannot work, and create (migrate) it
    once. Errors name `tracking.mlflow_uri`."""
    import urllib.request

    from mlflow.tracking import MlflowClient

    where = f"tracking.mlflow_uri ({uri})"
    path = _sqlite_path(uri)
    if path is not None:
        if not path.parent.is_dir():
            raise TrackingError(f"{where}: directory {path.parent} does not exist")
        try:  # writable, by trying (root passes every permission check)
            for writable in (path, Path(f"{path}.lock")):
                with open(writable, "a"):
                    pass
        except OSError as err:
            raise TrackingError(f"{where}: cannot write {err.filename}: {err.strerror}") from None
    elif uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=5):
                pass
        except OSError as err:
            raise TrackingError(f"{where}: no MLflow server answers ({err})") from None
    with _store_lock(uri):
        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception as err:
            raise TrackingError(f"{where}: cannot open the store: {str(err).strip().splitlines()[0][:300]}") from None


class MlflowRun:
    """One MLflow run per (experiment, algorithm, seed); resumable by run id. Every call to the
    store is retried while it fails transiently, up to `retry_seconds`."""

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: str | None, retry_seconds: float = 120.0,
                 tags: dict[str, str] | None = None, stopping: Callable[[], None] = lambda: None):
        """`tags` are set at creation (or on resume), so a run is findable from its first moment;
        `stopping` may give up a store call that waits (see `retrying`)."""
        import mlflow
        from mlflow.entities import RunTag
        from mlflow.tracking import MlflowClient

        self.retry_seconds, self.stopping = retry_seconds, stopping
        self.client = MlflowClient(tracking_uri=tracking_uri(uri))
        exp = self._call("get experiment", self.client.get_experiment_by_name, experiment)
        exp_id = exp.experiment_id if exp else self._call(
            "create experiment", self.client.create_experiment, experiment, artifact_location(tracking_uri(uri), experiment))
        if run_id is not None:
            try:
                run = self._call("get run", self.client.get_run, run_id)
                self.run_id = run.info.run_id
                self._call("resume run", self.client.update_run, self.run_id, status="RUNNING")
                for stale in ("failure", "diverged_at"):  # of the attempt this one resumes
                    if stale in run.data.tags:
                        self._call("resume run", self.client.delete_tag, self.run_id, stale)
                self._call("tag run", self.client.log_batch, self.run_id,
                           tags=[RunTag(k, v) for k, v in (tags or {}).items()])
                return
            except mlflow.exceptions.MlflowException:
                pass  # the store was reset: start a new run
        self.run_id = self._call("create run", self.client.create_run, exp_id, run_name=run_name,
                                 tags=tags or {}).info.run_id

    def __enter__(self) -> MlflowRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Outside the run skeleton (e.g. the tables stage): an error marks the run FAILED."""
        if exc is not None:
            with contextlib.suppress(Exception):
                self.finish("FAILED", f"{type(exc).__name__}: {exc}", bound=5.0)

    def _call(self, what: str, fn, *args, bound: float | None = None, **kwargs):
        """`fn(*args, **kwargs)`, retried for `retry_seconds`; with a `bound`, a last try that
        records how the run ended (after a failure or a stop): no stop request gives it up."""
        if bound is not None:
            return retrying(lambda: fn(*args, **kwargs), what, bound)
        return retrying(lambda: fn(*args, **kwargs), what, self.retry_seconds, stopping=self.stopping)

    def log_params_and_tags(self, params: dict[str, str], tags: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        existing = self._call("read params", self.client.get_run, self.run_id).data.params
        fresh = [Param(k, v[:6000]) for k, v in params.items() if k not in existing]
        self._call("log params", self.client.log_batch, self.run_id, params=fresh,
                   tags=[RunTag(k, v) for k, v in tags.items()])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.log_records([{"step": step, **metrics}], "step")

    def log_records(self, records: list[dict], step_key: str) -> None:
        """Each record's values at the step `record[step_key]`, in as few calls as MLflow allows."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, int(r[step_key])) for r in records for k, v in r.items() if k != step_key]
        for i in range(0, len(batch), 1000):  # MLflow's per-call limit
            self._call("log metrics", self.client.log_batch, self.run_id, metrics=batch[i : i + 1000])

    def log_artifacts(self, directory: Path) -> None:
        self._call("log artifacts", self.client.log_artifacts, self.run_id, str(directory))

    def last_step(self, key: str) -> int:
        """The last step at which this run holds metric `key`; -1 if none."""
        history = self._call("read metric", self.client.get_metric_history, self.run_id, key)
        return max((m.step for m in history), default=-1)

    def fail_stale_runs(self, tags: dict[str, str], reason: str) -> list[str]:
        """Mark FAILED every other RUNNING run carrying `tags` (a host among them) whose `pid`
        is no live process on this host: left by a process that died."""
        from mlflow.entities import ViewType

        run = self._call("get run", self.client.get_run, self.run_id)
        query = " and ".join([f"tags.`{k}` = '{v}'" for k, v in tags.items()] + ["attributes.status = 'RUNNING'"])
        stale = [r.info.run_id for r in self._call(
            "search runs", self.client.search_runs, [run.info.experiment_id], query, ViewType.ACTIVE_ONLY, 100)
            if r.info.run_id != self.run_id and not _alive(r.data.tags.get("pid"))]
        for run_id in stale:
            self._call("mark stale run", self.client.set_tag, run_id, "failure", reason)
            self._call("mark stale run", self.client.set_terminated, run_id, "FAILED")
        return stale

    def set_tag(self, key: str, value: str) -> None:
        self._call(f"tag {key}", self.client.set_tag, self.run_id, key, value)

    def finish(self, status: str = "FINISHED", reason: str | None = None, bound: float | None = None) -> None:
        if reason is not None:
            self._call("tag failure", self.client.set_tag, self.run_id, "failure", reason[:5000], bound=bound)
        self._call("end run", self.client.set_terminated, self.run_id, status=status, bound=bound)


def _alive(pid: str | None) -> bool:
    """A live process other than this one (whose earlier runs of an output it holds the lock
    of are over; a restarted container may reuse its PID)."""
    import psutil

    return pid is not None and pid.isdigit() and int(pid) != os.getpid() and psutil.pid_exists(int(pid))
