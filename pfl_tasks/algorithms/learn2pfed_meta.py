"""Learn2pFed's meta-training: client data as padded stacks, Theta trained through the cells,
the meta-epoch selected on validation, and evaluation of every client's personalized model v_i(L).

Supervision is `train` (the paper: the clients' training losses at the last cell) or `val`
([choice]): the cells fit each client's training split and the meta loss is taken on its
validation split. On training loss alone Lambda = 0 is optimal whenever a client's model class
holds its own truth, so the longer Theta trains the closer it drifts to local fitting: the
meta-epoch is selected as a training run's round is, on the clients' validation splits
(`pfl_tasks.selection.Selection`: Theta after each step, scored by the personalized models it gives). Under `val` supervision each
client's validation rows are split in two (`split_validation`), one half for the meta loss and
the other for the selection, so that the rows the meta-parameters fit never choose them. Either
way, the final models are the cells run with the selected Theta on each client's training split,
scored on the clients' test splits. There is no global column: the cells' w(L) is a by-product
of the unrolled ADMM that nothing in the meta loss looks at (it scored 11-131 where global least
squares scores 0.2-6.7 on the polynomial data), not a model the method would give a new client.
"""

from __future__ import annotations

import copy
from dataclasses import replace

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


def meta_loss(problem: Problem, v: torch.Tensor, kind: str) -> torch.Tensor:
    """`clients`: the sum of the clients' mean losses (each client counts once; the paper's
    text). `pooled`: every row counts once (the authors' code, a mean over the pooled rows),
    times M, so that both are equal when clients are of equal size: the options differ by the
    weighting alone, not by the scale that Adam and the gradient clip see."""
    per_client = problem.per_client_loss(v)
    if kind == "clients":
        return per_client.sum()
    counts = problem.mask.sum(1)
    return problem.n_clients * (counts * per_client).sum() / counts.sum()


def make_optimizer(cells: Cells, cfg: MetaOptimizer) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(cells.parameters(), lr=cfg.lr)
    # fused: ATen's Adam kernel takes the root; the unfused one's is MKL's (`numerics.sqrt`)
    return torch.optim.Adam(cells.parameters(), lr=cfg.lr, fused=True)


HELD_OUT_HALF = "the held-out half of each client's validation rows"  # what `val` supervision selects on


def split_validation(problem: Problem) -> tuple[Problem, Problem, list[int]]:
    """Each client's validation rows in two by alternate position: (the rows the meta loss is
    taken on, the rows the meta-epoch is selected on, the clients with a single row, which
    lends it to both: the guard does not hold for them)."""
    position = torch.arange(problem.mask.shape[1])
    fit, select = (problem.mask * (position % 2 == parity) for parity in (0, 1))
    single = select.sum(1) == 0
    select = torch.where(single[:, None], problem.mask, select)
    return replace(problem, mask=fit), replace(problem, mask=select), torch.nonzero(single).flatten().tolist()


def client_metrics(problem: Problem, v: torch.Tensor, by_row: bool = False) -> dict[str, torch.Tensor]:
    """Each client's model v_i scored on its rows of `problem`, in the engine's format (with
    `by_row`, each row's too: `engine.evaluate.evaluate_clients`'s `rows`)."""
    with torch.no_grad():
        metrics = {"n": problem.mask.sum(1).float()}
        loss = problem.per_client_loss(v).float()
        if problem.n_classes:
            metrics.update(loss=loss, acc=problem.accuracy(v).float())
        else:
            metrics.update(mse=loss, mse_sq=problem.per_client_loss_square(v).float())
        if by_row:
            metrics["rows"] = problem.per_row(v).float()
    return metrics


