"""Outages under a running stage: its Prefect server killed or stalled, its MLflow store locked
by another process. The stage still ends within seconds, signals stop it as they do otherwise,
and what it could not record is said in one line."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import mlflow_uri, read_until
from flows.stage import DRAIN_SECONDS, stage_main
from pfl_tasks.config import TrackingConfig
from pfl_tasks.runs import Run, RunPaths

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- Prefect server
# a stage whose own Prefect server (a stand-in answering /api/health) stalls, then one whose
# server is killed, each while its client holds 100 records that take 7 s each to send (as
# events do to a dead server: the client's retries); then what the drain at interpreter exit
# would wait
STAGES_WITH_A_BACKLOG = """
import asyncio, os, signal, subprocess, sys, time
from prefect._internal.concurrency.services import QueueService
from flows import stage

class Backlog(QueueService[int]):
    async def _handle(self, item):
        await asyncio.sleep(7)

popen, servers = subprocess.Popen, []

def stand_in(args, **kwargs):
    if args[1:3] == ["-m", "prefect"]:
        args = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", args[-1], "--directory", sys.argv[1]]
        servers.append(popen(args, **kwargs))
        return servers[-1]
    return popen(args, **kwargs)

subprocess.Popen = stand_in
for server in ("stalled", "killed"):
    with stage.prefect_api():
        worker = Backlog.instance()
        for record in range(100):
            worker.send(record)
        if server == "killed":
            os.kill(servers[-1].pid, signal.SIGKILL)
            servers[-1].wait()
        ending = time.monotonic()
    print(f"{server} took {time.monotonic() - ending:.1f} s", file=sys.stderr, flush=True)
