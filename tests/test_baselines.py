from dataclasses import replace
"""Baselines FedAvg+FT, FedProx+FT, kNN-Per, CFL and lp-proj, each against an exact property."""

import pytest
import torch
from torch import nn

from conftest import (
    assert_rel_close, least_squares_clients, lsq_federation, pooled_least_squares, regression_data, split_from,
    tiny_params,
)
from pfl_tasks.algorithms import build
from pfl_tasks.algorithms.lp_proj import projection
from pfl_tasks.config import parse_params
from pfl_tasks.data import FederatedData
from pfl_tasks.engine.federation import Facts
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.rounds import InlineSteps, run_round
from pfl_tasks.algorithms.lp_proj import PROJECTION
from pfl_tasks.engine.streams import run_seed

LEAST_SQUARES = {
    "model": {"kind": "linear", "bias": False}, "steps": 5, "batch_size": None, "optimizer": {"lr": 0.05},
}


def federate(data, algorithm, hp=None, rounds=3, executor="vectorized", model=None, **local):
    """Run `algorithm` on `data` (an MLP and 3 minibatch steps per round unless overridden)."""
    local = {"steps": 3, "batch_size": 8, "optimizer": {"lr": 0.1}, **local}
    params = parse_params(tiny_params(
        model=model or {"kind": "mlp", "hidden": [16]}, federation={"rounds": rounds}, local=local,
    ))
    engine = params.engine.model_copy(update={"executor": executor, "chunk_size": 3})
    exp = params.experiment("tiny").model_copy(update={"engine": engine})
    fed = Federation(exp, build(algorithm, hp or {}), data)
    state = fed.initial_state()
    for r in range(rounds):
        state = run_round(InlineSteps(2), fed, state, r)
    return fed, state


