"""The README's MLflow instructions work: its documented search filters against a small store,
and the CLI commands it shows with `MLFLOW_TRACKING_URI`."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def documented_filters() -> list[str]:
    text = README.read_text()
    block = re.search(r"<!-- mlflow-filters -->\n```text\n(.*?)```", text, re.S)
    assert block, "README lost its block of MLflow filters"
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """Three finished runs of `digits`, tagged and logged as the training flow does."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("digits")
    for algorithm, mu, acc in (("fedavg", None, 0.7), ("fedprox", "0.1", 0.75), ("ditto", "0.1", 0.9)):
        run = client.create_run(experiment, tags={"algorithm": algorithm, "seed": "0", "experiment": "digits"})
        if mu is not None:
            client.log_param(run.info.run_id, "algorithm.mu", mu)
        client.log_metric(run.info.run_id, "selected/test/personalized/acc_mean", acc)
        client.set_terminated(run.info.run_id)
    mlflow.set_tracking_uri(uri)
    return uri


@pytest.mark.parametrize("filter_string", documented_filters())
def test_documented_filter_is_accepted_and_selects_runs(store, filter_string):
    import mlflow

    runs = mlflow.search_runs(experiment_names=["digits"], filter_string=filter_string)
    assert len(runs) > 0


def test_documented_cli_reads_the_tracking_uri(store):
    env = {**os.environ, "MLFLOW_TRACKING_URI": store}
    mlflow = [sys.executable, "-m", "mlflow"]
    found = subprocess.run([*mlflow, "experiments", "search"], env=env, capture_output=True, text=True, check=True)
    assert "digits" in found.stdout
    experiment_id = re.search(r"^\s*(\d+)\s+digits", found.stdout, re.M).group(1)
    runs = subprocess.run([*mlflow, "runs", "list", "--experiment-id", experiment_id], env=env,
                          capture_output=True, text=True, check=True)
    assert len([line for line in runs.stdout.splitlines() if "FINISHED" in line or re.search(r"[0-9a-f]{32}", line)]) == 3
