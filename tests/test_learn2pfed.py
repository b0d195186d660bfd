"""Learn2pFed's unrolled ADMM: one cell is the hand-written iteration, many cells reach the
objective's closed-form minimizer (with a diagonal or a full Lambda), the meta loss weighs
clients or rows as configured, and meta-gradients reach every parameter of Theta."""

import numpy as np
import pytest
import torch

from pfl_tasks.algorithms.learn2pfed import FLOOR, Cells, Problem, inverse_positive, unroll
from pfl_tasks.algorithms.learn2pfed_meta import costs, evaluate, meta_loss, meta_step
from pfl_tasks.config import Learn2pFedConfig

INIT = {"rho": 0.01, "eta": 0.01, "gamma": 0.01, "theta": 0.01, "lam": 0.001}


def regression_problem(m=3, d=4, n=(5, 9, 7), seed=0) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, max(n), d, generator=gen, dtype=torch.float64)
    mask = (torch.arange(max(n))[None, :] < torch.tensor(n)[:, None]).double()
    truth = torch.randn(m, d, generator=gen, dtype=torch.float64)
    y = torch.einsum("mnd,md->mn", x, truth) + 0.1 * torch.randn(m, max(n), generator=gen, dtype=torch.float64)
    return Problem(x, y * mask, mask)


def set_theta(cells: Cells, **values):
    """Overwrite Theta with given values (each [layers, M], Lambda [layers, M, d] or, full,
    [layers, M, d, d])."""
    with torch.no_grad():
        for key, value in values.items():
            value = torch.as_tensor(value, dtype=torch.float64)
            if key == "lam" and cells.form == "full":
                eye = torch.eye(value.shape[-1], dtype=torch.float64)
                cells.raw[key].copy_(torch.linalg.cholesky(value - FLOOR * eye))
            else:
                cells.raw[key].copy_(inverse_positive(value))


def random_spd(m, d, layers=1, seed=4) -> np.ndarray:
    """[layers, M, d, d] symmetric positive definite, with off-diagonals as large as the diagonal's spread."""
    a = np.random.default_rng(seed).normal(size=(layers, m, d, d))
    return a @ a.swapaxes(-1, -2) / d + 0.05 * np.eye(d)


def random_theta(m, d, layers=1, seed=1):
    rng = np.random.default_rng(seed)
    theta = {key: rng.uniform(0.2, 2.0, (layers, m)) for key in ("rho", "eta", "gamma", "theta", "p")}
    theta["lam"] = rng.uniform(0.0, 3.0, (layers, m, d))
    return theta


def hand_admm(problem: Problem, theta: dict, cells: int, w0: np.ndarray):
    """The reference's cell equations, client by client, with explicit inverses (numpy)."""
    m, d = problem.n_clients, problem.dim
    w, z, alpha = w0.copy(), np.zeros((m, d)), np.zeros((m, d))
    v = np.zeros((m, d))
    for cell in range(cells):
        t = {k: val[min(cell, len(val) - 1)] for k, val in theta.items()}
        for i in range(m):
            rows = problem.mask[i].numpy() > 0
            x, y = problem.x[i].numpy()[rows], problem.y[i].numpy()[rows]
            v[i] = np.linalg.inv(x.T @ x + t["rho"][i] * np.eye(d)) @ (x.T @ y + t["rho"][i] * (w + z[i] + alpha[i]))
            lam = t["lam"][i] if t["lam"][i].ndim == 2 else np.diag(t["lam"][i])
            z[i] = t["eta"][i] * np.linalg.inv(lam + t["eta"][i] * np.eye(d)) @ (v[i] - w - alpha[i])
        weight = t["p"] * t["gamma"]
        w = (weight[:, None] * (v - z - alpha)).sum(0) / weight.sum()
        for i in range(m):
            alpha[i] = alpha[i] + t["theta"][i] * (z[i] - v[i] + w)
    return v, w


