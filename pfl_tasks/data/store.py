"""Build, write and read a partitioned dataset: `partition.parquet` + `manifest.json`."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pfl_tasks.config import DatasetConfig, config_hash
from pfl_tasks.data.partition import assign_clients, split_clients, standardize_by_train
from pfl_tasks.data.schema import DataValidationError, validate_partition
from pfl_tasks.data.sources import RawDataset, load_source

TABLE = "partition.parquet"
MANIFEST = "manifest.json"


def build_partition(name: str, cfg: DatasetConfig, seed: int) -> tuple[pd.DataFrame, dict]:
    """The partition table (rows grouped by client, each in source order) and its manifest."""
    rng = np.random.default_rng([seed, _stable_int(name)])
    data = load_source(cfg.source, rng)
    client = assign_clients(data, cfg.partition, rng)
    is_test = split_clients(data, client, cfg, rng)
    scale = None
    if data.standardize:
        data, scale = standardize_by_train(data, is_test)
    n = len(data.labels)
    flat = data.features.reshape(n, -1)
    df = pd.DataFrame(flat, columns=[f"f{i}" for i in range(flat.shape[1])])
    df.insert(0, "sample_id", np.arange(n, dtype=np.int64))
    df.insert(1, "client_id", client.astype(np.int64))
    df.insert(2, "split", np.where(is_test, "test", "train").astype(object))
    df.insert(3, "label", data.labels)
    df = df.sort_values(["client_id", "sample_id"], kind="stable").reset_index(drop=True)
    n_clients = int(client.max()) + 1
    validate_partition(df, data.task, data.n_classes, n_clients)
    manifest = {
        "dataset": name,
        "seed": seed,
        "params_hash": config_hash(cfg),
        "config": cfg.model_dump(mode="json"),
        "task": data.task,
        "n_classes": data.n_classes,
        "feature_shape": list(data.feature_shape),
        "n_clients": n_clients,
        "clients": _client_summary(df, data),
        "group_scale": scale,  # standardized sources: each group's train {mean, std}
    }
    return df, manifest


def write_partition(df: pd.DataFrame, manifest: dict, out_dir: Path) -> None:
    """Write into a sibling temp dir, then swap it in: no half-written partition is left."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        df.to_parquet(tmp / TABLE, index=False)
        manifest = {**manifest, "table_sha256": _sha256(tmp / TABLE)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class ClientSplit:
    """One split of every client, stored flat: client k owns rows offsets[k] : offsets[k]+counts[k]."""

    x: torch.Tensor  # [total, *feature_shape]
    y: torch.Tensor  # [total]
    offsets: torch.Tensor  # [N] int64
    counts: torch.Tensor  # [N] int64


@dataclass(frozen=True)
class FederatedData:
    name: str
    task: str
    n_classes: int
    feature_shape: tuple[int, ...]
    train: ClientSplit
    test: ClientSplit
    manifest_hash: str
    partition: str = ""  # e.g. "dirichlet(alpha=0.3, min_samples=20, n_clients=20)"

    @property
    def n_clients(self) -> int:
        return len(self.train.counts)

    @property
    def n_outputs(self) -> int:
        return self.n_classes if self.task == "classification" else 1


def load_partition(directory: Path) -> FederatedData:
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataValidationError(f"{directory}: unreadable {MANIFEST}: {err}") from None
    if _sha256(directory / TABLE) != manifest.get("table_sha256"):
        raise DataValidationError(f"{directory / TABLE} does not match its manifest's sha256")
    df = pd.read_parquet(directory / TABLE)
    validate_partition(df, manifest["task"], manifest["n_classes"], manifest["n_clients"])
    shape = tuple(manifest["feature_shape"])
    return FederatedData(
        name=manifest["dataset"],
        task=manifest["task"],
        n_classes=manifest["n_classes"],
        feature_shape=shape,
        train=_client_split(df[df["split"] == "train"], manifest["n_clients"], shape),
        test=_client_split(df[df["split"] == "test"], manifest["n_clients"], shape),
        manifest_hash=manifest["table_sha256"][:16],
        partition=_describe(manifest["config"]["partition"]),
    )


def _describe(partition: dict) -> str:
    options = ", ".join(f"{k}={v}" for k, v in sorted(partition.items()) if k != "kind")
    return f"{partition['kind']}({options})"


def _client_split(df: pd.DataFrame, n_clients: int, shape: tuple[int, ...]) -> ClientSplit:
    features = df.filter(regex=r"^f\d+$").to_numpy(np.float32, copy=True)
    counts = torch.as_tensor(np.bincount(df["client_id"].to_numpy(), minlength=n_clients))
    offsets = torch.cumsum(counts, 0) - counts
    return ClientSplit(
        x=torch.from_numpy(features).reshape(len(df), *shape),
        y=torch.from_numpy(df["label"].to_numpy().copy()),
        offsets=offsets,
        counts=counts,
    )


def _client_summary(df: pd.DataFrame, data: RawDataset) -> list[dict]:
    summary = []
    for k, rows in df.groupby("client_id"):
        entry = {
            "client_id": int(k),
            "train": int((rows["split"] == "train").sum()),
            "test": int((rows["split"] == "test").sum()),
        }
        if data.task == "classification":
            entry["labels"] = np.bincount(rows["label"], minlength=data.n_classes).tolist()
        summary.append(entry)
    return summary


def _sha256(path: Path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as err:
        raise DataValidationError(f"cannot read {path}: {err}") from None


def _stable_int(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)
