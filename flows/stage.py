"""What every stage's entry point shares: its own Prefect server, and the exit path.

A stage (without PREFECT_API_URL) owns a `prefect server start` child bound to 127.0.0.1. The
child lives in its own session, so a terminal's Ctrl-C reaches only the stage, which stops its
runs cleanly and then the server; and it carries a parent-death signal, so it dies with the
stage even when the stage is killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

from flows import prefect_workers
from pfl_tasks.config import params_snapshot
from pfl_tasks.errors import (
    CheckpointError, ComparisonError, ConfigError, DataValidationError, OutputLockedError, OutputPathError,
    PartitionError, RunStopped, SourceError, TrackingError,
)
from pfl_tasks.store_process import RERUN

EXPECTED = (ConfigError, DataValidationError, PartitionError, SourceError, CheckpointError, OutputLockedError,
            OutputPathError, TrackingError, ComparisonError)
PR_SET_PDEATHSIG = 1
STORAGE_FULL = (errno.ENOSPC, errno.EDQUOT)  # a disk or quota full: one line, as an expected error
OUR_SERVER = "PFL_PREFECT_SERVER"  # the URL of a server a stage or `make run` started, for its child processes
_APIS: set[str] = set()  # the Prefect APIs this process's flows reported to
# the loggers of Prefect's background services, which report, record by record, what its API did not take
DEAD_SERVER_NOISE = ("prefect.events.clients", "prefect.events.worker", "prefect._internal.concurrency",
                     "EventsWorker", "APILogWorker")
DRAIN_SECONDS = 5.0  # the longest a stage waits at its end for its Prefect server to take the last logs and events


def die_with(parent: int) -> Callable[[], None]:
    """A `preexec_fn` whose child gets SIGTERM when `parent` dies, however it dies."""
    def preexec() -> None:  # in the child, before exec
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def stage_name(*parts: str) -> str:
    """DVC stage names take letters, digits, '_' and '-': a run name's '.' becomes '_'."""
    return "-".join(re.sub(r"[^\w-]", "_", p) for p in parts)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_prefect_api() -> None:
    """A PREFECT_API_URL that is set must answer within seconds (else every flow run retries
    against it, then fails with a long traceback): a ConfigError naming it."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5):
            pass
    except urllib.error.HTTPError:
        pass  # it answers (a server that wants a key, as Prefect Cloud does)
    except (OSError, ValueError) as err:
        raise ConfigError(f"PREFECT_API_URL={url} does not answer ({getattr(err, 'reason', err)}): "
                          "start that server or unset it") from None


@contextlib.contextmanager
def settings_of_ours(settings: dict) -> Iterator[None]:
    """A server of ours's client `settings`, and no report of a log batch it did not take:
    Prefect's log shipper writes each to stderr while `logging.raiseExceptions` holds (the
    stdlib's default; off is its production setting), where a dead server's is noise before the
    stage's one line that says so."""
    from prefect.settings import temporary_settings

    previous, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        with temporary_settings(settings):
            yield
    finally:
        logging.raiseExceptions = previous


