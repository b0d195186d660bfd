"""Seed algorithms (shared/seeds/pfl-algorithms.txt), each against its own objective's optimum."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_rel_close, lsq_federation, pooled_least_squares, split_from, tiny_params


def local_hessians(xs, ys):
    """f_k(w) = mean (x w - y)^2 = 1/2 (w - c_k)^T A_k (w - c_k) + const."""
    hess = [2 * x.double().T @ x.double() / len(x) for x in xs]
    opt = [pooled_least_squares([x], [y]) for x, y in zip(xs, ys)]
    return hess, opt


# ----------------------------------------------------------------------------- Ditto
def test_ditto_global_is_fedavg_and_personal_is_the_prox_solution():
    """mu = 0 gives the local optima, growing mu pulls every personal model to theta*."""
    gaps = []
    for mu in (0.0, 0.5, 10.0):
        xs, ys, fed, state = lsq_federation("ditto", {"mu": mu}, rounds=250)
        theta = pooled_least_squares(xs, ys)
        assert_rel_close(state.server["global"]["1.weight"][0], theta)
        hess, opt = local_hessians(xs, ys)
        eye = torch.eye(len(theta), dtype=torch.float64)
        personal = state.clients["personal"]["1.weight"][:, 0]
        for k in range(len(xs)):
            expected = torch.linalg.solve(hess[k] + mu * eye, hess[k] @ opt[k] + mu * theta)
            assert_rel_close(personal[k], expected)
        gaps.append(max((personal[k].double() - theta).norm().item() for k in range(len(xs))))
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 0.5 * gaps[0], gaps


# ----------------------------------------------------------------------------- FedDyn
def test_feddyn_reaches_the_exact_global_optimum_where_fedavg_drifts():
    work = dict(steps=10, lr=0.1, rounds=80)
    xs, ys, _, dyn = lsq_federation("feddyn", {"alpha": 1.0}, **work)
    _, _, _, avg = lsq_federation("fedavg", {"weighting": "uniform"}, **work)
    optimum = pooled_least_squares(xs, ys, weights=[1] * len(xs))  # argmin sum_k f_k
    assert_rel_close(dyn.server["global"]["1.weight"][0], optimum)
    drift = (avg.server["global"]["1.weight"][0].double() - optimum).norm() / optimum.norm()
    assert drift > 1e-2, "FedAvg with the same local work should not reach the optimum"
    # the gradient states sum to zero at the fixed point (server h matches them)
    assert dyn.clients["grad"]["1.weight"].sum(0).abs().max() < 1e-4


# ----------------------------------------------------------------------------- FedPer / FedRep
def shared_representation_clients(n_clients=6, n=240, seed=0):
    """Clients share a feature map B but each labels with its own head W_k."""
    gen = torch.Generator().manual_seed(seed)
    body = torch.randn(4, 8, generator=gen)
    train, test = ([], []), ([], [])
    for _ in range(n_clients):
        head = torch.randn(3, 4, generator=gen) * 3
        x = torch.randn(n, 8, generator=gen)
        y = (torch.relu(x @ body.T) @ head.T).argmax(1)
        for split, rows in ((train, slice(0, n // 2)), (test, slice(n // 2, n))):
            split[0].append(x[rows])
            split[1].append(y[rows])
    from pfl_tasks.data import FederatedData

    return FederatedData("rep", "classification", 3, (8,), split_from(*train), split_from(*test), split_from(*test), "rep")


def run_on(data, algorithm, hp=None, rounds=25):
    from pfl_tasks.algorithms import build
    from pfl_tasks.config import parse_params
    from pfl_tasks.engine.federation import Federation
    from pfl_tasks.engine.rounds import InlineSteps, run_round

    params = parse_params(tiny_params(
        model={"kind": "mlp", "hidden": [16]}, federation={"rounds": rounds},
        local={"steps": 10, "batch_size": 32, "optimizer": {"lr": 0.1}},
    ))
    fed = Federation(params.experiment("tiny"), build(algorithm, hp or {}), data)
    state = fed.initial_state()
    for r in range(rounds):
        state = run_round(InlineSteps(2), fed, state, r)
    return fed, state


@pytest.mark.parametrize("algorithm", ["fedper", "fedrep"])
def test_head_stays_on_client_and_beats_fedavg_when_heads_differ(algorithm):
    data = shared_representation_clients()
    fed, state = run_on(data, algorithm)
    head = {"3.weight", "3.bias"}
    assert not head & set(state.server["body"])
    payload = fed.algorithm.payload(state.server)
    result = fed.local_update(0, payload, torch.arange(6), state.clients)  # all 6 clients: rows = stacks
    assert not head & set(result.messages["body"]) and set(result.clients["head"]) == head
    acc = fed.evaluate(state).metrics["test"]["personalized"]["acc"].mean().item()
    avg_fed, avg_state = run_on(data, "fedavg")
    avg_acc = avg_fed.evaluate(avg_state).metrics["test"]["personalized"]["acc"].mean().item()
    assert acc > avg_acc + 0.15, (acc, avg_acc)


def test_fedrep_trains_head_then_body_with_the_other_frozen():
    data = shared_representation_clients()
    fed, state = run_on(data, "fedrep", {"head_epochs": 1}, rounds=1)
    calls = []

    class Spy:
        def __init__(self, trainer):
            self.trainer, self.local, self.n_clients, self.rng = trainer, trainer.local, trainer.n_clients, trainer.rng

        def fit(self, params, trainable=None, **kw):
            calls.append((sorted(trainable), kw.get("local")))
            return self.trainer.fit(params, trainable=trainable, **kw)

    from pfl_tasks.engine.executor import VectorizedTrainer

    trainer = VectorizedTrainer(fed.fresh_net(), "classification", fed.train, torch.arange(6),
                                fed.exp.local, 0, 0)
    fed.algorithm.client_update(Spy(trainer), fed.algorithm.payload(state.server), state.clients)
    assert calls[0][0] == ["3.bias", "3.weight"] and calls[0][1].epochs == 1
    assert calls[1][0] == ["1.bias", "1.weight"] and calls[1][1] is None


# ----------------------------------------------------------------------------- pFedMe
def test_pfedme_global_minimizes_the_moreau_envelopes_and_personal_is_the_prox():
    lam = 1.0
    hp = {"lam": lam, "inner_steps": 60, "personal_lr": 0.1, "beta": 1.0}  # each round restarts the prox solve
    xs, ys, fed, state = lsq_federation("pfedme", hp, lr=0.5, rounds=250)
    hess, opt = local_hessians(xs, ys)
    eye = torch.eye(3, dtype=torch.float64)
    envelope = [torch.linalg.inv(torch.linalg.inv(a) + eye / lam) for a in hess]  # Hessian of M_k
    theta = torch.linalg.solve(sum(envelope), sum(h @ c for h, c in zip(envelope, opt)))
    assert_rel_close(state.server["global"]["1.weight"][0], theta)
    for k, (a, c) in enumerate(zip(hess, opt)):
        prox = torch.linalg.solve(a + lam * eye, a @ c + lam * theta)
        assert_rel_close(state.clients["personal"]["1.weight"][k, 0], prox)
    assert (theta - pooled_least_squares(xs, ys, [1] * 4)).norm() > 1e-2  # not FedAvg's point


# ----------------------------------------------------------------------------- pFedMac
def test_pfedmac_reaches_the_stationary_point_of_its_objective():
    lam = 0.3
    hp = {"lam": lam, "inner_steps": 10, "personal_lr": 0.05, "beta": 1.0}
    xs, ys, fed, state = lsq_federation("pfedmac", hp, lr=2.0, rounds=150)
    hess, opt = local_hessians(xs, ys)
    inv = [torch.linalg.inv(a) for a in hess]
    eye = torch.eye(3, dtype=torch.float64)
    theta = torch.linalg.solve(eye - lam * sum(inv) / 4, sum(opt) / 4)
    assert_rel_close(state.server["global"]["1.weight"][0], theta)
    for k in range(4):
        assert_rel_close(state.clients["personal"]["1.weight"][k, 0], opt[k] + lam * inv[k] @ theta)


def test_pfedmac_l1_term_gives_exact_zeros():
    hp = {"lam": 0.3, "inner_steps": 10, "personal_lr": 0.05, "gamma": 1.5}
    _, _, _, sparse = lsq_federation("pfedmac", hp, lr=2.0, rounds=60)
    _, _, _, dense = lsq_federation("pfedmac", {**hp, "gamma": 0.0}, lr=2.0, rounds=60)
    assert (sparse.clients["personal"]["1.weight"] == 0).sum() >= 1
    assert (dense.clients["personal"]["1.weight"] == 0).sum() == 0
    from pfl_tasks.algorithms.pfedmac import soft_threshold

    got = soft_threshold(torch.tensor([-3.0, -0.5, 0.0, 0.2, 2.0]), 1.0)
    assert torch.equal(got, torch.tensor([-2.0, 0.0, 0.0, 0.0, 1.0]))


# ----------------------------------------------------------------------------- APFL
def test_apfl_mixture_converges_to_each_local_optimum():
    """The seed's caveat: unconstrained, the personalized mixture is just the local optimum
    (at a fixed alpha; an adaptive one goes to 1, where v alone is it)."""
    xs, ys, fed, state = lsq_federation("apfl", {"alpha": 0.7, "adaptive_alpha": False}, lr=0.1, rounds=400)
    _, opt = local_hessians(xs, ys)
    mixture, stacked = fed.algorithm.personalized(state.server, state.clients)
    assert stacked
    for k in range(4):
        assert_rel_close(mixture["1.weight"][k, 0], opt[k])
    assert_rel_close(state.server["global"]["1.weight"][0], pooled_least_squares(xs, ys, [1] * 4))
    local_alone = state.clients["local"]["1.weight"][:, 0]
    assert max((local_alone[k].double() - opt[k]).norm() for k in range(4)) > 1e-2  # v alone is not it


def test_apfl_adaptive_alpha_follows_its_gradient_formula():
    hp = {"alpha": 0.5, "adaptive_alpha": True, "alpha_lr": 0.001}
    xs, ys, fed, state = lsq_federation("apfl", hp, lr=0.05, rounds=5)
    theta = state.server["global"]["1.weight"][0].double()
    v = state.clients["local"]["1.weight"][:, 0].double()
    alpha = state.clients["alpha"].double()
    expected = []
    for k, (x, y) in enumerate(zip(xs, ys)):
        x, y = x.double(), y.double()
        mix = alpha[k] * v[k] + (1 - alpha[k]) * theta
        g_mix = 2 * x.T @ (x @ mix - y) / len(y)
        expected.append(alpha[k] - 0.001 * torch.dot(v[k] - theta, g_mix))
    from pfl_tasks.engine.rounds import InlineSteps, run_round

    before = state.clients["alpha"].clone()  # the round updates client stacks in place
    after = run_round(InlineSteps(1), fed, state, 5)
    torch.testing.assert_close(after.clients["alpha"].double(), torch.stack(expected), rtol=1e-5, atol=1e-7)
    assert (after.clients["alpha"] - before).abs().max() > 1e-4
    assert ((0 < after.clients["alpha"]) & (after.clients["alpha"] < 1)).all()  # not clipped


# ----------------------------------------------------------------------------- L2SGD
def l2sgd_rounds(seed=0, p=0.5, n=40):
    from pfl_tasks.algorithms.l2sgd import COMMUNICATE
    from pfl_tasks.engine.streams import round_generator

    return [round_generator(seed, r, COMMUNICATE).random() < p for r in range(n)]


def test_l2sgd_expected_step_is_exactly_a_gradient_step_on_its_objective():
    """(1-p) * local branch + p * averaging branch = Theta - lr grad F(Theta), F = f + lam phi."""
    from pfl_tasks.engine.federation import RunState
    from pfl_tasks.engine.rounds import InlineSteps, run_round

    lam, p, lr = 2.0, 0.3, 0.2
    coins = l2sgd_rounds(p=p)
    xs, ys, fed, state = lsq_federation("l2sgd", {"lam": lam, "p": p, "lr": lr}, rounds=7)
    state = RunState(state.round, {**state.server, "pending": torch.zeros(())}, {
        **state.clients, "params": {"1.weight": state.clients["params"]["1.weight"] + torch.randn(4, 1, 3)}})
    theta = state.clients["params"]["1.weight"][:, 0].double()
    local_round, comm_round = coins.index(False), coins.index(True)
    # both branches from the same state (a round consumes its state)
    local = run_round(InlineSteps(1), fed, copy.deepcopy(state), local_round).clients["params"]["1.weight"][:, 0]
    comm = run_round(InlineSteps(1), fed, copy.deepcopy(state), comm_round)
    averaged = fed.algorithm.personalized(comm.server, comm.clients)[0]["1.weight"][:, 0]
    k = len(xs)
    grad_f = torch.stack([2 * x.double().T @ (x.double() @ theta[i] - y.double()) / len(y)
                          for i, (x, y) in enumerate(zip(xs, ys))])
    grad_F = grad_f / k + lam / k * (theta - theta.mean(0))
    expected = theta - lr * grad_F
    torch.testing.assert_close((1 - p) * local.double() + p * averaged.double(), expected, rtol=1e-5, atol=1e-6)


def l2sgd_average_iterate(lam, lr, rounds=1500, tail=1000):
    from pfl_tasks.engine.rounds import InlineSteps, run_round

    xs, ys, fed, state = lsq_federation("l2sgd", {"lam": lam, "p": 0.5, "lr": lr}, rounds=0)
    total = 0
    for r in range(rounds):
        state = run_round(InlineSteps(1), fed, state, r)
        if r >= rounds - tail:
            total = total + fed.algorithm.personalized(state.server, state.clients)[0]["1.weight"][:, 0].double()
    return xs, ys, total / tail


def mixture_optimum(xs, ys, lam):
    """argmin f(Theta) + lam phi(Theta): theta_k = (A_k + lam I)^-1 (A_k c_k + lam mean)."""
    hess, opt = local_hessians(xs, ys)
    eye = torch.eye(3, dtype=torch.float64)
    solves = [torch.linalg.inv(a + lam * eye) for a in hess]
    mean = torch.linalg.solve(eye - sum(lam * s for s in solves) / 4, sum(s @ a @ c for s, a, c in zip(solves, hess, opt)) / 4)
    return torch.stack([s @ (a @ c + lam * mean) for s, a, c in zip(solves, hess, opt)]), opt


@pytest.mark.parametrize("lam", [0.0, 1.0])
def test_l2sgd_average_iterate_approaches_the_mixture_optimum(lam):
    """A constant step leaves a noise floor, so the averaged iterate is held to 5%;
    lam = 0 is the local optima."""
    xs, ys, avg = l2sgd_average_iterate(lam, lr=0.2)
    optimum, local_opt = mixture_optimum(xs, ys, lam)
    assert (avg - optimum).norm() / optimum.norm() < 5e-2
    if lam == 0.0:
        assert (optimum - torch.stack(local_opt)).norm() < 1e-10


def test_l2sgd_large_lambda_approaches_consensus():
    xs, ys, avg = l2sgd_average_iterate(4.0, lr=0.2, rounds=600, tail=300)
    _, local_opt = local_hessians(xs, ys)
    local_opt = torch.stack(local_opt)
    spread = (avg - avg.mean(0)).norm()
    assert spread < 0.6 * (local_opt - local_opt.mean(0)).norm()


# ----------------------------------------------------------------------------- FPFC
def test_fpfc_prox_regimes_by_hand():
    from pfl_tasks.algorithms.fpfc import FPFCHyper, fusion_prox

    hp = FPFCHyper(rho=1.0, lam=0.5, a=3.7, xi=1e-4)
    norms = torch.tensor([0.3, 0.8, 1.5, 3.0, 1.0, 1.85])
    scad_15 = (1 - 3.7 * 0.5 / (2.7 * 1.5)) / (1 - 1 / 2.7)
    expected = torch.tensor([1e-4 / (1e-4 + 0.5), 1 - 0.5 / 0.8, scad_15, 1.0, 0.5, 1.0])
    torch.testing.assert_close(fusion_prox(norms, hp), expected, rtol=1e-6, atol=1e-7)


def grouped_regression_clients(per_group=3, n=60, seed=0):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.eye(3) * 3.0
    xs, ys, groups = [], [], []
    for g in range(3):
        for _ in range(per_group):
            x = torch.randn(n, 3, generator=gen)
            xs.append(x)
            ys.append(x @ centers[g] + 0.05 * torch.randn(n, generator=gen))
            groups.append(g)
    return xs, ys, groups


def test_fpfc_recovers_hidden_groups_without_their_number():
    from sklearn.metrics import adjusted_rand_score

    from conftest import regression_data
    from pfl_tasks.algorithms import build
    from pfl_tasks.config import parse_params
    from pfl_tasks.engine.federation import Federation
    from pfl_tasks.engine.rounds import InlineSteps, run_round

    xs, ys, groups = grouped_regression_clients()
    params = parse_params(tiny_params(
        model={"kind": "linear", "bias": False}, federation={"rounds": 60},
        local={"steps": 5, "batch_size": None, "optimizer": {"lr": 0.05}},
    ))
    fed = Federation(params.experiment("tiny"), build("fpfc", {}), regression_data(xs, ys))
    state = fed.initial_state()
    for r in range(60):
        state = run_round(InlineSteps(2), fed, state, r)
    labels = fed.algorithm.clusters(state.server)
    assert adjusted_rand_score(groups, labels.tolist()) == 1.0
    assert len(set(labels.tolist())) == 3
    models = state.clients["params"]["1.weight"][:, 0]
    for g in range(3):  # fused: one model per cluster, the cluster's own least squares
        members = [i for i in range(9) if groups[i] == g]
        cluster_ls = pooled_least_squares([xs[i] for i in members], [ys[i] for i in members])
        for i in members:
            assert_rel_close(models[i], cluster_ls, tol=1e-3)
            own = pooled_least_squares([xs[i]], [ys[i]])
            assert (own - cluster_ls).norm() > 5e-3  # alone it would differ


def test_fpfc_partial_participation_updates_only_active_pairs():
    from conftest import regression_data
    from pfl_tasks.algorithms import build
    from pfl_tasks.config import parse_params
    from pfl_tasks.engine.federation import Federation
    from pfl_tasks.engine.rounds import InlineSteps, run_round

    xs, ys, _ = grouped_regression_clients()
    params = parse_params(tiny_params(
        model={"kind": "linear", "bias": False}, federation={"rounds": 1, "clients_per_round": 3},
        local={"steps": 2, "batch_size": None},
    ))
    fed = Federation(params.experiment("tiny"), build("fpfc", {}), regression_data(xs, ys))
    state = run_round(InlineSteps(1), fed, fed.initial_state(), 0)
    active = set(fed.sample_clients(0).tolist())
    pairs = state.server["pairs"]
    touched = state.server["theta"]["1.weight"].flatten(1).abs().sum(1) > 0
    for (i, j), hit in zip(pairs.T.tolist(), touched.tolist()):
        assert hit == (i in active and j in active)


# ----------------------------------------------------------------------------- FedCR
def test_fedcr_server_poe_equals_a_direct_product_of_gaussians():
    """Multiply the prior and experts' densities on a grid; read mean and variance off the
    log-density (a quadratic), per dimension."""
    import numpy as np

    from pfl_tasks.algorithms.fedcr import product_of_experts

    gen = torch.Generator().manual_seed(1)
    mus = torch.randn(3, 1, 2, generator=gen, dtype=torch.float64)
    variances = torch.rand(3, 1, 2, generator=gen, dtype=torch.float64) + 0.2
    present = torch.tensor([[1.0], [1.0], [0.0]], dtype=torch.float64)  # third expert lacks the class
    mean, var = product_of_experts(1 / variances, mus / variances, present)
    grid = np.linspace(-3, 3, 7)
    for d in range(2):
        logp = -0.5 * grid**2  # N(0, 1) prior
        for i in range(2):
            logp = logp - 0.5 * (grid - mus[i, 0, d].item()) ** 2 / variances[i, 0, d].item()
        a, b, _ = np.polyfit(grid, logp, 2)  # logp = a z^2 + b z + c
        assert abs(var[0, d].item() - (-1 / (2 * a))) < 1e-9
        assert abs(mean[0, d].item() - (-b / (2 * a))) < 1e-9


def test_fedcr_classes_missing_from_all_active_clients_keep_last_statistics():
    from pfl_tasks.algorithms import build

    alg = build("fedcr", {})
    server = {"body": {"w": torch.zeros(2, 1)}, "class_mean": torch.full((3, 2), 7.0),
              "class_var": torch.full((3, 2), 0.5)}
    messages = {
        "body": {"w": torch.ones(2, 2, 1)},
        "precision": torch.ones(2, 3, 2), "precision_mean": torch.ones(2, 3, 2),
        "present": torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
    }
    new = alg.aggregate(server, messages, torch.ones(2), torch.arange(2))
    assert torch.equal(new["class_mean"][2], server["class_mean"][2])
    assert torch.equal(new["class_var"][2], server["class_var"][2])
    torch.testing.assert_close(new["class_var"][0], torch.full((2,), 1 / 3))  # prior + 2 experts
    torch.testing.assert_close(new["class_mean"][1], torch.full((2,), 1 / 2))  # prior + 1 expert
    torch.testing.assert_close(new["body"]["w"], torch.ones(2, 1))


def test_fedcr_kl_gradient_matches_the_analytic_diagonal_gaussian_kl():
    from pfl_tasks.algorithms.fedcr import gaussian_kl

    gen = torch.Generator().manual_seed(2)
    mu1, mu2 = torch.randn(5, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)
    var1 = torch.rand(5, generator=gen, dtype=torch.float64) + 0.3
    var2 = (torch.rand(5, generator=gen, dtype=torch.float64) + 0.3).requires_grad_()
    mu2.requires_grad_()
    kl = gaussian_kl(mu1, var1, mu2, var2)
    g_mu, g_var = torch.autograd.grad(kl, (mu2, var2))
    torch.testing.assert_close(g_mu, (mu2 - mu1).detach() / var2.detach())
    v2 = var2.detach()
    torch.testing.assert_close(g_var, 1 / (2 * v2) - (var1 + (mu1 - mu2.detach()) ** 2) / (2 * v2**2))
    torch.testing.assert_close(kl.detach(), (0.5 * (torch.log(v2 / var1) + (var1 + (mu1 - mu2.detach()) ** 2) / v2 - 1)).sum())


@pytest.mark.parametrize("stochastic", [True, False])
def test_fedcr_stack_gradient_by_hand_equals_autograd_on_each_client(stochastic):
    """FedCR's hand backpropagation over a stack (cross-entropy over noise draws, the KL pull
    weighted up to matter, padded rows of weight 0) gives each client autograd's gradient of
    its own loss, written out here from the module doc, and the same (mu, sigma^2)."""
    from types import SimpleNamespace

    from pfl_tasks.algorithms import build
    from pfl_tasks.algorithms.fedcr import ENCODER_KEYS, SIGMA_SHIFT, encoder_init, gaussian_kl
    from pfl_tasks.config import MLPNet
    from pfl_tasks.nets import build_net, init_params

    gen = torch.Generator().manual_seed(3)
    k, b, samples, width, classes = 3, 5, 4, 6, 3
    net = build_net(MLPNet(kind="mlp", hidden=[width]), (2, 4), classes)
    stacks = [{**init_params(net, seed), **encoder_init(width, seed)} for seed in range(k)]
    params = {n: torch.stack([p[n] for p in stacks]) for n in stacks[0]}
    weight = torch.rand(k, b, generator=gen)
    weight[0, -2:] = 0  # padding
    batch = SimpleNamespace(x=torch.randn(k, b, 2, 4, generator=gen), y=torch.randint(classes, (k, b), generator=gen),
                            weight=weight / weight.sum(1, keepdim=True), record_pass=lambda: None,
                            extra={"eps": torch.randn(k, b, samples, width, generator=gen)})
    payload = {"class_mean": torch.randn(classes, width, generator=gen),
               "class_var": torch.rand(classes, width, generator=gen) + 0.5}
    alg = build("fedcr", {"beta": 0.3, "stochastic": stochastic, "samples": samples})
    names = {n for n in params if n.startswith("3.")}
    grads, (mu, var) = alg.stack_gradient(net, params, names, batch, payload)

    def loss(p, c):  # client c's objective, autograd's way
        body = {n: v for n, v in p.items() if n not in ENCODER_KEYS and n not in names}
        s = F.linear(torch.func.functional_call(net[:-1], body, (batch.x[c],)), p["encoder.weight"], p["encoder.bias"])
        m, raw = s.chunk(2, -1)
        v = F.softplus(raw - SIGMA_SHIFT) ** 2 + 1e-8
        eps = batch.extra["eps"][c] if stochastic else torch.zeros(b, samples, width)
        logits = F.linear(m.unsqueeze(1) + v.sqrt().unsqueeze(1) * eps, p["3.weight"], p["3.bias"])
        ce = -F.log_softmax(logits, -1).gather(-1, batch.y[c][:, None, None].expand(-1, samples, 1)).squeeze(-1).mean(1)
        kl = gaussian_kl(payload["class_mean"][batch.y[c]], payload["class_var"][batch.y[c]], m, v)
        return ((ce + 0.3 * kl) * batch.weight[c]).sum(), (m, v)

    for c in range(k):
        expected, (m, v) = torch.func.grad(loss, has_aux=True)({n: t[c] for n, t in params.items()}, c)
        for n, g in expected.items():
            assert grads[n][c].is_contiguous()
            torch.testing.assert_close(grads[n][c], g, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(mu[c], m)
        torch.testing.assert_close(var[c], v)
        assert grads["encoder.bias"][c].abs().sum() > 0


def test_fedcr_without_alignment_or_noise_is_a_gradient_step_on_its_predictions_cross_entropy():
    """beta = 0 and z = mu: FedPer with the encoder in the shared body. One full-batch SGD step
    of one client equals a step on the cross-entropy of FedCR's own evaluation forward pass."""
    from pfl_tasks.algorithms import build
    from pfl_tasks.config import parse_params
    from pfl_tasks.data import FederatedData
    from pfl_tasks.engine.federation import Federation
    from pfl_tasks.engine.rounds import InlineSteps, run_round

    full = shared_representation_clients(n_clients=1)
    data = FederatedData("one", "classification", 3, (8,), full.train, full.train, full.train, "one")
    params = parse_params(tiny_params(model={"kind": "mlp", "hidden": [16]}, federation={"rounds": 1},
                                      local={"steps": 1, "batch_size": None, "optimizer": {"lr": 0.1}}))
    fed = Federation(params.experiment("tiny"), build("fedcr", {"beta": 0.0, "stochastic": False}), data)
    start = fed.initial_state()
    before = {k: v[0].clone().requires_grad_() for k, v in fed.algorithm.personalized(start.server, start.clients)[0].items()}
    loss = F.cross_entropy(fed.algorithm.forward(fed.fresh_net(), before, data.train.x), data.train.y)
    grads = dict(zip(before, torch.autograd.grad(loss, list(before.values()))))
    after = run_round(InlineSteps(1), fed, start, 0)
    trained, _ = fed.algorithm.personalized(after.server, after.clients)
    for k, v in before.items():
        torch.testing.assert_close(trained[k][0], (v - 0.1 * grads[k]).detach(), rtol=1e-5, atol=1e-6)
    noisy = Federation(params.experiment("tiny"), build("fedcr", {"beta": 0.01}), data)
    moved, _ = noisy.algorithm.personalized(*(lambda st: (st.server, st.clients))(
        run_round(InlineSteps(1), noisy, noisy.initial_state(), 0)))
    assert (moved["3.weight"][0] - trained["3.weight"][0]).abs().max() > 1e-6  # noise and KL do act


