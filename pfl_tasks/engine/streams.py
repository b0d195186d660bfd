"""A run's named random streams. Every draw of a run is counter-based: it depends on the run's
seed, the stream and, where it has them, the round and the client, never on the chunking, the
executor or the resume point. Each name stands for the number its draws used before the
streams had names, so that naming them changed no draw; two streams of one algorithm's round
never share a number."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

STREAMS = {
    # minibatch orders of a round's local work (`LocalTrainer.fit`, `scan`)
    "local": 0,  # every algorithm's first fit of a round
    "ditto/personal": 1,  # Ditto's personal model, after the global one
    "fedrep/head": 1,  # FedRep's head epochs, before the body's
    "lp_proj/local": 0,  # lp_proj's local round r: this number + r
    "evaluation": 0xE7A1,  # local work at evaluation time (fine-tuning stage s: this number + s)
    # the federation's draws of a round
    "federation/sample": 0x5A3,  # which clients are sampled
    "federation/dropout": 0xD209,  # which sampled clients drop out
    # an algorithm's own draws
    "fedcr/noise": 7,  # per client and round: the representation's reparameterization noise
    "fedcr/encoder": 0xFEDC,  # per run: the encoder's initialization
    "l2sgd/communicate": 0x125,  # per round: whether the round averages
    "lp_proj/projection": 0x9A0,  # per run: the projection every party shares
}


def run_seed(seed: int, name: str) -> int:
    """A seed of the run's stream `name`, the same every round (a server-side initialization)."""
    return _seed([seed, STREAMS[name]])


def round_generator(seed: int, round_idx: int, name: str) -> np.random.Generator:
    """The draws of stream `name` in round `round_idx`, shared by every client."""
    return np.random.default_rng([seed, round_idx, STREAMS[name]])


def _seed(entropy: list[int]) -> int:
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


@dataclass(frozen=True, eq=False)
class Stream:
    """One named stream of a chunk's round (`LocalTrainer.rng`): what `fit` and `scan` draw
    their minibatches from, and an algorithm's own draws."""

    name: str
    number: int  # STREAMS[name], plus an index for a family of streams
    seed: int
    round_idx: int
    client_ids: torch.Tensor  # the chunk's, on the host

    def client_generators(self) -> list[torch.Generator]:
        """A torch generator per client of the chunk (e.g. FedCR's noise)."""
        return [torch.Generator().manual_seed(_seed([self.seed, self.round_idx, int(c), self.number]))
                for c in self.client_ids]

    def uniform(self) -> float:
        """One uniform number in [0, 1) of this round, the same for every client (e.g. L2SGD's coin)."""
        return float(np.random.default_rng([self.seed, self.round_idx, self.number]).random())

    def run_seed(self) -> int:
        """A seed of the run alone, the same every round (e.g. lp_proj's shared projection)."""
        return _seed([self.seed, self.number])
