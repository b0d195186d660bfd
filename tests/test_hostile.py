"""Hostile and careless inputs: each gets a clear error naming what is wrong, and leaves nothing
half-written, locked or RUNNING behind. (Signals and kills of a whole stage: test_stage.py.)"""

from __future__ import annotations

import json
import os
import stat

import pandas as pd
import pytest
import torch
import yaml

from conftest import mlflow_uri, tiny_params, tracking
from flows.train import main
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import load_params, parse_params
from pfl_tasks.data import load_partition
from pfl_tasks.data.store import MANIFEST, TABLE, _sha256, sealed
from pfl_tasks.engine.checkpoint import load_checkpoint
from pfl_tasks.engine.rounds import InlineSteps
from pfl_tasks.errors import ConfigError, DataValidationError, OutputLockedError, TrackingError
from pfl_tasks.files import UMASK, OutputLock, atomic_write_text
from pfl_tasks.runs import RunPaths
from pfl_tasks.tracking import MlflowRun, retrying
from pfl_tasks.training import train_run


def config_error(data) -> str:
    with pytest.raises(ConfigError) as info:
        validate_params(parse_params(data))
    return str(info.value)


def write_params(root, data) -> str:
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def train(root, algorithm="fedavg", steps=None, tracking_options=None, **federation):
    params = parse_params(tiny_params(federation={"rounds": 6, **federation}))
    return train_run(params.experiment("tiny"), algorithm, params.algorithms[algorithm], root,
                     steps or InlineSteps(2), "refuse", tracking(**(tracking_options or {})))


def mlflow_runs(experiment="tiny", algorithm="fedavg"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri())
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id], f"tags.algorithm = '{algorithm}'") if exp else []


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("path, value, names", [
    (("federation", "rounds"), True, "federation.rounds"),
    (("local", "optimizer", "lr"), float("inf"), "local.optimizer.lr"),
    (("algorithms", "fedprox", "mu"), float("nan"), "algorithms.fedprox.mu"),
    (("algorithms", "fedprox", "mu"), True, "algorithms.fedprox.mu"),
    (("seed",), -1, "seed"),
    (("experiments", "tiny", "seeds"), [0, 0], "experiments.tiny.seeds"),
    (("experiments", "tiny", "seeds"), [3, -2], "experiments.tiny.seeds"),
    (("experiments", "tiny", "model", "hidden"), [], "experiments.tiny.model.hidden"),
])
def test_ill_formed_values_are_errors_naming_the_key(path, value, names):
    data = tiny_params()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert names in config_error(data)


@pytest.mark.parametrize("section", ["experiments", "datasets", "algorithms"])
def test_names_that_escape_the_repository_are_refused(section):
    data = tiny_params()
    data[section]["../../escape"] = data[section].pop({"experiments": "tiny", "datasets": "digits",
                                                       "algorithms": "fedavg"}[section])
    msg = config_error(data)
    assert f"{section}.../../escape" in msg and "pattern" in msg


def test_duplicate_yaml_keys_are_refused_with_their_lines(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tiny_params(), sort_keys=False).replace(
        "federation:\n", "federation:\n  rounds: 9\n", 1))
    with pytest.raises(ConfigError, match=r"key 'rounds' appears twice in one mapping, at lines \d+ and \d+"):
        load_params(path)


def test_yaml_merges_may_override_and_exponents_are_floats(tmp_path):
    data = tiny_params()
    del data["experiments"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data).replace("lr: 0.1", "lr: 1e-3") + (
        "experiments:\n"
        "  tiny: &tiny {dataset: digits, model: {kind: mlp, hidden: [16]}}\n"
        "  tiny2: {<<: *tiny, dataset: digits, seeds: [1]}\n"))
    params = load_params(tmp_path / "params.yaml")
    assert params.local.optimizer.lr == 1e-3 and params.experiments["tiny2"].seeds == [1]


def test_clients_per_round_above_the_client_count_is_an_error_before_mlflow(project):
    data = tiny_params(federation={"clients_per_round": 7})
    data["experiments"]["cpr"] = data["experiments"].pop("tiny")
    params = parse_params(data)
    with pytest.raises(ConfigError, match=r"experiments.cpr.federation.clients_per_round: 7 exceeds the 6 clients"):
        train_run(params.experiment("cpr"), "fedavg", {}, project, InlineSteps(2), "refuse", tracking())
    assert not mlflow_runs("cpr")[1] and not (project / "models").exists()


