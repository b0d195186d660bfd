"""`dvc repro` on a temp copy of the repo with tiny params: all stages, caching, reruns, exp run."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import background_server, free_port, listing_defaults, mlflow_uri, tiny_params
from flows.stage import OUR_SERVER
from flows.dvc_yaml import dvc_yaml

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def ran(out: str) -> set[str]:
    """The stages a `dvc repro` output says it ran."""
    return set(re.findall(r"Running stage '([^']+)'", out))


def sh(args, cwd, env):
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory):
    """A git repo of the project's files with tiny params, its stages reporting to one Prefect
    server, as under `make run`."""
    dst = tmp_path_factory.mktemp("repo")
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()
    for rel in files:
        src = REPO / rel
        if src.is_file() and not rel.startswith(("data/", "models/", "metrics/", "plots/", "reports/")) and rel != "dvc.lock":
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    data = tiny_params()
    data["engine"]["orchestrator"] = "prefect"
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    data["federation"]["rounds"] = 2
    data["learn2pfed"] = {"tiny": {"features_from": "fedavg", "cells": 2, "meta": {"epochs": 4}}}
    data["tables"] = {"tiny": {"experiments": ["tiny"]}}
    data["experiments"]["tiny"]["algorithms"] = ["local", "fedavg", "fedprox", "ditto"]
    data["experiments"]["other"] = {"dataset": "digits", "model": {"kind": "linear"}, "algorithms": ["fedavg"]}
    data["tuning"] = {"other": {"lr": [0.05, 0.5]}}
    (dst / "params.yaml").write_text(yaml.safe_dump(listing_defaults(data)))
    (dst / "dvc.yaml").write_text(dvc_yaml(str(dst / "params.yaml")))  # as make run writes it
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@localhost",
        "GIT_COMMITTER_NAME": "ci", "GIT_COMMITTER_EMAIL": "ci@localhost",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    sh(["git", "init", "-q"], dst, env)
    sh(["git", "add", "-A"], dst, env)
    sh(["git", "commit", "-qm", "copy"], dst, env)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    server_env = {**env, "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home"))}
    server = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with background_server(server, f"{api}/health", dst.parent / "prefect.log", server_env):
        yield dst, {**server_env, "PREFECT_API_URL": api, OUR_SERVER: api}


def test_dvc_repro_runs_caches_and_reruns_only_what_changed(repo_copy):
    root, env = repo_copy
    dvc = [sys.executable, "-m", "dvc"]
    out = sh([*dvc, "repro"], root, env)
    assert "Running stage 'prepare-digits'" in out and "Running stage 'train-tiny'" in out
    assert "Running stage 'tune-other'" in out
    tuning = json.loads((root / "tuning/other.json").read_text())["methods"]["fedavg"]
    assert sorted(tuning["points"]) == ["fedavg_lr0.05", "fedavg_lr0.5"]
    chosen = max(tuning["points"], key=tuning["points"].get)
    assert tuning["chosen"] == {"local.optimizer.lr": float(chosen.removeprefix("fedavg_lr"))}
    assert "## Tuning, on validation" in (root / "reports/compare/other.md").read_text()
    assert (root / "data/partitions/digits/seed-0/manifest.json").exists()
    for alg in ("local", "fedavg", "fedprox", "ditto"):
        assert (root / f"models/tiny/{alg}/seed-0/checkpoint.pt").exists()
        final = json.loads((root / f"metrics/tiny/{alg}/seed-0.json").read_text())
        assert final["status"] == "finished" and final["round"] in (1, 2) and 0 <= final["test"] <= 1
        assert set(final) <= {"status", "round", "val", "test", "global", "worst10", "plateau",
                              "mlflow_run"}  # the headline: every summary is in MLflow
        header = (root / f"plots/tiny/{alg}/seed-0.csv").read_text().splitlines()[0]
        assert header == "round,val/personalized,test/personalized,test/global"
    for supervision in ("train", "val"):
        final = json.loads((root / f"metrics/learn2pfed/tiny/learn2pfed-{supervision}/seed-0.json").read_text())
        assert 0 <= final["test"] <= 1
    assert "| learn2pfed-val |" in (root / "reports/markdown/tiny.md").read_text()
    report = (root / "reports/compare/tiny.md").read_text()
    assert "| learn2pfed-val" in report
    assert "†" in next(line for line in report.splitlines() if "| fedavg" in line)  # its model is the global one
    assert (root / "reports/figures/tiny-curves.png").exists()
    # DVC's views fit a terminal (the run pin, a list, is not a column), and `dvc plots show`
    # renders offline: image plots only, no Vega scripts from a CDN
    shown = sh([*dvc, "metrics", "show", "--md", "metrics/tiny"], root, env)
    assert "worst10" in shown and "mlflow_run" not in shown and max(map(len, shown.splitlines())) <= 120
    sh([*dvc, "plots", "show", "-o", "dvc_plots"], root, env)
    page = (root / "dvc_plots/index.html").read_text()
    assert "<img" in page and "<script" not in page
    shutil.rmtree(root / "dvc_plots")

    out = sh([*dvc, "repro"], root, env)
    assert "Running stage" not in out

    # an edit makes stale only what can change: the reports', the MLflow store's, the run outputs'
    # or the train CLI's code no training, one algorithm's module the train stages running it
    # (whose flows then retrain only the runs whose identity changed, as the `-S` test below
    # shows for a hyper-parameter)
    for plumbing in ("pfl_tasks/reports/text.py", "pfl_tasks/tracking.py", "pfl_tasks/outputs.py", "flows/train.py"):
        (root / plumbing).write_text((root / plumbing).read_text() + "# an edit\n")
    assert stale(root, env) == {"tables", "compare"}
    fedprox = root / "pfl_tasks/algorithms/fedprox.py"
    fedprox.write_text(fedprox.read_text() + "# an edit\n")
    assert stale(root, env) == {"train-tiny", "tables", "compare"}  # not train-other
    selection = root / "pfl_tasks/selection.py"  # which evaluation every run reports
    selection.write_text(selection.read_text() + "# an edit\n")
    assert stale(root, env) == {"tune-other", "train-tiny", "train-other", "learn2pfed-tiny", "tables", "compare"}
    sh(["git", "checkout", "-q", "--", "pfl_tasks", "flows"], root, env)
    assert not stale(root, env)


def test_a_fresh_clone_reuses_the_committed_tuning(repo_copy, tmp_path):
    """The tuning's choices are committed (cache: false): a clone whose partition is rebuilt
    finds tune-other up to date, so `dvc repro` there does not retune."""
    root, env = repo_copy
    sh(["git", "add", "-A"], root, env)
    sh(["git", "commit", "-qm", "after repro", "--allow-empty"], root, env)
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(root), str(clone)], tmp_path, env)
    assert (clone / "tuning/other.json").read_text() == (root / "tuning/other.json").read_text()
    sh([sys.executable, "-m", "dvc", "repro", "prepare-digits"], clone, env)
    assert "tune-other" not in stale(clone, env) and "train-other" in stale(clone, env)


def stale(root: Path, env: dict) -> set[str]:
    """The stages `dvc status` says changed."""
    status = json.loads(sh([sys.executable, "-m", "dvc", "status", "--json"], root, env))
    return set(status)


def pinned(root: Path, alg: str, experiment: str = "tiny") -> str:
    """The MLflow run a run's DVC metrics file names."""
    return json.loads((root / f"metrics/{experiment}/{alg}/seed-0.json").read_text())["mlflow_run"][0]


