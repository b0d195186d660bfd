"""The Learn2pFed stage end to end: features from an upstream checkpoint, resume, and tables."""

import json

import pytest
import yaml

from conftest import mlflow_uri, tiny_params

pytestmark = pytest.mark.slow


def write_params(project, epochs):
    data = tiny_params(algorithms=["local", "fedavg"])
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    data["learn2pfed"] = {"tiny": {"features_from": "fedavg", "cells": 3, "supervision": ["val"],
                                   "meta": {"epochs": epochs, "checkpoint_every": 4}}}
    data["tables"] = {"tiny": {"experiments": ["tiny"], "methods": ["learn2pfed-val", "fedavg", "local"]}}
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    return str(project / "params.yaml")


def test_learn2pfed_head_on_upstream_body_resumes_and_lands_in_the_table(project, prefect_harness):
    import torch

    from flows.learn2pfed import learn2pfed_flow, run_experiment
    from flows.tables import write_tables
    from flows.train import train_experiment
    from pfl_tasks.errors import CheckpointError

    path = write_params(project, epochs=8)
    with pytest.raises(CheckpointError, match=r"dvc repro train-tiny` first"):  # no upstream checkpoint yet; the stage that exists
        run_experiment("tiny", path, str(project))
    train_experiment("tiny", path, str(project))

    first = run_experiment("tiny", path, str(project))[("val", 0)]
    ckpt = project / "models/learn2pfed/tiny/learn2pfed-val/seed-0/checkpoint.pt"
    assert torch.load(ckpt, weights_only=True)["round"] == 8
    per_cell = 6 * 10 * 17 * 8  # clients x classes x (16 + bias) float64s
    assert first["final/comm/bytes_down"] == (2 * 8 + 1) * 3 * per_cell  # 8 meta steps there and back, 1 evaluation, 3 cells
    assert first["meta/loss_last"] != first["meta/fit_loss_last"]  # validation and training rows differ

    path = write_params(project, epochs=12)  # a longer meta-training continues from epoch 8
    resumed = learn2pfed_flow("tiny", "val", 0, path, str(project))
    straight = project / "straight"
    straight.mkdir()
    for sub in ("data", "models/tiny", "metrics/tiny"):
        (straight / sub).parent.mkdir(parents=True, exist_ok=True)
        (straight / sub).symlink_to(project / sub)
    fresh = learn2pfed_flow("tiny", "val", 0, path, str(straight))
    assert resumed == fresh  # resume is exact: same losses, same metrics
    # the untrained Theta's test score, beside the selected one: the same after 8 meta-epochs as after 12
    assert resumed["initial/test/personalized/acc_mean"] == first["initial/test/personalized/acc_mean"]

    write_tables(path, str(project))
    table = (project / "reports/markdown/tiny.md").read_text()
    rows = [line.split(" | ")[0].strip("| ") for line in table.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["learn2pfed-val", "fedavg", "local"]
    cells = {p.stem: json.loads(p.read_text()) for p in (project / "reports/tables/tiny").glob("*.json")}
    assert sorted(cells) == ["fedavg", "learn2pfed-val", "local"] and cells["fedavg"]["tiny"]["seeds"] == 1
    # the table's number is the Theta selected on validation (the held-out half of its rows)
    assert cells["learn2pfed-val"]["tiny"]["mean"] == pytest.approx(resumed["selected/test/personalized/acc_mean"])
    assert 0 <= resumed["selected/round"] <= 12 and resumed["final/round"] == 12
    assert "final/test/global/acc_mean" not in resumed  # the cells' w(L) is no model the method gives
    from mlflow.tracking import MlflowClient

    from pfl_tasks.algorithms.learn2pfed_meta import HELD_OUT_HALF
    from pfl_tasks.config import load_params
    from pfl_tasks.tracking import tracking_uri

    store = MlflowClient(tracking_uri(load_params(path).tracking.mlflow_uri))
    run = store.get_run(json.loads((project / "metrics/learn2pfed/tiny/learn2pfed-val/seed-0.json").read_text())
                        ["mlflow_run"][0])
    assert run.data.tags["validation_rows"] == HELD_OUT_HALF  # the reports keep it out of ✓
    assert run.data.tags["engine.torch_threads"] == str(torch.get_num_threads())
    # what Theta became, per client and parameter group, beside its initial value: a table and its figure
    from pfl_tasks.reports.figures import PARTICIPATION_CSV
    from pfl_tasks.reports.results import run_table

    assert {"participation.png", PARTICIPATION_CSV} <= {a.path for a in store.list_artifacts(run.info.run_id)}
    participation = run_table(store, run.info.run_id, PARTICIPATION_CSV)
    assert set(participation.group) == {"weights", "bias"}
    assert (participation.lam_learned != participation.lam_initial).any()
    # its validation curve in MLflow runs to the last Theta (meta-epoch 12): the reports judge its plateau on it
    from pfl_tasks.config import VerdictConfig
    from pfl_tasks.reports.results import plateaued

    curve = store.get_metric_history(run.info.run_id, "val/personalized/acc_mean")
    assert {m.step for m in curve} == set(range(13))
    assert plateaued(store, run.info.run_id, "acc", VerdictConfig()) is not None
    # the tables stage's MLflow run records the rules its verdicts were judged by
    tables_run = store.search_runs([store.get_experiment_by_name("tables").experiment_id],  # the newest: the store is the session's
                                   order_by=["attributes.start_time DESC"], max_results=1)[0]
    assert tables_run.data.params["verdicts.alpha"] == "0.05"
    assert tables_run.data.params["verdicts.plateau.window"] == "0.2"
