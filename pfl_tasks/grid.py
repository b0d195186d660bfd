"""A sweep's grid expanded into its own params file: overrides applied, a grid over an
algorithm's hyper-parameters as variants of one experiment (`ditto_mu0.1`), a grid over any
other key as one experiment per value (`digits-lr-lr0.1`), validated like params.yaml; and a
command line's `key=v1,v2` read as such a grid."""

from __future__ import annotations

import copy
import itertools
import json
import re
from typing import Any

import yaml

from pfl_tasks.config import ParamsLoader, SweepConfig, parse_params, read_params
from pfl_tasks.errors import ConfigError


def sweep_params(sweep: SweepConfig) -> dict:
    """The sweep's own params file: only its experiment (one per point of the non-algorithm
    grid), renamed, with the overrides applied and the grid's variants; validated like
    params.yaml, so an error names the offending key."""
    raw = read_params(sweep.params_path)
    for dotted, value in sweep.overrides.items():
        set_dotted(raw, dotted, value, "sweep.overrides")
    experiments = raw.get("experiments") or {}
    if sweep.experiment not in experiments:
        raise ConfigError(f"sweep.experiment: '{sweep.experiment}' is not in {sweep.params_path} "
                          f"(have: {sorted(experiments)})")
    exp = dict(experiments[sweep.experiment])
    exp.update({k: v for k, v in (("algorithms", sweep.algorithms), ("seeds", sweep.seeds)) if v is not None})
    run_names = exp.get("algorithms") or list(raw.get("algorithms") or {})
    for key in ("algorithm_overrides", "run_overrides"):  # of the runs swept only
        exp[key] = {k: v for k, v in (exp.get(key) or {}).items() if k in run_names}
    variants, points = split_grid(sweep.grid, run_names)
    algorithms = dict(raw.get("algorithms") or {})
    for run, hyper in variants.items():
        base = {**algorithms.get(run, {}), **exp["algorithm_overrides"].pop(run, {})}
        names = []
        for name, setting in variants_of(run, hyper).items():
            if name in algorithms:
                raise ConfigError(f"sweep.grid: algorithms.{run}: two values (or an existing entry) are named "
                                  f"'{name}': give distinct values")
            algorithms[name] = {**base, "algorithm": base.get("algorithm", run), **setting}
            if run in exp["run_overrides"]:  # a variant keeps its run's own budget
                exp["run_overrides"][name] = exp["run_overrides"][run]
            names.append(name)
        run_names = [n for r in run_names for n in (names if r == run else [r])]
        exp["run_overrides"].pop(run, None)
    exp["algorithms"] = run_names
    out = {}
    for point in itertools.product(*points.values()):
        setting = dict(zip(points, point))
        name = "-".join([sweep.experiment_name, *(f"{key.rsplit('.', 1)[-1]}{label(v)}" for key, v in setting.items())])
        if name in out:
            raise ConfigError(f"sweep.grid: {', '.join(points)}: two points are named '{name}': give distinct values")
        out[name] = copy.deepcopy(exp)
        for dotted, value in setting.items():
            set_dotted(out[name], dotted, value, "sweep.grid")
    # a sweep runs the params' values: a tuned experiment's choices (tuning/<experiment>.json) would
    # override the very keys a grid varies
    raw.update(experiments=out, algorithms=algorithms, learn2pfed={}, tuning={},
               tables={sweep.name: {"experiments": list(out)}} if len(out) > 1 else {})
    if sweep.tags:
        tracking = dict(raw.get("tracking") or {})
        tracking["tags"] = {**tracking.get("tags", {}), **sweep.tags}
        raw["tracking"] = tracking
    parse_params(raw)
    return raw


def variants_of(run: str, hyper: dict[str, list]) -> dict[str, dict]:
    """The variants a grid over run `run`'s hyper-parameters makes, by name (`ditto_mu0.1`)."""
    out = {}
    for values in itertools.product(*hyper.values()):
        setting = dict(zip(hyper, values))
        name = "_".join([run, *(f"{hp}{label(v)}" for hp, v in setting.items())])
        if name in out:
            raise ConfigError(f"sweep.grid: algorithms.{run}: two values are named '{name}': give distinct values")
        out[name] = setting
    return out


def variant_runs(grid: dict[str, list], run_names: list[str]) -> dict[str, str]:
    """Each variant the grid makes -> the run it varies: a sweep's methods are its runs (a
    params entry such as `fedadam` is one, though its module is FedAvg's), each over its variants."""
    return {name: run for run, hyper in split_grid(grid, run_names)[0].items() for name in variants_of(run, hyper)}


def split_grid(grid: dict[str, list], run_names: list[str]) -> tuple[dict[str, dict[str, list]], dict[str, list]]:
    """The grid's keys over algorithms' hyper-parameters, by run name (a name may hold dots:
    the longest run name that prefixes the key is its run), and the others, as keys of the
    experiment's own sections (`local.optimizer.lr` -> the experiment's `local`)."""
    variants: dict[str, dict[str, list]] = {}
    points: dict[str, list] = {}
    for dotted, values in grid.items():
        if dotted.startswith("algorithms."):
            rest = dotted.removeprefix("algorithms.")
            runs = [r for r in run_names if rest.startswith(f"{r}.") and "." not in rest[len(r) + 1:]]
            if not runs:
                raise ConfigError(f"sweep.grid: '{dotted}': expected algorithms.<run>.<hyper-parameter> with "
                                  f"<run> one of this sweep's runs {run_names}")
            run = max(runs, key=len)
            variants.setdefault(run, {})[rest[len(run) + 1:]] = values
        elif dotted.split(".")[0] in ("federation", "local", "model", "dataset"):
            points[dotted] = values
        else:
            raise ConfigError(f"sweep.grid: '{dotted}': a grid varies an algorithm's hyper-parameter "
                              "(algorithms.<run>.<name>) or the experiment's federation, local, model or dataset")
    return variants, points


def label(value: Any) -> str:
    """A grid value as part of a run or experiment name ([16, 32] -> 16x32)."""
    if isinstance(value, (list, tuple)):
        return "x".join(label(v) for v in value)
    return re.sub(r"[^A-Za-z0-9_.-]", "", value if isinstance(value, str) else json.dumps(value))


def parse_assignment(text: str) -> tuple[str, list[Any]]:
    """`key=v1,v2` from a command line: the dotted key and its values, each read as YAML (0.1
    a float, true a boolean, adam a string, [16,32] a list: commas inside brackets stay)."""
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise ConfigError(f"--set {text!r}: expected key=value[,value...]")
    parts, depth, current = [], 0, ""
    for char in values:
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    try:
        return key, [yaml.load(part, ParamsLoader) for part in [*parts, current]]
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key}: unreadable value ({err})") from None


def set_dotted(tree: dict, dotted: str, value: Any, where: str) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for i, key in enumerate(parents):
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: '{dotted}': '{'.'.join(parents[:i + 1])}' is not a section")
    node[leaf] = value
