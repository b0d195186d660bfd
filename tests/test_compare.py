"""The comparison report: ranking over seeds from MLflow, its figures, and a real `mlflow server`."""

import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import background_server, free_port, mlflow_uri, tiny_params

from pfl_tasks.compare import ComparisonError, rank, write_report
from pfl_tasks.tracking import MlflowRun, write_csv


def log_run(uri, experiment, algorithm, seed, acc, global_acc=None, status="FINISHED", clients=(0.5, 0.7)):
    run = MlflowRun(uri, experiment, f"{algorithm}-seed{seed}", None)
    run.log_params_and_tags({}, {"algorithm": algorithm, "seed": str(seed)})
    for step, value in ((1, acc / 2), (2, acc)):
        run.log_metrics({"personalized/acc_mean": value}, step=step)
    final = {"final/personalized/acc_mean": acc, "final/personalized/acc_worst10": acc - 0.2,
             "final/personalized/acc_std": 0.1, "best/personalized/acc_mean": acc}
    if global_acc is not None:
        final["final/global/acc_mean"] = global_acc
    run.log_metrics(final, step=2)
    write_csv(Path(os.environ["TMP_ARTIFACTS"]) / "clients_last.csv",
              [{"client_id": k, "n_test": 10, "personalized_acc": v} for k, v in enumerate(clients)])
    run.log_artifacts(Path(os.environ["TMP_ARTIFACTS"]))
    run.finish(status)
    time.sleep(0.01)  # distinct start times: the newest run of (algorithm, seed) counts
    return run.run_id


def test_ranking_over_seeds_uses_each_seeds_newest_finished_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("TMP_ARTIFACTS", str(tmp_path / "upload"))
    (tmp_path / "upload").mkdir()
    uri, experiment = mlflow_uri(), f"compare-{uuid.uuid4().hex[:8]}"
    log_run(uri, experiment, "b", 0, acc=0.99)  # superseded by the newer run of b, seed 0
    log_run(uri, experiment, "a", 0, acc=0.8, global_acc=0.6, clients=(0.6, 1.0))
    log_run(uri, experiment, "a", 1, acc=0.9, global_acc=0.7, clients=(0.8, 1.0))
    log_run(uri, experiment, "b", 0, acc=0.6)
    log_run(uri, experiment, "b", 1, acc=0.7)
    log_run(uri, experiment, "a", 2, acc=1.0, status="FAILED")  # not finished: left out
    log_run(uri, experiment, "renamed", 0, acc=0.95)  # no longer configured: left out by `only`

    client = MlflowClient(uri)
    assert [r.method for r in write_report(client, experiment, tmp_path, tmp_path)] == ["renamed", "a", "b"]
    only = {(m, s) for m in ("a", "b") for s in (0, 1, 2)}
    ranked = write_report(client, experiment, tmp_path / "reports", tmp_path / "figures", only)
    assert [r.method for r in ranked] == ["a", "b"]
    a, b = ranked
    assert a.seeds == [0, 1] and b.seeds == [0, 1]
    assert a.personalized == pytest.approx((0.85, statistics.stdev([0.8, 0.9])))
    assert b.personalized == pytest.approx((0.65, statistics.stdev([0.6, 0.7])))
    assert a.global_ == pytest.approx((0.65, statistics.stdev([0.6, 0.7]))) and b.global_ is None
    assert a.worst10[0] == pytest.approx(0.65)

    report = (tmp_path / "reports" / f"{experiment}.md").read_text()
    assert "| 1 | a | 2 | 0.8500 ± 0.0707 | 0.6500 ± 0.0707 |" in report
    assert "| 2 | b | 2 | 0.6500 ± 0.0707 | – |" in report
    for name in ("curves", "clients"):
        png = tmp_path / "figures" / f"{experiment}-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"](../figures/{png.name})" in report


def test_regression_ranks_lowest_mse_first_and_missing_experiment_is_named(tmp_path):
    from mlflow.tracking import MlflowClient

    def run(mse):
        return SimpleNamespace(data=SimpleNamespace(metrics={"final/personalized/mse_mean": mse}),
                               info=SimpleNamespace(run_id=str(mse)))

    ranked = rank({"worse": {0: run(2.0)}, "better": {0: run(0.5)}}, "mse")
    assert [r.method for r in ranked] == ["better", "worse"]
    with pytest.raises(ComparisonError, match="no experiment 'nowhere'"):
        write_report(MlflowClient(mlflow_uri()), "nowhere", tmp_path, tmp_path)


@pytest.mark.slow
def test_compare_against_a_real_mlflow_server(project, tmp_path):
    """Two runs logged by the training flow's tracking code through a loopback `mlflow server`,
    then ranked by `compare` over its REST API."""
    from flows.compare import compare
    from flows.train import train_experiment

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
              "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
              "--artifacts-destination", str(tmp_path / "art")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "DO_NOT_TRACK": "true"}
    data = tiny_params(algorithms=["local", "fedavg"])
    data["federation"] = {"rounds": 2, "eval_every": 1, "checkpoint_every": 2}
    data["tracking"] = {"mlflow_uri": uri}
    (project / "params.yaml").write_text(yaml.safe_dump(data))

    with background_server(server, f"{uri}/health", tmp_path / "mlflow.log", env):
        results = train_experiment("tiny", str(project / "params.yaml"), str(project))
        rankings = compare(["tiny"], str(project / "params.yaml"), root=str(project))

    expected = sorted(("local", "fedavg"), key=lambda a: -results[a, 0]["final/personalized/acc_mean"])
    assert [r.method for r in rankings["tiny"]] == expected
    for r in rankings["tiny"]:
        assert r.personalized[0] == pytest.approx(results[r.method, 0]["final/personalized/acc_mean"])
    assert (project / "reports/compare/tiny.md").exists()
    assert (project / "reports/figures/tiny-clients.png").exists()  # artifacts came through the server
