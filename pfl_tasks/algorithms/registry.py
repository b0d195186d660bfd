"""Algorithms by name. A run name selects a registered algorithm by itself, or through the
`algorithm:` key of its entry `algorithms.<run name>` (to run variants side by side)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pfl_tasks.config import Params, unknown
from pfl_tasks.errors import ConfigError

ALGORITHMS: dict[str, type] = {}


def register(cls):
    ALGORITHMS[cls.name] = cls
    return cls


def build(run_name: str, raw: dict[str, Any], where: str | None = None):
    """Instantiate the algorithm of run `run_name` with validated hyper-parameters; errors name
    `where` (default: `algorithms.<run_name>`)."""
    raw, where = dict(raw or {}), where or f"algorithms.{run_name}"
    kind = raw.pop("algorithm", run_name)
    if kind not in ALGORITHMS:
        raise ConfigError(f"{where}: {unknown('algorithm', kind, ALGORITHMS)} (or an entry under 'algorithms')")
    cls = ALGORITHMS[kind]
    try:
        return cls(cls.Hyper.model_validate(raw))
    except ValidationError as err:
        problems = [
            f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}"
            + (f" (allowed: {sorted(cls.Hyper.model_fields)})" if e["type"] == "extra_forbidden" else "")
            for e in err.errors()
        ]
        raise ConfigError("; ".join(problems)) from None  # one line, as a stage prints it


def hyper_parameters(run_name: str, raw: dict[str, Any], *, defaults: bool = True) -> dict[str, Any]:
    """Run `run_name`'s validated hyper-parameters as JSON values (a float always a float), with
    its `algorithm:` when it names one; `defaults=False` leaves out those at their default: the
    canonical form, the same whether params.yaml spells a default out or leaves it to the code."""
    kind = {"algorithm": raw["algorithm"]} if raw and "algorithm" in raw else {}
    return {**kind, **build(run_name, raw).hp.model_dump(mode="json", exclude_defaults=not defaults)}


def source_file(run_name: str, raw: dict[str, Any]) -> Path:
    """The module that defines run `run_name`'s algorithm."""
    return Path(inspect.getfile(type(build(run_name, raw))))


def validate_params(params: Params) -> Params:
    """Every algorithm entry, every experiment's runs with its overrides, and every value of its
    tuning grids (`check_tuning`)."""
    for run_name, raw in params.algorithms.items():
        build(run_name, raw)
    for name, exp in params.experiments.items():
        resolved = params.experiment(name)
        for run_name in resolved.algorithms:
            where = (f"experiments.{name}.algorithm_overrides.{run_name}" if run_name in exp.algorithm_overrides
                     else f"experiments.{name}.algorithms[{resolved.algorithms.index(run_name)}]")
            build(run_name, resolved.hyper[run_name], where)
        check_tuning(params, name)
    return params


def check_tuning(params: Params, experiment: str) -> None:
    """A ConfigError naming the first value of a `tuning.<experiment>.hyper` grid that its
    algorithm refuses (before a grid point is written or trained), or where
    `algorithms.<run>.<key>` (or the experiment's override of it) sets a key the grid tunes to
    other than its default: the tuning's choice replaces it, so no run would train with it (a
    `dvc exp run -S` of it would pass as a change that changes nothing)."""
    if experiment not in params.tuning:
        return
    exp = params.experiments[experiment]
    hyper = params.experiment(experiment).hyper
    for run_name, grid in params.tuning[experiment].hyper.items():
        for key, values in grid.items():
            for value in values:
                try:
                    build(run_name, {**hyper[run_name], key: value}, where=f"tuning.{experiment}.hyper.{run_name}")
                except ConfigError as err:
                    raise ConfigError(f"{err} (its grid's value {value!r})") from None
        set_values = hyper_parameters(run_name, hyper[run_name], defaults=False)
        for key in sorted(set(grid) & set(set_values)):
            where = (f"experiments.{experiment}.algorithm_overrides.{run_name}.{key}"
                     if key in (exp.algorithm_overrides.get(run_name) or {}) else f"algorithms.{run_name}.{key}")
            raise ConfigError(
                f"{where} is {set_values[key]!r}, but tuning.{experiment}.hyper.{run_name}.{key} tunes it over "
                f"{grid[key]}, so {experiment}'s runs would not use it: to run {run_name} at {key} "
                f"{set_values[key]!r} there, set tuning.{experiment}.hyper.{run_name}.{key}: [{set_values[key]!r}]; "
                f"else leave {where} at its default "
                f"{hyper_parameters(run_name, {k: v for k, v in hyper[run_name].items() if k != key})[key]!r}")
