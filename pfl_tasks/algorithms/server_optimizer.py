"""The server's step on a round's average, after fedjax's `fed_avg` (a server optimizer over
deltas): FedAvgM, FedAdagrad, FedAdam and FedYogi are configurations of FedAvg, not modules.

delta = average - x is the round's averaged client update (Reddi et al., "Adaptive Federated
Optimization", ICLR 2021, Algorithm 2: Delta_t). Plain FedAvg is sgd at lr 1 without momentum,
x + delta: the average itself, returned as is so that it stays bit for bit.
- sgd (FedAvgM, Hsu et al., arXiv:1909.06335, Algorithm 1 with the server lr): m <- beta m + delta,
  x <- x + lr m.
- adagrad, adam, yogi (Reddi et al., Algorithm 2): m <- b1 m + (1 - b1) delta;
  v <- v + delta^2 (adagrad), b2 v + (1 - b2) delta^2 (adam), v - (1 - b2) delta^2 sign(v - delta^2)
  (yogi); x <- x + lr m / (sqrt(v) + tau), from m = 0 and v = tau^2, without bias correction, as
  the paper. Its defaults b1 0.9, b2 0.99, tau 1e-3; its server lr is tuned per task (1e-2 to 1).
The state (m, v) is the server's, kept under `server_optimizer` and checkpointed with it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import Field, model_validator

from pfl_tasks.algorithms.base import HyperParams
from pfl_tasks.engine.state import Params, Tree
from pfl_tasks.numerics import sqrt

Fraction = Annotated[float, Field(ge=0, lt=1, strict=True)]


class ServerOptimizerHyper(HyperParams):
    server_optimizer: Literal["sgd", "adagrad", "adam", "yogi"] = "sgd"
    server_lr: Annotated[float, Field(gt=0)] = 1.0
    server_momentum: Fraction = 0.0  # sgd's beta (FedAvgM)
    # the adaptive methods' b1, b2 (a YAML list, hence not strict) and tau
    server_betas: Annotated[tuple[Fraction, Fraction], Field(strict=False)] = (0.9, 0.99)
    server_tau: Annotated[float, Field(gt=0)] = 1e-3

    @model_validator(mode="after")
    def _used(self):
        """A setting the chosen optimizer ignores stays at its default (never silently unused)."""
        ignored = ("server_betas", "server_tau") if self.server_optimizer == "sgd" else ("server_momentum",)
        moved = [name for name in ignored if getattr(self, name) != type(self).model_fields[name].default]
        if moved:
            raise ValueError(f"{moved} unused by server_optimizer '{self.server_optimizer}'")
        return self

    @property
    def averages(self) -> bool:
        """The step is the plain average (FedAvg's own rule)."""
        return self.server_optimizer == "sgd" and self.server_lr == 1.0 and self.server_momentum == 0.0


def init_server_optimizer(hp: ServerOptimizerHyper, params: Params) -> Tree:
    """The server optimizer's state for `params`: none for the plain average."""
    if hp.averages:
        return {}
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    if hp.server_optimizer == "sgd":
        return {"server_optimizer": {"m": zeros}} if hp.server_momentum else {}
    return {"server_optimizer": {"m": zeros, "v": {k: torch.full_like(v, hp.server_tau**2) for k, v in params.items()}}}


def server_step(hp: ServerOptimizerHyper, server: Tree, key: str, average: Params) -> Tree:
    """`server` with `server[key]` moved towards the round's `average` by the server optimizer."""
    if hp.averages:
        return {**server, key: average}
    x = server[key]
    delta = {k: average[k] - x[k] for k in x}
    state = server.get("server_optimizer", {})
    if hp.server_optimizer == "sgd":
        m = {k: hp.server_momentum * state["m"][k] + d for k, d in delta.items()} if state else delta
        moved = {**server, key: {k: x[k] + hp.server_lr * m[k] for k in x}}
        return {**moved, "server_optimizer": {"m": m}} if state else moved
    b1, b2 = hp.server_betas
    m = {k: b1 * state["m"][k] + (1 - b1) * d for k, d in delta.items()}
    v = {}
    for k, d in delta.items():
        v_old, d2 = state["v"][k], d * d
        if hp.server_optimizer == "adagrad":
            v[k] = v_old + d2
        elif hp.server_optimizer == "adam":
            v[k] = b2 * v_old + (1 - b2) * d2
        else:  # yogi
            v[k] = v_old - (1 - b2) * d2 * torch.sign(v_old - d2)
    new = {k: x[k] + hp.server_lr * m[k] / (sqrt(v[k]) + hp.server_tau) for k in x}
    return {**server, key: new, "server_optimizer": {"m": m, "v": v}}
