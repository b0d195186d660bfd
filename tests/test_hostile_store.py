"""Hostile store, round four: the MLflow store process killed, a store broken, dead, locked or
held before a stage starts, tag keys MLflow refuses, a resume whose MLflow calls fail. Each is
one line naming what is wrong and what a rerun does; nothing is lost."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import read_until, tiny_params

REPO = Path(__file__).resolve().parents[1]
RERUN = r"rerun the stage \(finished runs are kept, the others resume from their last checkpoints\)"


def stage_env() -> dict:
    drop = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "DVC_ROOT")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": str(REPO), "CI": "true"}


def tiny_project(root: Path, prepared_digits, **federation) -> Path:
    import shutil

    shutil.copytree(prepared_digits, root / "data" / "partitions" / "digits")
    data = tiny_params(algorithms=["fedavg", "local"])
    data["federation"] = {"rounds": 2, "eval_every": 1, "checkpoint_every": 1, **federation}
    data["tracking"] = {"mlflow_uri": f"sqlite:///{root}/mlflow.db", "retry_seconds": 60}
    (root / "params.yaml").write_text(yaml.safe_dump(data))
    return root / "params.yaml"


def flows_cli(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=root, env=stage_env(), text=True,
                          capture_output=True, timeout=timeout)


def test_the_store_process_killed_mid_run_is_one_line_exit_2_and_the_rerun_resumes(tmp_path, prepared_digits):
    import psutil

    tiny_project(tmp_path, prepared_digits, rounds=20)
    stage = subprocess.Popen([sys.executable, "-m", "flows.train", "tiny"], cwd=tmp_path, env=stage_env(),
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = read_until(stage.stdout, "tiny/fedavg/seed0 round 3:")
    [store] = [p for p in psutil.Process(stage.pid).children() if "pfl_tasks.store_process" in p.cmdline()]
    store.kill()
    lines += stage.stdout.readlines()
    out = "".join(lines)
    assert stage.wait() == 2, out
    assert "Traceback" not in out, out
    assert re.fullmatch(rf"train failed: the MLflow store process ended \(killed by SIGKILL\): {RERUN}\n", lines[-1]), out
    rerun = flows_cli(tmp_path, "flows.train", "tiny")
    assert rerun.returncode == 0, rerun.stderr
    assert "resum" in rerun.stdout + rerun.stderr, rerun.stdout


@pytest.mark.parametrize("broken", ["random bytes", "dead server"])
@pytest.mark.parametrize("entry", ["flows.compare", "flows.tables"])
def test_compare_and_tables_on_a_broken_or_dead_store_say_trains_one_line(tmp_path, prepared_digits, entry, broken):
    params = tiny_project(tmp_path, prepared_digits)
    data = yaml.safe_load(params.read_text())
    if broken == "random bytes":
        (tmp_path / "mlflow.db").write_bytes(os.urandom(4096))
    else:
        data["tracking"]["mlflow_uri"] = "http://127.0.0.1:9"  # nothing listens on the discard port
    data["tables"] = {"paper": {"experiments": ["tiny"], "methods": ["fedavg"]}}
    params.write_text(yaml.safe_dump(data))
    train = flows_cli(tmp_path, "flows.train", "tiny")
    done = flows_cli(tmp_path, entry, *(["tiny"] if entry == "flows.compare" else []))
    assert train.returncode == done.returncode == 2, done.stderr
    [said] = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr
    assert said.split(": ", 1)[1] == train.stderr.strip().splitlines()[-1].split(": ", 1)[1], (said, train.stderr)


def test_a_store_locked_when_the_stage_starts_is_retried_and_announced(tmp_path, prepared_digits):
    """Another process holds the sqlite store's write lock as the stage opens it: the stage says
    it waits, with its bound, and goes on when the lock is let go."""
    tiny_project(tmp_path, prepared_digits)
    assert flows_cli(tmp_path, "flows.train", "tiny").returncode == 0  # the store exists
    (tmp_path / "params.yaml").write_text((tmp_path / "params.yaml").read_text().replace("rounds: 2", "rounds: 3"))
    lock = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None, check_same_thread=False)
    lock.execute("BEGIN EXCLUSIVE")
    stage = subprocess.Popen([sys.executable, "-m", "flows.train", "tiny"], cwd=tmp_path, env=stage_env(),
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, waiting = [], threading.Event()

    def read() -> None:
        for line in stage.stdout:
            lines.append(line)
            if "database is locked" in line:
                waiting.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert waiting.wait(120), "".join(lines)
    finally:
        lock.rollback()
        lock.close()
    reader.join(300)
    assert stage.wait() == 0, "".join(lines)
    [said] = [line for line in lines if "database is locked" in line]
    assert re.fullmatch(r"tracking.mlflow_uri \(sqlite:///.*\): .*database is locked: retrying for up to 60 s\n", said)


def test_a_held_store_lock_file_is_waited_for_with_a_bound_and_said(tmp_path, prepared_digits):
    import fcntl

    tiny_project(tmp_path, prepared_digits)
    data = yaml.safe_load((tmp_path / "params.yaml").read_text())
    data["tracking"]["retry_seconds"] = 3
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    with open(tmp_path / "mlflow.db.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        done = flows_cli(tmp_path, "flows.train", "tiny", timeout=120)
        took = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert took < 60, took
    assert re.fullmatch(r"train failed: tracking.mlflow_uri \(sqlite:///.*\): MLflow store unavailable for 3 s \(open: "
                        r"another process holds .*mlflow.db.lock \(MLflow's first use of the store\)\); nothing ran: "
                        r"rerun when it is free\n", done.stderr.splitlines(keepends=True)[-1]), done.stderr
    assert "another process holds" in done.stderr.splitlines()[0] and "retrying for up to 3 s" in done.stderr


@pytest.mark.parametrize("key, problem", [
    ("a!b", "MLflow's tag keys may only contain alphanumerics, underscores"),
    ("k" * 300, "MLflow takes tag keys of at most 250 characters, not 300"),
    ("a/../b", "MLflow refuses a tag key that would resolve to the path 'b'"),
])
def test_a_tag_key_mlflow_refuses_is_a_config_error_naming_it(key, problem):
    from pfl_tasks.config import parse_params
    from pfl_tasks.errors import ConfigError

    data = tiny_params()
    data["tracking"] = {"tags": {key: "x"}}
    with pytest.raises(ConfigError) as info:
        parse_params(data)
    assert str(info.value).startswith(f"tracking.tags.{key}.[key]: {problem}"), str(info.value)


@pytest.mark.parametrize("key", ["team", "a b:c/d-e_f.g", "a!b", "k" * 250, "k" * 251, "", ".", "a//b", "/a", "ü"])
def test_the_config_takes_exactly_the_tag_keys_mlflow_takes(key):
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_tag

    from pfl_tasks.config import TrackingConfig
    from pfl_tasks.errors import ConfigError

    try:
        _validate_tag(key, "x")
        mlflow_takes = True
    except MlflowException:
        mlflow_takes = False
    try:
        TrackingConfig.model_validate({"tags": {key: "x"}})
        we_take = True
    except (ValueError, ConfigError):
        we_take = False
    assert we_take == mlflow_takes


class RefusingClient:
    """A StoreClient whose store refuses a run's tags (`log_batch` with tags only) and, if asked,
    the `failure` tag that marks how a run ended."""

    refuse_mark = False

    def __init__(self, uri: str):
        from pfl_tasks.store_process import StoreClient

        self.client = StoreClient(uri)

    def __getattr__(self, name: str):
        from pfl_tasks.store_process import StoreCallError

        call = getattr(self.client, name)

        def refusing(*args, **kwargs):
            if name == "log_batch" and kwargs.get("tags") and not kwargs.get("metrics"):
                raise StoreCallError("the store refused the tags", "BAD_REQUEST")
            if name == "set_tag" and args[1] == "failure" and self.refuse_mark:
                raise StoreCallError("the store refused the mark", "BAD_REQUEST")
            return call(*args, **kwargs)

        return refusing


@pytest.mark.parametrize("refused", ["tags", "tags and the failure mark"])
def test_a_resume_whose_mlflow_calls_fail_is_one_line_and_leaves_the_run_marked_or_says_so(
        project, capsys, monkeypatch, refused):
    """The store refuses the resumed run's tags: the stage says so in one line (exit 2, no
    traceback) and marks the run FAILED; when it refuses that mark too, the run is left
    RUNNING with the line that says so, and the next run resumes it."""
    from mlflow.tracking import MlflowClient

    import flows.train
    import pfl_tasks.tracking
    from pfl_tasks.engine.federation import Federation

    uri = f"sqlite:///{project}/mlflow.db"
    data = tiny_params(algorithms=["fedavg"])
    data["tracking"] = {"mlflow_uri": uri, "retry_seconds": 5}
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    argv = ["tiny", "--params", str(project / "params.yaml"), "--root", str(project)]

    def the_run():
        client = MlflowClient(uri)
        [run] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
        return run

    evaluate = Federation.evaluate
    with monkeypatch.context() as patch:
        patch.setattr(Federation, "evaluate", lambda fed, state: evaluate(fed, state) if state.round < 2 else 1 / 0)
        assert flows.train.main(argv) == 1
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setattr(RefusingClient, "refuse_mark", refused == "tags and the failure mark")
        patch.setattr(pfl_tasks.tracking, "StoreClient", RefusingClient)
        assert flows.train.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == ("train failed: the MLflow store refused to tag run (the store refused the tags); "
                                    "the run is checkpointed and resumes when rerun"), err
    left = [line for line in err.splitlines() if "left RUNNING" in line]
    if refused == "tags":
        assert the_run().info.status == "FAILED" and not left, err
    else:
        assert the_run().info.status == "RUNNING" and len(left) == 1, err
        assert left[0].startswith(f"tiny/fedavg/seed0: MLflow run {the_run().info.run_id} left RUNNING, not marked "
                                  "FAILED (the MLflow store refused to tag failure (the store refused the mark)")
    assert flows.train.main(argv) == 0
    assert the_run().info.status == "FINISHED"


def test_mlflow_s_traceback_of_a_locked_store_is_dropped_where_the_call_is_retried():
    """A write that meets a locked sqlite store: MLflow logs the SQLAlchemy error with its
    traceback and SQL (65 lines), then the store process answers it as worth another try and the
    stage retries, saying so in one line. Only that record is dropped; another error's stays."""
    import logging

    from pfl_tasks.store_process import MLFLOW_SQL_LOGGER, RetriedQuietly

    logger = logging.getLogger(MLFLOW_SQL_LOGGER)

    def record(err: Exception) -> logging.LogRecord:
        return logger.makeRecord(MLFLOW_SQL_LOGGER, logging.ERROR, __file__, 1, "SQLAlchemy database error. %s",
                                 (err,), (type(err), err, None))

    locked, other = record(sqlite3.OperationalError("database is locked")), record(sqlite3.OperationalError("no such table"))
    assert logger.filter(locked) and logger.filter(other)  # as MLflow alone logs them
    logger.addFilter(quiet := RetriedQuietly())
    try:
        assert not logger.filter(locked) and logger.filter(other)
    finally:
        logger.removeFilter(quiet)
