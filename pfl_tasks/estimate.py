"""A dry run's wall-clock time: what `flows.pipeline` would take for a params file on this
machine, before committing hours to it (`python -m flows.pipeline ... --estimate`).

Two measurements, neither writing where the pipeline writes:
- each algorithm's steps (`time_steps`): a warm-up round, then `rounds` (3) timed rounds and one
  timed evaluation, on the experiment's first seed's partition built in memory;
- the other costs (`probe_params`, run by `flows.pipeline`): the file's own pipeline in a
  temporary folder with its own MLflow store, every stage as configured but each experiment on
  its first seed, each run for two evaluation intervals and each tuning grid at its first point.
  Its wall time holds what does not grow with the runs (process start, the Prefect server,
  prepare, compare, tables). In each training run, the second interval less its steps is an
  interval's orchestration (Prefect task runs, MLflow logging, a checkpoint), the run's wall
  time less both intervals its start and finish, and the median gap between one run's end and the
  next one's start in the same MLflow experiment what comes between runs (the next flow run, its
  loading).

The total is the probe's wall time plus what the probe left out: every run at the timed rates
with those costs, less the probe's own runs, and Learn2pFed's other seeds at the probe's rate.
Its range is the fastest and the slowest timed round's. A tuning grid's widenings past the edges
chosen are not in it: they depend on what the grid chooses.
"""

from __future__ import annotations

import copy
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pfl_tasks.algorithms import build
from pfl_tasks.config import FederationConfig, Params
from pfl_tasks.data import FederatedData, build_partition, load_partition, write_partition
from pfl_tasks.engine.device import describe
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.rounds import InlineSteps
from pfl_tasks.tuning import grids, points, tune_name, tuning_seeds


def built_partition(name: str, cfg, seed: int) -> FederatedData:
    """The partition `prepare` would write, built, written, verified and read back as a stage
    reads it, its files not kept (a dry run, a benchmark). Here, not in the data layer, whose
    files are every run's code identity."""
    table, manifest = build_partition(name, cfg, seed)
    with tempfile.TemporaryDirectory() as tmp:
        write_partition(table, manifest, Path(tmp))
        return load_partition(Path(tmp))


@dataclass(frozen=True)
class Timing:
    """One algorithm's steps on this machine."""

    round_s: tuple[float, ...]  # each timed round
    evaluation_s: float  # one evaluation of every client


def time_steps(params: Params, experiment: str, rounds: int = 3,
               progress: Callable[[str], None] = lambda line: None) -> tuple[str, dict[str, Timing]]:
    """The platform, and each algorithm's timing from `rounds` timed rounds; `progress` gets a
    line as each algorithm starts."""
    exp = params.experiment(experiment)
    seed = exp.seeds[0]
    data = built_partition(exp.dataset, params.datasets[exp.dataset], seed)
    steps = InlineSteps(exp.engine.max_workers)
    out, platform = {}, ""
    for number, name in enumerate(exp.algorithms, 1):
        progress(f"{experiment}: timing {name} ({number} of {len(exp.algorithms)}): a warm-up round, "
                 f"{rounds} timed rounds and an evaluation")
        fed = Federation(exp.for_run(name, seed), build(name, exp.hyper[name]), data)
        platform = describe(fed.platform)
        state, times = steps.round(fed, fed.initial_state(), 0), []  # a warm-up round first
        for round_idx in range(1, 1 + rounds):
            start = time.perf_counter()
            state = steps.round(fed, state, round_idx)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        fed.evaluate(state)
        out[name] = Timing(tuple(times), time.perf_counter() - start)
    return platform, out


def evaluations(rounds: int, eval_every: int) -> int:
    """A run's evaluations: every `eval_every` rounds and after the last."""
    return len(set(range(eval_every, rounds + 1, eval_every)) | {rounds})


def probe_interval(fed: FederationConfig) -> int:
    """A probe run's evaluation (and checkpoint) interval; it runs two."""
    return min(fed.eval_every, math.ceil(fed.rounds / 2))


@dataclass(frozen=True)
class Runs:
    """`count` runs of one algorithm in one stage, each of `rounds` rounds and `evaluations`
    evaluations."""

    stage: str  # train-<experiment>, tune-<experiment>
    algorithm: str
    count: int
    rounds: int
    evaluations: int


