"""`flows.prefect_workers` against a real Prefect client worker: the private internals the
stage's drain relies on are still there, so an upgrade that moves them fails here."""

import asyncio
import threading
import time

from prefect._internal.concurrency.services import QueueService

from flows import prefect_workers


class Held(QueueService[int]):
    """A client worker whose records wait until the test lets them through."""

    release = threading.Event()
    handled: list[int] = []

    async def _handle(self, item: int) -> None:
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        self.handled.append(item)


def test_a_real_workers_records_are_found_drained_or_dropped():
    worker = Held.instance()
    for item in range(5):
        worker.send(item)
    assert worker in prefect_workers.workers() and prefect_workers.busy(worker)
    prefect_workers.quiet_waits()
    prefect_workers.drain_all(timeout=0.2)  # the first record is held: the drain gives up
    assert prefect_workers.busy(worker)
    dropped = prefect_workers.drop(worker)
    Held.release.set()
    prefect_workers.drain_all(timeout=5)  # the worker ends
    assert dropped == 4 and Held.handled in ([], [0])  # the 4 queued behind the one under way, never sent
    deadline = time.monotonic() + 5
    while prefect_workers.busy(worker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not prefect_workers.busy(worker)
