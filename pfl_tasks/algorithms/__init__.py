"""Algorithms layer: one module per method, registered by name, plus the federated round."""

from pfl_tasks.algorithms import (  # noqa: F401  (registration)
    apfl,
    cfl,
    ditto,
    fedavg,
    fedcr,
    feddyn,
    fedper,
    fedprox,
    fedrep,
    finetune,
    fpfc,
    knnper,
    l2sgd,
    local,
    lp_proj,
    pfedmac,
    pfedme,
)
from pfl_tasks.algorithms.base import Algorithm, HyperParams
from pfl_tasks.algorithms.registry import ALGORITHMS, build, hyper_parameters, source_file, validate_params

__all__ = ["ALGORITHMS", "Algorithm", "HyperParams", "build", "hyper_parameters", "source_file", "validate_params"]
