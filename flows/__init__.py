"""Prefect flows and the thin entry points that `dvc.yaml` stages call.

Defaults keep every run local and quiet: no telemetry, a generous ephemeral-server start.
"""

import os

for _key, _value in {
    "DO_NOT_TRACK": "true",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}.items():
    os.environ.setdefault(_key, _value)
