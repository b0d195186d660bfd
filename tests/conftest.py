"""Shared fixtures: tiny configurations and hand-made federated datasets."""

from __future__ import annotations

import contextlib
import tempfile

from pfl_tasks.numerics import pin

pin("portable")  # the default engine.numerics, as every entry point pins it: before torch loads

import pytest  # noqa: E402
import torch  # noqa: E402

from flows.environment import local_defaults  # noqa: E402

local_defaults()  # as every entry point, before Prefect and MLflow load

from pfl_tasks.config import parse_params  # noqa: E402
from pfl_tasks.data import ClientSplit, FederatedData  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--algorithm", help="run only the registry-parametrized cases of this algorithm "
                                          "(make check-algo NAME=<name>)")


def pytest_collection_modifyitems(config, items):
    name = config.getoption("--algorithm")
    if name is None:
        return
    from pfl_tasks.algorithms import ALGORITHMS

    if name not in ALGORITHMS:
        raise pytest.UsageError(f"--algorithm {name}: not registered; registered: {sorted(ALGORITHMS)}")
    chosen = [item for item in items
              if getattr(getattr(item, "callspec", None), "params", {}).get("algorithm") == name]
    config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
    items[:] = chosen


def tiny_params(**experiment_overrides) -> dict:
    """A small but complete params dict: digits over 6 Dirichlet clients, an MLP."""
    return {
        "seed": 0,
        "datasets": {
            "digits": {
                "source": {"name": "digits"},
                "partition": {"kind": "dirichlet", "n_clients": 6, "alpha": 0.5, "min_samples": 20},
            }
        },
        "experiments": {
            "tiny": {"dataset": "digits", "model": {"kind": "mlp", "hidden": [16]}, **experiment_overrides}
        },
        "federation": {"rounds": 4, "eval_every": 2, "checkpoint_every": 1},
        "local": {"steps": 3, "batch_size": 16, "optimizer": {"lr": 0.1}},
        "engine": {"orchestrator": "inline", "device": "cpu"},
        "algorithms": {"local": {}, "fedavg": {}, "fedprox": {"mu": 0.5}},
    }


@pytest.fixture
def params():
    return parse_params(tiny_params())


# the engine's devices: the CPU always, CUDA where there is one (skipped otherwise)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def digits6() -> FederatedData:
    """The tiny experiment's digits partition (6 clients), in memory."""
    from pfl_tasks.data import build_partition
    from pfl_tasks.data.store import _client_split

    params = parse_params(tiny_params())
    df, manifest = build_partition("digits", params.datasets["digits"], 0)
    shape = tuple(manifest["feature_shape"])
    return FederatedData(
        "digits", "classification", 10, shape,
        *(_client_split(df[df.split == split], 6, shape) for split in ("train", "val", "test")), "x",
    )


def tiny_federation(data, algorithm, executor="vectorized", device="cpu", hp=None, chunk_size=4, engine=None,
                    **overrides):
    """A `Federation` of the tiny experiment on `data`, run inline; `engine`: more engine settings."""
    from pfl_tasks.algorithms import build
    from pfl_tasks.config import EngineConfig
    from pfl_tasks.engine.federation import Federation

    params = parse_params(tiny_params(**overrides))
    engine = EngineConfig(executor=executor, chunk_size=chunk_size, device=device, orchestrator="inline",
                          **(engine or {}))
    exp = params.experiment("tiny").model_copy(update={"engine": engine})
    return Federation(exp, build(algorithm, hp if hp is not None else params.algorithms.get(algorithm, {})), data)


def run_rounds(fed, state, start: int, stop: int):
    """Rounds `start` to `stop` inline (no Prefect: runs where only torch and the library are)."""
    from pfl_tasks.engine.rounds import InlineSteps, run_round

    for r in range(start, stop):
        state = run_round(InlineSteps(2), fed, state, r)
    return state


def split_from(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> ClientSplit:
    counts = torch.tensor([len(y) for y in ys])
    return ClientSplit(torch.cat(xs), torch.cat(ys), torch.cumsum(counts, 0) - counts, counts)


def regression_data(xs, ys) -> FederatedData:
    """Clients' least-squares data, train and test identical."""
    split = split_from(xs, ys)
    return FederatedData("lsq", "regression", 0, (xs[0].shape[1],), split, split, split, "test")


def least_squares_clients(n_clients=4, dim=3, seed=0, sizes=(30, 50, 80, 120)):
    """Heterogeneous clients: own input scaling and own true weights."""
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for k in range(n_clients):
        x = torch.randn(sizes[k], dim, generator=gen) * (1 + k * 0.3)
        w = torch.randn(dim, generator=gen) * 2
        xs.append(x)
        ys.append(x @ w + 0.1 * torch.randn(sizes[k], generator=gen))
    return xs, ys


@pytest.fixture(scope="session")
def prepared_digits(tmp_path_factory):
    """A data/partitions/digits folder for the tiny params, seeds 0-2, built once per session."""
    from flows.prepare import prepare

    root = tmp_path_factory.mktemp("prepared")
    import yaml

    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(seeds=[0, 1, 2])))
    prepare("digits", str(root / "params.yaml"), root / "data" / "partitions")
    return root / "data" / "partitions" / "digits"


@pytest.fixture
def project(tmp_path, prepared_digits, monkeypatch):
    """A temp project root holding the prepared tiny partition and an MLflow sqlite URI."""
    import shutil

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copytree(prepared_digits, tmp_path / "data" / "partitions" / "digits")
    return tmp_path


_MLFLOW_DIR = tempfile.mkdtemp(prefix="pfl-tests-mlflow-")


