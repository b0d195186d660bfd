"""pandera schema of a partition table: one row per sample, features in columns f0..f{d-1}."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pandera.pandas as pa

from pfl_tasks.errors import DataValidationError

FEATURE_PATTERN = r"^f\d+$"
# the largest feature magnitude a partition may hold: standardized or pixel features are O(1),
# and a model's float32 products of larger ones overflow without ever turning non-finite in time
# for the divergence check (a 3e38 feature trained to "finished" with 6e34 weights)
MAX_ABS_VALUE = 1e9


def bounded() -> pa.Check:
    return pa.Check(lambda x: np.isfinite(x) & (np.abs(x) <= MAX_ABS_VALUE),
                    name=f"finite, at most {MAX_ABS_VALUE:g} in magnitude (standardize larger values)")


def partition_schema(task: str, n_classes: int, n_clients: int) -> pa.DataFrameSchema:
    if task == "classification":
        label = pa.Column(
            "int64", pa.Check.in_range(0, n_classes - 1), title=f"class in [0, {n_classes - 1}]"
        )
    else:
        label = pa.Column("float32", bounded())
    return pa.DataFrameSchema(
        {
            "sample_id": pa.Column("int64", pa.Check.ge(0), unique=True),
            "client_id": pa.Column("int64", pa.Check.in_range(0, n_clients - 1)),
            "split": pa.Column(str, pa.Check.isin(["train", "val", "test"])),
            "label": label,
            FEATURE_PATTERN: pa.Column("float32", bounded(), regex=True),
        },
        strict=True,
        coerce=False,
    )


def validate_partition(df: pd.DataFrame, task: str, n_classes: int, n_clients: int) -> None:
    """Raise DataValidationError naming the failing columns/clients; return None if valid."""
    try:
        partition_schema(task, n_classes, n_clients).validate(df, lazy=True)
    except pa.errors.SchemaErrors as err:
        cases = err.failure_cases
        lines = []
        for (column, check), group in cases.groupby(["column", "check"], dropna=False, sort=False):
            rows = [i for i in group["index"].tolist() if i is not None and i == i][:5]
            clients = sorted(set(df.loc[rows, "client_id"].tolist())) if rows and "client_id" in df else []
            values = group["failure_case"].tolist()[:5]
            where = f" (clients {clients})" if clients else ""
            lines.append(f"column '{column}' fails {check}: values {values}{where}")
        raise DataValidationError("partition table is invalid:\n  " + "\n  ".join(lines)) from None
    present = df.groupby("client_id")["split"].agg(set)
    empty = sorted(set(range(n_clients)) - set(present.index))
    if empty:
        raise DataValidationError(f"clients without any sample: {empty}")
    for split in ("train", "val", "test"):
        lacking = sorted(int(k) for k, s in present.items() if split not in s)
        if lacking:
            raise DataValidationError(f"clients without a {split} sample: {lacking}")
