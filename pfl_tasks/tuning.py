"""Per-method tuning on validation: the `tune-<experiment>` stage (`flows.tune`).

Every method of an experiment with a `tuning.<experiment>` section runs, on its tuning seeds
at a fraction of the rounds, each point of its grid: the local learning rate (`lr`, for the
methods whose steps use it) times the values of its key hyper-parameters (`hyper.<method>`,
from its paper's range). Each point scores its validation metric at its selected round, mean
over the seeds; of the points within noise of the best, the one with the most keys inside
their grids is the method's choice (`choose`); the test split is read by nothing here. A best
point at a grid's edge widens that key's values one step past it (`widened`), within its
bounds, and the new points train, until no best point is at an edge it may pass or
`extensions` are spent; a choice that stays at an edge says why. The choices are a small committed file,
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
from pfl_tasks.selection import paired_se_over, within_noise

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


def tuning_seeds(params: Params, experiment: str) -> list[int]:
    cfg, exp = params.tuning[experiment], params.experiment(experiment)
    return list(cfg.seeds or exp.seeds[:2])


def points(params: Params, experiment: str, tried: dict[str, dict[str, list]] | None = None) -> dict[str, tuple[str, dict]]:
    """variant name (`ditto_lr0.1_mu0.01`) -> (its method, its grid point), over the `tried`
    grids (default: the configured ones)."""
    out = {}
    for run, grid in (tried or grids(params, experiment)).items():
        for values in itertools.product(*grid.values()):
            point = dict(zip(grid, values))
            name = "_".join([run, *(f"{key.rsplit('.', 1)[-1]}{label(v)}" for key, v in point.items())])
            if name in out:
                raise ConfigError(f"tuning.{experiment}: two grid points of {run} are named '{name}': "
                                  "give distinct values")
            out[name] = run, point
    return out


def tuning_params(raw: dict, params: Params, experiment: str, tried: dict[str, dict[str, list]] | None = None) -> dict:
    """The tuning's own params file: one experiment, `<experiment>-tune`, whose runs are every
    point of every method's `tried` grid (default: the configured one) on the tuning seeds,
    each at `rounds_fraction` of its rounds."""
    cfg, exp = params.tuning[experiment], params.experiment(experiment)
    raw = copy.deepcopy(raw)
    source = raw["experiments"][experiment]
    algorithms, run_overrides = dict(raw.get("algorithms") or {}), {}
    for name, (run, point) in points(params, experiment, tried).items():
        algorithms[name] = {**exp.hyper[run], "algorithm": exp.hyper[run].get("algorithm", run),
                            **{k: v for k, v in point.items() if k != LOCAL_LR}}
        rounds = math.ceil(cfg.rounds_fraction * exp.for_run(run).federation.rounds)
        own = copy.deepcopy((source.get("run_overrides") or {}).get(run) or {})
        own["federation"] = {**own.get("federation", {}), "rounds": rounds, "checkpoint_every": rounds}
        if LOCAL_LR in point:
            set_dotted(own, LOCAL_LR, point[LOCAL_LR], f"tuning.{experiment}")
        run_overrides[name] = own
    tune = {k: v for k, v in source.items() if k not in ("algorithm_overrides", "run_overrides")}
    tune.update(algorithms=list(run_overrides), seeds=tuning_seeds(params, experiment),
                run_overrides=run_overrides)
    raw.update(experiments={tune_name(experiment): tune}, algorithms=algorithms, learn2pfed={}, tables={},
               tuning={})
    parse_params(raw)
    return raw


def all_numbers(values: list) -> bool:
    """Whether a grid's values are all numbers (ints or floats, not bools): those it can widen."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def edges(grid: dict[str, list], chosen: dict) -> dict[str, str]:
    """key -> "low" or "high", for the keys whose choice is the smallest or largest of 2+
    numbers: the best may lie beyond."""
    out = {}
    for key, values in grid.items():
        if len(values) > 1 and all_numbers(values):
            if chosen[key] == min(values):
                out[key] = "low"
            elif chosen[key] == max(values):
                out[key] = "high"
    return out


