"""dvc.yaml is generated from params.yaml: a train stage per experiment, whose code deps are the
files that can change its runs' numbers."""

import pytest
import yaml

from conftest import listing_defaults
from flows.dvc_yaml import dvc_yaml, stages
from pfl_tasks.errors import ConfigError
from pfl_tasks.code_deps import ROOT, numeric_code


def test_the_committed_dvc_yaml_is_what_params_yaml_gives():
    assert (ROOT / "dvc.yaml").read_text() == dvc_yaml(str(ROOT / "params.yaml")), \
        "dvc.yaml is stale: python -m flows.dvc_yaml"


def test_the_default_pipeline_trains_learn2pfed_downstream_of_a_trained_checkpoint():
    """The design card: Learn2pFed's meta-parameters are trained in a DVC stage on trained
    models, in the default run (`make run`) beside the methods it is compared with."""
    out = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    downstream = {name: stage for name, stage in out.items() if name.startswith("learn2pfed-")}
    trained = {f"models/{name.removeprefix('train-')}" for name in out if name.startswith("train-")}
    on_checkpoints = {name for name, stage in downstream.items()
                      if any(dep.rsplit("/", 1)[0] in trained for dep in stage["deps"])}
    assert on_checkpoints == {"learn2pfed-mnist"}
    assert "models/mnist/fedavg" in out["learn2pfed-mnist"]["deps"]
    assert "learn2pfed.mnist" in out["learn2pfed-mnist"]["params"]


def test_a_run_depends_on_the_numeric_core_and_its_own_algorithm_not_the_others_or_the_plumbing():
    code = set(map(str, numeric_code(ROOT / "pfl_tasks/algorithms/ditto.py")))
    assert {"pfl_tasks/algorithms/ditto.py", "pfl_tasks/algorithms/fedavg.py",  # Ditto's global model is FedAvg's
            "pfl_tasks/engine/executor.py", "pfl_tasks/nets.py", "pfl_tasks/data/store.py",
            "pfl_tasks/config.py", "pfl_tasks/selection.py"} <= code  # selection picks the reported round
    assert not {"pfl_tasks/algorithms/fedprox.py", "pfl_tasks/algorithms/__init__.py",  # another, the registration
                "pfl_tasks/tracking.py", "pfl_tasks/outputs.py", "pfl_tasks/runs.py",
                "pfl_tasks/reports/__init__.py", "pfl_tasks/reports/results.py", "pfl_tasks/training.py",  # plumbing
                "flows/train.py", "flows/stage.py", "flows/sweep.py"} & code


def test_a_stage_per_experiment_with_the_params_its_runs_read(tmp_path):
    params = {
        "datasets": {"d": {"source": {"name": "digits"}}},
        "experiments": {"e": {"dataset": "d", "model": {"kind": "linear"}, "algorithms": ["fedavg", "ditto-big"],
                              "algorithm_overrides": {"fedavg": {"weighting": "uniform"}}}},
        "algorithms": {"ditto-big": {"algorithm": "ditto", "mu": 1.0}, "fedprox": {"mu": 0.5}},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(listing_defaults(params)))
    out = stages(str(path))["stages"]
    assert set(out) == {"prepare-d", "train-e", "compare"}  # no tables configured
    train = out["train-e"]
    assert {"experiments.e", "algorithms.ditto-big"} <= set(train["params"])
    # a key added under the experiment later (`dvc exp run -S '+experiments.e....'`) is one DVC watches
    added = "experiments.e.algorithm_overrides.ditto-big.mu"
    assert any(added.startswith(f"{key}.") for key in train["params"])
    assert "algorithms.fedprox" not in train["params"]  # configured, but not run here
    assert "algorithms.fedavg" in train["params"]  # listed with its defaults: `dvc exp run -S` can change them
    # the curves are data, not DVC plots: Vega charts would load their scripts from a CDN
    assert "plots" not in train and {"plots/e": {"cache": False, "persist": True}} in train["outs"]
    assert {"pfl_tasks/algorithms/ditto.py", "pfl_tasks/algorithms/fedavg.py"} <= set(train["deps"])
    # an edit to the MLflow store, the run outputs or the CLI stales no train stage
    assert not {"pfl_tasks/algorithms/fedprox.py", "pfl_tasks/tracking.py", "pfl_tasks/outputs.py",
                "pfl_tasks/reports/text.py", "flows/train.py", "flows/stage.py"} & set(train["deps"])
    assert train["cmd"] == "python -m flows.train e --on-config-change restart"
    assert all(next(iter(o.values()))["persist"] for o in train["outs"])
    # DVC's metrics are the ranking's means alone, so that `dvc exp show --only-changed` fits a terminal
    assert [stage for stage, spec in out.items() if "metrics" in spec] == ["compare"]
    assert out["compare"]["metrics"] == [{"reports/ranking.json": {"cache": False}}]
    assert {f"pfl_tasks/reports/{m}.py" for m in ("__init__", "results", "verdicts", "text", "paper", "figures")} <= set(
        out["compare"]["deps"])
    # prepare depends on config, data and files only
    assert {d for d in out["prepare-d"]["deps"] if d.startswith("pfl_tasks/")} == {
        "pfl_tasks/__init__.py", "pfl_tasks/config.py", "pfl_tasks/errors.py", "pfl_tasks/files.py",
        "pfl_tasks/data/__init__.py", "pfl_tasks/data/partition.py", "pfl_tasks/data/schema.py",
        "pfl_tasks/data/sources.py", "pfl_tasks/data/store.py"}


