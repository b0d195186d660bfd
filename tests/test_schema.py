import numpy as np
import pytest

from pfl_tasks.config import DatasetConfig
from pfl_tasks.data import build_partition, load_partition, write_partition
from pfl_tasks.data.schema import validate_partition
from pfl_tasks.errors import DataValidationError


@pytest.fixture(scope="module")
def table():
    cfg = DatasetConfig(
        source={"name": "digits"},
        partition={"kind": "dirichlet", "n_clients": 5, "alpha": 1.0, "min_samples": 10},
    )
    df, manifest = build_partition("digits", cfg, seed=0)
    return df, manifest


def check(df):
    validate_partition(df, "classification", 10, 5)


def test_valid_table_passes(table):
    check(table[0])


def test_nan_feature_is_named(table):
    df = table[0].copy()
    df.loc[7, "f3"] = np.nan
    with pytest.raises(DataValidationError, match="f3"):
        check(df)


@pytest.mark.parametrize("value", [3e38, -2e9])
def test_a_feature_too_large_to_train_on_is_named(table, value):
    """A 3e38 feature once trained to "finished" (weights 6e34): refused, asking to standardize."""
    df = table[0].copy()
    df.loc[7, "f3"] = value
    with pytest.raises(DataValidationError, match=r"column 'f3' fails finite, at most 1e\+09 in magnitude "
                                                  r"\(standardize larger values\): values \[.+\] \(clients \["):
        check(df)
    df.loc[7, "f3"] = 1e9
    check(df)


def test_an_unknown_column_or_a_feature_of_another_dtype_is_named(table):
    with pytest.raises(DataValidationError, match="column 'extra' fails being in the schema"):
        check(table[0].assign(extra=1.0))
    with pytest.raises(DataValidationError, match="column 'f3' fails dtype float32: it is float64"):
        check(table[0].astype({"f3": "float64"}))


def test_every_failing_column_is_named_at_once(table):
    """A label and two features out of bounds: one error, a line each, features with their clients."""
    df = table[0].copy()
    df.loc[3, "label"], df.loc[7, "f3"], df.loc[9, "f5"] = 10, np.nan, np.inf
    with pytest.raises(DataValidationError) as info:
        check(df)
    lines = str(info.value).splitlines()[1:]
    assert [line.split(" fails")[0].strip() for line in lines] == ["column 'label'", "column 'f3'", "column 'f5'"]
    assert f"values [nan] (clients [{df.loc[7, 'client_id']}])" in lines[1]


def test_out_of_range_label_is_named(table):
    df = table[0].copy()
    df.loc[3, "label"] = 10
    with pytest.raises(DataValidationError, match="label") as info:
        check(df)
    assert "clients [" in str(info.value)


def test_empty_client_is_named(table):
    df = table[0][table[0]["client_id"] != 2]
    with pytest.raises(DataValidationError, match=r"^1 of 5 clients without any sample: 2$"):
        check(df)


def test_client_without_test_split_is_named(table):
    df = table[0]
    df = df[~((df["client_id"] == 4) & (df["split"] == "test"))]
    with pytest.raises(DataValidationError, match=r"^1 of 5 clients without a test sample: 4 \("):
        check(df)


def test_duplicated_sample_is_rejected(table):
    df = table[0].copy()
    df.loc[10, "sample_id"] = df.loc[11, "sample_id"]
    with pytest.raises(DataValidationError, match="sample_id"):
        check(df)


def test_manifest_counts_and_roundtrip(tmp_path, table):
    df, manifest = table
    write_partition(df, manifest, tmp_path / "digits")
    data = load_partition(tmp_path / "digits")
    assert data.n_clients == 5 and data.feature_shape == (1, 8, 8)
    assert [c["train"] for c in manifest["clients"]] == data.train.counts.tolist()
    assert sum(sum(c["labels"]) for c in manifest["clients"]) == len(df)
    assert list(tmp_path.iterdir()) == [tmp_path / "digits"]  # no temp dirs left


def test_tampered_table_is_refused(tmp_path, table):
    df, manifest = table
    write_partition(df, manifest, tmp_path / "digits")
    df.iloc[:10].to_parquet(tmp_path / "digits" / "partition.parquet")
    with pytest.raises(DataValidationError, match="sha256"):
        load_partition(tmp_path / "digits")


def test_failed_prepare_leaves_no_partial_output(tmp_path):
    import flows.prepare as prepare
    from conftest import tiny_params
    import yaml

    data = tiny_params()
    data["datasets"]["digits"]["partition"]["min_samples"] = 1000  # impossible
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match="cannot give"):
        prepare.prepare("digits", str(tmp_path / "params.yaml"), tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
