"""Learn2pFed with its meta-epoch selected on validation, against local and pooled least
squares, on the polynomial tasks (poly1-poly3 and their data-scarce variants), 3 seeds, both
supervision signals: the meta-training as the `learn2pfed` stage runs it (`flows.learn2pfed`'s
meta-epochs, `Selection`, the held-out half of the validation rows under `val` supervision), in this
process on the same partitions. Test MSE of the selected Theta and of the last one; local least
squares is the optimum Local-only training can reach, pooled least squares FedAvg's.

    python -m bench.learn2pfed_selection            # a few minutes on 2 cores
    python -m bench.learn2pfed_selection --quick    # one task, one seed, 30 meta-epochs

Writes bench/results/<date>-learn2pfed-selection.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch

from bench.common import TASKS, problems, write_results
from flows.learn2pfed import Problems, meta_epochs, selection_scores
from pfl_tasks.algorithms.learn2pfed import Cells
from pfl_tasks.algorithms.learn2pfed_meta import (
    client_metrics, make_optimizer, personalized_models, split_validation,
)
from pfl_tasks.config import load_params
from pfl_tasks.selection import Selection, paired_se, within_noise

KEY = "val/personalized/mse_mean"


def least_squares(train, test) -> dict[str, float]:
    xm = train.x * train.mask[..., None]
    gram, xty = xm.transpose(1, 2) @ xm, torch.einsum("mnd,mn->md", xm, train.y)
    local = torch.linalg.lstsq(gram, xty[..., None]).solution[..., 0]
    pooled = torch.linalg.solve(gram.sum(0), xty.sum(0)).expand_as(local)
    return {"local_ls": test.per_client_loss(local).mean().item(), "pooled_ls": test.per_client_loss(pooled).mean().item()}


def one_run(cfg, train, val, test, supervision: str, seed: int) -> dict:
    supervise, select, _ = (train, val, []) if supervision == "train" else split_validation(val)
    rows = Problems(train, supervise, select, test, torch.zeros(train.dim, dtype=torch.float64), "", "", "", ())
    cells = Cells(train, cfg.cells, cfg.tied, cfg.init.model_dump(), torch.Generator().manual_seed(seed), cfg.lambda_)
    opt, best = make_optimizer(cells, cfg.meta), Selection(higher_is_better=False)
    untrained = personalized_models(cells, train, rows.w0, cfg)
    initial, start = client_metrics(test, untrained)["mse"].mean().item(), selection_scores(select, untrained)[1]
    meta_epochs.fn(cells, opt, cfg, rows, 0, cfg.meta.epochs, best)
    last = personalized_models(cells, train, rows.w0, cfg)
    best.offer(cfg.meta.epochs, selection_scores(select, last)[1], {k: v.clone() for k, v in cells.state_dict().items()})
    cells.load_state_dict(best.state)
    selected = personalized_models(cells, train, rows.w0, cfg)
    beaten = not within_noise(start.mean - best.best.mean, paired_se(best.best, start))
    return {"selected_epoch": best.index, "argmax_epoch": best.best_index, "initial": initial,
            "start_beaten": beaten,
            "selected": client_metrics(test, selected)["mse"].mean().item(),
            "last": client_metrics(test, last)["mse"].mean().item()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for params_path, experiments in TASKS.items():
        params = load_params(params_path)
        for experiment in experiments[:1] if args.quick else experiments:
            cfg = params.learn2pfed[experiment]
            if args.quick:
                cfg = cfg.model_copy(update={"meta": cfg.meta.model_copy(update={"epochs": 30})})
            for seed in [0] if args.quick else [0, 1, 2]:
                train, val, test = problems(params, experiment, seed, cfg.bias)
                base = least_squares(train, test)
                for supervision in ("train", "val"):
                    rows.append({"task": experiment, "seed": seed, "supervision": supervision, **base,
                                 **one_run(cfg, train, val, test, supervision, seed)})
                    print(json.dumps(rows[-1]), flush=True)
        if args.quick:
            break
    lines = ["# Learn2pFed, meta-epoch selected on validation, polynomial tasks", "",
             f"{datetime.datetime.now().isoformat(timespec='seconds')}; `python -m bench.learn2pfed_selection`. Test MSE "
             "(x1e-4 on poly1-3, as is on the scarce variants), mean over 3 seeds; selected epochs per seed; "
             "at-or-below: seeds where the selected Theta's test MSE is at or below local least squares'. Selected: "
             "the latest meta-epoch within one paired standard error of the best on validation "
             "(`pfl_tasks.selection`); the argmax's epochs beside it. Untrained kept: seeds whose selection is "
             "meta-epoch 0 while the last Theta beat the initial one on test. Start kept: the selection were meta-epoch "
             "0 kept unless the best beats it beyond one paired standard error (test MSE; seeds where the best does).",
             "", "| task | supervision | initial | selected | last | start kept (beaten) | local LS | pooled LS "
             "| selected epochs | argmax epochs | untrained kept | at or below local LS |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for task in dict.fromkeys(r["task"] for r in rows):
        scale = 1.0 if "scarce" in task else 1e4
        for supervision in ("train", "val"):
            group = [r for r in rows if r["task"] == task and r["supervision"] == supervision]
            mean = {k: statistics.fmean(r[k] for r in group) * scale
                    for k in ("initial", "selected", "last", "local_ls", "pooled_ls")}
            anchored = statistics.fmean(r["selected"] if r["start_beaten"] else r["initial"] for r in group) * scale
            below = sum(r["selected"] <= r["local_ls"] for r in group)
            kept = sum(r["selected_epoch"] == 0 and r["last"] < r["initial"] for r in group)
            lines.append(f"| {task} | {supervision} | {mean['initial']:.4f} | {mean['selected']:.4f} | {mean['last']:.4f} "
                         f"| {anchored:.4f} ({sum(r['start_beaten'] for r in group)}/{len(group)}) | {mean['local_ls']:.4f} | {mean['pooled_ls']:.4f} "
                         f"| {', '.join(str(r['selected_epoch']) for r in group)} "
                         f"| {', '.join(str(r['argmax_epoch']) for r in group)} | {kept}/{len(group)} | {below}/{len(group)} |")
    write_results(f"learn2pfed-selection{'-quick' if args.quick else ''}", rows, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
