"""Learn2pFed's meta-training: client data as padded stacks, Theta trained through the cells,
and evaluation of every client's personalized model v_i(L) and of the global w(L).

Supervision is `train` (the paper: the clients' training losses at the last cell) or `val`
([choice]): the cells fit each client's training split and the meta loss is taken on its
validation split. On training loss alone Lambda = 0 is optimal whenever a
client's model class holds its own truth. Either way, the final models are the cells run with
the learned Theta on each client's training split, and they are scored on the clients' test
splits.
"""

from __future__ import annotations

import copy

import torch

from pfl_tasks.algorithms.learn2pfed import Cells, Problem, unroll
from pfl_tasks.config import Learn2pFedConfig, MetaOptimizer
from pfl_tasks.data import ClientSplit

def padded_problem(split: ClientSplit, features: torch.Tensor, n_classes: int, name: str = "training") -> Problem:
    """Stacks [M, n_max, ...] of each client's rows of `features` [total, d] (the split's rows,
    as features)."""
    feats = features.double()
    counts, offsets = split.counts, split.offsets
    pos = torch.arange(int(counts.max()))[None, :]
    valid = pos < counts[:, None]
    rows = torch.where(valid, offsets[:, None] + pos, offsets[:, None])
    if (valid.sum(1) == 0).any():
        empty = torch.nonzero(valid.sum(1) == 0).flatten().tolist()
        raise ValueError(f"clients {empty} have no rows in the {name} split")
    y = split.y[rows] if n_classes else split.y[rows].double()
    return Problem(feats[rows], y, valid.double(), n_classes)


def make_optimizer(cells: Cells, cfg: MetaOptimizer) -> torch.optim.Optimizer:
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[cfg.name]
    return cls(cells.parameters(), lr=cfg.lr)


def meta_epoch(cells: Cells, opt: torch.optim.Optimizer, cfg: Learn2pFedConfig, epoch: int,
               fit: Problem, supervise: Problem, w0: torch.Tensor) -> tuple[float, float]:
    """One full-batch outer step on sum_i loss_i(v_i(L)) over the `supervise` rows; returns that
    loss and the same sum over the `fit` rows (equal under `train` supervision)."""
    meta = cfg.meta
    lr = meta.decay_lr if meta.decay_epoch is not None and epoch >= meta.decay_epoch else meta.lr
    for group in opt.param_groups:
        group["lr"] = lr
    trace = unroll(cells, fit, w0, cfg.v_steps, cfg.v_lr)
    loss = supervise.per_client_loss(trace.v).sum()
    opt.zero_grad()
    loss.backward()
    if meta.clip is not None:
        torch.nn.utils.clip_grad_norm_(cells.parameters(), meta.clip)
    opt.step()
    return loss.item(), fit.per_client_loss(trace.v.detach()).sum().item()


def evaluate(cells: Cells, train: Problem, test: Problem, w0: torch.Tensor,
             cfg: Learn2pFedConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Per-client test metrics, in the engine's format, of v_i(L) and of the global w(L)."""
    frozen = copy.deepcopy(cells).requires_grad_(False)
    trace = unroll(frozen, train, w0, cfg.v_steps, cfg.v_lr, create_graph=False)
    models = {"personalized": trace.v.detach(), "global": trace.w.detach().expand_as(trace.v)}
    out = {}
    with torch.no_grad():
        for kind, v in models.items():
            metrics = {"n": test.mask.sum(1).float()}
            loss = test.per_client_loss(v).float()
            if test.n_classes:
                metrics.update(loss=loss, acc=test.accuracy(v).float())
            else:
                metrics["mse"] = loss
            out[kind] = metrics
    return out


def communication(problem: Problem, cells: int) -> dict[str, float]:
    """Bytes, all clients together, of the cells' float64 vectors: per cell each client uploads
    v - z - alpha and downloads w (d each). A meta step runs every cell forward and backward
    (the backward pass sends the gradients of the same vectors the other way), and each client
    uploads its scalar loss."""
    m, d, size = problem.n_clients, problem.dim, problem.x.element_size()
    per_cell = m * d * size
    return {
        "comm/bytes_up_per_cell": per_cell, "comm/bytes_down_per_cell": per_cell,
        "comm/bytes_up_per_meta_step": 2 * cells * per_cell + m * size,
        "comm/bytes_down_per_meta_step": 2 * cells * per_cell,
    }


def participation(cells: Cells) -> torch.Tensor:
    """Learned Lambda [layers, M, d]: large lambda_ij ties parameter j of client i to w."""
    return torch.stack([cells.values(c)["lam"] for c in range(len(cells.raw["lam"]))]).detach()