def final_round(root: Path, alg: str) -> int:
    from mlflow.tracking import MlflowClient

    return int(MlflowClient(mlflow_uri()).get_run(pinned(root, alg)).data.metrics["final/round"])


def test_dvc_exp_run_with_set_param(repo_copy):
    root, env = repo_copy
    sh(["git", "add", "-A"], root, env)
    sh(["git", "commit", "-qm", "after repro", "--allow-empty"], root, env)
    out = sh([sys.executable, "-m", "dvc", "exp", "run", "-n", "rounds4", "-S", "federation.rounds=4"], root, env)
    assert ran(out) == {"tune-other", "train-tiny", "train-other", "learn2pfed-tiny", "tables", "compare"}  # not prepare
    assert final_round(root, "fedavg") == 4
    shown = sh([sys.executable, "-m", "dvc", "exp", "show", "--json"], root, env)
    assert "federation.rounds" in shown or '"rounds": 4' in shown
    from mlflow.tracking import MlflowClient  # its MLflow runs name the experiment

    client = MlflowClient(mlflow_uri())
    tagged = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                                "tags.dvc_experiment != 'workspace'")
    assert tagged and all(r.data.tags["dvc_experiment"] in shown for r in tagged)


def test_dvc_exp_run_S_changes_a_default_hyper_parameter_and_reruns_only_its_runs(repo_copy):
    """params.yaml lists every configured run's defaults: `-S algorithms.ditto.mu=...` needs no
    `+`, reruns the train stage of the experiment running Ditto (not `other`'s), and in it
    retrains Ditto alone, to another number than the default mu's (0.1 here)."""
    root, env = repo_copy
    before = {alg: pinned(root, alg) for alg in ("local", "fedavg", "fedprox", "ditto")}
    ditto = root / "metrics/tiny/ditto/seed-0.json"
    score = json.loads(ditto.read_text())["val"]
    out = sh([sys.executable, "-m", "dvc", "exp", "run", "-n", "mu1.0", "-S", "algorithms.ditto.mu=1.0"], root, env)
    assert ran(out) == {"train-tiny", "tables", "compare"}
    assert "tiny: 3 of 4 runs already finished under the same config, data and code: kept" in out
    assert {alg for alg, run in before.items() if pinned(root, alg) != run} == {"ditto"}
    assert json.loads(ditto.read_text())["val"] != score
    # the README's `dvc exp diff`: the param varied and the means it moved, a row each; DVC's
    # metrics are the methods' means, not a column per run and seed
    diff = sh([sys.executable, "-m", "dvc", "exp", "diff", "--md"], root, env)
    assert "algorithms.ditto.mu" in diff and "tiny.ditto.mean" in diff and "seed" not in diff, diff
    assert max(map(len, diff.splitlines())) <= 120