def meta_step(cells: Cells, opt: torch.optim.Optimizer, cfg: Learn2pFedConfig, epoch: int,
              fit: Problem, supervise: Problem, w0: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """One full-batch outer step on the `meta_loss` of v_i(L) over the `supervise` rows; returns
    that loss, the clients' summed mean loss over the `fit` rows, and the v_i(L) of Theta before
    the step."""
    meta = cfg.meta
    lr = meta.decay_lr if meta.decay_epoch is not None and epoch >= meta.decay_epoch else meta.lr
    for group in opt.param_groups:
        group["lr"] = lr
    trace = unroll(cells, fit, w0, cfg.v_steps, cfg.v_lr)
    loss = meta_loss(supervise, trace.v, cfg.meta_loss)
    opt.zero_grad()
    loss.backward()
    if meta.clip is not None:
        torch.nn.utils.clip_grad_norm_(cells.parameters(), meta.clip)
    opt.step()
    v = trace.v.detach()
    return loss.item(), fit.per_client_loss(v).sum().item(), v


def theta(cells: Cells) -> dict[str, torch.Tensor]:
    """A copy of Theta as it is now (a `meta_step` changes it in place)."""
    return {name: value.detach().clone() for name, value in cells.state_dict().items()}


def personalized_models(cells: Cells, train: Problem, w0: torch.Tensor, cfg: Learn2pFedConfig) -> torch.Tensor:
    """v_i(L): the cells run with their Theta on each client's training rows."""
    frozen = copy.deepcopy(cells).requires_grad_(False)
    return unroll(frozen, train, w0, cfg.v_steps, cfg.v_lr, create_graph=False).v.detach()


def evaluate(cells: Cells, train: Problem, test: Problem, w0: torch.Tensor,
             cfg: Learn2pFedConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Per-client metrics on `test`'s rows, in the engine's format, of the personalized v_i(L)."""
    return {"personalized": client_metrics(test, personalized_models(cells, train, w0, cfg))}


def costs(fit: Problem, supervise: Problem, cfg: Learn2pFedConfig) -> dict[str, float]:
    """The run's totals in the engine's units (`compute/grad_samples`: samples x passes; bytes of
    all clients together), counted from the cells' float64 vectors. Per cell each client uploads
    v - z - alpha and downloads w (d each); a meta step runs every cell forward and backward (the
    backward sends the gradients of the same vectors the other way) and each client uploads its
    scalar loss; the final evaluation runs the cells forward once. A classification cell reads the
    client's fit rows once per v-step (a regression unroll once, for its Gram), the meta backward
    reads them again, and the meta loss reads the supervised rows."""
    m, d, size = fit.n_clients, fit.dim, fit.x.element_size()
    per_cell = m * d * size
    fit_reads = (cfg.cells * cfg.v_steps if fit.n_classes else 1) * fit.mask.sum().item()
    epochs = cfg.meta.epochs
    return {
        "compute/grad_samples": epochs * (2 * fit_reads + supervise.mask.sum().item()),
        "compute/eval_grad_samples": fit_reads,
        "comm/bytes_up": epochs * (2 * cfg.cells * per_cell + m * size) + cfg.cells * per_cell,
        "comm/bytes_down": (2 * epochs + 1) * cfg.cells * per_cell,
    }


def participation(cells: Cells) -> torch.Tensor:
    """Learned lambda_ij [layers, M, d] (a full Lambda_i's diagonal): large lambda_ij ties
    parameter j of client i to w."""
    lam = per_layer(cells, "lam")
    return lam if cells.form == "diagonal" else lam.diagonal(dim1=-2, dim2=-1)


def per_layer(cells: Cells, key: str) -> torch.Tensor:
    """Theta's `key` in each of its layers (one when tied), detached: [layers, M, ...]."""
    return torch.stack([cells.values(c)[key] for c in range(len(cells.raw[key]))]).detach()


def parameter_groups(problem: Problem) -> dict[str, torch.Tensor]:
    """Name -> the positions in v_i of a group of parameters: each coefficient of a regression
    model, the weights and the biases of a classification head [classes, features + 1]."""
    if problem.n_classes == 0:
        return {f"coef {j}": torch.tensor([j]) for j in range(problem.dim)}
    position = torch.arange(problem.dim).view(problem.n_classes, -1)
    return {"weights": position[:, :-1].flatten(), "bias": position[:, -1]}


def participation_table(initial: Cells, learned: Cells, problem: Problem) -> list[dict]:
    """What the meta-training made of each client's participation: per cell layer, client and
    parameter group, Lambda's diagonal (its geometric mean over the group) and rho, initial and
    learned."""
    groups = parameter_groups(problem)
    lam = {"initial": participation(initial), "learned": participation(learned)}
    rho = {"initial": per_layer(initial, "rho"), "learned": per_layer(learned, "rho")}
    return [{"cell": c, "client_id": i, "group": group,
             **{f"lam_{name}": value[c, i, index].log().mean().exp().item() for name, value in lam.items()},
             **{f"rho_{name}": value[c, i].item() for name, value in rho.items()}}
            for c in range(lam["learned"].shape[0]) for i in range(problem.n_clients) for group, index in groups.items()]
