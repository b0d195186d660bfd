"""Hostile runtimes: a dead Prefect server, a missing GPU, a dangling output link, garbled
inputs, hang-ups, killed writers and deleted locks. Each is one line on stderr and exit 2, and
leaves nothing behind: no store, no lock, no temporary, no run RUNNING, no step logged twice."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import free_port, mlflow_uri, tiny_params, tracking
from flows.stage import stage_main
from flows.train import main
from pfl_tasks.config import parse_params
from pfl_tasks.engine.checkpoint import load_checkpoint, save_checkpoint
from pfl_tasks.engine.rounds import InlineSteps
from pfl_tasks.errors import ComparisonError, OutputLockedError, RunStopped
from pfl_tasks.files import OutputLock
from pfl_tasks.reports.results import configured_runs
from pfl_tasks.runs import RunPaths
from pfl_tasks.training import train_run

REPO = Path(__file__).resolve().parent.parent


def files_under(root: Path) -> set[Path]:
    return {path.relative_to(root) for path in root.rglob("*")}


def write_params(root: Path, **changes) -> str:
    """The tiny params in `root`, its store the default `sqlite:///mlflow.db` there."""
    data = tiny_params()
    for section, values in changes.items():
        data[section].update(values)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def fails_in_one_line(root: Path, capsys, monkeypatch, *names: str, options=(), **changes) -> str:
    """`python -m flows.train tiny [options]` in `root` (the tiny params with `changes`): exit 2,
    one stderr line naming `names`, no new file."""
    params = write_params(root, **changes)
    monkeypatch.chdir(root)
    before = files_under(root)
    assert main(["tiny", "--params", params, *options]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train failed: ") and all(name in err[0] for name in names), err
    assert files_under(root) == before
    return err[0]


def experiment(name: str, **federation):
    """The tiny experiment under its own name (its own MLflow runs in the session's store)."""
    data = tiny_params(federation={"rounds": 6, **federation})
    data["experiments"][name] = data["experiments"].pop("tiny")
    return parse_params(data).experiment(name)


def train(root: Path, exp, steps):
    return train_run(exp, "fedavg", {}, root, steps, "refuse", tracking())


class At(InlineSteps):
    """Inline steps that call `event()` once, as round `round_idx` (counted from 0) starts."""

    def __init__(self, round_idx: int, event):
        super().__init__(2)
        self.round_idx, self.event = round_idx, event

    def round(self, fed, state, round_idx):
        if round_idx == self.round_idx:
            self.event()
        return super().round(fed, state, round_idx)


def mlflow_run(exp_name: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri())
    (run,) = client.search_runs([client.get_experiment_by_name(exp_name).experiment_id])
    return client, run


# ----------------------------------------------------------------------------- one line, nothing created
def test_a_dead_prefect_api_url_is_one_line_and_creates_nothing(project):
    params = write_params(project, engine={"orchestrator": "prefect"})
    url = f"http://127.0.0.1:{free_port()}/api"
    env = {**os.environ, "PREFECT_API_URL": url, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    before = files_under(project)
    done = subprocess.run([sys.executable, "-m", "flows.train", "tiny", "--params", params], cwd=project, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"train failed: PREFECT_API_URL={url} does not answer ([Errno 111] Connection refused): "
        "start that server or unset it"]
    assert files_under(project) == before


def test_cuda_without_a_gpu_names_engine_device(project, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # restart: no checkpoint identity (which names the platform) is computed first
    line = fails_in_one_line(project, capsys, monkeypatch, options=["--on-config-change", "restart"],
                             engine={"device": "cuda"})
    assert line == f"train failed: {project / 'params.yaml'}: engine.device is 'cuda' but torch sees no CUDA device " \
                   "here: set engine.device: cpu (or auto)"


def test_a_dangling_models_link_is_named_before_anything_is_created(project, capsys, monkeypatch):
    (project / "models").symlink_to(project / "elsewhere")
    line = fails_in_one_line(project, capsys, monkeypatch, "models is a link to", "elsewhere")
    assert "remove the link" in line


def test_a_corrupt_partition_fails_before_the_store_and_the_lock(project, capsys, monkeypatch):
    table = next((project / "data/partitions/digits/seed-0").glob("*.parquet"))
    with open(table, "ab") as fh:
        fh.write(b"garbage")
    fails_in_one_line(project, capsys, monkeypatch, table.name, "table_sha256")


@pytest.mark.parametrize("checkpoint", ["garbage", "another configuration"])
def test_a_bad_checkpoint_fails_before_the_store_and_the_lock(project, capsys, monkeypatch, checkpoint):
    path = RunPaths.of(project, "tiny", "local", 0).checkpoint
    path.parent.mkdir(parents=True)
    if checkpoint == "garbage":
        path.write_bytes(b"not a checkpoint")
    else:
        save_checkpoint(path, {"experiment": "tiny", "algorithm": "local", "config_hash": "0" * 16,
                               "config": json.dumps({"experiment": {"model": {"kind": "cnn"}}}), "round": 1})
    fails_in_one_line(project, capsys, monkeypatch, str(Path("models/tiny/local/seed-0/checkpoint.pt")))


@pytest.mark.parametrize("content", ["{garbled", "[1, 2]"])
def test_a_garbled_metrics_file_is_named_by_compare(tmp_path, content):
    path = RunPaths.of(tmp_path, "tiny", "fedavg", 1).metrics
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(ComparisonError, match=rf"^{re.escape(str(path))}: not a metrics file \(.+\): rerun its run's stage or delete it$"):
        configured_runs(parse_params(tiny_params(seeds=[0, 1])), "tiny", tmp_path)


# ----------------------------------------------------------------------------- leftovers
def test_compare_removes_the_temporaries_a_killed_compare_left(tmp_path):
    from test_reports import log_run

    from flows.compare import compare

    name = f"hostile-compare-{os.getpid()}"
    log_run(tmp_path, name, "fedavg", 0, [0.5, 0.7])
    data = tiny_params(algorithms=["fedavg"], seeds=[0])
    data["experiments"] = {name: data["experiments"]["tiny"]}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    stale = [tmp_path / f"reports/figures/.{name}-curves.png.k1ll3d", tmp_path / f"reports/compare/.{name}.md.k1ll3d",
             tmp_path / "reports/.ranking.json.k1ll3d"]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    compare([name], str(tmp_path / "params.yaml"), mlflow_uri(), root=str(tmp_path))
    assert (tmp_path / f"reports/compare/{name}.md").exists()
    assert not [path for path in stale if path.exists()]


@pytest.fixture
def sighup_caught():
    """Without its own handler a SIGHUP would kill pytest: here it fails the test instead."""
    def unhandled(signum, frame):
        raise AssertionError("SIGHUP reached the default handler")

    previous = signal.signal(signal.SIGHUP, unhandled)
    yield
    signal.signal(signal.SIGHUP, previous)


def test_sighup_stops_a_run_checkpointed_and_marked_killed(project, sighup_caught):
    exp = experiment(f"hostile-hup-{os.getpid()}")
    with pytest.raises(RunStopped) as stopped:
        train(project, exp, At(2, lambda: os.kill(os.getpid(), signal.SIGHUP)))
    assert stopped.value.signum == signal.SIGHUP
    assert load_checkpoint(RunPaths.of(project, exp.name, "fedavg", 0).checkpoint, {})["round"] == 3
    assert mlflow_run(exp.name)[1].info.status == "KILLED"


def test_sighup_stops_a_stage_with_exit_129(capsys, sighup_caught):
    assert stage_main("train", lambda: os.kill(os.getpid(), signal.SIGHUP)) == 128 + signal.SIGHUP
    assert capsys.readouterr().err.strip().splitlines() == ["train stopped by SIGHUP"]


def test_a_writer_let_in_by_a_deleted_lock_file_stops_the_first_which_writes_nothing_more(project):
    exp = experiment(f"hostile-lock-{os.getpid()}")
    paths = RunPaths.of(project, exp.name, "fedavg", 0)
    second = OutputLock(paths.lock, "second")

    def rm_locks_and_start_another_writer():
        paths.lock.unlink()
        second.__enter__()

    with pytest.raises(OutputLockedError, match=rf"its lock {re.escape(str(paths.lock))} was deleted .* PID {os.getpid()} took"):
        train(project, exp, At(2, rm_locks_and_start_another_writer))  # round 3
    second.__exit__()
    assert load_checkpoint(paths.checkpoint, {})["round"] == 2  # the first's last, before the loss
    client, run = mlflow_run(exp.name)
    assert run.info.status == "RUNNING"  # the other writer's run now: neither FAILED nor KILLED
    assert train(project, exp, InlineSteps(2))["final/round"] == 6  # the other writer, resuming
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "test/personalized/acc_mean")]
    assert steps == [2, 4, 6]  # each once
    assert mlflow_run(exp.name)[1].info.status == "FINISHED"


def test_a_lock_file_deleted_with_no_other_writer_is_taken_anew(project):
    exp = experiment(f"hostile-relock-{os.getpid()}")
    paths = RunPaths.of(project, exp.name, "fedavg", 0)
    assert train(project, exp, At(2, lambda: paths.lock.unlink()))["final/round"] == 6
    assert paths.lock.read_text().strip() == str(os.getpid())
