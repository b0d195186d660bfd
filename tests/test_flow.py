"""The Prefect round flow end to end on tiny data, and what it leaves in MLflow."""

import time

import pytest
import torch
import yaml

from conftest import assert_same_runs, mlflow_uri, tiny_params, train_tiny

pytestmark = pytest.mark.slow


def test_prefect_flow_runs_rounds_as_tasks_and_logs_to_mlflow(project, prefect_harness):
    from mlflow.tracking import MlflowClient
    from prefect import get_client

    from flows.train import train_experiment

    data = tiny_params(algorithms=["local", "fedavg"])
    data["experiments"]["prefect_e2e"] = {**data["experiments"].pop("tiny"), "seeds": [0, 1]}
    data["engine"] = {"orchestrator": "prefect", "device": "cpu", "chunk_size": 4}
    data["federation"] = {"rounds": 2, "eval_every": 1, "checkpoint_every": 2}
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    (project / "params.yaml").write_text(yaml.safe_dump(data))

    results = train_experiment("prefect_e2e", str(project / "params.yaml"), str(project))
    assert set(results) == {(alg, seed) for alg in ("local", "fedavg") for seed in (0, 1)}
    assert results["fedavg", 0] != results["fedavg", 1]  # the seed reaches training

    names = {f"prefect_e2e-{alg}-seed{seed}" for alg in ("local", "fedavg") for seed in (0, 1)}
    with get_client(sync_client=True) as client:
        flow_runs = {fr.name: fr for fr in client.read_flow_runs()}
        assert names <= set(flow_runs)
        assert all(flow_runs[n].state.is_completed() for n in names)
        tasks = {t.name for t in client.read_task_runs()}
    for name in ("round-1/sample_clients", "round-1/local_update-chunk-0", "round-1/local_update-chunk-1",
                 "round-1/aggregate", "round-1/evaluate", "round-2/checkpoint"):
        assert name in tasks

    mlflow = MlflowClient(mlflow_uri())
    exp = mlflow.get_experiment_by_name("prefect_e2e")
    runs = {r.info.run_name: r for r in mlflow.search_runs([exp.experiment_id])}
    assert set(runs) == {f"{alg}-seed{seed}" for alg in ("local", "fedavg") for seed in (0, 1)}
    fedavg = runs["fedavg-seed0"]
    assert fedavg.info.status == "FINISHED"
    assert fedavg.data.tags["algorithm"] == "fedavg" and fedavg.data.tags["prefect_flow_run_id"]
    assert fedavg.data.tags["seed"] == "0" and runs["fedavg-seed1"].data.tags["seed"] == "1"
    assert fedavg.data.tags["partition"] == "dirichlet(alpha=0.5, min_samples=20, n_clients=6)"
    assert fedavg.data.tags["dataset"] == "digits" and fedavg.data.tags["model"] == "mlp"
    assert fedavg.data.tags["platform.device"] == "cpu" and fedavg.data.tags["platform.torch"] == torch.__version__
    assert fedavg.data.params["experiment.federation.rounds"] == "2"
    metrics = fedavg.data.metrics
    for key in ("final/test/personalized/acc_mean", "final/test/global/acc_worst10",
                "selected/test/personalized/acc_weighted", "selected/val/personalized/acc_mean",
                "final/test/personalized/acc_std", "val/global/loss_mean", "test/personalized/acc_worst10",
                "comm/bytes_up", "compute/grad_samples"):
        assert key in metrics
    assert "test/personalized/acc_std" not in metrics  # the spread per evaluation: in the checkpoint only
    key = "final/test/personalized/acc_mean"
    assert metrics[key] == pytest.approx(results["fedavg", 0][key])
    history = mlflow.get_metric_history(fedavg.info.run_id, "test/personalized/acc_mean")
    assert sorted(m.step for m in history) == [1, 2]
    artifacts = {a.path for a in mlflow.list_artifacts(fedavg.info.run_id)}
    assert {"clients_last.csv", "clients_selected.csv", "learning_curve.png"} <= artifacts
    assert "final/test/global/acc_mean" not in runs["local-seed0"].data.metrics  # no global model


def test_progress_bar_shows_on_a_terminal_only_and_never_under_ci(monkeypatch):
    import io
    import sys

    from pfl_tasks.outputs import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress("run", 10, 0, "round").disable
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress("run", 10, 3, "round")
    assert not bar.disable and bar.n == 3
    bar.close()
    monkeypatch.setenv("CI", "true")
    assert progress("run", 10, 0, "round").disable


