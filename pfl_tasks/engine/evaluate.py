"""Evaluation of every client on its own test split, vectorized over clients, and the
fairness aggregates over clients (mean, sample-weighted mean, std, worst-10% mean, min/max)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, vmap

from pfl_tasks.data import ClientSplit
from pfl_tasks.engine.executor import per_sample_loss, take
from pfl_tasks.engine.state import Tree, to_device, to_host

SAMPLE_BLOCK = 512  # test rows per client per forward pass: bounds memory for big clients


@torch.no_grad()
def evaluate_clients(
    net: nn.Module, task: str, test: ClientSplit, client_ids: torch.Tensor, params: Tree,
    stacked: bool, forward: Callable[[nn.Module, Tree, torch.Tensor], torch.Tensor] | None = None,
    variants: int = 0, by_row: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-client test metrics for `client_ids`, as tensors [K]: n, and loss and accuracy
    (classification) or mse and mse_sq, the mean of the rows' squared errors squared, whose
    spread about mse is the rows' (regression; `NOISE_ONLY`). `params` is a stack [K, ...] or
    one shared model; `forward(net, params, x)` gives one client's outputs (default: the net itself). `test`
    holds its samples on the device, its offsets and counts (and `client_ids`) on the host.
    With `variants` V, `forward` gives V outputs of each row, [V, rows, ...] (V candidates of a
    client's model scored in one pass), and loss, accuracy or mse are [V, K]. With `by_row` (no
    variants), also `rows`: each row's own primary metric (a hit, 1 or 0; a squared error), the
    clients' rows one client after another (what `selection.paired_se` pairs evaluations on)."""
    device = test.x.device
    client_ids = client_ids.cpu()
    k, host_counts = len(client_ids), test.counts[client_ids]
    offsets, counts = to_device({"o": test.offsets[client_ids], "n": host_counts}, device).values()
    loss_sum = torch.zeros(max(variants, 1), k, device=device)
    square_sum = torch.zeros(max(variants, 1), k, device=device)
    correct = torch.zeros(max(variants, 1), k, device=device)
    per_row = torch.zeros(int(host_counts.sum()) if by_row else 0, device=device)

    def client_outputs(p, x):
        return forward(net, p, x) if forward else functional_call(net, p, (x,))

    def add(owner: torch.Tensor, outs: list[torch.Tensor], y: torch.Tensor, at: torch.Tensor,
            valid: torch.Tensor | None = None) -> None:
        for out, loss_of, square_of, correct_of in zip(outs, loss_sum, square_sum, correct):  # a variant's rows at a time
            losses = per_sample_loss(task, out, y)
            hits = out.argmax(-1) == y if task == "classification" else None
            if valid is not None:  # padding's infinite loss would be NaN times 0
                losses, hits = torch.where(valid, losses, 0), None if hits is None else hits & valid
            loss_of.index_add_(0, owner, losses)
            if hits is not None:
                correct_of.index_add_(0, owner, hits.to(correct.dtype))
            else:
                square_of.index_add_(0, owner, losses * losses)
            if by_row:
                kept = slice(None) if valid is None else valid
                per_row[at[kept]] = (losses if hits is None else hits.to(per_row.dtype))[kept]

    if not stacked:  # one model: every client's rows, unpadded, SAMPLE_BLOCK x K at a time
        owner = torch.repeat_interleave(torch.arange(k), host_counts)
        first = torch.cumsum(host_counts, 0) - host_counts
        up = to_device({"rows": test.offsets[client_ids][owner] + torch.arange(len(owner)) - first[owner],
                        "owner": owner}, device)
        for block in torch.arange(len(owner), device=device).split(SAMPLE_BLOCK * k):
            rows = up["rows"][block]
            out = client_outputs(params, take(test.x, rows))
            add(up["owner"][block], list(out) if variants else [out], take(test.y, rows), block)
    else:  # a model per client: their rows padded to the longest, SAMPLE_BLOCK at a time
        batched, owner = vmap(client_outputs), torch.arange(k, device=device)[:, None]
        first = (torch.cumsum(counts, 0) - counts)[:, None]
        longest = int(host_counts.max())
        for start in range(0, longest, SAMPLE_BLOCK):
            width = min(SAMPLE_BLOCK, longest - start)
            pos = torch.arange(start, start + width, device=device)[None, :]
            valid = pos < counts[:, None]
            rows = torch.where(valid, offsets[:, None] + pos, offsets[:, None])
            out = batched(params, take(test.x, rows))
            outs = [out[:, v].flatten(0, 1) for v in range(variants)] if variants else [out.flatten(0, 1)]
            add(owner.expand(k, width).flatten(), outs, take(test.y, rows).flatten(), (first + pos).flatten(),
                valid.flatten())
    n = counts.to(loss_sum.dtype)
    if not variants:
        loss_sum, square_sum, correct = loss_sum[0], square_sum[0], correct[0]
    out = {"n": n, "loss": loss_sum / n, "acc": correct / n} if task == "classification" else \
        {"n": n, "mse": loss_sum / n, "mse_sq": square_sum / n}
    return to_host({**out, **({"rows": per_row} if by_row else {})})


HIGHER_IS_BETTER = {"acc": True, "loss": False, "mse": False}
# per-client values that only say how noisy another metric is (`pfl_tasks.selection`): summarized
# and tabled nowhere
NOISE_ONLY = ("mse_sq",)


def summarize(values: torch.Tensor, weights: torch.Tensor, higher_is_better: bool) -> dict[str, float]:
    """Aggregates over clients; `worst10` is the mean of the worst ceil(10%) clients."""
    values, weights = values.double(), weights.double()
    k = max(1, math.ceil(0.1 * len(values)))
    ordered = torch.sort(values, descending=not higher_is_better).values
    return {
        "mean": values.mean().item(),
        "weighted": (values * weights).sum().item() / weights.sum().item(),
        "std": values.std(unbiased=False).item(),
        "worst10": ordered[:k].mean().item(),
        "min": values.min().item(),
        "max": values.max().item(),
    }
