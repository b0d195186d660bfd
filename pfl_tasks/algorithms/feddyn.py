"""FedDyn: dynamic regularization, so the server's fixed point is the exact global optimum.

Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021 (Algorithm 1;
seed eqs. (12)-(15)). Client k solves (approximately, by the round's local steps)
    min_theta f_k(theta) - <g_k, theta> + alpha/2 ||theta - theta_server||^2
then g_k <- g_k - alpha (theta_k - theta_server). Up to a constant, the local problem is
    f_k(theta) + alpha/2 ||theta - (theta_server + g_k / alpha)||^2,
a proximal pull toward a shifted anchor (`pull_target`): the fused proximal SGD step of
FedProx runs it. The server keeps
    h <- h - alpha/K sum_{k in S} (theta_k - theta_server),
    theta_server <- mean_{k in S} theta_k - h / alpha          (K = all clients).
alpha = 0.01 is the paper's most used value. Not personalized: both views are theta_server.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field

from pfl_tasks.algorithms.base import Algorithm, HyperParams, proximal
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import Params, Tree, broadcast, replicate, tree_zip


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
        """The paper's local problem f_k(theta) - <g_k, theta> + alpha/2 ||theta - anchor||^2,
        as a proximal one around `pull_target` (the same up to a constant)."""
        return proximal(self.hp.alpha)

    def pull_target(self, anchor: Params, grad: Tree) -> Params:
        """anchor + g_k / alpha: -<g, t> + alpha/2 ||t - a||^2 = alpha/2 ||t - (a + g/alpha)||^2 + const."""
        return tree_zip(lambda a, g: a + g / self.hp.alpha, anchor, grad)

    def client_update(self, trainer, payload, state):
        anchor = broadcast(payload["global"], trainer.n_clients)
        theta = trainer.fit(anchor, self.objective(), aux=self.pull_target(anchor, state["grad"]))
        grad = tree_zip(lambda g, t, a: g - self.hp.alpha * (t - a), state["grad"], theta, anchor)
        return {"params": theta}, {"grad": grad}

    def aggregate(self, server, messages, weights, ids):
        theta, alpha = server["global"], self.hp.alpha
        drift = {k: (messages["params"][k] - theta[k]).sum(0) for k in theta}
        h = {k: server["h"][k] - alpha / int(server["n_clients"]) * drift[k] for k in theta}
        mean = {k: messages["params"][k].mean(0) for k in theta}
        return {"global": {k: mean[k] - h[k] / alpha for k in theta}, "h": h, "n_clients": server["n_clients"]}
