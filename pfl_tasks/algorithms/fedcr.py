"""FedCR: a shared stochastic representation aligned across clients, personal heads.

Zhang et al., "FedCR: Personalized Federated Learning Based on Across-Client Common
Representation with Conditional Mutual Information Regularization", ICML 2023 (seed eqs.
(20)-(23) and pseudocode). The body (all layers but the last) gives features h(x); as in the
authors' code (a variational information bottleneck), one shared linear encoder maps h to
[mu, s], and sigma = softplus(s - 5) [choice: the shift of the original VIB code (Alemi et al.);
the authors' default shift is 0, noise of 0.7 per dimension at the start that drowns the small
features of our nets]. The personal head reads z = mu + sigma * eps; as in the authors' code the
training cross-entropy is averaged over `samples` draws of eps, and prediction reads the head at
mu (the authors average the logits of sampled z, whose expectation for a linear head is exactly
that). Local loss: that cross-entropy + beta * KL[N(mu^y, S^y) || N(mu(x), sigma^2(x))] against
the server's class-wise posterior. During local training each client accumulates its per-class
local PoE (precision = mean of the samples' precisions, mean = precision-weighted mean) and
sends it with its body and encoder; the server multiplies experts with the N(0, I) prior (eq.
(22)), classes no active client has keep last round's statistics, and bodies and encoders are
averaged uniformly. The encoder is initialized like `nn.Linear`, seeded by the run. beta = 0
with deterministic features (z = mu) is FedPer with the encoder in the shared body. As the authors, the
gradient's norm is clipped at 10 (`clip_norm`): without it a large shared lr diverges (MNIST at
lr 0.4). [choice] 4 samples (the authors: 15-18); the PoE is
taken over the samples of this round's local steps; beta = 1e-5 (the paper tunes beta per
dataset): with the small sigma the KL term is of order sum_h (S^y + (mu^y - mu)^2) / (2 sigma^2),
1e5-1e6 against the prior, so on 2-class digits clients beta = 1e-3 collapsed training to chance
and 1e-4 cost 0.03 of validation accuracy. Local steps go through the local optimizer (momentum,
weight decay or Adam apply when configured).
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import functional_call
from torch.linalg import vector_norm

from pfl_tasks.algorithms.base import Algorithm, HyperParams, SharedBody
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine import optim
from pfl_tasks.engine.executor import clientwise
from pfl_tasks.engine.state import per_row
from pfl_tasks.engine.streams import StreamKey, run_seed
from pfl_tasks.nets import head_keys, stacked_backward, stacked_forward
from pfl_tasks.numerics import sqrt

NOISE = StreamKey("fedcr/noise", 7)  # per client and round: the reparameterization noise
ENCODER = StreamKey("fedcr/encoder", 0xFEDC)  # per run: the encoder's initialization

ENCODER_KEYS = ("encoder.weight", "encoder.bias")
SIGMA_SHIFT = 5.0  # sigma = softplus(s - 5): the VIB code's small initial noise (module doc)


class FedCRHyper(HyperParams):
    beta: Annotated[float, Field(ge=0)] = 1e-5
    stochastic: bool = True
    samples: Annotated[int, Field(gt=0)] = 4
    clip_norm: Annotated[float, Field(gt=0)] | None = 10.0  # the authors' gradient clipping (None: off)


def gaussian_kl(mu1, var1, mu2, var2):
    """KL[N(mu1, diag var1) || N(mu2, diag var2)], summed over the last axis."""
    return 0.5 * (torch.log(var2 / var1) + (var1 + (mu1 - mu2) ** 2) / var2 - 1).sum(-1)


def product_of_experts(precisions, precision_means, present):
    """Posterior of the N(0, I) prior times the present experts (eq. (22)): [C, H] each."""
    weight = present.unsqueeze(-1).to(precisions.dtype)
    precision = 1 + (weight * precisions).sum(0)
    return (weight * precision_means).sum(0) / precision, 1 / precision


def encoder_init(width: int, seed: int) -> dict[str, torch.Tensor]:
    """`nn.Linear(width, 2 width)`'s default initialization, from a stream of the run's seed of
    its own (the net's layers draw from the seed itself)."""
    gen = torch.Generator().manual_seed(run_seed(seed, ENCODER))
    bound = 1 / math.sqrt(width)
    return {"encoder.weight": (torch.rand(2 * width, width, generator=gen) * 2 - 1) * bound,
            "encoder.bias": (torch.rand(2 * width, generator=gen) * 2 - 1) * bound}


def head_names(params) -> set[str]:
    """The personal head's parameter names (the net's last layer; the encoder is not in the net)."""
    return head_keys([k for k in params if k not in ENCODER_KEYS])


def read_head(params, names: set[str], z: torch.Tensor) -> torch.Tensor:
    """The head's logits for representations z."""
    head = next(iter(names)).split(".")[0]
    return F.linear(z, params[f"{head}.weight"], params.get(f"{head}.bias"))


@register
class FedCR(SharedBody, Algorithm):
    name = "fedcr"
    streams = (NOISE, ENCODER)
    citation = "Zhang et al., ICML 2023"
    Hyper = FedCRHyper
    head_of = staticmethod(head_names)

    def init_server(self, params, facts):
        body, head = self.split(params)
        n_classes, width = next(v for k, v in head.items() if k.endswith("weight")).shape
        body.update(encoder_init(width, facts.seed))
        return {"body": body, "class_mean": torch.zeros(n_classes, width), "class_var": torch.ones(n_classes, width)}

    def payload(self, server):
        return server

    @staticmethod
    def features(net, params, x, names):
        """(mu, sigma^2) of the representation of inputs x."""
        body = {k: v for k, v in params.items() if k not in ENCODER_KEYS and k not in names}
        s = F.linear(functional_call(net[:-1], body, (x,)), params["encoder.weight"], params["encoder.bias"])
        mu, raw = s.chunk(2, dim=-1)
        return mu, F.softplus(raw - SIGMA_SHIFT) ** 2 + 1e-8

    def forward(self, net, params, x):
        names = head_names(params)
        return read_head(params, names, self.features(net, params, x, names)[0])

    forward_global = forward

    def client_update(self, trainer, payload, state):
        hp, cfg, k = self.hp, trainer.local.optimizer, trainer.n_clients
        net = trainer.net
        names = set(state["head"])
        n_classes, width = payload["class_mean"].shape
        device = payload["class_mean"].device
        samples = hp.samples if hp.stochastic else 1

        def noise(steps, batch):
            return {"eps": torch.stack([torch.randn(steps, batch, samples, width, generator=generator)
                                        for generator in trainer.rng(NOISE).client_generators()]).to(device)}

        def objective(params, batch_):
            mu, var = self.features(net, params, batch_.x, names)
            eps = batch_.extra["eps"] if hp.stochastic else torch.zeros_like(batch_.extra["eps"])
            z = mu.unsqueeze(1) + sqrt(var).unsqueeze(1) * eps  # [B, samples, H]
            logits = read_head(params, names, z)
            log_p = F.log_softmax(logits, -1)  # [B, samples, C]
            loss = -log_p.gather(-1, batch_.y[:, None, None].expand(-1, samples, 1)).squeeze(-1).mean(1)
            kl = gaussian_kl(payload["class_mean"][batch_.y], payload["class_var"][batch_.y], mu, var)
            return ((loss + hp.beta * kl) * batch_.weight).sum(), (mu, var)

        @clientwise  # on a stack: the gradient by hand, norms and class sums per client row
        def step(carry, data_loss, aux, batch_):
            if carry["params"]["encoder.weight"].dim() == 3:
                g, (mu, var) = self.stack_gradient(net, carry["params"], names, batch_, payload)
            else:
                g, (mu, var) = batch_.grad(objective, has_aux=True)(carry["params"], batch_)
            if hp.clip_norm is not None:  # as torch.nn.utils.clip_grad_norm_, on the client's whole gradient
                clients = batch_.weight.sum(-1)  # [K] on a stack, a scalar for one client
                norm = sqrt(sum(vector_norm(t.reshape(*clients.shape, -1), dim=-1) ** 2 for t in g.values()))
                clip = torch.clamp(hp.clip_norm / (norm + 1e-6), max=1.0)
                g = {n: t.mul_(per_row(clip, t)) for n, t in g.items()}  # fresh gradients
            params, opt = optim.apply(cfg, carry["params"], g, carry["opt"])
            onehot = F.one_hot(batch_.y, n_classes).to(mu.dtype) * (batch_.weight > 0).unsqueeze(-1).to(mu.dtype)
            precision = (1 / var).detach()
            return {
                "params": params, "opt": opt,
                "precision": carry["precision"] + onehot.transpose(-2, -1) @ precision,
                "precision_mean": carry["precision_mean"] + onehot.transpose(-2, -1) @ (precision * mu.detach()),
                "count": carry["count"] + onehot.sum(-2),
            }

        zeros = torch.zeros(k, n_classes, width, device=device)
        params = self.joined(payload["body"], state)
        start = {
            "params": params, "opt": optim.start(cfg, params),
            "precision": zeros, "precision_mean": zeros.clone(), "count": torch.zeros(k, n_classes, device=device),
        }
        out = trainer.scan(start, step, per_step=noise)
        count = out["count"].clamp_min(1).unsqueeze(-1)
        body, state = self.parted(out["params"], state)
        message = {
            "body": body,
            "precision": out["precision"] / count,  # local PoE precision per class
            "precision_mean": out["precision_mean"] / count,
            "present": (out["count"] > 0).to(torch.float32),
        }
        return message, state

    def stack_gradient(self, net, params, names, batch, payload):
        """`objective`'s gradient for every client of a stackable net's stack [K, ...] at once,
        backpropagated by hand (the body by `stacked_backward`), with (mu, sigma^2): autograd's
        numbers without its graph, and each gradient in its parameter's layout."""
        hp, y = self.hp, batch.y
        batch.record_pass()
        body = {k: v for k, v in params.items() if k not in ENCODER_KEYS and k not in names}
        saved = []
        h = stacked_forward(net, body, batch.x, stop=len(net) - 1, saved=saved)  # [K, B, H]
        s = torch.baddbmm(params["encoder.bias"].unsqueeze(1), h, params["encoder.weight"].transpose(1, 2))
        mu, raw = s.chunk(2, dim=-1)
        soft = F.softplus(raw - SIGMA_SHIFT)
        var = soft**2 + 1e-8
        sigma = sqrt(var)
        eps = batch.extra["eps"] if hp.stochastic else torch.zeros_like(batch.extra["eps"])
        z = (mu.unsqueeze(-2) + sigma.unsqueeze(-2) * eps).flatten(1, 2)  # [K, B * samples, H]
        head = next(iter(names)).split(".")[0]
        weight, bias = params[f"{head}.weight"], params.get(f"{head}.bias")
        logits = torch.bmm(z, weight.transpose(1, 2)) if bias is None else \
            torch.baddbmm(bias.unsqueeze(1), z, weight.transpose(1, 2))
        samples = eps.shape[-2]
        # cross-entropy: d/dlogits = (softmax - onehot) x the row's weight / samples
        d_logits = torch.softmax(logits, -1)
        d_logits.scatter_add_(-1, y.repeat_interleave(samples, 1).unsqueeze(-1), d_logits.new_full((1, 1, 1), -1.0)
                              .expand(*d_logits.shape[:2], 1))
        d_logits.mul_((batch.weight / samples).repeat_interleave(samples, 1).unsqueeze(-1))
        grads = {f"{head}.weight": torch.bmm(d_logits.transpose(1, 2), z)}
        if bias is not None:
            grads[f"{head}.bias"] = d_logits.sum(1)
        d_z = torch.bmm(d_logits, weight).view(*eps.shape)  # [K, B, samples, H]
        # the KL term against the class posterior N(m, v): d/dmu = (mu - m) / sigma^2,
        # d/dsigma^2 = (1 / sigma^2 - (v + (m - mu)^2) / sigma^4) / 2; sigma = sqrt(sigma^2)
        m, v, pull = payload["class_mean"][y], payload["class_var"][y], hp.beta * batch.weight.unsqueeze(-1)
        d_mu = d_z.sum(-2) + pull * (mu - m) / var
        d_var = (d_z * eps).sum(-2) / (2 * sigma) + pull * 0.5 * (1 / var - (v + (m - mu) ** 2) / var**2)
        d_s = torch.cat([d_mu, d_var * 2 * soft * torch.sigmoid(raw - SIGMA_SHIFT)], -1)
        grads["encoder.weight"] = torch.bmm(d_s.transpose(1, 2), h)
        grads["encoder.bias"] = d_s.sum(1)
        body_grads = {k: torch.empty_like(t, memory_format=torch.contiguous_format) for k, t in body.items()}
        stacked_backward(net, body, saved, torch.bmm(d_s, params["encoder.weight"]), body_grads)
        grads.update(body_grads)
        return {k: grads[k] for k in params}, (mu, var)

    def aggregate(self, server, messages, weights, ids):
        mean, var = product_of_experts(messages["precision"], messages["precision_mean"], messages["present"])
        seen = messages["present"].sum(0) > 0
        return {
            "body": {k: v.mean(0) for k, v in messages["body"].items()},
            "class_mean": torch.where(seen.unsqueeze(-1), mean, server["class_mean"]),
            "class_var": torch.where(seen.unsqueeze(-1), var, server["class_var"]),
        }
