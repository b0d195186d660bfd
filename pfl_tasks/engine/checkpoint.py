"""Checkpoints: written atomically (temp file + rename), loaded with `weights_only=True`,
and refused when they belong to another run or another configuration.

Randomness is counter-based (seed, round, client, stream), so the RNG state of a run is fully
given by its seed and round index; both are stored.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pfl_tasks.errors import CheckpointError
from pfl_tasks.files import atomic_write

FORMAT = "pfl-checkpoint/1"


def save_checkpoint(path: Path, payload: dict) -> None:
    atomic_write(path, lambda fh: torch.save({"format": FORMAT, **payload}, fh), binary=True, fsync=True)


def load_checkpoint(path: Path, expect: dict[str, str]) -> dict:
    """Load `path`; every key in `expect` (run identity, config hash) must match exactly."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt, truncated or not a torch file at all
        first = (str(err).strip().splitlines() or [""])[0]  # torch's own explanation runs to many lines
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(err).__name__}: {first})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} file (foreign checkpoint?)")
    for key, value in expect.items():
        if payload.get(key) != value:
            raise CheckpointError(
                f"{path}: written for {key}={payload.get(key)!r}, this run has {key}={value!r}"
            )
    return payload