def test_dvc_exp_run_S_with_a_new_key_reruns_its_runs(repo_copy):
    """`+` adds a key params.yaml did not hold: the train stage watches the experiment's whole
    entry, so it reruns, and retrains Ditto alone."""
    root, env = repo_copy
    before = {alg: pinned(root, alg) for alg in ("local", "fedavg", "fedprox", "ditto")}
    out = sh([sys.executable, "-m", "dvc", "exp", "run", "-n", "plus", "-S",
              "+experiments.tiny.algorithm_overrides.ditto.mu=2.0"], root, env)
    assert "train-tiny" in ran(out) and "tiny: 3 of 4 runs already finished" in out, out
    assert {alg for alg, run in before.items() if pinned(root, alg) != run} == {"ditto"}


def test_dvc_exp_run_S_of_a_tuned_key_is_refused_in_one_line(repo_copy):
    """Where `other` tunes FedAvg's server_lr, a `-S` of it would show in `dvc exp show` beside
    numbers trained at the tuning's choice. The experiment fails in one line naming the grid to pin."""
    root, env = repo_copy
    committed = (root / "params.yaml").read_text()
    data = yaml.safe_load(committed)
    data["tuning"]["other"]["hyper"] = {"fedavg": {"server_lr": [1.0]}}
    (root / "params.yaml").write_text(yaml.safe_dump(data))
    try:
        out = subprocess.run([sys.executable, "-m", "dvc", "exp", "run", "--temp", "-n", "slr", "-S",
                              "algorithms.fedavg.server_lr=0.5"], cwd=root, env=env, capture_output=True, text=True,
                             timeout=600)
    finally:
        (root / "params.yaml").write_text(committed)
    assert out.returncode != 0
    said = out.stdout + out.stderr
    assert ("failed: algorithms.fedavg.server_lr is 0.5, but tuning.other.hyper.fedavg.server_lr tunes it over "
            "[1.0]") in said and "Traceback" not in said, said[-3000:]