def task_names(flow_run: str, expected: set[str]) -> set[str]:
    """The flow run's task-run names once `expected` are recorded and the next flush of the
    server's batches is in (it records task runs from events, after they ran), or after 30 s."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    deadline = time.monotonic() + 30

    def read() -> set[str]:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run])))
        return {t.name for t in runs}

    while not expected <= read() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)
    return read()


def test_one_task_per_round_is_bit_identical_to_a_task_per_step(tmp_path, prepared_digits, prefect_harness,
                                                                 monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "steps").mkdir()
    (tmp_path / "round").mkdir()
    per_step = train_tiny(tmp_path / "steps", prepared_digits, "tiny_steps", round_tasks="steps")
    per_round = train_tiny(tmp_path / "round", prepared_digits, "tiny_round", round_tasks="round")
    assert_same_runs(per_step, per_round)
    per_round_tasks = {"round-1", "round-2", "round-1/evaluate", "round-2/evaluate", "round-2/checkpoint"}
    assert task_names("tiny_round-ditto-seed0", per_round_tasks) == per_round_tasks
    per_step_tasks = {"round-1/sample_clients", "round-1/local_update-chunk-1", "round-1/aggregate"}
    assert per_step_tasks <= task_names("tiny_steps-ditto-seed0", per_step_tasks)


def test_one_task_per_interval_between_evaluations_is_bit_identical_to_a_task_per_round(
        tmp_path, prepared_digits, prefect_harness, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    federation = {"rounds": 5, "eval_every": 2, "checkpoint_every": 4}  # spans end at 2, 4 and 5
    runs = {}
    for mode in ("round", "interval"):
        (tmp_path / mode).mkdir()
        runs[mode] = train_tiny(tmp_path / mode, prepared_digits, f"tiny_{mode}", federation, round_tasks=mode)
    assert_same_runs(runs["round"], runs["interval"])
    spans = {"rounds-1-2", "rounds-3-4", "rounds-5-5"}  # evaluations and checkpoints inside them
    assert task_names("tiny_interval-ditto-seed0", spans) == spans


def test_runs_side_by_side_under_prefect_equal_runs_one_at_a_time(tmp_path, prepared_digits, prefect_harness,
                                                                  monkeypatch, capsys):
    """A round in one chunk leaves a worker idle: the stage trains `engine.max_workers` runs at
    once, each a Prefect flow on a thread of its own, with the stage's Prefect API."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = {}
    for workers in (1, 2):
        (tmp_path / str(workers)).mkdir()
        runs[workers] = train_tiny(tmp_path / str(workers), prepared_digits, f"tiny_workers{workers}",
                                   chunk_size=128, max_workers=workers)
        assert f"{workers} workers: {workers} run(s) at once" in capsys.readouterr().out
    assert_same_runs(runs[1], runs[2])


def test_runs_side_by_side_equal_their_runs_alone_across_the_registry(tmp_path, prepared_digits, monkeypatch):
    """Every algorithm's run computes the same bits beside another run as alone: nothing a run
    computes with is shared between threads (a generator, a cache, a thread count)."""
    import shutil

    from flows.train import train_experiment
    from pfl_tasks.algorithms import ALGORITHMS
    from pfl_tasks.runs import RunPaths

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    names = sorted(ALGORITHMS)
    runs = {}
    for workers in (1, 2):
        root = tmp_path / str(workers)
        shutil.copytree(prepared_digits, root / "data" / "partitions" / "digits")
        data = tiny_params(algorithms=names)
        data["experiments"][f"tiny_registry{workers}"] = data["experiments"].pop("tiny")
        data["federation"] = {"rounds": 2, "eval_every": 1, "checkpoint_every": 2}
        data["engine"] = {"orchestrator": "inline", "device": "cpu", "max_workers": workers}
        data["tracking"] = {"mlflow_uri": mlflow_uri()}
        (root / "params.yaml").write_text(yaml.safe_dump(data))
        finals = train_experiment(f"tiny_registry{workers}", str(root / "params.yaml"), str(root))
        states = {name: torch.load(RunPaths.of(root, f"tiny_registry{workers}", name, 0).checkpoint,
                                   weights_only=True) for name in names}
        runs[workers] = finals, states
    (alone, alone_states), (beside, beside_states) = runs[1], runs[2]
    assert list(alone) == list(beside) == [(name, 0) for name in names]
    for name in names:
        assert alone[name, 0] == beside[name, 0], name
        for part in ("server", "clients"):
            a = torch.utils._pytree.tree_flatten(alone_states[name][part])[0]
            b = torch.utils._pytree.tree_flatten(beside_states[name][part])[0]
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), (name, part)


def mkl_threads() -> int:
    """MKL's thread count for the calling thread (torch's own MKL)."""
    import ctypes
    from pathlib import Path

    return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).mkl_get_max_threads()


def test_runs_side_by_side_compute_with_the_stage_thread_count():
    """A new thread would run MKL on every core, whatever the main thread set: each run's
    thread sets its own count."""
    from flows.train import side_by_side

    seen = {}

    def train_one(key):
        seen[key] = mkl_threads()
        return key.upper()

    assert side_by_side(["a", "b", "c"], train_one, 2, 1) == {"a": "A", "b": "B", "c": "C"}
    assert set(seen.values()) == {1}


def test_a_failed_run_side_by_side_lets_the_run_under_way_finish_and_is_raised():
    import threading

    from flows.train import side_by_side

    beside_started, finished = threading.Event(), []

    def train_one(key):
        if key == "bad":
            beside_started.wait()
            raise ValueError("bad run")
        beside_started.set()
        finished.append(key)
        return key

    with pytest.raises(ValueError, match="bad run"):
        side_by_side(["bad", "beside"], train_one, 2, 1)
    assert finished == ["beside"]
