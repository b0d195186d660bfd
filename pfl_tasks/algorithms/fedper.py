"""FedPer: a shared body averaged by the server, a personal head that never leaves its client.

Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv:1912.00818, 2019.
The head is the net's last layer (`SharedBody`). Local training updates body and head together
from [received body, own head]; only the body is sent. The server has no head, so the "global"
model evaluated is the body with the clients' mean head, formed by the simulator. The server
optimizer (`server_optimizer.py`) steps the body as FedAvg's steps its model.
"""

from __future__ import annotations

from pfl_tasks.algorithms.base import Algorithm, SharedBody
from pfl_tasks.algorithms.fedavg import FedAvgHyper
from pfl_tasks.algorithms.registry import register
from pfl_tasks.algorithms.server_optimizer import init_server_optimizer, server_step
from pfl_tasks.engine.state import weighted_mean


@register
class FedPer(SharedBody, Algorithm):
    name = "fedper"
    citation = "Arivazhagan et al., arXiv:1912.00818"
    Hyper = FedAvgHyper

    def init_server(self, params, facts):
        body = self.split(params)[0]
        return {"body": body, **init_server_optimizer(self.hp, body)}

    def payload(self, server):
        return {"body": server["body"]}

    def local_train(self, trainer, params):
        return trainer.fit(params)

    def client_update(self, trainer, payload, state):
        body, state = self.parted(self.local_train(trainer, self.joined(payload["body"], state)), state)
        return {"body": body}, state

    def aggregate(self, server, messages, weights, ids):
        if self.hp.weighting == "uniform":
            weights = weights.new_ones(weights.shape)
        return server_step(self.hp, server, "body", weighted_mean(messages["body"], weights))
