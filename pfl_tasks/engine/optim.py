"""Functional optimizers over (stacked) parameter dicts, matching `torch.optim` semantics.

Algorithms that write their own local steps inside `LocalTrainer.scan` carry one client's
optimizer as `start(cfg, params)` and apply it with `apply`, so the configured optimizer
(momentum, weight decay, Adam) drives their steps too.
"""

from __future__ import annotations

import torch

from pfl_tasks.config import OptimizerConfig
from pfl_tasks.engine.state import Params


def init_state(cfg: OptimizerConfig, params: Params) -> dict[str, Params]:
    if cfg.name == "adam":
        return {
            "exp_avg": {k: torch.zeros_like(v) for k, v in params.items()},
            "exp_avg_sq": {k: torch.zeros_like(v) for k, v in params.items()},
        }
    if cfg.momentum:
        return {"momentum": {k: torch.zeros_like(v) for k, v in params.items()}}
    return {}


def step(
    cfg: OptimizerConfig,
    params: Params,
    grads: Params,
    state: dict[str, Params],
    step_index: int | torch.Tensor,
    lr: float | torch.Tensor | None = None,
) -> tuple[Params, dict[str, Params]]:
    """One optimizer step (`step_index` counts from 0) for every client, at `lr` (default: the configured one; a tensor for step-size schedules)."""
    lr = cfg.lr if lr is None else lr
    new_params, new_state = {}, {key: {} for key in state}
    for name, p in params.items():
        g = grads[name]
        if cfg.weight_decay:
            g = g + cfg.weight_decay * p
        if cfg.name == "adam":
            b1, b2 = cfg.betas
            m = b1 * state["exp_avg"][name] + (1 - b1) * g
            v = b2 * state["exp_avg_sq"][name] + (1 - b2) * g * g
            t = step_index + 1
            if isinstance(t, torch.Tensor) and t.dim() == 1:  # each client's count, on a whole stack
                t = t.reshape(-1, *([1] * (p.dim() - 1)))
            denom = (v.sqrt() / (1 - b2**t) ** 0.5) + cfg.eps
            update = (lr / (1 - b1**t)) * m / denom
            new_state["exp_avg"][name], new_state["exp_avg_sq"][name] = m, v
        else:
            if cfg.momentum:
                buf = cfg.momentum * state["momentum"][name] + g
                new_state["momentum"][name] = g = buf
            update = lr * g
        new_params[name] = p - update
    return new_params, new_state


def start(cfg: OptimizerConfig, params: Params) -> dict:
    """The optimizers of a chunk's clients over stacked `params` [K, ...], as a `scan` carry:
    their state and step counts."""
    first = next(iter(params.values()))
    return {"state": init_state(cfg, params), "t": torch.zeros(len(first), device=first.device)}


def apply(cfg: OptimizerConfig, params: Params, grads: Params, carry: dict,
          lr: float | torch.Tensor | None = None) -> tuple[Params, dict]:
    """`step` inside a `scan` step, where `carry` (from `start`) is one client's."""
    new, state = step(cfg, params, grads, carry["state"], carry["t"], lr)
    return new, {"state": state, "t": carry["t"] + 1}


def torch_optimizer(cfg: OptimizerConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The `torch.optim` twin of this config, used by the sequential reference executor."""
    if cfg.name == "adam":
        return torch.optim.Adam(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )
