"""Why Learn2pFed's meta-parameters do not move on the MNIST head: the meta-training of the
`learn2pfed-mnist` stage (a linear head on each seed's FedAvg body, `train-mnist`'s checkpoints)
under other meta lrs, supervisions, initial rho and Lambda, and cell counts; 3 seeds, 15
meta-epochs. Prints, per setting and seed, the personalized validation accuracy of the Theta at
meta-epoch 0 and its best and last, the meta loss, and the learned Theta's means.

    python -m bench.studies.learn2pfed_mnist_search        # in a checkout whose train-mnist stage ran; ~6 min
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from flows.learn2pfed import build_problems
from pfl_tasks.algorithms import validate_params
from pfl_tasks.algorithms.learn2pfed import Cells, positive
from pfl_tasks.algorithms.learn2pfed_meta import client_metrics, make_optimizer, meta_step, personalized_models
from pfl_tasks.config import Learn2pFedConfig, load_params

SETTINGS = [  # changes to params.yaml's learn2pfed.mnist; "supervision" and "epochs" are the run's
    {"meta": {"lr": 0.005}}, {}, {"meta": {"lr": 0.5}},
    {"supervision": "val", "meta": {"lr": 0.005}}, {"supervision": "val"},
    {"init": {"rho": 1.0}}, {"init": {"rho": 1.0, "lam": 1.0}},
    {"supervision": "val", "init": {"rho": 1.0, "lam": 1.0}}, {"cells": 3, "init": {"rho": 1.0}},
]


def run(params, change: dict, seed: int, epochs: int = 15) -> dict:
    change = dict(change)
    supervision = change.pop("supervision", "train")
    base = params.learn2pfed["mnist"].model_dump(by_alias=True)
    cfg = Learn2pFedConfig(**{**base, **change, "meta": {**base["meta"], **change.get("meta", {})},
                              "init": {**base["init"], **change.get("init", {})}})
    exp = params.experiment("mnist").model_copy(update={"seed": seed})
    problems = build_problems.fn(exp, params, cfg, supervision, Path("."))
    cells = Cells(problems.train, cfg.cells, cfg.tied, cfg.init.model_dump(), torch.Generator().manual_seed(seed), cfg.lambda_)
    opt, accuracy, losses = make_optimizer(cells, cfg.meta), [], []
    for epoch in range(epochs + 1):
        if epoch < epochs:
            loss, _, v = meta_step(cells, opt, cfg, epoch, problems.train, problems.supervise, problems.w0)
            losses.append(loss)
        else:
            v = personalized_models(cells, problems.train, problems.w0, cfg)
        accuracy.append(client_metrics(problems.select, v)["acc"].mean().item())
    return {"setting": json.dumps({"supervision": supervision, **change}), "seed": seed, "val_first": accuracy[0],
            "val_best": max(accuracy), "best_epoch": accuracy.index(max(accuracy)), "val_last": accuracy[-1],
            "loss_first": losses[0], "loss_last": losses[-1],
            "theta": {k: positive(p.detach()).mean().item() for k, p in cells.raw.items()}}


def main() -> int:
    params = validate_params(load_params("params.yaml"))
    for change in SETTINGS:
        for seed in params.experiment("mnist").seeds:
            print(json.dumps(run(params, change, seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
