"""APFL: each client mixes a local model v_k with the global model, hat_w = a_k v_k + (1-a_k) theta.

Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461 (Algorithm 1;
seed eqs. (10)-(11)). Per local step (tau = the round's local budget, the synchronization gap):
    mix      = a_k v_k + (1 - a_k) theta_k
    theta_k <- theta_k - eta grad f_k(theta_k)
    v_k     <- v_k - eta grad_v f_k(mix)      (= a_k grad f_k(mix), the gradient w.r.t. v_k)
    a_k     <- clip(a_k - eta_a <v_k - theta_k, grad f_k(mix)>, 0, 1)   if adaptive_alpha
then theta_k is sent and the server averages them uniformly (seed: 1/#S).
eta is the local optimizer's lr, or 16 / (mu (t + a)), a = max(128 kappa, tau), with
`decay_mu` set (t counts the client's local steps over all rounds). The personalized model
evaluated is the mixture a_k v_k + (1 - a_k) theta (a known peer bug evaluates v_k alone).
alpha = 0.25 is among the paper's settings. [choice] The paper's final p_t = (t+a)^2 iterate
averaging (a device of its convergence proof) is not applied: the last iterates are reported.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field
from torch.func import grad

from pfl_tasks.algorithms.base import Algorithm, HyperParams
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import broadcast, replicate


class APFLHyper(HyperParams):
    alpha: Annotated[float, Field(ge=0, le=1)] = 0.25
    adaptive_alpha: bool = False
    alpha_lr: Annotated[float, Field(gt=0)] = 0.01
    decay_mu: Annotated[float, Field(gt=0)] | None = None
    decay_kappa: Annotated[float, Field(gt=0)] = 1.0


def mixture(alpha, v, theta):
    return {k: alpha * v[k] + (1 - alpha) * theta[k] for k in v}


@register
class APFL(Algorithm):
    name = "apfl"
    citation = "Deng et al., arXiv:2003.13461"
    Hyper = APFLHyper

    def init_clients(self, params, n_clients):
        return {
            "local": replicate(params, n_clients),
            "alpha": torch.full((n_clients,), self.hp.alpha),
            "steps_done": torch.zeros(n_clients),
        }

    def step_size(self, local_lr, steps_done, tau):
        if self.hp.decay_mu is None:
            return local_lr
        a = max(128 * self.hp.decay_kappa, tau)
        return 16 / (self.hp.decay_mu * (steps_done + a))

    def client_update(self, trainer, payload, state):
        hp, local = self.hp, trainer.local
        tau = local.steps or local.epochs

        def step(carry, data_loss, aux, batch):
            theta, v, alpha = carry["theta"], carry["local"], carry["alpha"]
            eta = self.step_size(local.optimizer.lr, carry["steps_done"], tau)
            g_mix = grad(data_loss)(mixture(alpha, v, theta))
            g_theta = grad(data_loss)(theta)
            if hp.adaptive_alpha:
                inner = sum(((v[k] - theta[k]) * g_mix[k]).sum() for k in v)
                alpha = torch.clamp(alpha - hp.alpha_lr * inner, 0.0, 1.0)
            return {
                "theta": {k: theta[k] - eta * g_theta[k] for k in theta},
                "local": {k: v[k] - eta * carry["alpha"] * g_mix[k] for k in v},
                "alpha": alpha,
                "steps_done": carry["steps_done"] + 1,
            }

        start = {"theta": broadcast(payload["global"], len(trainer.client_ids)), **state}
        out = trainer.scan(start, step)
        return {"params": out.pop("theta")}, out

    def aggregate(self, server, messages, weights):
        return {"global": {k: v.mean(0) for k, v in messages["params"].items()}}

    def personalized(self, server, state):
        def mix(v, theta):
            alpha = state["alpha"].view(-1, *[1] * (v.dim() - 1))
            return alpha * v + (1 - alpha) * theta

        return {k: mix(v, server["global"][k]) for k, v in state["local"].items()}, True
