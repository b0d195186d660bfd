"""Partitioners assign every sample to exactly one client, then split each client into train,
validation and test; standardized sources are then scaled by their train part only."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pfl_tasks.config import (
    DatasetConfig,
    DirichletPartition,
    IIDPartition,
    NaturalPartition,
    ShardsPartition,
)
from pfl_tasks.data.sources import RawDataset
from pfl_tasks.errors import PartitionError


def assign_clients(data: RawDataset, cfg, rng: np.random.Generator) -> np.ndarray:
    """Client id of every sample, shape [n]."""
    if isinstance(cfg, NaturalPartition):
        if data.groups is None:
            raise PartitionError("partition 'natural' needs a dataset with natural groups")
        _, client = np.unique(data.groups, return_inverse=True)
        return client
    if isinstance(cfg, IIDPartition):
        return iid(len(data.labels), cfg.n_clients, rng)
    if data.task != "classification":
        raise PartitionError(f"partition '{cfg.kind}' needs class labels")
    if isinstance(cfg, DirichletPartition):
        return dirichlet(data.labels, cfg.n_clients, cfg.alpha, cfg.min_samples, rng)
    if isinstance(cfg, ShardsPartition):
        return shards(data.labels, cfg.n_clients, cfg.classes_per_client, rng)
    raise PartitionError(f"unknown partition {cfg!r}")


def iid(n: int, n_clients: int, rng: np.random.Generator) -> np.ndarray:
    if n < n_clients:
        raise PartitionError(f"iid: {n} samples cannot fill {n_clients} clients")
    client = np.empty(n, dtype=np.int64)
    for k, idx in enumerate(np.array_split(rng.permutation(n), n_clients)):
        client[idx] = k
    return client


def dirichlet(
    labels: np.ndarray, n_clients: int, alpha: float, min_samples: int, rng: np.random.Generator
) -> np.ndarray:
    """Label skew by Dirichlet(alpha) class proportions, with at least `min_samples` per client.

    One draw per class, no rejection loop, so it terminates for any alpha > 0. Clients left
    below the minimum are topped up with random samples of the currently largest client.
    """
    n = len(labels)
    if n < n_clients * min_samples:
        raise PartitionError(
            f"dirichlet: {n} samples cannot give {n_clients} clients {min_samples} each"
        )
    client = np.empty(n, dtype=np.int64)
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        share = rng.dirichlet(np.full(n_clients, alpha))
        counts = _largest_remainder(share, len(idx))
        client[idx] = np.repeat(np.arange(n_clients), counts)
    sizes = np.bincount(client, minlength=n_clients)
    for k in np.flatnonzero(sizes < min_samples):
        for _ in range(min_samples - sizes[k]):
            donor = int(np.argmax(sizes))
            moved = rng.choice(np.flatnonzero(client == donor))
            client[moved] = k
            sizes[donor] -= 1
            sizes[k] += 1
    return client


def shards(
    labels: np.ndarray, n_clients: int, classes_per_client: int, rng: np.random.Generator
) -> np.ndarray:
    """Exactly `classes_per_client` classes on every client, each class split evenly
    among the clients that hold it (classes dealt round-robin from a seeded order)."""
    classes = rng.permutation(np.unique(labels))
    if classes_per_client > len(classes):
        raise PartitionError(
            f"shards: {classes_per_client} classes per client, but the data has {len(classes)}"
        )
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for k in range(n_clients):
        for j in range(classes_per_client):
            holders[int(classes[(k * classes_per_client + j) % len(classes)])].append(k)
    client = np.empty(len(labels), dtype=np.int64)
    for c, ks in holders.items():
        idx = rng.permutation(np.flatnonzero(labels == c))
        if ks and len(idx) < len(ks):
            raise PartitionError(f"shards: class {c} has {len(idx)} samples for {len(ks)} clients")
        if not ks:
            raise PartitionError(f"shards: class {c} is held by no client; use more clients")
        for k, part in zip(ks, np.array_split(idx, len(ks))):
            client[part] = k
    return client


SPLITS = ("train", "val", "test")


def split_clients(
    data: RawDataset, client: np.ndarray, cfg: DatasetConfig, rng: np.random.Generator
) -> np.ndarray:
    """Each sample's split, "train", "val" or "test", by `cfg.split`: per client, a
    `test_fraction` of its samples is test and a `val_fraction` validation."""
    if cfg.split == "chronological" and not data.ordered:
        raise PartitionError(
            f"split 'chronological' needs a source whose samples are in time order (chicago), "
            f"not '{cfg.source.name}'"
        )
    split = np.full(len(client), "train", dtype=object)
    is_test = _hold_out(data, client, np.arange(len(client)), cfg.test_fraction, cfg, rng)
    split[is_test] = "test"
    rest = np.flatnonzero(~is_test)  # validation comes from the rest: chronologically, just before test
    is_val = _hold_out(data, client[rest], rest, cfg.val_fraction / (1 - cfg.test_fraction), cfg, rng)
    split[rest[is_val]] = "val"
    return split


def _hold_out(data: RawDataset, client: np.ndarray, rows: np.ndarray, fraction: float, cfg: DatasetConfig,
              rng: np.random.Generator) -> np.ndarray:
    """Boolean mask over `rows` (samples in source order, of clients `client`) of a held-out part."""
    if cfg.split == "chronological":
        return chronological_split(client, fraction)
    return split_train_test(client, data.labels[rows], fraction, data.task == "classification", rng)


def chronological_split(client: np.ndarray, test_fraction: float) -> np.ndarray:
    """Boolean mask of test samples: each client's last round(test_fraction * n) samples in
    source order, and at least one train and one test sample for every client with two or more."""
    is_test = np.zeros(len(client), dtype=bool)
    for k in np.unique(client):
        idx = np.flatnonzero(client == k)
        n_test = min(max(round(test_fraction * len(idx)), 1), len(idx) - 1)
        is_test[idx[len(idx) - n_test:]] = True
    return is_test


def standardize_by_train(data: RawDataset, is_train: np.ndarray) -> tuple[RawDataset, list[dict]]:
    """Each group's features and targets scaled by the mean/std of its train targets, so no
    validation or test value shapes the scale; also each group's {mean, std}, to turn MSE back
    into data units."""
    features, labels = data.features.astype(np.float64), data.labels.astype(np.float64)
    scale = []
    for g in np.unique(data.groups):
        mine = data.groups == g
        train = labels[mine & is_train]
        mean, std = train.mean(), train.std()
        if not std > 0:
            raise PartitionError(f"cannot standardize group {g}: its train targets are constant")
        features[mine] = (features[mine] - mean) / std
        labels[mine] = (labels[mine] - mean) / std
        scale.append({"mean": float(mean), "std": float(std)})
    scaled = replace(data, features=features.astype(np.float32), labels=labels.astype(np.float32))
    return scaled, scale


def split_train_test(
    client: np.ndarray, labels: np.ndarray, test_fraction: float, stratify: bool,
    rng: np.random.Generator,
) -> np.ndarray:
    """Boolean mask of test samples: per client, stratified by label where possible,
    and at least one train and one test sample for every client with two or more."""
    is_test = np.zeros(len(client), dtype=bool)
    for k in np.unique(client):
        idx = np.flatnonzero(client == k)
        strata = [idx[labels[idx] == c] for c in np.unique(labels[idx])] if stratify else [idx]
        chosen = []
        for members in strata:
            members = rng.permutation(members)
            chosen.append(members[: int(np.floor(test_fraction * len(members) + rng.random()))])
        picked = np.concatenate(chosen)
        if len(idx) >= 2:
            if len(picked) == 0:
                picked = rng.choice(idx, 1)
            elif len(picked) == len(idx):
                picked = picked[1:]
        is_test[picked] = True
    return is_test


def _largest_remainder(share: np.ndarray, total: int) -> np.ndarray:
    raw = share * total
    counts = np.floor(raw).astype(int)
    counts[np.argsort(counts - raw)[: total - counts.sum()]] += 1
    return counts
