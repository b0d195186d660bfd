"""Build, write and read a partitioned dataset: `partition.parquet` + `manifest.json`, one
folder per seed, `data/partitions/<dataset>/seed-<seed>/`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pfl_tasks.config import DatasetConfig, config_hash
from pfl_tasks.data.partition import SPLITS, assign_clients, split_clients, standardize_by_train
from pfl_tasks.data.schema import validate_partition
from pfl_tasks.data.sources import RawDataset, load_source
from pfl_tasks.errors import DataValidationError
from pfl_tasks.files import atomic_directory

if TYPE_CHECKING:  # pandas and pandera load with the first table built or read (0.45 s): a
    import pandas as pd  # config check, which imports this module, answers without them

TABLE = "partition.parquet"
MANIFEST = "manifest.json"
PARTITIONS = Path("data/partitions")


def partition_dir(root: Path, dataset: str, seed: int) -> Path:
    return Path(root) / PARTITIONS / dataset / f"seed-{seed}"


def build_partition(name: str, cfg: DatasetConfig, seed: int) -> tuple[pd.DataFrame, dict]:
    """The partition table (rows grouped by client, each in source order) and its manifest."""
    import pandas as pd

    rng = np.random.default_rng([seed, _stable_int(name)])
    data = load_source(cfg.source, rng)
    client = assign_clients(data, cfg.partition, rng)
    split = split_clients(data, client, cfg, rng)
    scale = None
    if data.standardize:
        data, scale = standardize_by_train(data, split == "train")
    n = len(data.labels)
    flat = data.features.reshape(n, -1)
    df = pd.DataFrame(flat, columns=[f"f{i}" for i in range(flat.shape[1])])
    df.insert(0, "sample_id", np.arange(n, dtype=np.int64))
    df.insert(1, "client_id", client.astype(np.int64))
    df.insert(2, "split", split)
    df.insert(3, "label", data.labels)
    df = df.sort_values(["client_id", "sample_id"], kind="stable").reset_index(drop=True)
    n_clients = int(client.max()) + 1
    validate_partition(df, data.task, data.n_classes, n_clients)
    # a natural partition's client k is the source's k-th client id in sorted order (`assign_clients`)
    names = np.unique(data.groups) if cfg.partition.kind == "natural" else None
    manifest = {
        "dataset": name,
        "seed": seed,
        "params_hash": config_hash(cfg),
        "config": cfg.model_dump(mode="json"),
        "task": data.task,
        "n_classes": data.n_classes,
        "feature_shape": list(data.feature_shape),
        "n_clients": n_clients,
        "clients": _client_summary(df, data, names),
        "group_scale": scale,  # standardized sources: each group's train {mean, std}
    }
    return df, manifest


def write_partition(df: pd.DataFrame, manifest: dict, out_dir: Path) -> None:
    """Write into a sibling temp dir, then swap it in: no half-written partition is left."""
    def fill(tmp: Path) -> None:
        df.to_parquet(tmp / TABLE, index=False)
        (tmp / MANIFEST).write_text(json.dumps(sealed({**manifest, "table_sha256": _sha256(tmp / TABLE)}), indent=1))

    atomic_directory(out_dir, fill)


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
    val: ClientSplit  # everything that selects (rounds, hyper-parameters) reads this
    test: ClientSplit  # only reported
    manifest_hash: str
    partition: str = ""  # e.g. "dirichlet(alpha=0.3, min_samples=20, n_clients=20)"
    client_names: tuple[str, ...] = ()  # a natural partition's: the source's client ids, in client order

    @property
    def n_clients(self) -> int:
        return len(self.train.counts)

    @property
    def n_outputs(self) -> int:
        return self.n_classes if self.task == "classification" else 1


NonNegative = Annotated[int, Field(ge=0, strict=True)]


class ClientEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    client_id: NonNegative
    train: NonNegative
    val: NonNegative
    test: NonNegative
    labels: list[NonNegative] | None = None  # classification: rows per class
    name: str | None = None  # a natural partition's: the source's client id


class Manifest(BaseModel):
    """`manifest.json`: what the table holds. Sealed by `manifest_sha256`, a hash of all the
    other fields, as the table is by `table_sha256`."""

    model_config = ConfigDict(extra="forbid")

    dataset: str
    seed: NonNegative
    params_hash: str
    config: dict[str, Any]
    task: Literal["classification", "regression"]
    n_classes: NonNegative
    feature_shape: Annotated[list[Annotated[int, Field(gt=0, strict=True)]], Field(min_length=1)]
    n_clients: Annotated[int, Field(gt=0, strict=True)]
    clients: list[ClientEntry]
    group_scale: Any = None
    table_sha256: str
    manifest_sha256: str


def _seal(manifest: dict) -> str:
    fields = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def sealed(manifest: dict) -> dict:
    return {**manifest, "manifest_sha256": _seal(manifest)}


def read_manifest(directory: Path) -> Manifest:
    """The validated manifest of a partition folder; DataValidationError names file and field."""
    path = Path(directory) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataValidationError(f"{path}: unreadable: {err}") from None
    if not isinstance(raw, dict):
        raise DataValidationError(f"{path}: expected a JSON object")
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as err:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in err.errors())
        raise DataValidationError(f"{path}: invalid manifest: {fields}") from None
    if _seal(raw) != manifest.manifest_sha256:
        raise DataValidationError(f"{path}: fields edited after it was written (manifest_sha256 does not match); "
                                  "rerun the prepare stage")
    entries = manifest.clients
    if [c.client_id for c in entries] != list(range(manifest.n_clients)):
        raise DataValidationError(f"{path}: clients: expected client_id 0..{manifest.n_clients - 1} in order")
    classification = manifest.task == "classification"
    if classification != (manifest.n_classes >= 2):
        raise DataValidationError(f"{path}: n_classes: {manifest.n_classes} does not fit task '{manifest.task}'")
    for c in entries:
        if classification and (c.labels is None or len(c.labels) != manifest.n_classes
                               or sum(c.labels) != c.train + c.val + c.test):
            raise DataValidationError(f"{path}: clients[{c.client_id}].labels: expected {manifest.n_classes} class "
                                      f"counts summing to train + val + test = {c.train + c.val + c.test}")
    return manifest


def load_partition(directory: Path) -> FederatedData:
    """Read and verify a partition: manifest and table hashes, schema, feature shape, and every
    client's train/val/test and label counts against the manifest. Rows are grouped by client here,
    whatever order the table was saved in."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    table = directory / TABLE
    if _sha256(table) != manifest.table_sha256:
        raise DataValidationError(f"{table} does not match its manifest's table_sha256")
    import pandas as pd

    df = pd.read_parquet(table)
    validate_partition(df, manifest.task, manifest.n_classes, manifest.n_clients)
    shape = tuple(manifest.feature_shape)
    n_features = df.filter(regex=r"^f\d+$").shape[1]
    if n_features != int(np.prod(shape)):
        raise DataValidationError(f"{directory / MANIFEST}: feature_shape {list(shape)} needs {int(np.prod(shape))} "
                                  f"feature columns; {table.name} has {n_features}")
    df = df.sort_values(["client_id", "sample_id"], kind="stable", ignore_index=True)
    _check_counts(df, manifest, directory / MANIFEST)
    return FederatedData(
        name=manifest.dataset,
        task=manifest.task,
        n_classes=manifest.n_classes,
        feature_shape=shape,
        **{split: _client_split(df[df["split"] == split], manifest.n_clients, shape) for split in SPLITS},
        manifest_hash=manifest.table_sha256[:16],
        partition=_describe(manifest.config["partition"]),
        client_names=tuple(c.name for c in manifest.clients) if all(c.name for c in manifest.clients) else (),
    )


