"""The evaluation protocol end to end: selection reads validation only, a diverged run is a
failed run, costs are accounted, and experiments override hyper-parameters for themselves."""

import json

import numpy as np
import pandas as pd
import pytest
from conftest import tiny_params, tracking

from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import parse_params
from pfl_tasks.data import load_partition, partition_dir, write_partition
from pfl_tasks.data.store import MANIFEST, TABLE
from pfl_tasks.engine.rounds import InlineSteps
from pfl_tasks.errors import ConfigError
from pfl_tasks.runs import RunPaths
from pfl_tasks.training import train_run


def run(root, algorithm, experiment="tiny", **overrides):
    data = tiny_params(algorithms=[algorithm], **overrides)
    data["experiments"] = {experiment: data["experiments"]["tiny"]}
    data["federation"] = {"rounds": 6, "eval_every": 1, "checkpoint_every": 3}
    params = validate_params(parse_params(data))
    exp = params.experiment(experiment)
    return train_run(exp, algorithm, exp.hyper[algorithm], root, InlineSteps(2), "refuse", tracking())


def permute_test_labels(folder):
    """Each client's test labels shuffled among its test rows (its label counts unchanged)."""
    df = pd.read_parquet(folder / TABLE)
    rng = np.random.default_rng(0)
    for _, rows in df[df["split"] == "test"].groupby("client_id"):
        df.loc[rows.index, "label"] = rng.permutation(rows["label"].to_numpy())
    manifest = json.loads((folder / MANIFEST).read_text())
    for key in ("table_sha256", "manifest_sha256"):
        manifest.pop(key)
    write_partition(df, manifest, folder)


@pytest.mark.parametrize("algorithm", ["fedavg_ft", "knnper"])
def test_permuting_the_test_labels_changes_no_selection(project, tmp_path, algorithm):
    """The selected round and kNN-Per's lam (it shapes every validation metric) are chosen on
    validation alone: scrambling the test labels changes the test metrics and nothing else."""
    import shutil

    other = tmp_path / "permuted"
    shutil.copytree(project / "data", other / "data")
    permute_test_labels(partition_dir(other, "digits", 0))
    first = run(project, algorithm, "labels_kept")
    second = run(other, algorithm, "labels_permuted")
    assert first["selected/test/personalized/acc_mean"] != second["selected/test/personalized/acc_mean"]
    for key, value in first.items():
        if not key.split("/")[1:2] == ["test"]:
            assert second[key] == value, key


def test_a_diverging_run_is_a_failed_run_never_a_result(project):
    from mlflow.tracking import MlflowClient

    from conftest import mlflow_uri

    outcome = run(project, "fedavg", "diverging", local={"steps": 3, "batch_size": 16, "optimizer": {"lr": 1.0e20}})
    assert outcome["status"] == "diverged" and outcome["diverged_at"] >= 1
    paths = RunPaths.of(project, "diverging", "fedavg", 0)
    assert json.loads(paths.metrics.read_text()) == outcome  # strict JSON: no NaN token
    client = MlflowClient(mlflow_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("diverging").experiment_id])
    assert found.info.status == "FAILED" and found.data.tags["diverged_at"] == str(outcome["diverged_at"])
    assert found.data.tags["failure"].startswith(f"diverged at round {outcome['diverged_at']}: ")


def test_costs_are_logged_per_round_and_grow_with_the_local_work(project):
    light = run(project, "fedavg", "cost_light")
    heavy = run(project, "fedavg", "cost_heavy", local={"steps": 6, "batch_size": 16, "optimizer": {"lr": 0.1}})
    counts = load_partition(partition_dir(project, "digits", 0)).train.counts
    # 6 rounds x 3 steps x min(16, n_k) rows of every client, one forward-backward pass each
    assert light["final/compute/grad_samples"] == 6 * 3 * counts.clamp(max=16).sum().item()
    assert heavy["final/compute/grad_samples"] == 2 * light["final/compute/grad_samples"]
    assert light["final/comm/bytes_up"] == light["final/comm/bytes_down"] > 0  # FedAvg: one model each way


def test_an_experiment_overrides_an_algorithms_hyper_parameters_for_itself():
    data = tiny_params(algorithms=["fedprox", "ditto"], algorithm_overrides={"fedprox": {"mu": 0.01}})
    data["experiments"]["other"] = {**data["experiments"]["tiny"], "algorithm_overrides": {}}
    params = validate_params(parse_params(data))
    assert params.experiment("tiny").hyper == {"fedprox": {"mu": 0.01}, "ditto": {}}  # ditto: its defaults
    assert params.experiment("other").hyper["fedprox"] == {"mu": 0.5}
    data["experiments"]["tiny"]["algorithm_overrides"] = {"fedprox": {"mu": -1.0}}
    with pytest.raises(ConfigError, match=r"experiments\.tiny\.algorithm_overrides\.fedprox\.mu"):
        validate_params(parse_params(data))
    data["experiments"]["tiny"]["algorithm_overrides"] = {"fedavg": {}}
    with pytest.raises(ConfigError, match=r"experiments.tiny.algorithm_overrides: \['fedavg'\] are not among"):
        parse_params(data)
    data["experiments"]["tiny"].update(algorithms=["fedprx"], algorithm_overrides={})
    with pytest.raises(ConfigError, match=r"experiments\.tiny\.algorithms\[0\]: unknown algorithm 'fedprx'"):
        validate_params(parse_params(data))


@pytest.mark.parametrize("section,key,value", [
    ("local", "optimizer", {"lr": float("inf")}), ("algorithms", "fedprox", {"mu": float("nan")}),
])
def test_non_finite_numbers_are_refused_everywhere(section, key, value):
    data = tiny_params()
    data[section] = {**data[section], key: value}
    with pytest.raises(ConfigError, match=f"{section}.{key}"):
        validate_params(parse_params(data))
