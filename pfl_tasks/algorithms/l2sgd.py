"""L2SGD: loopless local SGD on the mixture problem f(Theta) + lam phi(Theta).

Hanzely & Richtarik, "Federated Learning of a Mixture of Global and Local Models",
arXiv:2002.05516 (seed eqs. (1)-(2) and pseudocode). One federated round is one iteration:
with probability 1 - p (a coin shared by all clients, seeded by round) every client takes a
local step theta_k <- theta_k - lr/(K(1-p)) grad f_k(theta_k); with probability p the clients
send theta_k, the server averages them, and every client takes the averaging step
theta_k <- theta_k - lr lam/(K p) (theta_k - mean). The averaging step needs the mean, so it
is applied at the start of the client's next round (and by `personalized` for evaluation),
the only round whose download is the mean; the sequence of updates is the algorithm's. Needs full participation. [choice] Defaults
lam = 1, p = 0.5, lr = 1 (the paper sweeps them; K = all clients scales the steps).
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field

from pfl_tasks.algorithms.base import Algorithm, HyperParams
from pfl_tasks.algorithms.registry import register
from pfl_tasks.config import OptimizerConfig
from pfl_tasks.engine.state import replicate
from pfl_tasks.engine.streams import StreamKey

COMMUNICATE = StreamKey("l2sgd/communicate", 0x125)  # per round: whether the round averages


class L2SGDHyper(HyperParams):
    lam: Annotated[float, Field(ge=0)] = 1.0
    p: Annotated[float, Field(gt=0, lt=1)] = 0.5
    lr: Annotated[float, Field(gt=0)] = 1.0


@register
class L2SGD(Algorithm):
    name = "l2sgd"
    streams = (COMMUNICATE,)
    citation = "Hanzely & Richtarik, arXiv:2002.05516"
    Hyper = L2SGDHyper
    full_participation = True
    uses_local_lr = False  # its steps are lr / (K (1 - p)) of its own `lr`

    def init_server(self, params, facts):
        return {"mean": params, "pending": torch.zeros(()), "n_clients": torch.tensor(facts.n_clients)}

    def init_clients(self, params, n_clients):
        # K, which scales both steps, is known to every client: it never crosses the wire
        return {"params": replicate(params, n_clients), "n_clients": torch.full((n_clients,), n_clients)}

    def payload(self, server):
        """The mean, when an averaging step is due (the clients sent theirs last round); else nothing."""
        return {"mean": server["mean"]} if server["pending"] else {}

    def averaging_step(self, params, mean, n_clients: int):
        shrink = self.hp.lr * self.hp.lam / (n_clients * self.hp.p)
        return {k: v - shrink * (v - mean[k]) for k, v in params.items()}

    def client_update(self, trainer, payload, state):
        n_clients = int(state["n_clients"][0])
        params = state["params"] if "mean" not in payload else self.averaging_step(state["params"], payload["mean"],
                                                                                   n_clients)
        if trainer.rng(COMMUNICATE).uniform() < self.hp.p:  # this round averages
            return {"params": params}, {**state, "params": params}
        step = self.hp.lr / (n_clients * (1 - self.hp.p))
        one_step = trainer.local.model_copy(
            update={"steps": 1, "epochs": None, "optimizer": OptimizerConfig(name="sgd", lr=step)}
        )
        return {}, {**state, "params": trainer.fit(params, local=one_step)}

    def aggregate(self, server, messages, weights, ids):
        if not messages:
            return {**server, "pending": torch.zeros_like(server["pending"])}
        mean = {k: v.mean(0) for k, v in messages["params"].items()}
        return {**server, "mean": mean, "pending": torch.ones_like(server["pending"])}

    def personalized(self, server, state):
        if not server["pending"]:
            return state["params"], True
        return self.averaging_step(state["params"], server["mean"], int(server["n_clients"])), True

    def global_model(self, server, clients):
        return server["mean"]
