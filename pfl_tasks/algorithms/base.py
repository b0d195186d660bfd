"""The small surface every algorithm presents (in the spirit of Flower's `Strategy`).

Once, `init_server(params, facts)` with the federation's `Facts`; per round the engine calls,
in order:
  payload(server)                       -> what the server broadcasts to sampled clients
  download(payload, ids)                -> (shared, per-client rows) that each chunk receives
  client_update(trainer, payload, state) -> (message up the wire [K, ...], new client state [K, ...])
  aggregate(server, messages, weights, ids)
                                        -> new server state (the algorithm's own rule), from
                                           the messages of clients `ids`
and for evaluation of every client:
  personalized(server, state)           -> the model each client uses
  personalize(trainer, server, state, val_loss)
                                        -> what is evaluated (default: `personalized`; methods
                                           that adapt at evaluation time use the chunk's trainer,
                                           and select on `val_loss`)
  forward(net, params, x)               -> the evaluation forward pass of that personalized view
  global_model(server, clients)         -> the shared model, or None if there is none
  forward_global(net, params, x)        -> its evaluation forward pass
  round_metrics(server)                 -> diagnostics logged with each evaluation
Server state is a tree of tensors; client state is a tree of stacks with one row per client.
A client that is not sampled, or drops out (`federation.dropout`), takes no part in the round:
its rows of the client state (personal model, control variates, cluster, ...) stay as they were,
and `aggregate` sees only the messages of the clients that reported.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch.func import functional_call

from pfl_tasks.engine.executor import LocalTrainer, pulled
from pfl_tasks.engine.federation import Facts
from pfl_tasks.engine.state import Params, Tree, broadcast, replicate
from pfl_tasks.engine.streams import StreamKey
from pfl_tasks.nets import head_keys

ValLoss = Callable[[Tree, bool, Callable], torch.Tensor]


def proximal(mu: float):
    """Objective f_k(w) + mu/2 ||w - anchor||^2, the anchor passed as the trainer's `aux`."""

    @pulled(mu)
    def objective(data_loss, params, anchor):
        return data_loss(params) + 0.5 * mu * sum(((params[k] - anchor[k]) ** 2).sum() for k in anchor)

    return objective


class PersonalModels:
    """Mixin: every client keeps a full personal model, the one it is evaluated with."""

    def init_clients(self, params: Params, n_clients: int) -> Tree:
        return {"personal": replicate(params, n_clients)}

    def personalized(self, server: Tree, state: Tree) -> tuple[Params, bool]:
        return state["personal"], True


class SharedBody:
    """Mixin: FedPer's split, also FedRep's and FedCR's. The server keeps a body, the net's
    layers but the last; every client keeps a head, the last layer, which never leaves it."""

    @staticmethod
    def head_of(params) -> set[str]:
        return head_keys(params)

    def split(self, params: Params) -> tuple[Params, Params]:
        """(body, head) in the parameters' order, never a set's (whose order changes with the
        hash seed, and with it float sums over parameters such as a gradient's norm)."""
        head = self.head_of(params)
        return {k: v for k, v in params.items() if k not in head}, {k: v for k, v in params.items() if k in head}

    def init_server(self, params: Params, facts: Facts) -> Tree:
        return {"body": self.split(params)[0]}

    def init_clients(self, params: Params, n_clients: int) -> Tree:
        return {"head": replicate(self.split(params)[1], n_clients)}

    @staticmethod
    def joined(body: Params, state: Tree) -> Params:
        """[the body, each client's own head], a stack [K, ...]."""
        return {**broadcast(body, len(next(iter(state["head"].values())))), **state["head"]}

    @staticmethod
    def parted(trained: Params, state: Tree) -> tuple[Params, Tree]:
        """(the trained body, which is sent; the client state with its trained head, which stays)."""
        return ({k: v for k, v in trained.items() if k not in state["head"]},
                {"head": {k: trained[k] for k in state["head"]}})

    def personalized(self, server: Tree, state: Tree) -> tuple[Params, bool]:
        return self.joined(server["body"], state), True

    def global_model(self, server: Tree, clients: Tree) -> Params:
        """Evaluation-only view: the body with the clients' mean head (heads never move)."""
        return {**server["body"], **{k: v.mean(0) for k, v in clients["head"].items()}}


