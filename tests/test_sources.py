import gzip
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from pfl_tasks.config import DatasetConfig, FashionMNISTSource
from pfl_tasks.data import build_partition, load_partition, write_partition
from pfl_tasks.data.partition import chronological_split, standardize_by_train
from pfl_tasks.data.schema import validate_partition
from pfl_tasks.data.sources import RawDataset, chicago, fashion_mnist
from pfl_tasks.errors import DataValidationError, PartitionError, SourceError
from pfl_tasks.outputs import per_client_rows

RNG = np.random.default_rng(0)


def source_cfg(**source) -> DatasetConfig:
    return DatasetConfig.model_validate({"source": source})


# ----------------------------------------------------------------------------- chicago
@pytest.fixture(scope="module")
def chicago_table():
    cfg = DatasetConfig.model_validate(
        {"source": {"name": "chicago"}, "test_fraction": 0.1, "val_fraction": 0.1, "split": "chronological"}
    )
    return build_partition("chicago", cfg, seed=0)


def test_chicago_has_a_client_per_station_and_passes_the_schema(chicago_table):
    df, manifest = chicago_table
    assert manifest["n_clients"] == 20 and manifest["feature_shape"] == [7]
    assert manifest["task"] == "regression"
    assert {c["train"] + c["val"] + c["test"] for c in manifest["clients"]} == {5698 - 7}
    validate_partition(df, "regression", 0, 20)


def test_chicago_windows_are_lags_of_each_station_series():
    austin = chicago(source_cfg(name="chicago", stations=["Austin"]).source, RNG)
    days = [1.463, 1.505, 1.519, 1.49, 1.496, 0.693, 0.408, 0.987, 1.551]  # first 9 rows
    np.testing.assert_allclose(austin.features[0], days[:7], rtol=1e-6)
    np.testing.assert_allclose(austin.labels[:2], days[7:], rtol=1e-6)
    np.testing.assert_allclose(austin.features[1], days[1:8], rtol=1e-6)
    pair = chicago(source_cfg(name="chicago", stations=["Polk", "Austin"], window=2).source, RNG)
    polk_last = np.flatnonzero(pair.groups == 0)[-1]  # clients follow the `stations` order
    np.testing.assert_allclose(pair.features[polk_last], [2.848, 0.812], rtol=1e-6)
    assert pair.labels[polk_last] == pytest.approx(0.611)
    assert np.array_equal(pair.features[pair.groups == 1][0], np.float32(days[:2]))


def test_chicago_table_keeps_lags_after_standardizing(chicago_table):
    df, _ = chicago_table
    rows = df[df["client_id"] == 3]
    x, y = rows.filter(regex=r"^f\d+$").to_numpy(), rows["label"].to_numpy()
    assert np.array_equal(x[1:, :-1], x[:-1, 1:]) and np.array_equal(x[1:, -1], y[:-1])


def test_chronological_split_puts_each_clients_last_tenth_in_test_and_the_tenth_before_in_val(chicago_table):
    df, _ = chicago_table
    for _, rows in df.groupby("client_id"):
        assert rows["sample_id"].is_monotonic_increasing
        n_test = round(0.1 * len(rows))
        n_val = round(0.1 / 0.9 * (len(rows) - n_test))
        assert rows["split"].tolist() == ["train"] * (len(rows) - n_test - n_val) + ["val"] * n_val + ["test"] * n_test


def test_chronological_split_follows_source_order_of_interleaved_clients():
    client = np.array([0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 2])
    is_test = chronological_split(client, 0.4)
    assert np.flatnonzero(is_test).tolist() == [6, 8, 9, 10]  # client 2's one sample: train


def test_chicago_is_standardized_by_train_statistics(chicago_table):
    df, manifest = chicago_table
    train = df[df["split"] == "train"].groupby("client_id")["label"]
    np.testing.assert_allclose(train.mean(), 0, atol=1e-4)
    np.testing.assert_allclose(train.std(ddof=0), 1, atol=1e-4)
    assert len(manifest["group_scale"]) == 20


