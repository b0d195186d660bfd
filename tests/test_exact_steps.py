"""Exact, hand-computed steps of L2SGD, FedPer, FedRep and FedDyn, run through the engine.

Each expectation is written from the paper's equations (as the module's docstring states
them) in float64 and compared to the engine's float32 numbers; every test also checks that
the terms it pins move the result by far more than its tolerance, so that dropping a term or
flipping a sign fails it.
"""

import pytest
import torch

from conftest import least_squares_clients, regression_data, split_from, tiny_params
from pfl_tasks.algorithms import build
from pfl_tasks.config import LocalConfig, OptimizerConfig, parse_params
from pfl_tasks.data import FederatedData
from pfl_tasks.engine.executor import batch_schedule
from pfl_tasks.engine.federation import Federation, RunState
from pfl_tasks.engine.state import gather
from pfl_tasks.engine.rounds import InlineSteps, run_round
from pfl_tasks.algorithms.fedrep import HEAD as HEAD_STREAM
from pfl_tasks.algorithms.l2sgd import COMMUNICATE
from pfl_tasks.engine.streams import LOCAL, round_generator

EXECUTORS = ["vectorized", "sequential"]
TOL = dict(rtol=1e-5, atol=1e-6)


def federation(data, algorithm, hp, *, model, local, executor="vectorized", seed=0, chunk_size=3, **fed):
    """A federation of `algorithm` on `data` (4 clients: two chunks of the engine)."""
    raw = tiny_params(model=model, local=local, federation={"rounds": 10, **fed})
    raw["seed"] = seed
    exp = parse_params(raw).experiment("tiny")
    exp = exp.model_copy(update={"engine": exp.engine.model_copy(update={"executor": executor,
                                                                         "chunk_size": chunk_size})})
    return Federation(exp, build(algorithm, hp), data)


def close(actual, expected, **tol):
    torch.testing.assert_close(actual.double(), expected.double(), **{**TOL, **tol})


def far(a, b, margin=1e-3):
    """`a` and `b` differ by far more than the tolerance (a mutated term would be seen)."""
    assert (a.double() - b.double()).abs().max() > margin, "the pinned term is too small to be seen"


# ============================================================================= L2SGD
# Hanzely & Richtarik, arXiv:2002.05516, as l2sgd.py's docstring states it: each round, with
# probability 1 - p (one coin for all clients, from the stream `l2sgd/communicate`)
#     x_k <- x_k - lr / (K (1 - p)) grad f_k(x_k),
# else x_k <- x_k - lr lam / (K p) (x_k - mean_j x_j).
L2 = {"lam": 2.0, "p": 0.3, "lr": 0.2}  # lam != 1, p != 1/2 and K = 4: each factor is seen


def l2sgd_coins(seed, p, n):
    """Whether each round averages, as the module's declared stream draws it."""
    return [bool(round_generator(seed, r, COMMUNICATE).random() < p) for r in range(n)]


def l2sgd_federation(hp=L2, seed=0, executor="vectorized"):
    xs, ys = least_squares_clients()
    # full-batch f_k; the local lr is not L2SGD's (uses_local_lr = False): a wrong one is given
    fed = federation(regression_data(xs, ys), "l2sgd", hp, model={"kind": "linear", "bias": False},
                     local={"steps": 7, "batch_size": None, "optimizer": {"lr": 0.05}},
                     executor=executor, seed=seed)
    return [x.double() for x in xs], [y.double() for y in ys], fed


def lsq_grad(x, y, w):
    """grad of f_k(w) = mean_i (x_i w - y_i)^2."""
    return 2 * x.T @ (x @ w - y) / len(y)


def spread_state(fed, seed=1):
    """The initial state with every client's model moved apart (pending: no averaging due)."""
    state = fed.initial_state()
    gen = torch.Generator().manual_seed(seed)
    params = state.clients["params"]["1.weight"] + torch.randn(state.clients["params"]["1.weight"].shape, generator=gen)
    return RunState(state.round, state.server, {**state.clients, "params": {"1.weight": params}})


def l2sgd_view(fed, state):
    """The iterate x^t of the paper after a round (the averaging step due applied)."""
    return fed.algorithm.personalized(state.server, state.clients)[0]["1.weight"][:, 0]


