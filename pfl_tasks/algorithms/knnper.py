"""kNN-Per: a FedAvg global model, personalized at evaluation by interpolating its predictions
with a k-nearest-neighbours model over the client's own training data.

Marfoq, Neglia, Kameni, Vidal, "Personalized Federated Learning through Local Memorization",
ICML 2022. Training is FedAvg. At evaluation every client builds a datastore of (phi(x_j), y_j)
over all its training samples (full capacity), phi = the global model's body (every layer but
the head, `nets.head_keys`), and predicts
    p(y|x) = lam p_kNN(y|x) + (1 - lam) p_global(y|x),
    p_kNN(y|x) = sum_{j in kNN(x)} 1[y_j = y] exp(-d_j / T) / sum_{j in kNN(x)} exp(-d_j / T),
over the k nearest neighbours of phi(x). k = 10 (the paper). [choice] d_j is the squared
Euclidean distance and T defaults to the embedding dimension, as in the authors' code (faiss
IndexFlatL2 returns squared distances; the kernel is exp(-d / (dim * scale)), scale = 1).
lam is picked per client, as in the paper, from the grid 0, 0.05, ..., 1 at every evaluation:
[choice] the value with the lowest loss on the client's validation split (the authors' code
scores accuracy; the loss breaks the ties a small split leaves). `lam` set fixes it instead.
`forward` returns log p, so the cross-entropy and accuracy metrics stay right; datastores are
padded to the chunk's largest client and masked. Classification only. The global model
evaluated is the FedAvg model itself.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from pydantic import Field
from torch.func import functional_call

from pfl_tasks.algorithms.fedavg import FedAvg, FedAvgHyper
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import broadcast
from pfl_tasks.nets import embed, split_net


class KNNPerHyper(FedAvgHyper):
    k: Annotated[int, Field(gt=0)] = 10
    lam: Annotated[float, Field(ge=0, le=1)] | None = None  # None: per client, on validation
    temperature: Annotated[float, Field(gt=0)] | None = None  # None: the embedding dimension


def knn_probs(query, keys, labels, mask, k: int, temperature: float, n_classes: int):
    """p_kNN [B, C] of embeddings `query` [B, e] over one datastore (`keys` [N, e], `labels`
    [N], `mask` [N] false on padding)."""
    dist = (query**2).sum(-1, keepdim=True) - 2 * query @ keys.T + (keys**2).sum(-1)
    dist = dist.clamp_min(0).masked_fill(~mask, math.inf)
    near, index = torch.topk(dist, min(k, keys.shape[0]), largest=False)
    weight = torch.softmax(-near / temperature, -1)
    votes = labels[index][..., None] == torch.arange(n_classes, device=labels.device)
    return (weight[..., None] * votes).sum(-2)


def require_classification(task: str) -> None:
    if task != "classification":
        raise ValueError(f"knnper predicts labels from a kNN: it needs classification data, not {task}")


@register
class KNNPer(FedAvg):
    name = "knnper"
    citation = "Marfoq et al., ICML 2022"
    Hyper = KNNPerHyper

    def client_update(self, trainer, payload, state):
        require_classification(trainer.task)
        return super().client_update(trainer, payload, state)

    def personalize(self, trainer, server, state, val_loss):
        """The global model and, per client, its datastore of training embeddings and its lam."""
        require_classification(trainer.task)
        model, k = server["global"], trainer.n_clients
        body, body_params, _, _ = split_net(trainer.net, model)
        x, y, mask = trainer.samples()
        keys = embed(body, body_params, x.flatten(0, 1))
        store = {"keys": keys.view(*mask.shape, -1), "labels": y, "mask": mask}
        views = {"model": broadcast(model, k), "store": store}
        if self.hp.lam is not None:
            return {**views, "lam": keys.new_full((k,), self.hp.lam)}, True
        grid = torch.linspace(0, 1, 21, device=keys.device)
        losses = val_loss({**views, "lam": grid.expand(k, len(grid))}, True, self.forward, variants=len(grid))
        return {**views, "lam": grid[losses.argmin(0).to(grid.device)]}, True

    def forward(self, net, params, x):
        body, body_params, head, head_params = split_net(net, params["model"])
        embedding = functional_call(body, body_params, (x,))
        logits = functional_call(head, head_params, (embedding,))
        store, hp, lam = params["store"], self.hp, params["lam"]
        p_knn = knn_probs(embedding, store["keys"], store["labels"], store["mask"], hp.k,
                          hp.temperature or embedding.shape[-1], logits.shape[-1])
        lam = lam.reshape(*lam.shape, 1, 1)  # a grid of V values (`personalize`): [V, rows, C]
        return torch.logaddexp(lam.log() + p_knn.log(), (1 - lam).log() + logits.log_softmax(-1))
