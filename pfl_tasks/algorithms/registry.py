"""Algorithms by name. A run name selects a registered algorithm by itself, or through the
`algorithm:` key of its entry `algorithms.<run name>` (to run variants side by side)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pfl_tasks.config import Params
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
        raise ConfigError(
            f"{where}: unknown algorithm '{kind}'; registered: {sorted(ALGORITHMS)} (or an entry under 'algorithms')"
        )
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
    """Every algorithm entry, and every experiment's runs with its overrides."""
    for run_name, raw in params.algorithms.items():
        build(run_name, raw)
    for name, exp in params.experiments.items():
        resolved = params.experiment(name)
        for run_name in resolved.algorithms:
            where = (f"experiments.{name}.algorithm_overrides.{run_name}" if run_name in exp.algorithm_overrides
                     else f"experiments.{name}.algorithms[{resolved.algorithms.index(run_name)}]")
            build(run_name, resolved.hyper[run_name], where)
    return params
