"""Local-only: every client trains its own model on its own data; nothing is communicated.

The lower baseline of every PFL comparison (e.g. Learn2pFed, sec. 5; Ditto, sec. 5).
"""

from __future__ import annotations

from pfl_tasks.algorithms.base import Algorithm
from pfl_tasks.algorithms.registry import register
from pfl_tasks.engine.state import replicate


@register
class LocalOnly(Algorithm):
    name = "local"
    citation = "baseline: independent training per client"

    def init_server(self, params, facts):
        return {}

    def init_clients(self, params, n_clients):
        return {"params": replicate(params, n_clients)}

    def payload(self, server):
        return {}

    def client_update(self, trainer, payload, state):
        return {}, {"params": trainer.fit(state["params"])}

    def aggregate(self, server, messages, weights, ids):
        return server

    def personalized(self, server, state):
        return state["params"], True

    def global_model(self, server, clients):
        return None
