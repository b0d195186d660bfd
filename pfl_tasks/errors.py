"""Every error the project raises on purpose, in one leaf module that imports nothing of the
project: a stage reports each as one line naming what is wrong (`flows.stage`), without
importing the layers that raise them."""

from __future__ import annotations

import signal


class ConfigError(ValueError):
    """A configuration problem; the message names the offending dotted key."""


class SourceError(ValueError):
    """A source's files are missing or malformed; the message names the file and the fix."""


class PartitionError(ValueError):
    """A partition cannot be built from its source as configured."""


class DataValidationError(ValueError):
    """A partition table breaks the schema; the message names the column or client."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, foreign, corrupt, or of another configuration."""


class OutputLockedError(RuntimeError):
    """Another live process writes the same outputs."""


class OutputPathError(RuntimeError):
    """An output's folder cannot be made: a file or a dangling link in its way, or no write access."""


class TrackingError(RuntimeError):
    """The MLflow store is unreachable, unwritable, or stayed unavailable past the retry bound."""


class ComparisonError(ValueError):
    """The tracked runs cannot make the comparison asked for (missing experiment or runs)."""


def listing(items, shown: int = 5) -> str:
    """The first `shown` of `items` and how many more, so that an error line stays a line."""
    items = list(items)
    head = ", ".join(str(item) for item in items[:shown])
    return f"{head} and {len(items) - shown:,} more" if len(items) > shown else head


class RunStopped(BaseException):
    """SIGTERM, SIGHUP or SIGINT asked the run to stop (a BaseException, as KeyboardInterrupt: no
    `except Exception` on the way may swallow it)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")