def test_standardization_ignores_validation_and_test_values():
    groups = np.repeat([0, 1], 10)
    data = RawDataset(
        RNG.normal(5, 2, (20, 3)).astype(np.float32), RNG.normal(5, 2, 20).astype(np.float32),
        "regression", 0, groups=groups, ordered=True, standardize=True,
    )
    is_test = chronological_split(groups, 0.3)
    other = replace(
        data,
        features=np.where(is_test[:, None], 99, data.features).astype(np.float32),
        labels=np.where(is_test, -50, data.labels).astype(np.float32),
    )
    (scaled, scale), (scaled_other, scale_other) = (
        standardize_by_train(d, ~is_test) for d in (data, other)
    )
    assert scale == scale_other
    assert np.array_equal(scaled.features[~is_test], scaled_other.features[~is_test])
    assert np.array_equal(scaled.labels[~is_test], scaled_other.labels[~is_test])


def test_chronological_split_needs_a_time_ordered_source():
    cfg = DatasetConfig.model_validate({
        "source": {"name": "digits"},
        "partition": {"kind": "iid", "n_clients": 3},
        "split": "chronological",
    })
    with pytest.raises(PartitionError, match="time order.*'digits'"):
        build_partition("digits", cfg, seed=0)


def test_unknown_or_repeated_station_is_named():
    with pytest.raises(ValidationError, match=r"station\(s\) \['Nowhere'\]; valid: \['Austin'"):
        source_cfg(name="chicago", stations=["Austin", "Nowhere"])
    with pytest.raises(ValidationError, match=r"listed twice: \['Polk'\]"):
        source_cfg(name="chicago", stations=["Polk", "Austin", "Polk"])


# ----------------------------------------------------------------------------- fashion_mnist
def write_idx(path: Path, array: np.ndarray, magic: int | None = None) -> None:
    sizes = b"".join(n.to_bytes(4, "big") for n in array.shape)
    blob = (magic or 0x800 + array.ndim).to_bytes(4, "big") + sizes + array.tobytes()
    path.write_bytes(gzip.compress(blob) if path.suffix == ".gz" else blob)


def fake_fashion(directory: Path, sizes=(30, 10)) -> dict[str, np.ndarray]:
    """Random IDX files: train gzipped, t10k plain, as the loader accepts both."""
    written = {}
    for part, n, suffix in (("train", sizes[0], ".gz"), ("t10k", sizes[1], "")):
        written[part] = RNG.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        write_idx(directory / f"{part}-images-idx3-ubyte{suffix}", written[part])
        labels = np.arange(n, dtype=np.uint8) % 10
        write_idx(directory / f"{part}-labels-idx1-ubyte{suffix}", labels)
    return written


def test_fashion_mnist_reads_idx_files(tmp_path):
    written = fake_fashion(tmp_path)
    data = fashion_mnist(FashionMNISTSource(name="fashion_mnist", directory=tmp_path), RNG)
    assert data.feature_shape == (1, 28, 28) and data.n_classes == 10
    expected = np.concatenate([written["train"], written["t10k"]])[:, None] / 255
    np.testing.assert_allclose(data.features, expected, rtol=1e-6)
    assert data.labels.tolist() == list(range(10)) * 3 + list(range(10))
    small = FashionMNISTSource(name="fashion_mnist", directory=tmp_path, max_samples=12)
    subset = fashion_mnist(small, np.random.default_rng(5))
    keep = np.sort(np.random.default_rng(5).choice(40, 12, replace=False))  # seeded, in order
    assert keep.tolist() != list(range(12))  # a random subset, not the first rows
    np.testing.assert_allclose(subset.features, expected[keep], rtol=1e-6)
    assert subset.labels.tolist() == data.labels[keep].tolist()


def test_fashion_mnist_partition_passes_the_schema(tmp_path):
    fake_fashion(tmp_path)
    cfg = DatasetConfig.model_validate({
        "source": {"name": "fashion_mnist", "directory": str(tmp_path)},
        "partition": {"kind": "iid", "n_clients": 4},
    })
    df, manifest = build_partition("fashion", cfg, seed=0)
    assert manifest["feature_shape"] == [1, 28, 28] and len(df) == 40
    validate_partition(df, "classification", 10, 4)


def test_missing_fashion_mnist_names_the_directory_and_the_package(tmp_path):
    missing = FashionMNISTSource(name="fashion_mnist", directory=tmp_path / "nowhere")
    with pytest.raises(SourceError, match="nowhere.*sudo apt-get install dataset-fashion-mnist"):
        fashion_mnist(missing, RNG)