def l2sgd_local(xs, ys, theta, hp=L2):
    k = len(xs)
    step = hp["lr"] / (k * (1 - hp["p"]))
    return torch.stack([theta[i] - step * lsq_grad(xs[i], ys[i], theta[i]) for i in range(k)])


def l2sgd_average(theta, hp=L2):
    k = len(theta)
    return theta - hp["lr"] * hp["lam"] / (k * hp["p"]) * (theta - theta.mean(0))


@pytest.mark.parametrize("seed, p", [(0, 0.3), (5, 0.8)])
def test_l2sgd_rounds_follow_the_declared_coin_with_probability_p(seed, p):
    """The rounds that average (`pending` after the round) are exactly those whose draw of
    `l2sgd/communicate` (seed, round) is below p; over many rounds their share is p."""
    n = 300
    _, _, fed = l2sgd_federation({**L2, "p": p}, seed=seed)
    state, averaged = fed.initial_state(), []
    for r in range(n):
        state = run_round(InlineSteps(2), fed, state, r)
        averaged.append(bool(state.server["pending"]))
    expected = l2sgd_coins(seed, p, n)
    assert averaged == expected
    assert abs(sum(averaged) / n - p) < 0.08  # 3 standard deviations at n = 300
    assert expected != l2sgd_coins(seed + 1, p, n)  # the sequence is the run seed's


@pytest.mark.parametrize("executor", EXECUTORS)
def test_l2sgd_local_step_is_lr_over_K_one_minus_p_times_the_gradient(executor):
    xs, ys, fed = l2sgd_federation(executor=executor)
    state = spread_state(fed)
    theta = state.clients["params"]["1.weight"][:, 0].double().clone()
    mean_before = state.server["mean"]["1.weight"].clone()
    r = l2sgd_coins(0, L2["p"], 50).index(False)
    after = run_round(InlineSteps(2), fed, state, r)
    expected = l2sgd_local(xs, ys, theta)
    close(after.clients["params"]["1.weight"][:, 0], expected)
    close(l2sgd_view(fed, after), expected)  # no averaging step due after a local step
    assert not bool(after.server["pending"])
    assert torch.equal(after.server["mean"]["1.weight"], mean_before)  # nothing was averaged
    far(expected, theta)
    far(expected, l2sgd_local(xs, ys, theta, {**L2, "p": 1 - L2["p"]}))  # 1 - p, not p, is seen


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("then", ["local", "average"])
def test_l2sgd_averaging_step_is_lr_lam_over_K_p_towards_the_mean(executor, then):
    """An averaging round sends x_k and leaves it; the step x_k - lr lam/(K p) (x_k - mean)
    is what the client is evaluated with, and the next round starts from it."""
    xs, ys, fed = l2sgd_federation(executor=executor)
    coins = l2sgd_coins(0, L2["p"], 200)
    nxt = then == "average"
    r = next(r for r in range(len(coins) - 1) if coins[r] and coins[r + 1] == nxt)
    state = spread_state(fed)
    theta = state.clients["params"]["1.weight"][:, 0].double().clone()
    comm = run_round(InlineSteps(2), fed, state, r)
    assert bool(comm.server["pending"])
    close(comm.server["mean"]["1.weight"][0], theta.mean(0))
    close(comm.clients["params"]["1.weight"][:, 0], theta)  # the step waits for the next round
    averaged = l2sgd_average(theta)
    close(l2sgd_view(fed, comm), averaged)
    far(averaged, theta)
    far(averaged, theta - L2["lr"] / (4 * L2["p"]) * (theta - theta.mean(0)))  # lam is seen
    far(averaged, theta - L2["lr"] * L2["lam"] / (4 * (1 - L2["p"])) * (theta - theta.mean(0)))  # p is seen

    second = run_round(InlineSteps(2), fed, comm, r + 1)
    if then == "local":  # the averaging step, then the local step at the averaged point
        expected = l2sgd_local(xs, ys, averaged)
        close(second.clients["params"]["1.weight"][:, 0], expected)
        close(l2sgd_view(fed, second), expected)
        assert not bool(second.server["pending"])
    else:  # two averaging steps in a row; the mean does not move
        close(second.clients["params"]["1.weight"][:, 0], averaged)
        close(second.server["mean"]["1.weight"][0], theta.mean(0))
        close(l2sgd_view(fed, second), l2sgd_average(averaged))