def test_apfl_iterate_averages_match_a_brute_force_running_average():
    """With partial participation the lazy per-client sums equal averaging every round's
    mixture alpha_k v_k + (1 - alpha_k) theta with weights p_r = (r tau + a)^2."""
    from conftest import least_squares_clients, regression_data
    from pfl_tasks.algorithms import build
    from pfl_tasks.config import parse_params
    from pfl_tasks.engine.federation import Federation
    from pfl_tasks.engine.rounds import InlineSteps, run_round

    xs, ys = least_squares_clients()
    params = parse_params(tiny_params(
        model={"kind": "linear", "bias": False}, federation={"rounds": 6, "clients_per_round": 2},
        local={"steps": 3, "batch_size": None, "optimizer": {"lr": 0.05}},
    ))
    hp = {"alpha": 0.4, "adaptive_alpha": True, "alpha_lr": 0.001, "average_iterates": True}
    fed = Federation(params.experiment("tiny"), build("apfl", hp), regression_data(xs, ys))
    state = fed.initial_state()
    mix_sum, theta_sum, weight = 0, 0, 0
    for r in range(6):
        state = run_round(InlineSteps(1), fed, state, r)
        p = ((r + 1) * 3 + 128) ** 2
        theta = state.server["global"]["1.weight"].double()
        alpha = state.clients["alpha"].double().view(-1, 1, 1)
        mix_sum = mix_sum + p * (alpha * state.clients["local"]["1.weight"].double() + (1 - alpha) * theta)
        theta_sum, weight = theta_sum + p * theta, weight + p
    personal, _ = fed.algorithm.personalized(state.server, state.clients)
    torch.testing.assert_close(personal["1.weight"].double(), mix_sum / weight, rtol=1e-5, atol=1e-6)
    shared = fed.algorithm.global_model(state.server, state.clients)
    torch.testing.assert_close(shared["1.weight"].double(), theta_sum / weight, rtol=1e-5, atol=1e-6)
    last, _ = build("apfl", {**hp, "average_iterates": False}).personalized(state.server, state.clients)
    assert (last["1.weight"].double() - mix_sum / weight).abs().max() > 1e-3  # averaging matters


