"""MLflow's client in a process of its own. A stage starts it first thing (`start`), so that
MLflow's imports (1.5-2 s) and a new store's migrations (about 1 s) run on another core
beside the stage's own imports, and each store call (a round's metrics too) costs the stage a
pipe write instead of the store's work.

`StoreClient(uri)` answers MlflowClient's calls in plain data: an entity comes back as a
namespace of its properties (`run.info.status`, `run.data.tags`), `log_batch` takes its
metrics, params and tags as tuples, and an error raises `StoreCallError` with MLflow's error
code and whether another try may succeed (`transient`). The process serves the calls of every
thread in the order they were made; it ignores the stop signals (a stopped stage still marks
its runs KILLED through it) and ends when its stage closes the pipe, exits or dies."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import fcntl
import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from pfl_tasks.errors import TrackingError

# what a rerun of a stage that ended on an outage does (its last line says so)
RERUN = "rerun the stage (finished runs are kept, the others resume from their last checkpoints)"

_UNREACHABLE = ("ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "MaxRetryError", "NewConnectionError")
_BUSY = ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED")  # MLflow's error codes worth another try


class StoreCallError(Exception):
    """An MLflow call that failed in the store process: its message, MLflow's error code (None
    for another error) and whether another try may succeed."""

    def __init__(self, message: str, error_code: str | None = None, transient: bool = False):
        super().__init__(message)
        self.error_code, self.transient = error_code, transient


def transient(err: BaseException | None) -> bool:
    """A locked sqlite store, a server briefly down, overloaded or slow: worth another try (a
    permission or a missing file is not). MLflow wraps a failed request's error in an
    MlflowException raised while handling it, so the cause/context chain is read."""
    while err is not None:
        if getattr(err, "transient", False) or getattr(err, "error_code", None) in _BUSY:
            return True
        if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__name__ in _UNREACHABLE \
                or "database is locked" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?")[0])


LOCK_WAIT = 2.0  # the longest a store call waits for `store_lock` before it fails, to be retried


@contextlib.contextmanager
def store_lock(uri: str):
    """Serializes first use of a sqlite store across processes (MLflow migrates a new database
    on first use, and two processes doing so at once fail). A lock held past LOCK_WAIT is a
    transient StoreCallError: the caller's retries, bounded and said, wait for it."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    with open(f"{path}.lock", "a") as fh:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreCallError(f"another process holds {Path(fh.name).resolve()} (MLflow's first use of "
                                         "the store)", transient=True) from None
                time.sleep(0.05)
        yield


# ----------------------------------------------------------------------------- the stage's side
class StoreClient:
    """MlflowClient(tracking_uri=uri), its calls made in the store process."""

    def __init__(self, uri: str):
        self.uri = uri

    def open(self) -> None:
        """The store's first use (its migrations, under `store_lock`) and a first query."""
        _process().call(self.uri, "open", (), {})

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: _process().call(self.uri, name, args, kwargs)


def start(uri: str) -> None:
    """Start the store process now (it imports MLflow first) and, for a sqlite store `uri`,
    have it open the store while the stage goes on, if the file exists; else only load MLflow's
    sqlite store: a new store waits for the stage's checks of its inputs (a bad one leaves none
    behind), and a server for the stage's own health check."""
    process, path = _process(), sqlite_path(uri)
    if path is not None:
        process.submit(uri, "open" if path.is_file() else "load sqlite", (), {})