def test_corrupt_idx_files_are_refused(tmp_path):
    fake_fashion(tmp_path)
    cfg = FashionMNISTSource(name="fashion_mnist", directory=tmp_path)
    labels = tmp_path / "t10k-labels-idx1-ubyte"
    write_idx(labels, np.zeros(10, np.uint8), magic=0x0803)
    with pytest.raises(SourceError, match="t10k-labels.*magic number 0x00000803, expected 0x0+801"):
        fashion_mnist(cfg, RNG)
    write_idx(labels, np.zeros(10, np.uint8))
    labels.write_bytes(labels.read_bytes()[:-3])
    with pytest.raises(SourceError, match=r"declares shape \[10\] but 7 bytes follow"):
        fashion_mnist(cfg, RNG)


INSTALLED = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not INSTALLED.is_dir(), reason="dataset-fashion-mnist is not installed")
def test_installed_fashion_mnist_has_70000_balanced_images():
    data = fashion_mnist(FashionMNISTSource(name="fashion_mnist"), RNG)
    assert data.features.shape == (70000, 1, 28, 28)
    assert np.bincount(data.labels).tolist() == [7000] * 10
    assert data.features.min() == 0 and data.features.max() == 1


# ----------------------------------------------------------------------------- mnist5k
def test_mnist5k_gives_balanced_images_and_passes_the_schema():
    cfg = DatasetConfig.model_validate({
        "source": {"name": "mnist5k"},
        "partition": {"kind": "dirichlet", "n_clients": 10, "alpha": 0.5, "min_samples": 20},
    })
    df, manifest = build_partition("mnist5k", cfg, seed=0)
    assert manifest["feature_shape"] == [1, 28, 28] and manifest["n_classes"] == 10
    assert np.sum([c["labels"] for c in manifest["clients"]], axis=0).tolist() == [500] * 10
    pixels = df.filter(regex=r"^f\d+$").to_numpy()
    assert pixels.shape == (5000, 784) and pixels.min() == 0 and pixels.max() == 1
    validate_partition(df, "classification", 10, 10)


# ----------------------------------------------------------------------------- your own file
def own_rows(n=240, clients=4, seed=0):
    import pandas as pd

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    return pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2],
                         "species": np.where(x[:, 0] + x[:, 1] > 0, "setosa", "virginica"),
                         "site": rng.integers(0, clients, n) * 10, "y": 2 * x[:, 2] + 1})


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_table_of_your_own_is_partitioned_by_its_client_column_or_the_configured_partitioner(tmp_path, suffix):
    rows = own_rows()
    path = tmp_path / f"own{suffix}"
    rows.to_csv(path, index=False) if suffix == ".csv" else rows.to_parquet(path)
    by_site = DatasetConfig.model_validate(
        {"source": {"name": "file", "path": str(path), "task": "classification", "label": "species",
                    "client": "site", "features": ["a", "b"]}})
    df, manifest = build_partition("own", by_site, seed=0)
    assert manifest["n_clients"] == 4 and manifest["n_classes"] == 2 and manifest["feature_shape"] == [2]
    sites = rows["site"].to_numpy()
    counts = [c["train"] + c["val"] + c["test"] for c in manifest["clients"]]
    assert counts == [int((sites == s).sum()) for s in sorted(set(sites))]  # each site a client, in order
    # the sites' own ids go with them: the manifest, the loaded partition, each run's per-client CSVs
    names = [str(s) for s in sorted(set(sites))]
    assert [c["name"] for c in manifest["clients"]] == names
    write_partition(df, manifest, tmp_path / "partition")
    data = load_partition(tmp_path / "partition")
    assert data.client_names == tuple(names)
    metrics = {"test": {"personalized": {"n": torch.ones(4), "acc": torch.full((4,), 0.5)}}}
    assert [row["client"] for row in per_client_rows(metrics, data.client_names)] == names
    first = df.sort_values("sample_id").iloc[0]
    assert first["label"] == int(rows["species"][0] == "virginica")  # classes numbered in sorted order
    assert np.allclose([first["f0"], first["f1"]], rows[["a", "b"]].iloc[0], atol=1e-6)

    numeric = tmp_path / f"numeric{suffix}"
    rows = rows.drop(columns="species")
    rows.to_csv(numeric, index=False) if suffix == ".csv" else rows.to_parquet(numeric)
    spread = DatasetConfig.model_validate(
        {"source": {"name": "file", "path": str(numeric), "task": "regression", "label": "y"},
         "partition": {"kind": "iid", "n_clients": 3}})
    df, manifest = build_partition("own", spread, seed=0)
    assert manifest["n_clients"] == 3 and manifest["task"] == "regression"
    assert "name" not in manifest["clients"][0]  # a partitioner's clients have no names of their own
    assert manifest["feature_shape"] == [4]  # every other column: a, b, c, site (the label excluded)


