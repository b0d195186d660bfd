"""Data layer: sources, partitioners, pandera schemas and the partition store."""

from pfl_tasks.data.store import (
    PARTITIONS, ClientSplit, FederatedData, build_partition, load_partition, partition_dir, write_partition,
)

__all__ = [
    "ClientSplit",
    "FederatedData",
    "PARTITIONS",
    "build_partition",
    "load_partition",
    "partition_dir",
    "write_partition",
]