def beyond(values: list, edge: str, bounds: list[float]) -> int | float | None:
    """The next value past the `edge` ("low" or "high") of a grid's numbers: the step between
    the two values at that edge again, as a ratio when both are positive (else a difference),
    to the fewest significant digits that still pass the edge (integers: at least one
    further), within `bounds`; None when the edge is at its bound."""
    ordered = sorted(values)
    high = edge == "high"
    last, inner = (ordered[-1], ordered[-2]) if high else (ordered[0], ordered[1])
    limit = bounds[1] if high else bounds[0]
    if (last >= limit) if high else (last <= limit):
        return None
    step = last * (last / inner) if last > 0 and inner > 0 else last + (last - inner)
    if all(isinstance(v, int) for v in values):
        step = max(math.ceil(step), last + 1) if high else min(math.floor(step), last - 1)
        return int(min(step, math.floor(limit)) if high else max(step, math.ceil(limit)))
    step = next((rounded for digits in (1, 2, 3) if (rounded := float(f"{step:.{digits}g}")) != last
                 and (rounded > last) == high), step)
    return min(step, limit) if high else max(step, limit)


def bounds_of(params: Params, experiment: str, run: str, key: str) -> list[float] | None:
    cfg = params.tuning[experiment]
    return cfg.lr_bounds if key == LOCAL_LR else cfg.hyper_bounds.get(run, {}).get(key)


def past_edge(params: Params, experiment: str, run: str, key: str, values: list, edge: str) -> int | float | None:
    """The value a widening adds past this edge of `run`'s `key`, or None (no bound, or at it)."""
    bounds = bounds_of(params, experiment, run, key)
    return None if bounds is None else beyond(values, edge, bounds)


def widened(params: Params, experiment: str, record: dict) -> dict[str, dict[str, list]]:
    """Each method's tried grid (`record`, from `choose`), with the next value past every edge
    its best point sits on, where its bounds allow (`beyond`): the best, not the choice, which
    may sit inside within noise of it, so that no method stops short of a better edge."""
    out = {}
    for run, entry in record["methods"].items():
        grid = {key: list(values) for key, values in entry["tried"].items()}
        for key, edge in (edges(grid, entry["best"]) if entry["best"] else {}).items():  # none finished: no edge
            value = past_edge(params, experiment, run, key, grid[key], edge)
            if value is not None:
                grid[key] = sorted([*grid[key], value])
        out[run] = grid
    return out


def edge_reason(params: Params, experiment: str, run: str, key: str, values: list, edge: str) -> str:
    """Why a choice stays at its grid's edge: no bound to widen into, the bound reached, or
    the widenings spent."""
    bounds = bounds_of(params, experiment, run, key)
    if bounds is None:
        where = "lr_bounds" if key == LOCAL_LR else f"hyper_bounds.{run}.{key}"
        return f"no bound to widen into (tuning.{experiment}.{where})"
    if beyond(values, edge, bounds) is None:
        return f"at its bound {bounds[1] if edge == 'high' else bounds[0]:g}"
    return f"{params.tuning[experiment].extensions} widenings spent"


def on_grid(grid: dict[str, list], chosen) -> bool:
    """`chosen` is one of the grid's points: its keys, each at one of its values, of its type."""
    def kind(value) -> str:
        return "bool" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else type(value).__name__

    return (isinstance(chosen, dict) and chosen.keys() == grid.keys()
            and all(any(kind(v) == kind(chosen[key]) and v == chosen[key] for v in values)
                    for key, values in grid.items()))


def inside(grid: dict[str, list], point: dict) -> int:
    """How many of a point's keys of 2+ numbers sit inside their grid, at neither end."""
    return sum(min(values) < point[key] < max(values) for key, values in grid.items()
               if len(values) > 1 and all_numbers(values))