ending = time.monotonic()
worker.drain(at_exit=True)
print(f"exit drain took {time.monotonic() - ending:.1f} s", file=sys.stderr, flush=True)
"""


def test_hostile_outage_of_the_stages_prefect_server_ends_the_stage_within_seconds(tmp_path):
    """A stalled server gets DRAIN_SECONDS for the records Prefect's client holds, a dead one
    nothing (each record would wait out the client's retries); what is left is dropped with
    one line, and nothing waits at interpreter exit."""
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "health").write_text("ok")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    try:
        out = subprocess.run([sys.executable, "-c", STAGES_WITH_A_BACKLOG, str(tmp_path)], cwd=REPO,
                             capture_output=True, text=True, timeout=90, env={**env, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"the stages still waited after 90 s:\n{(err.stderr or b'').decode()}") from None
    lines = out.stderr.splitlines()
    assert out.returncode == 0, out.stderr
    assert lines.count(f"the stage's Prefect server had not taken the last logs and events after {DRAIN_SECONDS:g} s: "
                       "the 99 still queued are lost") == 1, out.stderr
    assert len([line for line in lines if re.fullmatch(
        r"the stage's Prefect server died: the \d+ logs and events its client still held are lost", line)]) == 1, \
        out.stderr
    took = {what: float(seconds) for what, seconds in re.findall(r"^(.+) took ([\d.]+) s$", out.stderr, re.M)}
    assert DRAIN_SECONDS <= took["stalled"] < DRAIN_SECONDS + 2 and took["killed"] < 2, out.stderr
    assert took["exit drain"] < 1, out.stderr


# ----------------------------------------------------------------------------- MLflow store
@pytest.fixture(scope="module")
def store() -> Path:
    """The session's sqlite MLflow store (creating one costs seconds)."""
    from pfl_tasks.tracking import open_store

    open_store(mlflow_uri())
    return Path(mlflow_uri().removeprefix("sqlite:///"))


class Stamped:
    """A stand-in for stderr that notes when each line was written."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines.extend((time.monotonic(), line) for line in text.splitlines() if line)
        return len(text)

    def flush(self):
        pass

    def when(self, fragment: str) -> list[float]:
        return [at for at, line in self.lines if fragment in line]

    def __repr__(self):
        return "\n".join(line for _, line in self.lines)


@pytest.mark.parametrize("outage", ["store_back", "second_signal", "store_stays_locked"])
def test_hostile_outage_of_the_mlflow_store_lets_signals_stop_the_run_within_seconds(
        tmp_path, store, monkeypatch, outage):
    """SIGTERM while another process holds the store locked and the run waits to log a step:
    the run gives the store call up at once (the step is checkpointed first; MLflow gets its
    records on resume) and tries 5 s to mark itself KILLED; a second signal stops that at once.
    A mark not written is said in one line."""
    from mlflow.tracking import MlflowClient

    experiment, stderr, moments = f"outage-{outage}", Stamped(), {}
    tracked, locked = threading.Event(), threading.Event()
    lock = sqlite3.connect(store, isolation_level=None, check_same_thread=False)
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv("CI", "true")  # no progress bar

    def work():
        identity = {"experiment": experiment, "algorithm": "fedavg", "config_hash": "-", "config": "{}"}
        with Run(RunPaths.of(tmp_path, experiment, "fedavg", 0), identity,
                 TrackingConfig(mlflow_uri=f"sqlite:///{store}", retry_seconds=30), 0, total=3, unit="round") as run:
            run.track(experiment, {}, {})
            tracked.set()
            locked.wait(30)
            for _, stop in run.spans(0, 1):
                run.log([{"round": stop, "acc": 0.5}])

    def another_process():
        tracked.wait(60)
        lock.execute("BEGIN EXCLUSIVE")
        locked.set()
        time.sleep(1)  # the run waits in its store call: sqlite's 20 s wait for the lock
        moments["signal"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        if outage == "store_back":
            time.sleep(2)
            lock.rollback()
        elif outage == "second_signal":
            time.sleep(0.5)
            moments["second"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # none reaches pytest (stage_main, Run take it over)
    helper = threading.Thread(target=another_process)
    try:
        helper.start()
        rc = stage_main("outage", work)
        ended = time.monotonic()
        helper.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if lock.in_transaction:
            lock.rollback()
        lock.close()
    assert rc == 128 + signal.SIGTERM, stderr
    [stopping] = stderr.when("SIGTERM: stopping after this round")
    assert stopping - moments["signal"] < 1, stderr  # not after sqlite's 20 s wait
    left = [line for _, line in stderr.lines if "left RUNNING" in line]
    client = MlflowClient(f"sqlite:///{store}")
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    if outage == "store_back":
        assert not left and ended - moments["signal"] < 4, stderr
        # round 1's records went out while round 2 began: its log waits on them, locked
        assert (run.info.status, run.data.tags["failure"]) == ("KILLED", "RunStopped during round 2: stopped by SIGTERM")
    elif outage == "second_signal":
        assert len(left) == 1 and "not marked KILLED (stopped by SIGTERM)" in left[0], stderr
        assert ended - moments["second"] < 2 and run.info.status == "RUNNING", stderr
    else:
        assert len(left) == 1 and "not marked KILLED (MLflow store unavailable for 5 s" in left[0], stderr
        assert 5 <= ended - moments["signal"] < 9 and run.info.status == "RUNNING", stderr


def test_hostile_outage_a_stage_whose_prefect_server_is_killed_ends_in_seconds_in_one_line(tmp_path, prepared_digits):
    """The stage's own Prefect server killed -9 mid-run: the run under way finishes (its steps
    do not wait on the server), the flow's end report fails within seconds (three retries a request
    on a server of ours, not the client's five), the stage exits 2 saying so in one line, with
    no traceback, and the rerun keeps the finished run and trains the others."""
    import shutil

    import psutil
    import yaml

    from conftest import tiny_params

    shutil.copytree(prepared_digits, tmp_path / "data" / "partitions" / "digits")
    data = tiny_params(algorithms=["fedavg", "local"])
    # chunks of 4 of the 6 clients: one run at a time, so the second waits for the rerun
    data["engine"] = {"orchestrator": "prefect", "device": "cpu", "chunk_size": 4}
    data["federation"] = {"rounds": 20, "eval_every": 1, "checkpoint_every": 5}
    data["tracking"] = {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}, "PYTHONPATH": str(REPO), "CI": "true"}
    stage = subprocess.Popen([sys.executable, "-m", "flows.train", "tiny"], cwd=tmp_path, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = read_until(stage.stdout, "tiny/fedavg/seed0 round 3:")
    [server] = [p for p in psutil.Process(stage.pid).children() if "server" in p.cmdline()]
    server.kill()
    killed = time.monotonic()
    lines += stage.stdout.readlines()
    assert stage.wait() == 2, "".join(lines)
    assert time.monotonic() - killed < 30, "".join(lines)
    assert "Traceback" not in "".join(lines) and "--- Error logging to API" not in "".join(lines)
    assert re.fullmatch(r"train failed: the Prefect server at http://127\.0\.0\.1:\d+/api stopped answering \(.+\): "
                        r"rerun the stage \(finished runs are kept, the others resume from their last checkpoints\)\n",
                        lines[-1]), "".join(lines)
    assert not [line for line in lines[lines.index(next(l for l in lines if "round 20:" in l)) + 1:-1]
                if "the stage's Prefect server died" not in line], "".join(lines)
    rerun = subprocess.run([sys.executable, "-m", "flows.train", "tiny"], cwd=tmp_path, env=env, text=True,
                           capture_output=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "1 of 2 runs already finished under the same config, data and code: kept" in rerun.stdout