def test_a_dataset_of_your_own_reruns_its_prepare_stage_when_its_file_changes(tmp_path):
    params = {
        "datasets": {"own": {"source": {"name": "file", "path": "data/own/rows.csv", "task": "classification"},
                             "partition": {"kind": "iid", "n_clients": 4}}},
        "experiments": {"e": {"dataset": "own", "model": {"kind": "linear"}, "algorithms": ["fedavg"]}},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(listing_defaults(params)))
    assert "data/own/rows.csv" in stages(str(path))["stages"]["prepare-own"]["deps"]


def test_a_run_whose_hyper_parameters_are_not_all_listed_is_refused_with_their_defaults(tmp_path):
    """DVC sees only the keys params.yaml holds: a default left to the code could not be changed
    by `dvc exp run -S` (it would ask for `+algorithms...`), and no stage would depend on it."""
    params = {
        "datasets": {"d": {"source": {"name": "digits"}}},
        "experiments": {"e": {"dataset": "d", "model": {"kind": "linear"}, "algorithms": ["local", "fedcr"]}},
        "algorithms": {"local": {}, "fedcr": {"beta": 1e-4, "stochastic": True, "samples": 4}},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError, match=r"add their defaults: fedcr: \{clip_norm: 10.0\}$"):
        stages(str(path))
    path.write_text(yaml.safe_dump(listing_defaults(params)))
    assert yaml.safe_load(path.read_text())["algorithms"]["fedcr"] == {"beta": 1e-4, "stochastic": True, "samples": 4,
                                                                        "clip_norm": 10.0}
    assert "algorithms.fedcr" in stages(str(path))["stages"]["train-e"]["params"]


def test_a_prepare_stage_depends_on_its_datasets_keys_and_its_experiments_seeds_only(tmp_path):
    """Adding an experiment on another dataset stales no prepare stage of the others; new seeds
    of an experiment on the dataset do (one partition per seed)."""
    params = {
        "datasets": {"d": {"source": {"name": "digits"}}, "other": {"source": {"name": "digits"}}},
        "experiments": {"e": {"dataset": "d", "model": {"kind": "linear"}, "algorithms": ["fedavg"], "seeds": [0, 1]},
                        "f": {"dataset": "d", "model": {"kind": "linear"}, "algorithms": ["fedavg"]}},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(listing_defaults(params)))
    before = stages(str(path))["stages"]["prepare-d"]["params"]
    assert before == ["seed", "datasets.d", "experiments.e.dataset", "experiments.f.dataset", "experiments.e.seeds"]
    params["experiments"]["g"] = {"dataset": "other", "model": {"kind": "mlp"}, "algorithms": ["fedavg"]}
    path.write_text(yaml.safe_dump(listing_defaults(params)))
    after = stages(str(path))["stages"]
    assert after["prepare-d"]["params"] == before
    assert after["prepare-other"]["params"] == ["seed", "datasets.other", "experiments.g.dataset"]