def test_prepare_says_that_your_own_features_are_not_scaled_and_their_range(tmp_path, capsys):
    import yaml

    from flows.prepare import prepare

    rows = own_rows()
    rows["a"] *= 1000
    rows.to_csv(tmp_path / "own.csv", index=False)
    params = {"seed": 0, "datasets": {"own": {"source": {
        "name": "file", "path": str(tmp_path / "own.csv"), "task": "classification", "label": "species",
        "client": "site", "features": ["a", "b"]}}}, "experiments": {}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    prepare("own", str(tmp_path / "params.yaml"), tmp_path / "partitions")
    line = capsys.readouterr().out.splitlines()[-1]
    a, b = rows["a"], rows["b"]
    assert line.startswith(f"own: features as they are in {tmp_path / 'own.csv'}, not scaled: values "
                           f"{min(a.min(), b.min()):.3g}..{max(a.max(), b.max()):.3g}, column std "
                           f"{b.std():.3g}..{a.std():.3g}"), line


def test_an_npz_of_your_own_keeps_its_feature_shape(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "own.npz"
    np.savez(path, x=rng.normal(size=(90, 1, 4, 4)), label=rng.integers(0, 3, 90), client=np.repeat([7, 8, 9], 30))
    cfg = source_cfg(name="file", path=str(path), task="classification", client="client")
    df, manifest = build_partition("own", cfg, seed=0)
    assert manifest["feature_shape"] == [1, 4, 4] and manifest["n_clients"] == 3 and manifest["n_classes"] == 3


def test_a_file_of_your_own_that_does_not_fit_is_one_line_naming_it(tmp_path):
    rows = own_rows()
    table = tmp_path / "own.csv"
    rows.to_csv(table, index=False)

    def fails(expected, **source):
        cfg = DatasetConfig.model_validate({"source": {"name": "file", "task": "classification", **source},
                                            "partition": {"kind": "iid", "n_clients": 2}})
        with pytest.raises(SourceError, match=expected):
            build_partition("own", cfg, seed=0)

    fails(r"nosuch.csv: no such file", path=str(tmp_path / "nosuch.csv"))
    fails(r"own.csv: no column\(s\) \['label'\]", path=str(table))
    # a second `label` header would reach the model as pandas' `label.1`, a feature holding the label
    (tmp_path / "twice.csv").write_text("a,label,b,label,b\n" + "".join(f"{i},{i % 2},1,{i % 2},2\n" for i in range(30)))
    fails(r"twice.csv: column\(s\) \['b', 'label'\] appear more than once in its header: rename them",
          path=str(tmp_path / "twice.csv"))
    fails(r"feature column\(s\) \['species'\] are not numeric", path=str(table), label="y")
    (tmp_path / "one.csv").write_text("a,label\n1,x\n2,x\n3,x\n")
    fails(r"one.csv: label 'label' has 1 class", path=str(tmp_path / "one.csv"))
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 and then not a zip")
    fails(r"bad.npz: not a readable .npz", path=str(tmp_path / "bad.npz"))
    np.savez(tmp_path / "arrays.npz", features=np.zeros((4, 2)), label=np.arange(4))
    fails(r"arrays.npz: .*no array\(s\) \['x'\]", path=str(tmp_path / "arrays.npz"))
    with pytest.raises(ValidationError, match="not one of"):
        source_cfg(name="file", path="own.xlsx", task="regression")
    (tmp_path / "gap.csv").write_text("a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(30)) + ",1\n")
    with pytest.raises(SourceError, match=r"gap.csv: column .a. is missing .* at line 32:"):
        build_partition("own", DatasetConfig.model_validate(
            {"source": {"name": "file", "path": str(tmp_path / "gap.csv"), "task": "classification"},
             "partition": {"kind": "iid", "n_clients": 2}}), seed=0)
    for source, partition in (({"client": "site"}, {"kind": "iid", "n_clients": 2}), ({}, {"kind": "natural"})):
        with pytest.raises(ValidationError, match="a client column is the partition"):
            DatasetConfig.model_validate({"source": {"name": "file", "path": str(table), "task": "regression",
                                                     **source}, "partition": partition})