def classification_data(random_labels=False, test_is_train=False, n_clients=4, seed=0):
    """Clients with shifted Gaussian features; labels from one linear teacher, or random."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(3, 8, generator=gen)
    train, test = ([], []), ([], [])
    for k in range(n_clients):
        x = torch.randn(40 + 4 * k, 8, generator=gen) + k
        y = torch.randint(0, 3, (len(x),), generator=gen) if random_labels else (x @ teacher.T).argmax(1)
        half = len(x) // 2
        test_rows = slice(0, half) if test_is_train else slice(half, None)
        for split, rows in ((train, slice(0, half)), (test, test_rows)):
            split[0].append(x[rows])
            split[1].append(y[rows])
    return FederatedData("cls", "classification", 3, (8,), split_from(*train), split_from(*test), split_from(*test), "cls")


# ----------------------------------------------------------------------------- FedAvg+FT / FedProx+FT
@pytest.mark.parametrize("executor", ["vectorized", "sequential"])
def test_fedavg_ft_trains_as_fedavg_and_evaluates_hand_computed_fine_tuning(executor):
    steps, ft_lr = 3, 0.1
    hp = {"ft_steps": steps, "ft_lr": ft_lr, "ft_epochs": 1}  # one stage: fine-tuned, or not
    xs, ys, fed, state = lsq_federation("fedavg_ft", hp, rounds=20, executor=executor)
    _, _, _, avg = lsq_federation("fedavg", rounds=20, executor=executor)
    theta = state.server["global"]["1.weight"][0]
    assert torch.equal(theta, avg.server["global"]["1.weight"][0])
    tuned, stacked, cost = fed.personalized_models(state, torch.arange(4))
    assert cost == steps * sum(len(y) for y in ys)  # full-batch steps: every sample, forward and backward
    metrics = fed.evaluate(state).metrics["test"]
    assert stacked
    for k, (x, y) in enumerate(zip(xs, ys)):
        x, y = x.double(), y.double()
        w = theta.double()
        for _ in range(steps):
            w = w - ft_lr * 2 * x.T @ (x @ w - y) / len(y)
        assert_rel_close(tuned["1.weight"][k, 0], w, tol=1e-5)
        assert (w - theta.double()).norm() > 1e-2 * w.norm()  # fine-tuning moved it
        for view, model in (("personalized", w), ("global", theta.double())):
            mse = ((x @ model - y) ** 2).mean()
            torch.testing.assert_close(metrics[view]["mse"][k].double(), mse, rtol=1e-4, atol=0)


def test_fedprox_ft_trains_as_fedprox_and_long_fine_tuning_reaches_each_clients_optimum():
    hp = {"mu": 0.5, "ft_steps": 400, "ft_lr": 0.1, "ft_epochs": 1}
    xs, ys, fed, state = lsq_federation("fedprox_ft", hp, rounds=10)
    _, _, _, prox = lsq_federation("fedprox", {"mu": 0.5}, rounds=10)
    assert torch.equal(state.server["global"]["1.weight"], prox.server["global"]["1.weight"])
    tuned, _, _ = fed.personalized_models(state, torch.arange(4))
    for k, (x, y) in enumerate(zip(xs, ys)):
        assert_rel_close(tuned["1.weight"][k, 0], pooled_least_squares([x], [y]))


@pytest.mark.parametrize("executor", ["vectorized", "sequential"])
def test_fine_tuning_budget_is_selected_per_client_on_validation(executor):
    """Each client keeps the stage (0 = the global model, then 2 full-batch steps per stage) of
    lowest validation MSE; clients 2 and 3 validate on flipped targets, so fine-tuning hurts them."""
    xs, ys = least_squares_clients()
    val_ys = [y if k < 2 else -y for k, y in enumerate(ys)]
    data = FederatedData("lsq", "regression", 0, (3,), split_from(xs, ys), split_from(xs, val_ys),
                         split_from(xs, ys), "lsq")
    params = parse_params(tiny_params(
        model={"kind": "linear", "bias": False}, federation={"rounds": 5},
        local={"steps": 1, "batch_size": None, "optimizer": {"lr": 0.05}},
    ))
    exp = params.experiment("tiny").model_copy(
        update={"engine": params.engine.model_copy(update={"executor": executor})})
    fed = Federation(exp, build("fedavg_ft", {"ft_steps": 2, "ft_epochs": 4, "ft_lr": 0.05}), data)
    state = fed.initial_state()
    for r in range(5):
        state = run_round(InlineSteps(1), fed, state, r)
    tuned, _, _ = fed.personalized_models(state, torch.arange(4))
    theta = state.server["global"]["1.weight"][0].double()
    chosen = []
    for k, (x, y, yv) in enumerate(zip(xs, ys, val_ys)):
        x, y, yv = x.double(), y.double(), yv.double()
        stages, w = [theta], theta
        for _ in range(4 * 2):
            w = w - 0.05 * 2 * x.T @ (x @ w - y) / len(y)
            if len(stages) < 5 and _ % 2 == 1:
                stages.append(w)
        losses = torch.stack([((x @ m - yv) ** 2).mean() for m in stages])
        chosen.append(int(losses.argmin()))
        assert_rel_close(tuned["1.weight"][k, 0], stages[chosen[-1]], tol=1e-5)
    assert chosen[:2] == [4, 4] and chosen[2] == 0  # the budget differs per client


@pytest.mark.parametrize("algorithm", ["fedavg_ft", "fedprox_ft", "knnper", "cfl", "lp_proj"])
def test_evaluation_is_reproducible_and_the_same_in_both_executors(algorithm):
    data = classification_data()
    hp = {"cfl": {"warmup_rounds": 0}}.get(algorithm, {})
    fed, vec = federate(data, algorithm, hp, rounds=2)
    seq_fed, seq = federate(data, algorithm, hp, rounds=2, executor="sequential")
    first, again, other = (f.evaluate(s).metrics["test"] for f, s in ((fed, vec), (fed, vec), (seq_fed, seq)))
    assert first.keys() == other.keys() and "personalized" in first
    for view, metrics in first.items():
        for name, values in metrics.items():
            assert torch.equal(values, again[view][name])
            torch.testing.assert_close(values, other[view][name], atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- kNN-Per
def test_knnper_with_lam_zero_is_the_global_model():
    fed, state = federate(classification_data(), "knnper", {"lam": 0.0})
    out = fed.evaluate(state).metrics["test"]
    assert torch.equal(out["personalized"]["acc"], out["global"]["acc"])
    torch.testing.assert_close(out["personalized"]["loss"], out["global"]["loss"])


def test_knnper_with_one_neighbour_memorizes_its_training_points():
    data = classification_data(random_labels=True, test_is_train=True)
    fed, state = federate(data, "knnper", {"lam": 1.0, "k": 1})
    out = fed.evaluate(state).metrics["test"]
    assert out["personalized"]["acc"].eq(1).all() and out["personalized"]["loss"].eq(0).all()
    assert out["global"]["acc"].max() < 0.8  # random labels: the global model alone cannot


@pytest.mark.parametrize("temperature", [0.7, None])
@torch.no_grad()
def test_knnper_prediction_is_the_brute_force_mixture(temperature):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 3))
    model = dict(net.named_parameters())
    queries = torch.randn(5, 2)
    stored = torch.cat([torch.randn(4, 2), queries[:2]])  # padding sits on two queries
    labels = torch.tensor([0, 1, 2, 1, 0, 2])
    mask = torch.tensor([True] * 4 + [False] * 2)
    lam, k, t = 0.3, 3, temperature or 4.0  # default: the embedding dimension
    algorithm = build("knnper", {"k": k, "lam": lam, "temperature": temperature})
    embed = net[:2]
    store = {"keys": embed(stored), "labels": labels, "mask": mask}
    got = algorithm.forward(net, {"model": model, "store": store, "lam": torch.tensor(lam)}, queries).exp()
    for query, row in zip(queries, got):
        dist = ((embed(stored[:4]) - embed(query)) ** 2).sum(1)
        near = dist.argsort()[:k]
        weight = torch.exp(-dist[near] / t)
        p_knn = torch.zeros(3).index_add_(0, labels[near], weight) / weight.sum()
        torch.testing.assert_close(row, lam * p_knn + (1 - lam) * net(query).softmax(-1))


def test_knnper_picks_each_clients_lam_on_its_validation_split_only():
    """Validation labels the kNN memorizes (val = train, random labels) pull lam to 1 for every
    client; permuting the test labels changes no lam."""
    data = classification_data(random_labels=True, test_is_train=True)
    fed, state = federate(data, "knnper", {"k": 1})
    lam = fed.personalized_models(state, torch.arange(data.n_clients))[0]["lam"]
    assert lam.eq(1).all()
    scrambled = replace(data, test=replace(data.test, y=data.test.y[torch.randperm(len(data.test.y))]),
                        val=replace(data.val, y=(data.val.y + 1) % 3))
    fed, state = federate(scrambled, "knnper", {"k": 1})
    lam = fed.personalized_models(state, torch.arange(data.n_clients))[0]["lam"]
    assert lam.lt(1).all()  # wrong validation labels: the kNN is distrusted


def test_knnper_refuses_regression_data():
    with pytest.raises(ValueError, match="classification"):
        lsq_federation("knnper", rounds=1)


# ----------------------------------------------------------------------------- CFL
def signed_clients(signs, seed=0):
    """Noise-free least squares towards +target or -target, each client its own inputs."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.tensor([1.0, -2.0, 0.5])
    xs = [torch.randn(40, 3, generator=gen) for _ in signs]
    return xs, [sign * x @ target for sign, x in zip(signs, xs)]


