"""FPFC: fusion-penalized federated clustering, by ADMM over pairwise model differences.

Yu et al., "Clustered Federated Learning based on Nonconvex Pairwise Fusion", arXiv:2211.04218
(seed eq. (19) and pseudocode). Each sampled client i runs its local budget on
    f_i(w) + rho/2 ||w - zeta_i||^2,   starting from its own last model omega_i,
and sends omega_i. For every pair i < j of senders the server sets
    delta = omega_i - omega_j + v_ij / rho,  theta_ij = prox(delta),  v_ij += rho (omega_i - omega_j - theta_ij)
and for every client zeta_i = 1/m sum_j (omega_j + theta_ij - v_ij / rho) (theta_ji = -theta_ij).
Clients i, j share a cluster when ||theta_ij|| ~ 0; the number of clusters is never given.

The fusion penalty is SCAD(lam, a) with its kink at 0 smoothed by a quadratic on [0, xi]
[choice: the seed names the parameters, not the formula]; `fusion_prox` is the exact proximal
map of penalty / rho, piecewise in ||delta||: shrink to ~0, soft-threshold, SCAD interpolation,
identity. Needs (a - 1) rho > 1. Defaults rho = 1, lam = 0.5, a = 3.7 (Fan & Li's a), xi = 1e-4.

Memory: the server keeps every client's last model (m x d) and theta, v for all m(m-1)/2 pairs
(2 x m(m-1)/2 x d floats): O(m^2 d), e.g. 20 clients x 100k parameters = 152 MB.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field, model_validator

from pfl_tasks.algorithms.base import Algorithm, HyperParams, proximal
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import gather, per_row, replicate
from pfl_tasks.numerics import sqrt


class FPFCHyper(HyperParams):
    rho: Annotated[float, Field(gt=0)] = 1.0
    lam: Annotated[float, Field(gt=0)] = 0.5
    a: Annotated[float, Field(gt=1)] = 3.7
    xi: Annotated[float, Field(gt=0)] = 1e-4

    @model_validator(mode="after")
    def _convex_subproblem(self):
        if (self.a - 1) * self.rho <= 1:
            raise ValueError("FPFC needs (a - 1) * rho > 1 for its proximal step")
        return self


BLOCK_FLOATS = 2**20  # a block of the server rule holds this many floats per temporary (4 MB)


def fusion_prox(norm: torch.Tensor, hp: FPFCHyper) -> torch.Tensor:
    """Scale c(||delta||) with prox(delta) = c * delta, for penalty/rho (see module doc)."""
    rho, lam, a, xi = hp.rho, hp.lam, hp.a, hp.xi
    safe = norm.clamp_min(1e-12)
    huber = torch.full_like(norm, xi * rho / (xi * rho + lam))
    soft = 1 - lam / (rho * safe)
    scad = (1 - a * lam / ((a - 1) * rho * safe)) / (1 - 1 / ((a - 1) * rho))
    return torch.where(
        norm <= xi + lam / rho, huber,
        torch.where(norm <= lam + lam / rho, soft, torch.where(norm <= a * lam, scad, torch.ones_like(norm))),
    )


def client_count(server) -> int:
    return len(next(iter(server["omega"].values())))  # a row per client


@register
class FPFC(Algorithm):
    name = "fpfc"
    citation = "Yu et al., arXiv:2211.04218"
    Hyper = FPFCHyper

    def init_server(self, params, facts):
        m = facts.n_clients
        pairs = torch.triu_indices(m, m, offset=1)
        zeros = {k: torch.zeros(pairs.shape[1], *v.shape) for k, v in params.items()}
        return {
            "omega": replicate(params, m), "zeta": replicate(params, m),
            "theta": zeros, "dual": {k: v.clone() for k, v in zeros.items()}, "pairs": pairs,
        }

    def init_clients(self, params, n_clients):
        return {"params": replicate(params, n_clients)}

    def payload(self, server):
        return {"zeta": server["zeta"]}

    def download(self, payload, ids):
        return {}, {"zeta": gather(payload["zeta"], ids)}

    def client_update(self, trainer, payload, state):
        omega = trainer.fit(state["params"], proximal(self.hp.rho), aux=payload["zeta"])
        return {"params": omega}, {"params": omega}

    def aggregate(self, server, messages, weights, ids):
        rho, pairs = self.hp.rho, server["pairs"]
        omega = {k: v.index_copy(0, ids.to(v.device), messages["params"][k]) for k, v in server["omega"].items()}
        m = client_count(server)
        active = torch.zeros(m, dtype=torch.bool, device=pairs.device)
        active[ids.to(pairs.device)] = True
        live = (active[pairs[0]] & active[pairs[1]]).nonzero().squeeze(1)  # the pairs of two senders
        # theta and v are updated in place, as the engine updates the client stacks (a round's
        # state is used once), a block of pairs at a time in reused buffers: copies and [pairs, d]
        # temporaries in fresh memory cost most of a round. Each value is computed as by the
        # whole-tensor formulas in the module doc, and summed in their order.
        theta, dual = server["theta"], server["dual"]
        size = max(1, BLOCK_FLOATS // sum(v[0].numel() for v in theta.values()))  # pairs per block
        diff, old, delta, new = ({k: v.new_empty(size, *v.shape[1:]) for k, v in theta.items()} for _ in range(4))
        for rows in torch.split(live, size):
            b = len(rows)
            for k, w in omega.items():
                torch.index_select(w, 0, pairs[0][rows], out=diff[k][:b]).sub_(
                    torch.index_select(w, 0, pairs[1][rows], out=new[k][:b]))
                torch.index_select(dual[k], 0, rows, out=old[k][:b])
                torch.div(old[k][:b], rho, out=delta[k][:b]).add_(diff[k][:b])
            norm = sqrt(sum(torch.mul(delta[k][:b], delta[k][:b], out=new[k][:b]).flatten(1).sum(1)
                            for k in omega))
            scale = fusion_prox(norm, self.hp)
            for k in omega:
                theta[k].index_copy_(0, rows, torch.mul(delta[k][:b], per_row(scale, delta[k][:b]), out=new[k][:b]))
                dual[k].index_copy_(0, rows, old[k][:b].add_(diff[k][:b].sub_(new[k][:b]).mul_(rho)))
        zeta = {}
        for k, w in omega.items():
            # each pair's correction theta - dual / rho is added to its first client's row, then
            # subtracted from its second's (index_add_ is deterministic on CUDA in the engine's
            # deterministic mode)
            push = torch.zeros_like(w)
            for side, sign in ((0, 1), (1, -1)):
                for start in range(0, pairs.shape[1], size):
                    block = slice(start, start + size)
                    b = len(pairs[side][block])
                    corr = torch.sub(theta[k][block], torch.div(dual[k][block], rho, out=new[k][:b]), out=new[k][:b])
                    push.index_add_(0, pairs[side][block], corr, alpha=sign)
            zeta[k] = w.mean(0, keepdim=True) + push / m
        return {"omega": omega, "zeta": zeta, "theta": theta, "dual": dual, "pairs": pairs}

    def personalized(self, server, state):
        return state["params"], True

    def global_model(self, server, clients):
        return {k: v.mean(0) for k, v in server["omega"].items()}

    def clusters(self, server, tol: float = 1e-3) -> torch.Tensor:
        """Cluster label of each client: connected components of ||theta_ij|| < tol."""
        pairs = server["pairs"]
        norm = sqrt(sum((t.flatten(1) ** 2).sum(1) for t in server["theta"].values()))
        labels = torch.arange(client_count(server))
        for i, j in pairs.cpu()[:, norm.cpu() < tol].T.tolist():  # union by relabeling
            labels[labels == labels[j]] = labels[i].item()
        return torch.unique(labels, return_inverse=True)[1]
