"""FedDyn: dynamic regularization, so the server's fixed point is the exact global optimum.

Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021 (Algorithm 1;
seed eqs. (12)-(15)). Client k solves (approximately, by the round's local steps)
    min_theta f_k(theta) - <g_k, theta> + alpha/2 ||theta - theta_server||^2
then g_k <- g_k - alpha (theta_k - theta_server). The server keeps
    h <- h - alpha/K sum_{k in S} (theta_k - theta_server),
    theta_server <- mean_{k in S} theta_k - h / alpha          (K = all clients).
alpha = 0.01 is the paper's most used value. Not personalized: both views are theta_server.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field

from pfl_tasks.algorithms.base import Algorithm, HyperParams
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.executor import penalized
from pfl_tasks.engine.state import broadcast, replicate, tree_zip


class FedDynHyper(HyperParams):
    alpha: Annotated[float, Field(gt=0)] = 0.01


@register
class FedDyn(Algorithm):
    name = "feddyn"
    citation = "Acar et al., ICLR 2021"
    Hyper = FedDynHyper

    def init_server(self, params, facts):
        return {"global": params, "h": {k: torch.zeros_like(v) for k, v in params.items()},
                "n_clients": torch.tensor(facts.n_clients)}

    def init_clients(self, params, n_clients):
        return {"grad": replicate({k: torch.zeros_like(v) for k, v in params.items()}, n_clients)}

    def objective(self):
        """f_k(theta) - <grad_k, theta> + alpha/2 ||theta - anchor||^2 (the paper's local problem)."""
        alpha = self.hp.alpha

        def gradient(grads, params, aux):  # -grad_k + alpha (theta - anchor)
            for k, g in grads.items():
                g.sub_(aux["grad"][k]).add_(params[k] - aux["anchor"][k], alpha=alpha)

        @penalized(gradient)
        def objective(data_loss, params, aux):
            linear = sum((aux["grad"][k] * params[k]).sum() for k in params)
            prox = sum(((params[k] - aux["anchor"][k]) ** 2).sum() for k in params)
            return data_loss(params) - linear + 0.5 * alpha * prox

        return objective

    def client_update(self, trainer, payload, state):
        anchor = broadcast(payload["global"], trainer.n_clients)
        theta = trainer.fit(anchor, self.objective(), aux={"anchor": anchor, "grad": state["grad"]})
        grad = tree_zip(lambda g, t, a: g - self.hp.alpha * (t - a), state["grad"], theta, anchor)
        return {"params": theta}, {"grad": grad}

    def aggregate(self, server, messages, weights, ids):
        theta, alpha = server["global"], self.hp.alpha
        drift = {k: (messages["params"][k] - theta[k]).sum(0) for k in theta}
        h = {k: server["h"][k] - alpha / int(server["n_clients"]) * drift[k] for k in theta}
        mean = {k: messages["params"][k].mean(0) for k in theta}
        return {"global": {k: mean[k] - h[k] / alpha for k in theta}, "h": h, "n_clients": server["n_clients"]}