@contextlib.contextmanager
def prefect_api(ui: bool = False) -> Iterator[str]:
    """The Prefect API this stage's flows report to: PREFECT_API_URL when set, else a server of
    the stage's own (with its web UI if `ui`), stopped (SIGTERM to its PID) when the stage
    ends, however it ends. A server of ours (this stage's, or `make run`'s) gets three retries a
    request, so that a dead one ends the stage in seconds (`prefect_unreachable`); on it flow
    runs send no heartbeats: those feed only the automations that detect crashed runs, and ours run none
    (PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED=false), while waiting for the heartbeat thread
    costs every flow run about a second (0.12 s without)."""
    from prefect.settings import (
        PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings,
    )

    quiet_prefect_logs()  # its handlers exist now

    # a server of ours is on this machine: a request it fails 4 times (about 14 s) means it died;
    # the client's default, 5 retries, waits about 70 s per request for a dead server. Its sqlite
    # answers concurrent writers (runs side by side) 503 now and then: those retries cover that
    ours = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None, PREFECT_CLIENT_MAX_RETRIES: 3}
    if PREFECT_API_URL.value():
        check_prefect_api()
        mine = PREFECT_API_URL.value() == os.environ.get(OUR_SERVER)
        _APIS.add(PREFECT_API_URL.value())
        with settings_of_ours(ours) if mine else contextlib.nullcontext():
            yield PREFECT_API_URL.value()
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    _APIS.add(url)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with(os.getpid()),
            env={**os.environ, "PREFECT_SERVER_UI_ENABLED": str(ui).lower()},
        )
        try:
            deadline = time.monotonic() + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise RuntimeError(f"the stage's Prefect server did not start:\n{log.read()[-2000:]}") from None
                    time.sleep(0.2)
            with temporary_settings({PREFECT_API_URL: url}), settings_of_ours(ours):
                os.environ["PREFECT_API_URL"] = os.environ[OUR_SERVER] = url  # and for child processes (dvc's stages)
                try:
                    yield url
                finally:
                    with contextlib.suppress(Exception):  # never to mask how the stage ended
                        _drain_prefect_workers(server_died=proc.poll() is not None)  # else they retry at exit
                    os.environ.pop("PREFECT_API_URL", None)
                    os.environ.pop(OUR_SERVER, None)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _drain_prefect_workers(server_died: bool) -> None:
    """Send the logs and events Prefect's client still holds (as its test harness does) for at
    most DRAIN_SECONDS, without the workers' "Still processing items: N items remaining"
    warnings: that wait is this one. What they hold after it, and all of it when the server died
    (each record would wait out the client's retries, about 7 s), is dropped with one line, and
    so is their drain at interpreter exit; a signal during the wait drops it too."""
    prefect_workers.quiet_waits()
    held = prefect_workers.workers()
    try:
        prefect_workers.drain_all(timeout=0 if server_died else DRAIN_SECONDS)
    finally:
        left = [w for w in held if prefect_workers.busy(w)]
        lost = sum(prefect_workers.drop(w) for w in left)
        if server_died:
            _say(f"the stage's Prefect server died: the {lost} logs and events its client still held are lost")
        elif left:
            _say(f"the stage's Prefect server had not taken the last logs and events after {DRAIN_SECONDS:g} s: "
                 f"the {lost} still queued are lost")


def _say(line: str) -> None:
    """One line on stderr in one write, so that a worker thread's output cannot split it."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def expected(err: BaseException) -> bool:
    """An error `stage_main` says in one line: a clear one of the project's, or a full disk."""
    return isinstance(err, EXPECTED) or isinstance(err, OSError) and err.errno in STORAGE_FULL


def prefect_unreachable(err: BaseException) -> str | None:
    """The Prefect API URL that `err` (or its cause) failed to reach, or that answered a server
    error past its retries (a 503 from a loaded server's sqlite), None for any other error."""
    import httpx

    while err is not None:
        if isinstance(err, httpx.TransportError) or (isinstance(err, httpx.HTTPStatusError)
                                                      and err.response.status_code >= 500):
            with contextlib.suppress(RuntimeError):  # an error with no request
                failed = str(err.request.url)
                return next((url for url in _APIS if failed.startswith(url)), None)
        err = err.__cause__ or err.__context__
    return None


def _stop(signum, frame) -> None:
    raise RunStopped(signum)


class QuietExpectedErrors(logging.Filter):
    """Keeps off the console Prefect's report of a flow or task run that failed on an expected
    error (its traceback, then the run's "Finished in state Failed"): `stage_main` says it in
    one line. The Prefect API still records it; any other error keeps its traceback. Prefect's
    background services' reports of events the API did not take (`DEAD_SERVER_NOISE`) stay off
    it too: they say nothing of the stage's results, and a dying server's came before the health
    check could tell it was dead (a loaded machine), after the stage's last line."""

    def __init__(self):
        super().__init__()
        self.failed_runs: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in DEAD_SERVER_NOISE:  # `stage_main` says it once, when the server died
            return False
        run = getattr(record, "task_run_id", None) or getattr(record, "flow_run_id", None)
        if record.exc_info and (expected(record.exc_info[1]) or prefect_unreachable(record.exc_info[1])):
            if run is not None:
                self.failed_runs.add(run)
            return False
        return run not in self.failed_runs


