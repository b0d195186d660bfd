"""pFedMac: personalized models that maximize their correlation with the global model.

Li et al., "Personalized Federated Learning via Maximizing Correlation with Sparse and
Hierarchical Extensions", arXiv:2107.05330 (seed eqs. (16)-(18) and ClientUpdate). Client k
starts theta_k = theta and, for each local step on a fresh minibatch D:
    omega_k <- argmin_w l_k(w; D) - lam <w, theta_k> + gamma ||w||_1
               (`inner_steps` proximal-gradient steps with `personal_lr`, warm-started;
                the l1 part by soft-thresholding, so gamma > 0 gives exact zeros)
    theta_k <- theta_k - eta lam (theta_k - omega_k)         (eta: the local optimizer's lr)
and sends theta_k; the server smooths theta <- (1 - beta) theta + beta mean_k theta_k.
[choice] Defaults lam = 0.1, beta = 1, 5 inner steps at lr 0.01, gamma = 0: the seed gives
no values; set them per experiment.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field
from torch.func import grad

from pfl_tasks.algorithms.base import HyperParams
from pfl_tasks.algorithms.pfedme import PFedMe
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import broadcast


class PFedMacHyper(HyperParams):
    lam: Annotated[float, Field(gt=0)] = 0.1
    beta: Annotated[float, Field(gt=0)] = 1.0
    inner_steps: Annotated[int, Field(gt=0)] = 5
    personal_lr: Annotated[float, Field(gt=0)] = 0.01
    gamma: Annotated[float, Field(ge=0)] = 0.0


def soft_threshold(x: torch.Tensor, tau: float) -> torch.Tensor:
    return torch.sign(x) * torch.clamp(x.abs() - tau, min=0)


@register
class PFedMac(PFedMe):
    """Shares pFedMe's personal-model state, beta-smoothing server rule and views."""

    name = "pfedmac"
    citation = "Li et al., arXiv:2107.05330"
    Hyper = PFedMacHyper

    def client_update(self, trainer, payload, state):
        hp, eta = self.hp, trainer.local.optimizer.lr

        def step(carry, data_loss, aux, batch):
            theta, omega = carry["theta"], carry["personal"]

            def correlation_objective(w):
                return data_loss(w) - hp.lam * sum((w[k] * theta[k]).sum() for k in w)

            for _ in range(hp.inner_steps):
                g = grad(correlation_objective)(omega)
                omega = {
                    k: soft_threshold(omega[k] - hp.personal_lr * g[k], hp.personal_lr * hp.gamma)
                    for k in omega
                }
            theta = {k: theta[k] - eta * hp.lam * (theta[k] - omega[k]) for k in theta}
            return {"theta": theta, "personal": omega}

        start = {"theta": broadcast(payload["global"], len(trainer.client_ids)), "personal": state["personal"]}
        out = trainer.scan(start, step)
        return {"params": out["theta"]}, {"personal": out["personal"]}
