"""Ditto: a global model trained as in FedAvg, and per-client models pulled towards it.

Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through Personalization",
ICML 2021 (Algorithm 1; seed eqs. (8)-(9)). Each round a sampled client runs UpdateGlobal
(local SGD from theta, as FedAvg) and `s` local steps on its personal model
    omega_k <- omega_k - eta (grad f_k(omega_k) + mu (omega_k - theta)),
with theta the model it received this round (the seed's single step is s = 1; Algorithm 1 of
the paper uses the round's local budget, as here). mu = 0.1 is among the paper's tuned values.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pfl_tasks.algorithms.base import PersonalModels, proximal
from pfl_tasks.algorithms.fedavg import FedAvg, FedAvgHyper
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import broadcast
from pfl_tasks.engine.streams import StreamKey

PERSONAL = StreamKey("ditto/personal", 1)  # the personal model's fit, after the global one


class DittoHyper(FedAvgHyper):
    mu: Annotated[float, Field(ge=0)] = 0.1


@register
class Ditto(PersonalModels, FedAvg):
    name = "ditto"
    streams = (PERSONAL,)
    citation = "Li et al., ICML 2021"
    Hyper = DittoHyper

    def client_update(self, trainer, payload, state):
        start = broadcast(payload["global"], trainer.n_clients)
        global_k = trainer.fit(start)
        personal = trainer.fit(state["personal"], proximal(self.hp.mu), aux=start, stream=trainer.rng(PERSONAL))
        return {"params": global_k}, {"personal": personal}
