"""A dry run's time: an experiment's rounds and evaluations times the step times measured on
this machine, before committing hours to it (`python -m flows.pipeline ... --estimate`).

Each algorithm runs one warm-up round, then `rounds` (3) timed rounds and one timed evaluation,
on the experiment's first seed's partition built in memory (nothing is written: no partition,
checkpoint, MLflow or Prefect run). The estimate is per algorithm: seeds x (rounds x round time
+ evaluations x evaluation time), a range from the fastest to the slowest timed round, plus
their sum; the fixed costs of a stage (its start, the store, checkpoints) and the Learn2pFed
stage are not in it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass

from pfl_tasks.algorithms import build
from pfl_tasks.config import Params
from pfl_tasks.data import FederatedData, build_partition, load_partition, write_partition
from pfl_tasks.engine.device import describe
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.rounds import InlineSteps


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
    round_s: tuple[float, ...]  # each timed round
    evaluation_s: float  # one evaluation of every client, measured
    runs: int  # seeds
    rounds: int
    evaluations: int

    def total_s(self, round_s: float) -> float:
        return self.runs * (self.rounds * round_s + self.evaluations * self.evaluation_s)

    @property
    def range_s(self) -> tuple[float, float]:
        """The estimate at the fastest and at the slowest timed round."""
        return self.total_s(min(self.round_s)), self.total_s(max(self.round_s))


def estimate(params: Params, experiment: str, rounds: int = 3,
             progress: Callable[[str], None] = lambda line: None) -> tuple[str, list[Estimate]]:
    """The platform it was measured on, and each algorithm's estimate from `rounds` timed rounds;
    `progress` gets a line as each algorithm starts."""
    exp = params.experiment(experiment)
    seed = exp.seeds[0]
    data = built_partition(exp.dataset, params.datasets[exp.dataset], seed)
    steps = InlineSteps(exp.engine.max_workers)
    out, platform = [], ""
    for number, name in enumerate(exp.algorithms, 1):
        progress(f"{experiment}: timing {name} ({number} of {len(exp.algorithms)}): a warm-up round, "
                 f"{rounds} timed rounds and an evaluation")
        run = exp.for_run(name, seed)
        fed = Federation(run, build(name, exp.hyper[name]), data)
        platform = describe(fed.platform)
        state, times = steps.round(fed, fed.initial_state(), 0), []  # a warm-up round first
        for round_idx in range(1, 1 + rounds):
            start = time.perf_counter()
            state = steps.round(fed, state, round_idx)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        fed.evaluate(state)
        evaluation_s = time.perf_counter() - start
        fed_cfg = run.federation
        evaluations = len(set(range(fed_cfg.eval_every, fed_cfg.rounds + 1, fed_cfg.eval_every)) | {fed_cfg.rounds})
        out.append(Estimate(name, tuple(times), evaluation_s, len(exp.seeds), fed_cfg.rounds, evaluations))
    return platform, out


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def report(experiment: str, platform: str, estimates: list[Estimate]) -> str:
    timed = len(estimates[0].round_s) if estimates else 0
    lines = [f"{experiment}: estimated on {platform} (one warm-up round, then {timed} timed rounds, the fastest "
             "and slowest giving the range, and one evaluation per algorithm; stage start-up, checkpoints and "
             "MLflow not included)",
             f"{'algorithm':<12} {'round':>15} {'evaluation':>11}  runs x (rounds + evaluations)  {'estimate':>17}"]
    for e in estimates:
        low, high = e.range_s
        lines.append(f"{e.algorithm:<12} {min(e.round_s):>6.2f}-{max(e.round_s):.2f}s {e.evaluation_s:>10.2f}s  "
                     f"{e.runs} x ({e.rounds} + {e.evaluations}){'':>14}{span(low, high):>17}")
    low, high = (sum(e.range_s[i] for e in estimates) for i in (0, 1))
    lines.append(f"{'total':<12} {span(low, high):>74}")
    return "\n".join(lines)


def span(low: float, high: float) -> str:
    return f"{duration(low)} - {duration(high)}"
