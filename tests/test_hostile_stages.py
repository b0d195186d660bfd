"""Hostile stages, round three: a params file edited while a stage runs, a stale upstream
checkpoint, MLflow marks that fail, garbled inputs. Each either runs what it records or stops
in one line naming what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import flows.prefect_rounds
import flows.train
from conftest import mlflow_uri, tiny_params
from pfl_tasks.outputs import PINNED_RUN, pinned_run
from pfl_tasks.runs import RunPaths

REPO = Path(__file__).resolve().parents[1]


def configured_lr(root, run_name: str) -> float:
    ckpt = torch.load(RunPaths.of(root, "tiny", run_name, 0).checkpoint, weights_only=True)
    return json.loads(ckpt["config"])["experiment"]["local"]["optimizer"]["lr"]


def test_a_params_edit_during_a_stage_runs_nothing_of_it_and_fails_the_stage(
        project, prefect_harness, monkeypatch, capsys):
    """Every flow run of a stage runs the params the stage read first; an edit meanwhile fails
    the stage at its end (so DVC records nothing) in one line."""
    data = tiny_params(algorithms=["fedavg", "fedprox"])
    data["engine"]["orchestrator"] = "prefect"
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    path = project / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    trained = flows.prefect_rounds.train_run  # what each flow run calls

    def then_edited(*args, **kwargs):
        result = trained(*args, **kwargs)
        path.write_text(yaml.safe_dump({**data, "local": {**data["local"], "optimizer": {"lr": 0.07}}}))
        return result

    monkeypatch.setattr(flows.prefect_rounds, "train_run", then_edited)
    assert flows.train.main(["tiny", "--params", str(path), "--root", str(project)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train")]
    assert err == [f"train failed: {path.resolve()} changed during the stage, which ran on the version it read "
                   "first: rerun it (dvc repro) for the new one"]
    assert configured_lr(project, "fedavg") == configured_lr(project, "fedprox") == 0.1


def test_a_config_the_stage_writes_itself_is_read_as_written_and_an_edit_after_it_still_fails(tmp_path):
    """`snapshot_write` (the tune stage widening its grid): later reads inside the stage return
    the new version and the stage ends cleanly; someone else's edit after it still fails it."""
    from pfl_tasks.config import params_snapshot, snapshot_read, snapshot_write
    from pfl_tasks.errors import ConfigError

    path = tmp_path / "params.yaml"
    path.write_text("a: 1\n")
    with params_snapshot():
        assert snapshot_read(path) == b"a: 1\n"
        snapshot_write(path, "a: 2\n")
        assert snapshot_read(path) == b"a: 2\n"
    with pytest.raises(ConfigError, match="changed during the stage"), params_snapshot():
        snapshot_write(path, "a: 3\n")
        path.write_text("a: 4\n")


