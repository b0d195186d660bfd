"""FedAvg+FT and FedProx+FT: trained exactly as FedAvg / FedProx; each client's personalized
model is the current global model fine-tuned on that client's own training data.

The fine-tuning baseline of personalization studies, e.g. Wang et al., "Federated Evaluation of
On-device Personalization", arXiv:1910.10252, 2019 (the global model trained with FedAvg, then
a few local SGD epochs per client). Fine-tuning happens at every evaluation, for every client,
from that round's global model; the fine-tuned models are not kept. It runs the local optimizer
on the plain local loss, with no proximal term also for FedProx+FT [choice], at learning rate
`ft_lr` (default: the local one). Its budget is selected on validation, per client, as the
literature tunes it per task: after each of up to `ft_epochs` epochs over the client's data
(or `ft_steps` steps per stage, when set) the client keeps the model of lowest validation loss
so far, the global model itself included (0 epochs) [choice: each stage restarts the
optimizer's state]. Its minibatches come from the evaluation stream of the round, so runs are
reproducible and both executors draw the same. The global model evaluated is the server model.
"""

from __future__ import annotations

from typing import Annotated

import torch

from pydantic import Field

from pfl_tasks.algorithms.base import HyperParams
from pfl_tasks.algorithms.fedavg import FedAvg, FedAvgHyper
from pfl_tasks.algorithms.fedprox import FedProx, FedProxHyper
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import broadcast, per_row
from pfl_tasks.engine.streams import EVALUATION


class FineTuneHyper(HyperParams):
    ft_epochs: Annotated[int, Field(gt=0)] = 5  # the most stages tried; each is an epoch...
    ft_steps: Annotated[int, Field(gt=0)] | None = None  # ...or this many steps, when set
    ft_lr: Annotated[float, Field(gt=0)] | None = None


class FineTune:
    """Mixin: a client is evaluated with the global model fine-tuned on its training data, for
    the number of stages its validation loss selects."""

    def personalize(self, trainer, server, state, val_loss):
        hp, local = self.hp, trainer.local
        stage = local.model_copy(update={
            "steps": hp.ft_steps,
            "epochs": None if hp.ft_steps else 1,
            "optimizer": local.optimizer.model_copy(update={"lr": hp.ft_lr or local.optimizer.lr}),
        })
        model = broadcast(server["global"], trainer.n_clients)
        best, best_loss = model, val_loss(model, True, self.forward)
        for s in range(hp.ft_epochs):
            model = trainer.fit(model, stream=trainer.rng(EVALUATION, s), local=stage)
            loss = val_loss(model, True, self.forward)
            better = loss < best_loss
            best = {k: torch.where(per_row(better.to(v.device), v), v, best[k]) for k, v in model.items()}
            best_loss = torch.where(better, loss, best_loss)
        return best, True


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
