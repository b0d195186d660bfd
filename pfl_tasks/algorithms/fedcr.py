"""FedCR: a shared stochastic representation aligned across clients, personal heads.

Zhang et al., "FedCR: Personalized Federated Learning Based on Across-Client Common
Representation with Conditional Mutual Information Regularization", ICML 2023 (seed eqs.
(20)-(23) and pseudocode). The body (all layers but the last) gives mu(x); a shared extra
layer gives sigma^2(x) = softplus(W h + b); the personal head reads z = mu + sigma * eps
(`stochastic`) or z = mu. Local loss: cross-entropy + beta * KL[N(mu^y, S^y) || N(mu(x), sigma^2(x))]
against the server's class-wise posterior. During local training each client accumulates its
per-class local PoE (precision = mean of the samples' precisions, mean = precision-weighted mean)
and sends it with its body; the server multiplies experts with the N(0, I) prior (eq. (22)),
classes no active client has keep last round's statistics, and bodies are averaged uniformly.
beta = 0 with deterministic features is FedPer exactly. Evaluation uses z = mu.
[choice] beta = 1e-3 (the paper tunes beta per dataset); the PoE is taken over the samples of
this round's local steps.
"""

from __future__ import annotations

from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import functional_call, grad

from pfl_tasks.algorithms.base import Algorithm, HyperParams
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.executor import client_seed
from pfl_tasks.engine.state import broadcast, replicate
from pfl_tasks.nets import head_keys

VAR_KEYS = ("logvar.weight", "logvar.bias")


class FedCRHyper(HyperParams):
    beta: Annotated[float, Field(ge=0)] = 1e-3
    stochastic: bool = True


def gaussian_kl(mu1, var1, mu2, var2):
    """KL[N(mu1, diag var1) || N(mu2, diag var2)], summed over the last axis."""
    return 0.5 * (torch.log(var2 / var1) + (var1 + (mu1 - mu2) ** 2) / var2 - 1).sum(-1)


def product_of_experts(precisions, precision_means, present):
    """Posterior of the N(0, I) prior times the present experts (eq. (22)): [C, H] each."""
    weight = present.unsqueeze(-1).to(precisions.dtype)
    precision = 1 + (weight * precisions).sum(0)
    return (weight * precision_means).sum(0) / precision, 1 / precision


@register
class FedCR(Algorithm):
    name = "fedcr"
    citation = "Zhang et al., ICML 2023"
    Hyper = FedCRHyper

    def split(self, params):
        head = head_keys([k for k in params if k not in VAR_KEYS])
        return {k: v for k, v in params.items() if k not in head}, {k: params[k] for k in head}

    def init_server(self, params):
        body, head = self.split(params)
        n_classes, width = next(v for k, v in head.items() if k.endswith("weight")).shape
        body["logvar.weight"] = torch.zeros(width, width)
        body["logvar.bias"] = torch.zeros(width)
        return {"body": body, "class_mean": torch.zeros(n_classes, width), "class_var": torch.ones(n_classes, width)}

    def init_clients(self, params, n_clients):
        return {"head": replicate(self.split(params)[1], n_clients)}

    def payload(self, server):
        return server

    @staticmethod
    def features(net, params, x, head_names):
        """(mu, var) of the representation of inputs x."""
        body = {k: v for k, v in params.items() if k not in VAR_KEYS and k not in head_names}
        mu = functional_call(net[:-1], body, (x,))
        var = F.softplus(mu @ params["logvar.weight"].T + params["logvar.bias"]) + 1e-4
        return mu, var

    def client_update(self, trainer, payload, state):
        hp, lr, k = self.hp, trainer.local.optimizer.lr, len(trainer.client_ids)
        net = trainer.net
        head_names = set(state["head"])
        head = next(iter(head_names)).split(".")[0]
        n_classes, width = payload["class_mean"].shape
        device = payload["class_mean"].device

        def noise(steps, batch):
            return {"eps": torch.stack([
                torch.randn(steps, batch, width, generator=torch.Generator().manual_seed(
                    client_seed(trainer.seed, trainer.round_idx, int(c), 7)))
                for c in trainer.client_ids
            ]).to(device)}

        def objective(params, batch_):
            mu, var = self.features(net, params, batch_.x, head_names)
            z = mu + var.sqrt() * batch_.extra["eps"] if hp.stochastic else mu
            logits = F.linear(z, params[f"{head}.weight"], params.get(f"{head}.bias"))
            loss = F.cross_entropy(logits, batch_.y, reduction="none")
            kl = gaussian_kl(payload["class_mean"][batch_.y], payload["class_var"][batch_.y], mu, var)
            return ((loss + hp.beta * kl) * batch_.weight).sum(), (mu, var)

        def step(carry, data_loss, aux, batch_):
            batch_.record_pass()
            g, (mu, var) = grad(objective, has_aux=True)(carry["params"], batch_)
            onehot = F.one_hot(batch_.y, n_classes).to(mu.dtype) * (batch_.weight > 0).unsqueeze(-1).to(mu.dtype)
            precision = (1 / var).detach()
            return {
                "params": {n: p - lr * g[n] for n, p in carry["params"].items()},
                "precision": carry["precision"] + onehot.T @ precision,
                "precision_mean": carry["precision_mean"] + onehot.T @ (precision * mu.detach()),
                "count": carry["count"] + onehot.sum(0),
            }

        zeros = torch.zeros(k, n_classes, width, device=device)
        start = {
            "params": {**broadcast(payload["body"], k), **state["head"]},
            "precision": zeros, "precision_mean": zeros.clone(), "count": torch.zeros(k, n_classes, device=device),
        }
        out = trainer.scan(start, step, per_step=noise)
        count = out["count"].clamp_min(1).unsqueeze(-1)
        trained = out["params"]
        message = {
            "body": {n: v for n, v in trained.items() if n not in head_names},
            "precision": out["precision"] / count,  # local PoE precision per class
            "precision_mean": out["precision_mean"] / count,
            "present": (out["count"] > 0).to(torch.float32),
        }
        return message, {"head": {n: trained[n] for n in head_names}}

    def aggregate(self, server, messages, weights):
        mean, var = product_of_experts(messages["precision"], messages["precision_mean"], messages["present"])
        seen = messages["present"].sum(0) > 0
        return {
            "body": {k: v.mean(0) for k, v in messages["body"].items()},
            "class_mean": torch.where(seen.unsqueeze(-1), mean, server["class_mean"]),
            "class_var": torch.where(seen.unsqueeze(-1), var, server["class_var"]),
        }

    def personalized(self, server, state):
        k = len(next(iter(state["head"].values())))
        body = {n: v for n, v in server["body"].items() if n not in VAR_KEYS}
        return {**broadcast(body, k), **state["head"]}, True

    def global_model(self, server, clients):
        """Evaluation-only view: the body with the clients' mean head (heads never move)."""
        body = {n: v for n, v in server["body"].items() if n not in VAR_KEYS}
        return {**body, **{k: v.mean(0) for k, v in clients["head"].items()}}
