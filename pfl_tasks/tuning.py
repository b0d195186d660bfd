"""Per-method tuning on validation: the `tune-<experiment>` stage (`flows.tune`).

Every method of an experiment with a `tuning.<experiment>` section runs, on one seed at a
fraction of the rounds, each point of its grid: the local learning rate (`lr`, for the methods
whose steps use it) times the values of its key hyper-parameters (`hyper.<method>`, from its
paper's range). The point best on validation at its selected round is the method's choice;
the test split is read by nothing here. The choices are a small committed file,
`tuning/<experiment>.json`, which the experiment's training runs read (`tuned`): a fresh
clone reuses it, and DVC reruns the stage when the grid, the experiment or the code changes.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path

from pfl_tasks.algorithms import build
from pfl_tasks.config import Params, ResolvedExperiment, RunOverride, parse_params, snapshot_read
from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER
from pfl_tasks.errors import ConfigError
from pfl_tasks.grid import label, set_dotted

TUNING = Path("tuning")
LOCAL_LR = "local.optimizer.lr"  # a grid's key for the local learning rate; the others are hyper-parameters


def tuning_path(root: Path, experiment: str) -> Path:
    return Path(root) / TUNING / f"{experiment}.json"


def tune_name(experiment: str) -> str:
    """The experiment (and MLflow experiment) the tuning runs train under."""
    return f"{experiment}-tune"


def grids(params: Params, experiment: str) -> dict[str, dict[str, list]]:
    """method -> its grid, key -> values (LOCAL_LR first)."""
    cfg, exp = params.tuning[experiment], params.experiment(experiment)
    return {run: {**({LOCAL_LR: list(cfg.lr)} if build(run, exp.hyper[run]).uses_local_lr else {}),
                  **cfg.hyper.get(run, {})}
            for run in exp.algorithms}


def points(params: Params, experiment: str) -> dict[str, tuple[str, dict]]:
    """variant name (`ditto_lr0.1_mu0.01`) -> (its method, its grid point)."""
    out = {}
    for run, grid in grids(params, experiment).items():
        for values in itertools.product(*grid.values()):
            point = dict(zip(grid, values))
            name = "_".join([run, *(f"{key.rsplit('.', 1)[-1]}{label(v)}" for key, v in point.items())])
            if name in out:
                raise ConfigError(f"tuning.{experiment}: two grid points of {run} are named '{name}': "
                                  "give distinct values")
            out[name] = run, point
    return out


def tuning_params(raw: dict, params: Params, experiment: str) -> dict:
    """The tuning's own params file: one experiment, `<experiment>-tune`, whose runs are every
    grid point of every method on the tuning seed, each at `rounds_fraction` of its rounds."""
    cfg, exp = params.tuning[experiment], params.experiment(experiment)
    raw = copy.deepcopy(raw)
    source = raw["experiments"][experiment]
    algorithms, run_overrides = dict(raw.get("algorithms") or {}), {}
    for name, (run, point) in points(params, experiment).items():
        algorithms[name] = {**exp.hyper[run], "algorithm": exp.hyper[run].get("algorithm", run),
                            **{k: v for k, v in point.items() if k != LOCAL_LR}}
        rounds = math.ceil(cfg.rounds_fraction * exp.for_run(run).federation.rounds)
        own = copy.deepcopy((source.get("run_overrides") or {}).get(run) or {})
        own["federation"] = {**own.get("federation", {}), "rounds": rounds, "checkpoint_every": rounds}
        if LOCAL_LR in point:
            set_dotted(own, LOCAL_LR, point[LOCAL_LR], f"tuning.{experiment}")
        run_overrides[name] = own
    tune = {k: v for k, v in source.items() if k not in ("algorithm_overrides", "run_overrides")}
    tune.update(algorithms=list(run_overrides), seeds=[exp.seeds[0] if cfg.seed is None else cfg.seed],
                run_overrides=run_overrides)
    raw.update(experiments={tune_name(experiment): tune}, algorithms=algorithms, learn2pfed={}, tables={},
               tuning={})
    parse_params(raw)
    return raw


def at_edge(grid: dict[str, list], chosen: dict) -> list[str]:
    """The keys whose choice is the smallest or largest of 2+ numbers: the best may lie beyond."""
    return [key for key, values in grid.items()
            if len(values) > 1 and all(isinstance(v, (int, float)) for v in values)
            and chosen[key] in (min(values), max(values))]


def on_grid(grid: dict[str, list], chosen) -> bool:
    """`chosen` is one of the grid's points: its keys, each at one of its values, of its type."""
    def kind(value) -> str:
        return "bool" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else type(value).__name__

    return (isinstance(chosen, dict) and chosen.keys() == grid.keys()
            and all(any(kind(v) == kind(chosen[key]) and v == chosen[key] for v in values)
                    for key, values in grid.items()))


