"""Hostile stages, round three: a params file edited while a stage runs, a stale upstream
checkpoint, MLflow marks that fail, garbled inputs. Each either runs what it records or stops
in one line naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

import flows.train
from conftest import mlflow_uri, tiny_params
from pfl_tasks.runs import RunPaths


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
    trained = flows.train.train_run

    def then_edited(*args, **kwargs):
        result = trained(*args, **kwargs)
        path.write_text(yaml.safe_dump({**data, "local": {**data["local"], "optimizer": {"lr": 0.07}}}))
        return result

    monkeypatch.setattr(flows.train, "train_run", then_edited)
    assert flows.train.main(["tiny", "--params", str(path), "--root", str(project)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train")]
    assert err == [f"train failed: {path.resolve()} changed during the stage, which ran on the version it read "
                   "first: rerun it (dvc repro) for the new one"]
    assert configured_lr(project, "fedavg") == configured_lr(project, "fedprox") == 0.1


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
