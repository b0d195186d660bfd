"""The one place that reaches into Prefect's private client workers (the queues that send logs
and events to the API), for `flows.stage`'s drain at a stage's end. Prefect has no public list
of them, nor a way to drop what one holds; `tests/test_prefect_workers.py` runs this module
against a real worker, so an upgrade that moves these internals fails a test instead of
silently keeping records."""

from __future__ import annotations

import contextlib
import logging
import queue


def _base():
    from prefect._internal.concurrency.services import _QueueServiceBase  # every worker's base

    return _QueueServiceBase


def quiet_waits() -> None:
    """Silence the workers' "Still processing items: N items remaining" warnings, which each kind
    logs on a logger named after its class."""
    kinds = [_base()]
    for kind in kinds:
        logging.getLogger(kind.__name__).setLevel(logging.ERROR)
        kinds += kind.__subclasses__()


def workers() -> list:
    """Every client worker of this process."""
    base = _base()
    with base._instance_cache_lock:
        return list(base._instances.values())


def drain_all(timeout: float) -> None:
    """Let every worker send what it holds, for at most `timeout` seconds."""
    _base().drain_all(timeout=timeout)


def busy(worker) -> bool:
    """Whether `worker` has not ended (it still holds records, or is sending one)."""
    return worker._done_event is not None and not worker._done_event.is_set()


def drop(worker) -> int:
    """Drop the records `worker` holds queued, and its drain at interpreter exit (it ends); how
    many it held."""
    dropped = 0
    with contextlib.suppress(queue.Empty):
        while True:
            dropped += worker._queue.get_nowait() is not None
    worker._queue.put_nowait(None)  # its end
    with contextlib.suppress(RuntimeError):  # its loop already closed: it has ended
        worker._loop.call_soon_threadsafe(worker._done_event.set)
    return dropped