def test_cli_prints_one_line_and_exits_2(project, capsys, monkeypatch):
    data = tiny_params()
    data["experiments"]["tiny"]["seeds"] = [0, 0]
    monkeypatch.chdir(project)
    assert main(["tiny", "--params", write_params(project, data)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("train failed: ") and "experiments.tiny.seeds" in "\n".join(err)
    assert "Traceback" not in "\n".join(err)


# ----------------------------------------------------------------------------- partitions
@pytest.fixture
def partition(tmp_path, prepared_digits):
    import shutil

    shutil.copytree(prepared_digits / "seed-0", tmp_path / "digits")
    return tmp_path / "digits"


def rewrite(directory, table=None, **fields):
    """What a careless hand edit does: new table and/or manifest fields, hashes updated to match."""
    manifest = json.loads((directory / MANIFEST).read_text())
    if table is not None:
        table.to_parquet(directory / TABLE, index=False)
        manifest["table_sha256"] = _sha256(directory / TABLE)
    manifest.update(fields)
    (directory / MANIFEST).write_text(json.dumps(sealed(manifest)))


def test_shuffled_rows_load_grouped_by_client(partition):
    before = load_partition(partition)
    rewrite(partition, pd.read_parquet(partition / TABLE).sample(frac=1.0, random_state=0))
    after = load_partition(partition)
    for split in ("train", "test"):
        for field in ("x", "y", "offsets", "counts"):
            assert torch.equal(getattr(getattr(before, split), field), getattr(getattr(after, split), field))


def test_edited_manifest_field_breaks_its_seal(partition):
    manifest = json.loads((partition / MANIFEST).read_text())
    (partition / MANIFEST).write_text(json.dumps({**manifest, "n_classes": 20}))
    with pytest.raises(DataValidationError, match="manifest.json: fields edited after it was written"):
        load_partition(partition)


@pytest.mark.parametrize("fields, names", [
    ({"n_classes": 20}, r"clients\[0\].labels: expected 20 class counts"),
    ({"feature_shape": [1, 8, 9]}, r"feature_shape \[1, 8, 9\] needs 72 feature columns"),
    ({"task": "ranking"}, r"invalid manifest: task:"),
    ({"n_clients": 7}, r"client_id 0..6"),
])
def test_resealed_but_inconsistent_manifest_is_refused_naming_the_field(partition, fields, names):
    rewrite(partition, **fields)
    with pytest.raises(DataValidationError, match=names):
        load_partition(partition)


def test_manifest_without_a_field_is_refused_naming_it(partition):
    manifest = json.loads((partition / MANIFEST).read_text())
    del manifest["task"]
    (partition / MANIFEST).write_text(json.dumps(sealed(manifest)))
    with pytest.raises(DataValidationError, match=r"invalid manifest: task: Field required"):
        load_partition(partition)


def test_rows_moved_between_clients_are_refused(partition):
    table = pd.read_parquet(partition / TABLE)
    table.loc[table.index[0], "client_id"] = 1  # client 0's first row now claims client 1
    rewrite(partition, table)
    with pytest.raises(DataValidationError, match=r"clients\[0\].(train|test) = \d+, but the table holds"):
        load_partition(partition)


# ----------------------------------------------------------------------------- files and locks
def test_failed_write_leaves_no_temporary_and_outputs_get_the_umask(tmp_path):
    target = tmp_path / "out" / "seed-0.json"
    from pfl_tasks.files import atomic_write

    atomic_write_text(target, "{}")
    with pytest.raises(ZeroDivisionError):
        atomic_write(target, lambda fh: 1 / 0)
    assert sorted(p.name for p in target.parent.iterdir()) == ["seed-0.json"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~UMASK


def test_partition_folder_gets_the_umask(prepared_digits):
    assert stat.S_IMODE((prepared_digits / "seed-0").stat().st_mode) == 0o777 & ~UMASK
    assert stat.S_IMODE((prepared_digits / "seed-0" / TABLE).stat().st_mode) == 0o666 & ~UMASK


def test_a_run_sweeps_the_temporaries_a_killed_writer_left(project):
    paths = RunPaths.of(project, "tiny", "fedavg", 0)
    leftovers = [p.parent / f".{p.name}.k1ll3d" for p in (paths.checkpoint, paths.metrics, paths.curve)]
    for path in leftovers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("half")
    train(project)
    assert not any(p.exists() for p in leftovers)
    assert stat.S_IMODE(paths.checkpoint.stat().st_mode) == 0o666 & ~UMASK


def test_a_second_writer_is_refused_naming_the_holder(project):
    paths = RunPaths.of(project, "tiny", "fedavg", 0)
    with OutputLock(paths.lock, "holder"):
        with pytest.raises(OutputLockedError, match=rf"tiny/fedavg/seed0 is being written by another process \(PID {os.getpid()}"):
            train(project)
    assert not paths.checkpoint.exists()


def test_the_lock_of_a_killed_writer_is_taken_over(project):
    import subprocess
    import sys

    paths = RunPaths.of(project, "tiny", "fedavg", 0)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pfl_tasks.files import OutputLock\n"
         "with OutputLock(sys.argv[1], 'x'):\n print('held', flush=True); time.sleep(600)", str(paths.lock)],
        stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(OutputLockedError, match=f"PID {holder.pid}"):
        train(project)
    holder.kill()
    holder.wait()
    assert train(project)["final/round"] == 6


# ----------------------------------------------------------------------------- MLflow
def test_transient_store_errors_are_retried_with_backoff(monkeypatch):
    from mlflow.exceptions import MlflowException

    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    waits, calls = [], iter([MlflowException("database is locked", TEMPORARILY_UNAVAILABLE)] * 3 + ["ok"])

    def call():
        value = next(calls)
        if isinstance(value, Exception):
            raise value
        return value

    monkeypatch.setattr("time.sleep", waits.append)
    assert retrying(call, "log", bound=60) == "ok"
    assert waits == [0.5, 1.0, 2.0]


def test_a_server_briefly_down_is_retried(monkeypatch):
    """MLflow's REST client raises a plain MlflowException while handling the connection error."""
    import requests
    from mlflow.exceptions import MlflowException

    attempts = []

    def call():
        attempts.append(1)
        if len(attempts) < 3:
            try:
                raise requests.exceptions.ConnectionError("Connection refused")
            except requests.exceptions.ConnectionError as err:
                raise MlflowException(f"API request failed with exception {err}")  # noqa: B904
        return "ok"

    monkeypatch.setattr("time.sleep", lambda s: None)
    assert retrying(call, "log", bound=60) == "ok" and len(attempts) == 3
    with pytest.raises(PermissionError):  # not transient: at once
        retrying(lambda: (_ for _ in ()).throw(PermissionError("read-only artifact root")), "log", 60)


def test_store_unavailable_past_the_bound_is_a_tracking_error(monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    monkeypatch.setattr("time.sleep", lambda s: None)
    with pytest.raises(TrackingError, match="MLflow store unavailable for 0.1 s"):
        retrying(lambda: (_ for _ in ()).throw(MlflowException("locked", TEMPORARILY_UNAVAILABLE)), "log", 0.1)
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    with pytest.raises(MlflowException, match="bad param"):  # not transient: at once
        retrying(lambda: (_ for _ in ()).throw(MlflowException("bad param", INVALID_PARAMETER_VALUE)), "log", 60)


def test_sqlite_store_locked_past_the_bound_fails_the_run_checkpointed_and_a_rerun_resumes(project, tmp_path_factory):
    import shutil
    import sqlite3

    store = tmp_path_factory.mktemp("locked-store") / "mlflow.db"
    patient = {"mlflow_uri": f"sqlite:///{store}"}  # the default bound: a busy machine's slow write is no outage
    bounded = {**patient, "retry_seconds": 1.0}
    other = tmp_path_factory.mktemp("unlocked")
    shutil.copytree(project / "data", other / "data")
    uninterrupted = train(other, tracking_options=patient)
    holder = {}

    class LockStoreAfter(InlineSteps):
        def checkpoint(self, path, round_idx, payload):
            super().checkpoint(path, round_idx, payload)
            if round_idx == 4:  # another process takes the whole database
                holder["con"] = sqlite3.connect(store, isolation_level=None)
                holder["con"].execute("BEGIN EXCLUSIVE")

    with pytest.raises(TrackingError, match="MLflow store unavailable"):
        train(project, steps=LockStoreAfter(2), tracking_options=bounded)
    holder["con"].rollback()
    holder["con"].close()
    paths = RunPaths.of(project, "tiny", "fedavg", 0)
    # round 4's records go out while round 5 trains: their failure surfaces at round 5's log,
    # after its checkpoint, and the failed run checkpoints there
    assert load_checkpoint(paths.checkpoint, {})["round"] == 5
    assert train(project, tracking_options=patient) == uninterrupted
    client, runs = _runs_at(store, "tiny", "fedavg")
    resumed = [r for r in runs if r.data.tags.get("pid") and r.info.status == "FINISHED"]
    history = client.get_metric_history(runs[0].info.run_id, "test/personalized/acc_mean")
    assert len(runs) == 2 and len(resumed) == 2  # the uninterrupted run, and the locked one resumed
    assert sorted(m.step for m in history) == [2, 4, 6]  # nothing lost, nothing twice


def _runs_at(store, experiment, algorithm):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id], f"tags.algorithm = '{algorithm}'", order_by=["start_time DESC"])


@pytest.mark.parametrize("uri, names", [
    ("http://127.0.0.1:9", "no MLflow server answers"),
    ("sqlite:////nonexistent-dir/mlflow.db", "directory /nonexistent-dir does not exist"),
    ("sqlite:////proc/mlflow.db", "cannot write /proc/mlflow.db"),
])
def test_unusable_tracking_uri_fails_fast_before_training(project, capsys, monkeypatch, uri, names):
    import time

    data = tiny_params()
    data["tracking"] = {"mlflow_uri": uri}
    monkeypatch.chdir(project)
    start = time.monotonic()
    assert main(["tiny", "--params", write_params(project, data)]) == 2
    assert time.monotonic() - start < 15
    err = capsys.readouterr().err
    assert f"tracking.mlflow_uri ({uri}): {names}" in err
    assert not (project / "models").exists() and not os.path.exists("/nonexistent-dir")


def test_concurrent_first_use_of_a_fresh_store_does_not_race_its_migration(tmp_path):
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    code = "import sys; from pfl_tasks.tracking import open_store; open_store(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, uri], stderr=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__))) for _ in range(3)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors


class CrashIn(InlineSteps):
    """Raises in `step` (evaluate or checkpoint) of round 4."""

    def __init__(self, step: str):
        super().__init__(2)
        self.step = step

    def evaluate(self, fed, round_idx, state):
        if (self.step, round_idx) == ("evaluate", 4):
            raise RuntimeError("boom")
        return super().evaluate(fed, round_idx, state)

    def checkpoint(self, path, round_idx, payload):
        if (self.step, round_idx) == ("checkpoint", 4):
            raise RuntimeError("boom")
        super().checkpoint(path, round_idx, payload)


@pytest.mark.parametrize("step, every, reason, checkpointed", [
    ("evaluate", {}, "RuntimeError during round 4: boom", 3),  # mid-round: the last checkpoint stands
    ("checkpoint", {}, "RuntimeError at round 4 (checkpointed): boom", 4),  # between rounds: saved
    # round 3 was logged after the checkpoint at 2: the rerun must not log it again
    ("evaluate", {"eval_every": 1, "checkpoint_every": 2}, "RuntimeError during round 4: boom", 2),
])
def test_a_crash_marks_the_run_failed_with_the_reason_and_a_rerun_resumes_exactly(
        project, tmp_path_factory, step, every, reason, checkpointed):
    import shutil

    other = tmp_path_factory.mktemp("uncrashed")
    shutil.copytree(project / "data", other / "data")
    with pytest.raises(RuntimeError, match="boom"):
        train(project, "local", steps=CrashIn(step), **every)
    client, runs = mlflow_runs(algorithm="local")
    crashed = [r for r in runs if r.data.tags.get("failure")]
    assert [(r.info.status, r.data.tags["failure"]) for r in crashed] == [("FAILED", reason)]
    paths = RunPaths.of(project, "tiny", "local", 0)
    assert load_checkpoint(paths.checkpoint, {})["round"] == checkpointed
    assert train(project, "local", **every) == train(other, "local", **every)
    evaluated = list(range(every.get("eval_every", 2), 7, every.get("eval_every", 2)))
    assert [h["round"] for h in load_checkpoint(paths.checkpoint, {})["history"]] == evaluated
    resumed = client.get_run(crashed[0].info.run_id)
    assert resumed.info.status == "FINISHED" and "failure" not in resumed.data.tags
    for key in ("test/personalized/acc_mean", "rounds/skipped"):
        points = client.get_metric_history(resumed.info.run_id, key)
        assert sorted(m.step for m in points) == evaluated  # each evaluation logged once


def test_a_run_left_running_by_a_dead_process_is_marked_failed_a_live_ones_not(project):
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])  # a PID that no longer runs
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    key = {"experiment": "tiny", "variant": "fedprox", "seed": "0", "host": socket.gethostname()}
    orphans = [MlflowRun(mlflow_uri(), "tiny", "fedprox-seed0", None, tags={**key, "pid": str(pid)})
               for pid in (dead.pid, os.getpid())]  # an earlier attempt in this very process is over too
    live = MlflowRun(mlflow_uri(), "tiny", "fedprox-seed0", None, tags={**key, "pid": str(alive.pid)})
    try:
        train(project, "fedprox")
        client, _ = mlflow_runs(algorithm="fedprox")
        for orphan in orphans:
            left = client.get_run(orphan.run_id)
            assert left.info.status == "FAILED" and "its process died" in left.data.tags["failure"]
        assert client.get_run(live.run_id).info.status == "RUNNING"  # its process may still be writing
    finally:
        alive.kill()
        live.finish()