def planned_runs(params: Params, experiment: str) -> list[Runs]:
    """Every run the pipeline trains for `experiment`: its tuning grid's, then its own."""
    exp, out = params.experiment(experiment), []
    if experiment in params.tuning:
        fraction, seeds = params.tuning[experiment].rounds_fraction, len(tuning_seeds(params, experiment))
        for name, grid in grids(params, experiment).items():
            fed = exp.for_run(name).federation
            rounds = math.ceil(fraction * fed.rounds)
            out.append(Runs(f"tune-{experiment}", name, seeds * math.prod(len(v) for v in grid.values()), rounds,
                            evaluations(rounds, fed.eval_every)))
    for name in exp.algorithms:
        fed = exp.for_run(name).federation
        out.append(Runs(f"train-{experiment}", name, len(exp.seeds), fed.rounds, evaluations(fed.rounds, fed.eval_every)))
    return out


def probe_params(raw: dict, params: Params, experiments: list[str], store: str) -> dict:
    """The probe's params file (`raw` as read): the pipeline of `experiments` as configured, each
    on its first seed, each run for two evaluation intervals (`probe_interval`, a checkpoint each),
    each tuning grid at its first point on one seed, never widened, logged to `store`."""
    raw = copy.deepcopy(raw)
    kept = {}
    for experiment in experiments:
        exp, source = params.experiment(experiment), raw["experiments"][experiment]
        overrides = source.setdefault("run_overrides", {})
        for name in exp.algorithms:
            interval = probe_interval(exp.for_run(name).federation)
            own = overrides.setdefault(name, {})
            own["federation"] = {**own.get("federation", {}), "rounds": 2 * interval, "eval_every": interval,
                                 "checkpoint_every": interval}
        source["seeds"] = [exp.seeds[0]]
        kept[experiment] = source
    raw["experiments"] = kept
    raw["tuning"] = {e: {**t, "lr": t["lr"][:1], "hyper": {run: {key: values[:1] for key, values in grid.items()}
                                                          for run, grid in (t.get("hyper") or {}).items()},
                         **({"seeds": t["seeds"][:1]} if t.get("seeds") else {}), "extensions": 0}
                     for e, t in (raw.get("tuning") or {}).items() if e in kept}
    raw["learn2pfed"] = {e: c for e, c in (raw.get("learn2pfed") or {}).items() if e in kept}
    raw["tables"] = {t: c for t, c in (raw.get("tables") or {}).items() if set(c["experiments"]) <= set(kept)}
    raw["tracking"] = {**(raw.get("tracking") or {}), "mlflow_uri": store}
    return raw


@dataclass(frozen=True)
class ProbeRun:
    wall_s: float  # its MLflow run's
    start_s: float  # when it started, in seconds since the epoch
    logged_s: tuple[float, ...]  # when each batch of its metrics was logged (at its checkpoints), from its start


@dataclass(frozen=True)
class Probe:
    """What the probe pipeline measured."""

    wall_s: float
    runs: dict[tuple[str, str], ProbeRun]  # (MLflow experiment, run name) -> its run

    def between_runs_s(self) -> float:
        """The median gap from one run's end to the next one's start in the same MLflow
        experiment: the next run's flow run and loading, which no run's wall time holds."""
        gaps = []
        for experiment in {e for e, _ in self.runs}:
            runs = sorted((r for (e, _), r in self.runs.items() if e == experiment), key=lambda r: r.start_s)
            gaps += [after.start_s - (before.start_s + before.wall_s) for before, after in zip(runs, runs[1:])]
        return max(0.0, statistics.median(gaps)) if gaps else 0.0


def probe_runs(uri: str) -> dict[tuple[str, str], ProbeRun]:
    """Every finished training run in the probe's MLflow store (not the tables stage's, which
    evaluates nothing)."""
    from mlflow.tracking import MlflowClient

    client, out = MlflowClient(tracking_uri=uri), {}
    for e in client.search_experiments():
        for r in client.search_runs([e.experiment_id]):
            evaluated = sorted(k for k in r.data.metrics if k.startswith("val/"))
            if r.info.end_time and evaluated:
                key = evaluated[0]
                logged = sorted({m.timestamp for m in client.get_metric_history(r.info.run_id, key)})
                out[e.name, r.info.run_name] = ProbeRun((r.info.end_time - r.info.start_time) / 1000,
                                                        r.info.start_time / 1000,
                                                        tuple((t - r.info.start_time) / 1000 for t in logged))
    return out


@dataclass(frozen=True)
class Cost:
    """A run's measured costs besides its steps."""

    run_s: float  # once a run: its start and finish, and what comes between it and the next
    interval_s: float  # per evaluation interval: Prefect task runs, MLflow logging, a checkpoint