def test_apfl_decaying_step_size_follows_16_over_mu_t_plus_a():
    from pfl_tasks.algorithms import build

    alg = build("apfl", {"decay_mu": 0.5, "decay_kappa": 2.0})
    assert alg.offset(10) == 256  # max(128 kappa, tau)
    assert alg.step_size(0.1, torch.tensor(44.0), 10).item() == pytest.approx(16 / (0.5 * 300))
    assert alg.offset(400) == 400
    assert build("apfl", {}).step_size(0.1, torch.tensor(5.0), 10) == 0.1  # constant without decay_mu


def test_fedcr_alignment_term_pulls_features_towards_the_global_posterior():
    from pfl_tasks.algorithms.fedcr import gaussian_kl

    data = shared_representation_clients()

    def mean_kl(beta):
        fed, state = run_on(data, "fedcr", {"beta": beta, "stochastic": False}, rounds=3)
        params = {**state.server["body"], **{k: v[0] for k, v in state.clients["head"].items()}}
        x, y = data.train.x[: data.train.counts[0]], data.train.y[: data.train.counts[0]]
        mu, var = fed.algorithm.features(fed.fresh_net(), params, x, set(state.clients["head"]))
        return gaussian_kl(state.server["class_mean"][y], state.server["class_var"][y], mu, var).mean().item()

    assert mean_kl(1e-3) < 0.8 * mean_kl(0.0)


