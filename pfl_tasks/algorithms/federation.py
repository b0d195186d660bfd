"""One federated run's round steps: sample clients, local update per chunk, aggregate, evaluate.

Each step is a plain method, so a Prefect flow can wrap each as a task and the inline
orchestrator (tests, benchmarks) can call them directly. Full client state lives on the CPU;
a chunk's rows move to the device only while that chunk trains or is evaluated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from pfl_tasks.algorithms.base import Algorithm, Facts
from pfl_tasks.config import ConfigError, ResolvedExperiment
from pfl_tasks.data import FederatedData
from pfl_tasks.engine.evaluate import evaluate_clients
from pfl_tasks.engine.executor import make_trainer
from pfl_tasks.engine.state import Tree, concat, gather, leaves, scatter_, to_device, tree_bytes, tree_map
from pfl_tasks.nets import build_net, init_params


@dataclass
class RunState:
    """The state after `round` rounds. The next round's aggregate updates `clients` in place
    (its cost is the sampled rows, not every client's), so a state is consumed by that round."""

    round: int  # completed rounds
    server: Tree
    clients: Tree  # stacks with one row per client, on the CPU
    bytes_up: int = 0  # sent in the last round, all clients together
    bytes_down: int = 0
    reported: int = 0  # clients whose messages the last round aggregated (0: skipped)
    grad_samples: int = 0  # the last round's local compute: samples x forward-backward passes


@dataclass
class ChunkResult:
    ids: torch.Tensor
    messages: Tree  # on the device
    clients: Tree  # on the CPU
    bytes_down: int
    grad_samples: int


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("engine.device is 'cuda' but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class Federation:
    def __init__(self, exp: ResolvedExperiment, algorithm: Algorithm, data: FederatedData):
        self.exp, self.algorithm = exp, algorithm
        fed, where = exp.federation, f"experiments.{exp.name}.federation"
        if fed.clients_per_round is not None and fed.clients_per_round > data.n_clients:
            raise ConfigError(f"{where}.clients_per_round: {fed.clients_per_round} exceeds the "
                              f"{data.n_clients} clients of dataset '{exp.dataset}'")
        self.per_round = fed.clients_per_round or max(1, round(fed.participation * data.n_clients))
        if algorithm.full_participation and (self.per_round < data.n_clients or fed.dropout):
            key = "dropout" if fed.dropout else "clients_per_round" if fed.clients_per_round else "participation"
            raise ConfigError(f"{where}.{key}: {algorithm.name} needs every client every round "
                              "(its server rule averages all of them)")
        self.facts = Facts(data.n_clients, exp.local.steps or exp.local.epochs, exp.seed)
        self.device = resolve_device(exp.engine.device)
        self.task = data.task
        self.train = _split_to(data.train, self.device)
        self.splits = {"val": _split_to(data.val, self.device), "test": _split_to(data.test, self.device)}
        self.n_clients = data.n_clients
        self.net = build_net(exp.model, data.feature_shape, data.n_outputs)
        # functional_call swaps a module's tensors while it runs, so concurrent chunks each
        # get their own module: a copy of this storage-free template
        self._template = copy.deepcopy(self.net).to("meta")

    def fresh_net(self) -> torch.nn.Module:
        return copy.deepcopy(self._template)

    def initial_state(self) -> RunState:
        params = init_params(self.net, self.exp.seed)
        server = to_device(self.algorithm.init_server(params, self.facts), self.device)
        clients = tree_map(lambda t: t.cpu(), self.algorithm.init_clients(params, self.n_clients))
        return RunState(0, server, clients)

    def to_device(self, tree: Tree) -> Tree:
        return to_device(tree, self.device)

    def sample_clients(self, round_idx: int) -> torch.Tensor:
        """The sampled clients that report this round, sorted. Dropout is drawn per client from
        (seed, round) alone: who drops does not depend on who else was sampled. A dropped client
        is as if unsampled: its local work is lost and its state stays as it was."""
        fed = self.exp.federation
        rng = np.random.default_rng([self.exp.seed, round_idx, 0x5A3])
        ids = np.sort(rng.choice(self.n_clients, self.per_round, replace=False))
        if fed.dropout:
            drops = np.random.default_rng([self.exp.seed, round_idx, 0xD209]).random(self.n_clients) < fed.dropout
            ids = ids[~drops[ids]]
        return torch.as_tensor(ids)

    def chunks(self, ids: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(ids, self.exp.engine.chunk_size))

    def local_update(self, round_idx: int, payload: Tree, ids: torch.Tensor, client_rows: Tree) -> ChunkResult:
        """Local work of clients `ids`, whose state is `client_rows` (their rows of the client stacks)."""
        trainer = make_trainer(
            self.exp.engine.executor, self.fresh_net(), self.task, self.train, ids, self.exp.local,
            self.exp.seed, round_idx,
        )
        state = to_device(client_rows, self.device)
        shared, rows = self.algorithm.download(payload, ids.to(self.device))
        messages, new_state = self.algorithm.client_update(trainer, {**shared, **rows}, state)
        new_state = tree_map(lambda t: t.cpu(), new_state)
        return ChunkResult(ids, messages, new_state, tree_bytes(shared) * len(ids) + tree_bytes(rows),
                           trainer.grad_samples)

    def aggregate(self, state: RunState, results: list[ChunkResult]) -> RunState:
        ids = torch.cat([r.ids for r in results])
        messages = concat([r.messages for r in results])
        on_device = ids.to(self.device)
        server = self.algorithm.aggregate(state.server, messages, self.train.counts[on_device].to(torch.float64), on_device)
        clients = state.clients
        if clients:
            clients = scatter_(clients, ids, concat([r.clients for r in results]))
        up = tree_bytes(messages)
        return RunState(state.round + 1, server, clients, up, sum(r.bytes_down for r in results), len(ids),
                        sum(r.grad_samples for r in results))

    def evaluate(self, state: RunState) -> Evaluation:
        """Per-client validation and test metrics of every client, for the personalized and
        global models, and the compute personalizing them took."""
        out = {split: {"personalized": [], "global": []} for split in self.splits}
        view = self.algorithm.global_model(state.server, state.clients)  # clients stay on the CPU
        shared = None if view is None else to_device(view, self.device)
        grad_samples = 0
        for ids in self.chunks(torch.arange(self.n_clients)):
            params, stacked, cost = self.personalized_models(state, ids)
            grad_samples += cost
            for split, parts in out.items():
                personal = self._eval(split, ids, params, stacked, self.algorithm.forward)
                parts["personalized"].append(personal)
                if shared is not None:  # no personalization (e.g. FedAvg): the same numbers
                    parts["global"].append(personal if params is view else
                                           self._eval(split, ids, shared, False, self.algorithm.forward_global))
        metrics = {split: {kind: concat(p) for kind, p in parts.items() if p} for split, parts in out.items()}
        return Evaluation(metrics, grad_samples)

    def personalized_models(self, state: RunState, ids: torch.Tensor) -> tuple[Tree, bool, int]:
        """What clients `ids` are evaluated with, and the compute that took. Local work at
        evaluation time (fine-tuning, datastores) sees the chunk's training data through a
        trainer of round `state.round`; what it selects (kNN-Per's lam) it selects on their
        validation loss."""
        trainer = make_trainer(
            self.exp.engine.executor, self.fresh_net(), self.task, self.train, ids, self.exp.local,
            self.exp.seed, state.round,
        )
        chunk = to_device(gather(state.clients, ids), self.device)

        def val_loss(params: Tree, stacked: bool, forward) -> torch.Tensor:
            metrics = self._eval("val", ids, params, stacked, forward)
            return metrics["loss" if self.task == "classification" else "mse"]

        params, stacked = self.algorithm.personalize(trainer, state.server, chunk, val_loss)
        return params, stacked, trainer.grad_samples

    def nonfinite(self, state: RunState) -> str | None:
        """The first server or client tensor holding a NaN or an infinity, if any."""
        for where, tree in (("server", state.server), ("clients", state.clients)):
            for name, tensor in leaves(tree):
                if not torch.isfinite(tensor).all():
                    return f"{where}.{name}"
        return None

    def _eval(self, split, ids, params, stacked, forward=None) -> dict[str, torch.Tensor]:
        return evaluate_clients(
            self.fresh_net(), self.task, self.splits[split], ids.to(self.device), params, stacked, forward
        )


@dataclass
class Evaluation:
    metrics: dict[str, dict[str, dict[str, torch.Tensor]]]  # split -> personalized/global -> metric -> [N]
    grad_samples: int  # compute spent personalizing every client (fine-tuning), 0 for most methods


def _split_to(split, device):
    return type(split)(*(t.to(device) for t in (split.x, split.y, split.offsets, split.counts)))
