"""Each algorithm reaches its own objective's optimum on least squares with a closed form."""

import pytest
import torch

from conftest import assert_rel_close, lsq_federation, pooled_least_squares


def test_fedavg_full_batch_converges_to_pooled_least_squares():
    xs, ys, fed, state = lsq_federation("fedavg")
    assert_rel_close(state.server["global"]["1.weight"][0], pooled_least_squares(xs, ys))


def test_fedavg_uniform_weighting_converges_to_client_mean_objective():
    xs, ys, fed, state = lsq_federation("fedavg", {"weighting": "uniform"})
    expected = pooled_least_squares(xs, ys, weights=[1] * len(xs))
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
