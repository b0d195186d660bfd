"""Learn2pFed's two open choices measured: Lambda_i diagonal (the paper's text) or full (the
authors' code), and the meta loss over clients (the paper's text) or over pooled rows (the
authors' code), on the polynomial tasks (poly1-poly3 and their data-scarce variants), 3 seeds.

A third form, measured here only: `log-cholesky`, a full Lambda_i = L L^T + FLOOR I stepped on
a scale that cannot jump. The library's full form steps L's entries on their plain scale, so
Adam at lr 0.05 moves a diagonal of about 0.02 by 0.05 a step (its Lambda went from 4e-4 to
about 0.3 in 10 steps); here L = diag(exp(s)) (I + N), N strictly lower triangular: each step
scales a row of L by at most about exp(lr) and turns it by about lr, whatever its size.

Each (task, seed) trains Theta under both supervision signals with each of the six
combinations, in this process (no Prefect, no MLflow: the library's meta-training as the
`learn2pfed` stage runs it, on the same partitions, its meta-epoch selected on validation as
the stage selects it). The choice is made on the validation MSE of `train`-supervised runs
(whose meta loss never sees the validation split); test MSE of both signals is reported beside
it, never chosen on.

    python -m bench.studies.learn2pfed_options            # 32 minutes on 2 cores beside another 1-thread job
    python -m bench.studies.learn2pfed_options --quick    # one task, one seed, 20 meta-epochs: a smoke run
    python -m bench.studies.learn2pfed_options --held-out # `train` supervision, selected and scored on disjoint halves

Writes bench/results/<date>-learn2pfed-options.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import statistics
import sys
import time

import torch

from bench.common import TASKS, problems
from bench.paths import result_stem
from flows.learn2pfed import selection_scores
from pfl_tasks.algorithms.learn2pfed import FLOOR, Cells
from pfl_tasks.algorithms.learn2pfed_meta import (
    evaluate, make_optimizer, meta_step, personalized_models, split_validation,
    theta,
)
from pfl_tasks.config import load_params
from pfl_tasks.selection import Selection

COMBOS = list(itertools.product(("diagonal", "full", "log-cholesky"), ("clients", "pooled")))


class LogCholeskyCells(Cells):
    """The full form with L = diag(exp(s)) (I + N) (see the module doc), from the same start:
    s = log sqrt(lam U), N = 0, so Lambda starts at the same diagonal."""

    def __init__(self, *args):
        super().__init__(*args, "full")
        with torch.no_grad():
            raw = self.raw["lam"]
            raw.copy_(torch.diag_embed(raw.diagonal(dim1=-2, dim2=-1).log()))

    def values(self, cell: int) -> dict[str, torch.Tensor]:
        out = super().values(cell)
        raw = self.raw["lam"][min(cell, len(self.raw["lam"]) - 1)]
        eye = torch.eye(raw.shape[-1], dtype=raw.dtype)
        factor = raw.diagonal(dim1=-2, dim2=-1).exp()[..., :, None] * (eye + raw.tril(-1))
        out["lam"] = factor @ factor.transpose(-1, -2) + FLOOR * eye
        return out


def one_run(cfg, form: str, train, supervise, select, val, test, seed: int) -> dict:
    """Theta meta-trained on the `supervise` rows, its meta-epoch selected on the `select` rows
    as the stage selects it (every meta-epoch, and the last Theta); val and test MSE of that one."""
    w0 = torch.zeros(train.dim, dtype=torch.float64)
    args = (train, cfg.cells, cfg.tied, cfg.init.model_dump(), torch.Generator().manual_seed(seed))
    cells = LogCholeskyCells(*args) if form == "log-cholesky" else Cells(*args, cfg.lambda_)
    opt, best = make_optimizer(cells, cfg.meta), Selection(higher_is_better=False)

    def offer(epoch: int, v: torch.Tensor, state: dict) -> None:
        best.offer(epoch, selection_scores(select, v)[1], state)

    for epoch in range(cfg.meta.epochs):
        state = theta(cells)
        loss, _, v = meta_step(cells, opt, cfg, epoch, train, supervise, w0)
        if not math.isfinite(loss):
            return {"diverged": True}
        offer(epoch, v, state)
    offer(cfg.meta.epochs, personalized_models(cells, train, w0, cfg), theta(cells))
    cells.load_state_dict(best.state)
    mse = {split: evaluate(cells, train, problem, w0, cfg)["personalized"]["mse"].mean().item()
           for split, problem in (("val", val), ("test", test))}
    return {"diverged": False, **mse, "selected_epoch": best.index, "meta_loss_last": loss}


def measure(quick: bool, held_out: bool) -> dict:
    """Every combination on every task and seed; with `held_out`, `train` supervision only, the
    meta-epoch selected on one half of each client's validation rows (alternate positions, as
    `val` supervision splits them) and the reported validation MSE taken on the other half, so
    that the rows that select a run do not also score it."""
    rows = []
    for params_path, experiments in TASKS.items():
        params = load_params(params_path)
        for experiment in experiments[:1] if quick else experiments:
            base = params.learn2pfed.get(experiment) or params.learn2pfed.get("poly2")
            seeds = params.experiment(experiment).seeds[:1] if quick else params.experiment(experiment).seeds
            for seed in seeds:
                train, val, test = problems(params, experiment, seed, base.bias)
                halves = split_validation(val)
                for (form, loss), supervision in itertools.product(COMBOS, ("train",) if held_out else ("train", "val")):
                    cfg = base.model_copy(update={"lambda_": "full" if form == "log-cholesky" else form,
                                                  "meta_loss": loss})
                    if quick:
                        cfg = cfg.model_copy(update={"meta": cfg.meta.model_copy(update={"epochs": 20})})
                    start = time.perf_counter()
                    supervise, select = (train, val) if supervision == "train" else halves[:2]
                    scored = val
                    if held_out:  # a client with a single validation row has it in both halves
                        select, scored = halves[:2]
                    out = one_run(cfg, form, train, supervise, select, scored, test, seed)
                    rows.append({"task": experiment, "seed": seed, "lambda": form, "meta_loss": loss,
                                 "supervision": supervision, "seconds": time.perf_counter() - start, **out})
                    print(f"  {experiment} seed {seed} {form}/{loss} ({supervision}): "
                          + ("diverged" if out["diverged"] else f"val {out['val']:.4f} test {out['test']:.4f}"),
                          flush=True)
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "quick": quick, "held_out": held_out,
            "rows": rows}


def mean_sd(values: list[float]) -> str:
    if not values:
        return "–"
    sd = f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.4f}{sd}"


def markdown(result: dict) -> str:
    rows = result["rows"]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    head = " | ".join(f"{form}/{loss}" for form, loss in COMBOS)
    out = [f"# Learn2pFed: Lambda diagonal, full or log-Cholesky, meta loss over clients or pooled rows "
           f"({result['date']})", "", "Every run at its meta-epoch selected on validation, as the stage selects it."
           + (" Held out: selected on one half of each client's validation rows (alternate positions), every "
              "validation MSE below taken on the other half." if result.get("held_out") else ""), ""]
    for title, supervision, split in (("validation MSE, train-supervised (the choice is made here)", "train", "val"),
                                      ("test MSE, train-supervised", "train", "test"),
                                      ("test MSE, val-supervised", "val", "test")):
        if not any(r["supervision"] == supervision for r in rows):
            continue
        out += [f"## {title}: mean ± sd over seeds, personalized model, mean over clients", "",
                f"| task | {head} |", "|---" * (len(COMBOS) + 1) + "|"]
        for task in tasks:
            cells = []
            for form, loss in COMBOS:
                picked = [r for r in rows if (r["task"], r["lambda"], r["meta_loss"], r["supervision"]) ==
                          (task, form, loss, supervision)]
                values = [r[split] for r in picked if not r["diverged"]]
                failed = len(picked) - len(values)
                cells.append(mean_sd(values) + (f" ({failed} diverged)" if failed else ""))
            out.append(f"| {task} | " + " | ".join(cells) + " |")
        out.append("")
    ranks = {combo: [] for combo in COMBOS}
    for task in tasks:
        means = {combo: round(statistics.mean(r["val"] for r in rows if not r["diverged"] and
                                              (r["task"], r["lambda"], r["meta_loss"], r["supervision"]) ==
                                              (task, *combo, "train")), 4) for combo in COMBOS}
        for combo, value in means.items():  # ties (to the 4 decimals shown) share their mean rank
            ranks[combo].append(sum(v < value for v in means.values()) + (sum(v == value for v in means.values()) + 1) / 2)
    selected = {combo: [r["selected_epoch"] for r in rows if not r["diverged"] and r["supervision"] == "train"
                        and (r["lambda"], r["meta_loss"]) == combo] for combo in COMBOS}
    out += ["Selected meta-epochs of the train-supervised runs (median, range): " + ", ".join(
        f"{form}/{loss} {statistics.median(e):.0f} ({min(e)}-{max(e)})" for (form, loss), e in selected.items() if e), ""]
    out.append("Mean rank over the tasks of the validation MSE above (train-supervised; 1 = lowest, ties share "
               "their mean rank): " + ", ".join(f"{form}/{loss} {statistics.mean(r):.2f}" for (form, loss), r in ranks.items()))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--held-out", action="store_true", help="select on half the validation rows, score on the other")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.quick, args.held_out)
    suffix = ("-held-out" if args.held_out else "") + ("-quick" if args.quick else "")
    stem = result_stem(f"learn2pfed-options{suffix}")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
