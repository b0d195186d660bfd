"""Hostile files, round four: the tuning file a stage reads, and your own data file. A stage
trains what it first read of every file that configures it, and a file that is not what it
claims is refused in one line naming the file, its own column and its lines."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

import flows.prefect_rounds
import flows.train
from conftest import mlflow_uri, ranked_result, tiny_params
from flows.prepare import build_partition
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import DatasetConfig, parse_params
from pfl_tasks.errors import ConfigError, DataValidationError, SourceError
from pfl_tasks.runs import RunPaths
from pfl_tasks.tuning import LOCAL_LR, checked_tuning, choose, tuned, tuning_path


# ----------------------------------------------------------------------------- the tuning file
def tuned_params(**options) -> dict:
    raw = tiny_params(algorithms=["fedavg", "fedprox"], **options)
    raw["algorithms"]["fedprox"] = {}  # a tuned key stays at its default
    raw["tuning"] = {"tiny": {"lr": [0.05, 0.2], "rounds_fraction": 0.5, "hyper": {"fedprox": {"mu": [0.01, 1.0]}}}}
    return raw


def write_tuning(root, raw: dict, fedavg_lr: float = 0.05) -> dict:
    """A tuning file choosing lr `fedavg_lr` for FedAvg, (0.2, mu 0.01) for FedProx."""
    params = validate_params(parse_params(raw))
    lr = "0.05" if fedavg_lr == 0.05 else "0.2"
    record = choose(params, "tiny", [ranked_result(f"fedavg_lr{lr}", 0.9, 0.9),
                                     ranked_result("fedprox_lr0.2_mu0.01", 0.9, 0.9)], seconds=1)
    path = tuning_path(root, "tiny")
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(record))
    return record


def test_a_tuning_file_edited_during_a_stage_trains_what_it_first_read_and_fails_the_stage(
        project, prefect_harness, monkeypatch, capsys):
    """Each flow run of an orchestrated stage reads the tuning file; an edit meanwhile changes
    no run's choice and fails the stage at its end in one line naming the file."""
    raw = tuned_params(seeds=[0, 1])
    raw["engine"]["orchestrator"] = "prefect"
    raw["tracking"] = {"mlflow_uri": mlflow_uri()}
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    write_tuning(project, raw, fedavg_lr=0.05)
    trained = flows.prefect_rounds.train_run

    def then_edited(*args, **kwargs):
        result = trained(*args, **kwargs)
        write_tuning(project, raw, fedavg_lr=0.2)
        return result

    monkeypatch.setattr(flows.prefect_rounds, "train_run", then_edited)
    assert flows.train.main(["tiny", "--params", str(project / "params.yaml"), "--root", str(project)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train")]
    assert err == [f"train failed: {tuning_path(project, 'tiny').resolve()} changed during the stage, which ran "
                   "on the version it read first: rerun it (dvc repro) for the new one"]
    for seed in (0, 1):
        ckpt = torch.load(RunPaths.of(project, "tiny", "fedavg", seed).checkpoint, weights_only=True)
        assert json.loads(ckpt["config"])["experiment"]["local"]["optimizer"]["lr"] == 0.05


@pytest.mark.parametrize("chosen, problem", [
    ({LOCAL_LR: 0.5}, "is {'local.optimizer.lr': 0.5}, not a point of its grid"),
    ({LOCAL_LR: "0.05"}, "is {'local.optimizer.lr': '0.05'}, not a point of its grid"),
    ({LOCAL_LR: 0.05, "momentum": 0.9}, "is {'local.optimizer.lr': 0.05, 'momentum': 0.9}, not a point"),
    ([0.05], "is [0.05], not a point of its grid"),
])
def test_a_tuning_choice_off_its_grid_is_refused_naming_the_tuning_file_and_key(tmp_path, chosen, problem):
    """An edited choice (another value, a string, an unknown key) is the tuning file's error,
    never trained, never reported as the tuning's, never blamed on params.yaml."""
    raw = tuned_params()
    record = write_tuning(tmp_path, raw)
    record["methods"]["fedavg"]["chosen"] = chosen
    tuning_path(tmp_path, "tiny").write_text(json.dumps(record))
    params = validate_params(parse_params(raw))
    for read in (tuned, checked_tuning):  # training, and the report's marks
        with pytest.raises(ConfigError) as info:
            read(params, "tiny", tmp_path)
        assert str(info.value).startswith(f"{tuning_path(tmp_path, 'tiny')}: methods.fedavg.chosen {problem}")
        assert "params.yaml" not in str(info.value) and "run_overrides" not in str(info.value)


def test_a_hand_edited_choice_that_is_another_grid_point_is_refused(tmp_path):
    """lr 0.2 is a grid point, but lr 0.05 scored better beyond noise: the file's own points
    choose 0.05, so a choice of 0.2 (shown beside 0.05's score) is an edit, refused in one line."""
    raw = tuned_params()
    params = validate_params(parse_params(raw))
    record = choose(params, "tiny", [ranked_result("fedavg_lr0.05", 0.9, 0.9), ranked_result("fedavg_lr0.2", 0.9, 0.8),
                                     ranked_result("fedprox_lr0.2_mu0.01", 0.9, 0.9)], seconds=1)
    assert record["methods"]["fedavg"]["chosen"] == {LOCAL_LR: 0.05}
    record["methods"]["fedavg"]["chosen"] = {LOCAL_LR: 0.2}
    tuning_path(tmp_path, "tiny").parent.mkdir()
    tuning_path(tmp_path, "tiny").write_text(json.dumps(record))
    for read in (tuned, checked_tuning):
        with pytest.raises(ConfigError, match=r"methods.fedavg.chosen is \{'local.optimizer.lr': 0.2\}, but its points "
                                              r"choose \{'local.optimizer.lr': 0.05\}: edited by hand"):
            read(params, "tiny", tmp_path)


def test_a_tuning_file_whose_method_entry_is_not_a_mapping_names_the_tuning_file(tmp_path):
    raw = tuned_params()
    record = write_tuning(tmp_path, raw)
    record["methods"]["fedprox"] = ["chosen"]
    tuning_path(tmp_path, "tiny").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=r"tuning/tiny.json: holds no choice for fedprox over its grid"):
        tuned(validate_params(parse_params(raw)), "tiny", tmp_path)


# ----------------------------------------------------------------------------- your own data file
def own_table(path, n=60, seed=0, **columns) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    table = pd.DataFrame({"height": rng.normal(size=n), "weight": rng.normal(size=n),
                          "species": rng.integers(0, 3, n), **columns})
    table.to_csv(path, index=False) if path.suffix == ".csv" else table.to_parquet(path)
    return table


def prepared(path, task="classification", label="species", **source):
    partition = {"kind": "natural"} if "client" in source else {"kind": "iid", "n_clients": 3}
    cfg = DatasetConfig.model_validate({"source": {"name": "file", "path": str(path), "task": task,
                                                   "label": label, **source}, "partition": partition})
    return build_partition("own", cfg, seed=0)


@pytest.mark.parametrize("suffix, where", [(".csv", "lines 6, 9"), (".parquet", "rows 4, 7")])
def test_a_nan_label_is_refused_naming_the_file_the_column_and_its_lines(tmp_path, suffix, where):
    """A NaN label would become a class of its own (4 classes of 3)."""
    labels = np.random.default_rng(1).integers(0, 3, 60).astype(float)
    labels[[4, 7]] = np.nan
    path = tmp_path / f"own{suffix}"
    own_table(path, species=labels)
    with pytest.raises(SourceError) as info:
        prepared(path)
    assert str(info.value) == (f"{path}: label 'species' is missing (empty, NA, n/a or NaN) at {where}: "
                               "fill, fix or drop those rows")


def test_an_n_a_cell_is_named_as_missing_in_the_files_own_column_and_line(tmp_path):
    path = tmp_path / "own.csv"
    own_table(path)
    lines = path.read_text().splitlines()
    lines[3] = "n/a," + lines[3].split(",", 1)[1]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SourceError, match=r"own.csv: column 'height' is missing \(empty, NA, n/a or NaN\) at line 4:"):
        prepared(path)
    table = own_table(path)
    table.loc[5, "weight"] = np.inf
    table.to_csv(path, index=False)
    with pytest.raises(SourceError, match=r"own.csv: column 'weight' has inf, not finite.* at line 7:"):
        prepared(path)


