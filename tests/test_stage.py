"""A whole Prefect-orchestrated `train` stage, stopped by SIGTERM, SIGINT and SIGKILL at seeded
random moments: it exits with 128 + the signal, leaves no process behind (its Prefect server
included), no temporary file and no RUNNING MLflow run, and a rerun ends bit-identical to a run
that was never interrupted. The moments differ on every run (PFL_KILL_SEED repeats one)."""

from __future__ import annotations

import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from conftest import tiny_params
from pfl_tasks.runs import RunPaths

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = ("fedavg", "ditto")


def stage_params(uri: str, orchestrator: str, chunk_size: int) -> dict:
    data = tiny_params(algorithms=list(ALGORITHMS))
    data["algorithms"]["ditto"] = {"mu": 0.1}
    data["engine"] = {"orchestrator": orchestrator, "device": "cpu", "chunk_size": chunk_size}
    data["federation"] = {"rounds": 12, "eval_every": 1, "checkpoint_every": 3, "dropout": 0.2}
    data["tracking"] = {"mlflow_uri": uri}
    return data


def project_at(root: Path, prepared_digits, orchestrator: str, chunk_size: int) -> Path:
    shutil.copytree(prepared_digits, root / "data" / "partitions" / "digits")
    (root / "params.yaml").write_text(
        yaml.safe_dump(stage_params(f"sqlite:///{root}/mlflow.db", orchestrator, chunk_size)))
    return root


class Stage:
    """`python -m flows.train tiny` in `root`, its output read line by line; started with SIGINT
    ignored, as a shell starts a background job (the stage must stop on it all the same)."""

    def __init__(self, root: Path):
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flows.train", "tiny"], cwd=root, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**env, "PYTHONPATH": str(REPO), "CI": "true"},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
        self.lines, self.log = queue.Queue(), []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.log[-40:])
                continue
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no line matching {pattern!r}:\n{''.join(self.log[-40:])}")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def finish(self, timeout: float = 180) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(timeout)  # it has read the pipe to its end
        return rc


def gone(processes: list[psutil.Process], timeout: float = 30) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return not alive


def temporaries(root: Path) -> list[Path]:
    return [p for d in ("models", "metrics", "plots") for p in (root / d).rglob(".*")]


def mlflow_statuses(root: Path) -> dict[str, list[str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    out = {}
    for run in runs:
        out.setdefault(run.info.status, []).append(run)
    return out


def states(root: Path) -> dict:
    return {alg: torch.load(RunPaths.of(root, "tiny", alg, 0).checkpoint, weights_only=True) for alg in ALGORITHMS}


# chunks of 4 of the 6 clients: one run at a time, its two chunks side by side; one chunk: the
# two runs side by side, each on a thread of its own (`flows.train.side_by_side`)
@pytest.mark.parametrize("chunk_size", [4, 128], ids=["one_run_at_a_time", "runs_side_by_side"])
def test_signals_and_kills_leave_nothing_behind_and_resume_bit_identically(tmp_path_factory, prepared_digits,
                                                                           chunk_size):
    from flows.train import train_experiment

    reference = project_at(tmp_path_factory.mktemp("reference"), prepared_digits, "inline", chunk_size)
    train_experiment("tiny", str(reference / "params.yaml"), str(reference))
    root = project_at(tmp_path_factory.mktemp("stage"), prepared_digits, "prefect", chunk_size)
    seed = int(os.environ.get("PFL_KILL_SEED", random.SystemRandom().randrange(2**32)))
    print(f"kill moments drawn from seed {seed} (rerun them with PFL_KILL_SEED={seed})")
    draw = random.Random(seed)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL, signal.SIGKILL):
        started_ms = time.time() * 1000
        stage = Stage(root)
        for _ in range(draw.randint(1, 3)):  # a random moment: after 1-3 evaluations, plus a fraction of a round
            stage.wait_for(r"tiny/\w+/seed0 round \d+:")
        time.sleep(draw.uniform(0, 0.3))
        children = stage.descendants()
        assert children, "the stage runs its own Prefect server"
        stage.proc.send_signal(sig)
        rc = stage.finish()
        assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig), "".join(stage.log[-30:])
        assert gone(children), f"left running after {sig.name}: {[p.cmdline() for p in children if p.is_running()]}"
        if sig != signal.SIGKILL:
            assert f"stopped by {sig.name}" in "".join(stage.log[-5:])
            assert not temporaries(root)
            statuses = mlflow_statuses(root)
            assert "RUNNING" not in statuses
            # the runs this stage stopped; a run side by side that it never resumed keeps an earlier reason
            stopped = [r for r in statuses.get("KILLED", []) if r.info.end_time >= started_ms]
            if stopped:
                for run in stopped:
                    assert re.fullmatch(rf"RunStopped at round \d+ \(checkpointed\): stopped by {sig.name}",
                                        run.data.tags["failure"])
            else:  # the stop came in a run's last round (PFL_KILL_SEED=4175974164): it finished, no next one began
                assert "stopping after this round" in "".join(stage.log) and statuses["FINISHED"]

    stage = Stage(root)
    assert stage.finish() == 0, "".join(stage.log[-30:])
    assert not temporaries(root)
    statuses = mlflow_statuses(root)
    assert set(statuses) <= {"FINISHED", "FAILED", "KILLED"}
    assert {r.data.tags["algorithm"] for r in statuses["FINISHED"]} == set(ALGORITHMS)
    expected, actual = states(reference), states(root)
    for alg in ALGORITHMS:
        for part in ("server", "clients", "history"):
            a, b = (torch.utils._pytree.tree_flatten(s[alg][part])[0] for s in (expected, actual))
            assert len(a) == len(b) and all(
                torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)), (alg, part)


def test_a_server_error_from_our_prefect_server_past_its_retries_ends_the_stage_in_one_line(monkeypatch):
    """A 503 (its sqlite busy under a loaded host) that outlasts the client's retries: one line
    saying to rerun, as for a server that stopped answering; a 4xx, or another server's 5xx, is no such line."""
    import httpx

    import flows.stage

    api = "http://127.0.0.1:4999/api"
    monkeypatch.setattr(flows.stage, "_APIS", {api})

    def failed(status: int, url: str = f"{api}/flow_runs/") -> Exception:
        request = httpx.Request("POST", url)
        return httpx.HTTPStatusError(f"{status}", request=request, response=httpx.Response(status, request=request))

    assert flows.stage.ending(RuntimeError("while logging")) is None
    wrapped = RuntimeError("while logging")
    wrapped.__cause__ = failed(503)
    assert flows.stage.ending(wrapped) == (f"the Prefect server at {api} stopped answering (while logging): rerun "
                                           "the stage (finished runs are kept, the others resume from their last "
                                           "checkpoints)")
    assert flows.stage.ending(failed(404)) is None and flows.stage.ending(failed(503, "http://elsewhere/api/x")) is None
