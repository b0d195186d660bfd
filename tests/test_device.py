"""The engine on each device (the CPU always, CUDA where there is one): one round of every
algorithm, CUDA against the CPU, reruns and resumes bit-identical, client stacks on the host
or the GPU, and no value read back to the host inside the local step loop."""

import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import run_rounds, tiny_federation
from pfl_tasks.algorithms import ALGORITHMS
from pfl_tasks.config import EngineConfig
from pfl_tasks.engine.checkpoint import load_checkpoint, save_checkpoint
from pfl_tasks.engine.state import gather, leaves
from pfl_tasks.errors import ConfigError

EVERY_ALGORITHM = sorted(ALGORITHMS)
HP = {"feddyn": {"alpha": 0.1}}  # its default alpha needs the experiments' smaller lr
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def trees(state) -> dict:
    return {"server": state.server, "clients": state.clients}


def assert_identical(a: dict, b: dict):
    a, b = dict(leaves(a)), dict(leaves(b))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].cpu(), b[name].cpu()), name


@pytest.mark.parametrize("executor", ["vectorized", "sequential"])
@pytest.mark.parametrize("algorithm", EVERY_ALGORITHM)
def test_one_round_of_every_algorithm(digits6, device, algorithm, executor):
    fed = tiny_federation(digits6, algorithm, executor, device, HP.get(algorithm))
    state = run_rounds(fed, fed.initial_state(), 0, 1)
    assert fed.nonfinite(state) is None
    assert all(t.device.type == device for _, t in leaves(state.server))
    assert all(t.device == fed.state_device for _, t in leaves(state.clients))
    acc = fed.evaluate(state).metrics["test"]["personalized"]["acc"]
    assert acc.device.type == "cpu" and len(acc) == 6 and bool(((acc >= 0) & (acc <= 1)).all())