def mlflow_uri(root=None) -> str:
    """One sqlite store for the whole session: creating a store costs seconds."""
    return f"sqlite:///{_MLFLOW_DIR}/mlflow.db"


def tracking(**options):
    """The `tracking` section for the session's store."""
    from pfl_tasks.config import TrackingConfig

    return TrackingConfig(**{"mlflow_uri": mlflow_uri(), **options})


def ranked_result(method: str, test: float, val: float | None = None, p_vs_best: float | None = None,
                  plateaued=(True, True)):
    """A ranked method of a comparison (two seeds), as `pfl_tasks.reports.verdicts.summarize` makes one."""
    from pfl_tasks.reports.results import MethodResult

    return MethodResult(method, "acc", [0, 1], ["r0", "r1"], [], (test, test - 0.01, test + 0.01),
                        test if val is None else val, None, None, [2, 2], list(plateaued), None, None, None, False,
                        {}, {}, p_vs_best)


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server and database for the whole session (it starts in seconds)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def train_tiny(root, prepared_digits, experiment: str = "tiny", federation=None, **engine) -> dict:
    """FedAvg and Ditto, 2 rounds of 2 chunks (or as `federation` says) under Prefect with
    these engine settings: their final metrics and checkpoints."""
    import shutil

    import yaml

    from flows.train import train_experiment
    from pfl_tasks.runs import RunPaths

    shutil.copytree(prepared_digits, root / "data" / "partitions" / "digits")
    data = tiny_params(algorithms=["fedavg", "ditto"])
    data["experiments"][experiment] = data["experiments"].pop("tiny")
    data["algorithms"]["ditto"] = {"mu": 0.1}
    data["engine"] = {"orchestrator": "prefect", "device": "cpu", "chunk_size": 4, **engine}
    data["federation"] = federation or {"rounds": 2, "eval_every": 1, "checkpoint_every": 2}
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    (root / "params.yaml").write_text(yaml.safe_dump(data))
    finals = train_experiment(experiment, str(root / "params.yaml"), str(root))
    checkpoints = {alg: torch.load(RunPaths.of(root, experiment, alg, 0).checkpoint, weights_only=True)
                   for alg in ("fedavg", "ditto")}
    return {"finals": finals, "checkpoints": checkpoints}


def assert_same_runs(a: dict, b: dict):
    """`train_tiny` results with equal metrics and bit-identical server and client states."""
    assert a["finals"] == b["finals"]
    for alg in ("fedavg", "ditto"):
        for part in ("server", "clients"):
            flat_a = torch.utils._pytree.tree_flatten(a["checkpoints"][alg][part])[0]
            flat_b = torch.utils._pytree.tree_flatten(b["checkpoints"][alg][part])[0]
            assert len(flat_a) == len(flat_b) and (flat_a or (alg, part) == ("fedavg", "clients"))
            assert all(torch.equal(x, y) for x, y in zip(flat_a, flat_b)), (alg, part)


def lsq_federation(algorithm, hp=None, steps=1, lr=0.05, rounds=300, executor="vectorized"):
    """Run `algorithm` on the least-squares clients with full-batch local GD."""
    from pfl_tasks.algorithms import build
    from pfl_tasks.engine.federation import Federation
    from pfl_tasks.engine.rounds import InlineSteps, run_round

    xs, ys = least_squares_clients()
    data = regression_data(xs, ys)
    params = parse_params(tiny_params(
        model={"kind": "linear", "bias": False},
        federation={"rounds": max(rounds, 1)},
        local={"steps": steps, "batch_size": None, "optimizer": {"lr": lr}},
    ))
    exp = params.experiment("tiny").model_copy(
        update={"engine": params.engine.model_copy(update={"executor": executor, "chunk_size": 3})}
    )
    fed = Federation(exp, build(algorithm, hp or {}), data)
    state = fed.initial_state()
    for r in range(rounds):
        state = run_round(InlineSteps(2), fed, state, r)
    return xs, ys, fed, state


def pooled_least_squares(xs, ys, weights=None):
    """argmin_w sum_k weight_k * mean_i (x_ki w - y_ki)^2; default weights n_k (pooled data)."""
    weights = weights or [len(y) for y in ys]
    a = sum(w * x.double().T @ x.double() / len(x) for w, x in zip(weights, xs))
    b = sum(w * x.double().T @ y.double() / len(x) for w, x, y in zip(weights, xs, ys))
    return torch.linalg.solve(a, b)


def assert_rel_close(actual, expected, tol=1e-4):
    err = (actual.double() - expected).norm() / expected.norm()
    assert err < tol, f"relative error {err:.2e}"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def background_server(args: list[str], health_url: str, log_path, env=None, timeout: float = 120, cwd=None):
    """Start a server process, wait (bounded) until `health_url` answers, stop it by SIGTERM to its PID."""
    import signal
    import subprocess
    import time
    import urllib.request

    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(health_url, timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{args[0]} did not come up at {health_url}:\n{open(log_path).read()[-3000:]}")
                time.sleep(0.5)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def listing_defaults(data: dict) -> dict:
    """`data` with every configured run's hyper-parameters listed under `algorithms`, as
    `flows.dvc_yaml` requires of a params file that DVC runs."""
    from flows.dvc_yaml import unlisted_defaults
    from pfl_tasks.algorithms import validate_params

    for run, keys in unlisted_defaults(validate_params(parse_params(data)), data).items():
        data.setdefault("algorithms", {}).setdefault(run, {}).update(keys)
    return data


def read_until(stream, marker: str) -> list[str]:
    """A child's output lines up to the first that holds `marker`: a fault test waits on what
    the child says, never on a sleep."""
    lines = []
    for line in stream:
        lines.append(line)
        if marker in line:
            break
    return lines
