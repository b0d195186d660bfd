"""APFL: each client mixes a local model v_k with the global model, hat_w = a_k v_k + (1-a_k) theta.

Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461 (Algorithm 1;
seed eqs. (10)-(11)). Per local step (tau = the round's local budget, the synchronization gap):
    mix      = a_k v_k + (1 - a_k) theta_k
    theta_k <- theta_k - eta grad f_k(theta_k)
    v_k     <- v_k - eta grad_v f_k(mix)      (= a_k grad f_k(mix), the gradient w.r.t. v_k)
    a_k     <- clip(a_k - eta_a <v_k - theta_k, grad f_k(mix)>, 0, 1)   if adaptive_alpha
then theta_k is sent and the server averages them uniformly (seed: 1/#S). The theta and v
steps are steps of the local optimizer (momentum, weight decay or Adam apply when configured),
each with its own state, at lr eta: the configured one, or 16 / (mu (t + a)),
a = max(128 kappa, tau), with `decay_mu` set (t counts the client's local steps over all rounds). The personalized model
evaluated is the mixture a_k v_k + (1 - a_k) theta (a known peer bug evaluates v_k alone).
With `average_iterates`, both views are the paper's final averages with weights
p_t = (t + a)^2, taken once per round (t = rounds x tau, tau = local steps, or epochs when the
budget is in epochs): the server keeps sum_t p_t theta_t, and each client catches up its own sum
lazily when it next participates (or at evaluation), so the cost stays per sampled client.
[choice] alpha adapts by default (the paper's eq. (10); "adaptive" is its name), from a_k = 0.5
at the local lr (`alpha_lr`). A fixed alpha = 0.25, among the paper's settings, personalizes
little: v_k's gradient is scaled by a_k and its weight in the mixture again, so the personal
part learns 16 times slower than a Local-only model.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field

from pfl_tasks.algorithms.base import Algorithm, HyperParams
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine import optim
from pfl_tasks.engine.executor import clientwise
from pfl_tasks.engine.state import broadcast, interpolate, per_row, replicate


class APFLHyper(HyperParams):
    alpha: Annotated[float, Field(ge=0, le=1)] = 0.5  # the initial a_k when adaptive
    adaptive_alpha: bool = True
    alpha_lr: Annotated[float, Field(gt=0)] | None = None  # None: the local optimizer's lr
    decay_mu: Annotated[float, Field(gt=0)] | None = None
    decay_kappa: Annotated[float, Field(gt=0)] = 1.0
    average_iterates: bool = False


@register
class APFL(Algorithm):
    name = "apfl"
    citation = "Deng et al., arXiv:2003.13461"
    Hyper = APFLHyper

    def init_server(self, params, facts):
        server = {"global": params}
        if self.hp.average_iterates:
            zeros = {k: torch.zeros_like(v) for k, v in params.items()}
            server.update(round=torch.zeros(()), weight_sum=torch.zeros(()), global_sum=zeros,
                          local_steps=torch.tensor(facts.local_steps))
        return server

    def init_clients(self, params, n_clients):
        state = {
            "local": replicate(params, n_clients),
            "alpha": torch.full((n_clients,), self.hp.alpha),
            "steps_done": torch.zeros(n_clients),
        }
        if self.hp.average_iterates:
            zeros = {k: torch.zeros_like(v) for k, v in params.items()}
            state.update(mix_sum=replicate(zeros, n_clients), seen_weight=torch.zeros(n_clients),
                         seen_global=replicate(zeros, n_clients))
        return state

    def payload(self, server):
        return {k: server[k] for k in ("global", "weight_sum", "global_sum") if k in server}

    def offset(self, tau: int) -> float:
        """a = max(128 kappa, tau), tau the local steps per round."""
        return max(128 * self.hp.decay_kappa, tau)

    def step_size(self, local_lr, steps_done, tau: int):
        if self.hp.decay_mu is None:
            return local_lr
        return 16 / (self.hp.decay_mu * (steps_done + self.offset(tau)))

    def catch_up(self, state, weight_sum, global_sum):
        """Each client's sum_t p_t mix_t through the rounds it has not yet counted."""
        gap = weight_sum - state["seen_weight"]

        def add(mix_sum, v, g, seen):
            alpha = per_row(state["alpha"], v)
            return mix_sum + alpha * v * per_row(gap, v) + (1 - alpha) * (g - seen)

        return {k: add(state["mix_sum"][k], v, global_sum[k], state["seen_global"][k])
                for k, v in state["local"].items()}

    def client_update(self, trainer, payload, state):
        hp, local = self.hp, trainer.local
        cfg, alpha_lr = local.optimizer, hp.alpha_lr or local.optimizer.lr
        if hp.average_iterates:
            k = trainer.n_clients
            state = {**state, "mix_sum": self.catch_up(state, payload["weight_sum"], payload["global_sum"]),
                     "seen_weight": payload["weight_sum"].expand(k).clone(),
                     "seen_global": {n: v.expand(k, *v.shape).clone() for n, v in payload["global_sum"].items()}}

        # plain SGD at a fixed lr runs both steps fused into their backward passes, no gradient stored
        plain = optim.plain_sgd(cfg) and hp.decay_mu is None

        @clientwise  # per-client values (alpha, step counts) act on their own rows
        def step(carry, data_loss, aux, batch):
            theta, v, alpha = carry["theta"], carry["local"], carry["alpha"]
            opt_theta, opt_local = carry["opt_theta"], carry["opt_local"]
            eta = self.step_size(cfg.lr, carry["steps_done"], local.steps or local.epochs)
            if plain:
                slope = batch.interpolation_step(alpha, v, theta, eta, theta_step=True)
            else:
                g_v, slope = batch.interpolation_grad(alpha, v, theta)
                theta, opt_theta = optim.apply(cfg, theta, batch.data_grad(theta), opt_theta, eta)
                v, opt_local = optim.apply(cfg, v, g_v, opt_local, eta)
            if hp.adaptive_alpha:
                alpha = torch.clamp(alpha - alpha_lr * slope, 0.0, 1.0)
            return {"theta": theta, "local": v, "alpha": alpha, "steps_done": carry["steps_done"] + 1,
                    "opt_theta": opt_theta, "opt_local": opt_local}

        trained = ("local", "alpha", "steps_done")
        received = broadcast(payload["global"], trainer.n_clients)
        start = {"theta": received, **{k: state[k] for k in trained},
                 "opt_theta": optim.start(cfg, received), "opt_local": optim.start(cfg, state["local"])}
        out = trainer.scan(start, step)
        return {"params": out["theta"]}, {**state, **{k: out[k] for k in trained}}

    def aggregate(self, server, messages, weights, ids):
        theta = {k: v.mean(0) for k, v in messages["params"].items()}
        if not self.hp.average_iterates:
            return {"global": theta}
        r, tau = server["round"] + 1, int(server["local_steps"])
        p = (r * tau + self.offset(tau)) ** 2
        return {
            **server, "global": theta, "round": r, "weight_sum": server["weight_sum"] + p,
            "global_sum": {k: server["global_sum"][k] + p * v for k, v in theta.items()},
        }

    def personalized(self, server, state):
        if self.hp.average_iterates:
            total = self.catch_up(state, server["weight_sum"], server["global_sum"])
            return {k: v / server["weight_sum"] for k, v in total.items()}, True

        return interpolate(state["alpha"], state["local"], server["global"]), True

    def global_model(self, server, clients):
        if self.hp.average_iterates:
            return {k: v / server["weight_sum"] for k, v in server["global_sum"].items()}
        return server["global"]