def test_l2sgd_trajectory_is_the_papers_iteration_under_the_declared_coin():
    """40 rounds from spread-out models: after every round the evaluated models are the
    paper's iterate x^t, computed by hand with the coin of `l2sgd/communicate`."""
    seed, n = 3, 40
    xs, ys, fed = l2sgd_federation(seed=seed)
    coins = l2sgd_coins(seed, L2["p"], n)
    assert 5 <= sum(coins) <= n - 5  # both kinds of step occur
    state = spread_state(fed)
    theta = state.clients["params"]["1.weight"][:, 0].double().clone()
    for r, average in enumerate(coins):
        theta = l2sgd_average(theta) if average else l2sgd_local(xs, ys, theta)
        state = run_round(InlineSteps(2), fed, state, r)
        close(l2sgd_view(fed, state), theta, rtol=1e-4, atol=1e-5)
    far(theta, theta.mean(0), margin=1e-2)  # still personalized: lam = 2 does not force consensus


# ============================================================================= FedPer / FedRep
# Body = layer 1 (Linear 3 -> 4, then ReLU), head = layer 3 (Linear 4 -> 1); squared error.
BODY, HEAD = ("1.weight", "1.bias"), ("3.weight", "3.bias")
SIZES = (6, 10, 9, 13)
SPLIT_TOL = dict(rtol=1e-4, atol=2e-5)  # the pinned terms move the result by more than 1e-3


def representation_data():
    gen = torch.Generator().manual_seed(11)
    xs, ys = [], []
    for k, n in enumerate(SIZES):
        x = torch.randn(n, 3, generator=gen) + 0.3 * k
        ys.append(torch.sin(x[:, 0]) * (k + 1) - x[:, 1] * x[:, 2] + 0.5 * k)
        xs.append(x)
    split = split_from(xs, ys)
    return FederatedData("rep", "regression", 0, (3,), split, split, split, "rep"), xs, ys


def known_start():
    """A known body on the server and a different head on every client."""
    gen = torch.Generator().manual_seed(5)
    body = {"1.weight": torch.randn(4, 3, generator=gen), "1.bias": 0.1 * torch.randn(4, generator=gen)}
    heads = {"3.weight": torch.randn(4, 1, 4, generator=gen), "3.bias": torch.randn(4, 1, generator=gen)}
    return body, heads


def mlp_loss(p, x, y):
    h = torch.relu(x @ p["1.weight"].T + p["1.bias"])
    return ((h @ p["3.weight"].T + p["3.bias"]).squeeze(-1) - y).pow(2).mean()


def sgd(p, batches, keys, lr):
    """Plain SGD on `keys` only, one step per batch (x, y)."""
    p = {k: v.clone() for k, v in p.items()}
    for x, y in batches:
        live = {k: v.detach().requires_grad_(k in keys) for k, v in p.items()}
        grads = torch.autograd.grad(mlp_loss(live, x, y), [live[k] for k in keys])
        p = {**p, **{k: live[k].detach() - lr * g for k, g in zip(keys, grads)}}
    return p


def batches_of(fed, xs, ys, local, stream, round_idx):
    """Each client's minibatches as the engine's schedule draws them for `stream`."""
    counts = torch.tensor(SIZES)
    sched = batch_schedule(counts, torch.arange(len(SIZES)), local, fed.exp.seed, round_idx, stream.number)
    out = []
    for k in range(len(SIZES)):
        steps = int(sched.active[k].sum())
        rows = [sched.index[k, s][sched.mask[k, s]] for s in range(steps)]
        out.append([(xs[k][r].double(), ys[k][r].double()) for r in rows])
    return out


