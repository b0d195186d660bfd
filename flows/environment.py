"""Defaults that keep every run local and quiet: no telemetry, a generous server start, MLflow's
HTTP client not retrying on its own (`pfl_tasks.tracking` retries, within
`tracking.retry_seconds`). Without PREFECT_API_URL each stage starts a Prefect server of its own
(`flows.stage`), set to record task runs in batches; stopped at exit, it drops its last
in-flight task-run events and logs a traceback for each (an upstream race that leaves results
untouched), so its own log is limited to critical messages. A real server (PREFECT_API_URL) runs
and logs as configured.

Importing a flow changes no environment: every entry point (`python -m flows.<name>`, the
benchmark, the test suite) calls `local_defaults()` before Prefect and MLflow load, since they
read their settings then. A variable already set is left as it is.
"""

import os

ALWAYS = {
    "DO_NOT_TRACK": "true",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    # Prefect's per-run INFO lines ("Task run 'round-3' - Finished in state Completed()": nine
    # in ten lines of a run) stay in the Prefect UI and API; the terminal gets its warnings and
    # errors, and the runs' own progress bars and evaluation lines
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
}
OWN_SERVER = {  # without PREFECT_API_URL: the stage's own server
    "PREFECT_LOGGING_SERVER_LEVEL": "CRITICAL",
    # the server records task runs from their events one database write each by default:
    # 50-60 ms of CPU a task run on 2 cores, competing with training; in batches 20-30 ms.
    # No automations run here, so their trigger service is off. (bench P2)
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "50",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
}


def local_defaults() -> None:
    """Set the defaults above where the environment does not already."""
    for key, value in {**ALWAYS, **({} if "PREFECT_API_URL" in os.environ else OWN_SERVER)}.items():
        os.environ.setdefault(key, value)
