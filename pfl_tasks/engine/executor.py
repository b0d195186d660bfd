"""Local training for a chunk of clients: vectorized (`torch.func`) or sequential (reference).

Both executors draw the same minibatches (`batch_schedule`) and apply the same objective and
optimizer; the vectorized one runs every client of the chunk in one `vmap(grad(...))` call per
step, the sequential one loops over clients with autograd and `torch.optim`. Tests hold them to
allclose results.

An algorithm describes its local problem as an `Objective`:
`objective(data_loss, params, aux) -> scalar` for ONE client, where `data_loss(params)` is the
mean loss on the client's current minibatch and `aux` holds that client's extra tensors
(e.g. the received global model for a proximal term).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from pfl_tasks.config import LocalConfig
from pfl_tasks.data import ClientSplit
from pfl_tasks.engine import optim
from pfl_tasks.engine.state import Params, Stack, Tree, interpolate, per_row, row_sums, to_device, tree_map, tree_zip
from pfl_tasks.engine.streams import LOCAL, Stream, StreamKey, client_keys, row_hashes
from pfl_tasks.nets import (first_linear, frozen_prefix, interpolated_backward, interpolated_forward, stackable,
                            stacked_backward, stacked_forward)

DataLoss = Callable[[Params], torch.Tensor]
Objective = Callable[[DataLoss, Params, Tree], torch.Tensor]
Step = Callable[[Tree, DataLoss, Tree, "Batch"], Tree]


@dataclass(frozen=True)
class Batch:
    """One client's minibatch inside a `scan` step (a whole stack's, in a `clientwise` step):
    `weight` sums to 1 over real rows (0 on padding), `extra` holds this step's slice of the
    `per_step` tensors. `data_grad(params)` is the gradient of the data loss on this batch at
    `params` (fresh tensors, the caller's to overwrite); `data_step` an SGD step on it, in place;
    `interpolation_grad` and `interpolation_step` the same at an interpolation of two models;
    `grad(loss, has_aux)` is `torch.func.grad` of a loss of the step's own over this batch (a
    custom forward pass). Each call of any is one forward-backward pass, counted by the engine
    for the compute."""

    x: torch.Tensor
    y: torch.Tensor
    weight: torch.Tensor
    extra: Tree
    record_pass: Callable[[], None]  # a pass the step computes by hand calls it
    data_grad: Callable[[Params], Params]
    fused_step: Callable[[Params, float, tuple[Params, float] | None], None] | None = None  # data_step's
    fused_interpolation_step: Callable[[torch.Tensor, Params, Params, float, bool], torch.Tensor] | None = None

    def data_step(self, params: Params, lr: float, pull: tuple[Params, float] | None = None) -> None:
        """params -= lr * (the data loss's gradient at params), in place; with `pull` (anchors,
        mu) the gradient of data loss + mu/2 ||params - anchors||^2."""
        if self.fused_step is not None:
            return self.fused_step(params, lr, pull)
        g = self.data_grad(params)
        if pull is not None:
            add_pull(g, params, *pull)
        for k, t in params.items():
            t.add_(g[k], alpha=-lr)

    def interpolation_grad(self, a: torch.Tensor, v: Params, theta: Params) -> tuple[Params, torch.Tensor]:
        """For the data loss f at the interpolation a v + (1 - a) theta (a per client): its
        gradient in v, a grad f(...), and its derivative in a, <v - theta, grad f(...)>."""
        g = self.data_grad(interpolate(a, v, theta))
        slope = sum(row_sums((v[k] - theta[k]).mul_(g[k]), a) for k in v)
        return {k: t.mul_(per_row(a, t)) for k, t in g.items()}, slope

    def interpolation_step(self, a: torch.Tensor, v: Params, theta: Params, lr: float,
                           theta_step: bool = False) -> torch.Tensor:
        """v -= lr * (`interpolation_grad`'s gradient in v), in place, and with `theta_step`
        theta's own `data_step` at lr too (the two passes then share theta's first product);
        returns the derivative in a. Everything at the values before the steps."""
        if self.fused_interpolation_step is not None:
            return self.fused_interpolation_step(a, v, theta, lr, theta_step)
        g, slope = self.interpolation_grad(a, v, theta)
        if theta_step:
            self.data_step(theta, lr)
        for k, t in v.items():
            t.add_(g[k], alpha=-lr)
        return slope

    def grad(self, loss: Callable, has_aux: bool = False) -> Callable:
        gradient = grad(loss, has_aux=has_aux)

        def counted(*args):
            self.record_pass()
            return gradient(*args)

        return counted


def clientwise(fn):
    """Marks an objective, or a `scan` step, as computing each client's values from that
    client's rows alone, elementwise, with any sum over clients or parameters only feeding a
    gradient (a proximal term, say, and not one that multiplies a client's matrices): called
    once on a whole stack, it gives every client what it gives that client alone. The
    vectorized executor calls such a function once on a stackable net's whole stack
    (`stacked_forward`, `stacked_backward`), where anything else is vmapped client by client."""
    fn.clientwise = True
    return fn


def penalized(gradient: Callable[[Params, Params, Tree], None]):
    """Marks an objective `data_loss(params) + R(params, aux)` with R's gradient:
    `gradient(grads, params, aux)` adds each client's dR/dparams[k] to `grads[k]`, in place,
    for each key of `grads`, on a stack's rows (`params` all of them, trainable or not). On a
    stackable net the vectorized executor then backpropagates the data loss by hand, builds no
    autograd graph and adds this; everywhere else the objective runs as written. Tests hold
    the two together for every marked objective."""

    def mark(objective):
        objective.penalty_gradient = gradient
        return objective

    return mark


def add_pull(grads: Params, params: Params, anchor: Params, mu: float) -> None:
    """grads += mu (params - anchor), in place: the gradient of mu/2 ||params - anchor||^2."""
    for k, g in grads.items():
        g.add_(params[k] - anchor[k], alpha=mu)


def pulled(mu: float):
    """Marks a proximal objective `data_loss(params) + mu/2 ||params - aux||^2`: `penalized`
    by mu (params - aux), which plain SGD on a stackable net fuses into its step instead, each
    parameter first drawn toward aux by lr mu, no gradient stored."""

    def mark(objective):
        objective = penalized(lambda grads, params, anchor: add_pull(grads, params, anchor, mu))(objective)
        objective.pull = mu
        return objective

    return mark


@clientwise
def data_objective(data_loss, params, aux):
    return data_loss(params)


@dataclass(frozen=True)
class Schedule:
    """On the host. A client's real entries of a step come first (`mask` is a prefix)."""

    index: torch.Tensor  # [K, S, B] row offsets inside each client's split (0 where padded)
    mask: torch.Tensor  # [K, S, B] real (not padded) batch entries
    active: torch.Tensor  # [K, S] steps inside each client's budget


@dataclass(frozen=True)
class StepPlan:
    """One step of a vectorized fit over the chunk in budget order, its tensors already on
    the device: the first `width` clients are still within their budget and step; their rows
    of the flat split, which entries are real, and the real rows in all (compute accounting)."""

    width: int
    rows: torch.Tensor  # [width, B]
    mask: torch.Tensor  # [width, B]
    samples: int


def batch_schedule(
    counts: torch.Tensor, client_ids: torch.Tensor, local: LocalConfig, seed: int,
    round_idx: int, stream: int,
) -> Schedule:
    """Minibatches for every step: epochs of seeded per-client permutations, each client
    sampling only its own data. Batch size is min(batch_size, n_k); full batch when None.
    Client k's permutation r sorts the hashes of (key_k, r, j) over its rows j, where key_k
    hashes (seed, round, stream, client): the draws are counter-based, so a client's batches
    do not depend on its chunk, the executor or the resume point. Vectorized over clients."""
    n = counts.long()
    b = n if local.batch_size is None else n.clamp(max=local.batch_size)
    steps = torch.full_like(n, local.steps) if local.steps is not None else local.epochs * -(-n // b)
    epochs = -(-(steps * b) // n)  # permutations each client needs
    r = np.arange(int(epochs.max()), dtype=np.uint64)[:, None] << np.uint64(32)
    j = np.arange(int(n.max()), dtype=np.uint64)[None, :]
    hashes = row_hashes(client_keys(seed, round_idx, stream, client_ids.numpy()), r + j)  # [K, R, N]
    not_its_rows = np.arange(hashes.shape[-1]) >= n.numpy()[:, None, None]
    hashes = np.where(not_its_rows, np.iinfo(np.uint64).max, hashes)  # sorted last
    perms = torch.from_numpy(np.argsort(hashes, axis=-1, kind="stable"))  # row r: a permutation of 0..n_k-1 first

    s_max, b_max = int(steps.max()), int(b.max())
    step, slot = torch.arange(s_max)[None, :, None], torch.arange(b_max)[None, None, :]
    mask = (step < steps[:, None, None]) & (slot < b[:, None, None])
    t = (step * b[:, None, None] + slot) * mask  # position in the client's stream of epochs
    nk = n[:, None, None]
    index = perms[torch.arange(len(n))[:, None, None], t // nk, t % nk] * mask
    active = torch.arange(s_max)[None, :] < steps[:, None]
    return Schedule(index, mask, active)


def take(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`t[rows]` for an integer index of any shape, by `index_select` (several times faster
    than advanced indexing on the CPU)."""
    return t.index_select(0, rows.flatten()).view(*rows.shape, *t.shape[1:])


def per_sample_loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if task == "classification":
        return F.cross_entropy(out, y, reduction="none")
    return (out.squeeze(-1) - y) ** 2


class LocalTrainer(ABC):
    """Trains stacked client parameters on a chunk's own data (base of both executors).

    What an algorithm may use: `net` (a storage-free module for `functional_call`), `task`,
    `local` (the local budget and optimizer), `device`, `n_clients` (the chunk's), `fit` and
    `scan`, the chunk's training `samples()`, and its random streams (`rng`). Its
    samples stay on the device and their offsets and counts on the host: the schedule is built
    on the host and uploaded once per fit, so no step waits on the device."""

    def __init__(
        self, net: nn.Module, task: str, train: ClientSplit, client_ids: torch.Tensor,
        local: LocalConfig, seed: int, round_idx: int,
    ):
        self.net, self.task, self.local = net, task, local
        self.device = train.x.device
        self._train, self._client_ids, self._seed, self._round_idx = train, client_ids.cpu(), seed, round_idx
        self._offsets = train.offsets[self._client_ids]
        self._counts = train.counts[self._client_ids]
        # compute spent: samples x forward-backward passes, summed over the chunk's clients
        self.grad_samples = 0
        self._passes = 0  # of the vectorized step being traced

    @property
    def n_clients(self) -> int:
        return len(self._client_ids)

    def rng(self, key: StreamKey, index: int = 0) -> Stream:
        """This round's random stream `key` (`pfl_tasks.engine.streams`), the `index`-th of its
        family: the minibatches of a second fit (`fit(..., stream=trainer.rng(SECOND))`), or an
        algorithm's own draws."""
        return Stream(key.name, key.number + index, self._seed, self._round_idx, self._client_ids)

    def samples(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every training sample of the chunk's clients, padded to the largest client, on the
        device: x [K, N, ...], y [K, N] and mask [K, N] (false on padding, which repeats the
        client's first sample)."""
        position = torch.arange(int(self._counts.max()))
        mask = position < self._counts[:, None]
        up = to_device({"rows": self._offsets[:, None] + position * mask, "mask": mask}, self.device)
        return take(self._train.x, up["rows"]), take(self._train.y, up["rows"]), up["mask"]

    def schedule(self, stream: Stream | None, local: LocalConfig) -> Schedule:
        number = (stream or self.rng(LOCAL)).number
        return batch_schedule(self._counts, self._client_ids, local, self._seed, self._round_idx, number)

    def _rows(self, sched: Schedule) -> torch.Tensor:
        """[K, S, B] rows of the flat split, on the device (one upload)."""
        return to_device({"rows": self._offsets[:, None, None] + sched.index}, self.device)["rows"]

    @abstractmethod
    def fit(
        self, params: Stack, objective: Objective = data_objective, aux: Stack | None = None,
        stream: Stream | None = None, trainable: set[str] | None = None, local: LocalConfig | None = None,
    ) -> Stack:
        """Run the local budget on `params` [K, ...]; returns the trained stack.
        Only keys in `trainable` (default: all) are optimized; `stream` (default: `rng(LOCAL)`)
        separates the minibatch draws of several fits in one round; `local` overrides steps/optimizer."""

    @abstractmethod
    def scan(self, carry: Tree, step: Step, aux: Tree | None = None, stream: Stream | None = None,
             local: LocalConfig | None = None,
             per_step: Callable[[int, int], Tree] | None = None) -> Tree:
        """Run `step(carry_k, data_loss, aux_k, batch) -> carry_k` once per local step, each on
        a fresh minibatch, for every client; for algorithms whose local work is not plain
        optimization (nested prox solves, mixtures, custom forward passes). `step` may call
        `torch.func.grad`, and owns its carry: it may update the carry's tensors in place and
        return them (each executor hands it a copy of `carry` that nothing else reads).
        `per_step(S, B)` returns tensors [K, S, B, ...] for the chunk's padded step and batch
        counts (e.g. noise drawn per client outside `vmap`, so both executors see the same);
        step s gets its slice as `batch.extra`."""

    def net_loss(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return per_sample_loss(self.task, functional_call(self.net, params, (x,)), y)

    def _record_pass(self) -> None:
        """Inside a vectorized step, traced once for every client of the chunk."""
        self._passes += 1

    def _count_step(self, samples: int) -> None:
        """One vectorized step ran `self._passes` passes over `samples` real batch rows."""
        self.grad_samples += self._passes * samples
        self._passes = 0


class VectorizedTrainer(LocalTrainer):
    def fit(self, params, objective=data_objective, aux=None, stream=None, trainable=None, local=None):
        local = local or self.local
        order, plans = self._plan(self.schedule(stream, local))
        keys = trainable if trainable is not None else set(params)
        train = order.copy({k: v for k, v in params.items() if k in keys})
        frozen = order.arrange({k: v for k, v in params.items() if k not in keys})
        aux = order.arrange(aux or {})

        def client_objective(train_p, frozen_p, x, y, mask, aux_k):
            def data_loss(p):
                self._record_pass()
                losses = self.net_loss(p, x, y)
                return (losses * mask).sum() / mask.sum()

            return objective(data_loss, {**frozen_p, **train_p}, aux_k)

        start, inputs = 0, self._samples
        # plain SGD on a stackable net's data loss, `pulled` or not: each step moves the
        # parameters as the backward pass leaves them, no gradient stored
        pull = getattr(objective, "pull", None)
        descend = (stackable(self.net) and (objective is data_objective or pull is not None)
                   and optim.plain_sgd(local.optimizer))
        if stackable(self.net):
            start = frozen_prefix(params, keys)
            if start:
                inputs = self._frozen_features(start, frozen, order)
            grads_of = None if descend else self._stacked_grads(objective, start, train)
        else:
            grads_of = vmap(grad(client_objective))
        opt_state = optim.init_state(local.optimizer, train)
        for s, plan in enumerate(plans):
            x, y = inputs(plan), take(self._train.y, plan.rows)
            # the clients still within their budget are a prefix: their rows step in place
            rows, frozen_rows, aux_rows, opt_rows = _first(plan.width, train, frozen, aux, opt_state)
            if descend:
                self._backward({**frozen_rows, **rows}, x, y, plan.mask, rows, start, local.optimizer.lr,
                               None if pull is None else (aux_rows, pull))
            else:
                grads = grads_of(rows, frozen_rows, x, y, plan.mask, aux_rows)
                optim.step_(local.optimizer, rows, grads, opt_rows, s)
            self._count_step(plan.samples)
        return order.restore({**frozen, **train})

    def _backward(self, params: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, grads: Params,
                  start: int = 0, lr: float | None = None, pull: tuple[Params, float] | None = None) -> None:
        """One forward-backward pass of a stackable net (from module `start`) on the data loss,
        by hand (`stacked_backward`): each client's gradient into `grads`, or with `lr` an SGD
        step of the parameters `grads` names, with `pull` (anchors, mu) a `pulled` one's."""
        saved = []
        self._record_pass()
        out = stacked_forward(self.net, params, x, start, saved=saved)
        stacked_backward(self.net, params, saved, self._loss_gradient(out, y, mask), grads, lr, pull)

    def _samples(self, plan: StepPlan) -> torch.Tensor:
        return take(self._train.x, plan.rows)

    def _frozen_features(self, start: int, frozen: Stack, order: BudgetOrder) -> Callable[[StepPlan], torch.Tensor]:
        """The inputs of net[start:] for a step: the frozen modules before it applied once, at
        the start of the fit, to each client's own training rows (in budget order, unpadded),
        instead of once a step to its batch."""
        offsets, counts = self._offsets[order.host_perm], self._counts[order.host_perm]
        features = torch.cat([
            stacked_forward(self.net, tree_map(lambda t: t[k: k + 1], frozen), self._train.x[o: o + n][None],
                            stop=start)[0]
            for k, (o, n) in enumerate(zip(offsets.tolist(), counts.tolist()))])
        # a split row r of client k stands at r + shift[k] among the features
        shift = to_device({"shift": (torch.cumsum(counts, 0) - counts - offsets)[:, None]}, self.device)["shift"]

        def inputs(plan: StepPlan) -> torch.Tensor:
            return take(features, plan.rows + shift[: plan.width])

        return inputs

    def _stacked_grads(self, objective: Objective, start: int, train: Stack):
        """`vmap(grad(client objective))` for a stackable net, computed more cheaply: one
        batched forward of the whole stack (`stacked_forward`, from module `start` on). The data
        loss of a `penalized` objective (plain data loss included) is backpropagated by hand
        into buffers shaped like `train`, and its penalty's gradient added; any other objective
        gets ordinary autograd on the sum of the clients' objectives, which gives each client's
        gradient in its own slice (a `clientwise` objective called once on the stack, any other
        vmapped around each client's data loss)."""
        penalty = None if objective is data_objective else getattr(objective, "penalty_gradient", None)
        if objective is data_objective or penalty is not None:
            buffers = {k: torch.empty_like(v) for k, v in train.items()}

            def by_hand(train_p, frozen_p, x, y, mask, aux):
                params, grads = {**frozen_p, **train_p}, {k: v[: len(x)] for k, v in buffers.items()}
                self._backward(params, x, y, mask, grads, start)
                if penalty is not None:
                    penalty(grads, params, aux)
                return grads

            return by_hand

        def grads_of(train_p, frozen_p, x, y, mask, aux):
            train_p = {k: v.detach().requires_grad_() for k, v in train_p.items()}
            params = {**frozen_p, **train_p}
            out = stacked_forward(self.net, params, x, start)
            per_sample = per_sample_loss(self.task, out.flatten(0, 1), y.flatten()).view(mask.shape)
            losses = (per_sample * mask).sum(1) / mask.sum(1)

            def objective_of(params_k, aux_k, loss_k):
                def data_loss(p):
                    if p is not params_k:
                        raise ValueError("a stacked fit's objective takes the data loss of the parameters it is given")
                    self._record_pass()
                    return loss_k

                return objective(data_loss, params_k, aux_k)

            if getattr(objective, "clientwise", False):
                total = objective_of(params, aux, losses.sum())
            else:
                total = vmap(objective_of)(params, aux, losses).sum()
            return dict(zip(train_p, torch.autograd.grad(total, list(train_p.values()))))

        return grads_of

    def _loss_gradient(self, out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """d(sum over clients of each client's mean loss on its real batch rows) / d outputs,
        for outputs [K, B, C]: (softmax - one-hot) or 2 (prediction - target), times each row's
        weight, mask / its client's real rows."""
        weight = (mask / mask.sum(1, keepdim=True)).unsqueeze(-1)
        if self.task == "classification":
            d = torch.softmax(out, -1)
            d.scatter_add_(-1, y.unsqueeze(-1), weight.new_full((1, 1, 1), -1.0).expand(*y.shape, 1))
        else:
            d = 2 * (out - y.unsqueeze(-1))
        return d.mul_(weight)

    def scan(self, carry, step, aux=None, stream=None, local=None, per_step=None):
        sched = self.schedule(stream, local or self.local)
        order, plans = self._plan(sched)
        per_step = order.arrange(to_device(per_step(*sched.index.shape[1:]) if per_step else {}, self.device))
        carry, aux = order.copy(carry), order.arrange(aux or {})

        def client_step(c, x, y, mask, a, extra):
            weight = mask / mask.sum()

            def data_loss(p):
                self._record_pass()
                return (self.net_loss(p, x, y) * weight).sum()

            return step(c, data_loss, a, Batch(x, y, weight, extra, self._record_pass, grad(data_loss)))

        def stack_step(c, x, y, mask, a, extra):  # a clientwise step, on the whole stack at once
            weight = mask / mask.sum(1, keepdim=True)

            def data_loss(p):  # the sum of the clients' losses
                self._record_pass()
                out = stacked_forward(self.net, p, x).flatten(0, 1)
                return (per_sample_loss(self.task, out, y.flatten()).view(mask.shape) * weight).sum()

            def data_grad(p):  # each client's, in its own rows, backpropagated by hand
                grads = {k: torch.empty_like(v, memory_format=torch.contiguous_format) for k, v in p.items()}
                self._backward(p, x, y, mask, grads)
                return grads

            def data_step(p, lr, pull):  # p stepped as the backward pass leaves it
                self._backward(p, x, y, mask, p, 0, lr, pull)

            def interpolation_step(share, v, theta, lr, theta_step):  # stepped as the backward passes leave them
                theta_saved, theta_outputs, theta_first = [], {}, None
                if theta_step:
                    self._record_pass()
                    d_theta = self._loss_gradient(
                        stacked_forward(self.net, theta, x, saved=theta_saved, outputs=theta_outputs), y, mask)
                    theta_first = theta_outputs[first_linear(self.net)]
                saved, gaps = [], {}
                self._record_pass()
                out = interpolated_forward(self.net, share, v, theta, x, saved, gaps, theta_first)
                slope = interpolated_backward(self.net, share, v, theta, saved, gaps,
                                              self._loss_gradient(out, y, mask), lr)
                if theta_step:  # theta moves last: the passes above read it
                    stacked_backward(self.net, theta, theta_saved, d_theta, theta, lr)
                return slope

            return step(c, data_loss, a, Batch(x, y, weight, extra, self._record_pass, data_grad, data_step,
                                               interpolation_step))

        stepped = stack_step if stackable(self.net) and getattr(step, "clientwise", False) else vmap(client_step)
        for s, plan in enumerate(plans):
            x, y = take(self._train.x, plan.rows), take(self._train.y, plan.rows)
            extra = tree_map(lambda t: t[: plan.width, s], per_step)
            new = stepped(*_first(plan.width, carry), x, y, plan.mask, *_first(plan.width, aux), extra)
            self._count_step(plan.samples)
            carry = _update_first(carry, new)
        return order.restore(carry)

    def _plan(self, sched: Schedule) -> tuple[BudgetOrder, list[StepPlan]]:
        """The chunk's budget order and every step's tensors, uploaded in one go; the widths
        and sample counts read on the host."""
        order = BudgetOrder(sched.active.sum(1), self.device)
        perm = order.host_perm
        up = to_device({"rows": (self._offsets[:, None, None] + sched.index)[perm],
                        "mask": sched.mask[perm].to(self._train.x.dtype)}, self.device)
        rows, mask = up["rows"], up["mask"]
        widths = sched.active.sum(0).tolist()
        samples = sched.mask.sum((0, 2)).tolist()
        return order, [StepPlan(w, rows[:w, s], mask[:w, s], samples[s]) for s, w in enumerate(widths)]


class BudgetOrder:
    """A chunk's clients longest budget first (stable), so the clients still within their
    budget at any step are a prefix; the identity (no copies) when every budget is equal."""

    def __init__(self, steps: torch.Tensor, device: torch.device):
        self.uniform = bool((steps == steps[0]).all())
        self.host_perm = torch.arange(len(steps)) if self.uniform else torch.argsort(-steps, stable=True)
        if not self.uniform:
            self._perm = to_device({"p": self.host_perm}, device)["p"]
            self._inverse = torch.argsort(self._perm)

    def arrange(self, tree: Tree) -> Tree:
        """Client rows in budget order, to read (the tree itself when every budget is equal;
        a broadcast tensor, every row the same, as it is)."""
        if self.uniform:
            return tree

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t if t.dim() and t.stride(0) == 0 else t.index_select(0, self._perm.to(t.device))

        return tree_map(rows, tree)

    def copy(self, tree: Tree) -> Tree:
        """Client rows in budget order, in fresh contiguous memory to update in place."""
        if self.uniform:
            return tree_map(lambda t: t.clone(memory_format=torch.contiguous_format), tree)
        return tree_map(lambda t: t.index_select(0, self._perm.to(t.device)), tree)

    def restore(self, tree: Tree) -> Tree:
        return tree if self.uniform else tree_map(lambda t: t.index_select(0, self._inverse.to(t.device)), tree)


def _first(width: int, *trees: Tree) -> tuple[Tree, ...]:
    """The first `width` client rows of each tree (views)."""
    return tuple(tree_map(lambda t: t[:width], tree) for tree in trees)


def _update_first(tree: Tree, new: Tree) -> Tree:
    """`tree` with its first rows replaced by `new` (its rows for the clients that stepped),
    in place when they are fewer: the rest, clients past their budget, keep their values."""

    def put(old: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        if len(fresh) == len(old):
            return fresh
        if fresh.data_ptr() == old.data_ptr() and fresh.stride() == old.stride():  # updated in place
            return old
        return old.index_copy_(0, torch.arange(len(fresh), device=old.device), fresh)

    return tree_zip(put, tree, new)


class SequentialTrainer(LocalTrainer):
    """The reference: one client at a time, autograd and `torch.optim`, unpadded batches."""

    def fit(self, params, objective=data_objective, aux=None, stream=None, trainable=None, local=None):
        local = local or self.local
        sched = self.schedule(stream, local)
        keys = trainable if trainable is not None else set(params)
        aux = aux or {}
        out = {k: torch.empty_like(v) for k, v in params.items()}
        batches = self._batches(sched)
        for i in range(len(self._client_ids)):
            p = {k: v[i].detach().clone().requires_grad_(k in keys) for k, v in params.items()}
            opt = optim.torch_optimizer(local.optimizer, [p[k] for k in sorted(keys)])
            aux_i = tree_map(lambda t: t[i], aux)
            for x, y in batches(i):
                opt.zero_grad()
                loss = objective(self._data_loss(x, y), p, aux_i)
                loss.backward()
                opt.step()
            for k in params:
                out[k][i] = p[k].detach()
        return out

    def scan(self, carry, step, aux=None, stream=None, local=None, per_step=None):
        sched = self.schedule(stream, local or self.local)
        per_step = to_device(per_step(*sched.index.shape[1:]) if per_step else {}, self.device)
        batches = self._batches(sched)
        rows = []
        for i in range(len(self._client_ids)):
            c = tree_map(lambda t: t[i].clone(), carry)  # the step's own
            a = tree_map(lambda t: t[i], aux or {})
            for s, (x, y) in enumerate(batches(i)):
                extra = tree_map(lambda t: t[i, s, : len(y)], per_step)
                weight = torch.full((len(y),), 1 / len(y), device=x.device)
                data_loss = self._data_loss(x, y)
                c = step(c, data_loss, a, Batch(x, y, weight, extra, self._recorder(len(y)), grad(data_loss)))
            rows.append(c)
        return tree_zip(lambda *ts: torch.stack(ts), *rows)

    def _recorder(self, rows: int) -> Callable[[], None]:
        def record_pass():
            self.grad_samples += rows

        return record_pass

    def _data_loss(self, x, y) -> DataLoss:
        record_pass = self._recorder(len(y))

        def data_loss(p):
            record_pass()
            return self.net_loss(p, x, y).mean()

        return data_loss

    def _batches(self, sched: Schedule) -> Callable[[int], Iterator[tuple[torch.Tensor, torch.Tensor]]]:
        """Client i's real (unpadded) minibatches, step by step; the rows uploaded once."""
        rows = self._rows(sched)
        sizes = sched.mask.sum(-1).tolist()  # [K][S] real entries: a prefix of each step's slots
        steps = sched.active.sum(1).tolist()

        def batches(i: int):
            for s in range(steps[i]):
                r = rows[i, s, : sizes[i][s]]
                yield take(self._train.x, r), take(self._train.y, r)

        return batches


def make_trainer(executor: str, *args, **kwargs) -> LocalTrainer:
    return {"vectorized": VectorizedTrainer, "sequential": SequentialTrainer}[executor](
        *args, **kwargs
    )