def choose(params: Params, experiment: str, results: list, seconds: float) -> dict:
    """The tuning file's content: per method its grid, every point's validation metric (or why
    it has none), the choice (the best on validation; the earlier point on a tie) and its
    compute. `results`: the tuning experiment's MethodResults (`pfl_tasks.reports`)."""
    by_name = {r.method: r for r in results}
    metric = next((r.metric for r in results), "acc")
    better = max if HIGHER_IS_BETTER[metric] else min
    cfg = params.tuning[experiment]
    methods, every = {}, points(params, experiment)
    for run, grid in grids(params, experiment).items():
        named = {name: point for name, (of, point) in every.items() if of == run}
        scores = {}
        for name in named:
            r = by_name.get(name)
            scores[name] = (r.val if r is not None and r.ranked and r.val is not None
                            else "diverged" if r is not None and r.diverged else "no result")
        finished = [name for name, score in scores.items() if not isinstance(score, str)]
        best = better(finished, key=lambda name: scores[name]) if finished else None
        chosen = named[best] if best else None
        methods[run] = {"grid": grid, "chosen": chosen, "val": scores.get(best),
                        "at_edge": at_edge(grid, chosen) if chosen else [], "points": scores,
                        "grad_samples": sum(by_name[n].grad_samples or 0 for n in named if n in by_name)}
    exp = params.experiment(experiment)
    return {"experiment": experiment, "metric": metric, "selected_on": f"validation/personalized/{metric}_mean",
            "seed": exp.seeds[0] if cfg.seed is None else cfg.seed, "rounds_fraction": cfg.rounds_fraction,
            "seconds": round(seconds), "methods": methods}


def read_tuning(root: Path, experiment: str) -> dict | None:
    """The tuning file (None when there is none), as the stage first read it (`snapshot_read`)."""
    path = tuning_path(root, experiment)
    try:
        text = snapshot_read(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err}") from None
    try:
        record = json.loads(text)
        if not isinstance(record, dict) or not isinstance(record.get("methods"), dict):
            raise ValueError("no 'methods' mapping")
    except ValueError as err:
        raise ConfigError(f"{path}: not a tuning file ({err}): rerun `dvc repro -f tune-{experiment}`") from None
    return record


def checked_tuning(params: Params, experiment: str, root: Path) -> dict | None:
    """The experiment's tuning file (None when there is none), refused in one line naming it
    unless it holds, for each method, a choice over the configured grid that is one of its points."""
    record, path = read_tuning(root, experiment), tuning_path(root, experiment)
    for run, grid in grids(params, experiment).items() if record is not None else ():
        entry = record["methods"].get(run)
        if not isinstance(entry, dict) or entry.get("grid") != grid:
            raise ConfigError(f"{path}: holds no choice for {run} over its grid {grid}: the grid changed since; "
                              f"rerun `dvc repro tune-{experiment}`")
        chosen = entry.get("chosen")  # None: no grid point finished
        if chosen is not None and not on_grid(grid, chosen):
            raise ConfigError(f"{path}: methods.{run}.chosen is {chosen}, not a point of its grid {grid}: "
                              f"rerun `dvc repro tune-{experiment}`")
    return record


def tuned(params: Params, experiment: str, root: Path) -> ResolvedExperiment:
    """`experiment` as its training runs see it: each method at its tuning's choice when the
    experiment has a `tuning` section (`checked_tuning`), else as configured."""
    exp = params.experiment(experiment)
    if experiment not in params.tuning:
        return exp
    record, path = checked_tuning(params, experiment, root), tuning_path(root, experiment)
    if record is None:
        raise ConfigError(f"{path}: missing: tune first (`dvc repro tune-{experiment}` or "
                          f"`python -m flows.tune {experiment}`)")
    hyper, run_overrides = dict(exp.hyper), dict(exp.run_overrides)
    for run in grids(params, experiment):
        chosen = record["methods"][run]["chosen"]
        if chosen is None:  # the configured values, and the report says so
            continue
        hyper[run] = {**hyper[run], **{k: v for k, v in chosen.items() if k != LOCAL_LR}}
        if LOCAL_LR in chosen:
            own = run_overrides.get(run, RunOverride()).model_dump()
            set_dotted(own, LOCAL_LR, chosen[LOCAL_LR], str(path))
            run_overrides[run] = RunOverride.model_validate(own)
    return exp.model_copy(update={"hyper": hyper, "run_overrides": run_overrides})
