"""FedAvg: local SGD from the global model, server takes the sample-weighted average.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017 (Algorithm 1: weights n_k / n). A server optimizer other than the plain average
(`server_optimizer.py`) makes it FedAvgM, FedAdam, FedYogi or FedAdagrad.
"""

from __future__ import annotations

from typing import Literal

from pfl_tasks.algorithms.base import Algorithm
from pfl_tasks.algorithms.registry import register
from pfl_tasks.algorithms.server_optimizer import ServerOptimizerHyper, init_server_optimizer, server_step
from pfl_tasks.engine.executor import data_objective
from pfl_tasks.engine.state import broadcast, weighted_mean


class FedAvgHyper(ServerOptimizerHyper):
    weighting: Literal["samples", "uniform"] = "samples"


@register
class FedAvg(Algorithm):
    name = "fedavg"
    citation = "McMahan et al., AISTATS 2017"
    Hyper = FedAvgHyper

    def init_server(self, params, facts):
        return {"global": params, **init_server_optimizer(self.hp, params)}

    def objective(self):
        return data_objective

    def client_update(self, trainer, payload, state):
        k = trainer.n_clients
        start = broadcast(payload["global"], k)
        trained = trainer.fit(start, self.objective(), aux=start)
        return {"params": trained}, state

    def aggregate(self, server, messages, weights, ids):
        if self.hp.weighting == "uniform":
            weights = weights.new_ones(weights.shape)
        return server_step(self.hp, server, "global", weighted_mean(messages["params"], weights))
