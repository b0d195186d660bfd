"""Algorithms by name. A `params.yaml` entry `algorithms.<run name>` selects a registered
algorithm by its run name, or by an explicit `algorithm:` key (to run variants side by side)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pfl_tasks.config import ConfigError, Params

ALGORITHMS: dict[str, type] = {}


def register(cls):
    ALGORITHMS[cls.name] = cls
    return cls


def build(run_name: str, raw: dict[str, Any]):
    """Instantiate the algorithm of `algorithms.<run_name>` with validated hyper-parameters."""
    raw = dict(raw or {})
    kind = raw.pop("algorithm", run_name)
    if kind not in ALGORITHMS:
        raise ConfigError(
            f"algorithms.{run_name}: unknown algorithm '{kind}'; registered: {sorted(ALGORITHMS)}"
        )
    cls = ALGORITHMS[kind]
    try:
        return cls(cls.Hyper.model_validate(raw))
    except ValidationError as err:
        lines = [
            f"  algorithms.{run_name}.{'.'.join(map(str, e['loc']))}: {e['msg']}"
            + (f" (allowed: {sorted(cls.Hyper.model_fields)})" if e["type"] == "extra_forbidden" else "")
            for e in err.errors()
        ]
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None


def validate_params(params: Params) -> Params:
    for run_name, raw in params.algorithms.items():
        build(run_name, raw)
    return params
