"""A run's random streams. Every draw of a run is counter-based: it depends on the run's seed,
the stream and, where it has them, the round and the client, never on the chunking, the
executor or the resume point. A stream is a `StreamKey`: the engine declares its own here, and
an algorithm declares its own in its module (listed in its `streams`), so the engine names no
algorithm. Each key's number is the one its draws used before the streams had names, so that
naming them changed no draw; two streams of one algorithm's round never share a number. All
of a run's seeding is here: the minibatch orders hash (seed, round, stream, client) with
SplitMix64 for every client at once (`client_keys`), the other draws derive from SeedSequence;
unifying the two would move every draw of the methods with draws of their own, so each keeps
its own."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StreamKey:
    name: str
    number: int  # a family of streams (index i) draws from number + i


# minibatch orders of a round's local work (`LocalTrainer.fit`, `scan`): every algorithm's first fit
LOCAL = StreamKey("local", 0)
# local work at evaluation time (fine-tuning stage s: this number + s)
EVALUATION = StreamKey("evaluation", 0xE7A1)
# the federation's draws of a round: which clients are sampled, and which of them drop out
SAMPLE = StreamKey("federation/sample", 0x5A3)
DROPOUT = StreamKey("federation/dropout", 0xD209)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a counter-based hash of uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def client_keys(seed: int, round_idx: int, number: int, client_ids: np.ndarray) -> np.ndarray:
    """Each client's uint64 key of stream `number` in a round, by SplitMix64: the minibatch
    orders' keys, hashed for all clients at once (a SeedSequence per client costs a host call
    each). The other draws below derive from SeedSequence; each derivation keeps the numbers it
    has always drawn."""
    with np.errstate(over="ignore"):
        key = np.uint64(seed)
        for part in (round_idx, number):
            key = _mix(np.asarray(key ^ np.uint64(part)) + np.uint64(0x9E3779B97F4A7C15))
        return _mix((client_ids.astype(np.uint64) ^ key) + np.uint64(0x9E3779B97F4A7C15))


def row_hashes(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """hash(key_k, counter) for every client key [K] and counter (uint64, any shape): [K, ...]."""
    with np.errstate(over="ignore"):
        return _mix(keys.reshape(-1, *([1] * counters.ndim)) ^ _mix(counters + np.uint64(1)))


def run_seed(seed: int, key: StreamKey) -> int:
    """A seed of the run's stream `key`, the same every round (a server-side initialization)."""
    return _seed([seed, key.number])


def round_generator(seed: int, round_idx: int, key: StreamKey) -> np.random.Generator:
    """The draws of stream `key` in round `round_idx`, shared by every client."""
    return np.random.default_rng([seed, round_idx, key.number])


def _seed(entropy: list[int]) -> int:
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


@dataclass(frozen=True, eq=False)
class Stream:
    """One stream of a chunk's round (`LocalTrainer.rng`): what `fit` and `scan` draw their
    minibatches from, and an algorithm's own draws."""

    name: str
    number: int  # the key's, plus an index for a family of streams
    seed: int
    round_idx: int
    client_ids: torch.Tensor  # the chunk's, on the host

    def client_generators(self) -> list[torch.Generator]:
        """A torch generator per client of the chunk (e.g. noise drawn per client)."""
        return [torch.Generator().manual_seed(_seed([self.seed, self.round_idx, int(c), self.number]))
                for c in self.client_ids]

    def uniform(self) -> float:
        """One uniform number in [0, 1) of this round, the same for every client (e.g. a coin
        that decides whether the round communicates)."""
        return float(np.random.default_rng([self.seed, self.round_idx, self.number]).random())

    def run_seed(self) -> int:
        """A seed of the run alone, the same every round (e.g. a projection every party shares)."""
        return _seed([self.seed, self.number])
