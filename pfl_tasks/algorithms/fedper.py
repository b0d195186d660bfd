"""FedPer: a shared body averaged by the server, a personal head that never leaves its client.

Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv:1912.00818, 2019.
The head is the net's last layer. Local training updates body and head together from
[received body, own head]; only the body is sent. The server has no head, so the "global"
model evaluated is the body with the clients' mean head, formed by the simulator.
"""

from __future__ import annotations

from pfl_tasks.algorithms.base import Algorithm
from pfl_tasks.algorithms.fedavg import FedAvgHyper
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import broadcast, replicate, weighted_mean
from pfl_tasks.nets import head_keys


@register
class FedPer(Algorithm):
    name = "fedper"
    citation = "Arivazhagan et al., arXiv:1912.00818"
    Hyper = FedAvgHyper

    def init_server(self, params, facts):
        head = head_keys(params)
        return {"body": {k: v for k, v in params.items() if k not in head}}

    def init_clients(self, params, n_clients):
        head = head_keys(params)
        return {"head": replicate({k: v for k, v in params.items() if k in head}, n_clients)}

    def payload(self, server):
        return {"body": server["body"]}

    def start(self, trainer, payload, state):
        return {**broadcast(payload["body"], trainer.n_clients), **state["head"]}

    def local_train(self, trainer, params):
        return trainer.fit(params)

    def client_update(self, trainer, payload, state):
        trained = self.local_train(trainer, self.start(trainer, payload, state))
        body = {k: v for k, v in trained.items() if k not in state["head"]}
        return {"body": body}, {"head": {k: trained[k] for k in state["head"]}}

    def aggregate(self, server, messages, weights, ids):
        if self.hp.weighting == "uniform":
            weights = weights.new_ones(weights.shape)
        return {"body": weighted_mean(messages["body"], weights)}

    def personalized(self, server, state):
        k = len(next(iter(state["head"].values())))
        return {**broadcast(server["body"], k), **state["head"]}, True

    def global_model(self, server, clients):
        """Evaluation-only view: the body with the clients' mean head (heads never move)."""
        return {**server["body"], **{k: v.mean(0) for k, v in clients["head"].items()}}
