"""The MLflow store: where runs are tracked (`tracking_uri`), opening it once (`open_store`), one
run's record (`MlflowRun`: params, tags, metrics, artifacts, its end) with every call retried while
the store is briefly unavailable, and the tags a comparison groups runs by (`run_tags`). Their
store calls run in the store process (`pfl_tasks.store_process`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pfl_tasks.errors import RunStopped, TrackingError
from pfl_tasks.store_process import StoreCallError, StoreClient, sqlite_path, transient

ACTIVE_ONLY = 1  # MLflow's ViewType.ACTIVE_ONLY: the runs not deleted


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_tags(exp, task: str, partition: str, run_name: str, algorithm_class: str, citation: str, data_hash: str,
             config_hash: str, setting_hash: str, flow_run_id: str) -> dict[str, str]:
    """The MLflow tags a comparison filters and groups by: `algorithm` the registered algorithm
    (`ditto`), `variant` the run name it was configured under (`ditto`, a grid's `ditto_mu1`),
    `setting_hash` the hash of what it trained with but the seed (its algorithm, every
    hyper-parameter, the experiment's settings and budget): one method at one setting, whose
    seeds share it, apart from every other method and setting."""
    return {
        "experiment": exp.name, "dataset": exp.dataset, "partition": partition, "model": exp.model.kind, "task": task,
        "algorithm": algorithm_class, "variant": run_name, "citation": citation, "seed": str(exp.seed),
        "git_commit": git_commit(), "data_hash": data_hash, "config_hash": config_hash,
        "setting_hash": setting_hash,
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


def tracking_uri(configured: str) -> str:
    """MLFLOW_TRACKING_URI when set, else `tracking.mlflow_uri`; a relative sqlite path is the
    project's (DVC_ROOT, which `dvc exp run --temp` and `--queue` set to the project while the
    stages run in a temporary copy), so their runs land in the project's store."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", configured)
    path = sqlite_path(uri)
    if path is not None and not path.is_absolute() and os.environ.get("DVC_ROOT"):
        return uri.replace(f"sqlite:///{path}", f"sqlite:///{Path(os.environ['DVC_ROOT']).resolve() / path}", 1)
    return uri


def retrying(call, what: str, bound: float, first_wait: float = 0.5, stopping: Callable[[], None] = lambda: None,
             then: str = "the run is checkpointed and resumes when rerun"):
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
                if not transient(err):
                    result.set_exception(err)
                    return
                latest[:] = [err]
            time.sleep(pause)
            pause = min(2 * pause, 8.0)

    threading.Thread(target=tries, name=f"MLflow {what}", daemon=True).start()
    try:
        while not concurrent.futures.wait([result], timeout=min(0.1, max(deadline - time.monotonic(), 0.0))).done:
            if time.monotonic() >= deadline:
                last = first_line(latest[0]) if latest else "no answer"
                raise TrackingError(f"MLflow store unavailable for {bound:g} s ({what}: {last}); {then}")
            stopping()
    except BaseException:
        given_up.set()
        raise
    return result.result()


def artifact_location(uri: str, experiment: str) -> str | None:
    """A new experiment's artifacts beside a sqlite store (`mlruns/` next to `mlflow.db`), not
    under the working directory, which `dvc exp run --temp` deletes; a server's: its default."""
    path = sqlite_path(uri)
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
    path, store = Path(url2pathname(parsed.path)), sqlite_path(store_uri)
    if path.exists() or store is None or "mlruns" not in path.parts:
        return path
    below = path.parts[len(path.parts) - 1 - path.parts[::-1].index("mlruns"):]
    return store.resolve().parent.joinpath(*below)


def open_store(uri: str, retry_seconds: float = 120.0) -> None:
    """Fail fast, before any training, on a store that cannot work, and create (migrate) it
    once; a store busy (locked by another process) is retried for `retry_seconds`, said in a
    line when it first is. Errors name `tracking.mlflow_uri`."""
    import urllib.request

    where = f"tracking.mlflow_uri ({uri})"
    path = sqlite_path(uri)
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
    announced = []

    def attempt() -> None:
        try:
            StoreClient(uri).open()
        except Exception as err:
            if transient(err) and not announced:
                announced.append(err)
                print(f"{where}: {first_line(err)}: retrying for up to {retry_seconds:g} s", file=sys.stderr,
                      flush=True)
            raise

    try:
        retrying(attempt, "open", retry_seconds, then="nothing ran: rerun when it is free")
    except TrackingError as err:
        raise TrackingError(f"{where}: {err}") from None
    except Exception as err:
        raise TrackingError(f"{where}: cannot open the store: {first_line(err)}") from None


SQLALCHEMY_NOTES = ("(raised as a result of", "[SQL:", "[parameters:", "(Background on this error")


def first_line(err: BaseException) -> str:
    """An error's message in a line: its first line that is not one of SQLAlchemy's notes."""
    lines = [line for line in str(err).strip().splitlines() if line.strip() and not line.startswith(SQLALCHEMY_NOTES)]
    return (lines or [type(err).__name__])[0][:300]


_EXPERIMENT_CREATION = threading.Lock()


class MlflowRun:
    """One MLflow run per (experiment, algorithm, seed); resumable by run id. Every call to the
    store is retried while it fails transiently, up to `retry_seconds`. Metric records go to the
    store on a thread of their own, one batch at a time and in order, while training goes on
    (a store write of a round's metrics costs about as much as a small round): every other
    call, and the next batch, waits for the batch in flight first, and raises its error."""

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: str | None, retry_seconds: float = 120.0,
                 tags: dict[str, str] | None = None, stopping: Callable[[], None] = lambda: None):
        """`tags` are set at creation (or on resume), so a run is findable from its first moment;
        `stopping` may give up a store call that waits (see `retrying`)."""
        self.retry_seconds, self.stopping = retry_seconds, stopping
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlflow-records")
        self._in_flight: concurrent.futures.Future | None = None
        self.client = StoreClient(tracking_uri(uri))
        with _EXPERIMENT_CREATION:  # runs side by side create their experiment once
            exp = self._call("get experiment", self.client.get_experiment_by_name, experiment)
            exp_id = exp.experiment_id if exp else self._call(
                "create experiment", self.client.create_experiment, experiment,
                artifact_location(tracking_uri(uri), experiment))
        run = None if run_id is None else self._call("get run", stored_run, self.client, run_id)
        self.to_resume = run is not None  # found, not yet set RUNNING again: `resume`
        self._stale_tags = [tag for tag in ("failure", "diverged_at") if run is not None and tag in run.data.tags]
        self.run_id = run.info.run_id if run is not None else self._call(
            "create run", self.client.create_run, exp_id, run_name=run_name, tags=dict(texts(tags or {}))).info.run_id

    def resume(self, tags: dict[str, str]) -> None:
        """The run found by id RUNNING again, without the tags of how its last attempt ended,
        tagged with `tags`; a failure here leaves it to the caller to mark (`finish`)."""
        self.to_resume = False
        self._call("resume run", self.client.update_run, self.run_id, status="RUNNING")
        for stale in self._stale_tags:
            self._call("resume run", self.client.delete_tag, self.run_id, stale)
        self._call("tag run", self.client.log_batch, self.run_id, tags=texts(tags))

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
        try:
            if bound is not None:
                return retrying(lambda: fn(*args, **kwargs), what, bound)
            return retrying(lambda: fn(*args, **kwargs), what, self.retry_seconds, stopping=self.stopping)
        except StoreCallError as err:  # not transient: MLflow refused it
            raise TrackingError(f"the MLflow store refused to {what} ({first_line(err)}); the run is checkpointed "
                                "and resumes when rerun") from err

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the records in flight (at most `timeout` seconds); their error, if they
        failed, raises here."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result(timeout)

    def log_params_and_tags(self, params: dict[str, str], tags: dict[str, str]) -> None:
        self.drain()
        existing = self._call("read params", self.client.get_run, self.run_id).data.params
        fresh = [(k, v[:6000]) for k, v in texts(params) if k not in existing]
        self._call("log params", self.client.log_batch, self.run_id, params=fresh, tags=texts(tags))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.log_records([{"step": step, **metrics}], "step")

    def log_records(self, records: list[dict], step_key: str) -> None:
        """Each record's values at the step `record[step_key]`, in as few calls as MLflow allows."""
        now = int(time.time() * 1000)
        batch = [(k, float(v), now, int(r[step_key])) for r in records for k, v in r.items() if k != step_key]

        def send() -> None:
            for i in range(0, len(batch), 1000):  # MLflow's per-call limit
                self._call("log metrics", self.client.log_batch, self.run_id, metrics=batch[i : i + 1000])

        self.drain()
        self._in_flight = self._sender.submit(send)

    def log_artifacts(self, directory: Path) -> None:
        self.drain()
        self._call("log artifacts", self.client.log_artifacts, self.run_id, str(directory))

    def last_step(self, key: str) -> int:
        """The last step at which this run holds metric `key`; -1 if none."""
        self.drain()
        history = self._call("read metric", self.client.get_metric_history, self.run_id, key)
        return max((m.step for m in history), default=-1)

    def fail_stale_runs(self, tags: dict[str, str], reason: str) -> list[str]:
        """Mark FAILED every other RUNNING run carrying `tags` (a host among them) whose `pid`
        is no live process on this host: left by a process that died."""
        self.drain()
        run = self._call("get run", self.client.get_run, self.run_id)
        query = " and ".join([f"tags.`{k}` = '{v}'" for k, v in tags.items()] + ["attributes.status = 'RUNNING'"])
        stale = [r.info.run_id for r in self._call(
            "search runs", self.client.search_runs, [run.info.experiment_id], query, ACTIVE_ONLY, 100)
            if r.info.run_id != self.run_id and not _alive(r.data.tags.get("pid"))]
        for run_id in stale:
            self._call("mark stale run", self.client.set_tag, run_id, "failure", reason)
            self._call("mark stale run", self.client.set_terminated, run_id, "FAILED")
        return stale

    def set_tag(self, key: str, value: str) -> None:
        self.drain()
        self._call(f"tag {key}", self.client.set_tag, self.run_id, key, value)

    def finish(self, status: str = "FINISHED", reason: str | None = None, bound: float | None = None) -> None:
        """Mark the run ended: a FINISHED run has every record (their error raises here); a
        failed or stopped one is marked whatever became of its records in flight, waited for
        at most `bound` seconds (its checkpoint holds them)."""
        if status == "FINISHED":
            self.drain()
        else:
            with contextlib.suppress(Exception, RunStopped):
                self.drain(bound)
        self._sender.shutdown(wait=False)
        if reason is not None:
            self._call("tag failure", self.client.set_tag, self.run_id, "failure", reason[:5000], bound=bound)
        self._call("end run", self.client.set_terminated, self.run_id, status=status, bound=bound)


def texts(values: dict) -> list[tuple[str, str]]:
    """Keys and values as plain `str`: a subclass (torch's version string) would make the store
    process import its module to read them."""
    return [(str(k), str(v)) for k, v in values.items()]


def stored_run(client, run_id: str):
    """The store's run `run_id` (from an MlflowClient or a StoreClient), None when the store does
    not hold it (it was reset, or lost); every other error raises."""
    try:
        return client.get_run(run_id)
    except Exception as err:
        if getattr(err, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def unmarked_runs(uri: str, run_ids: list[str], retry_seconds: float) -> list[str]:
    """Those of `run_ids` that the store does not hold marked FINISHED (failed, still RUNNING, or
    gone from a lost or reset store)."""
    client = StoreClient(uri)
    runs = {run_id: retrying(lambda r=run_id: stored_run(client, r), "get run", retry_seconds) for run_id in run_ids}
    return [run_id for run_id, run in runs.items() if run is None or run.info.status != "FINISHED"]


def _alive(pid: str | None) -> bool:
    """A live process other than this one (whose earlier runs of an output it holds the lock
    of are over; a restarted container may reuse its PID)."""
    import psutil

    return pid is not None and pid.isdigit() and int(pid) != os.getpid() and psutil.pid_exists(int(pid))