CFL_HP = {"warmup_rounds": 0}  # the scale-free defaults otherwise


@pytest.mark.parametrize("executor", ["vectorized", "sequential"])
def test_cfl_splits_opposite_clients_and_each_cluster_reaches_its_own_optimum(executor):
    xs, ys = signed_clients([1, 1, -1, -1])
    fed, state = federate(regression_data(xs, ys), "cfl", CFL_HP, rounds=60, executor=executor, **LEAST_SQUARES)
    cluster = state.server["cluster"]
    assert int(state.server["n_clusters"]) == 2
    assert cluster[0] == cluster[1] != cluster[2] == cluster[3]
    models, _ = fed.algorithm.personalized(state.server, state.clients)
    for group in ([0, 1], [2, 3]):
        optimum = pooled_least_squares([xs[k] for k in group], [ys[k] for k in group])
        for k in group:
            assert_rel_close(models["1.weight"][k, 0], optimum)
    view = fed.algorithm.global_model(state.server, state.clients)
    torch.testing.assert_close(view["1.weight"], models["1.weight"].mean(0))


def test_cfl_never_splits_identical_clients():
    xs, ys = signed_clients([1])
    _, state = federate(regression_data(xs * 4, ys * 4), "cfl", CFL_HP, rounds=60, **LEAST_SQUARES)
    assert int(state.server["n_clusters"]) == 1 and state.server["cluster"].eq(0).all()
    assert_rel_close(state.server["models"]["1.weight"][0, 0], pooled_least_squares(xs, ys))


OPPOSED = [[2.0, 0.1], [1.0, 0.0], [-2.0, 0.0], [-1.1, -0.1]]  # two groups pulling apart
ORTHOGONAL = [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]  # a zero mean, but no two groups


