"""Learn2pFed: unrolled ADMM whose per-client, per-parameter participation is learned.

Lv, Ye, Huang, Yang, Chen, "Learn What You Need in Personalized Federated Learning",
arXiv:2401.08327 (equations: shared/reference/learn2pfed.md). The problem
    min sum_i p_i [F_i(v_i) + z_i^T Lambda_i z_i]   s.t.  v_i - w - z_i = 0
is solved by L cells of ADMM whose parameters Theta = {Lambda_i (diagonal, or a full matrix:
`lambda: full`), p_i, rho_i, eta_i, gamma_i, theta_i} are meta-trained by gradient descent
through all cells. One cell l:
    v_i = argmin_v F_i(v) + rho_i/2 ||v - (w + z_i + alpha_i)||^2               (client)
    z_i = eta_i (Lambda_i + eta_i I)^-1 (v_i - w - alpha_i)                      (client)
    w   = sum_i p_i gamma_i (v_i - z_i - alpha_i) / sum_i p_i gamma_i            (server)
    alpha_i = alpha_i + theta_i (z_i - v_i + w)                                  (client)
Clients own Lambda, rho, eta, theta and send only the mixed vector v_i - z_i - alpha_i; the
server owns p, gamma and w. At a fixed point, grad F_i(v_i) = -(rho_i/eta_i) Lambda_i z_i and
sum_i p_i gamma_i Lambda_i z_i / eta_i = 0: with gamma_i proportional to rho_i this is the
minimizer of sum_i p_i [F_i(v_i) + rho_i/(2 eta_i) (v_i - w)^T Lambda_i (v_i - w)], the
problem above when eta_i = rho_i / 2. Cells run in float64 on the CPU (small problems: one
model vector per client).

[choice]s: every parameter is exp(raw) + 1e-6, so Lambda > 0 and rho, eta, gamma, theta,
p > 0 always and every inverse exists; the map is scale-free, so one outer learning rate serves
parameters whose sizes differ by decades (a sharp softplus, the identity on the positive side as
in the authors' unconstrained demo, left parameters dead at the floor after the first Adam
steps: measured, meta loss 12 -> 29 on `poly1_scarce`). Regression uses the demo's
F_i = 1/2 ||X_i v - Y_i||^2 and its closed-form v-step (batched `torch.linalg.solve`);
classification uses the mean cross-entropy of a linear head and `v_steps` gradient steps,
warm-started at the previous v_i. Cells start at w = w0 (zero, or the upstream global head),
z = alpha = 0, v = w0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pfl_tasks.numerics import sqrt

FLOOR = 1e-6  # keeps rho + X^T X invertible when a client has fewer rows than features
CLIENT_KEYS = ("lam", "rho", "eta", "theta")  # owned by each client
SERVER_KEYS = ("p", "gamma")  # owned by the server


def positive(raw: torch.Tensor) -> torch.Tensor:
    return torch.exp(raw) + FLOOR


def inverse_positive(value: torch.Tensor) -> torch.Tensor:
    return torch.log(value - FLOOR)


@dataclass(frozen=True)
class Problem:
    """Every client's data, padded into stacks: x [M, n, d], y [M, n], mask [M, n] (1 = real).
    Regression targets are floats; classification labels are class indices with `n_classes`."""

    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor
    n_classes: int = 0  # 0: regression

    @property
    def n_clients(self) -> int:
        return self.x.shape[0]

    @property
    def dim(self) -> int:
        """Length of one client's model vector v."""
        d = self.x.shape[-1]
        return d if self.n_classes == 0 else self.n_classes * (d + 1)

    def per_client_loss(self, v: torch.Tensor) -> torch.Tensor:
        """Mean loss of each client's model v_i on its own rows: MSE or cross-entropy, [M]."""
        losses = self._losses(v)
        return (losses * self.mask).sum(1) / self.mask.sum(1)

    def per_client_loss_square(self, v: torch.Tensor) -> torch.Tensor:
        """Mean squared loss of each client's rows, [M]: their spread about `per_client_loss`."""
        losses = self._losses(v)
        return (losses * losses * self.mask).sum(1) / self.mask.sum(1)

    def accuracy(self, v: torch.Tensor) -> torch.Tensor:
        return (self._hits(v) * self.mask).sum(1) / self.mask.sum(1)

    def per_row(self, v: torch.Tensor) -> torch.Tensor:
        """Each real row's own primary metric (a hit, 1 or 0; a squared error), client after client."""
        return (self._losses(v) if self.n_classes == 0 else self._hits(v))[self.mask.bool()]

    def _hits(self, v: torch.Tensor) -> torch.Tensor:
        return (self._logits(v).argmax(1) == self.y).to(self.mask.dtype)

    def _logits(self, v: torch.Tensor) -> torch.Tensor:
        """[M, classes, n]: classes before rows, so that the log-sum-exp over classes runs along
        contiguous rows (1.7x faster forward and double backward than [M, n, classes])."""
        head = v.view(len(v), self.n_classes, -1)
        return torch.baddbmm(head[..., -1:], head[..., :-1], self.x.transpose(1, 2))

    def _losses(self, v: torch.Tensor) -> torch.Tensor:
        if self.n_classes == 0:
            return (torch.einsum("mnd,md->mn", self.x, v) - self.y) ** 2
        logits = self._logits(v)
        return torch.logsumexp(logits, 1) - logits.gather(1, self.y[:, None]).squeeze(1)


