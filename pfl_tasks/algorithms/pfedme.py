"""pFedMe: personalized models as Moreau-envelope proximal points of the global model.

Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020
(Algorithm 1; seed eqs. (3)-(7)). Client k starts omega_k = theta_k = theta, the received global
model (as in the authors' code, which loads the global model into both each round), and for
each of its R local steps (the round's local budget), on a fresh minibatch b_r:
    theta_k <- prox_update(omega_k; b_r): `inner_steps` GD steps with `personal_lr` on
               l_k(theta_k; b_r) + lam/2 ||theta_k - omega_k||^2, warm-started at theta_k
    omega_k <- omega_k - eta lam (omega_k - theta_k)
(a step of the local optimizer, of lr eta, on the Moreau envelope's gradient lam (omega_k -
theta_k): with momentum, weight decay or Adam configured, those apply to it), and sends
omega_k; the server smooths theta <- (1 - beta) theta + beta mean_k omega_k. The personalized
model is theta_k from the client's last round.
Defaults are the authors' for MNIST: lam = 15, K = 5 inner steps, personal lr 0.1, beta = 1 (their
Synthetic runs use personal lr 0.01); their outer lr there, 0.005, is the experiment's
`local.optimizer.lr` here.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pfl_tasks.algorithms.base import Algorithm, HyperParams, PersonalModels
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine import optim
from pfl_tasks.engine.executor import clientwise
from pfl_tasks.engine.state import broadcast


class PFedMeHyper(HyperParams):
    lam: Annotated[float, Field(gt=0)] = 15.0
    inner_steps: Annotated[int, Field(gt=0)] = 5
    personal_lr: Annotated[float, Field(gt=0)] = 0.1
    beta: Annotated[float, Field(gt=0)] = 1.0


def smooth(theta, messages, beta):
    """(1 - beta) theta + beta * (uniform mean of the senders' models)."""
    return {k: (1 - beta) * theta[k] + beta * messages[k].mean(0) for k in theta}


@register
class PFedMe(PersonalModels, Algorithm):
    name = "pfedme"
    citation = "Dinh et al., NeurIPS 2020"
    Hyper = PFedMeHyper

    def personal_step(self, batch, shared, personal):
        """pFedMe's prox update: `inner_steps` gradient steps on f_k(personal) + lam/2
        ||personal - shared||^2, warm-started at the personal model the scan carries (in place)."""
        for _ in range(self.hp.inner_steps):
            batch.data_step(personal, self.hp.personal_lr, pull=(shared, self.hp.lam))
        return personal

    def personal_start(self, received, state):
        return received  # as the authors' code: both models start from the global one each round

    def client_update(self, trainer, payload, state):
        """Per local step, the personal model's update (`personal_step`), then a step of the
        local optimizer on the shared model along lam (shared - personal): pFedMe's envelope
        gradient, pFedMac's correlation pull. Sends the shared model."""
        hp, cfg = self.hp, trainer.local.optimizer
        plain = optim.plain_sgd(cfg)

        @clientwise
        def step(carry, data_loss, aux, batch):
            shared, personal = carry["shared"], self.personal_step(batch, carry["shared"], carry["personal"])
            opt = carry["opt"]
            if plain:  # shared - lr lam (shared - personal), in place (ops vmap batches)
                for k, t in shared.items():
                    t.mul_(1 - cfg.lr * hp.lam).add_(personal[k], alpha=cfg.lr * hp.lam)
            else:
                shared, opt = optim.apply(cfg, shared, {k: hp.lam * (shared[k] - personal[k]) for k in shared}, opt)
            return {"shared": shared, "personal": personal, "opt": opt}

        received = broadcast(payload["global"], trainer.n_clients)
        out = trainer.scan({"shared": received, "personal": self.personal_start(received, state),
                            "opt": optim.start(cfg, received)}, step)
        return {"params": out["shared"]}, {"personal": out["personal"]}

    def aggregate(self, server, messages, weights, ids):
        return {"global": smooth(server["global"], messages["params"], self.hp.beta)}
