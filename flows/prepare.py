"""`prepare` stage: partition one dataset into data/partitions/<dataset>/seed-<seed>/, one
partition per seed that an experiment on it trains with.

Plain Python rather than a Prefect flow: it runs once per dataset and would otherwise pay
Prefect's ephemeral-server start for nothing.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import flows  # noqa: F401  (environment defaults)
from flows.stage import stage_main
from pfl_tasks.config import ConfigError, load_params
from pfl_tasks.data import PARTITIONS, build_partition, write_partition
from pfl_tasks.files import remove_stale_temporaries


def prepare(dataset: str, params_path: str = "params.yaml", out_root: Path = PARTITIONS) -> Path:
    """The dataset's folder, holding exactly the partitions of its seeds."""
    params = load_params(params_path)
    if dataset not in params.datasets:
        raise ConfigError(f"unknown dataset '{dataset}'; params.yaml has {sorted(params.datasets)}")
    folder = Path(out_root) / dataset
    seeds = params.partition_seeds(dataset)
    for stale in folder.glob("*") if folder.is_dir() else []:  # seeds no longer used, older layouts
        if stale.name not in {f"seed-{s}" for s in seeds} and not stale.name.startswith("."):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    for seed in seeds:
        table, manifest = build_partition(dataset, params.datasets[dataset], seed)
        out = folder / f"seed-{seed}"
        remove_stale_temporaries(out)  # of a killed earlier prepare
        write_partition(table, manifest, out)
        counts = [c["train"] + c["val"] + c["test"] for c in manifest["clients"]]
        print(f"{dataset} seed {seed}: {len(table)} samples, {manifest['n_clients']} clients "
              f"(sizes {min(counts)}..{max(counts)}) -> {out}")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dataset")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    return stage_main("prepare", lambda: prepare(args.dataset, args.params))


if __name__ == "__main__":
    sys.exit(main())
