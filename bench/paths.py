"""Where measurements are written: bench/results/, one file stem per measurement and day. Light
to import (no torch), for the drivers that only start subprocesses."""

from __future__ import annotations

import datetime
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def result_stem(name: str) -> Path:
    """bench/results/<today>-<name>: a measurement's files, less their suffix (the one place
    that names a results path)."""
    RESULTS.mkdir(exist_ok=True)
    return RESULTS / f"{datetime.date.today().isoformat()}-{name}"
