"""Learn2pFed's meta-optimizer schedules measured on validation: Adam at meta lr 0.001-0.1, with
and without the demo's step decay (to 1e-3 from meta-epoch 60), and the demo's SGD schedule on
log-parameters, on the project's polynomial tasks (poly1-3 and their data-scarce variants,
3 seeds; `train` supervision, the meta-epoch selected on validation as the stage selects it),
and on the authors' data (bench.studies.learn2pfed_authors: all rows, and 85% with selection).

The choice reads the selected Theta's validation MSE only, each schedule against the default
(Adam 0.05 with decay), paired over the 3 seeds; the clean-curve scores of the authors' data
are printed beside it, never chosen on.

    python -m bench.studies.learn2pfed_schedule NAME[,NAME...] OUT   # one process per list; about 4 min a schedule
    python -m bench.studies.learn2pfed_schedule --report OUT...      # the tables, from the JSON files
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from bench.studies.learn2pfed_authors import authors_data, clean_mse, split, stacked
from bench.common import problems
from flows.learn2pfed import selection_scores
from pfl_tasks.algorithms.learn2pfed import Cells
from pfl_tasks.algorithms.learn2pfed_meta import client_metrics, make_optimizer, meta_step, personalized_models
from pfl_tasks.config import Learn2pFedConfig, MetaOptimizer, load_params
from pfl_tasks.selection import Selection

DECAY = dict(decay_epoch=60, decay_lr=1e-3)
SCHEDULES = {
    **{f"adam{lr}": dict(name="adam", lr=lr, decay_epoch=None) for lr in (0.05, 0.02, 0.01, 0.005, 0.001)},
    **{f"adam{lr}-d60": dict(name="adam", lr=lr, **DECAY) for lr in (0.1, 0.05, 0.02, 0.01, 0.005, 0.002)},
    "sgd-authors": dict(name="sgd", lr=0.01, decay_epoch=61, decay_lr=1e-3, epochs=500),
}
TASKS = {"params.yaml": ["poly1"],
         "params-extended.yaml": ["poly2", "poly3", "poly1_scarce", "poly2_scarce", "poly3_scarce"]}


def trajectory(cfg, fit, select, score, seed: int) -> dict:
    """Validation (mean, and the `Score` the selection pairs) on `select` and `score(v)` of the Theta each meta-epoch starts from, and the last."""
    w0 = torch.zeros(fit.dim, dtype=torch.float64)
    cells = Cells(fit, cfg.cells, cfg.tied, cfg.init.model_dump(), torch.Generator().manual_seed(seed), cfg.lambda_)
    opt, out = make_optimizer(cells, cfg.meta), {"val": [], "score": [], "test": []}
    for epoch in range(cfg.meta.epochs + 1):
        v = meta_step(cells, opt, cfg, epoch, fit, fit, w0)[2] if epoch < cfg.meta.epochs else \
            personalized_models(cells, fit, w0, cfg)
        out["test"].append(score(v))
        if select is not None:
            score = selection_scores(select, v)[1]
            out["val"].append(score.mean)
            out["score"].append(score)
    return out


def selected(run: dict) -> int:
    selection = Selection(higher_is_better=False)
    for epoch, score in enumerate(run["score"]):
        selection.offer(epoch, score, None)
    return selection.index


def measure(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        cfg, start = Learn2pFedConfig(meta=MetaOptimizer(**{"epochs": 300, **SCHEDULES[name]})), time.time()
        for path, experiments in TASKS.items():
            params = load_params(path)
            for experiment in experiments:
                for seed in (0, 1, 2):
                    train, val, test = problems(params, experiment, seed, False)
                    run = trajectory(cfg, train, val, lambda v: client_metrics(test, v)["mse"].mean().item(), seed)
                    rows.append({"schedule": name, "task": experiment, "seed": seed, **run})
        for seed in (1, 2, 3):
            xs, ys, coefs = authors_data(seed)
            train, val = split(xs, seed)
            score = lambda v: clean_mse(v, xs, coefs)  # noqa: E731
            rows.append({"schedule": name, "task": "authors-all", "seed": seed,
                         **trajectory(cfg, stacked(xs, ys, [np.arange(len(x)) for x in xs]), None, score, seed)})
            rows.append({"schedule": name, "task": "authors-split", "seed": seed,
                         **trajectory(cfg, stacked(xs, ys, train), stacked(xs, ys, val), score, seed)})
        print(name, f"{time.time() - start:.0f}s", flush=True)
    return rows


def report(rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["schedule"] for r in rows))
    lines = ["| schedule | " + " | ".join(TASKS["params.yaml"] + TASKS["params-extended.yaml"])
             + " | authors, all rows (last) | authors, 85% (selected) |", "|---" * 9 + "|"]
    for name in names:
        cells = []
        for task in TASKS["params.yaml"] + TASKS["params-extended.yaml"]:
            scale = 1 if "scarce" in task else 1e4
            ours = [r for r in rows if r["schedule"] == name and r["task"] == task]
            base = [r for r in rows if r["schedule"] == "adam0.05-d60" and r["task"] == task]
            diff = scale * np.array([a["val"][selected(a)] - b["val"][selected(b)] for a, b in zip(ours, base)])
            cells.append(f"{scale * np.mean([r['val'][selected(r)] for r in ours]):.3f} "
                         f"({diff.mean():+.3f} ± {diff.std(ddof=1) / np.sqrt(len(diff)):.3f})")
        authors = {t: [r for r in rows if r["schedule"] == name and r["task"] == t] for t in ("authors-all", "authors-split")}
        cells.append(" / ".join(f"{r['test'][-1]:.3f}" for r in authors["authors-all"]))
        cells.append(" / ".join(f"{r['test'][selected(r)]:.3f}" for r in authors["authors-split"]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "--report":
        print(report(sum((json.load(open(path)) for path in sys.argv[2:]), [])))
    else:
        json.dump(measure(sys.argv[1].split(",")), open(sys.argv[2], "w"))
