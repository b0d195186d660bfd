import numpy as np
import pytest

from pfl_tasks.data.partition import dirichlet, iid, shards, split_train_test
from pfl_tasks.errors import PartitionError


def labels(n=2000, classes=10, seed=0):
    return np.random.default_rng(seed).integers(0, classes, n)


def label_skew(y, client):
    """Mean total-variation distance between each client's label mix and the global one."""
    glob = np.bincount(y, minlength=10) / len(y)
    dists = []
    for k in np.unique(client):
        h = np.bincount(y[client == k], minlength=10)
        dists.append(0.5 * np.abs(h / h.sum() - glob).sum())
    return float(np.mean(dists))


@pytest.mark.parametrize("make", [
    lambda y, rng: iid(len(y), 17, rng),
    lambda y, rng: dirichlet(y, 17, 0.3, 10, rng),
    lambda y, rng: shards(y, 17, 3, rng),
])
def test_every_sample_assigned_exactly_once(make):
    y = labels()
    client = make(y, np.random.default_rng(1))
    assert client.shape == y.shape  # one client per sample, so never two
    assert set(np.unique(client)) == set(range(17))


def test_dirichlet_tiny_alpha_many_clients_terminates_with_minimum():
    y = labels(3000)
    client = dirichlet(y, 100, 0.05, 12, np.random.default_rng(0))
    assert np.bincount(client, minlength=100).min() >= 12


def test_dirichlet_impossible_minimum_is_an_error():
    with pytest.raises(PartitionError, match="cannot give"):
        dirichlet(labels(100), 20, 0.5, 10, np.random.default_rng(0))


def test_smaller_alpha_gives_more_label_skew():
    y = labels(5000)
    skews = [label_skew(y, dirichlet(y, 20, a, 10, np.random.default_rng(0))) for a in (100.0, 1.0, 0.05)]
    assert skews[0] < skews[1] < skews[2]
    assert skews[0] < 0.1 and skews[2] > 0.6


def test_shards_give_exactly_k_classes_per_client():
    y = labels()
    for k in (1, 2, 5):
        client = shards(y, 13, k, np.random.default_rng(0))
        assert all(len(np.unique(y[client == c])) == k for c in range(13))


def test_split_gives_each_client_train_and_test_stratified():
    y = labels(1000)
    client = dirichlet(y, 10, 0.5, 10, np.random.default_rng(0))
    is_test = split_train_test(client, y, 0.25, True, np.random.default_rng(0))
    for k in range(10):
        mine = client == k
        assert is_test[mine].any() and (~is_test[mine]).any()
    assert abs(is_test.mean() - 0.25) < 0.05


def test_each_client_gets_train_validation_and_test_at_the_configured_fractions():
    from pfl_tasks.config import DatasetConfig
    from pfl_tasks.data import build_partition

    cfg = DatasetConfig.model_validate({"source": {"name": "digits"}, "val_fraction": 0.2,
                                        "partition": {"kind": "dirichlet", "n_clients": 8, "alpha": 1.0}})
    df, manifest = build_partition("digits", cfg, seed=0)
    share = df["split"].value_counts(normalize=True)
    assert abs(share["test"] - 0.2) < 0.02 and abs(share["val"] - 0.2) < 0.02
    assert all(c["train"] and c["val"] and c["test"] for c in manifest["clients"])
    other, _ = build_partition("digits", cfg, seed=1)  # each seed draws its own partition
    by_sample = [d.sort_values("sample_id")["client_id"].to_numpy() for d in (df, other)]
    assert (by_sample[0] != by_sample[1]).mean() > 0.5


def test_validation_and_test_fractions_must_leave_training_data():
    from pfl_tasks.config import DatasetConfig, _validate
    from pfl_tasks.errors import ConfigError

    with pytest.raises(ConfigError, match="test_fraction \\+ val_fraction = 1 leaves no training data"):
        _validate(DatasetConfig, {"source": {"name": "digits"}, "test_fraction": 0.5, "val_fraction": 0.5})