def test_pfedme_restarts_the_personal_model_from_the_received_model_each_round():
    """As in the authors' code: what a client's personal model was before a round does not
    change that round's outcome."""
    from dataclasses import replace

    from pfl_tasks.engine.rounds import InlineSteps, run_round

    data = shared_representation_clients()
    fed, state = run_on(data, "pfedme", rounds=2)
    scrambled = {k: torch.randn_like(v) for k, v in state.clients["personal"].items()}
    a = run_round(InlineSteps(1), fed, replace(state, clients={"personal": dict(state.clients["personal"])}), 2)
    b = run_round(InlineSteps(1), fed, replace(state, clients={"personal": scrambled}), 2)
    for k in a.clients["personal"]:
        torch.testing.assert_close(a.clients["personal"][k], b.clients["personal"][k])
    torch.testing.assert_close(a.server["global"], b.server["global"])


def test_fedcr_starts_with_small_noise_on_unrectified_features():
    """The authors' encoder: mu and sigma from one linear layer over the body's features,
    sigma = softplus(s - 5) ~ 0.007, so the noise does not drown the features at the start."""
    from pfl_tasks.algorithms import build
    from pfl_tasks.config import parse_params
    from pfl_tasks.engine.federation import Facts
    from pfl_tasks.nets import build_net, init_params

    net = build_net(parse_params(tiny_params(model={"kind": "mlp", "hidden": [16]})).experiment("tiny").model, (8,), 3)
    alg = build("fedcr", {})
    server = alg.init_server(init_params(net, 0), Facts(n_clients=2, local_steps=1, seed=0))
    params = {**server["body"], **{k: v for k, v in init_params(net, 0).items() if k.startswith("3.")}}
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    mu, var = alg.features(net, params, x, {"3.weight", "3.bias"})
    assert var.sqrt().max() < 0.05 < mu.abs().mean()  # softplus(0) = 0.69 would be noise of 0.83
    assert (mu < 0).any()  # not taken after a ReLU