def choose(params: Params, experiment: str, results: list, seconds: float,
           tried: dict[str, dict[str, list]] | None = None) -> dict:
    """The tuning file's content: per method its configured and `tried` grids, every point's
    validation metric, mean over the tuning seeds (or why it has none), and the standard error of
    its difference from the best point, paired over seeds and clients (`points_se`,
    `selection.paired_se_over`; None with a single pair: then only an exact tie counts as noise);
    the best point, and the choice: of the points within noise of the best
    (`selection.within_noise`), the one with the most keys inside their grids (`inside`), the
    better score next, the earlier point last, so that a choice sits at an edge only where the
    edge beats every point inside by more than noise; the edges it sits on with why each stays
    (were no widening to follow) and its compute. `results`: the tuning experiment's
    MethodResults (`pfl_tasks.reports`)."""
    by_name = {r.method: r for r in results}
    metric = next((r.metric for r in results), "acc")
    sign = 1 if HIGHER_IS_BETTER[metric] else -1
    cfg, seeds = params.tuning[experiment], tuning_seeds(params, experiment)
    tried = tried or grids(params, experiment)
    methods, every = {}, points(params, experiment, tried)
    for run, grid in grids(params, experiment).items():
        named = {name: point for name, (of, point) in every.items() if of == run}
        scores = {name: score(by_name.get(name), seeds) for name in named}
        best = best_point(scores, sign)
        se = {name: paired_se_over(by_name[best].val_clients, by_name[name].val_clients)
              for name, value in scores.items() if not isinstance(value, str)}
        choice = rule_choice(scores, se, named, tried[run], sign)
        chosen = named[choice] if choice else None
        at = edges(tried[run], chosen) if chosen else {}
        methods[run] = {
            "grid": grid, "tried": tried[run], "chosen": chosen, "val": scores.get(choice), "se": se.get(choice),
            "best": named[best] if best else None, "best_val": scores.get(best), "at_edge": list(at),
            "edge_reasons": {key: edge_reason(params, experiment, run, key, tried[run][key], edge)
                             for key, edge in at.items()},
            "points": scores, "points_se": se,
            "grad_samples": sum(by_name[n].grad_samples or 0 for n in named if n in by_name)}
    return {"experiment": experiment, "metric": metric, "selected_on": f"validation/personalized/{metric}_mean",
            "seeds": seeds, "rounds_fraction": cfg.rounds_fraction, "seconds": round(seconds), "methods": methods}


def best_point(scores: dict[str, float | str], sign: int) -> str | None:
    """The point with the best score (the earlier of ties), None where none finished."""
    finished = [name for name, value in scores.items() if not isinstance(value, str)]
    return max(finished, key=lambda name: sign * scores[name]) if finished else None


def rule_choice(scores: dict[str, float | str], se: dict[str, float | None], named: dict[str, dict],
                grid: dict[str, list], sign: int) -> str | None:
    """`choose`'s rule over points' `scores` and paired standard errors against the best (`se`):
    of the points within noise of the best, the one with the most keys inside the grid, the
    better score next, the earlier point last."""
    best = best_point(scores, sign)
    if best is None:
        return None
    tied = [name for name in se if within_noise(sign * (scores[best] - scores[name]), se[name] or 0.0)]
    return max(tied, key=lambda name: (inside(grid, named[name]), sign * scores[name]))


def score(result, seeds: list[int]) -> float | str:
    """A point's validation metric, mean over the tuning seeds, or why it has none."""
    if result is None:
        return "no result"
    if result.diverged:
        return "diverged"
    if not result.ranked or result.val is None or not set(seeds) <= set(result.seeds):
        return f"{len(result.seeds)}/{len(seeds)} seeds finished"
    return result.val


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
    unless it holds, for each method, a choice by `choose`'s rule over the configured grid,
    widened or not, that is one of the points it tried."""
    record, path = read_tuning(root, experiment), tuning_path(root, experiment)
    sign = 1 if record is None or HIGHER_IS_BETTER.get(record.get("metric"), True) else -1
    for run, grid in grids(params, experiment).items() if record is not None else ():
        entry = record["methods"].get(run)
        if (not isinstance(entry, dict) or entry.get("grid") != grid or not isinstance(entry.get("tried"), dict)
                or "best" not in entry):  # no "best": chosen by an earlier rule, blind to noise
            raise ConfigError(f"{path}: holds no choice for {run} over its grid {grid}: the grid or the tuning "
                              f"changed since; rerun `dvc repro tune-{experiment}`")
        chosen, tried = entry.get("chosen"), entry["tried"]  # chosen None: no grid point finished
        if chosen is not None and not on_grid(tried, chosen):
            raise ConfigError(f"{path}: methods.{run}.chosen is {chosen}, not a point of its grid {tried}: "
                              f"rerun `dvc repro tune-{experiment}`")
        named = {name: point for name, (of, point) in points(params, experiment, {run: tried}).items()}
        scores, se = entry.get("points"), entry.get("points_se")
        if (chosen is not None and isinstance(scores, dict) and isinstance(se, dict) and scores.keys() == named.keys()
                and (rule := rule_choice(scores, se, named, tried, sign)) is not None and named[rule] != chosen):
            raise ConfigError(f"{path}: methods.{run}.chosen is {chosen}, but its points choose {named[rule]}: "
                              f"edited by hand? Rerun `dvc repro tune-{experiment}`")
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