def measured_cost(run: ProbeRun | None, interval_rounds: int, t: Timing, between_s: float) -> Cost:
    """From the probe run's two intervals: the second, less its steps, is an interval's
    orchestration; the run's wall time less both intervals, plus `between_s`, is its start and
    finish."""
    if run is None or len(run.logged_s) < 2:
        return Cost(between_s, 0.0)
    interval = run.logged_s[1] - run.logged_s[0]
    return Cost(max(0.0, run.wall_s - 2 * interval) + between_s,
                max(0.0, interval - interval_rounds * statistics.median(t.round_s) - t.evaluation_s))


@dataclass(frozen=True)
class Line:
    """One stage's runs of one algorithm, estimated, less the probe's run of them."""

    runs: Runs
    timing: Timing
    cost: Cost
    low_s: float
    high_s: float


def whole(params: Params, experiments: list[str], timings: dict[str, dict[str, Timing]],
          probe: Probe) -> tuple[list[Line], dict[str, float], float, float]:
    """Each stage's runs per algorithm, Learn2pFed's seconds beyond the probe per experiment, and
    the whole run's low and high totals."""
    lines, learn2pfed, between_s = [], {}, probe.between_runs_s()
    for experiment in experiments:
        exp = params.experiment(experiment)
        methods = {(experiment, name): name for name in exp.algorithms}  # (MLflow experiment, run) -> method
        if experiment in params.tuning:
            methods |= {(tune_name(experiment), name): run for name, (run, _) in points(params, experiment).items()}
        probed = {(e, methods.get((e, name.rsplit("-seed", 1)[0]))): run for (e, name), run in probe.runs.items()}
        for runs in planned_runs(params, experiment):
            t = timings[experiment][runs.algorithm]
            trained = probed.get((experiment, runs.algorithm))
            cost = measured_cost(trained, probe_interval(exp.for_run(runs.algorithm).federation), t, between_s)
            mine = trained if runs.stage.startswith("train-") else probed.get((tune_name(experiment), runs.algorithm))

            def total(round_s):
                each = cost.run_s + runs.rounds * round_s + runs.evaluations * (t.evaluation_s + cost.interval_s)
                return runs.count * each - (mine.wall_s + between_s if mine else 0.0)
            lines.append(Line(runs, t, cost, total(min(t.round_s)), total(max(t.round_s))))
        if experiment in params.learn2pfed:
            seconds = sum(run.wall_s + between_s for (e, name), run in probe.runs.items()
                          if e == experiment and name.startswith("learn2pfed-"))
            learn2pfed[experiment] = seconds * (len(exp.seeds) - 1)
    fixed = probe.wall_s + sum(learn2pfed.values())
    return (lines, learn2pfed, fixed + sum(line.low_s for line in lines),
            fixed + sum(line.high_s for line in lines))


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def span(low: float, high: float) -> str:
    return f"{duration(low)} - {duration(high)}"


def report(params_path: str, platform: str, probe: Probe, lines: list[Line], learn2pfed: dict[str, float],
           low: float, high: float) -> str:
    out = [f"{params_path}: estimated on {platform}: each algorithm's rounds timed (one warm-up round, then "
           f"{len(lines[0].timing.round_s) if lines else 0}, the fastest and slowest giving the range) and one "
           "evaluation; other costs measured by the probe, the pipeline itself on each experiment's first seed "
           "for two evaluation intervals a run",
           f"{'stage':<16} {'algorithm':<12} {'round':>13} {'evaluation':>10} {'interval':>9} {'run':>7}  "
           f"runs x (rounds + evaluations)  {'beyond the probe':>17}"]
    for line in lines:
        r, t = line.runs, line.timing
        out.append(f"{r.stage:<16} {r.algorithm:<12} {min(t.round_s):>5.2f}-{max(t.round_s):.2f} s {t.evaluation_s:>8.2f} s "
                   f"{line.cost.interval_s:>7.2f} s {line.cost.run_s:>5.2f} s  "
                   f"{f'{r.count} x ({r.rounds} + {r.evaluations})':<29}  {span(line.low_s, line.high_s):>17}")
    for experiment, seconds in learn2pfed.items():
        out.append(f"{'learn2pfed-' + experiment:<16} {'':<12} {'':>52}  {'the probe x other seeds':<29}  "
                   f"{duration(seconds):>17}")
    out.append(f"{'probe':<16} {'':<12} {'':>52}  {'its wall time':<29}  {duration(probe.wall_s):>17}")
    out.append(f"total: {span(low, high)} (interval: an evaluation interval's orchestration, Prefect task runs, "
               "MLflow logging and a checkpoint; run: a run's start and finish and the gap to the next; all measured in the probe; a busier "
               "machine stretches every figure)"
               + ("; plus any widening of a tuning grid past the edges it chose, which depends on the choices"
                  if any(line.runs.stage.startswith("tune-") for line in lines) else ""))
    return "\n".join(out)
