"""The round runtime: one federated run's steps (sample clients, local update per chunk,
aggregate, evaluate) over an algorithm's surface (`pfl_tasks.algorithms.base.Algorithm`).

Each step is a plain method, so a Prefect flow can wrap each as a task and the inline steps
(`pfl_tasks.engine.rounds`) call them directly. The server state and the samples
live on the engine's device; the client stacks on the device too when `engine.client_state`
says so, otherwise on the host (pinned when the device is a GPU), a chunk's rows moving up
only while that chunk trains or is evaluated.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from pfl_tasks.config import ResolvedExperiment
from pfl_tasks.data import ClientSplit, FederatedData
from pfl_tasks.engine.device import configure, platform, resolve_device
from pfl_tasks.engine.evaluate import evaluate_clients
from pfl_tasks.engine.executor import make_trainer
from pfl_tasks.engine.state import Tree, concat, gather, leaves, scatter_, to_device, to_host, tree_bytes, tree_map
from pfl_tasks.engine.streams import DROPOUT, SAMPLE, round_generator
from pfl_tasks.errors import CheckpointError, ConfigError
from pfl_tasks.nets import build_net, init_params


@dataclass(frozen=True)
class Facts:
    """What the server knows of its federation before the first round."""

    n_clients: int
    local_steps: int  # per round (epochs when the budget is in epochs): the synchronization gap
    seed: int = 0  # of the run, for server-side initialization


@dataclass
class RunState:
    """The state after `round` rounds. The next round's aggregate updates `clients` in place
    (its cost is the sampled rows, not every client's), so a state is consumed by that round."""

    round: int  # completed rounds
    server: Tree
    clients: Tree  # stacks with one row per client, on `Federation.state_device`
    bytes_up: int = 0  # sent in the last round, all clients together
    bytes_down: int = 0
    reported: int = 0  # clients whose messages the last round aggregated (0: skipped)
    grad_samples: int = 0  # the last round's local compute: samples x forward-backward passes


@dataclass
class ChunkResult:
    ids: torch.Tensor
    messages: Tree  # on the device (on the host when it comes back from a Ray worker)
    clients: Tree  # on `Federation.state_device`
    bytes_down: int
    grad_samples: int

    def to_host(self) -> ChunkResult:
        return ChunkResult(self.ids, to_host(self.messages), to_host(self.clients), self.bytes_down,
                           self.grad_samples)


DEVICE_STATE_SHARE = 0.25  # client_state auto: the stacks on the GPU up to this share of its memory


def clients_per_round(exp: ResolvedExperiment, algorithm, n_clients: int) -> int:
    """How many clients a round samples; a ConfigError when the federation cannot run
    `algorithm` on `n_clients` clients."""
    fed, where = exp.federation, f"experiments.{exp.name}.federation"
    if fed.clients_per_round is not None and fed.clients_per_round > n_clients:
        raise ConfigError(f"{where}.clients_per_round: {fed.clients_per_round} exceeds the "
                          f"{n_clients} clients of dataset '{exp.dataset}'")
    per_round = fed.clients_per_round or max(1, round(fed.participation * n_clients))
    if algorithm.full_participation and (per_round < n_clients or fed.dropout):
        key = "dropout" if fed.dropout else "clients_per_round" if fed.clients_per_round else "participation"
        raise ConfigError(f"{where}.{key}: {algorithm.name} needs every client every round "
                          "(its server rule averages all of them)")
    return per_round


def tree_mismatch(expected, found, where: str) -> str | None:
    """The first difference of `found` from `expected` in entry names, tensor shapes and dtypes."""
    if isinstance(expected, dict):
        if not isinstance(found, dict) or set(found) != set(expected):
            names = sorted(found) if isinstance(found, dict) else type(found).__name__
            return f"{where} holds {names}, expected {sorted(expected)}"
        return next((problem for key in expected
                     if (problem := tree_mismatch(expected[key], found[key], f"{where}.{key}")) is not None), None)
    if isinstance(expected, torch.Tensor):
        if not isinstance(found, torch.Tensor):
            return f"{where} is a {type(found).__name__}, expected a tensor"
        if found.shape != expected.shape or found.dtype != expected.dtype:
            return f"{where} is {found.dtype} {list(found.shape)}, expected {expected.dtype} {list(expected.shape)}"
    return None


class Federation:
    def __init__(self, exp: ResolvedExperiment, algorithm, data: FederatedData):
        """`algorithm`: a registered `pfl_tasks.algorithms.Algorithm` with its hyper-parameters."""
        self.exp, self.algorithm = exp, algorithm
        self.per_round = clients_per_round(exp, algorithm, data.n_clients)
        self.facts = Facts(data.n_clients, exp.local.steps or exp.local.epochs, exp.seed)
        self.device = resolve_device(exp.engine.device)
        configure(exp.engine, self.device)
        self.platform = platform(exp.engine, self.device)
        self.state_device = self.device  # where the client stacks live: settled by `place`
        self.task = data.task
        self._token = uuid.uuid4().hex  # names this federation's samples in a worker's cache
        self.train, self.splits = _split_to(data.train, self.device), {
            "val": _split_to(data.val, self.device), "test": _split_to(data.test, self.device)}
        self.n_clients = data.n_clients
        self.net = build_net(exp.model, data.feature_shape, data.n_outputs)
        # functional_call swaps a module's tensors while it runs, so concurrent chunks each
        # get their own module: a copy of this storage-free template
        self._template = copy.deepcopy(self.net).to("meta")

    def __getstate__(self) -> dict:
        """Pickled (for a Ray worker) with its samples as host arrays, which Ray's object store
        hands to every worker without a copy."""
        state = dict(self.__dict__)
        state["train"], state["splits"] = _host_arrays(self.train), {k: _host_arrays(v) for k, v in self.splits.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled in a worker: the samples go to its device once per run, not once per chunk."""
        self.__dict__.update(state)
        if self.device.type == "cuda":  # the worker's own GPU (Ray shows each worker the one it assigned)
            self.device = resolve_device("cuda")
        configure(self.exp.engine, self.device)
        key = self._token, str(self.device)
        if key not in _UPLOADED:
            while len(_UPLOADED) >= 2:  # a worker serves one run at a time: keep the newest
                _UPLOADED.pop(next(iter(_UPLOADED)))
            _UPLOADED[key] = (_split_to(_from_arrays(self.train), self.device),
                              {k: _split_to(_from_arrays(v), self.device) for k, v in self.splits.items()})
        self.train, self.splits = _UPLOADED[key]

    def fresh_net(self) -> torch.nn.Module:
        return copy.deepcopy(self._template)

    def initial_state(self) -> RunState:
        params = init_params(self.net, self.exp.seed)
        server = to_device(self.algorithm.init_server(params, self.facts), self.device)
        return RunState(0, server, self.place(self.algorithm.init_clients(params, self.n_clients)))

    def restore(self, round_idx: int, server: Tree, clients: Tree) -> RunState:
        """The state a checkpoint holds (on the CPU), placed as this federation keeps it; a
        CheckpointError names the first entry whose name, shape or dtype is not this
        federation's (a checkpoint of the same identity, edited)."""
        fresh = self.initial_state()
        for part, expected, found in (("server", fresh.server, server), ("clients", fresh.clients, clients)):
            problem = tree_mismatch(expected, found, part)
            if problem is not None:
                raise CheckpointError(f"not this run's state: {problem}")
        return RunState(round_idx, to_device(server, self.device), self.place(clients))

    def place(self, clients: Tree) -> Tree:
        """The client stacks where `engine.client_state` keeps them: on a GPU, or on the host,
        pinned (a GPU copies pinned rows without blocking)."""
        choice, size = self.exp.engine.client_state, tree_bytes(clients)
        if self.device.type != "cuda":
            self.state_device = self.device
        elif choice == "device" or (choice == "auto" and self.exp.engine.task_runner != "ray" and
                                    size <= DEVICE_STATE_SHARE * torch.cuda.get_device_properties(self.device).total_memory):
            self.state_device = self.device
        else:
            self.state_device = torch.device("cpu")
            return tree_map(lambda t: t.cpu().pin_memory(), clients)
        return to_device(clients, self.state_device)

    def sample_clients(self, round_idx: int) -> torch.Tensor:
        """The sampled clients that report this round, sorted. Dropout is drawn per client from
        (seed, round) alone: who drops does not depend on who else was sampled. A dropped client
        is as if unsampled: its local work is lost and its state stays as it was."""
        fed = self.exp.federation
        rng = round_generator(self.exp.seed, round_idx, SAMPLE)
        ids = np.sort(rng.choice(self.n_clients, self.per_round, replace=False))
        if fed.dropout:
            drops = round_generator(self.exp.seed, round_idx, DROPOUT).random(self.n_clients) < fed.dropout
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
        if self.state_device != self.device:
            new_state = to_host(new_state)
        return ChunkResult(ids, messages, new_state, tree_bytes(shared) * len(ids) + tree_bytes(rows),
                           trainer.grad_samples)

    def aggregate(self, state: RunState, results: list[ChunkResult]) -> RunState:
        ids = torch.cat([r.ids for r in results])
        messages = concat([r.messages for r in results])
        weights = self.train.counts[ids].to(self.device, torch.float64)
        server = self.algorithm.aggregate(state.server, to_device(messages, self.device), weights, ids.to(self.device))
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
        view = self.algorithm.global_model(state.server, state.clients)
        shared = None if view is None else to_device(view, self.device)
        grad_samples = 0
        for ids in self.chunks(torch.arange(self.n_clients)):
            params, stacked, cost = self.personalized_models(state, ids)
            grad_samples += cost
            for split, parts in out.items():
                personal = self._eval(split, ids, params, stacked, self.algorithm.forward, by_row=split == "val")
                parts["personalized"].append(personal)
                if shared is not None:  # no personalization: the same numbers
                    parts["global"].append(personal if params is view else
                                           self._eval(split, ids, shared, False, self.algorithm.forward_global))
        metrics = {split: {kind: concat(p) for kind, p in parts.items() if p} for split, parts in out.items()}
        val_rows = metrics["val"]["personalized"].pop("rows") if "val" in metrics else None
        for parts in metrics.get("val", {}).values():
            parts.pop("rows", None)  # the global model's, where it is the personalized one
        return Evaluation(metrics, grad_samples, val_rows)

    def personalized_models(self, state: RunState, ids: torch.Tensor) -> tuple[Tree, bool, int]:
        """What clients `ids` are evaluated with, and the compute that took. Local work at
        evaluation time (fine-tuning, datastores) sees the chunk's training data through a
        trainer of round `state.round`; what it selects (e.g. a mixing weight) it selects on their
        validation loss."""
        trainer = make_trainer(
            self.exp.engine.executor, self.fresh_net(), self.task, self.train, ids, self.exp.local,
            self.exp.seed, state.round,
        )
        chunk = to_device(gather(state.clients, ids), self.device)

        def val_loss(params: Tree, stacked: bool, forward, variants: int = 0) -> torch.Tensor:
            metrics = self._eval("val", ids, params, stacked, forward, variants)
            return metrics["loss" if self.task == "classification" else "mse"]

        params, stacked = self.algorithm.personalize(trainer, state.server, chunk, val_loss)
        return params, stacked, trainer.grad_samples

    def nonfinite(self, state: RunState) -> str | None:
        """The first server or client tensor holding a NaN or an infinity, if any. A tensor's
        sum is finite only when every entry is (a NaN or an infinity makes it NaN or infinite),
        so entries are checked one by one only where the sum is not, which finite entries
        reach by overflowing it: a sum is about 50 times cheaper (4 ms a round for a stack of
        20 MLP models, entry by entry)."""
        for where, tree in (("server", state.server), ("clients", state.clients)):
            for name, tensor in leaves(tree):
                if not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
                    return f"{where}.{name}"
        return None

    def _eval(self, split, ids, params, stacked, forward=None, variants=0, by_row=False) -> dict[str, torch.Tensor]:
        return evaluate_clients(self.fresh_net(), self.task, self.splits[split], ids, params, stacked, forward,
                                variants, by_row)


@dataclass
class Evaluation:
    metrics: dict[str, dict[str, dict[str, torch.Tensor]]]  # split -> personalized/global -> metric -> [N]
    grad_samples: int  # compute spent personalizing every client (fine-tuning), 0 for most methods
    val_rows: torch.Tensor | None = None  # the personalized models' per-row validation metric (`by_row`)


_UPLOADED: dict[tuple[str, str], tuple] = {}  # (federation token, device) -> its samples there, per process


def _host_arrays(split) -> tuple:
    return tuple(t.cpu().numpy() for t in (split.x, split.y, split.offsets, split.counts))


def _from_arrays(arrays: tuple):
    return ClientSplit(*(torch.from_numpy(a.copy()) for a in arrays))


def _split_to(split, device):
    """The samples on `device` (one plain copy a run: no pinned buffer kept for it); offsets
    and counts stay on the host, where schedules are built."""
    return type(split)(split.x.to(device), split.y.to(device), split.offsets, split.counts)
