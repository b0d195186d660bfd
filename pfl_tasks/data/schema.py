"""pandera schema of a partition table: one row per sample, features in columns f0..f{d-1}."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pfl_tasks.errors import DataValidationError, listing

if TYPE_CHECKING:  # both load with the first table checked (0.45 s), not at import
    import pandas as pd
    import pandera.pandas as pa

FEATURE_PATTERN = r"^f\d+$"
# the largest feature magnitude a partition may hold: standardized or pixel features are O(1),
# and a model's float32 products of larger ones overflow without ever turning non-finite in time
# for the divergence check (a 3e38 feature trained to "finished" with 6e34 weights)
MAX_ABS_VALUE = 1e9
BOUNDED = f"finite, at most {MAX_ABS_VALUE:g} in magnitude (standardize larger values)"


def bounded(values):
    """Elementwise: finite and at most MAX_ABS_VALUE in magnitude (a column or an array)."""
    return np.isfinite(values) & (np.abs(values) <= MAX_ABS_VALUE)


def partition_schema(task: str, n_classes: int, n_clients: int) -> pa.DataFrameSchema:
    """The named columns' schema. The features, hundreds of columns that pandera would check one
    by one (about a second a table), are checked as one array by `feature_failures`."""
    import pandera.pandas as pa

    if task == "classification":
        label = pa.Column(
            "int64", pa.Check.in_range(0, n_classes - 1), title=f"class in [0, {n_classes - 1}]"
        )
    else:
        label = pa.Column("float32", pa.Check(bounded, name=BOUNDED))
    return pa.DataFrameSchema(
        {
            "sample_id": pa.Column("int64", pa.Check.ge(0), unique=True),
            "client_id": pa.Column("int64", pa.Check.in_range(0, n_clients - 1)),
            "split": pa.Column(str, pa.Check.isin(["train", "val", "test"])),
            "label": label,
        },
        coerce=False,
    )


def feature_failures(df: pd.DataFrame, named: list[str]) -> list[str]:
    """A line per failing column besides the `named` ones: not a feature f<j>, not float32, or
    with values that are not BOUNDED (the first 5, with their clients)."""
    features = df.filter(regex=FEATURE_PATTERN)
    lines = [f"column '{c}' fails being in the schema ({', '.join(named)}, f0, f1, ...)"
             for c in df.columns if c not in named and c not in features]
    lines += [f"column '{c}' fails dtype float32: it is {t}" for c, t in features.dtypes.items() if t != np.float32]
    if lines:
        return lines
    values = features.to_numpy()
    bad = ~bounded(values)
    clients = df["client_id"].to_numpy() if "client_id" in df else None
    for j in np.flatnonzero(bad.any(0)):
        rows = np.flatnonzero(bad[:, j])[:5]
        where = f" (clients {sorted(set(clients[rows].tolist()))})" if clients is not None else ""
        lines.append(f"column '{features.columns[j]}' fails {BOUNDED}: values {values[rows, j].tolist()}{where}")
    return lines


def validate_partition(df: pd.DataFrame, task: str, n_classes: int, n_clients: int) -> None:
    """Raise DataValidationError naming the failing columns/clients; return None if valid."""
    import pandera.pandas as pa

    lines, schema = [], partition_schema(task, n_classes, n_clients)
    try:
        schema.validate(df, lazy=True)
    except pa.errors.SchemaErrors as err:
        for (column, check), group in err.failure_cases.groupby(["column", "check"], dropna=False, sort=False):
            rows = [i for i in group["index"].tolist() if i is not None and i == i][:5]
            clients = sorted(set(df.loc[rows, "client_id"].tolist())) if rows and "client_id" in df else []
            values = group["failure_case"].tolist()[:5]
            where = f" (clients {clients})" if clients else ""
            lines.append(f"column '{column}' fails {check}: values {values}{where}")
    lines += feature_failures(df, list(schema.columns))
    if lines:
        raise DataValidationError("partition table is invalid:\n  " + "\n  ".join(lines))
    present = df.groupby("client_id")["split"].agg(set)
    empty = sorted(set(range(n_clients)) - set(present.index))
    if empty:
        raise DataValidationError(f"{len(empty):,} of {n_clients:,} clients without any sample: {listing(empty)}")
    for split in ("train", "val", "test"):
        lacking = sorted(int(k) for k, s in present.items() if split not in s)
        if lacking:
            raise DataValidationError(f"{len(lacking):,} of {n_clients:,} clients without a {split} sample: "
                                      f"{listing(lacking)} (each client needs a train, a val and a test sample: "
                                      "fewer, larger clients)")