def test_learn2pfed_refuses_an_upstream_checkpoint_of_other_params_in_one_line(project, monkeypatch, capsys):
    """The body Learn2pFed takes features from must be the train stage's current run: one
    trained with `hidden: [16]` is refused once the params say [32]."""
    from flows.learn2pfed import main as learn2pfed_main
    from flows.train import train_experiment

    data = tiny_params(algorithms=["fedavg"])
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    data["learn2pfed"] = {"tiny": {"features_from": "fedavg", "cells": 2, "supervision": ["train"],
                                   "meta": {"epochs": 2, "checkpoint_every": 2}}}
    path = project / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    train_experiment("tiny", str(path), str(project))
    data["experiments"]["tiny"]["model"]["hidden"] = [32]
    path.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(project)
    capsys.readouterr()
    assert learn2pfed_main(["tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "learn2pfed failed: models/tiny/fedavg/seed-0/checkpoint.pt: not a finished run of the current params, "
        "data and code of train-tiny (configuration changed (experiment.model.hidden")
    assert err[0].endswith("run `dvc repro train-tiny` first"), err
    assert not (project / "models" / "learn2pfed").exists()


# ----------------------------------------------------------------------------- MLflow marks
def own_store_params(project, **federation) -> tuple[str, str]:
    """The tiny FedAvg params with a store of the project's own: (params path, store URI)."""
    data = tiny_params(algorithms=["fedavg"])
    data["federation"].update(federation)
    uri = f"sqlite:///{project}/mlflow.db"
    data["tracking"] = {"mlflow_uri": uri, "retry_seconds": 5}
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    return str(project / "params.yaml"), uri


def output_runs(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tiny")
    return client, (client.search_runs([exp.experiment_id]) if exp else [])


def test_a_finished_run_whose_mlflow_mark_failed_is_marked_by_the_rerun(project, capsys):
    """Finished means checkpoint, metrics and MLflow mark agree: a kept run that MLflow shows
    FAILED is resumed and marked, its numbers unchanged."""
    from flows.train import train_experiment

    path, uri = own_store_params(project)
    train_experiment("tiny", path, str(project))
    metrics = RunPaths.of(project, "tiny", "fedavg", 0).metrics
    before = metrics.read_bytes()
    client, [run] = output_runs(uri)
    client.set_terminated(run.info.run_id, "FAILED")
    capsys.readouterr()
    train_experiment("tiny", path, str(project))
    assert "1 finished runs are not marked FINISHED" in capsys.readouterr().out
    _, [after] = output_runs(uri)
    assert (after.info.run_id, after.info.status) == (run.info.run_id, "FINISHED")
    assert metrics.read_bytes() == before


def test_a_lost_store_is_rebuilt_from_the_checkpoints(project):
    """A deleted mlflow.db (a new process: this one's MLflow client keeps the deleted file
    open): the rerun logs every kept run anew, history and final numbers, from
    its checkpoint; the metrics file then names the new run and keeps its numbers."""
    from flows.train import train_experiment

    path, uri = own_store_params(project)
    train_experiment("tiny", path, str(project))
    metrics = RunPaths.of(project, "tiny", "fedavg", 0).metrics
    before = json.loads(metrics.read_text())
    client, [run] = output_runs(uri)
    key = "val/personalized/acc_mean"
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
    (project / "mlflow.db").unlink()
    rerun = subprocess.run([sys.executable, "-m", "flows.train", "tiny", "--params", path, "--root", str(project)],
                           cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert rerun.returncode == 0, rerun.stderr
    assert "1 finished runs are not marked FINISHED" in rerun.stdout
    client, [rebuilt] = output_runs(uri.replace("/mlflow.db", "/./mlflow.db"))  # a new client for the new file
    assert rebuilt.info.status == "FINISHED" and rebuilt.info.run_id != run.info.run_id
    assert [(m.step, m.value) for m in client.get_metric_history(rebuilt.info.run_id, key)] == history
    assert rebuilt.data.metrics == run.data.metrics
    after = json.loads(metrics.read_text())
    assert pinned_run(after) == rebuilt.info.run_id
    assert {k: v for k, v in after.items() if k != PINNED_RUN} == {k: v for k, v in before.items() if k != PINNED_RUN}


def test_an_mlflow_error_resuming_a_run_is_raised_not_split_into_a_new_run(project, monkeypatch):
    """Only "no such run" starts a new MLflow run on resume; any other store error fails the
    run, which keeps its one MLflow run."""
    import sqlite3

    from flows.train import train_experiment
    from pfl_tasks.engine.federation import Federation
    from pfl_tasks.errors import TrackingError
    from pfl_tasks.store_process import sqlite_path

    path, uri = own_store_params(project)
    evaluate = Federation.evaluate
    monkeypatch.setattr(Federation, "evaluate", lambda fed, state: evaluate(fed, state) if state.round < 4 else 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train_experiment("tiny", path, str(project))
    monkeypatch.setattr(Federation, "evaluate", evaluate)

    with sqlite3.connect(sqlite_path(uri)) as store:  # a store that refuses to set a run RUNNING again
        store.execute("CREATE TRIGGER refused BEFORE UPDATE OF status ON runs WHEN NEW.status = 'RUNNING' "
                      "BEGIN SELECT RAISE(ABORT, 'the store refused the update'); END")
    with pytest.raises(TrackingError, match="the MLflow store refused to resume run .*refused the update") as raised:
        train_experiment("tiny", path, str(project))
    assert raised.value.__cause__.error_code == "BAD_REQUEST" and not raised.value.__cause__.transient
    _, runs = output_runs(uri)
    assert [r.info.status for r in runs] == ["FAILED"]


# ----------------------------------------------------------------------------- the files a stage reads and writes
@pytest.fixture
def compared(tmp_path, monkeypatch):
    """A project whose store holds one finished FedAvg run of experiment `<name>`: (root, name)."""
    from test_reports import log_run

    name = f"hostile-stages-{os.getpid()}"
    log_run(tmp_path, name, "fedavg", 0, [0.5, 0.7])
    data = tiny_params(algorithms=["fedavg"], seeds=[0])
    data["experiments"] = {name: data["experiments"]["tiny"]}
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    return tmp_path, name


@pytest.mark.parametrize("content, problem", [
    ("<<<<<<< HEAD\n{}\n=======\n{}\n>>>>>>> theirs\n", "Expecting value: line 1 column 1"),
    ("[1, 2]", "not a JSON object of experiments"),
    ('{"mnist": 3}', "not a JSON object of experiments"),
])
def test_a_garbled_ranking_file_is_one_line_naming_it_and_nothing_is_written(compared, capsys, content, problem):
    from flows.compare import main as compare_main

    root, name = compared
    ranking = root / "reports" / "ranking.json"
    ranking.parent.mkdir()
    ranking.write_text(content)
    assert compare_main([name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"compare failed: reports/ranking.json: unreadable ({problem}"
                   f"{'' if problem.startswith('not') else ' (char 0)'}): delete it, or run `python -m flows.compare` "
                   "without names to write it anew"]
    assert ranking.read_text() == content and not (root / "reports" / "compare").exists()


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_no_temporary(compared, capsys, monkeypatch):
    import errno

    import pfl_tasks.files
    from flows.compare import main as compare_main

    fdopen = os.fdopen

    class Full:
        def __init__(self, fd, mode):
            self.fh = fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pfl_tasks.files.os, "fdopen", Full)  # every atomic write
    root, name = compared
    assert compare_main([name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compare failed: No space left on device: reports/"), err
    assert err[0].endswith(": make room and rerun the stage (finished runs are kept, the others resume from their "
                           "last checkpoints)")
    assert not [p for p in root.rglob(".*") if p.is_file()]


# ----------------------------------------------------------------------------- structure
def test_a_federation_the_data_cannot_hold_is_one_line_naming_the_file_before_any_store(project, capsys, monkeypatch):
    from test_hostile_runtime import fails_in_one_line

    line = fails_in_one_line(project, capsys, monkeypatch, "params.yaml: experiments.tiny.federation.clients_per_round: "
                             "7 exceeds the 6 clients of dataset 'digits'", federation={"clients_per_round": 7})
    assert not (project / "mlflow.db").exists(), line


@pytest.mark.parametrize("algorithm", sorted(__import__("pfl_tasks.algorithms", fromlist=["ALGORITHMS"]).ALGORITHMS))
def test_every_algorithms_state_keeps_its_structure_so_restore_accepts_its_own_checkpoints(digits6, algorithm):
    from conftest import run_rounds, tiny_federation
    from pfl_tasks.engine.federation import tree_mismatch

    fed = tiny_federation(digits6, algorithm, hp={"feddyn": {"alpha": 0.1}}.get(algorithm))
    initial = fed.initial_state()
    state = run_rounds(fed, initial, 0, 3)
    assert tree_mismatch(initial.server, state.server, "server") is None
    assert tree_mismatch(initial.clients, state.clients, "clients") is None
    fed.restore(3, state.server, state.clients)


@pytest.mark.parametrize("edit, problem", [
    (lambda ckpt: ckpt["server"].clear(), "server holds [], expected ['global']"),
    (lambda ckpt: ckpt["server"]["global"].update(
        {k: v[:-1] for k, v in ckpt["server"]["global"].items() if k.endswith("bias")}),
     "server.global.1.bias is torch.float32 [15], expected torch.float32 [16]"),
])
def test_a_well_formed_checkpoint_of_another_shape_is_one_line(project, capsys, monkeypatch, edit, problem):
    """A checkpoint of this run's identity whose state was edited (sliced, emptied): resume
    says which entry in one line, before any round."""
    from flows.train import main as train_main
    from pfl_tasks.engine.checkpoint import load_checkpoint, save_checkpoint

    data = tiny_params(algorithms=["fedavg"])
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    data["federation"]["rounds"] = 2
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(project)
    assert train_main(["tiny"]) == 0
    path = RunPaths.of(Path("."), "tiny", "fedavg", 0).checkpoint
    ckpt = load_checkpoint(path, {})
    edit(ckpt)
    save_checkpoint(path, {k: v for k, v in ckpt.items() if k != "format"})
    data["federation"]["rounds"] = 4
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert train_main(["tiny"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("20")]  # MLflow's INFO
    assert err == [f"train failed: {path}: not this run's state: {problem}"]


def test_a_well_formed_learn2pfed_checkpoint_of_another_shape_is_one_line(project, prefect_harness, capsys,
                                                                            monkeypatch):
    from flows.learn2pfed import main as learn2pfed_main
    from flows.train import train_experiment
    from pfl_tasks.engine.checkpoint import load_checkpoint, save_checkpoint

    data = tiny_params(algorithms=["fedavg"])
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    data["learn2pfed"] = {"tiny": {"features_from": "fedavg", "cells": 2, "supervision": ["train"],
                                   "meta": {"epochs": 2, "checkpoint_every": 2}}}
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    train_experiment("tiny", str(project / "params.yaml"), str(project))
    monkeypatch.chdir(project)
    assert learn2pfed_main(["tiny"]) == 0
    path = RunPaths.of(Path("."), "learn2pfed/tiny", "learn2pfed-train", 0).checkpoint
    ckpt = load_checkpoint(path, {})
    ckpt["cells"] = {k: v[..., :-1] for k, v in ckpt["cells"].items()}
    save_checkpoint(path, {k: v for k, v in ckpt.items() if k != "format"})
    data["learn2pfed"]["tiny"]["meta"]["epochs"] = 4
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert learn2pfed_main(["tiny"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("learn2pfed")]
    assert len(err) == 1 and err[0].startswith(f"learn2pfed failed: {path}: not this run's state (RuntimeError: "), err


# ----------------------------------------------------------------------------- lines that say what is wrong
def test_a_misspelled_run_or_experiment_is_named_as_such(project, capsys, monkeypatch):
    """Not "that is a sweep" nor "run dvc repro first": a name nothing knows is a typo."""
    from flows.compare import main as compare_main
    from flows.sweep import main as sweep_main
    from flows.train import main as train_main

    data = tiny_params(algorithms=["fedavg", "ditto"])
    data["algorithms"]["ditto"] = {"mu": 0.1}
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(project)
    assert train_main(["tiny", "--algorithms", "dito"]) == 2
    assert capsys.readouterr().err.strip() == ("train failed: --algorithms: 'dito' is no algorithm and no entry under "
                                               "`algorithms` in params.yaml (did you mean 'ditto'?)")
    assert sweep_main(["tiny", "--set", "algorithms.ditto.mew=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sweep failed: sweep.grid: algorithms.ditto.mew: Extra inputs are not permitted"), err
    assert compare_main(["nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("compare failed: no experiment(s) ['nosuch'] in ") and err.endswith(
        ", and params.yaml configures none of that name (it has ['tiny'])"), err


def test_a_finished_run_whose_checkpoint_was_deleted_is_retrained_into_its_mlflow_run(project, capsys):
    """`rm -rf models`: the rerun retrains (bit-identically) into the MLflow run the metrics
    file names, logging nothing twice, instead of adding a second FINISHED run."""
    import shutil

    from flows.train import train_experiment

    path, uri = own_store_params(project)
    train_experiment("tiny", path, str(project))
    metrics = RunPaths.of(project, "tiny", "fedavg", 0).metrics
    before = metrics.read_bytes()
    client, [run] = output_runs(uri)
    key = "val/personalized/acc_mean"
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
    shutil.rmtree(project / "models")
    capsys.readouterr()
    train_experiment("tiny", path, str(project))
    assert f"retraining into MLflow run {run.info.run_id}" in capsys.readouterr().out
    client, [after] = output_runs(uri)
    assert (after.info.run_id, after.info.status) == (run.info.run_id, "FINISHED")
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] == history
    assert metrics.read_bytes() == before and RunPaths.of(project, "tiny", "fedavg", 0).checkpoint.exists()
