"""What one federated round costs, for every registered algorithm, derived by hand from the
algorithm's steps (its module docstring and paper), never from another executor's count.

Units of the engine: compute is samples x forward-backward passes, summed over clients
(`RunState.grad_samples` for a round, `Evaluation.grad_samples` for local work at evaluation
time); communication is the bytes of the tensors sent, all clients together (`RunState.bytes_up`
for the messages, `bytes_down` for what each client receives), float32 here: 4 bytes a number.

The setup: an MLP 3 -> 4 -> 3 (P = 31 parameters: a body of 16, a head of 15), 4 clients of 5,
9, 12 and 20 training samples, batches of 8 (5 for the smallest client), 2 local steps a round,
full participation, 2 chunks (3 + 1 clients). The multipliers (fits, inner steps, epochs,
stages) differ from one another, so dropping or doubling any one recorded pass or message field
changes a pinned number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch.func import grad

from conftest import split_from, tiny_params
from pfl_tasks.algorithms import ALGORITHMS, build
from pfl_tasks.config import parse_params
from pfl_tasks.data import FederatedData
from pfl_tasks.engine.federation import Federation, RunState
from pfl_tasks.engine.executor import clientwise
from pfl_tasks.engine.rounds import InlineSteps, run_round
from pfl_tasks.engine.state import broadcast
from pfl_tasks.algorithms.l2sgd import COMMUNICATE
from pfl_tasks.engine.streams import round_generator

COUNTS = (5, 9, 12, 20)  # training samples per client
FEATURES, HIDDEN, CLASSES = 3, 4, 3
BATCH, STEPS, SEED = 8, 2, 0
FLOAT = 4  # bytes of a float32

K = len(COUNTS)  # clients in a round: all of them
BODY = FEATURES * HIDDEN + HIDDEN  # layer 1: 16 parameters
HEAD = HIDDEN * CLASSES + CLASSES  # layer 3, the last: 15
P = BODY + HEAD  # 31
ENCODER = 2 * HIDDEN * HIDDEN + 2 * HIDDEN  # FedCR's Linear(H, 2H) from features to [mu, s]: 40


def batch(n: int) -> int:
    return min(BATCH, n)  # a client smaller than the batch uses all its samples


STEP = sum(batch(n) for n in COUNTS)  # rows of one local step, all clients: 5 + 8 + 8 + 8 = 29
EPOCH = sum(-(-n // batch(n)) * batch(n) for n in COUNTS)  # ceil(n / b) full batches each: 5 + 16 + 16 + 24 = 61
FIT = STEPS * STEP  # one fit of the round's local budget: 58 samples x passes
MODEL = K * FLOAT * P  # one model per client


@dataclass(frozen=True)
class Cost:
    compute: int  # grad_samples of the round
    up: int  # bytes, clients -> server
    down: int  # bytes, server -> clients
    evaluation: int = 0  # grad_samples of evaluating every client after it (fine-tuning)


def split_clusters(state: RunState) -> None:
    """CFL after a split: clients 2 and 3 form a second cluster (both start from the same model)."""
    state.server["cluster"] = torch.tensor([0, 0, 1, 1])
    state.server["n_clusters"] = torch.tensor(2)


# (id, algorithm, hyper-parameters, cost of round 0, optional edit of the initial state)
CASES = [
    # McMahan et al., Alg. 1: local SGD from w, w_k up, w down
    ("fedavg", "fedavg", {}, Cost(FIT, MODEL, MODEL), None),
    # FedAvg with a proximal term: the same single fit, the same messages
    ("fedprox", "fedprox", {"mu": 0.5}, Cost(FIT, MODEL, MODEL), None),
    # trained as FedAvg; each evaluation fine-tunes every client's copy of w, 3 one-epoch stages
    ("fedavg_ft", "fedavg_ft", {"ft_epochs": 3}, Cost(FIT, MODEL, MODEL, evaluation=3 * EPOCH), None),
    # trained as FedProx; 3 stages of ft_steps = 5 steps
    ("fedprox_ft", "fedprox_ft", {"ft_epochs": 3, "ft_steps": 5},
     Cost(FIT, MODEL, MODEL, evaluation=3 * 5 * STEP), None),
    # one fit of the own model; nothing sent either way
    ("local", "local", {}, Cost(FIT, 0, 0), None),
    # Ditto Alg. 1: UpdateGlobal (a FedAvg fit from theta) AND s steps on the personal model: two fits
    ("ditto", "ditto", {}, Cost(2 * FIT, MODEL, MODEL), None),
    # FedPer: one fit of [body, head]; only the body goes up and down, the head stays home
    ("fedper", "fedper", {}, Cost(FIT, K * FLOAT * BODY, K * FLOAT * BODY), None),
    # FedRep Alg. 1: tau_h = 3 epochs of the head (body frozen), then the local budget on the body
    ("fedrep", "fedrep", {"head_epochs": 3}, Cost(3 * EPOCH + FIT, K * FLOAT * BODY, K * FLOAT * BODY), None),
    # APFL Alg. 1: per local step, grad f(theta) and grad f(mixture): two passes; theta up, theta down
    ("apfl", "apfl", {}, Cost(2 * FIT, MODEL, MODEL), None),
    # with averaged iterates the client also receives sum_t p_t theta_t and sum_t p_t (catch-up)
    ("apfl[average_iterates]", "apfl", {"average_iterates": True},
     Cost(2 * FIT, MODEL, K * FLOAT * (2 * P + 1)), None),
    # CFL Alg. 1: one fit from the cluster's model (a row per client down), dW_i up
    ("cfl", "cfl", {}, Cost(FIT, MODEL, MODEL), None),
    ("cfl[after a split]", "cfl", {}, Cost(FIT, MODEL, MODEL), split_clusters),
    # FPFC: one fit of f_i + rho/2 ||w - zeta_i||^2; zeta_i down (its own row), omega_i up
    ("fpfc", "fpfc", {}, Cost(FIT, MODEL, MODEL), None),
    # kNN-Per: FedAvg training; the datastore at evaluation is a forward pass only (no backward)
    ("knnper", "knnper", {}, Cost(FIT, MODEL, MODEL), None),
    # lp-proj: local_rounds = 3 fits of x_i; w_i (dim = 5 floats) up, w down
    ("lp_proj", "lp_proj", {"dim": 5, "local_rounds": 3}, Cost(3 * FIT, K * FLOAT * 5, K * FLOAT * 5), None),
    # pFedMe Alg. 1: per local step, inner_steps = 3 gradient steps of the prox problem; omega up, w down
    ("pfedme", "pfedme", {"inner_steps": 3}, Cost(3 * FIT, MODEL, MODEL), None),
    # pFedMac: per local step, inner_steps = 5 proximal-gradient steps on omega; theta up, theta down
    ("pfedmac", "pfedmac", {"inner_steps": 5}, Cost(5 * FIT, MODEL, MODEL), None),
    # FedDyn Alg. 1: one fit of the dynamic-regularized problem; theta_k up, theta down (h stays)
    ("feddyn", "feddyn", {"alpha": 0.1}, Cost(FIT, MODEL, MODEL), None),
    # FedCR: one pass a step (the body once; the head on `samples` z draws of the same pass);
    # up: body, encoder, local PoE precision and precision-weighted mean [C, H] each, present [C];
    # down: body, encoder, the global class posterior's mean and variance [C, H] each
    ("fedcr", "fedcr", {},
     Cost(FIT, K * FLOAT * (BODY + ENCODER + 2 * CLASSES * HIDDEN + CLASSES),
          K * FLOAT * (BODY + ENCODER + 2 * CLASSES * HIDDEN)), None),
]
# "vectorized-generic": the vectorized executor on its paths for any net (vmap and autograd),
# which the MLP otherwise skips for its hand-written stacked passes
EXECUTORS = ["vectorized", "vectorized-generic", "sequential"]


@pytest.fixture(autouse=True)
def executor_paths(request, monkeypatch):
    if getattr(request.node, "callspec", None) and request.node.callspec.params.get("executor") == "vectorized-generic":
        monkeypatch.setattr("pfl_tasks.engine.executor.stackable", lambda net: False)


def dataset() -> FederatedData:
    """Random features and labels: costs depend on the counts alone."""
    gen = torch.Generator().manual_seed(0)

    def split(counts):
        xs = [torch.randn(n, FEATURES, generator=gen) for n in counts]
        return split_from(xs, [torch.randint(0, CLASSES, (n,), generator=gen) for n in counts])

    return FederatedData("costs", "classification", CLASSES, (FEATURES,), split(COUNTS), split([3] * K),
                         split([3] * K), "costs")


DATA = dataset()


def federation(algorithm: str, hp: dict, executor: str, **federation_overrides) -> Federation:
    params = parse_params(tiny_params(
        model={"kind": "mlp", "hidden": [HIDDEN]},
        local={"steps": STEPS, "batch_size": BATCH, "optimizer": {"lr": 0.1}},
        federation={"rounds": 1, **federation_overrides},
    ))
    exp = params.experiment("tiny").model_copy(
        update={"engine": params.engine.model_copy(update={"executor": executor.split("-")[0], "chunk_size": 3})})
    return Federation(exp, build(algorithm, hp), DATA)


def one_round(fed: Federation, edit: Callable[[RunState], None] | None = None, round_idx: int = 0) -> RunState:
    state = fed.initial_state()
    if edit is not None:
        edit(state)
    return run_round(InlineSteps(1), fed, state, round_idx)


def test_the_setup_is_what_the_formulas_say():
    assert (P, BODY, HEAD, STEP, EPOCH) == (31, 16, 15, 29, 61)
    params = federation("fedavg", {}, "vectorized").initial_state().server["global"]
    assert sum(v.numel() for v in params.values()) == P and params["3.weight"].shape == (CLASSES, HIDDEN)


def test_every_registered_algorithm_is_pinned():
    pinned = {algorithm for _, algorithm, *_ in CASES} | {"l2sgd"}  # l2sgd: its own tests below
    assert pinned == set(ALGORITHMS) - {"learn2pfed"}  # Learn2pFed has no rounds (test_learn2pfed pins it)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("algorithm,hp,cost,edit", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_one_round_costs_what_the_algorithm_computes_and_sends(algorithm, hp, cost, edit, executor):
    fed = federation(algorithm, hp, executor)
    after = one_round(fed, edit)
    assert after.reported == K
    assert (after.grad_samples, after.bytes_up, after.bytes_down) == (cost.compute, cost.up, cost.down)
    assert fed.evaluate(after).grad_samples == cost.evaluation
    if edit is split_clusters:  # the round ran with two clusters
        assert int(after.server["n_clusters"]) == 2 and after.server["cluster"].tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_only_sampled_clients_train_and_every_client_is_fine_tuned(executor):
    fed = federation("fedavg_ft", {"ft_epochs": 3}, executor, clients_per_round=2)
    ids = fed.sample_clients(0).tolist()
    after = one_round(fed)
    sampled = [COUNTS[i] for i in ids]
    assert len(ids) == after.reported == 2
    assert after.grad_samples == STEPS * sum(batch(n) for n in sampled)
    assert after.bytes_up == after.bytes_down == 2 * FLOAT * P
    assert fed.evaluate(after).grad_samples == 3 * EPOCH  # evaluation personalizes all 4 clients


# ----------------------------------------------------------------------------- L2SGD
def coin_round(communicates: bool, p: float = 0.5) -> int:
    """The first round whose shared coin (`l2sgd/communicate`) averages, or takes a local step."""
    return next(r for r in range(100)
                if (round_generator(SEED, r, COMMUNICATE).random() < p) == communicates)


def pending(value: float) -> Callable[[RunState], None]:
    """The state after a round that averaged (1: the averaging step is due) or stepped (0)."""

    def edit(state: RunState) -> None:
        state.server["pending"] = torch.tensor(value)

    return edit


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("due", [0.0, 1.0], ids=["after a local step", "after an averaging"])
@pytest.mark.parametrize("communicates", [False, True], ids=["local step", "averaging"])
def test_l2sgd_round_is_one_local_step_or_one_model_up(communicates, due, executor):
    """With probability 1 - p one local SGD step of every client (one batch each, nothing sent);
    with probability p every client sends theta_k and computes nothing; the due averaging step
    (theta_k moves towards the mean) computes no gradient."""
    fed = federation("l2sgd", {}, executor)
    after = one_round(fed, pending(due), coin_round(communicates))
    assert after.grad_samples == (0 if communicates else STEP)
    assert after.bytes_up == (MODEL if communicates else 0)
    assert int(after.server["pending"]) == communicates
    assert fed.evaluate(after).grad_samples == 0


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("due", [0.0, 1.0], ids=["after a local step", "after an averaging"])
def test_l2sgd_sends_the_mean_down_only_when_an_averaging_step_is_due(due, executor):
    """The averaging step of round r - 1 is applied at the start of round r: the mean goes down
    then, once, and nothing goes down in a round that follows a local step."""
    fed = federation("l2sgd", {}, executor)
    after = one_round(fed, pending(due), coin_round(False))
    assert after.bytes_down == (MODEL if due else 0)


def unmarked(data_loss, params, aux):
    """An objective with neither `penalized` nor `clientwise`: autograd on the whole stack."""
    return data_loss(params) + 0.5 * sum((v**2).sum() for v in params.values())


@clientwise
def loss_step(carry, data_loss, aux, batch):
    """A clientwise step that differentiates the data loss itself (no `data_grad`): one pass."""
    g = grad(data_loss)(carry)
    return {k: v - 0.1 * g[k] for k, v in carry.items()}


def custom_step(carry, data_loss, aux, batch):
    """A step with a loss of its own on the batch (FedCR's way), through `batch.grad`: one pass."""
    def loss(p):
        return sum(((v - batch.x.mean()) ** 2).sum() for v in p.values())

    g = batch.grad(loss)(carry)
    return {k: v - 0.1 * g[k] for k, v in carry.items()}


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_method_of_ones_own_is_counted_on_every_path(executor):
    """The engine counts the passes of any local work, not only the registered methods': an
    unmarked objective, a clientwise step that calls the data loss, a step with its own loss."""
    from pfl_tasks.engine.executor import make_trainer

    fed = federation("fedavg", {}, executor)
    params = broadcast(fed.initial_state().server["global"], K)
    for work in (lambda t: t.fit(params, unmarked), lambda t: t.scan(params, loss_step),
                 lambda t: t.scan(params, custom_step)):
        trainer = make_trainer(executor.split("-")[0], fed.fresh_net(), fed.task, fed.train, torch.arange(K),
                               fed.exp.local, 0, 0)
        work(trainer)
        assert trainer.grad_samples == FIT