def test_dvc_exp_apply_then_compare_reports_that_experiments_numbers(repo_copy):
    """A 5-round experiment continues the 4-round one's checkpoints as new MLflow runs: after
    `dvc exp apply` of either, `compare` reports its own numbers."""
    root, env = repo_copy
    dvc = [sys.executable, "-m", "dvc"]
    sh([*dvc, "exp", "apply", "rounds4"], root, env)
    out = sh([*dvc, "exp", "run", "-n", "rounds5", "-S", "federation.rounds=5"], root, env)
    assert "continuing the 4-round run" in out
    for name, rounds in (("rounds4", 4), ("rounds5", 5)):
        sh([*dvc, "exp", "apply", name], root, env)
        assert final_round(root, "fedavg") == rounds
        sh([sys.executable, "-m", "flows.compare", "tiny"], root, env)
        test_acc = json.loads((root / "metrics/tiny/fedavg/seed-0.json").read_text())["test"]
        row = next(line for line in (root / "reports/compare/tiny.md").read_text().splitlines() if "| fedavg" in line)
        assert f"{test_acc:.4f}" in row, (name, test_acc, row)
    # the README's `dvc exp show`: experiments x the params varied x methods' means, in a terminal
    shown = sh([*dvc, "exp", "show", "--md", "--drop", ".*", "--keep",
                r"Experiment|algorithms.ditto.mu|federation.rounds|tiny\.(ditto|fedavg)\.mean$"], root, env)
    assert {"rounds4", "rounds5", "mu1.0", "tiny.ditto.mean"} <= set(re.findall(r"[\w.]+", shown))
    assert max(map(len, shown.splitlines())) <= 120


def test_repro_flow_streams_dvc_repro_and_fails_loudly(repo_copy, prefect_harness, monkeypatch):
    """The nightly deployment's flow: `dvc repro` in the repo (all cached after the tests above)."""
    from flows.pipeline import repro_flow

    root, env = repo_copy
    monkeypatch.setenv("PATH", env["PATH"])
    repro_flow(root=str(root))  # nothing to rerun: completes
    with pytest.raises(RuntimeError, match="dvc repro exited with status"):
        repro_flow(targets=["no-such-stage"], root=str(root))


def test_make_run_serves_one_prefect_ui_and_stops_it_however_dvc_ends(repo_copy):
    """`python -m flows.repro` (make run): dvc.yaml from params.yaml, one server on 127.0.0.1
    whose UI URL it prints, `dvc repro` with its arguments, and the server gone afterwards."""
    import socket
    import urllib.parse

    root, env = repo_copy
    env = {k: v for k, v in env.items() if k not in ("PREFECT_API_URL", OUR_SERVER)}
    for args, ok in (([], True), (["no-such-stage"], False)):
        out = subprocess.run([sys.executable, "-m", "flows.repro", *args], cwd=root, env=env, capture_output=True,
                             text=True, timeout=300)
        assert (out.returncode == 0) == ok, out.stdout[-2000:] + out.stderr[-2000:]
        url = re.search(r"Prefect UI \(every stage's flow runs, live\): (http://\S+)", out.stdout).group(1)
        where = urllib.parse.urlsplit(url)
        assert where.hostname == "127.0.0.1"
        with socket.socket() as sock:  # nothing listens there any more
            assert sock.connect_ex((where.hostname, where.port)) != 0
    assert "not found inside 'dvc.yaml'" in out.stderr  # dvc's own error, then its status


def test_make_run_is_one_at_a_time_and_its_process_group_dies_together(repo_copy):
    """A second `make run` in a checkout is refused in one line; a kill -9 of `make run`'s
    process group mid-stage leaves no process behind (`dvc repro` and its stages are in the
    group; the Prefect server dies with its parent), and the next `make run` just runs."""
    import signal

    import psutil

    from pfl_tasks.files import OutputLock

    root, env = repo_copy
    env = {k: v for k, v in env.items() if k not in ("PREFECT_API_URL", OUR_SERVER)}
    with OutputLock(root / ".locks" / "make-run.lock", "the test's"):
        out = subprocess.run([sys.executable, "-m", "flows.repro"], cwd=root, env=env, capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"make run failed: this checkout's pipeline is being run by another `make run` (PID {os.getpid()}, "
        "lock .locks/make-run.lock); wait for it or stop it"], out.stderr

    for outputs in ("models", "metrics"):  # so that train-tiny trains
        shutil.rmtree(root / outputs / "tiny")
    make = subprocess.Popen([sys.executable, "-m", "flows.repro", "train-tiny"], cwd=root, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines = []
    for line in make.stdout:  # until the stage's first run finished: the others are under way
        lines.append(line)
        if re.match(r"tiny/\w+/seed0: \d+ rounds in", line):
            break
    family = psutil.Process(make.pid).children(recursive=True)
    assert any("flows.train" in " ".join(p.cmdline()) for p in family), "".join(lines)
    os.killpg(make.pid, signal.SIGKILL)
    make.wait()
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [p.cmdline() for p in alive]
    out = subprocess.run([sys.executable, "-m", "flows.repro"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
