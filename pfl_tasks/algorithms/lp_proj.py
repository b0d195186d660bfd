"""lp-proj: personal models coupled by infimal convolution to a shared model that lives in a
fixed low-dimensional random subspace; only that low-dimensional vector is communicated.

Lin, Han, Li, Zhang, "Personalized Federated Learning towards Communication Efficiency,
Robustness and Fairness", NeurIPS 2022. With P in R^{p x d} a fixed random projection of the
d model parameters to p = `dim` << d coordinates, the problem is
    min_w sum_i M_i(w),   M_i(w) = min_{x_i} f_i(x_i) + lam/2 ||P x_i - w||^2,
x_i the client's personal model, w in R^p the shared one. Each round, as in the authors' code
(its square-regularizer client, the case the paper's convergence theory covers): a client
receives w, sets w_i = w and, `local_rounds` times, runs its local budget on x_i for
f_i(x_i) + lam/2 ||P x_i - w_i||^2 (x_i warm-started from its last value), then steps
w_i <- w_i - lr lam (w_i - P x_i), lr times the gradient of M_i at w_i. It sends w_i (p floats);
the server averages the w_i uniformly (the code's default). At the fixed point
sum_i (w - P x_i*(w)) = 0: w minimizes sum_i M_i.

P has standard Gaussian rows scaled to unit norm (the authors' code), drawn from the
experiment seed by every party and never sent; w starts at 0 (the code). [choice] lam = 1,
dim = 64, lr = 0.05, local_rounds = 1: the authors' scripts use lam in {1, 5, 15}, p from 21 to
600 by model, local lr 0.01-0.05 and one local round. [choice] Only the squared l2 coupling;
the code's l_p couplings (p = 1 against Byzantine clients) are left out. Memory: P is p x d
floats (64 x 13.7k for the digits CNN: 3.5 MB). Evaluated: the personal models x_i; there is
no global model (w is not a model of the net).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated

import torch
from pydantic import Field

from pfl_tasks.algorithms.base import Algorithm, HyperParams, PersonalModels
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.executor import penalized
from pfl_tasks.engine.streams import StreamKey

LOCAL_ROUND = StreamKey("lp_proj/local", 0)  # local round r: this number + r
PROJECTION = StreamKey("lp_proj/projection", 0x9A0)  # per run: the projection every party shares

class LpProjHyper(HyperParams):
    lam: Annotated[float, Field(gt=0)] = 1.0
    dim: Annotated[int, Field(gt=0)] = 64
    lr: Annotated[float, Field(gt=0)] = 0.05
    local_rounds: Annotated[int, Field(gt=0)] = 1


@lru_cache(maxsize=4)
def projection(key: int, dim: int, size: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """P [dim, size] with unit-norm Gaussian rows, the same for every party sharing `key` (the
    run's `lp_proj/projection` stream):
    drawn on the host, uploaded once per device."""
    if device.type != "cpu":
        return projection(key, dim, size).to(device)
    rows = torch.randn(dim, size, generator=torch.Generator().manual_seed(key))
    return rows / rows.norm(dim=1, keepdim=True)


def flatten(params, start: int = 0) -> torch.Tensor:
    """One vector per model (`start=1` for a stack [K, ...]), parameters in name order."""
    return torch.cat([params[k].flatten(start) for k in sorted(params)], -1)


def coupled(lam: float, proj: torch.Tensor):
    """Objective f_i(x) + lam/2 ||P x - w_i||^2, w_i passed as the trainer's `aux`."""

    def gradient(grads, params, aux):  # lam P^T (P x_i - w_i), each client's row
        names = sorted(params)
        full = lam * (flatten(params, 1) @ proj.T - aux["w"]) @ proj
        for name, part in zip(names, full.split([params[k][0].numel() for k in names], 1)):
            if name in grads:
                grads[name].add_(part.view_as(grads[name]))

    @penalized(gradient)
    def objective(data_loss, params, aux):
        return data_loss(params) + 0.5 * lam * ((proj @ flatten(params) - aux["w"]) ** 2).sum()

    return objective


@register
class LpProj(PersonalModels, Algorithm):
    name = "lp_proj"
    streams = (LOCAL_ROUND, PROJECTION)
    citation = "Lin et al., NeurIPS 2022"
    Hyper = LpProjHyper

    def init_server(self, params, facts):
        size = sum(v.numel() for v in params.values())
        if self.hp.dim >= size:
            raise ValueError(f"lp_proj: dim={self.hp.dim} must be below the model's {size} parameters "
                             "(the shared model lives in a low-dimensional subspace)")
        return {"w": torch.zeros(self.hp.dim)}

    def payload(self, server):
        return {"w": server["w"]}

    def client_update(self, trainer, payload, state):
        hp, personal = self.hp, state["personal"]
        size = sum(v[0].numel() for v in personal.values())
        proj = projection(trainer.rng(PROJECTION).run_seed(), hp.dim, size, payload["w"].device)
        w = payload["w"].expand(trainer.n_clients, hp.dim)
        for r in range(hp.local_rounds):
            personal = trainer.fit(personal, coupled(hp.lam, proj), aux={"w": w}, stream=trainer.rng(LOCAL_ROUND, r))
            w = w - hp.lr * hp.lam * (w - flatten(personal, 1) @ proj.T)
        return {"w": w}, {"personal": personal}

    def aggregate(self, server, messages, weights, ids):
        return {"w": messages["w"].mean(0)}

    def global_model(self, server, clients):
        return None
