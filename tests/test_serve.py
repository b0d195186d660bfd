"""Scheduled deployments on a real Prefect server, and the sweep's parameter validation."""

import os
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import background_server, free_port, mlflow_uri, tiny_params

from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import SweepConfig, parse_params
from pfl_tasks.errors import ConfigError
from pfl_tasks.grid import sweep_params

REPO = Path(__file__).resolve().parents[1]


def write_params(root: Path, **changes) -> Path:
    data = tiny_params()
    data["engine"] = {"orchestrator": "prefect", "device": "cpu", "chunk_size": 4}
    data["federation"] = {"rounds": 2, "eval_every": 1, "checkpoint_every": 2}
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    data.update(changes)
    (root / "params.yaml").write_text(yaml.safe_dump(data))
    return root / "params.yaml"


def test_sweep_parameters_are_validated_like_params_yaml(tmp_path):
    path = str(write_params(tmp_path))
    sweep = SweepConfig(name="s1", experiment="tiny", algorithms=["fedavg"], seeds=[3, 4],
                        overrides={"federation.rounds": 7, "algorithms.fedprox.mu": 0.1}, params_path=path)
    raw = sweep_params(sweep)
    assert list(raw["experiments"]) == ["tiny-s1"]
    exp = raw["experiments"]["tiny-s1"]
    assert exp["algorithms"] == ["fedavg"] and exp["seeds"] == [3, 4]
    assert raw["federation"]["rounds"] == 7 and raw["algorithms"]["fedprox"]["mu"] == 0.1

    with pytest.raises(ConfigError, match=r"federation: unknown key\(s\) \['roundz'\]"):
        sweep_params(SweepConfig(name="s", experiment="tiny", overrides={"federation.roundz": 7}, params_path=path))
    with pytest.raises(ConfigError, match=r"federation.rounds"):
        sweep_params(SweepConfig(name="s", experiment="tiny", overrides={"federation.rounds": "many"}, params_path=path))
    with pytest.raises(ConfigError, match=r"'seed' is not a section"):
        sweep_params(SweepConfig(name="s", experiment="tiny", overrides={"seed.x": 1}, params_path=path))
    with pytest.raises(ConfigError, match=r"sweep.experiment: 'nope'"):
        sweep_params(SweepConfig(name="s", experiment="nope", params_path=path))
    with pytest.raises(ConfigError, match=r"experiments.tiny-s.algorithms\[0\]: unknown algorithm 'dito'"):
        validate_params(parse_params(sweep_params(SweepConfig(name="s", experiment="tiny", algorithms=["dito"],
                                                 params_path=path))))
    with pytest.raises(ValueError, match="name"):
        SweepConfig(name="../escape", experiment="tiny")


SWEEP = {"name": "t", "experiment": "tiny", "algorithms": ["fedavg"], "seeds": [0]}


def serving_setup(project: Path, tmp_path: Path, sweep: dict) -> tuple[str, dict, list[str], list[str]]:
    """The project's params file, and a Prefect server's API URL, environment and command on a
    free loopback port, with `flows.serve`'s command serving `sweep` to it."""
    write_params(project)
    api = f"http://127.0.0.1:{free_port()}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(REPO)}
    server = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
              api.rsplit(":", 1)[1].removesuffix("/api")]
    serve = [sys.executable, "-m", "flows.serve", "--only", "sweep", "--params-file", "params.yaml",
             "--sweep", SweepConfig(**sweep).model_dump_json()]
    return api, env, server, serve


