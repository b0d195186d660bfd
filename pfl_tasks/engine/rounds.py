"""How a run's round steps are called: the `Steps` protocol, and its plain-call implementation.

`flows.train` adapts the same protocol to Prefect (each step a task run, or a task run per
round or per span of rounds) and to Ray; every implementation computes the same numbers, as
they all call the `Federation`'s steps in the same order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import torch

from pfl_tasks.engine.checkpoint import save_checkpoint
from pfl_tasks.engine.federation import ChunkResult, Evaluation, Federation, RunState
from pfl_tasks.engine.state import Tree, gather


def run_round(steps: Steps, fed: Federation, state: RunState, round_idx: int) -> RunState:
    """Sample, local updates per chunk, aggregate: each through `steps`."""
    ids = steps.sample(fed, round_idx)
    if len(ids) == 0:  # every sampled client dropped out: nothing to aggregate
        return RunState(state.round + 1, state.server, state.clients)
    payload = fed.algorithm.payload(state.server)
    results = steps.local_updates(fed, round_idx, payload, fed.chunks(ids), state.clients)
    return steps.aggregate(fed, round_idx, state, results)


def play_rounds(play: Callable[[int], str | None], first: int, stop: int) -> str | None:
    """`play(round_idx)` for rounds `first` to `stop - 1`, stopping at the first that reports
    a problem (a diverged run), which it returns."""
    for round_idx in range(first, stop):
        problem = play(round_idx)
        if problem is not None:
            return problem
    return None


class Steps(ABC):
    """The steps of a run, as the training loop (`pfl_tasks.training.train_run`) calls them.
    A round is `round` (by default `run_round` over the three round steps); the loop plays its
    rounds in spans between checkpoints (one round each, or, when `spans_rounds`, up to the next
    evaluation or checkpoint) through `span`."""

    spans_rounds: ClassVar[bool] = False

    @abstractmethod
    def sample(self, fed: Federation, round_idx: int) -> torch.Tensor:
        """The clients that report in round `round_idx` (counted from 0)."""

    @abstractmethod
    def local_updates(self, fed: Federation, round_idx: int, payload: Tree, chunks: list[torch.Tensor],
                      clients: Tree) -> list[ChunkResult]:
        """Each chunk's local update, from the server's payload and its rows of the client state."""

    @abstractmethod
    def aggregate(self, fed: Federation, round_idx: int, state: RunState, results: list[ChunkResult]) -> RunState:
        """The algorithm's server rule over the chunks' results."""

    @abstractmethod
    def evaluate(self, fed: Federation, done: int, state: RunState) -> Evaluation:
        """Every client's metrics after round `done` (counted from 1)."""

    @abstractmethod
    def checkpoint(self, path: Path, done: int, payload: dict) -> None:
        """The run's checkpoint after round `done`."""

    def round(self, fed: Federation, state: RunState, round_idx: int) -> RunState:
        return run_round(self, fed, state, round_idx)

    def span(self, play: Callable[[int], str | None], first: int, stop: int) -> str | None:
        return play_rounds(play, first, stop)


class InlineSteps(Steps):
    """The steps as plain calls (chunks on a thread pool): no orchestration cost."""

    def __init__(self, max_workers: int):
        self.max_workers = max_workers

    def sample(self, fed, round_idx):
        return fed.sample_clients(round_idx)

    def local_updates(self, fed, round_idx, payload, chunks, clients):
        def one(ids):
            return fed.local_update(round_idx, payload, ids, gather(clients, ids))

        if len(chunks) == 1:
            return [one(chunks[0])]
        with ThreadPoolExecutor(self.max_workers) as pool:
            return list(pool.map(one, chunks))

    def aggregate(self, fed, round_idx, state, results):
        return fed.aggregate(state, results)

    def evaluate(self, fed, done, state):
        return fed.evaluate(state)

    def checkpoint(self, path, done, payload):
        save_checkpoint(path, payload)
