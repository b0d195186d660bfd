"""FedRep: FedPer's split, trained in two phases: the head first, with the body frozen, then
the body, with the head frozen.

Collins et al., "Exploiting Shared Representations for Personalized Federated Learning",
ICML 2021 (Algorithm 1: tau_h = 10 head epochs, then the body's local budget).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pfl_tasks.algorithms.fedavg import FedAvgHyper
from pfl_tasks.algorithms.fedper import FedPer
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.streams import StreamKey

HEAD = StreamKey("fedrep/head", 1)  # the head's epochs, before the body's


class FedRepHyper(FedAvgHyper):
    head_epochs: Annotated[int, Field(gt=0)] = 10


@register
class FedRep(FedPer):
    name = "fedrep"
    streams = (HEAD,)
    citation = "Collins et al., ICML 2021"
    Hyper = FedRepHyper

    def local_train(self, trainer, params):
        head = self.head_of(params)
        head_budget = trainer.local.model_copy(update={"epochs": self.hp.head_epochs, "steps": None})
        params = trainer.fit(params, trainable=head, local=head_budget, stream=trainer.rng(HEAD))
        return trainer.fit(params, trainable=set(params) - head)
