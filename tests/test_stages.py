"""dvc.yaml is generated from params.yaml; each stage's code deps are the files its runs import."""

from pathlib import Path

import yaml

from flows.stages import dvc_yaml, stages
from pfl_tasks.imports import ROOT, run_code


def test_the_committed_dvc_yaml_is_what_params_yaml_gives():
    assert (ROOT / "dvc.yaml").read_text() == dvc_yaml(str(ROOT / "params.yaml")), \
        "dvc.yaml is stale: python -m flows.stages"


def test_a_run_depends_on_its_own_algorithm_and_what_it_imports_not_the_others():
    code = set(map(str, run_code(ROOT / "flows/train.py", ROOT / "pfl_tasks/algorithms/ditto.py")))
    assert {"pfl_tasks/algorithms/ditto.py", "pfl_tasks/algorithms/fedavg.py",  # Ditto's global model is FedAvg's
            "pfl_tasks/engine/executor.py", "flows/train.py"} <= code
    assert not {"pfl_tasks/algorithms/fedprox.py", "pfl_tasks/reports.py", "flows/compare.py",
                "flows/sweep.py"} & code  # another algorithm, the reports, the CLI's sweep path


def test_a_stage_per_experiment_and_algorithm_with_the_params_its_run_reads(tmp_path):
    params = {
        "datasets": {"d": {"source": {"name": "digits"}}},
        "experiments": {"e": {"dataset": "d", "model": {"kind": "linear"}, "algorithms": ["fedavg", "ditto-big"],
                              "algorithm_overrides": {"fedavg": {"weighting": "uniform"}}}},
        "algorithms": {"ditto-big": {"algorithm": "ditto", "mu": 1.0}},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    out = stages(str(path))["stages"]
    assert set(out) == {"prepare-d", "train-e-fedavg", "train-e-ditto-big", "compare"}  # no tables configured
    fedavg, ditto = out["train-e-fedavg"], out["train-e-ditto-big"]
    assert "experiments.e.algorithm_overrides.fedavg" in fedavg["params"]
    assert "algorithms.ditto-big" in ditto["params"] and "experiments.e.algorithm_overrides.fedavg" not in ditto["params"]
    assert not any(p.endswith(".algorithms") for p in fedavg["params"])  # the list: adding a method reruns no other
    assert "pfl_tasks/algorithms/ditto.py" in ditto["deps"] and "pfl_tasks/algorithms/ditto.py" not in fedavg["deps"]
    assert ditto["cmd"].endswith("--algorithms ditto-big --on-config-change restart")
    assert Path(ROOT / "pfl_tasks/reports.py").exists() and "pfl_tasks/reports.py" in out["compare"]["deps"]
