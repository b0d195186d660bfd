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


# run name, its entry under `algorithms` (`mu: 1` an int, as YAML and `--set mu=0.1,1` read it), test accuracy
RUNS = (("fedavg", {}, 0.7), ("fedprox", {"mu": 0.1}, 0.75), ("ditto", {}, 0.9),
        ("ditto_mu1", {"algorithm": "ditto", "mu": 1}, 0.85))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """Finished runs of `mnist`, one a grid's variant, tagged and with params logged by the
    training flow's code."""
    from conftest import tiny_params
    from pfl_tasks.algorithms import build, hyper_parameters
    from pfl_tasks.config import parse_params
    from pfl_tasks.tracking import MlflowRun, flatten, run_tags

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    exp = parse_params(tiny_params()).experiment("tiny").model_copy(update={"name": "mnist"})
    for run_name, raw, acc in RUNS:
        run = MlflowRun(uri, "mnist", f"{run_name}-seed0", None)
        tags = run_tags(exp, "classification", "p", run_name, build(run_name, raw).name, "c", "d", "h", "")
        run.log_params_and_tags(flatten({"algorithm": hyper_parameters(run_name, raw)}), tags)
        run.log_metrics({"selected/test/personalized/acc_mean": acc}, step=0)
        run.finish()
    return uri


# what each filter of the README's block selects from RUNS: a filter added there needs its line here
DOCUMENTED_SELECTS = {
    "tags.algorithm = 'ditto' AND metrics.\"selected/test/personalized/acc_mean\" > 0.8": ["ditto", "ditto_mu1"],
    "tags.algorithm LIKE 'fed%'": ["fedavg", "fedprox"],
    "tags.variant = 'ditto_mu1'": ["ditto_mu1"],
    "params.\"algorithm.mu\" = '1.0' AND tags.seed = '0'": ["ditto_mu1"],
    "attributes.status = 'FINISHED' AND tags.experiment = 'mnist'": ["ditto", "ditto_mu1", "fedavg", "fedprox"],
}


@pytest.mark.parametrize("filter_string", documented_filters())
def test_documented_filter_is_accepted_and_selects_the_runs_it_says(store, filter_string, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # as the README sets it (never mlflow.set_tracking_uri:
                                                      # it sets this variable for the rest of the process)
    runs = mlflow.search_runs(experiment_names=["mnist"], filter_string=filter_string)
    assert filter_string in DOCUMENTED_SELECTS, "a new README filter: add what it selects to DOCUMENTED_SELECTS"
    assert sorted(name.removesuffix("-seed0") for name in runs["tags.mlflow.runName"]) == DOCUMENTED_SELECTS[filter_string]


@pytest.mark.parametrize("filter_string, selected", [
    ("tags.algorithm = 'ditto'", ["ditto-seed0", "ditto_mu1-seed0"]),  # a grid's variants too
    ("tags.variant = 'ditto_mu1'", ["ditto_mu1-seed0"]),
    ("params.\"algorithm.mu\" = '1.0'", ["ditto_mu1-seed0"]),  # params.yaml's int 1, logged as a float
    ("params.\"algorithm.mu\" = '0.1'", ["ditto-seed0", "fedprox-seed0"]),  # ditto's default, logged too
])
def test_filters_select_by_algorithm_variant_and_canonical_params(store, filter_string, selected, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    runs = mlflow.search_runs(experiment_names=["mnist"], filter_string=filter_string)
    assert sorted(runs["tags.mlflow.runName"]) == selected


def test_documented_cli_reads_the_tracking_uri(store):
    env = {**os.environ, "MLFLOW_TRACKING_URI": store}
    mlflow = [sys.executable, "-m", "mlflow"]
    found = subprocess.run([*mlflow, "experiments", "search"], env=env, capture_output=True, text=True, check=True)
    assert "mnist" in found.stdout
    experiment_id = re.search(r"^\s*(\d+)\s+mnist", found.stdout, re.M).group(1)
    runs = subprocess.run([*mlflow, "runs", "list", "--experiment-id", experiment_id], env=env,
                          capture_output=True, text=True, check=True)
    listed = [line for line in runs.stdout.splitlines() if "FINISHED" in line or re.search(r"[0-9a-f]{32}", line)]
    assert len(listed) == len(RUNS)


def test_worked_example_of_an_algorithm_registers_and_does_its_job(digits6):
    """FedBABU from the README: registered by its module alone; its head never leaves its
    initialization while the body trains, and its clients are evaluated fine-tuned."""
    from conftest import run_rounds, tiny_federation
    from pfl_tasks.algorithms import ALGORITHMS
    from pfl_tasks.nets import head_keys

    code = re.search(r"<!-- worked-example -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert code, "README lost its worked example"
    try:
        exec(compile(code.group(1), "README.md (worked example)", "exec"), {"__name__": "fedbabu_example"})
        assert "fedbabu" in ALGORITHMS
        fed = tiny_federation(digits6, "fedbabu", hp={})
        start = fed.initial_state()
        state = run_rounds(fed, start, 0, 3)
        before, after = start.server["global"], state.server["global"]
        head = head_keys(after)
        for k in head:  # the average of identical rows: equal to rounding
            torch.testing.assert_close(after[k], before[k], rtol=1e-6, atol=1e-7)
        assert min((after[k] - before[k]).abs().max() for k in set(after) - head) > 1e-3
        evaluation = fed.evaluate(state).metrics["val"]
        assert not torch.equal(evaluation["personalized"]["loss"], evaluation["global"]["loss"])  # fine-tuned
    finally:
        ALGORITHMS.pop("fedbabu", None)
