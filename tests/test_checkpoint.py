"""Checkpoints: bit-identical resume after a kill, and loud refusal of bad files."""

import argparse
import json

import pytest
import torch

from conftest import tiny_params, tracking
from pfl_tasks.config import parse_params
from pfl_tasks.engine.checkpoint import load_checkpoint, save_checkpoint
from pfl_tasks.engine.rounds import InlineSteps
from pfl_tasks.errors import CheckpointError
from pfl_tasks.runs import RunPaths
from pfl_tasks.training import train_run


class Killed(Exception):
    pass


class KilledAfter(InlineSteps):
    """Dies right after writing the checkpoint of round `at`, like a killed process."""

    def __init__(self, at):
        super().__init__(2)
        self.at = at

    def checkpoint(self, path, round_idx, payload):
        super().checkpoint(path, round_idx, payload)
        if round_idx == self.at:
            raise Killed


def train(root, algorithm="fedprox", steps=None, on_config_change="refuse", **overrides):
    params = parse_params(tiny_params(federation={"rounds": 6, **overrides}))
    return train_run(
        params.experiment("tiny"), algorithm, params.algorithms[algorithm], root,
        steps or InlineSteps(2), on_config_change, tracking(),
    )


@pytest.mark.parametrize("algorithm", ["fedprox", "local"])
def test_resume_after_kill_is_bit_identical(project, tmp_path_factory, algorithm):
    import shutil

    other = tmp_path_factory.mktemp("uninterrupted")
    shutil.copytree(project / "data", other / "data")
    uninterrupted = train(other, algorithm)

    with pytest.raises(Killed):
        train(project, algorithm, steps=KilledAfter(3))
    assert load_checkpoint(RunPaths.of(project, "tiny", algorithm, 0).checkpoint, {})["round"] == 3
    resumed = train(project, algorithm)

    assert resumed == uninterrupted
    paths = [RunPaths.of(root, "tiny", algorithm, 0) for root in (other, project)]
    metrics = [json.loads(p.metrics.read_text()) for p in paths]
    assert [m.pop("mlflow_run")[0] != "" for m in metrics] == [True, True]  # two MLflow runs, one number each
    assert metrics[0] == metrics[1]
    a, b = (load_checkpoint(p.checkpoint, {}) for p in paths)
    flat_a, flat_b = _leaves({"s": a["server"], "c": a["clients"]}), _leaves({"s": b["server"], "c": b["clients"]})
    assert flat_a and len(flat_a) == len(flat_b)
    assert all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


def _leaves(tree):
    return [t for v in tree.values() for t in (_leaves(v) if isinstance(v, dict) else [v])]


def test_checkpoint_of_other_config_is_refused_naming_the_change(project):
    train(project)
    with pytest.raises(CheckpointError, match=r"configuration changed \(experiment.federation.eval_every\)"):
        train(project, eval_every=3)
    assert train(project, eval_every=3, on_config_change="restart")["final/round"] == 6


def test_checkpoint_of_another_platform_is_refused_unless_resumed(project, monkeypatch):
    """The platform (device, torch, the CPU's numerics and threads, GPU, CUDA, TF32) decides the rounding: a checkpoint from
    another is refused by default, resumed (with a warning) only when asked."""
    train(project, rounds=3)
    path = RunPaths.of(project, "tiny", "fedprox", 0).checkpoint
    assert load_checkpoint(path, {})["platform"] == f"device cpu, torch {torch.__version__}, numerics portable, threads 1"
    from pfl_tasks import training

    monkeypatch.setattr(training, "platform", lambda engine, device: {"device": "cuda", "gpu": "Some GPU"})
    with pytest.raises(CheckpointError, match="computed on device cpu, .* this run computes on device cuda, gpu Some GPU"):
        train(project)
    assert train(project, on_config_change="resume")["final/round"] == 6
    assert load_checkpoint(path, {})["platform"] == "device cuda, gpu Some GPU"


def test_longer_run_continues_a_finished_one(project):
    train(project)
    ckpt = RunPaths.of(project, "tiny", "fedprox", 0).checkpoint
    params = parse_params(tiny_params(federation={"rounds": 8}))
    final = train_run(params.experiment("tiny"), "fedprox", {"mu": 0.5}, project, InlineSteps(2),
                      "refuse", tracking())
    assert final["final/round"] == 8 and load_checkpoint(ckpt, {})["round"] == 8


def test_corrupt_checkpoint_is_refused(project):
    path = RunPaths.of(project, "tiny", "fedprox", 0).checkpoint
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        train(project, on_config_change="restart")


def test_foreign_checkpoint_is_refused(project):
    path = RunPaths.of(project, "tiny", "fedprox", 0).checkpoint
    path.parent.mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.zeros(2)}}, path)
    with pytest.raises(CheckpointError, match="foreign"):
        train(project, on_config_change="restart")


def test_checkpoint_of_another_algorithm_is_refused(project):
    train(project, "fedavg")
    src = RunPaths.of(project, "tiny", "fedavg", 0).checkpoint
    dst = RunPaths.of(project, "tiny", "fedprox", 0).checkpoint
    dst.parent.mkdir(parents=True)
    dst.write_bytes(src.read_bytes())
    with pytest.raises(CheckpointError, match="algorithm='fedavg'"):
        train(project, "fedprox", on_config_change="restart")


def test_checkpoint_with_code_objects_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format": "pfl-checkpoint/1", "obj": argparse.Namespace(run=1)}, path)
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(path, {})


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"round": 1})

    def broken_save(obj, fh):
        fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError):
        save_checkpoint(path, {"round": 2})
    assert load_checkpoint(path, {})["round"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
