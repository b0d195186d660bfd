"""Nets, written so `torch.func.vmap` works over them: no BatchNorm running stats,
no in-place ops on captured tensors. The engine only uses them through `functional_call`."""

from __future__ import annotations

import math

import torch
from torch import nn

from pfl_tasks.config import CNNNet, LinearNet, MLPNet


def build_net(cfg, feature_shape: tuple[int, ...], n_outputs: int) -> nn.Module:
    n_in = math.prod(feature_shape)
    if isinstance(cfg, LinearNet):
        return nn.Sequential(nn.Flatten(), nn.Linear(n_in, n_outputs, bias=cfg.bias))
    if isinstance(cfg, MLPNet):
        layers: list[nn.Module] = [nn.Flatten()]
        for width in cfg.hidden:
            layers += [nn.Linear(n_in, width), nn.ReLU()]
            n_in = width
        return nn.Sequential(*layers, nn.Linear(n_in, n_outputs))
    if isinstance(cfg, CNNNet):
        return _cnn(cfg, feature_shape, n_outputs)
    raise TypeError(f"unknown net config {cfg!r}")


def _cnn(cfg: CNNNet, feature_shape: tuple[int, ...], n_outputs: int) -> nn.Module:
    if len(feature_shape) != 3:
        raise ValueError(f"cnn needs image features [C, H, W], got shape {list(feature_shape)}")
    channels, side = feature_shape[0], min(feature_shape[1:])
    layers: list[nn.Module] = []
    for width in cfg.channels:
        layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
        if side >= 4:  # pool while the map is large enough: 8x8 -> 2x2, 28x28 -> 7x7
            layers.append(nn.MaxPool2d(2))
            side //= 2
        channels = width
    body = nn.Sequential(*layers, nn.Flatten())
    with torch.no_grad():
        n_flat = body(torch.zeros(1, *feature_shape)).shape[1]
    return nn.Sequential(
        *body, nn.Linear(n_flat, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, n_outputs)
    )


def init_params(net: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fresh parameters for `net`, reproducible from `seed` alone."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for module in net.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    finally:
        torch.random.set_rng_state(gen_state)
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def head_keys(param_names) -> set[str]:
    """Parameters of the last layer (the "head"; the rest is the "body"), for the
    `nn.Sequential` nets built here, whose parameter names start with the module index."""
    last = max(int(name.split(".", 1)[0]) for name in param_names)
    return {name for name in param_names if int(name.split(".", 1)[0]) == last}