# ----------------------------------------------------------------------------- client dropout
def federation_of(digits, algorithm, hp=None, **federation):
    from pfl_tasks.algorithms import build
    from pfl_tasks.engine.federation import Federation

    params = parse_params(tiny_params(federation={"rounds": 3, **federation}))
    return Federation(params.experiment("tiny"), build(algorithm, hp or {}), digits)


@pytest.fixture(scope="module")
def digits(prepared_digits):
    return load_partition(prepared_digits / "seed-0")


def leaves(tree):
    return torch.utils._pytree.tree_flatten(tree)[0]


@pytest.mark.parametrize("algorithm, hp", [("fedavg", {}), ("ditto", {"mu": 0.1})])
def test_aggregation_uses_exactly_the_clients_that_reported(digits, monkeypatch, algorithm, hp):
    from pfl_tasks.engine.rounds import run_round

    flaky = federation_of(digits, algorithm, hp, dropout=0.5)
    reported = flaky.sample_clients(0)
    assert 0 < len(reported) < 6  # this seed drops some of the six, not all
    before = flaky.initial_state()
    with_dropout = run_round(InlineSteps(2), flaky, flaky.initial_state(), 0)

    exact = federation_of(digits, algorithm, hp)
    monkeypatch.setattr(exact, "sample_clients", lambda round_idx: reported)
    only_reporters = run_round(InlineSteps(2), exact, exact.initial_state(), 0)

    assert with_dropout.reported == len(reported)
    for a, b in zip(leaves([with_dropout.server, with_dropout.clients]),
                    leaves([only_reporters.server, only_reporters.clients]), strict=True):
        assert torch.equal(a, b)
    dropped = sorted(set(range(6)) - set(reported.tolist()))
    for new, old in zip(leaves(with_dropout.clients), leaves(before.clients)):  # dropped clients keep their state
        assert torch.equal(new[dropped], old[dropped])
    if algorithm == "fedavg":  # the global model is the sample-weighted mean of the reporters' local models
        local = exact.local_update(0, exact.algorithm.payload(before.server), reported, {}).messages
        weights = digits.train.counts[reported].double()
        for key, value in with_dropout.server["global"].items():
            expected = (local["params"][key].double() * (weights / weights.sum()).view(-1, *[1] * (value.dim()))).sum(0)
            torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("algorithm", sorted(__import__("pfl_tasks.algorithms", fromlist=["ALGORITHMS"]).ALGORITHMS))
