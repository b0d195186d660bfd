"""Nets, written so `torch.func.vmap` works over them: no BatchNorm running stats, no fused
cuDNN RNNs, no in-place ops on captured tensors. The engine only uses them through
`functional_call`."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.func import functional_call

from pfl_tasks.config import CNNNet, LinearNet, LSTMNet, MLPNet


def build_net(cfg, feature_shape: tuple[int, ...], n_outputs: int) -> nn.Module:
    n_in = math.prod(feature_shape)
    if isinstance(cfg, LinearNet):
        return nn.Sequential(nn.Flatten(), nn.Linear(n_in, n_outputs, bias=cfg.bias))
    if isinstance(cfg, MLPNet):
        layers: list[nn.Module] = [nn.Flatten()]
        for width in cfg.hidden:
            layers += [nn.Linear(n_in, width), nn.ReLU()]
            n_in = width
        return nn.Sequential(*layers, nn.Linear(n_in, n_outputs))
    if isinstance(cfg, CNNNet):
        return _cnn(cfg, feature_shape, n_outputs)
    if isinstance(cfg, LSTMNet):
        return _lstm(cfg, feature_shape, n_outputs)
    raise TypeError(f"unknown net config {cfg!r}")


def _cnn(cfg: CNNNet, feature_shape: tuple[int, ...], n_outputs: int) -> nn.Module:
    if len(feature_shape) != 3:
        raise ValueError(f"cnn needs image features [C, H, W], got shape {list(feature_shape)}")
    channels, side = feature_shape[0], min(feature_shape[1:])
    layers: list[nn.Module] = []
    for width in cfg.channels:
        layers += [nn.Conv2d(channels, width, cfg.kernel, padding=cfg.padding), nn.ReLU()]
        side += 2 * cfg.padding - cfg.kernel + 1
        if side >= 4:  # pool while the map is large enough: 8x8 -> 2x2, 28x28 -> 7x7 (or 4x4 unpadded 5x5)
            layers.append(nn.MaxPool2d(2))
            side //= 2
        channels = width
    body = nn.Sequential(*layers, nn.Flatten())
    with torch.no_grad():
        n_flat = body(torch.zeros(1, *feature_shape)).shape[1]
    return nn.Sequential(
        *body, nn.Linear(n_flat, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, n_outputs)
    )


def _lstm(cfg: LSTMNet, feature_shape: tuple[int, ...], n_outputs: int) -> nn.Module:
    if len(feature_shape) != 1:
        raise ValueError(
            f"lstm needs a lag window [window] as features, got shape {list(feature_shape)}"
        )
    return nn.Sequential(
        nn.Unflatten(1, (feature_shape[0], 1)),  # [B, window] -> [B, window, 1]: a scalar per step
        UnrolledLSTM(1, cfg.hidden, cfg.layers),
        nn.Linear(cfg.hidden, n_outputs),
    )


class UnrolledLSTM(nn.Module):
    """nn.LSTM (batch_first) with its equations, parameter names, shapes and init, unrolled
    over time in plain tensor ops so `torch.func.vmap` works over it (the fused kernel does
    not). Maps [B, T, n_in] to the last layer's hidden state at the last step, [B, hidden]."""

    GATE_PARAMS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")

    def __init__(self, n_in: int, hidden: int, layers: int):
        super().__init__()
        self.hidden, self.layers = hidden, layers
        for k in range(layers):
            width = n_in if k == 0 else hidden
            shapes = ((4 * hidden, width), (4 * hidden, hidden), (4 * hidden,), (4 * hidden,))
            for name, shape in zip(self.GATE_PARAMS, shapes):
                self.register_parameter(f"{name}_l{k}", nn.Parameter(torch.empty(shape)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.hidden)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in range(self.layers):
            w_ih, w_hh, b_ih, b_hh = (getattr(self, f"{name}_l{k}") for name in self.GATE_PARAMS)
            x_gates = nn.functional.linear(x, w_ih, b_ih)  # every step's input term at once
            h = c = x.new_zeros(x.shape[0], self.hidden)
            steps = []
            for t in range(x.shape[1]):  # gates in nn.LSTM's order: input, forget, cell, output
                i, f, g, o = (x_gates[:, t] + nn.functional.linear(h, w_hh, b_hh)).chunk(4, -1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                steps.append(h)
            x = torch.stack(steps, dim=1)
        return h


STACKABLE = (nn.Flatten, nn.Linear, nn.ReLU)


def stackable(net: nn.Module) -> bool:
    """Whether `stacked_forward` computes this net: a Sequential of Flatten, Linear and ReLU
    (the linear and MLP nets)."""
    return isinstance(net, nn.Sequential) and all(isinstance(m, STACKABLE) for m in net)


def stacked_forward(net: nn.Sequential, params: dict[str, torch.Tensor], x: torch.Tensor,
                    start: int = 0, stop: int | None = None, saved: list | None = None,
                    outputs: dict | None = None) -> torch.Tensor:
    """A stackable net's outputs for K clients at once, each with its own parameters:
    `params` [K, ...] and `x` [K, B, ...] give [K, B, outputs], by batched matmuls (ordinary
    autograd then gives each client's gradient in its own slice, without vmap). With `start`
    and `stop`, only the modules net[start:stop]. `saved`, if given, receives what
    `stacked_backward` needs: each module's index with its input (Linear, Flatten) or output (ReLU);
    `outputs` each Linear's output by its index."""
    return _forward(net, x, lambda i, h: _linear(params, i, h), start, stop, saved, outputs)


def first_linear(net: nn.Sequential) -> int:
    """The index of a stackable net's first Linear: the one whose input is the data."""
    return next(i for i, module in enumerate(net) if isinstance(module, nn.Linear))


def interpolated_forward(net: nn.Sequential, a: torch.Tensor, v: dict[str, torch.Tensor],
                         theta: dict[str, torch.Tensor], x: torch.Tensor, saved: list,
                         gaps: dict[int, torch.Tensor], theta_first: torch.Tensor | None = None) -> torch.Tensor:
    """`stacked_forward` at the interpolation a v + (1 - a) theta (a [K], per client) without
    forming it: each Linear's output is a times v's output plus (1 - a) times theta's, two
    products that read the parameters as they are (forming the interpolation would read both
    stacks and write a third, every step). `saved` receives what `stacked_forward` saves, and
    `gaps` each Linear's v output minus theta's: the outputs' derivative in a. `theta_first`,
    if given, is theta's output of the first Linear on `x` (a forward pass of theta's own has
    it), not computed again."""
    first = first_linear(net)

    def linear(i: int, h: torch.Tensor) -> torch.Tensor:
        out_theta = theta_first if i == first and theta_first is not None else _linear(theta, i, h)
        gaps[i] = _linear(v, i, h).sub_(out_theta)
        return torch.addcmul(out_theta, gaps[i], a.view(-1, 1, 1))

    return _forward(net, x, linear, 0, None, saved)


def _linear(params: dict[str, torch.Tensor], i: int, h: torch.Tensor) -> torch.Tensor:
    weight, bias = params[f"{i}.weight"].transpose(1, 2), params.get(f"{i}.bias")
    return torch.bmm(h, weight) if bias is None else torch.baddbmm(bias.unsqueeze(1), h, weight)


def _forward(net: nn.Sequential, x: torch.Tensor, linear, start: int, stop: int | None,
             saved: list | None, outputs: dict | None = None) -> torch.Tensor:
    modules = list(net)  # indexing the Sequential itself builds a new one per slice
    for i in range(start, len(modules) if stop is None else stop):
        module = modules[i]
        if saved is not None:
            saved.append((i, x))
        if isinstance(module, nn.Flatten):
            x = x.flatten(2)
        elif isinstance(module, nn.Linear):
            x = linear(i, x)
            if outputs is not None:
                outputs[i] = x
        else:
            x = torch.relu(x)
            if saved is not None:
                saved[-1] = (i, x)
    return x


def _through(module: nn.Module, kept: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Backpropagation through a ReLU (`kept` its output) or a Flatten (`kept` its input)."""
    return d.mul_(kept > 0) if isinstance(module, nn.ReLU) else d.view(kept.shape)


def stacked_backward(net: nn.Sequential, params: dict[str, torch.Tensor], saved: list,
                     d_out: torch.Tensor, grads: dict[str, torch.Tensor], lr: float | None = None,
                     pull: tuple[dict[str, torch.Tensor], float] | None = None) -> None:
    """Backpropagation by hand through `stacked_forward(..., saved=saved)`: writes into `grads`
    (buffers [K, ...] in the parameters' layout, one per parameter wanted) each client's
    gradient of sum_b <d_out[k, b], outputs[k, b]>, and stops at the first module they need.
    Autograd's twin, minus its graph and its transposed weight gradients: each matmul writes
    where the optimizer reads. With `lr`, `grads` are those parameters themselves, each stepped
    in place by -lr times its gradient (plain SGD, the gradient never stored), every product
    with a parameter's old value taken before it moves; with `pull` (anchors, mu) too, each is
    first drawn toward its anchor by lr mu, the SGD step of a proximal term mu/2 ||w - anchor||^2.
    `d_out` is overwritten."""
    first = min(int(name.split(".", 1)[0]) for name in grads)
    d, modules = d_out, list(net)

    def stepped(name: str) -> torch.Tensor:  # the parameter, drawn toward its anchor first
        if pull is not None:
            grads[name].lerp_(pull[0][name], lr * pull[1])
        return grads[name]

    for i, kept in reversed(saved):
        module = modules[i]
        if not isinstance(module, nn.Linear):
            d = _through(module, kept, d)
        else:
            below = torch.bmm(d, params[f"{i}.weight"]) if i > first else None
            weight, bias = f"{i}.weight", f"{i}.bias"
            if weight in grads:
                if lr is None:
                    torch.bmm(d.transpose(1, 2), kept, out=grads[weight])
                else:
                    stepped(weight).baddbmm_(d.transpose(1, 2), kept, alpha=-lr)
            if bias in grads:
                if lr is None:
                    torch.sum(d, 1, out=grads[bias])
                else:
                    stepped(bias).add_(d.sum(1), alpha=-lr)
            d = below
        if i <= first:
            return


def interpolated_backward(net: nn.Sequential, a: torch.Tensor, v: dict[str, torch.Tensor],
                          theta: dict[str, torch.Tensor], saved: list, gaps: dict[int, torch.Tensor],
                          d_out: torch.Tensor, lr: float) -> torch.Tensor:
    """Backpropagation by hand through `interpolated_forward`, as `stacked_backward`'s SGD step
    for v alone: each client's v stepped in place by -lr times the gradient in v of
    sum_b <d_out[k, b], outputs[k, b]> (a times the gradient at the interpolation), every
    product with v taken before it moves; returns that sum's derivative in a, per client [K]
    (each Linear's <d, gap>: the inner product <v - theta, gradient at the interpolation>).
    `d_out` is overwritten."""
    modules, d, a_rows, first = list(net), d_out, a.view(-1, 1, 1), first_linear(net)
    slope = torch.zeros_like(a)
    for i, kept in reversed(saved):
        module = modules[i]
        if not isinstance(module, nn.Linear):
            d = _through(module, kept, d)
            continue
        slope += (d * gaps[i]).sum((1, 2))
        d_v = d * a_rows
        weight, bias = f"{i}.weight", f"{i}.bias"
        below = None
        if i > first:
            below = torch.baddbmm(torch.bmm(d_v, v[weight]), d.mul_(1 - a_rows), theta[weight])
        v[weight].baddbmm_(d_v.transpose(1, 2), kept, alpha=-lr)
        if bias in v:
            v[bias].add_(d_v.sum(1), alpha=-lr)
        d = below
        if i == first:
            break
    return slope


def frozen_prefix(params, trainable: set[str]) -> int:
    """The index of the first module with a trainable parameter when every parameter from it
    on is trainable and none before it (FedRep's head phase: the body frozen): the modules
    before it compute the same features all fit long. 0 otherwise."""
    index = {name: int(name.split(".", 1)[0]) for name in params}
    cut = min((index[name] for name in trainable), default=0)
    frozen = set(params) - set(trainable)
    return cut if frozen and all((index[name] >= cut) == (name in trainable) for name in params) else 0


def init_params(net: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fresh parameters for `net`, reproducible from `seed` alone."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for module in net.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    finally:
        torch.random.set_rng_state(gen_state)
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def split_net(net: nn.Sequential, params: dict[str, torch.Tensor]):
    """(body, body params, head, head params) of a net built here: the head is the last layer."""
    head = head_keys(params)
    cut = int(next(iter(head)).split(".", 1)[0])
    body_params = {k: v for k, v in params.items() if k not in head}
    return net[:cut], body_params, net[cut:], {k: v for k, v in params.items() if k in head}


def embed(body: nn.Module, body_params: dict[str, torch.Tensor], x: torch.Tensor, block: int = 4096):
    """The body's output for every row of `x`, `block` rows per forward pass."""
    return torch.cat([functional_call(body, body_params, (part,)) for part in x.split(block)])


def head_keys(param_names) -> set[str]:
    """Parameters of the last layer (the "head"; the rest is the "body"), for the
    `nn.Sequential` nets built here, whose parameter names start with the module index."""
    last = max(int(name.split(".", 1)[0]) for name in param_names)
    return {name for name in param_names if int(name.split(".", 1)[0]) == last}
