"""One-line runs and grids: `python -m flows.train <experiment> --algorithms ... --seeds ...` in
place, `python -m flows.sweep <experiment> ... --set key=v1,v2` as a sweep: the override parser,
the grid's params, errors before anything starts, and a grid run end to end under one MLflow
parent run."""

import re
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import mlflow_uri, ranked_result, tiny_params
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import SweepConfig, parse_params
from pfl_tasks.errors import ConfigError
from pfl_tasks.grid import parse_assignment, sweep_params


def write_params(root, **changes):
    data = tiny_params()
    data["engine"] = {"orchestrator": "prefect", "device": "cpu", "chunk_size": 4, "round_tasks": "round"}
    data["federation"] = {"rounds": 2, "eval_every": 1, "checkpoint_every": 2}
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    data["algorithms"]["ditto_v0.5"] = {"algorithm": "ditto", "mu": 0.5}  # a run name with a dot
    data["experiments"]["tiny"]["algorithms"] = ["fedavg", "fedprox", "ditto_v0.5"]
    data.update(changes)
    (root / "params.yaml").write_text(yaml.safe_dump(data))
    return str(root / "params.yaml")


def test_assignment_reads_each_value_as_yaml():
    assert parse_assignment("algorithms.ditto.mu=0.01,0.1,1") == ("algorithms.ditto.mu", [0.01, 0.1, 1])
    assert parse_assignment("model.hidden=[16,32],[8]") == ("model.hidden", [[16, 32], [8]])
    assert parse_assignment("local.optimizer.name=adam,sgd") == ("local.optimizer.name", ["adam", "sgd"])
    assert parse_assignment("x.y=1e-3,true") == ("x.y", [0.001, True])
    for bad in ("mu", "=1", "mu="):
        with pytest.raises(ConfigError, match="key=value"):
            parse_assignment(bad)


def test_grid_over_a_hyper_parameter_runs_its_values_side_by_side(tmp_path):
    path = write_params(tmp_path)
    raw = sweep_params(SweepConfig(name="mu", experiment="tiny", grid={"algorithms.fedprox.mu": [0.01, 1],
                                                          "algorithms.ditto_v0.5.mu": [0.1]},
                      params_path=path))
    validate_params(parse_params(raw))
    assert list(raw["experiments"]) == ["tiny-mu"] and raw["tables"] == {}
    assert raw["experiments"]["tiny-mu"]["algorithms"] == ["fedavg", "fedprox_mu0.01", "fedprox_mu1", "ditto_v0.5_mu0.1"]
    assert raw["algorithms"]["fedprox_mu1"] == {"algorithm": "fedprox", "mu": 1}
    assert raw["algorithms"]["ditto_v0.5_mu0.1"] == {"algorithm": "ditto", "mu": 0.1}  # the dotted name's entry, varied


def test_grid_over_another_key_gives_an_experiment_per_value_and_a_table(tmp_path):
    raw = sweep_params(SweepConfig(name="lr", experiment="tiny", algorithms=["fedavg"], grid={"local.optimizer.lr": [0.05, 0.2]},
                      params_path=write_params(tmp_path, local={"steps": 3, "optimizer": {"lr": 0.1}})))
    params = validate_params(parse_params(raw))
    assert list(raw["experiments"]) == ["tiny-lr-lr0.05", "tiny-lr-lr0.2"]
    assert [params.experiment(e).local.optimizer.lr for e in raw["experiments"]] == [0.05, 0.2]
    assert params.experiment("tiny-lr-lr0.2").local.steps == 3  # the rest of the section is kept
    assert raw["tables"] == {"lr": {"experiments": ["tiny-lr-lr0.05", "tiny-lr-lr0.2"]}}


def test_grid_errors_name_the_key(tmp_path):
    path = write_params(tmp_path)
    with pytest.raises(ConfigError, match=r"'algorithms.dito.mu'.*runs \['fedavg', 'fedprox', 'ditto_v0.5'\]"):
        sweep_params(SweepConfig(name="g", experiment="tiny", grid={"algorithms.dito.mu": [1]}, params_path=path))
    with pytest.raises(ConfigError, match=r"'engine.device': a grid varies"):
        sweep_params(SweepConfig(name="g", experiment="tiny", grid={"engine.device": ["cpu"]}, params_path=path))
    with pytest.raises(ConfigError, match=r"experiments.tiny-g-lrfast.local.optimizer.lr"):
        sweep_params(SweepConfig(name="g", experiment="tiny", grid={"local.optimizer.lr": ["fast"]}, params_path=path))
    with pytest.raises(ConfigError, match=r"two points are named 'tiny-g-hidden64'"):
        sweep_params(SweepConfig(name="g", experiment="tiny", grid={"model.hidden": [[64], "64"]}, params_path=path))
    with pytest.raises(ConfigError, match=r"two values .* 'fedprox_mu0.1'"):
        sweep_params(SweepConfig(name="g", experiment="tiny", grid={"algorithms.fedprox.mu": [0.1, 0.1]}, params_path=path))