def _check_counts(df: pd.DataFrame, manifest: Manifest, where: Path) -> None:
    client = df["client_id"].to_numpy()
    for split in SPLITS:
        actual = np.bincount(client[(df["split"] == split).to_numpy()], minlength=manifest.n_clients)
        expected = np.array([getattr(c, split) for c in manifest.clients])
        wrong = np.flatnonzero(actual != expected)
        if len(wrong):
            k = int(wrong[0])
            raise DataValidationError(f"{where}: clients[{k}].{split} = {expected[k]}, but the table holds "
                                      f"{actual[k]} {split} rows of client {k} ({len(wrong)} clients differ)")
    if manifest.task == "classification":
        actual = np.zeros((manifest.n_clients, manifest.n_classes), dtype=np.int64)
        np.add.at(actual, (client, df["label"].to_numpy()), 1)
        wrong = np.flatnonzero((actual != np.array([c.labels for c in manifest.clients])).any(1))
        if len(wrong):
            raise DataValidationError(f"{where}: clients[{int(wrong[0])}].labels do not match the table's labels "
                                      f"of that client ({len(wrong)} clients differ)")


def _describe(partition: dict) -> str:
    options = ", ".join(f"{k}={v}" for k, v in sorted(partition.items()) if k != "kind")
    return f"{partition['kind']}({options})"


def _client_split(df: pd.DataFrame, n_clients: int, shape: tuple[int, ...]) -> ClientSplit:
    # row-major: a frame's to_numpy is column-major, and gathering rows of that is ~10x slower
    features = np.ascontiguousarray(df.filter(regex=r"^f\d+$").to_numpy(np.float32))
    counts = torch.as_tensor(np.bincount(df["client_id"].to_numpy(), minlength=n_clients))
    offsets = torch.cumsum(counts, 0) - counts
    return ClientSplit(
        x=torch.from_numpy(features).reshape(len(df), *shape),
        y=torch.from_numpy(df["label"].to_numpy().copy()),
        offsets=offsets,
        counts=counts,
    )


def _client_summary(df: pd.DataFrame, data: RawDataset, names: np.ndarray | None) -> list[dict]:
    summary = []
    for k, rows in df.groupby("client_id"):
        entry = {
            "client_id": int(k),
            **({"name": str(names[k])} if names is not None else {}),
            **{split: int((rows["split"] == split).sum()) for split in SPLITS},
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
