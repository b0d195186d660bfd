"""Algorithms layer: one module per method, registered by name, plus the federated round."""

from pfl_tasks.algorithms import (  # noqa: F401  (registration)
    apfl,
    ditto,
    fedavg,
    fedcr,
    feddyn,
    fedper,
    fedprox,
    fedrep,
    fpfc,
    l2sgd,
    local,
    pfedmac,
    pfedme,
)
from pfl_tasks.algorithms.base import Algorithm, HyperParams
from pfl_tasks.algorithms.registry import ALGORITHMS, build, validate_params

__all__ = ["ALGORITHMS", "Algorithm", "HyperParams", "build", "validate_params"]