def test_command_line_errors_come_before_anything_starts(tmp_path, monkeypatch, capsys):
    import flows.sweep
    import flows.train

    started = []
    monkeypatch.setattr(flows.sweep, "run_sweep", lambda sweep, root: started.append((sweep.name, root)))
    path = write_params(tmp_path)
    for args, message in ((["--set", "algorithms.fedprox.muu=1"], "sweep.grid: algorithms.fedprox.muu: Extra inputs"),
                          (["--set", "algorithms.fedprox.mu"], "expected key=value"),
                          (["--set", "algorithms.fedprox.mu=1", "--name", "a/b"], "--name 'a/b'"),
                          (["--seeds", "-1"], "--seeds [-1]: Input should be greater than or equal to 0"),
                          (["--algorithms", "dito"], "unknown algorithm 'dito'")):
        assert flows.sweep.main(["tiny", "--params", path, *args]) == 2
        assert message in capsys.readouterr().err
    assert started == []
    # --root: a sweep writes beside the outputs of its params file
    assert flows.sweep.main(["tiny", "--params", path, "--root", "runs/x", "--set", "algorithms.fedprox.mu=1,2"]) == 0
    assert flows.sweep.main(["tiny", "--params", path, "--algorithms", "fedavg", "--seeds", "7"]) == 0
    assert started == [("mu", "runs/x"), ("runs", ".")]

    monkeypatch.setattr(flows.train, "train_experiment", lambda *a: started.append(a))
    assert flows.train.main(["tiny", "--params", path, "--algorithms", "fedavg", "--seeds", "0"]) == 0
    assert flows.train.main(["tiny", "--params", path, "--root", "runs/x", "--algorithms", "fedavg"]) == 0
    assert started[2:] == [("tiny", path, ".", "refuse", ["fedavg"], [0]),  # configured runs: in place
                           ("tiny", path, "runs/x", "refuse", ["fedavg"], None)]


