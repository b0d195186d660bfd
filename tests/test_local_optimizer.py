"""The configured local optimizer (momentum, weight decay, Adam) drives the local steps that
pFedMe, pFedMac, APFL and FedCR write themselves: one round of one full-batch client against a
reference written with `torch.optim`."""

from __future__ import annotations

import torch
from conftest import regression_data, split_from, tiny_params

from pfl_tasks.algorithms import build
from pfl_tasks.config import parse_params
from pfl_tasks.data import FederatedData
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.rounds import InlineSteps, run_round

ADAM = {"name": "adam", "lr": 0.05, "weight_decay": 0.01}
STEPS = 3


def one_client():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=gen)
    return x, x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(20, generator=gen)


def one_round(algorithm, hp, data, model=None, optimizer=ADAM):
    params = parse_params(tiny_params(
        model=model or {"kind": "linear", "bias": False}, federation={"rounds": 1},
        local={"steps": STEPS, "batch_size": None, "optimizer": optimizer},
    ))
    fed = Federation(params.experiment("tiny"), build(algorithm, hp), data)
    start = fed.initial_state()
    w0 = {k: v.clone() for k, v in start.server.get("global", {}).items()}
    return w0, run_round(InlineSteps(1), fed, start, 0)


def mse(w, x, y):
    return ((x @ w.T).squeeze(-1) - y).pow(2).mean()


def adam(tensor):
    p = tensor.clone().requires_grad_()
    return p, torch.optim.Adam([p], lr=ADAM["lr"], weight_decay=ADAM["weight_decay"])


def descend(opt, p, grad):
    opt.zero_grad()
    p.grad = grad.detach().clone()
    opt.step()


def prox_loop(outer, inner, inner_loss, outer_grad, plr, steps):
    """pFedMe's and pFedMac's local loop, by hand: per local step `steps` GD steps on
    `inner_loss(inner, outer)`, then one Adam step of `outer` on `outer_grad(outer, inner)`."""
    outer, opt = adam(outer)
    for _ in range(STEPS):
        for _ in range(steps):
            p = inner.clone().requires_grad_()
            inner = inner - plr * torch.autograd.grad(inner_loss(p, outer.detach()), p)[0]
        descend(opt, outer, outer_grad(outer.detach(), inner))
    return outer.detach(), inner


def test_pfedme_outer_step_is_the_configured_optimizer():
    x, y = one_client()
    lam, plr, inner = 15.0, 0.01, 2
    w0, state = one_round("pfedme", {"lam": lam, "personal_lr": plr, "inner_steps": inner}, regression_data([x], [y]))
    omega, theta = prox_loop(w0["1.weight"], w0["1.weight"].clone(),
                             lambda t, o: mse(t, x, y) + lam / 2 * (t - o).pow(2).sum(),
                             lambda o, t: lam * (o - t), plr, inner)
    torch.testing.assert_close(state.server["global"]["1.weight"], omega)
    torch.testing.assert_close(state.clients["personal"]["1.weight"][0], theta)


def test_pfedmac_global_step_is_the_configured_optimizer():
    x, y = one_client()
    lam, plr, inner = 0.5, 0.05, 2
    w0, state = one_round("pfedmac", {"lam": lam, "personal_lr": plr, "inner_steps": inner}, regression_data([x], [y]))
    theta, omega = prox_loop(w0["1.weight"], w0["1.weight"].clone(),  # the personal model starts as the initial one
                             lambda o, t: mse(o, x, y) - lam * (o * t).sum(),
                             lambda t, o: lam * (t - o), plr, inner)
    torch.testing.assert_close(state.server["global"]["1.weight"], theta)
    torch.testing.assert_close(state.clients["personal"]["1.weight"][0], omega)


def test_apfl_steps_are_the_configured_optimizer_with_one_state_per_model():
    x, y = one_client()
    alpha, alpha_lr = 0.5, 0.01
    w0, state = one_round("apfl", {"alpha": alpha, "alpha_lr": alpha_lr}, regression_data([x], [y]))
    theta, opt_theta = adam(w0["1.weight"])
    v, opt_v = adam(w0["1.weight"])  # the personal model starts as the initial model
    a = torch.tensor(alpha)
    for _ in range(STEPS):
        mix = (a * v + (1 - a) * theta).detach().requires_grad_()
        g_mix = torch.autograd.grad(mse(mix, x, y), mix)[0]
        t = theta.detach().clone().requires_grad_()
        g_theta = torch.autograd.grad(mse(t, x, y), t)[0]
        new_a = torch.clamp(a - alpha_lr * ((v.detach() - theta.detach()) * g_mix).sum(), 0, 1)
        descend(opt_theta, theta, g_theta)
        descend(opt_v, v, a * g_mix)
        a = new_a
    torch.testing.assert_close(state.server["global"]["1.weight"], theta.detach())
    torch.testing.assert_close(state.clients["local"]["1.weight"][0], v.detach())
    torch.testing.assert_close(state.clients["alpha"][0], a)


def test_fedcr_steps_are_the_configured_optimizer():
    """Without noise or alignment FedCR's objective is the cross-entropy of its own evaluation
    forward pass, over body, encoder and head: its round is Adam on that."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    split = split_from([x], [y])
    data = FederatedData("cls", "classification", 2, (4,), split, split, split, "cls")
    params = parse_params(tiny_params(
        model={"kind": "mlp", "hidden": [6]}, federation={"rounds": 1},
        local={"steps": STEPS, "batch_size": None, "optimizer": ADAM},
    ))
    fed = Federation(params.experiment("tiny"), build("fedcr", {"beta": 0.0, "stochastic": False}), data)
    start = fed.initial_state()
    model = {k: v[0].clone().requires_grad_()
             for k, v in fed.algorithm.personalized(start.server, start.clients)[0].items()}
    model.update({k: start.server["body"][k].clone().requires_grad_() for k in ("encoder.weight", "encoder.bias")})
    opt = torch.optim.Adam(model.values(), lr=ADAM["lr"], weight_decay=ADAM["weight_decay"])
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(fed.algorithm.forward(fed.fresh_net(), model, x), y).backward()
        opt.step()
    after = run_round(InlineSteps(1), fed, start, 0)
    trained = {**after.server["body"], **{k: v[0] for k, v in after.clients["head"].items()}}
    for k, v in model.items():
        torch.testing.assert_close(trained[k], v.detach(), rtol=1e-5, atol=1e-6)