def test_every_algorithm_survives_half_its_clients_dropping(digits, algorithm):
    from pfl_tasks.algorithms import ALGORITHMS
    from pfl_tasks.engine.rounds import run_round

    if ALGORITHMS[algorithm].full_participation:  # refused up front, naming the key
        with pytest.raises(ConfigError, match=rf"experiments.tiny.federation.dropout: {algorithm} needs every client"):
            federation_of(digits, algorithm, dropout=0.5)
        return
    fed = federation_of(digits, algorithm, {"feddyn": {"alpha": 0.1}}.get(algorithm), dropout=0.5)
    state = fed.initial_state()
    for r in range(3):
        state = run_round(InlineSteps(2), fed, state, r)
    accuracy = fed.evaluate(state).metrics["test"]["personalized"]["acc"]
    assert torch.isfinite(accuracy).all() and state.round == 3


def test_a_round_nobody_reports_is_skipped_and_counted(project):
    final = train(project, dropout=0.9)
    skipped = sum(len(federation_of(load_partition(project / "data/partitions/digits/seed-0"), "fedavg", dropout=0.9)
                      .sample_clients(r)) == 0 for r in range(6))
    assert skipped > 0 and final["final/rounds/skipped"] == skipped


def test_a_run_killed_while_writing_its_curve_is_not_finished(tmp_path, monkeypatch):
    """The metrics file (what says a run finished, and so is kept by the next stage) is written
    after the curve: a kill in between leaves a run that the rerun resumes and writes again, not
    a kept run with a stale curve and a temporary beside it (test_stage's kills found one)."""
    from pfl_tasks import outputs

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "write_csv", killed)
    with pytest.raises(KeyboardInterrupt):
        outputs.write_dvc_outputs(tmp_path / "seed-0.json", tmp_path / "seed-0.csv", {"status": "finished"},
                                  [{"round": 1, "val": 0.5}])
    assert not (tmp_path / "seed-0.json").exists()