def test_train_refuses_runs_it_does_not_configure_and_names_the_sweep(tmp_path, capsys):
    import flows.train

    path = write_params(tmp_path)
    for args, message in ((["--seeds", "7"], "does not run seeds [7]"),
                          (["--algorithms", "apfl"], "does not run algorithms ['apfl']"),  # a typo: test_hostile_stages
                          (["--set", "algorithms.fedprox.mu=1,2"], "--set makes a sweep")):
        assert flows.train.main(["tiny", "--params", path, *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "python -m flows.sweep" in err


def test_a_grids_parent_run_holds_the_grid_and_the_choice_on_validation(tmp_path, monkeypatch):
    """The sweep's parent run (its training stubbed): params `grid.<key>`, tag `winner` (the
    best on validation, not on test), tag `selection_metric` and the winner's value of it; the
    training runs it hands its tags get them."""
    import contextlib
    import uuid

    from mlflow.tracking import MlflowClient

    import flows.sweep

    name = f"mu{uuid.uuid4().hex[:6]}"
    sweep = SweepConfig(name=name, experiment="tiny", algorithms=["ditto_v0.5"],
                        grid={"algorithms.ditto_v0.5.mu": [0.1, 1]}, params_path=write_params(tmp_path))
    on_test = ranked_result("ditto_v0.5_mu1", 0.95, val=0.90)
    on_validation = ranked_result("ditto_v0.5_mu0.1", 0.94, val=0.93)
    handed = []

    def trained(child_sweep, root):
        handed.append(child_sweep.tags)
        return {sweep.experiment_name: {"ranking": [on_test, on_validation], "winner_on_validation": on_validation}}

    monkeypatch.setattr(flows.sweep, "sweep_flow", trained)
    monkeypatch.setattr(flows.sweep, "prefect_api", contextlib.nullcontext)
    flows.sweep.run_sweep(sweep)
    client = MlflowClient(mlflow_uri())
    (parent,) = client.search_runs([client.get_experiment_by_name(sweep.experiment_name).experiment_id],
                                   f"tags.sweep = '{name}'")
    assert handed == [{"mlflow.parentRunId": parent.info.run_id, "sweep": name}]
    assert parent.info.status == "FINISHED" and parent.data.params == {"grid.algorithms.ditto_v0.5.mu": "[0.1, 1]"}
    assert parent.data.tags["winner"] == "ditto_v0.5_mu0.1"
    assert parent.data.tags["selection_metric"] == "selected/val/personalized/acc_mean"
    assert parent.data.metrics == {"selected/val/personalized/acc_mean": pytest.approx(0.93)}


def test_a_variants_runs_are_tagged_with_its_algorithm_and_its_run_name():
    from pfl_tasks.tracking import run_tags

    exp = parse_params(tiny_params()).experiment("tiny")
    tags = run_tags(exp, "classification", "p", "ditto_mu1", "ditto", "Li et al., ICML 2021", "d", "h", "s", "f")
    assert tags["algorithm"] == "ditto" and tags["variant"] == "ditto_mu1"


@pytest.mark.slow
def test_a_grid_runs_under_one_mlflow_parent_run_with_one_table(project, prefect_harness, monkeypatch):
    from mlflow.tracking import MlflowClient

    import flows.sweep

    monkeypatch.chdir(project)
    path = write_params(project)
    assert flows.sweep.main(["tiny", "--params", path, "--algorithms", "fedavg", "ditto_v0.5", "--seeds", "0",
                             "--set", "algorithms.ditto_v0.5.mu=0.1,1"]) == 0
    client = MlflowClient(mlflow_uri())
    runs = client.search_runs([client.get_experiment_by_name("tiny-mu").experiment_id], "tags.sweep = 'mu'")
    parents = [r for r in runs if r.info.run_name == "sweep-mu"]
    children = [r for r in runs if r.info.run_name != "sweep-mu"]
    assert len(parents) == 1 and {r.info.status for r in runs} == {"FINISHED"}
    assert sorted(r.data.tags["variant"] for r in children) == ["ditto_v0.5_mu0.1", "ditto_v0.5_mu1", "fedavg"]
    assert sorted(r.data.tags["algorithm"] for r in children) == ["ditto", "ditto", "fedavg"]
    assert sorted(r.data.params.get("algorithm.mu") for r in children if r.data.tags["algorithm"] == "ditto") == [
        "0.1", "1.0"]  # `mu=0.1,1` read 1 as an int: logged as the float it is
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    on_validation = {r.data.tags["variant"]: r.data.metrics["selected/val/personalized/acc_mean"] for r in children}
    assert on_validation[parents[0].data.tags["winner"]] == max(on_validation.values())  # the best on validation
    assert parents[0].data.params == {"grid.algorithms.ditto_v0.5.mu": "[0.1, 1]"}
    report = (project / "sweeps" / "mu" / "reports" / "compare" / "tiny-mu.md").read_text()
    assert all(f"| {name}" in report for name in ("ditto_v0.5_mu0.1", "ditto_v0.5_mu1", "fedavg"))
    assert re.search(rf"\| {re.escape(parents[0].data.tags['winner'])}[≈†]*✓⚑? \|", report)  # the choice, marked


def test_a_sweep_keeps_only_its_runs_own_overrides_and_a_variant_its_runs():
    raw = tiny_params(algorithms=["fedavg", "l2sgd"], run_overrides={"l2sgd": {"federation": {"rounds": 40}}})
    path = Path(tempfile.mkdtemp()) / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    alone = parse_params(sweep_params(SweepConfig(name="s", experiment="tiny", algorithms=["fedavg"],
                                                  params_path=str(path))))
    assert alone.experiments["tiny-s"].run_overrides == {}
    swept = parse_params(sweep_params(SweepConfig(name="p", experiment="tiny", algorithms=["l2sgd"],
                                                  grid={"algorithms.l2sgd.p": [0.2, 0.8]}, params_path=str(path))))
    exp = swept.experiment("tiny-p")
    assert [exp.for_run(r).federation.rounds for r in exp.algorithms] == [40, 40]


def sweep_examples() -> list[list[str]]:
    """The command lines `python -m flows.sweep --help` shows, as argument lists."""
    import shlex

    import flows.sweep

    text = flows.sweep.__doc__.replace("\\\n", " ")
    lines, current = [], None
    for line in text.splitlines():
        if line.strip().startswith("python -m flows.sweep"):
            current = line.strip()
            lines.append(current)
        elif current is not None and line.startswith("                            "):  # a JSON example's next line
            lines[-1] += " " + line.strip()
        else:
            current = None
    return [shlex.split(line.split("  #")[0])[3:] for line in lines]


@pytest.mark.parametrize("argv", sweep_examples(), ids=lambda argv: " ".join(argv)[:60])
def test_each_help_example_of_the_sweep_is_a_valid_sweep_of_params_yaml(argv, monkeypatch):
    """The examples run as written: each is parsed and its grid checked against params.yaml,
    all the sweep does before training."""
    import flows.sweep
    from pfl_tasks.code_deps import ROOT

    monkeypatch.chdir(ROOT)
    started = []
    monkeypatch.setattr(flows.sweep, "stage_main", lambda name, work: started.append(name) or 0)
    assert flows.sweep.main(argv) == 0 and started == ["sweep"]


def test_a_sweeps_methods_are_its_runs_each_over_its_own_variants():
    """`--per-method` groups a variant under the run it varies, never under the module behind
    it: FedAvgM's and FedAdam's variants are theirs, though both entries run FedAvg's module."""
    from pfl_tasks.grid import variant_runs

    grid = {"algorithms.fedavgm.server_lr": [0.1, 0.3], "algorithms.fedadam.server_lr": [0.01],
            "local.optimizer.lr": [0.1, 0.3]}
    assert variant_runs(grid, ["fedavg", "fedavgm", "fedadam"]) == {
        "fedavgm_server_lr0.1": "fedavgm", "fedavgm_server_lr0.3": "fedavgm", "fedadam_server_lr0.01": "fedadam"}