@pytest.mark.parametrize("hp,updates,senders,splits", [
    ({}, OPPOSED, [0, 1, 2, 3], True),  # mean 0.15 = 0.075 x the largest, 2.0; cross similarity -0.996
    ({"stationarity": 0.05}, OPPOSED, [0, 1, 2, 3], False),  # not yet stationary enough
    ({"max_cross_similarity": -0.999}, OPPOSED, [0, 1, 2, 3], False),  # the halves not apart enough
    ({}, ORTHOGONAL, [0, 1, 2, 3], False),  # any bipartition leaves orthogonal pairs across it
    ({"warmup_rounds": 1}, OPPOSED, [0, 1, 2, 3], False),
    ({}, OPPOSED, [0, 1, 2], False),  # a member did not report
    ({"min_split_size": 5}, OPPOSED, [0, 1, 2, 3], False),  # a cluster of 4 is too small to split
    ({"min_split_size": 4}, OPPOSED, [0, 1, 2, 3], True),
])
def test_cfl_round_by_hand(hp, updates, senders, splits):
    """Split when ||weighted mean dW|| <= stationarity x max ||dW|| and every update of one half
    points away from every update of the other: the halves group the updates that point the
    same way, and each half moves from the parent's model by its own mean. The scale-free test
    gives the same answer for updates 1000 times smaller."""
    for scale in (1.0, 1e-3):
        algorithm = build("cfl", {"warmup_rounds": 0, **hp})
        server = algorithm.init_server({"w": torch.tensor([1.0, 1.0])}, Facts(n_clients=4, local_steps=1))
        ups = scale * torch.tensor(updates)[senders]
        weights = torch.tensor([1.0, 3.0, 2.0, 2.0], dtype=torch.float64)[senders]
        new = algorithm.aggregate(server, {"update": {"w": ups}}, weights, torch.tensor(senders))
        groups = [[0, 1], [2, 3]] if splits else [senders]
        assert int(new["n_clusters"]) == len(groups)
        for group in groups:
            rows = [senders.index(i) for i in group]
            cluster = new["cluster"][group]
            assert cluster.eq(cluster[0]).all()
            step = weights[rows].float() @ ups[rows] / weights[rows].sum().float()
            torch.testing.assert_close(new["models"]["w"][cluster[0]], torch.tensor([1.0, 1.0]) + step)
        assert new["cluster"][0] != new["cluster"][2] if splits else new["cluster"].eq(0).all()
        metrics = algorithm.round_metrics(new)
        assert metrics["cfl/clusters"] == len(groups)
        assert metrics["cfl/max_update_norm"] == pytest.approx(ups.norm(dim=1).max().item())


# ----------------------------------------------------------------------------- lp-proj
def test_lp_proj_reaches_the_minimizer_of_its_envelopes_and_sends_only_p_floats():
    """M_k(w) = min_x f_k(x) + lam/2 ||P x - w||^2 with f_k = 1/2 (x - c_k)^T A_k (x - c_k):
    x_k(w) = (A_k + lam P^T P)^-1 (A_k c_k + lam P^T w), and sum_k (w - P x_k(w)) = 0 at w*."""
    lam, dim = 2.0, 2
    xs, ys, fed, state = lsq_federation("lp_proj", {"lam": lam, "dim": dim, "lr": 0.3}, steps=10, rounds=60)
    proj = projection(run_seed(fed.exp.seed, PROJECTION), dim, 3).double()
    torch.testing.assert_close(proj.norm(dim=1), torch.ones(dim, dtype=torch.float64))
    hess = [2 * x.double().T @ x.double() / len(x) for x in xs]
    opt = [pooled_least_squares([x], [y]) for x, y in zip(xs, ys)]
    inner = [a + lam * proj.T @ proj for a in hess]
    lhs = len(xs) * torch.eye(dim, dtype=torch.float64)
    lhs -= lam * sum(proj @ torch.linalg.solve(b, proj.T) for b in inner)
    w = torch.linalg.solve(lhs, sum(proj @ torch.linalg.solve(b, a @ c) for a, b, c in zip(hess, inner, opt)))
    assert_rel_close(state.server["w"], w)
    for k, (a, b, c) in enumerate(zip(hess, inner, opt)):
        personal = torch.linalg.solve(b, a @ c + lam * proj.T @ w)
        assert_rel_close(state.clients["personal"]["1.weight"][k, 0], personal)
    assert (w - proj @ pooled_least_squares(xs, ys)).norm() > 1e-2 * w.norm()  # not FedAvg's point
    assert state.bytes_up == state.bytes_down == len(xs) * dim * 4  # p float32 each way, not d


def test_lp_proj_one_round_by_hand():
    """From w = 0: two GD steps on f_k(x) + lam/2 ||P x - 0||^2, then w_k = 0 - lr lam (0 - P x_k),
    and the server averages the w_k."""
    lam, dim, lr, eta = 2.0, 2, 0.3, 0.05
    xs, ys, fed, state = lsq_federation("lp_proj", {"lam": lam, "dim": dim, "lr": lr}, steps=2, lr=eta, rounds=1)
    proj = projection(run_seed(fed.exp.seed, PROJECTION), dim, 3).double()
    start = fed.initial_state().clients["personal"]["1.weight"][0, 0].double()
    sent = []
    for k, (x, y) in enumerate(zip(xs, ys)):
        x, y, v = x.double(), y.double(), start
        for _ in range(2):
            v = v - eta * (2 * x.T @ (x @ v - y) / len(y) + lam * proj.T @ (proj @ v))
        assert_rel_close(state.clients["personal"]["1.weight"][k, 0], v, tol=1e-5)
        sent.append(lr * lam * proj @ v)
    assert_rel_close(state.server["w"], sum(sent) / len(sent), tol=1e-5)
