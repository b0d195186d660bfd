"""FedAvg+FT and FedProx+FT: trained exactly as FedAvg / FedProx; each client's personalized
model is the current global model fine-tuned on that client's own training data.

The fine-tuning baseline of personalization studies, e.g. Wang et al., "Federated Evaluation of
On-device Personalization", arXiv:1910.10252, 2019 (the global model trained with FedAvg, then
a few local SGD epochs per client). Fine-tuning happens at every evaluation, for every client,
from that round's global model; the fine-tuned models are not kept. It runs the local optimizer
on the plain local loss, with no proximal term also for FedProx+FT [choice], for `ft_epochs`
epochs over the client's data, or `ft_steps` steps when set, at learning rate `ft_lr` (default:
the local one) [choice: the budget is tuned per task in the literature; 1 epoch]. Its
minibatches come from the evaluation stream of the round, so runs are reproducible and both
executors draw the same. The global model evaluated is the server model.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pfl_tasks.algorithms.base import EVAL_STREAM, HyperParams
from pfl_tasks.algorithms.fedavg import FedAvg, FedAvgHyper
from pfl_tasks.algorithms.fedprox import FedProx, FedProxHyper
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import broadcast


class FineTuneHyper(HyperParams):
    ft_epochs: Annotated[int, Field(gt=0)] = 1
    ft_steps: Annotated[int, Field(gt=0)] | None = None  # when set, replaces `ft_epochs`
    ft_lr: Annotated[float, Field(gt=0)] | None = None


class FineTune:
    """Mixin: a client is evaluated with the global model fine-tuned on its training data."""

    def personalize(self, trainer, server, state, val_loss):
        hp, local = self.hp, trainer.local
        budget = local.model_copy(update={
            "steps": hp.ft_steps,
            "epochs": None if hp.ft_steps else hp.ft_epochs,
            "optimizer": local.optimizer.model_copy(update={"lr": hp.ft_lr or local.optimizer.lr}),
        })
        start = broadcast(server["global"], len(trainer.client_ids))
        return trainer.fit(start, stream=EVAL_STREAM, local=budget), True


class FedAvgFTHyper(FineTuneHyper, FedAvgHyper):
    pass


class FedProxFTHyper(FineTuneHyper, FedProxHyper):
    pass


@register
class FedAvgFT(FineTune, FedAvg):
    name = "fedavg_ft"
    citation = "McMahan et al., AISTATS 2017 + local fine-tuning (Wang et al., arXiv:1910.10252)"
    Hyper = FedAvgFTHyper


@register
class FedProxFT(FineTune, FedProx):
    name = "fedprox_ft"
    citation = "Li et al., MLSys 2020 + local fine-tuning (Wang et al., arXiv:1910.10252)"
    Hyper = FedProxFTHyper