_QUIET: list[tuple[QuietExpectedErrors, set[logging.Handler]]] = []  # the active filter, the handlers it is on


@contextlib.contextmanager
def quiet_expected_errors() -> Iterator[None]:
    """`QuietExpectedErrors` on the console's handlers (`quiet_prefect_logs`); and no "--- Error
    logging to API ---" per batch of logs a dead server did not take (Prefect prints those only
    while `logging.raiseExceptions`, the stdlib's debug mode)."""
    quiet, filtered, raising = QuietExpectedErrors(), set(), logging.raiseExceptions
    _QUIET.append((quiet, filtered))
    quiet_prefect_logs()
    logging.raiseExceptions = False
    try:
        yield
    finally:
        logging.raiseExceptions = raising
        _QUIET.remove((quiet, filtered))
        for handler in filtered:
            handler.removeFilter(quiet)


def quiet_prefect_logs() -> None:
    """The active `QuietExpectedErrors` on the root logger's handlers, where Prefect's run loggers
    reach the console, and on those of its internal loggers: again once Prefect is imported (a
    stage imports it only to orchestrate), since it sets up its handlers as it loads."""
    handlers = set(logging.getLogger().handlers)
    for name in DEAD_SERVER_NOISE:  # Prefect's internal loggers have handlers of their own
        logger = logging.getLogger(name)
        while logger is not None:
            handlers.update(logger.handlers)
            logger = logger.parent if logger.propagate else None
    for quiet, filtered in _QUIET:
        for handler in handlers - filtered:
            handler.addFilter(quiet)
            filtered.add(handler)


def stage_main(name: str, work: Callable[[], object]) -> int:
    """Run `work` on one snapshot of the config files it reads and map its end to an exit code:
    0 done; 2 a clear error of config (a config file edited while it ran among them), data,
    checkpoint, lock, output folder or tracking, or a full disk (one line); 128 + N stopped by
    signal N (SIGTERM, SIGHUP and SIGINT each stop it cleanly); 1 anything else (traceback,
    then one line). Prefect's background services are silenced before that last line, so that
    nothing they report of a dying server follows it."""
    # SIGINT too: a shell starts a background job with it ignored, which Python then keeps
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    set_background_noise(disabled=False)
    code, line = 0, None
    try:
        with quiet_expected_errors(), params_snapshot():  # every flow run of the stage runs one version
            work()
    except RunStopped as err:
        code, line = 128 + err.signum, f"{name} {err}"
    except KeyboardInterrupt:
        code, line = 128 + signal.SIGINT, f"{name} stopped by SIGINT"
    except Exception as err:
        said, code = ending(err), 2
        if said is None:
            traceback.print_exc()
            said, code = f"{type(err).__name__}: {err}", 1
        line = f"{name} failed: {said}"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        set_background_noise(disabled=True)  # their drain at exit would follow the stage's last line
    if line is not None:
        _say(line)
    return code


def ending(err: Exception) -> str | None:
    """The one line that says an expected error (`expected`, or the Prefect server gone), with
    what a rerun does; None for any other error."""
    url = prefect_unreachable(err)
    if url is not None:
        return f"the Prefect server at {url} stopped answering ({err}): {RERUN}"
    if not expected(err):
        return None
    if isinstance(err, OSError):
        return f"{err.strerror}: {err.filename}: make room and {RERUN}"
    return str(err)


def set_background_noise(disabled: bool) -> None:
    """Prefect's background services' loggers (`DEAD_SERVER_NOISE`) off or on, for the process."""
    for logger_name in DEAD_SERVER_NOISE:
        logging.getLogger(logger_name).disabled = disabled