class Cells(torch.nn.Module):
    """Theta of L unrolled cells, tied (one set for all cells) or one set per cell. Lambda_i is
    diagonal (the paper's text: one lambda_ij per parameter) or, with `form="full"`, a d x d
    matrix (the authors' code) kept positive definite as L_i L_i^T + FLOOR I, L_i lower
    triangular; both start at the same diagonal (the demo's lam U(0,1) per entry)."""

    def __init__(self, problem: Problem, cells: int, tied: bool, init: dict[str, float],
                 generator: torch.Generator, form: str = "diagonal"):
        super().__init__()
        m, d, layers = problem.n_clients, problem.dim, 1 if tied else cells
        self.cells, self.form = cells, form
        counts = problem.mask.sum(1)
        start = {key: torch.full((layers, m), init[key]) for key in ("rho", "eta", "gamma", "theta")}
        start["p"] = (counts / counts.sum()).expand(layers, m)
        raw = {key: inverse_positive(value.double()) for key, value in start.items()}
        uniform = torch.rand(layers, m, d, generator=generator, dtype=torch.float64).clamp_min(1e-6)
        if form == "diagonal":
            raw["lam"] = torch.log(init["lam"] * uniform)  # Lambda = lam U + FLOOR
        else:  # the factor L: L L^T + FLOOR I = the same diagonal
            raw["lam"] = torch.diag_embed(sqrt(init["lam"] * uniform))
        self.raw = torch.nn.ParameterDict({key: torch.nn.Parameter(value) for key, value in raw.items()})

    def values(self, cell: int) -> dict[str, torch.Tensor]:
        """Theta of cell `cell`: each [M], Lambda [M, d] (its diagonal) or [M, d, d] (full)."""
        out = {key: positive(raw[min(cell, len(raw) - 1)]) for key, raw in self.raw.items() if key != "lam"}
        lam = self.raw["lam"][min(cell, len(self.raw["lam"]) - 1)]
        if self.form == "diagonal":
            out["lam"] = positive(lam)
        else:
            factor = lam.tril()
            out["lam"] = factor @ factor.transpose(-1, -2) + FLOOR * torch.eye(lam.shape[-1], dtype=lam.dtype)
        return out


@dataclass
class Trace:
    v: torch.Tensor  # [M, d] personalized models after the last cell
    w: torch.Tensor  # [d] global model after the last cell


# ----------------------------------------------------------------------------- one cell's steps
def v_step_closed_form(gram, xty, rho, center):
    """argmin_v 1/2 ||X v - Y||^2 + rho/2 ||v - center||^2 for every client at once."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + rho[:, None, None] * eye, xty + rho[:, None] * center)


def v_step_gradient(problem, v, rho, center, steps: int, lr: float, create_graph: bool):
    """`steps` gradient steps on F_i(v) + rho/2 ||v - center||^2, from the previous v."""
    for _ in range(steps):
        if not v.requires_grad:  # a constant start (the first cell, or evaluation)
            v = v.detach().requires_grad_()
        grad_f = torch.autograd.grad(problem.per_client_loss(v).sum(), v, create_graph=create_graph)[0]
        v = v - lr * (grad_f + rho[:, None] * (v - center))
    return v


def z_step(v, w, alpha, lam, eta):
    """eta_i (Lambda_i + eta_i I)^-1 (v_i - w - alpha_i): elementwise for a diagonal Lambda
    [M, d], a batched solve for a full one [M, d, d]."""
    if lam.dim() == 2:
        return eta[:, None] / (lam + eta[:, None]) * (v - w - alpha)
    eye = torch.eye(lam.shape[-1], dtype=lam.dtype, device=lam.device)
    return eta[:, None] * torch.linalg.solve(lam + eta[:, None, None] * eye, v - w - alpha)


def w_step(mixed, p, gamma):
    weight = p * gamma
    return (weight[:, None] * mixed).sum(0) / weight.sum()


def alpha_step(alpha, v, z, w, theta):
    return alpha + theta[:, None] * (z - v + w)


# ----------------------------------------------------------------------------- the unrolled net
def unroll(cells: Cells, problem: Problem, w0: torch.Tensor, v_steps: int = 1, v_lr: float = 0.1,
           create_graph: bool = True) -> Trace:
    """Run every cell on `problem` (the data the v-steps fit); differentiable in Theta."""
    m, d = problem.n_clients, problem.dim
    w = w0.to(problem.x.dtype)
    v = w.expand(m, d)
    z = alpha = torch.zeros(m, d, dtype=w.dtype, device=w.device)
    if problem.n_classes == 0:
        xm = problem.x * problem.mask[..., None]
        gram, xty = xm.transpose(1, 2) @ xm, torch.einsum("mnd,mn->md", xm, problem.y)
    for cell in range(cells.cells):
        theta = cells.values(cell)
        center = w + z + alpha
        if problem.n_classes == 0:
            v = v_step_closed_form(gram, xty, theta["rho"], center)
        else:
            v = v_step_gradient(problem, v, theta["rho"], center, v_steps, v_lr, create_graph)
        z = z_step(v, w, alpha, theta["lam"], theta["eta"])
        w = w_step(v - z - alpha, theta["p"], theta["gamma"])  # the only upload: v - z - alpha
        alpha = alpha_step(alpha, v, z, w, theta["theta"])
    return Trace(v, w)
