"""The MLflow store process (`pfl_tasks.store_process`): its answers, its errors, that the stage
never imports MLflow for them, and that it ends with its stage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from pfl_tasks.store_process import StoreCallError, StoreClient
from pfl_tasks.tracking import stored_run

REPO = Path(__file__).resolve().parent.parent


def test_calls_from_many_threads_each_get_their_own_answer(tmp_path):
    client = StoreClient(f"sqlite:///{tmp_path}/mlflow.db")
    client.open()
    experiment = client.create_experiment("threads")
    found = {}

    def run(i: int) -> None:
        run_id = client.create_run(experiment, tags={"i": str(i)}).info.run_id
        client.log_batch(run_id, metrics=[("m", float(i), 0, 0)], params=[("p", str(i))])
        stored = client.get_run(run_id)
        found[i] = (stored.data.tags["i"], stored.data.params["p"], stored.data.metrics["m"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == {i: (str(i), str(i), float(i)) for i in range(8)}


def test_a_store_error_comes_back_with_its_code_and_whether_to_try_again(tmp_path):
    client = StoreClient(f"sqlite:///{tmp_path}/mlflow.db")
    with pytest.raises(StoreCallError) as raised:
        client.get_run("0" * 32)
    assert raised.value.error_code == "RESOURCE_DOES_NOT_EXIST" and not raised.value.transient
    assert stored_run(client, "0" * 32) is None


def child(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)}, **kwargs)


def test_the_stage_reads_runs_without_importing_mlflow(tmp_path):
    stage = child("""
        import sys
        from pfl_tasks.tracking import MlflowRun
        run = MlflowRun(sys.argv[1], "plain", "run", None, tags={"a": "b"})
        run.log_params_and_tags({"p": 1}, {"t": "u"})
        run.log_metrics({"m": 0.5}, step=3)
        assert run.last_step("m") == 3
        run.finish()
        print("mlflow" in sys.modules)
    """, f"sqlite:///{tmp_path}/mlflow.db")
    out, _ = stage.communicate(timeout=120)
    assert stage.returncode == 0 and out.strip() == "False"


def test_the_store_process_ignores_stop_signals_and_ends_with_its_stage_however_it_ends(tmp_path):
    for ending in ("exit", "SIGKILL"):
        stage = child("""
            import os, signal, sys, time
            from pfl_tasks.store_process import StoreClient, _process
            StoreClient(sys.argv[1]).open()
            print(_process().proc.pid, flush=True)
            sys.stdin.readline()
            if sys.argv[2] == "SIGKILL":
                os.kill(os.getpid(), signal.SIGKILL)
        """, f"sqlite:///{tmp_path}/mlflow.db", ending, stdin=subprocess.PIPE)
        store = psutil.Process(int(stage.stdout.readline()))
        store.send_signal(signal.SIGTERM)  # as a group's Ctrl-C or kill would
        time.sleep(0.5)
        assert store.is_running() and store.status() != psutil.STATUS_ZOMBIE
        stage.stdin.write("\n")
        stage.stdin.flush()
        stage.wait(60)
        _, alive = psutil.wait_procs([store], timeout=10)
        assert not alive, ending
