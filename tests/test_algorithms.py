"""Each algorithm reaches its own objective's optimum on least squares with a closed form."""

import pytest
import torch

from conftest import least_squares_clients, regression_data, tiny_params
from flows.train import InlineSteps, run_round
from pfl_tasks.algorithms import build
from pfl_tasks.algorithms.federation import Federation
from pfl_tasks.config import parse_params


def lsq_federation(algorithm, hp=None, steps=1, lr=0.05, rounds=300, executor="vectorized"):
    xs, ys = least_squares_clients()
    data = regression_data(xs, ys)
    params = parse_params(tiny_params(
        model={"kind": "linear", "bias": False},
        federation={"rounds": rounds},
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


def pooled_least_squares(xs, ys):
    x, y = torch.cat(xs).double(), torch.cat(ys).double()
    return torch.linalg.solve(x.T @ x, x.T @ y)


def assert_rel_close(actual, expected, tol=1e-4):
    err = (actual.double() - expected).norm() / expected.norm()
    assert err < tol, f"relative error {err:.2e}"


def test_fedavg_full_batch_converges_to_pooled_least_squares():
    xs, ys, fed, state = lsq_federation("fedavg")
    assert_rel_close(state.server["global"]["1.weight"][0], pooled_least_squares(xs, ys))


def test_fedavg_uniform_weighting_converges_to_client_mean_objective():
    xs, ys, fed, state = lsq_federation("fedavg", {"weighting": "uniform"})
    a = sum(x.double().T @ x.double() / len(x) for x in xs)
    b = sum(x.double().T @ y.double() / len(x) for x, y in zip(xs, ys))
    expected = torch.linalg.solve(a, b)
    assert_rel_close(state.server["global"]["1.weight"][0], expected)
    assert (expected - pooled_least_squares(xs, ys)).norm() > 1e-2  # the weighting matters


@pytest.mark.parametrize("mu", [0.1, 1.0])
def test_fedprox_full_batch_converges_to_the_same_optimum(mu):
    xs, ys, fed, state = lsq_federation("fedprox", {"mu": mu})
    assert_rel_close(state.server["global"]["1.weight"][0], pooled_least_squares(xs, ys))


@pytest.mark.parametrize("executor", ["vectorized", "sequential"])
def test_fedprox_proximal_term_acts_exactly(executor):
    """Two local GD steps: the second carries mu (w1 - w0); checked against hand computation."""
    mu, lr = 0.7, 0.05
    xs, ys, fed, state = lsq_federation("fedprox", {"mu": mu}, steps=2, lr=lr, rounds=1, executor=executor)
    w0 = fed.initial_state().server["global"]["1.weight"][0].double()
    n = sum(len(y) for y in ys)
    expected = torch.zeros_like(w0)
    for x, y in zip(xs, ys):
        x, y = x.double(), y.double()
        grad = lambda w: 2 * x.T @ (x @ w - y) / len(y)  # noqa: E731
        w1 = w0 - lr * grad(w0)
        w2 = w1 - lr * (grad(w1) + mu * (w1 - w0))
        expected += len(y) / n * w2
    assert_rel_close(state.server["global"]["1.weight"][0], expected, tol=1e-5)
    _, _, _, avg = lsq_federation("fedavg", steps=2, lr=lr, rounds=1, executor=executor)
    assert (avg.server["global"]["1.weight"][0].double() - expected).norm() > 1e-4


def test_local_only_reaches_each_clients_own_least_squares():
    xs, ys, fed, state = lsq_federation("local", lr=0.1, rounds=400)
    for k, (x, y) in enumerate(zip(xs, ys)):
        own = pooled_least_squares([x], [y])
        assert_rel_close(state.clients["params"]["1.weight"][k, 0], own)
