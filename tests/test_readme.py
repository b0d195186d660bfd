"""The README's instructions work: its documented MLflow search filters against a small store,
the CLI commands it shows with `MLFLOW_TRACKING_URI`, and its worked example of an algorithm."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def documented_filters() -> list[str]:
    text = README.read_text()
    block = re.search(r"<!-- mlflow-filters -->\n```text\n(.*?)```", text, re.S)
    assert block, "README lost its block of MLflow filters"
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """Three finished runs of `mnist`, tagged and logged as the training flow does."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("mnist")
    for algorithm, mu, acc in (("fedavg", None, 0.7), ("fedprox", "0.1", 0.75), ("ditto", "0.1", 0.9)):
        run = client.create_run(experiment, tags={"algorithm": algorithm, "seed": "0", "experiment": "mnist"})
        if mu is not None:
            client.log_param(run.info.run_id, "algorithm.mu", mu)
        client.log_metric(run.info.run_id, "selected/test/personalized/acc_mean", acc)
        client.set_terminated(run.info.run_id)
    return uri


@pytest.mark.parametrize("filter_string", documented_filters())
def test_documented_filter_is_accepted_and_selects_runs(store, filter_string, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # as the README sets it (never mlflow.set_tracking_uri:
                                                      # it sets this variable for the rest of the process)
    runs = mlflow.search_runs(experiment_names=["mnist"], filter_string=filter_string)
    assert len(runs) > 0


def test_documented_cli_reads_the_tracking_uri(store):
    env = {**os.environ, "MLFLOW_TRACKING_URI": store}
    mlflow = [sys.executable, "-m", "mlflow"]
    found = subprocess.run([*mlflow, "experiments", "search"], env=env, capture_output=True, text=True, check=True)
    assert "mnist" in found.stdout
    experiment_id = re.search(r"^\s*(\d+)\s+mnist", found.stdout, re.M).group(1)
    runs = subprocess.run([*mlflow, "runs", "list", "--experiment-id", experiment_id], env=env,
                          capture_output=True, text=True, check=True)
    assert len([line for line in runs.stdout.splitlines() if "FINISHED" in line or re.search(r"[0-9a-f]{32}", line)]) == 3


def test_worked_example_of_an_algorithm_registers_and_does_its_job(digits6):
    """FedAvgM from the README: registered by its module alone; with beta 0 it is FedAvg
    exactly, and its momentum changes the global model."""
    from conftest import run_rounds, tiny_federation
    from pfl_tasks.algorithms import ALGORITHMS

    code = re.search(r"<!-- worked-example -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert code, "README lost its worked example"
    try:
        exec(compile(code.group(1), "README.md (worked example)", "exec"), {"__name__": "fedavgm_example"})
        assert "fedavgm" in ALGORITHMS

        def global_model(algorithm, hp):
            fed = tiny_federation(digits6, algorithm, hp=hp)
            return run_rounds(fed, fed.initial_state(), 0, 3).server["global"]

        fedavg, no_momentum, momentum = (global_model("fedavg", {}), global_model("fedavgm", {"beta": 0.0}),
                                         global_model("fedavgm", {}))
        for name, value in fedavg.items():
            torch.testing.assert_close(no_momentum[name], value, atol=1e-6, rtol=1e-5)
        assert max((momentum[k] - fedavg[k]).abs().max() for k in fedavg) > 1e-3
    finally:
        ALGORITHMS.pop("fedavgm", None)
