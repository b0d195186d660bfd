"""Data layer: sources, partitioners, pandera schemas and the partition store."""

from pfl_tasks.data.schema import DataValidationError
from pfl_tasks.data.store import ClientSplit, FederatedData, build_partition, load_partition, write_partition

__all__ = [
    "ClientSplit",
    "DataValidationError",
    "FederatedData",
    "build_partition",
    "load_partition",
    "write_partition",
]