@cuda_only
@pytest.mark.parametrize("algorithm", EVERY_ALGORITHM)
def test_cuda_agrees_with_the_cpu(digits6, algorithm):
    """TF32 off: 3 rounds on the GPU within float32 rounding (atol 1e-4, rtol 1e-3) of the CPU's."""
    runs = {}
    for device in ("cpu", "cuda"):
        fed = tiny_federation(digits6, algorithm, device=device, hp=HP.get(algorithm))
        runs[device] = dict(leaves(trees(run_rounds(fed, fed.initial_state(), 0, 3))))
    for name, value in runs["cpu"].items():
        torch.testing.assert_close(runs["cuda"][name].cpu(), value, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("algorithm", EVERY_ALGORITHM)
def test_rerun_and_resume_are_bit_identical(digits6, device, algorithm, tmp_path):
    def federation():
        return tiny_federation(digits6, algorithm, device=device, hp=HP.get(algorithm),
                               model={"kind": "cnn", "channels": [4, 8], "hidden": 16})

    fed = federation()
    full = run_rounds(fed, fed.initial_state(), 0, 4)
    again = run_rounds(fed, fed.initial_state(), 0, 4)
    assert_identical(trees(full), trees(again))

    half = run_rounds(fed, fed.initial_state(), 0, 2)
    save_checkpoint(tmp_path / "checkpoint.pt", {"round": half.round, **trees(half)})
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt", {})
    resumed_fed = federation()  # a fresh process's
    resumed = run_rounds(resumed_fed, resumed_fed.restore(ckpt["round"], ckpt["server"], ckpt["clients"]), 2, 4)
    assert_identical(trees(full), trees(resumed))


@cuda_only
def test_client_stacks_on_the_host_or_the_gpu_give_identical_runs(digits6):
    runs = {}
    for placement in ("host", "device"):
        fed = tiny_federation(digits6, "ditto", device="cuda", engine={"client_state": placement})
        runs[placement] = run_rounds(fed, fed.initial_state(), 0, 3)
        stacks = [t for _, t in leaves(runs[placement].clients)]
        assert all(t.is_cuda for t in stacks) if placement == "device" else all(t.is_pinned() for t in stacks)
    assert_identical(trees(runs["host"]), trees(runs["device"]))


def test_client_stacks_on_the_gpu_are_refused_with_ray():
    with pytest.raises(ValueError, match="client_state 'device'"):
        EngineConfig(client_state="device", task_runner="ray")


def test_ray_chunks_ask_for_the_gpu_only_on_a_cuda_engine(monkeypatch):
    import ray  # `make test` installs it (docs/engine.md, "What the tests cover")

    from flows.prefect_rounds import ray_options

    engine = EngineConfig(gpus_per_chunk=0.25)
    assert ray_options(engine, torch.device("cpu")) == {"num_gpus": 0}
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    nodes = [{"Alive": True, "Resources": {"CPU": 4.0, "GPU": 1.0}}, {"Alive": False, "Resources": {"GPU": 4.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert ray_options(engine, torch.device("cuda", 0)) == {"num_gpus": 0.25, "max_calls": 0}  # workers reused
    nodes[1]["Alive"] = True  # a node with several GPUs: a fresh process per GPU task
    assert ray_options(engine, torch.device("cuda", 0)) == {"num_gpus": 0.25, "max_calls": 1}
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    with pytest.raises(ConfigError, match="offers 0 GPUs"):
        ray_options(engine, torch.device("cuda", 0))


# ----------------------------------------------------------------------------- device discipline
HOST_READS = {"item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host: on a GPU each one waits for
    the device (a boolean-mask index too, which must count its rows)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        bool_index = name == "__getitem__" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        to_host = name == "to" and any(str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values()))
        self.calls += name in HOST_READS or bool_index or to_host
        return func(*args, **(kwargs or {}))


def reads_during(fn, device: str) -> int:
    """Host reads in fn(), and on CUDA also the synchronizations no Python call shows."""
    with HostReads() as reads, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    return reads.calls + sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("budget", [{"steps": 2}, {"epochs": 1}])  # epochs: clients leave the loop unevenly
@pytest.mark.parametrize("executor", ["vectorized", "sequential"])
@pytest.mark.parametrize("algorithm", [a for a in EVERY_ALGORITHM if a != "l2sgd"])  # L2SGD: one step a round
def test_the_local_step_loop_never_reads_values_back(digits6, device, executor, algorithm, budget):
    """A chunk's local work and its evaluation-time personalization read the same number of
    values back to the host whatever the number of local steps (a budget 3x as long): nothing
    inside the step loop waits for the device."""

    def reads_and_compute(scale: int) -> tuple[int, int]:
        local = {key: value * scale for key, value in budget.items()}
        fed = tiny_federation(digits6, algorithm, executor, device, HP.get(algorithm), local=local)
        state = fed.initial_state()
        ids = fed.sample_clients(0)
        payload = fed.algorithm.payload(state.server)
        done = {}

        def work():
            done["update"] = fed.local_update(0, payload, ids, gather(state.clients, ids))
            done["personalize"] = fed.personalized_models(state, ids)[2]

        return reads_during(work, device), done["update"].grad_samples + done["personalize"]

    (short_reads, short_compute), (long_reads, long_compute) = reads_and_compute(1), reads_and_compute(3)
    assert long_compute > short_compute  # the longer budget did run more steps
    assert long_reads == short_reads


def test_a_nonfinite_entry_is_found_and_an_overflowing_sum_of_finite_ones_is_not(digits6):
    """The divergence check: any NaN or infinity in any server or client tensor names it;
    finite entries whose sum overflows float32 do not."""
    fed = tiny_federation(digits6, "ditto", "vectorized", "cpu", HP.get("ditto"))
    state = fed.initial_state()
    name, tensor = next((n, t) for n, t in leaves(state.clients) if t.is_floating_point() and t.numel() > 2)
    tensor.fill_(3e38)  # finite: its sum is infinite
    assert fed.nonfinite(state) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        tensor.view(-1)[1] = bad
        assert fed.nonfinite(state) == f"clients.{name}"
    tensor.view(-1)[0] = float("inf")  # inf - inf: a NaN sum
    tensor.view(-1)[1] = -float("inf")
    assert fed.nonfinite(state) == f"clients.{name}"
