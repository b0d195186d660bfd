"""CFL: clustered federated learning; a cluster splits in two when it has reached a stationary
point of its joint objective while some of its clients' own objectives still pull apart.

Sattler, Müller, Samek, "Clustered Federated Learning: Model-Agnostic Distributed Multitask
Optimization under Privacy Constraints", IEEE TNNLS 2020 (Algorithm 1). All clients start in
one cluster. A client trains from its cluster's model and sends its weight update dW_i. For
each cluster c, when ||sum_i n_i dW_i / sum_i n_i|| < eps1 and max_i ||dW_i|| > eps2, c is
bipartitioned by the pairwise cosine similarities of the dW_i: the paper's optimal bipartition,
computed as in the authors' code by complete-linkage agglomerative clustering of -similarity
into 2 clusters. Then every cluster's model moves by the sample-weighted mean update of its
members (FedAvg within the cluster; both halves of a split start from the parent's model)
[the code averages uniformly]. [choice, from the authors' code] eps1 = 0.4, eps2 = 1.6 (data-
dependent: update norms scale with the learning rate and local budget), no split before round
`warmup_rounds` = 20, and only clusters of more than 2 clients split. [choice] A cluster
splits only in a round where all its members sent updates (the paper has full participation).

Server state: one model slot per client (clusters are never empty, so there are at most as
many) and each client's cluster id. The global model evaluated is the mean over clients of
their cluster models (the single model before any split).
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field
from sklearn.cluster import AgglomerativeClustering

from pfl_tasks.algorithms.base import Algorithm, HyperParams
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import gather, replicate, weighted_mean


class CFLHyper(HyperParams):
    eps1: Annotated[float, Field(gt=0)] = 0.4
    eps2: Annotated[float, Field(gt=0)] = 1.6
    warmup_rounds: Annotated[int, Field(ge=0)] = 20


def bipartition(updates: torch.Tensor) -> torch.Tensor:
    """True for the clients of the second half; `updates` [m, d] are flattened dW_i."""
    unit = updates / (updates.norm(dim=1, keepdim=True) + 1e-12)
    similarity = (unit @ unit.T).double().cpu().numpy()
    linkage = AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="complete")
    return torch.as_tensor(linkage.fit(-similarity).labels_ == 1, device=updates.device)


@register
class CFL(Algorithm):
    name = "cfl"
    citation = "Sattler et al., IEEE TNNLS 2020"
    Hyper = CFLHyper

    def init_server(self, params):
        return {
            "models": replicate(params, self.n_clients),
            "cluster": torch.zeros(self.n_clients, dtype=torch.long),
            "n_clusters": torch.ones((), dtype=torch.long),
            "round": torch.zeros((), dtype=torch.long),
        }

    def init_clients(self, params, n_clients):
        return {"id": torch.arange(n_clients)}

    def payload(self, server):
        return {"models": server["models"], "cluster": server["cluster"]}

    def download(self, payload, ids):
        return {}, {"start": gather(payload["models"], payload["cluster"][ids])}

    def client_update(self, trainer, payload, state):
        start = payload["start"]
        trained = trainer.fit(start)
        return {"update": {k: trained[k] - v for k, v in start.items()}, "id": state["id"]}, state

    def splits(self, updates, weights, members_in_cluster, round_idx) -> bool:
        mean = weights.to(updates.dtype) @ updates / weights.sum().to(updates.dtype)
        return (
            round_idx >= self.hp.warmup_rounds and members_in_cluster == len(updates) > 2
            and mean.norm() < self.hp.eps1 and updates.norm(dim=1).max() > self.hp.eps2
        )

    def aggregate(self, server, messages, weights):
        ids, updates = messages["id"], messages["update"]
        flat = torch.cat([v.flatten(1) for v in updates.values()], 1)
        cluster = server["cluster"].clone()
        models = {k: v.clone() for k, v in server["models"].items()}
        n_clusters = int(server["n_clusters"])
        for c in range(n_clusters):
            members = torch.nonzero(cluster[ids] == c).squeeze(1)
            size = int((cluster == c).sum())
            if self.splits(flat[members], weights[members], size, int(server["round"])):
                cluster[ids[members[bipartition(flat[members])]]] = n_clusters
                for v in models.values():
                    v[n_clusters] = v[c]
                n_clusters += 1
        for c in torch.unique(cluster[ids]).tolist():
            members = torch.nonzero(cluster[ids] == c).squeeze(1)
            step = weighted_mean(gather(updates, members), weights[members])
            for k, v in models.items():
                v[c] += step[k]
        return {"models": models, "cluster": cluster, "round": server["round"] + 1,
                "n_clusters": server["n_clusters"].new_tensor(n_clusters)}

    def personalized(self, server, state):
        return gather(server["models"], server["cluster"][state["id"]]), True

    def global_model(self, server, clients):
        sizes = torch.bincount(server["cluster"], minlength=len(server["cluster"]))
        return weighted_mean(server["models"], sizes.to(torch.float64))