def test_fedcr_clips_each_clients_whole_gradient_at_clip_norm(digits6):
    """One SGD step: with `clip_norm` below the gradient's norm, each client's update is the
    unclipped update scaled to norm lr * clip_norm (the authors' clip_grad_norm_)."""
    from conftest import tiny_federation
    from pfl_tasks.engine.state import gather, leaves

    updates = {}
    for clip in (None, 1e-3):
        fed = tiny_federation(digits6, "fedcr", hp={"clip_norm": clip}, local={"steps": 1})
        state = fed.initial_state()
        ids = torch.arange(6)
        payload = fed.algorithm.payload(state.server)
        result = fed.local_update(0, payload, ids, gather(state.clients, ids))
        before = {**{f"body.{k}": v.expand(6, *v.shape) for k, v in leaves(payload["body"])},
                  **{f"head.{k}": v for k, v in leaves(state.clients["head"])}}
        after = {**{f"body.{k}": v for k, v in leaves(result.messages["body"])},
                 **{f"head.{k}": v for k, v in leaves(result.clients["head"])}}
        updates[clip] = torch.cat([(after[k] - before[k]).flatten(1) for k in before], 1)
    lr = fed.exp.local.optimizer.lr
    free, clipped = updates[None], updates[1e-3]
    assert (free.norm(dim=1) > lr * 1e-3).all()  # the clip binds
    torch.testing.assert_close(clipped.norm(dim=1), torch.full((6,), lr * 1e-3), rtol=1e-3, atol=0)
    assert (F.cosine_similarity(clipped, free, dim=1) > 0.999).all()  # the same direction


def test_fedcr_numbers_do_not_depend_on_pythons_hash_seed():
    """Its parameter dicts keep the net's order, never a set's (which changes with
    PYTHONHASHSEED and, through float sums over parameters such as the clipped gradient's
    norm, changed FedCR's MNIST results from one process to the next)."""
    import subprocess
    import sys

    code = ("import torch; from pfl_tasks.algorithms import build; from pfl_tasks.nets import split_net; "
            "from torch import nn; "
            "params = {'1.weight': torch.zeros(3, 2), '1.bias': torch.zeros(3), '3.weight': torch.zeros(2, 3), "
            "'3.bias': torch.zeros(2)}; "
            "body, head = build('fedcr', {}).split(params); "
            "net = nn.Sequential(nn.Flatten(), nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)); "
            "print(list(body), list(head), list(split_net(net, params)[3]))")
    orders = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(4)}
    assert orders == {"['1.weight', '1.bias'] ['3.weight', '3.bias'] ['3.weight', '3.bias']\n"}