def test_an_npz_value_out_of_bounds_names_its_array_and_position(tmp_path):
    x = np.zeros((30, 2, 2))
    x[3, 1, 0] = 1e12
    np.savez(tmp_path / "own.npz", x=x, label=np.arange(30) % 2)
    with pytest.raises(SourceError, match=r"own.npz: array 'x' at \[1, 0\] has 1000000000000.0, not finite.* at row 3:"):
        prepared(tmp_path / "own.npz", label="label")


def test_continuous_labels_for_classification_are_refused_with_a_hint_to_regression(tmp_path):
    path = tmp_path / "own.csv"
    own_table(path, n=500, species=np.random.default_rng(2).normal(size=500))
    with pytest.raises(SourceError) as info:
        prepared(path)
    assert str(info.value) == (f"{path}: label 'species' has 500 distinct values in 500 rows, too many to be "
                               "classes: is the task regression? (source.task)")
    _, manifest = prepared(path, task="regression")
    assert manifest["task"] == "regression"


@pytest.mark.parametrize("name, content, problem", [
    ("nul.csv", None, "not CSV text (NUL bytes in its first 1,048,576 bytes)"),
    ("latin.csv", "h\xe9ight,species\n".encode("latin-1") + b"1,0\n" * 10, "not CSV text (bytes that are not UTF-8"),
    ("one-line.csv", b"1," * (1 << 20), "not CSV text (no line break in its first 1,048,576 bytes)"),
    ("table.parquet", b"height,species\n1,0\n", "not a parquet file (it does not begin with b'PAR1')"),
    ("arrays.npz", b"\0" * 64, "not a npz file (it does not begin with b'PK\\x03\\x04')"),
])
def test_a_file_that_is_not_what_its_extension_says_is_refused_before_it_is_parsed(tmp_path, name, content, problem):
    """A gigabyte of NUL bytes named .csv is refused from its first MiB (it took 8.7 GB to parse)."""
    path = tmp_path / name
    if content is None:
        with open(path, "wb") as fh:
            fh.truncate(1 << 30)  # a sparse gigabyte of NUL bytes
    else:
        path.write_bytes(content)
    with pytest.raises(SourceError) as info:
        prepared(path)
    assert str(info.value).startswith(f"{path}: {problem}")


def test_an_error_that_lists_clients_shows_a_few_and_a_count(tmp_path):
    """50,000 one-row clients: a line, not 118 KB."""
    n = 50_000
    pd.DataFrame({"a": np.random.default_rng(0).normal(size=n), "species": np.arange(n) % 2,
                  "site": np.arange(n)}).to_csv(tmp_path / "own.csv", index=False)
    with pytest.raises(DataValidationError) as info:
        prepared(tmp_path / "own.csv", client="site")
    message = str(info.value)
    assert re.fullmatch(r"[\d,]+ of 50,000 clients without a \w+ sample: (\d+, ){4}\d+ and [\d,]+ more \(.*\)", message)
    assert len(message) < 200
