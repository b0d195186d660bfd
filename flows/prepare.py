"""`prepare` stage: partition one dataset into data/partitions/<dataset>/seed-<seed>/, one
partition per seed that an experiment on it trains with.

Plain Python rather than a Prefect flow: it runs once per dataset and would otherwise pay
Prefect's ephemeral-server start for nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from flows.environment import local_defaults
from flows.precheck import pin_numerics_first


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dataset")
    parser.add_argument("--params", default="params.yaml")
    return parser


if __name__ == "__main__":  # --help and a command-line error answer before Prefect and MLflow load, which read their settings then
    local_defaults()
    first = arguments().parse_args()
    pin_numerics_first("prepare", first.params, datasets=[first.dataset])  # numpy's code paths too

from flows.stage import stage_main
from pfl_tasks.config import load_params, unknown
from pfl_tasks.data import PARTITIONS, build_partition, write_partition
from pfl_tasks.errors import ConfigError, OutputLockedError
from pfl_tasks.files import OutputLock


def prepare(dataset: str, params_path: str = "params.yaml", out_root: Path = PARTITIONS) -> Path:
    """The dataset's folder, holding exactly the partitions of its seeds."""
    params = load_params(params_path)
    if dataset not in params.datasets:
        raise ConfigError(f"{params_path}: {unknown('dataset', dataset, params.datasets)}")
    folder = Path(out_root) / dataset
    seeds = params.partition_seeds(dataset)
    for seed in seeds:
        table, manifest = build_partition(dataset, params.datasets[dataset], seed)
        out = folder / f"seed-{seed}"
        with dataset_lock(Path(out_root), dataset):
            # seeds no longer used, older layouts, temporaries of a killed prepare
            for stale in folder.glob("*") if folder.is_dir() else []:
                if stale.name not in {f"seed-{s}" for s in seeds}:
                    shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
            write_partition(table, manifest, out)
        counts = [c["train"] + c["val"] + c["test"] for c in manifest["clients"]]
        print(f"{dataset} seed {seed}: {len(table)} samples, {manifest['n_clients']} clients "
              f"(sizes {min(counts)}..{max(counts)}) -> {out}")
    source = params.datasets[dataset].source
    if source.name == "file":
        features = table.filter(regex=r"^f\d+$")
        print(f"{dataset}: features as they are in {source.path}, not scaled: values {features.min().min():.3g}.."
              f"{features.max().max():.3g}, column std {features.std().min():.3g}..{features.std().max():.3g} "
              "(the learning rates suit unit scale: scale them in the file if these are far from it)")
    return folder


@contextlib.contextmanager
def dataset_lock(out_root: Path, dataset: str) -> Iterator[None]:
    """The dataset's folder to this process alone, once a concurrent prepare of it is done."""
    lock = OutputLock(out_root / ".locks" / f"{dataset}.lock", f"the partitions of {dataset}")
    waiting = False
    while True:
        try:
            lock.__enter__()
            break
        except OutputLockedError as err:
            if not waiting:
                print(f"waiting: {err}", flush=True)
            waiting = True
            time.sleep(0.2)
    try:
        yield
    finally:
        lock.__exit__()


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    return stage_main("prepare", lambda: prepare(args.dataset, args.params))


if __name__ == "__main__":
    sys.exit(main())
