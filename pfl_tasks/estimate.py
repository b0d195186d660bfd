"""A dry run's time: an experiment's rounds and evaluations times the step times measured on
this machine, before committing hours to it (`python -m flows.pipeline ... --estimate`).

Each algorithm runs one warm-up round, then `rounds` timed rounds and one timed evaluation, on
the experiment's first seed's partition built in memory (nothing is written: no partition,
checkpoint, MLflow or Prefect run). The estimate is per algorithm: seeds x (rounds x round time
+ evaluations x evaluation time), plus their sum; the fixed costs of a stage (its start, the
store, checkpoints) and the Learn2pFed stage are not in it.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from dataclasses import dataclass

from pfl_tasks.algorithms import build
from pfl_tasks.config import Params
from pfl_tasks.data import FederatedData, build_partition, load_partition, write_partition
from pfl_tasks.engine.device import describe
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.steps import InlineSteps


def built_partition(name: str, cfg, seed: int) -> FederatedData:
    """The partition `prepare` would write, built, written, verified and read back as a stage
    reads it, its files not kept (a dry run, a benchmark). Here, not in the data layer, whose
    files are every run's code identity."""
    table, manifest = build_partition(name, cfg, seed)
    with tempfile.TemporaryDirectory() as tmp:
        write_partition(table, manifest, Path(tmp))
        return load_partition(Path(tmp))


@dataclass(frozen=True)
class Estimate:
    algorithm: str
    round_s: float  # one round, measured
    evaluation_s: float  # one evaluation of every client, measured
    runs: int  # seeds
    rounds: int
    evaluations: int

    @property
    def total_s(self) -> float:
        return self.runs * (self.rounds * self.round_s + self.evaluations * self.evaluation_s)


def estimate(params: Params, experiment: str, rounds: int = 1) -> tuple[str, list[Estimate]]:
    """The platform it was measured on, and each algorithm's estimate."""
    exp = params.experiment(experiment)
    seed, fed_cfg = exp.seeds[0], exp.federation
    data = built_partition(exp.dataset, params.datasets[exp.dataset], seed)
    evaluations = len(set(range(fed_cfg.eval_every, fed_cfg.rounds + 1, fed_cfg.eval_every)) | {fed_cfg.rounds})
    run, steps = exp.model_copy(update={"seed": seed}), InlineSteps(exp.engine.max_workers)
    out, platform = [], ""
    for name in exp.algorithms:
        fed = Federation(run, build(name, exp.hyper[name]), data)
        platform = describe(fed.platform)
        state = steps.round(fed, fed.initial_state(), 0)  # warm-up
        start = time.perf_counter()
        for round_idx in range(1, 1 + rounds):
            state = steps.round(fed, state, round_idx)
        round_s = (time.perf_counter() - start) / rounds
        start = time.perf_counter()
        fed.evaluate(state)
        out.append(Estimate(name, round_s, time.perf_counter() - start, len(exp.seeds), fed_cfg.rounds, evaluations))
    return platform, out


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def report(experiment: str, platform: str, estimates: list[Estimate]) -> str:
    lines = [f"{experiment}: estimated on {platform} (one warm-up round, then timed rounds and one evaluation "
             "per algorithm; stage start-up, checkpoints and MLflow not included)",
             f"{'algorithm':<12} {'round':>9} {'evaluation':>11}  runs x (rounds + evaluations)  estimate"]
    for e in estimates:
        lines.append(f"{e.algorithm:<12} {e.round_s:>8.2f}s {e.evaluation_s:>10.2f}s  "
                     f"{e.runs} x ({e.rounds} + {e.evaluations}){'':>14}{duration(e.total_s):>9}")
    lines.append(f"{'total':<12} {duration(sum(e.total_s for e in estimates)):>62}")
    return "\n".join(lines)
