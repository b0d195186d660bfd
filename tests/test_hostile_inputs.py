"""Hostile params files and racing or killed `prepare`s (issue 28, items 5, 6 and 8): a bad
params file is one ConfigError line naming the file and key before anything is created; a
partition is swapped whole, so a kill leaves the old or the new one, and concurrent prepares of
one dataset take turns."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

import pfl_tasks.files as files
from conftest import tiny_params
from flows.prepare import prepare
from pfl_tasks.config import load_params
from pfl_tasks.data import load_partition
from pfl_tasks.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def with_changes(change) -> dict:
    data = tiny_params()
    change(data)
    return data


def long_name(data: dict) -> None:
    data["experiments"]["x" * 300] = data["experiments"].pop("tiny")


# name -> (the params file's bytes, or a change of the tiny params; how the error begins after the file)
BAD_PARAMS = {
    "binary garbage": (bytes(range(256)) * 8, "position 128: not utf-8 text (invalid start byte)"),
    "nested 900 levels": (b"seed: " + b"[" * 900 + b"]" * 900, "line 1: nested deeper than 32 levels"),
    "algorithm a list": (lambda d: d["algorithms"].update(fedavg={"algorithm": ["fedavg"]}),
                         "algorithms.fedavg: 'algorithm' must name a registered algorithm, not ['fedavg']"),
    "seed past 64 bits": (lambda d: d.update(seed=99999999999999999999),
                          "seed: Input should be less than or equal to 4294967295"),
    "300-character name": (long_name, f"experiments.{'x' * 300}.[key]: String should have at most 100 characters"),
    "numbers and names as keys": (lambda d: d.update({1: "x", "colour": "y"}),
                                  "(top level): unknown key(s) [1, 'colour']"),
    "a list as key": (b"? [seed]\n: 0\n", "line 1, column 3: found unhashable key"),
    "YAML syntax": (b"seed: [0\n", "line 2, column 1: expected ',' or ']', but got '<stream end>'"),
}


def write_bad(root: Path, case: str) -> Path:
    content = BAD_PARAMS[case][0]
    path = root / "params.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(yaml.safe_dump(with_changes(content)))
    return path


@pytest.mark.parametrize("case", BAD_PARAMS)
def test_bad_params_file_is_one_line_naming_file_and_key_and_creates_nothing(tmp_path, case):
    path = write_bad(tmp_path, case)
    with pytest.raises(ConfigError) as info:
        prepare("digits", str(path), tmp_path / "data" / "partitions")
    message = str(info.value)
    assert message.startswith(f"{path}: {BAD_PARAMS[case][1]}") and "\n" not in message
    assert list(tmp_path.iterdir()) == [path]  # no partition, no lock


@pytest.mark.parametrize("case", ["seed past 64 bits", "algorithm a list"])
def test_train_cli_on_bad_params_prints_one_line_and_creates_nothing(tmp_path, case):
    write_bad(tmp_path, case)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "DVC_ROOT")}
    proc = subprocess.run([sys.executable, "-m", "flows.train", "tiny", "--params", "params.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO)}, timeout=120)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr.splitlines() == [f"train failed: params.yaml: {BAD_PARAMS[case][1]}"]
    assert [p.name for p in tmp_path.iterdir()] == ["params.yaml"]  # no mlflow.db, no lock, no output


def test_params_file_over_a_mebibyte_is_refused_unread(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("# a comment\n" * (2_000_004 // 12))
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_params(path)
    assert time.monotonic() - started < 0.5
    assert str(info.value) == f"{path}: 2,000,004 bytes, over the 1,048,576 bytes a params file may take"


# ----------------------------------------------------------------------------- prepare
OLD, NEW = "dirichlet(alpha=0.5, min_samples=20, n_clients=6)", "iid(n_clients=6)"


def params_file(root: Path, name: str, partition: dict | None = None) -> str:
    data = tiny_params()
    if partition:
        data["datasets"]["digits"]["partition"] = partition
    (root / name).write_text(yaml.safe_dump(data))
    return str(root / name)


@pytest.fixture
def two_partitionings(tmp_path):
    """Params files of the old partition (prepared) and of a new one, and the partitions' root."""
    old = params_file(tmp_path, "old.yaml")
    new = params_file(tmp_path, "new.yaml", {"kind": "iid", "n_clients": 6})
    prepare("digits", old, tmp_path / "partitions")
    return new, tmp_path / "partitions"


class Killed(BaseException):
    """The process died here: nothing after it runs (no `finally` cleans up)."""


@pytest.mark.parametrize("killed_at", [0, 1, 2])
def test_a_kill_at_any_step_of_the_swap_leaves_a_whole_partition(two_partitionings, monkeypatch, killed_at):
    """Killed before the `killed_at`-th step that moves or deletes a folder (the swap takes two:
    the exchange, then deleting the old folder; deleting, then renaming took three)."""
    new, root = two_partitionings
    steps = []

    def dies_at_step(call):
        def step(*args, **kwargs):
            steps.append(call.__name__)
            if len(steps) > killed_at:
                raise Killed
            return call(*args, **kwargs)
        return step

    with monkeypatch.context() as patch:  # every step that moves or deletes a folder
        for owner, name in ((shutil, "rmtree"), (os, "rename"), (os, "replace"), (files, "_exchange")):
            if hasattr(owner, name):
                patch.setattr(owner, name, dies_at_step(getattr(owner, name)))
        with contextlib.suppress(Killed):
            prepare("digits", new, root)
    assert load_partition(root / "digits" / "seed-0").partition in (OLD, NEW)
    prepare("digits", new, root)  # the rerun sweeps what the kill stranded
    assert load_partition(root / "digits" / "seed-0").partition == NEW
    assert [p.name for p in (root / "digits").iterdir()] == ["seed-0"]


def test_a_filesystem_without_exchange_still_swaps_whole(two_partitionings, monkeypatch):
    new, root = two_partitionings

    def cannot(a, b):
        raise OSError(22, "Invalid argument")  # EINVAL, as on NFS

    monkeypatch.setattr(files, "_exchange", cannot, raising=False)
    prepare("digits", new, root)
    assert load_partition(root / "digits" / "seed-0").partition == NEW
    assert [p.name for p in (root / "digits").iterdir()] == ["seed-0"]


def test_concurrent_prepares_of_one_dataset_both_succeed(two_partitionings, monkeypatch):
    """The first prepare pauses inside its write (up to 1 s, or until the second is done): the
    second must wait for it rather than sweep its temp folder away."""
    new, root = two_partitionings
    first_writing, second_done = threading.Event(), threading.Event()
    to_parquet = pd.DataFrame.to_parquet

    def paused_once(self, *args, **kwargs):
        if not first_writing.is_set():
            first_writing.set()
            second_done.wait(timeout=1)
        return to_parquet(self, *args, **kwargs)

    monkeypatch.setattr(pd.DataFrame, "to_parquet", paused_once)
    errors = []

    def run(done: threading.Event | None = None):
        try:
            prepare("digits", new, root)
        except Exception as err:  # noqa: BLE001  (reported by the assertion below)
            errors.append(err)
        finally:
            if done is not None:
                done.set()

    first = threading.Thread(target=run)
    first.start()
    assert first_writing.wait(timeout=30)
    second = threading.Thread(target=run, args=(second_done,))
    second.start()
    for thread in (first, second):
        thread.join(timeout=60)
    assert errors == []
    assert load_partition(root / "digits" / "seed-0").partition == NEW
    assert [p.name for p in (root / "digits").iterdir()] == ["seed-0"]