class HyperParams(BaseModel):
    # strict: a boolean or string is no number; non-finite values are refused
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Algorithm(ABC):
    name: ClassVar[str]
    citation: ClassVar[str]
    Hyper: ClassVar[type[HyperParams]] = HyperParams

    # True: every round needs every client's message (no sampling, no dropout)
    full_participation: ClassVar[bool] = False
    # False: its steps ignore `local.optimizer.lr` (tuning leaves it alone)
    uses_local_lr: ClassVar[bool] = True
    # its own random streams, beside the engine's (`pfl_tasks.engine.streams`)
    streams: ClassVar[tuple[StreamKey, ...]] = ()

    def __init__(self, hp: HyperParams):
        self.hp = hp

    def init_server(self, params: Params, facts: Facts) -> Tree:
        return {"global": params}

    def init_clients(self, params: Params, n_clients: int) -> Tree:
        return {}

    def payload(self, server: Tree) -> Tree:
        return {"global": server["global"]}

    def download(self, payload: Tree, ids: torch.Tensor) -> tuple[Tree, Tree]:
        """(shared, rows): what every client of `ids` receives, and per-client rows [K, ...]
        (e.g. FPFC's zeta_i); both reach `client_update` merged."""
        return payload, {}

    @abstractmethod
    def client_update(self, trainer: LocalTrainer, payload: Tree, state: Tree) -> tuple[Tree, Tree]:
        """Local work of a chunk of K clients; `state` rows and the returned trees are [K, ...]."""

    @abstractmethod
    def aggregate(self, server: Tree, messages: Tree, weights: torch.Tensor, ids: torch.Tensor) -> Tree:
        """Server rule; `messages` rows, `weights` (training-sample counts) and `ids` [S] are the
        senders', in the same order."""

    def personalized(self, server: Tree, state: Tree) -> tuple[Params, bool]:
        """(params, stacked): a stack [K, ...] of per-client models, or one shared model."""
        return server["global"], False

    def personalize(self, trainer: LocalTrainer, server: Tree, state: Tree, val_loss: ValLoss) -> tuple[Tree, bool]:
        """What a chunk is evaluated with, as `personalized`; `trainer` holds the chunk's training
        data, for local work at evaluation time (its fits draw from `trainer.rng(EVALUATION, ...)`), and
        `val_loss(params, stacked, forward)` scores a candidate on each client's validation
        split [K], for what is selected at evaluation time (never the test split); with
        `variants=V` V candidates at once, [V, K], from a `forward` giving [V, rows, ...]."""
        return self.personalized(server, state)

    def forward(self, net: nn.Module, params: Tree, x: torch.Tensor) -> torch.Tensor:
        """One client's evaluation outputs for the personalized view (logits or log-probabilities,
        or predictions); `params` is that client's slice of what `personalize` returned."""
        return functional_call(net, params, (x,))

    def forward_global(self, net: nn.Module, params: Tree, x: torch.Tensor) -> torch.Tensor:
        """The evaluation forward pass of the `global_model` view."""
        return functional_call(net, params, (x,))

    def round_metrics(self, server: Tree) -> dict[str, float]:
        """The algorithm's own diagnostics of the last round (e.g. CFL's update norms), logged
        with each evaluation."""
        return {}

    def global_model(self, server: Tree, clients: Tree) -> Params | None:
        """`clients` is every client's state, for views a simulator can form for evaluation
        only (e.g. FedPer's body with the clients' mean head); nothing is sent for it."""
        return server["global"]