def federated_round(fed, state, r):
    """`run_round`, with a look at what travels: the payload and each chunk's message."""
    ids = fed.sample_clients(r)
    payload = fed.algorithm.payload(state.server)
    assert set(payload) == {"body"} and set(payload["body"]) == set(BODY)  # no head goes down
    results = [fed.local_update(r, payload, chunk, gather(state.clients, chunk)) for chunk in fed.chunks(ids)]
    for result in results:
        assert set(result.messages) == {"body"} and set(result.messages["body"]) == set(BODY)  # none goes up
        assert set(result.clients) == {"head"} and set(result.clients["head"]) == set(HEAD)
    new = fed.aggregate(state, results)
    assert set(new.server) == {"body"} and set(new.server["body"]) == set(BODY)
    return new


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("batch_size", [None, 4])
@pytest.mark.parametrize("algorithm", ["fedper", "fedrep"])
def test_split_methods_two_rounds_by_hand(algorithm, batch_size, executor):
    """FedPer: body and head trained together from [server body, own head]. FedRep: the head
    for `head_epochs` epochs (stream `fedrep/head`) with the body frozen, then the body for
    the local budget (stream `local`) with the head frozen. Both: the server's body is the
    n_k-weighted mean of the trained bodies; every head stays on its client."""
    data, xs, ys = representation_data()
    lr, steps, head_epochs = 0.1, 3, 2
    local = {"steps": steps, "batch_size": batch_size, "optimizer": {"lr": lr}}
    hp = {"head_epochs": head_epochs} if algorithm == "fedrep" else {}
    fed = federation(data, algorithm, hp, model={"kind": "mlp", "hidden": [4]}, local=local, executor=executor)
    body, heads = known_start()
    state = RunState(0, {"body": {k: v.clone() for k, v in body.items()}},
                     fed.place({"head": {k: v.clone() for k, v in heads.items()}}))
    body = {k: v.double() for k, v in body.items()}
    heads = [{k: v[i].double() for k, v in heads.items()} for i in range(len(SIZES))]
    weights = torch.tensor(SIZES, dtype=torch.float64) / sum(SIZES)
    head_local = LocalConfig(steps=None, epochs=head_epochs, batch_size=batch_size, optimizer=OptimizerConfig(lr=lr))

    for r in range(2):
        body_batches = batches_of(fed, xs, ys, fed.exp.local, LOCAL, r)
        head_batches = batches_of(fed, xs, ys, head_local, HEAD_STREAM, r)
        trained = []
        for k in range(len(SIZES)):
            p = {**body, **heads[k]}
            if algorithm == "fedper":
                p = sgd(p, body_batches[k], BODY + HEAD, lr)
            else:
                assert len(head_batches[k]) == head_epochs * -(-SIZES[k] // (batch_size or SIZES[k]))
                p = sgd(p, head_batches[k], HEAD, lr)
                p = sgd(p, body_batches[k], BODY, lr)
            trained.append(p)
        new_body = {k: sum(w * t[k] for w, t in zip(weights, trained)) for k in BODY}
        far(new_body["1.weight"], sum(t["1.weight"] for t in trained) / len(trained))  # n_k weights seen
        for k in range(len(SIZES)):
            far(trained[k]["3.weight"], heads[k]["3.weight"])  # the head did train
        body, heads = new_body, [{h: t[h] for h in HEAD} for t in trained]
        state = federated_round(fed, state, r)
        for key in BODY:  # float32 steps of up to 14 minibatches: rounding grows to ~5e-6
            close(state.server["body"][key], body[key], **SPLIT_TOL)
        for key in HEAD:
            close(state.clients["head"][key], torch.stack([h[key] for h in heads]), **SPLIT_TOL)
    # the evaluated models: the server's body with each client's own head
    models, stacked = fed.algorithm.personalized(state.server, state.clients)
    assert stacked
    close(models["3.weight"], torch.stack([h["3.weight"] for h in heads]), **SPLIT_TOL)
    close(models["1.weight"][2], body["1.weight"], **SPLIT_TOL)


def test_fedrep_head_and_body_phases_differ_from_fedper_and_from_each_other():
    """The hand computation above tells the three orders apart on this data (a sanity check of
    the test: training jointly, head then body, or body then head give different bodies)."""
    data, xs, ys = representation_data()
    body, heads = known_start()
    x, y = xs[0].double(), ys[0].double()
    p = {**{k: v.double() for k, v in body.items()}, **{k: v[0].double() for k, v in heads.items()}}
    batches = [(x, y)] * 3
    joint = sgd(p, batches, BODY + HEAD, 0.1)
    head_first = sgd(sgd(p, batches, HEAD, 0.1), batches, BODY, 0.1)
    body_first = sgd(sgd(p, batches, BODY, 0.1), batches, HEAD, 0.1)
    far(joint["1.weight"], head_first["1.weight"])
    far(head_first["1.weight"], body_first["1.weight"])


# ============================================================================= FedDyn
# Acar et al., ICLR 2021, as feddyn.py's docstring states it, at the DEFAULT alpha: client k
# runs the local budget on f_k(theta) - <g_k, theta> + alpha/2 ||theta - theta_s||^2 from
# theta_s, then g_k <- g_k - alpha (theta_k - theta_s); the server
#     h <- h - alpha/K sum_{k in S} (theta_k - theta_s),  theta_s <- mean_S theta_k - h/alpha.
def feddyn_by_hand(xs, ys, theta_s, g, h, ids, alpha, lr, steps, n_clients, drop=()):
    """One round of FedDyn on full-batch least squares, every number by hand; `drop` names
    terms to leave out (to show the test sees each of them)."""
    thetas, new_g = {}, dict(g)
    for k in ids:
        w = theta_s.clone()
        for _ in range(steps):
            grad = lsq_grad(xs[k], ys[k], w)
            if "linear" not in drop:
                grad = grad - g[k]
            if "prox" not in drop:
                grad = grad + alpha * (w - theta_s)
            w = w - lr * grad
        thetas[k] = w
        new_g[k] = g[k] - alpha * (w - theta_s)
    drift = sum(thetas[k] - theta_s for k in ids)
    h = h - alpha / n_clients * drift
    mean = sum(thetas.values()) / len(ids)
    theta = mean if "h" in drop else mean - h / alpha
    return theta, new_g, h, thetas


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("per_round", [4, 2])
def test_feddyn_three_rounds_at_default_alpha_by_hand(per_round, executor):
    """Full participation, and 2 of 4 clients a round (h's 1/K is then over all K clients,
    the mean over the reporting ones, and the unsampled clients' g_k stay as they were)."""
    xs, ys = least_squares_clients(sizes=(12, 20, 16, 24))
    lr, steps = 0.05, 10
    fed = federation(regression_data(xs, ys), "feddyn", {}, model={"kind": "linear", "bias": False},
                     local={"steps": steps, "batch_size": None, "optimizer": {"lr": lr}},
                     executor=executor, clients_per_round=per_round)
    alpha = fed.algorithm.hp.alpha
    assert alpha == 0.01  # the default, the paper's most used value (feddyn.py docstring)
    xs, ys = [x.double() for x in xs], [y.double() for y in ys]
    state = fed.initial_state()
    theta = state.server["global"]["1.weight"][0].double()
    g = {k: torch.zeros(3, dtype=torch.float64) for k in range(4)}
    h = torch.zeros(3, dtype=torch.float64)
    seen = set()
    for r in range(3):
        ids = fed.sample_clients(r).tolist()
        args = (xs, ys, theta, g, h, ids, alpha, lr, steps, 4)
        new_theta, new_g, new_h, thetas = feddyn_by_hand(*args)
        # each term moves the result by far more than the tolerance, at alpha = 0.01
        for term in ("prox", "h") + (("linear",) if r else ()):
            other = feddyn_by_hand(*args, drop=(term,))
            far(new_theta, other[0], 1e-3)
        state = run_round(InlineSteps(2), fed, state, r)
        close(state.server["global"]["1.weight"][0], new_theta)
        close(state.server["h"]["1.weight"][0], new_h, atol=1e-7)
        for k in range(4):
            close(state.clients["grad"]["1.weight"][k, 0], new_g[k], atol=1e-7)
        theta, g, h = new_theta, new_g, new_h
        seen |= set(ids)
    assert any(g[k].abs().max() > 1e-3 for k in range(4))
    if per_round < 4:
        assert len(seen) == 4
