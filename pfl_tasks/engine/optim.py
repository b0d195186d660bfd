"""Functional optimizers over (stacked) parameter dicts, matching `torch.optim` semantics.

Algorithms that write their own local steps inside `LocalTrainer.scan` carry one client's
optimizer as `start(cfg, params)` and apply it with `apply`, so the configured optimizer
(momentum, weight decay, Adam) drives their steps too.
"""

from __future__ import annotations

import torch

from pfl_tasks.config import OptimizerConfig
from pfl_tasks.engine.state import Params, per_row
from pfl_tasks.numerics import sqrt


def init_state(cfg: OptimizerConfig, params: Params) -> dict[str, Params]:
    if cfg.name == "adam":
        return {
            "exp_avg": {k: torch.zeros_like(v) for k, v in params.items()},
            "exp_avg_sq": {k: torch.zeros_like(v) for k, v in params.items()},
        }
    if cfg.momentum:
        return {"momentum": {k: torch.zeros_like(v) for k, v in params.items()}}
    return {}


def per_client(value, like: torch.Tensor):
    """A step count or lr: a number, or a tensor (each client's [K] on a whole stack, shaped
    to broadcast against its rows of `like`)."""
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return per_row(value, like)
    return value


def plain_sgd(cfg: OptimizerConfig) -> bool:
    """SGD without momentum or weight decay: a step is -lr times the gradient, nothing kept."""
    return cfg.name == "sgd" and not cfg.momentum and not cfg.weight_decay


def step_(cfg: OptimizerConfig, params: Params, grads: Params, state: dict[str, Params],
          step_index: int | torch.Tensor, lr: float | torch.Tensor | None = None) -> None:
    """One optimizer step (`step_index` counts from 0) for every client, at `lr` (default: the
    configured one; a tensor for step-size schedules), updating `params` and `state` in place:
    no step allocates a model-sized tensor (each costs page faults on the CPU) unless weight
    decay or a tensor `lr` asks for one."""
    for name, p in params.items():
        g, rate = grads[name], cfg.lr if lr is None else per_client(lr, p)
        if cfg.weight_decay:
            g = g.add(p, alpha=cfg.weight_decay)
        if cfg.name == "adam":
            b1, b2 = cfg.betas
            m, v = state["exp_avg"][name], state["exp_avg_sq"][name]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).add_(g * g, alpha=1 - b2)
            t = per_client(step_index + 1, p)
            denom = (sqrt(v) / sqrt(1 - b2**t)) + cfg.eps
            p.sub_((rate / (1 - b1**t)) * m / denom)
        else:
            if cfg.momentum:
                g = state["momentum"][name].mul_(cfg.momentum).add_(g)
            if isinstance(rate, torch.Tensor):
                p.sub_(rate * g)
            else:
                p.add_(g, alpha=-rate)


def start(cfg: OptimizerConfig, params: Params) -> dict:
    """The optimizers of a chunk's clients over stacked `params` [K, ...], as a `scan` carry:
    their state and step counts."""
    first = next(iter(params.values()))
    return {"state": init_state(cfg, params), "t": torch.zeros(len(first), device=first.device)}


def apply(cfg: OptimizerConfig, params: Params, grads: Params, carry: dict,
          lr: float | torch.Tensor | None = None) -> tuple[Params, dict]:
    """`step_` inside a `scan` step, where `carry` (from `start`) is one client's: `params` and
    the optimizer's state move in place (a scan step owns its carry); returns them and the carry."""
    step_(cfg, params, grads, carry["state"], carry["t"], lr)
    return params, {"state": carry["state"], "t": carry["t"] + 1}


def torch_optimizer(cfg: OptimizerConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The `torch.optim` twin of this config, used by the sequential reference executor (its Adam
    roots are MKL's: held to the vectorized form within tolerance, not bits)."""
    if cfg.name == "adam":
        return torch.optim.Adam(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )
