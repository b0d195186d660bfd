"""The vectorized executor against the sequential reference, and the engine's building blocks."""

import pytest
import torch

from conftest import run_rounds, tiny_federation, tiny_params
from pfl_tasks.algorithms import ALGORITHMS
from pfl_tasks.config import parse_params
from pfl_tasks.engine.executor import SequentialTrainer, VectorizedTrainer, batch_schedule
from pfl_tasks.engine.state import tree_map


def run(data, algorithm, executor, rounds=3, hp=None, device="cpu", **overrides):
    fed = tiny_federation(data, algorithm, executor, device, hp, **overrides)
    return fed, run_rounds(fed, fed.initial_state(), 0, rounds)


def assert_trees_close(a, b, atol=1e-5):
    flat_a, flat_b = [], []
    tree_map(flat_a.append, a)
    tree_map(flat_b.append, b)
    assert len(flat_a) == len(flat_b) > 0
    for x, y in zip(flat_a, flat_b):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "local"])
@pytest.mark.parametrize("local", [
    {},
    {"optimizer": {"momentum": 0.9, "weight_decay": 1e-3}},
    {"epochs": 1, "optimizer": {"name": "adam", "lr": 0.01}},
])
def test_vectorized_equals_sequential(digits6, algorithm, local, device):
    fed, vec = run(digits6, algorithm, "vectorized", local=local, device=device)
    _, seq = run(digits6, algorithm, "sequential", local=local, device=device)
    _, start = run(digits6, algorithm, "sequential", rounds=0, local=local, device=device)
    vec_model, _ = fed.algorithm.personalized(vec.server, vec.clients)
    seq_model, _ = fed.algorithm.personalized(seq.server, seq.clients)
    start_model, _ = fed.algorithm.personalized(start.server, start.clients)
    assert_trees_close(vec_model, seq_model)
    assert vec.grad_samples == seq.grad_samples > 0  # the same compute, counted either way
    assert (vec_model["3.weight"] - start_model["3.weight"]).abs().max() > 1e-3  # it trained


def test_fedprox_differs_from_fedavg_when_mu_positive(digits6):
    _, avg = run(digits6, "fedavg", "vectorized")
    _, prox = run(digits6, "fedprox", "vectorized")
    diff = (avg.server["global"]["3.weight"] - prox.server["global"]["3.weight"]).abs().max()
    assert diff > 1e-4


def test_local_only_equals_independent_training_per_client(digits6):
    """Each client's Local-only model (vectorized, chunked beside others) is exactly what a
    plain torch loop over that client's data alone produces."""
    fed, together = run(digits6, "local", "vectorized")
    exp = parse_params(tiny_params()).experiment("tiny")
    init = fed.initial_state().clients["params"]
    for k in range(6):
        params = {name: value[k:k + 1] for name, value in init.items()}
        for r in range(3):
            alone = SequentialTrainer(fed.fresh_net(), "classification", digits6.train,
                                      torch.tensor([k]), exp.local, exp.seed, r)
            params = alone.fit(params)
        for name, value in params.items():
            torch.testing.assert_close(together.clients["params"][name][k], value[0], atol=1e-5, rtol=1e-4)


