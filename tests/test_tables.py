"""Comparison tables: aggregation over clients and seeds, and the errors for missing runs."""

import json

import pytest

from flows.tables import build_table, markdown
from pfl_tasks.config import ConfigError, TableConfig


def write_metrics(root, path, mean, std):
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(json.dumps({"final/personalized/mse_mean": mean, "final/personalized/mse_std": std}))


def test_cells_average_over_seeds_and_report_both_spreads(tmp_path):
    write_metrics(tmp_path, "metrics/e1/local/seed-0.json", 1.0, 0.5)
    write_metrics(tmp_path, "metrics/e1/local/seed-1.json", 3.0, 0.7)
    write_metrics(tmp_path, "metrics/learn2pfed/e1/learn2pfed-train/seed-0.json", 0.5, 0.1)
    write_metrics(tmp_path, "metrics/e2/local/seed-0.json", 2.0, 0.2)
    rows = build_table(tmp_path, TableConfig(experiments=["e1", "e2"]))
    local = rows["local"]["e1"]
    assert (local["mean"], local["std_clients"], local["seeds"]) == (2.0, 0.6, 2)
    assert local["std_seeds"] == pytest.approx(2**0.5)  # sample std of 1 and 3
    assert rows["learn2pfed-train"] == {"e1": {"metric": "mse", "mean": 0.5, "std_clients": 0.1,
                                               "std_seeds": 0.0, "seeds": 1}}
    text = markdown("t", rows, ["e1", "e2"])
    assert "MSE (lower is better)" in text
    assert "| learn2pfed-train | 0.5 ± 0.1 [± 0, 1 seeds] | – |" in text


def test_an_experiment_without_metrics_or_an_unknown_method_is_named(tmp_path):
    write_metrics(tmp_path, "metrics/e1/local/seed-0.json", 1.0, 0.5)
    with pytest.raises(ConfigError, match=r"\['e2'\]"):
        build_table(tmp_path, TableConfig(experiments=["e1", "e2"]))
    with pytest.raises(ConfigError, match=r"\['lcoal'\]"):
        build_table(tmp_path, TableConfig(experiments=["e1"], methods=["lcoal"]))
