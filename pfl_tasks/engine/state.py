"""Client state as stacked tensors: a `Stack` is `{name: Tensor[K, ...]}`; a `Tree` nests such
dicts (e.g. `{"params": Stack, "grad_state": Stack}`)."""

from __future__ import annotations

from typing import Callable

import torch

Params = dict[str, torch.Tensor]
Stack = dict[str, torch.Tensor]
Tree = dict  # nested dict whose leaves are tensors


def tree_map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Tree) -> Tree:
    return {k: tree_map(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def tree_zip(fn: Callable[..., torch.Tensor], *trees: Tree) -> Tree:
    first = trees[0]
    return {
        k: tree_zip(fn, *(t[k] for t in trees)) if isinstance(v, dict) else fn(*(t[k] for t in trees))
        for k, v in first.items()
    }


def broadcast(params: Tree, k: int) -> Tree:
    """The same tensors for k clients, as an expanded (copy-free) stack."""
    return tree_map(lambda t: t.unsqueeze(0).expand(k, *t.shape), params)


def replicate(params: Tree, k: int) -> Tree:
    """k independent copies (real memory), for state clients will own and change."""
    return tree_map(lambda t: t.unsqueeze(0).repeat(k, *([1] * t.dim())).contiguous(), params)


def gather(stack: Tree, index: torch.Tensor) -> Tree:
    """Rows `index` of every stack; rows of a pinned stack into pinned memory (a GPU copies
    them without blocking or another host copy)."""

    def take(t: torch.Tensor) -> torch.Tensor:
        rows = index.to(t.device)
        if not t.is_pinned():
            return t[rows]
        out = torch.empty((len(rows), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        return torch.index_select(t, 0, rows, out=out)

    return tree_map(take, stack)


def scatter_(stack: Tree, index: torch.Tensor, values: Tree) -> Tree:
    """Rows `index` of `stack` replaced by `values`, in place: a round costs its sampled rows,
    not a copy of every client's state."""

    def put(t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t[index.to(t.device)] = v.to(t.device, t.dtype)
        return t

    return tree_zip(put, stack, values)


def concat(stacks: list[Tree]) -> Tree:
    return tree_zip(lambda *ts: torch.cat(ts), *stacks)


def weighted_mean(stack: Tree, weights: torch.Tensor) -> Tree:
    """Sum_k w_k x_k / Sum_k w_k over the leading client axis."""
    w = weights / weights.sum()

    def mean(t: torch.Tensor) -> torch.Tensor:
        return torch.tensordot(w.to(t.device, t.dtype), t, dims=1)

    return tree_map(mean, stack)


def to_device(tree: Tree, device: torch.device | str) -> Tree:
    """`tree` on `device`; from the host to a GPU through pinned memory, without blocking."""
    device = torch.device(device)
    if device.type != "cuda":
        return tree_map(lambda t: t.to(device), tree)

    def upload(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    return tree_map(upload, tree)


def to_host(tree: Tree) -> Tree:
    """`tree` on the CPU; from a GPU into pinned memory (what the next upload copies from
    without blocking), with one wait for all the copies."""
    if not any(t.is_cuda for _, t in leaves(tree)):
        return tree
    out = tree_map(lambda t: t.to("cpu", non_blocking=True), tree)
    torch.cuda.current_stream().synchronize()
    return out


def per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-client values [K] shaped to broadcast against a stack `like` [K, ...]."""
    return values.reshape(-1, *([1] * (like.dim() - 1)))


def interpolate(a: torch.Tensor, v: Params, theta: Params) -> Params:
    """a v + (1 - a) theta, a per client (a stack's [K], or one client's)."""
    return {k: torch.lerp(theta[k], t, per_row(a, t)) for k, t in v.items()}


def row_sums(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`t` summed within each client's row, shaped as the per-client `values`: [K] for a stack,
    a scalar for one client (a step written for either: `clientwise`)."""
    return t.reshape(*values.shape, -1).sum(-1)


def leaves(tree: Tree, prefix: str = ""):
    """(dotted name, tensor) of every leaf."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def tree_bytes(tree: Tree) -> int:
    return sum(
        tree_bytes(v) if isinstance(v, dict) else v.numel() * v.element_size() for v in tree.values()
    )