def test_batches_stay_inside_each_client_and_are_reproducible():
    counts = torch.tensor([5, 40, 17])
    ids = torch.tensor([3, 8, 9])
    local = parse_params(tiny_params()).experiment("tiny").local
    a = batch_schedule(counts, ids, local, seed=0, round_idx=2, stream=0)
    b = batch_schedule(counts, ids, local, seed=0, round_idx=2, stream=0)
    c = batch_schedule(counts, ids, local, seed=0, round_idx=3, stream=0)
    assert torch.equal(a.index, b.index) and not torch.equal(a.index, c.index)
    for k, n in enumerate(counts.tolist()):
        assert (a.index[k][a.mask[k]] < n).all()
        assert a.mask[k].sum(-1).tolist() == [min(16, n)] * 3
    # a client's draws do not depend on who else is in its chunk
    alone = batch_schedule(counts[1:2], ids[1:2], local, seed=0, round_idx=2, stream=0)
    assert torch.equal(alone.index[0], a.index[1][:, :16])
    # draws are whole epochs: every row once before any row twice
    for k, n in enumerate(counts.tolist()):
        drawn = a.index[k][a.mask[k]]
        for epoch in drawn[: len(drawn) // n * n].view(-1, n):
            assert sorted(epoch.tolist()) == list(range(n))
        assert len(set(drawn[len(drawn) // n * n:].tolist())) == len(drawn) % n
    assert not torch.equal(a.index[1], batch_schedule(counts, ids, local, 0, 2, stream=1).index[1])


def test_epochs_budget_gives_each_client_its_own_step_count():
    local = parse_params(tiny_params(local={"epochs": 2})).experiment("tiny").local
    sched = batch_schedule(torch.tensor([5, 40]), torch.tensor([0, 1]), local, 0, 0, 0)
    assert sched.active.sum(1).tolist() == [2, 6]  # 2 * ceil(n / min(16, n))


@pytest.mark.parametrize("budget", [{}, {"epochs": 1}], ids=["steps", "epochs"])  # epochs: uneven step counts
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_vectorized_equals_sequential_for_every_algorithm(digits6, algorithm, device, budget):
    hp = {"feddyn": {"alpha": 0.1}}.get(algorithm, {})
    fed, vec = run(digits6, algorithm, "vectorized", hp=hp, device=device, local=budget)
    _, seq = run(digits6, algorithm, "sequential", hp=hp, device=device, local=budget)
    assert vec.grad_samples == seq.grad_samples  # the last round's compute, counted either way
    assert vec.grad_samples > 0 or algorithm == "l2sgd"  # L2SGD's third round only communicates
    for view in (fed.algorithm.personalized, lambda s, c: (fed.algorithm.global_model(s, c), False)):
        a, _ = view(vec.server, vec.clients)
        b, _ = view(seq.server, seq.clients)
        if a is not None:
            assert_trees_close(a, b)


def test_uneven_clients_cost_their_real_steps_and_results_do_not_depend_on_chunking(digits6):
    """Each vectorized step runs only the clients still within their budget, and how clients
    are chunked changes no result."""
    fed = tiny_federation(digits6, "fedavg", local={"epochs": 1})
    ids = torch.arange(6)
    local = fed.exp.local
    sched = batch_schedule(digits6.train.counts, ids, local, 0, 0, 0)
    steps = sched.active.sum(1)
    assert steps.min() < steps.max()  # uneven
    trainer = VectorizedTrainer(fed.fresh_net(), "classification", fed.train, ids, local, 0, 0)
    _, plans = trainer._plan(sched)
    assert [p.width for p in plans] == [int((steps > s).sum()) for s in range(int(steps.max()))]
    assert sum(p.width for p in plans) == steps.sum()  # no masked steps
    runs = [run(digits6, "fedavg", "vectorized", local={"epochs": 1}, chunk_size=c)[1] for c in (1, 4, 6)]
    for other in runs[1:]:
        assert_trees_close(other.server, runs[0].server, atol=1e-6)


@pytest.mark.parametrize("algorithm,views", [("fedavg", 1), ("ditto", 2), ("local", 1)])
def test_evaluation_runs_once_per_distinct_view(digits6, algorithm, views):
    """FedAvg's personalized model is its global one: evaluated once per split, reported for both."""
    fed, state = run(digits6, algorithm, "vectorized", rounds=1, hp={})
    calls, original = [], fed._eval
    fed._eval = lambda *args: calls.append(1) or original(*args)
    result = fed.evaluate(state).metrics
    assert len(calls) == 2 * views * len(fed.chunks(torch.arange(6)))
    assert len(result["val"]["personalized"]["acc"]) == len(result["test"]["personalized"]["acc"]) == 6
