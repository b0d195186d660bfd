"""`learn2pfed` stage: Learn2pFed's meta-parameters trained downstream of an experiment.

For every supervision signal (`train`, `val`) and seed of the experiment, one Prefect flow
run: `problems` (each client's data as stacks; for classification, features from the body of
the upstream `train` checkpoint named by `features_from`, whose head also starts w), then
`meta-epochs-A-B` tasks of `meta.checkpoint_every` outer steps, each followed by a checkpoint,
each step scoring the Theta it starts from on the clients' validation rows (the held-out half
under `val` supervision), then `evaluate`: the Theta selected on validation, and the last one,
on every client's validation and test splits (`selected/...`, `final/...`; the reports judge the
plateau on its validation curve).

    python -m flows.learn2pfed <experiment> [--on-config-change refuse|restart|resume]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from flows.environment import local_defaults
from flows.precheck import check_params_first


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--on-config-change", choices=["refuse", "restart", "resume"], default="refuse")
    return parser


if __name__ == "__main__":  # --help, and a command-line or config error, answer before Prefect, MLflow and torch load
    local_defaults()
    first = arguments().parse_args()
    check_params_first("learn2pfed", first.params, first.experiment)

import pandas as pd
import torch
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.stage import check_prefect_api, prefect_api, stage_main, stage_name
from pfl_tasks.algorithms import build, source_file, validate_params
from pfl_tasks.algorithms.learn2pfed import Cells, Problem
from pfl_tasks.algorithms.learn2pfed_meta import (
    HELD_OUT_HALF, client_metrics, costs, evaluate, make_optimizer, meta_step, padded_problem, participation,
    participation_table, personalized_models, split_validation, theta,
)
from pfl_tasks.config import Learn2pFedConfig, ResolvedExperiment, config_hash, load_params, setting_hash
from pfl_tasks.data import FederatedData, load_partition, partition_dir
from pfl_tasks.data.store import read_manifest
from pfl_tasks.engine.checkpoint import load_checkpoint, save_checkpoint
from pfl_tasks.engine.device import configure, platform, torch_threads, usable_cores
from pfl_tasks.engine.federation import tree_mismatch
from pfl_tasks.errors import CheckpointError, ConfigError
from pfl_tasks.code_deps import ROOT, code_hash, numeric_code
from pfl_tasks.nets import build_net, embed, head_keys, split_net
from pfl_tasks.outputs import write_client_tables, write_csv
from pfl_tasks.reports.figures import PARTICIPATION_CSV, participation_figure_of, save_figure
from pfl_tasks.runs import Run, RunPaths
from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER
from pfl_tasks.selection import PRIMARY, Score, Selection, final_metrics, summarize_eval, validation_score
from pfl_tasks.tracking import flatten, open_store, run_tags, tracking_uri
from pfl_tasks.training import finished
from pfl_tasks.tuning import tuned

TASK_OPTIONS = dict(cache_policy=NO_CACHE, persist_result=False)


@dataclass(frozen=True)
class Problems:
    train: object  # every training row: the cells fit these
    supervise: object  # rows the meta loss is taken on: train's, or half of each client's validation rows
    select: object  # rows the meta-epoch is selected on: the validation split's, or its other half
    test: object
    w0: torch.Tensor
    upstream: str  # hash of the upstream checkpoint ("" for regression)
    data_hash: str
    partition: str
    client_names: tuple[str, ...]


def learn2pfed_code(params, experiment: str) -> list[Path]:
    """The code that can change a Learn2pFed run's numbers: this flow (its meta-training
    loop), the Learn2pFed modules, the round runtime and the selection rules (`numeric_code`), with the module of
    the algorithm whose checkpoint gives its features, if any; not the tracking and outputs."""
    upstream = params.learn2pfed[experiment].features_from
    hyper = params.experiment(experiment).hyper
    modules = [ROOT / "pfl_tasks/algorithms/learn2pfed.py", ROOT / "pfl_tasks/algorithms/learn2pfed_meta.py"]
    code = numeric_code(*modules, *([source_file(upstream, hyper[upstream])] if upstream else []))
    return sorted({Path(__file__).relative_to(ROOT), *code})


def first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"


def upstream_checkpoint(params, experiment: str, run_name: str, seed: int, root: Path) -> tuple[Path, dict]:
    """The checkpoint of `run_name`'s `train` run that gives the features, and the run's
    hyper-parameters: those of a run finished under the train stage's current params (tuning
    included), data and code; errors name the stage to run."""
    trained = tuned(params, experiment, root)
    exp = trained.for_run(run_name, seed)
    paths = RunPaths.of(root, exp.name, run_name, seed)
    outcome, why = finished(exp, run_name, trained.hyper[run_name], root)
    if outcome is not None:
        return paths.checkpoint, trained.hyper[run_name]
    if why.endswith("says diverged"):
        raise ConfigError(f"learn2pfed.{exp.name}.features_from: '{run_name}' diverged ({paths.metrics}): "
                          "no trained body to take features from")
    raise CheckpointError(f"{paths.checkpoint}: not a finished run of the current params, data and code of "
                          f"{stage_name('train', exp.name)} ({why}): run `dvc repro {stage_name('train', exp.name)}` first")


def check_inputs(params, experiment: str, root: Path) -> None:
    """What every run of `experiment` reads and writes, checked before the store opens and
    Prefect starts: each seed's partition, each run's output folders and, for classification,
    the upstream checkpoint."""
    exp, cfg = params.experiment(experiment), params.learn2pfed[experiment]
    upstream = cfg.features_from
    for seed in exp.seeds:
        for supervision in cfg.supervision:
            RunPaths.of(root, f"learn2pfed/{exp.name}", f"learn2pfed-{supervision}", seed).check_writable()
        manifest = read_manifest(partition_dir(root, exp.dataset, seed))
        if manifest.task == "classification" and upstream is not None:
            upstream_checkpoint(params, experiment, upstream, seed, root)


def upstream_features(exp: ResolvedExperiment, params, data: FederatedData, run_name: str, root: Path):
    """(features, w0, hash): the trained body of `run_name`'s checkpoint as a frozen feature
    map, its head [classes, hidden + 1] flattened as the cells' starting w."""
    (path, hyper), where = upstream_checkpoint(params, exp.name, run_name, exp.seed, root), \
        f"learn2pfed.{exp.name}.features_from"
    ckpt = load_checkpoint(path, {"experiment": exp.name, "algorithm": run_name})
    try:
        model = build(run_name, hyper).global_model(ckpt["server"], ckpt["clients"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path}: no global model in its state ({first_line(err)})") from None
    if model is None:
        raise ConfigError(f"{where}: '{run_name}' has no global model to take a body from")
    if len(head_keys(model)) != 2 or len(model) == 2:
        raise ConfigError(f"{where}: '{run_name}' needs a body and a last layer with weight and bias")
    net = build_net(exp.model, data.feature_shape, data.n_outputs)
    problem = tree_mismatch({k: v.detach() for k, v in net.named_parameters()}, model, "its global model")
    if problem is not None:
        raise CheckpointError(f"{path}: not a model of learn2pfed.{exp.name}'s experiment: {problem}")
    body, body_params, _, head = split_net(net, model)

    @torch.no_grad()
    def features(x):
        return embed(body, body_params, x)

    weight, bias = (head[k] for k in sorted(head, key=lambda k: k.endswith("bias")))
    w0 = torch.cat([weight, bias[:, None]], 1).flatten().double()
    return features, w0, hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@task(**TASK_OPTIONS, task_run_name="problems")
def build_problems(exp, params, cfg: Learn2pFedConfig, supervision: str, root: Path) -> Problems:
    data = load_partition(partition_dir(root, exp.dataset, exp.seed))
    n_classes = data.n_classes if data.task == "classification" else 0
    if n_classes:
        if cfg.features_from is None:
            raise ConfigError(f"learn2pfed.{exp.name}.features_from: classification needs an upstream algorithm")
        features, w0, upstream = upstream_features(exp, params, data, cfg.features_from, root)
    else:
        def features(x):
            flat = x.flatten(1)
            return torch.cat([flat, torch.ones(len(x), 1)], 1) if cfg.bias else flat

        w0, upstream = torch.zeros(features(data.train.x[:1]).shape[1], dtype=torch.float64), ""
    train_features = features(data.train.x)
    train = padded_problem(data.train, train_features, n_classes)
    val = padded_problem(data.val, features(data.val.x), n_classes, name="validation")
    supervise, select, single = (train, val, []) if supervision == "train" else split_validation(val)
    if single:
        print(f"{exp.name} seed {exp.seed}: learn2pfed-val: clients {single} have one validation row, which both "
              "fits the meta loss and selects the meta-epoch", file=sys.stderr)
    test = padded_problem(data.test, features(data.test.x), n_classes, name="test")
    return Problems(train, supervise, select, test, w0, upstream, data.manifest_hash, data.partition, data.client_names)


def selection_scores(select: Problem, v: torch.Tensor) -> tuple[dict[str, float], Score]:
    """The personalized models' `val/personalized/...` aggregates on the selection rows
    `select`, and their `validation_score` (what `Selection` is offered)."""
    personalized = client_metrics(select, v, by_row=True)
    rows = personalized.pop("rows")
    metrics = {"val": {"personalized": personalized}}
    return summarize_eval(metrics), validation_score(metrics, TASK[bool(select.n_classes)], rows)


TASK = {True: "classification", False: "regression"}  # by whether the problem has classes


def task_of(problems: Problems) -> str:
    return TASK[bool(problems.test.n_classes)]


@task(**TASK_OPTIONS, task_run_name="meta-epochs-{start}-{stop}")
def meta_epochs(cells, opt, cfg, problems: Problems, start: int, stop: int, selection: Selection) -> list[dict]:
    """Meta-steps `start` to `stop`: each one's losses and the validation scores of the Theta it
    starts from, which `selection` is offered."""
    out = []
    for epoch in range(start, stop):
        state = theta(cells)
        loss, fit_loss, v = meta_step(cells, opt, cfg, epoch, problems.train, problems.supervise, problems.w0)
        scores, score = selection_scores(problems.select, v)
        selection.offer(epoch, score, state)
        out.append({"epoch": epoch, "meta/loss": loss, "meta/fit_loss": fit_loss, **scores})
    return out


@task(**TASK_OPTIONS, task_run_name="checkpoint-{epoch}")
def checkpoint(path: Path, epoch: int, payload: dict):
    save_checkpoint(path, payload)


@task(**TASK_OPTIONS, task_run_name="evaluate")
def evaluate_clients(cells, cfg, problems: Problems) -> dict:
    """Per-client metrics of `cells`' personalized models: split -> model -> metric -> [M]."""
    return {split: evaluate(cells, problems.train, rows, problems.w0, cfg)
            for split, rows in (("val", problems.select), ("test", problems.test))}


@flow(name="pfl-learn2pfed", flow_run_name="{experiment}-learn2pfed-{supervision}-seed{seed}",
      persist_result=False)
def learn2pfed_flow(experiment: str, supervision: str, seed: int, params_path: str = "params.yaml",
                    root: str = ".", on_config_change: str = "refuse") -> dict[str, float]:
    from prefect.runtime import flow_run

    params = validate_params(load_params(params_path))
    exp = params.experiment(experiment).model_copy(update={"seed": seed})
    cfg, root = params.learn2pfed[experiment], Path(root)
    configure(exp.engine, torch.device("cpu"))  # the cells run on the CPU, in float64
    run_name = f"learn2pfed-{supervision}"
    paths = RunPaths.of(root, f"learn2pfed/{exp.name}", run_name, seed)
    problems = build_problems(exp, params, cfg, supervision, root)
    data_hash = problems.data_hash
    config = {
        "experiment": exp.model_dump(mode="json", exclude={"engine", "algorithms", "hyper", "seeds", "federation", "local",
                                                         "run_overrides"}),
        "learn2pfed": cfg.model_dump(mode="json", exclude={"supervision": True, "meta": {"epochs", "checkpoint_every"}}),
        "supervision": supervision, "data": data_hash, "upstream": problems.upstream, "code": code_hash(learn2pfed_code(params, experiment)),
    }
    identity = {"experiment": exp.name, "algorithm": run_name, "config_hash": config_hash(config),
                "setting_hash": setting_hash(config), "config": json.dumps(config, sort_keys=True)}

    task_kind = task_of(problems)

    def initial_cells() -> Cells:
        return Cells(problems.train, cfg.cells, cfg.tied, cfg.init.model_dump(), torch.Generator().manual_seed(seed),
                     cfg.lambda_)

    cells = initial_cells()
    opt = make_optimizer(cells, cfg.meta)
    metric = PRIMARY[task_kind]
    key = f"val/personalized/{metric}_mean"
    selection = Selection(HIGHER_IS_BETTER[metric])
    with Run(paths, identity, params.tracking, seed, total=cfg.meta.epochs, unit="epoch",
             on_config_change=on_config_change) as run:
        history = []  # {"epoch", "meta/loss" (supervised), "meta/fit_loss"} per meta-epoch
        if run.resumed is not None:
            try:
                cells.load_state_dict(run.resumed["cells"])
                opt.load_state_dict(run.resumed["optimizer"])
                history = run.resumed["history"]
                selection = Selection.from_dict(run.resumed["selection"])
            except CheckpointError as err:
                raise CheckpointError(f"{paths.checkpoint}: {err}") from None
            except (KeyError, TypeError, ValueError, RuntimeError) as err:
                raise CheckpointError(f"{paths.checkpoint}: not this run's state ({first_line(err)})") from None
            print(f"{run.label}: resuming from meta-epoch {len(history)}")
        run.track(exp.name,
                  flatten({"experiment": exp.model_dump(mode="json", exclude={"hyper"}),
                           "learn2pfed": cfg.model_dump(mode="json"), "supervision": supervision}),
                  run_tags(exp, task_kind, problems.partition, run_name, "learn2pfed", "Lv et al., arXiv:2401.08327",
                           data_hash, identity["config_hash"], identity["setting_hash"], str(flow_run.id))
                  | {"engine.torch_threads": str(torch.get_num_threads())}
                  | {f"platform.{key}": value for key, value in platform(exp.engine, torch.device("cpu")).items()}
                  | ({"validation_rows": HELD_OUT_HALF} if supervision == "val" else {}))
        run.log(history)

        def snapshot() -> dict:
            return {**identity, "round": len(history), "budget": cfg.meta.epochs, "cells": cells.state_dict(),
                    "optimizer": opt.state_dict(), "selection": selection.as_dict(),
                    "history": history, "mlflow_run_id": run.tracker.run_id, "seed": seed}

        run.snapshot = snapshot

        def advance(start: int, stop: int) -> tuple[int, str] | None:
            history.extend(meta_epochs(cells, opt, cfg, problems, start, stop, selection))
            broken = [h["epoch"] for h in history[start:] if not math.isfinite(h["meta/loss"])]
            if broken or not all(torch.isfinite(p).all() for p in cells.parameters()):
                at = broken[0] + 1 if broken else stop
                return at, f"meta loss or Theta not finite after meta-epoch {at}"
            return None

        every = cfg.meta.checkpoint_every
        diverged = run.play(len(history), every, advance, checkpoint, every, history,
                            lambda stop: f"meta loss={history[-1]['meta/loss']:.4f}, {key}={history[-1][key]:.4f}")
        if diverged is not None:
            return run.diverged(*diverged, [])

        epochs = cfg.meta.epochs  # the last Theta, after every step, is a candidate too
        selection.offer(epochs, selection_scores(problems.select, personalized_models(cells, problems.train, problems.w0, cfg))[1],
                        theta(cells))
        selected = copy.deepcopy(cells)
        selected.load_state_dict(selection.state)
        tables = {"selected": evaluate_clients(selected, cfg, problems), "last": evaluate_clients(cells, cfg, problems)}
        spent = costs(problems.train, problems.supervise, cfg)
        evaluations = [{"round": selection.index, **summarize_eval(tables["selected"]), **spent},
                       {"round": epochs, **summarize_eval(tables["last"]), **spent}]
        # the last Theta's score ends the validation curve (the history's epoch e scores the Theta
        # that epoch starts from), on which the reports judge the plateau
        final = {**final_metrics(evaluations, 0), key: evaluations[1][key]}
        final.update({"meta/loss_first": history[0]["meta/loss"], "meta/loss_last": history[-1]["meta/loss"],
                      "meta/fit_loss_last": history[-1]["meta/fit_loss"]})
        # the untrained Theta's test score: what the meta-training is measured against (reported, never selected on)
        untrained = evaluate(initial_cells(), problems.train, problems.test, problems.w0, cfg)
        final.update({f"initial/{k}": v for k, v in summarize_eval({"test": untrained}).items()
                      if k.endswith(f"/{metric}_mean")})
        lam = participation(selected)
        final["participation/lam_mean"] = lam.mean().item()
        if lam.shape[-1] <= 16:  # per coordinate, for the interpretable regression tasks
            final.update({f"participation/lam_mean_{j}": v for j, v in enumerate(lam.mean((0, 1)).tolist())})

        def artifacts(tmp: Path) -> None:
            write_client_tables(tmp, tables, problems.client_names)
            table = participation_table(initial_cells(), selected, problems.train)
            write_csv(tmp / PARTICIPATION_CSV, table)
            fig = participation_figure_of({f"{run_name}, seed {seed}": pd.DataFrame(table)},
                                          f"{exp.name}: Learn2pFed's participation at meta-epoch {selection.index}")
            save_figure(fig, tmp / "participation.png")

        run.finish(final, [{"epoch": h["epoch"], "meta_loss": h["meta/loss"], "fit_loss": h["meta/fit_loss"],
                            "val": h[key]} for h in history], artifacts)
    print(f"{run.label}: meta-epoch {selection.index} selected on validation; " + ", ".join(
        f"{k}={v:.4f}" for k, v in final.items() if k.startswith("selected/test/") and k.endswith(("acc_mean", "mse_mean"))))
    return final


def run_experiment(experiment: str, params_path: str = "params.yaml", root: str = ".",
                   on_config_change: str = "refuse") -> dict[tuple[str, int], dict[str, float]]:
    params = validate_params(load_params(params_path))
    if experiment not in params.learn2pfed:
        raise ConfigError(f"learn2pfed: no entry '{experiment}' (have: {sorted(params.learn2pfed)})")
    exp = params.experiment(experiment)
    check_inputs(params, experiment, Path(root))
    check_prefect_api()
    open_store(tracking_uri(params.tracking.mlflow_uri), params.tracking.retry_seconds)
    print(f"{experiment}: learn2pfed on {torch_threads(exp.engine)} torch thread(s) (engine.threads: "
          f"{exp.engine.threads}; {usable_cores()} cores)")
    with prefect_api():
        return {
            (supervision, seed): learn2pfed_flow(experiment, supervision, seed, params_path, root, on_config_change)
            for supervision in params.learn2pfed[experiment].supervision
            for seed in exp.seeds
        }


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    return stage_main("learn2pfed", lambda: run_experiment(args.experiment, args.params, ".", args.on_config_change))


if __name__ == "__main__":
    sys.exit(main())
