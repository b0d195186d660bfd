"""FedProx: FedAvg whose clients minimise f_k(w) + mu/2 ||w - w_global||^2.

Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020 (eq. 2; mu = 0.01
is among the paper's tuned values). The proximal gradient mu (w - w_global) enters through the
objective, so every optimizer and both executors apply it the same way.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pfl_tasks.algorithms.base import proximal
from pfl_tasks.algorithms.fedavg import FedAvg, FedAvgHyper
from pfl_tasks.algorithms.registry import register


class FedProxHyper(FedAvgHyper):
    mu: Annotated[float, Field(ge=0)] = 0.01


@register
class FedProx(FedAvg):
    name = "fedprox"
    citation = "Li et al., MLSys 2020"
    Hyper = FedProxHyper

    def objective(self):
        return proximal(self.hp.mu)