@pytest.mark.slow
def test_served_sweep_deployment_runs_rounds_as_task_runs(project, tmp_path):
    """`prefect server` and `python -m flows.serve` as real processes on loopback; the sweep
    deployment, triggered with `run_deployment`, completes and shows each round's tasks."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api, env, server, serve = serving_setup(project, tmp_path, SWEEP)

    with background_server(server, f"{api}/health", tmp_path / "server.log", env), \
            temporary_settings({PREFECT_API_URL: api}):
        with background_server(serve, f"{api}/health", tmp_path / "serve.log", env, cwd=project) as serving:
            with get_client(sync_client=True) as client:
                deadline = time.monotonic() + 120
                while True:  # the serve process registers its deployment
                    try:
                        client.read_deployment_by_name("pfl-sweep/sweep")
                        break
                    except Exception:
                        log = (tmp_path / "serve.log").read_text()
                        assert serving.poll() is None and time.monotonic() < deadline, log
                        time.sleep(1)
                flow_run = run_deployment("pfl-sweep/sweep", parameters={"sweep": SWEEP}, timeout=400)
                assert flow_run.state.is_completed(), (tmp_path / "serve.log").read_text()[-5000:]
                assert flow_run.name == "sweep-t"
                names = {fr.name for fr in client.read_flow_runs()}
                tasks = {t.name for t in client.read_task_runs()}
    assert "tiny-t-fedavg-seed0" in names  # the training run, a subflow of the sweep
    for name in ("prepare-digits", "round-1/sample_clients", "round-1/local_update-chunk-0",
                 "round-1/local_update-chunk-1", "round-1/aggregate", "round-1/evaluate", "compare"):
        assert name in tasks
    assert (project / "sweeps/t/metrics/tiny-t/fedavg/seed-0.json").exists()
    assert (project / "sweeps/t/reports/compare/tiny-t.md").exists()


def test_the_default_sweep_is_one_of_params_yaml():
    """`python -m flows.serve` as the README gives it (no --sweep) validates its default sweep
    against the committed params.yaml."""
    from flows.serve import DEFAULT_SWEEP
    from pfl_tasks.algorithms import validate_params
    from pfl_tasks.config import parse_params
    from pfl_tasks.grid import sweep_params

    assert validate_params(parse_params(sweep_params(DEFAULT_SWEEP))).experiments


@pytest.mark.slow
def test_ctrl_c_stops_serve_and_pauses_its_schedules_or_at_once_when_the_server_died(project, tmp_path):
    """Ctrl-C while the server answers: Prefect's shutdown, which pauses the deployments. Ctrl-C
    after the server died: one line and exit, instead of a shutdown that waits on the server."""
    import signal
    import subprocess
    from datetime import datetime, timezone

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api, env, server, serve = serving_setup(project, tmp_path, SWEEP)

    started = []

    def serving(log: Path) -> subprocess.Popen:
        """serve, once its runner has polled the server."""
        since = datetime.now(timezone.utc)
        with open(log, "w") as out:
            started.append(subprocess.Popen(serve, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=project))
        deadline = time.monotonic() + 120
        with get_client(sync_client=True) as client:
            while True:
                try:
                    polled = client.read_deployment_by_name("pfl-sweep/sweep").last_polled
                    if polled and polled > since:
                        return started[-1]
                except Exception:  # not registered yet
                    pass
                assert started[-1].poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)

    try:
        with background_server(server, f"{api}/health", tmp_path / "server.log", env) as prefect_server, \
                temporary_settings({PREFECT_API_URL: api}):
            first = serving(tmp_path / "first.log")
            first.send_signal(signal.SIGINT)
            assert first.wait(120) == 0, (tmp_path / "first.log").read_text()[-3000:]
            with get_client(sync_client=True) as client:
                assert client.read_deployment_by_name("pfl-sweep/sweep").paused
            second = serving(tmp_path / "second.log")
            prefect_server.terminate()
            prefect_server.wait(60)
            second.send_signal(signal.SIGINT)
            assert second.wait(120) == 128 + signal.SIGINT
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
    said = [line for line in (tmp_path / "second.log").read_text().splitlines() if line.startswith("serve stopped")]
    assert len(said) == 1 and said[0].startswith(
        "serve stopped at Ctrl-C, its schedules left as they were: PREFECT_API_URL="), said