@pytest.mark.parametrize("form", ["diagonal", "full"])
@pytest.mark.parametrize("tied", [True, False])
def test_cells_equal_the_hand_written_admm_iterations(tied, form):
    problem = regression_problem()
    layers = 1 if tied else 3
    cells = Cells(problem, 3, tied, INIT, torch.Generator().manual_seed(0), form)
    theta = random_theta(problem.n_clients, problem.dim, layers)
    if form == "full":
        theta["lam"] = random_spd(problem.n_clients, problem.dim, layers)
    set_theta(cells, **theta)
    w0 = np.random.default_rng(2).normal(size=problem.dim)
    for n_cells in (1, 3):
        cells.cells = n_cells
        trace = unroll(cells, problem, torch.from_numpy(w0))
        v, w = hand_admm(problem, theta, n_cells, w0)
        np.testing.assert_allclose(trace.v.detach().numpy(), v, rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(trace.w.detach().numpy(), w, rtol=1e-9, atol=1e-10)


def objective_minimizer(problem: Problem, p, lam, weight):
    """argmin over (v_1..v_M, w) of sum_i p_i [1/2 ||X_i v_i - Y_i||^2 + weight_i/2 (v_i-w)^T
    Lambda_i (v_i-w)], Lambda_i = diag(lam_i) or the matrix lam_i: the stationarity conditions
    as one linear system."""
    m, d = problem.n_clients, problem.dim
    size = (m + 1) * d
    a, b = np.zeros((size, size)), np.zeros(size)
    for i in range(m):
        rows = problem.mask[i].numpy() > 0
        x, y = problem.x[i].numpy()[rows], problem.y[i].numpy()[rows]
        tie = weight[i] * (lam[i] if lam[i].ndim == 2 else np.diag(lam[i]))
        vi, wi = slice(i * d, (i + 1) * d), slice(m * d, size)
        a[vi, vi] += p[i] * (x.T @ x + tie)
        a[vi, wi] -= p[i] * tie
        a[wi, wi] += p[i] * tie
        a[wi, vi] -= p[i] * tie
        b[vi] += p[i] * x.T @ y
    sol = np.linalg.solve(a, b)
    return sol[: m * d].reshape(m, d), sol[m * d:]


@pytest.mark.parametrize("form", ["diagonal", "full"])
@pytest.mark.parametrize("rho_equals_eta", [True, False])
def test_many_cells_converge_to_the_objectives_minimizer(rho_equals_eta, form):
    """With gamma_i proportional to rho_i the fixed point minimizes
    sum_i p_i [F_i(v_i) + rho_i/(2 eta_i) (v_i-w)^T Lambda_i (v_i-w)] (the paper's objective,
    with F_i = 1/2 ||X_i v - Y_i||^2, when eta_i = rho_i / 2), for a full symmetric Lambda_i
    as for a diagonal one."""
    problem = regression_problem()
    m, d = problem.n_clients, problem.dim
    rng = np.random.default_rng(3)
    rho = rng.uniform(0.5, 2.0, m)
    eta = rho.copy() if rho_equals_eta else rng.uniform(0.5, 2.0, m)
    lam = rng.uniform(0.05, 4.0, (m, d)) if form == "diagonal" else random_spd(m, d)[0]
    p = rng.uniform(0.2, 1.0, m)
    cells = Cells(problem, 600, True, INIT, torch.Generator().manual_seed(0), form)
    set_theta(cells, rho=rho[None], eta=eta[None], gamma=3 * rho[None], theta=np.ones((1, m)),
              p=p[None], lam=lam[None])
    trace = unroll(cells, problem, torch.zeros(d, dtype=torch.float64), create_graph=False)
    v, w = objective_minimizer(problem, p, lam, rho / eta)
    np.testing.assert_allclose(trace.w.detach().numpy(), w, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(trace.v.detach().numpy(), v, rtol=1e-6, atol=1e-8)
    local = [np.linalg.lstsq(problem.x[i].numpy(), problem.y[i].numpy(), rcond=None)[0] for i in range(m)]
    assert np.abs(v - np.stack(local)).max() > 1e-2  # the coupling is not a no-op
    if form == "full":  # the off-diagonals count: the diagonal alone gives another minimizer
        v_diag, _ = objective_minimizer(problem, p, np.diagonal(lam, axis1=-2, axis2=-1), rho / eta)
        assert np.abs(v - v_diag).max() > 1e-2


def test_a_full_lambda_starts_at_the_diagonal_one():
    """Both forms start at the demo's Lambda = lam U(0,1) per entry (the same draw): their first
    unroll is the same, and the full one's off-diagonals then get gradients of their own."""
    problem = regression_problem()
    diagonal, full = (Cells(problem, 4, True, INIT, torch.Generator().manual_seed(0), form)
                      for form in ("diagonal", "full"))
    torch.testing.assert_close(full.values(0)["lam"], torch.diag_embed(diagonal.values(0)["lam"]), rtol=1e-12, atol=0)
    w0 = torch.zeros(problem.dim, dtype=torch.float64)
    traces = [unroll(cells, problem, w0) for cells in (diagonal, full)]
    torch.testing.assert_close(traces[0].v, traces[1].v, rtol=1e-10, atol=1e-12)
    meta_loss(problem, traces[1].v, "clients").backward()
    grad = full.raw["lam"].grad[0]
    assert (grad.tril(-1).abs() > 0).any() and (grad.triu(1) == 0).all()  # L is lower triangular


def test_the_pooled_meta_loss_weighs_every_row_once():
    """`clients`: sum_i mean_i; `pooled`: M x the mean over every real row of every client (the
    authors' code, scaled): its gradient is sum_i (M n_i / N) grad mean_i, and with clients of
    equal size the two are the same loss."""
    problem = regression_problem(n=(2, 9, 5))
    m = problem.n_clients
    v = torch.randn(m, problem.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    rows = problem.mask > 0
    errors = (torch.einsum("mnd,md->mn", problem.x, v) - problem.y)[rows] ** 2  # the pooled rows
    torch.testing.assert_close(meta_loss(problem, v, "pooled"), m * errors.mean())
    counts = problem.mask.sum(1)
    per_client = problem.per_client_loss(v)
    expected = sum(m * counts[i] / counts.sum() * torch.autograd.grad(per_client[i], v, retain_graph=True)[0]
                   for i in range(m))
    torch.testing.assert_close(torch.autograd.grad(meta_loss(problem, v, "pooled"), v)[0], expected)
    assert not torch.allclose(meta_loss(problem, v, "pooled"), meta_loss(problem, v, "clients"))
    equal = regression_problem(n=(6, 6, 6))
    torch.testing.assert_close(meta_loss(equal, v, "pooled"), meta_loss(equal, v, "clients"))


def test_a_meta_step_takes_the_configured_lambda_and_meta_loss():
    """`lambda: full` and `meta_loss: pooled` from the params reach the meta step: its loss is
    the pooled loss of the full cells' v(L), and its update moves the off-diagonals."""
    import copy

    problem = regression_problem(n=(2, 9, 5))
    cfg = Learn2pFedConfig.model_validate({"lambda": "full", "meta_loss": "pooled", "cells": 3})
    cells = Cells(problem, cfg.cells, cfg.tied, cfg.init.model_dump(), torch.Generator().manual_seed(0), cfg.lambda_)
    before = copy.deepcopy(cells)
    w0 = torch.zeros(problem.dim, dtype=torch.float64)
    opt = torch.optim.Adam(cells.parameters(), lr=cfg.meta.lr)
    loss, _, _ = meta_step(cells, opt, cfg, 0, problem, problem, w0)
    assert loss == pytest.approx(meta_loss(problem, unroll(before, problem, w0).v, "pooled").item(), rel=1e-12)
    assert (cells.raw["lam"].detach().tril(-1) != 0).any()


def classification_problem(m=3, n=12, d=5, classes=3, seed=0) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, d, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (m, n), generator=gen)
    mask = torch.ones(m, n, dtype=torch.float64)
    mask[0, -4:] = 0
    return Problem(x, y, mask, classes)


def test_gradient_v_step_is_a_prox_gradient_step_on_the_clients_loss():
    problem = classification_problem()
    cells = Cells(problem, 1, True, INIT, torch.Generator().manual_seed(0))
    rho, lr = 0.7, 0.3
    set_theta(cells, rho=np.full((1, 3), rho))
    w0 = torch.randn(problem.dim, dtype=torch.float64)
    trace = unroll(cells, problem, w0, v_steps=2, v_lr=lr, create_graph=False)
    expected = []
    for i in range(problem.n_clients):
        rows = problem.mask[i] > 0
        x, y = problem.x[i][rows], problem.y[i][rows]
        v = w0.clone()  # z = alpha = 0 in the first cell, so the centre is w0
        for _ in range(2):
            v = v.detach().requires_grad_()
            head = v.view(3, -1)
            loss = torch.nn.functional.cross_entropy(x @ head[:, :-1].T + head[:, -1], y)
            (g,) = torch.autograd.grad(loss, v)
            v = v - lr * (g + rho * (v - w0))
        expected.append(v.detach())
    torch.testing.assert_close(trace.v.detach(), torch.stack(expected))


def test_a_clients_loss_and_accuracy_are_over_its_own_rows_of_its_own_head():
    problem = classification_problem()
    v = torch.randn(problem.n_clients, problem.dim, dtype=torch.float64)
    for i in range(problem.n_clients):
        rows = problem.mask[i] > 0
        head = v[i].view(problem.n_classes, -1)
        logits = problem.x[i][rows] @ head[:, :-1].T + head[:, -1]
        y = problem.y[i][rows]
        torch.testing.assert_close(problem.per_client_loss(v)[i], torch.nn.functional.cross_entropy(logits, y))
        torch.testing.assert_close(problem.accuracy(v)[i], (logits.argmax(1) == y).double().mean())


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_meta_gradients_reach_every_parameter_and_meta_steps_reduce_the_loss(kind):
    problem = regression_problem() if kind == "regression" else classification_problem()
    cfg = Learn2pFedConfig.model_validate(
        {"cells": 4, "tied": False, "v_steps": 2, "v_lr": 0.5, "init": {"rho": 0.5, "eta": 0.5, "gamma": 0.5, "theta": 0.5, "lam": 0.5},
         "meta": {"name": "adam", "lr": 0.1, "clip": None}}
    )
    cells = Cells(problem, cfg.cells, cfg.tied, cfg.init.model_dump(), torch.Generator().manual_seed(0))
    w0 = torch.zeros(problem.dim, dtype=torch.float64)
    loss = problem.per_client_loss(unroll(cells, problem, w0, cfg.v_steps, cfg.v_lr).v).sum()
    loss.backward()
    for key, raw in cells.raw.items():  # every client of every cell; v(L) is the last cell's
        reach = raw.grad if key == "rho" else raw.grad[:-1]  # v-step, so only its rho matters
        assert (reach.abs().flatten(1) > 0).all(), key
    opt = torch.optim.Adam(cells.parameters(), lr=cfg.meta.lr)
    losses = [meta_step(cells, opt, cfg, epoch, problem, problem, w0)[0] for epoch in range(30)]
    assert losses[-1] < 0.9 * losses[0]


def test_costs_count_every_row_the_meta_step_and_the_evaluation_read(monkeypatch):
    """grad_samples per meta epoch = the fit rows read by the differentiated cells, twice (the
    meta backward reads them again), plus the supervised rows of the meta loss; evaluation reads
    the fit rows once per v-step. Counted here from the calls themselves."""
    fit, supervise, test = (classification_problem(seed=s) for s in (0, 1, 2))
    cfg = Learn2pFedConfig.model_validate({"cells": 2, "tied": False, "v_steps": 3, "meta": {"epochs": 4}})
    reads = {id(fit): 0, id(supervise): 0, id(test): 0}
    real_loss = Problem.per_client_loss

    def counted(problem, v):
        if v.requires_grad:
            reads[id(problem)] += problem.mask.sum().item()
        return real_loss(problem, v)

    monkeypatch.setattr(Problem, "per_client_loss", counted)
    cells = Cells(fit, cfg.cells, cfg.tied, cfg.init.model_dump(), torch.Generator().manual_seed(0))
    w0 = torch.zeros(fit.dim, dtype=torch.float64)
    meta_step(cells, torch.optim.SGD(cells.parameters(), lr=0.01), cfg, 0, fit, supervise, w0)
    per_epoch = 2 * reads[id(fit)] + reads[id(supervise)]
    reads[id(fit)] = 0
    evaluate(cells, fit, test, w0, cfg)
    total = costs(fit, supervise, cfg)
    assert total["compute/grad_samples"] == cfg.meta.epochs * per_epoch > 0
    assert total["compute/eval_grad_samples"] == reads[id(fit)] > 0
    per_cell = fit.n_clients * fit.dim * 8  # float64
    assert total["comm/bytes_down"] == (2 * cfg.meta.epochs + 1) * cfg.cells * per_cell
    assert total["comm/bytes_up"] == total["comm/bytes_down"] + cfg.meta.epochs * fit.n_clients * 8


def scarce_polynomial(n_points, n_clients, noise, seed, supervision="val"):
    """Meta-train on a data-scarce polynomial setting 1; returns the test MSE of Learn2pFed,
    of Local-only and FedAvg at their optima (each client's own least squares, and pooled least
    squares), and the learned Lambda [M, 4]."""
    from pfl_tasks.algorithms.learn2pfed_meta import evaluate, make_optimizer, padded_problem
    from pfl_tasks.config import DatasetConfig
    from pfl_tasks.data.store import _client_split, build_partition

    cfg = DatasetConfig.model_validate(
        {"source": {"name": "polynomial", "setting": 1, "n_clients": n_clients, "n_points": n_points, "noise": noise}}
    )
    df, _ = build_partition("poly_scarce", cfg, seed)
    train, val, test = (padded_problem(split, split.x, 0) for split in (
        _client_split(df[df["split"] == name], n_clients, (4,)) for name in ("train", "val", "test")))
    supervise = val if supervision == "val" else train
    l2p = Learn2pFedConfig()
    cells = Cells(train, l2p.cells, l2p.tied, l2p.init.model_dump(), torch.Generator().manual_seed(seed))
    opt, w0 = make_optimizer(cells, l2p.meta), torch.zeros(4, dtype=torch.float64)
    for epoch in range(l2p.meta.epochs):
        meta_step(cells, opt, l2p, epoch, train, supervise, w0)
    mse = evaluate(cells, train, test, w0, l2p)["personalized"]["mse"].mean().item()
    xm = train.x * train.mask[..., None]
    gram, xty = xm.transpose(1, 2) @ xm, torch.einsum("mnd,mn->md", xm, train.y)
    local = torch.linalg.lstsq(gram, xty[..., None]).solution[..., 0]
    pooled = torch.linalg.solve(gram.sum(0), xty.sum(0)).expand_as(local)
    baselines = {"local": test.per_client_loss(local).mean().item(), "fedavg": test.per_client_loss(pooled).mean().item()}
    return mse, baselines, cells.values(0)["lam"].detach()


@pytest.mark.slow
def test_validation_meta_training_learns_to_share_the_shared_coefficients():
    """Setting 1 shares a0-a2 and shifts a3 per client. With few, noisy points on 3 clients
    (40 each, 6 of them validation), meta-training on the validation rows ties a0-a2 to w more
    than a3, on every generated dataset."""
    for seed in range(4):
        _, _, lam = scarce_polynomial(120, 3, 1.0, seed)
        assert lam[:, :3].mean() > lam[:, 3].mean(), seed


@pytest.mark.slow
def test_validation_supervised_learn2pfed_beats_local_and_fedavg_optima_on_scarce_polynomial():
    """The `poly1_scarce` dataset of params-extended.yaml (10 clients, ~15 noisy points each), averaged
    over three generated datasets: lower test MSE than Local-only's and FedAvg's optima."""
    runs = [scarce_polynomial(200, 10, 1.0, seed) for seed in range(3)]
    mse = np.mean([r[0] for r in runs])
    for method in ("local", "fedavg"):
        assert mse < np.mean([r[1][method] for r in runs]), method


def test_the_meta_epoch_is_selected_on_validation_never_test():
    """Train supervision on noisy polynomial data drifts towards local least squares:
    validation MSE falls, then rises. The flow's meta-epochs offer every Theta to `Selection`,
    which tracks the best on validation and keeps the latest Theta within noise of it (its state
    reproduces that score exactly); scrambling the test labels changes nothing of it."""
    from dataclasses import replace

    from flows.learn2pfed import Problems, meta_epochs, selection_scores
    from pfl_tasks.algorithms.learn2pfed_meta import make_optimizer, padded_problem, personalized_models
    from pfl_tasks.config import DatasetConfig
    from pfl_tasks.data.store import _client_split, build_partition
    from pfl_tasks.selection import Selection

    cfg = DatasetConfig.model_validate({"source": {"name": "polynomial", "setting": 1, "n_clients": 3,
                                                   "n_points": 100, "noise": 0.5}})
    df, _ = build_partition("poly_scarce", cfg, 0)
    train, val, test = (padded_problem(split, split.x, 0) for split in (
        _client_split(df[df["split"] == name], 3, (4,)) for name in ("train", "val", "test")))
    l2p = Learn2pFedConfig(meta={"epochs": 120})
    key = "val/personalized/mse_mean"

    def run(test_rows):
        problems = Problems(train, train, val, test_rows, torch.zeros(4, dtype=torch.float64), "", "", "", ())
        cells = Cells(train, l2p.cells, l2p.tied, l2p.init.model_dump(), torch.Generator().manual_seed(0))
        opt, selection = make_optimizer(cells, l2p.meta), Selection(higher_is_better=False)
        history = meta_epochs.fn(cells, opt, l2p, problems, 0, 60, selection)
        history += meta_epochs.fn(cells, opt, l2p, problems, 60, 120, selection)  # across a checkpoint boundary
        return history, selection, cells, problems

    history, selection, cells, problems = run(test)
    scores = [h[key] for h in history]
    assert selection.best_index == scores.index(min(scores))
    assert selection.index >= selection.best_index  # the latest within noise of the best
    selected = Cells(train, l2p.cells, l2p.tied, l2p.init.model_dump(), torch.Generator().manual_seed(1))
    selected.load_state_dict(selection.state)
    v = personalized_models(selected, train, problems.w0, l2p)
    assert selection_scores(problems.select, v)[0][key] == scores[selection.index]  # the kept Theta is the one scored
    scrambled = replace(test, y=torch.randn(test.y.shape, generator=torch.Generator().manual_seed(3),
                                             dtype=test.y.dtype))
    again, selection_again, _, _ = run(scrambled)
    assert again == history and selection_again.index == selection.index  # the test split chooses nothing


def test_val_supervision_fits_half_of_each_clients_validation_rows_and_selects_on_the_other():
    from pfl_tasks.algorithms.learn2pfed import Problem
    from pfl_tasks.algorithms.learn2pfed_meta import split_validation

    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    rows = Problem(torch.zeros(2, 5, 3, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.float64), mask)
    fit, select, single = split_validation(rows)
    assert fit.mask.tolist() == [[1, 0, 1, 0, 1], [1, 0, 0, 0, 0]]
    assert select.mask.tolist() == [[0, 1, 0, 1, 0], [0, 1, 0, 0, 0]]
    assert ((fit.mask + select.mask) == mask).all() and single == []  # disjoint, and every row used
    fit, select, single = split_validation(Problem(rows.x, rows.y, torch.tensor([[1.0, 1, 0, 0, 0], [1, 0, 0, 0, 0]])))
    assert single == [1] and fit.mask[1].tolist() == select.mask[1].tolist() == [1, 0, 0, 0, 0]  # said, not hidden