class _StoreProcess:
    def __init__(self):
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "pfl_tasks.store_process", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._lock, self._waiting, self._numbers = threading.Lock(), {}, itertools.count()
        self._ended: str | None = None
        threading.Thread(target=self._replies, name="MLflow store replies", daemon=True).start()

    def submit(self, uri: str, name: str, args: tuple, kwargs: dict) -> concurrent.futures.Future:
        reply = concurrent.futures.Future()
        with self._lock:
            if self._ended is not None:
                raise self.death()
            number = next(self._numbers)
            self._waiting[number] = reply  # answered by number: a call interrupted here waits for nothing
            try:
                pickle.dump((number, uri, name, args, kwargs), self.proc.stdin)
                self.proc.stdin.flush()
            except OSError:
                del self._waiting[number]
                self._ended = self._ended or f"the MLflow store process ended ({ended_how(self.proc.wait())})"
                raise self.death() from None
        return reply

    def call(self, uri: str, name: str, args: tuple, kwargs: dict):
        status, *value = self.submit(uri, name, args, kwargs).result()
        if status == "ended":
            raise self.death()
        if status == "error":
            raise StoreCallError(*value)
        return value[0]

    def death(self) -> TrackingError:
        """The store process's end, as a stage says it: one line, with what a rerun does."""
        return TrackingError(f"{self._ended}: {RERUN}")

    def _replies(self) -> None:
        try:
            while True:
                number, reply = pickle.load(self.proc.stdout)
                with self._lock:
                    waiting = self._waiting.pop(number)
                waiting.set_result(reply)
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        with self._lock:
            self._ended = f"the MLflow store process ended ({ended_how(self.proc.wait())})"
            for waiting in self._waiting.values():
                waiting.set_result(("ended",))
            self._waiting.clear()

    def close(self, timeout: float = 1.0) -> None:
        """End it at this process's exit, when every call waited for has its answer: it reads
        the end of its requests, or is killed busy with one given up."""
        with contextlib.suppress(OSError), self._lock:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ended_how(returncode: int) -> str:
    return f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exit {returncode}"


_PROCESS: _StoreProcess | None = None
_STARTING = threading.Lock()


def _process() -> _StoreProcess:
    global _PROCESS
    with _STARTING:
        if _PROCESS is None or _PROCESS._ended is not None:
            _PROCESS = _StoreProcess()
            atexit.register(_PROCESS.close)
        return _PROCESS


# ----------------------------------------------------------------------------- the store process
def plain(value):
    """An MLflow entity as a namespace of its properties, recursively: what the stage unpickles
    without importing MLflow."""
    from mlflow.entities._mlflow_object import _MlflowObject

    if isinstance(value, _MlflowObject):
        return SimpleNamespace(**{key: plain(v) for key, v in value})
    if isinstance(value, dict):
        return {key: plain(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class RetriedQuietly(logging.Filter):
    """Drops MLflow's traceback of a store error worth another try (`transient`: a locked
    sqlite store, a server briefly away): the caller retries it and says so in one line, where
    MLflow logs 65 lines with the SQL statement."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and transient(record.exc_info[1]))


MLFLOW_SQL_LOGGER = "mlflow.store.db.utils"  # where MLflow logs a failed SQL session


def _serve(parent: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)

    def watch() -> None:  # a stage killed while this one is busy (importing MLflow, a slow store)
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything MLflow prints goes to stderr, not into the replies

    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    logging.getLogger(MLFLOW_SQL_LOGGER).addFilter(RetriedQuietly())

    clients: dict[str, MlflowClient] = {}

    def answer(uri: str, name: str, args: tuple, kwargs: dict):
        if name == "load sqlite":
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

            return None
        if uri not in clients:
            with store_lock(uri):  # the client opens (migrates) the store as it is made
                clients[uri] = MlflowClient(tracking_uri=uri)
        if name == "open":
            return clients[uri].search_experiments(max_results=1)
        if name == "log_batch":
            kwargs = {**kwargs, **{key: [kind(*item) for item in kwargs.get(key, ())]
                                   for key, kind in (("metrics", Metric), ("params", Param), ("tags", RunTag))}}
        return getattr(clients[uri], name)(*args, **kwargs)

    while True:
        try:
            number, uri, name, args, kwargs = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = ("ok", plain(answer(uri, name, args, kwargs)))
        except Exception as err:
            reply = ("error", str(err), getattr(err, "error_code", None), transient(err))
        try:
            data = pickle.dumps((number, reply))
        except Exception as err:
            data = pickle.dumps((number, ("error", f"MLflow's answer to {name} could not be sent: {err}")))
        replies.write(data)
        replies.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
