"""`train` stage: every algorithm of one experiment, each as one Prefect flow run.

Per round the flow runs tasks `sample_clients` -> `local_update` (mapped over client chunks,
in parallel on the task runner) -> `aggregate`, then `evaluate` every `eval_every` rounds and
`checkpoint` every `checkpoint_every` rounds. `engine.round_tasks: round` makes each round one
task run instead of 2 + one per chunk. `engine.orchestrator: inline` runs the very same steps as
plain calls, to measure Prefect's cost and to keep unit tests fast.

The training loop itself is the library's (`pfl_tasks.training.train_run`); this module
adapts its steps (`pfl_tasks.engine.rounds.Steps`) to Prefect tasks and Ray.

    python -m flows.train <experiment> [--on-config-change refuse|restart|resume]
    python -m flows.train digits --algorithms ditto fedavg --seeds 0 1        # some of its runs, in place

A grid, or runs the params file does not configure, is a sweep: `python -m flows.sweep`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from difflib import get_close_matches
from pathlib import Path

from flows.environment import local_defaults
from flows.precheck import check_params_first


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--root", default=".", help="where its data, models and metrics are (as flows.pipeline's)")
    parser.add_argument(
        "--on-config-change", choices=["refuse", "restart", "resume"], default="refuse",
        help="what to do with a checkpoint written under another configuration",
    )
    parser.add_argument("--algorithms", nargs="+", metavar="RUN", help="default: the experiment's")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help="default: the experiment's")
    for sweep_option in ("--set", "--name"):  # a sweep's: named in the error
        parser.add_argument(sweep_option, action="append", help=argparse.SUPPRESS)
    return parser


if __name__ == "__main__":  # --help, and a command-line or config error, answer before Prefect, MLflow and torch load
    local_defaults()
    first = arguments().parse_args()
    check_params_first("train", first.params, first.experiment)

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows.stage import check_prefect_api, prefect_api, stage_main
from pfl_tasks.algorithms import ALGORITHMS, validate_params
from pfl_tasks.config import EngineConfig, load_params
from pfl_tasks.engine.checkpoint import save_checkpoint
from pfl_tasks.engine.device import torch_threads, usable_cores
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.state import gather
from pfl_tasks.engine.rounds import InlineSteps, Steps, play_rounds, run_round
from pfl_tasks.errors import ConfigError
from pfl_tasks.outputs import pinned_run
from pfl_tasks.tracking import open_store, tracking_uri, unmarked_runs
from pfl_tasks.training import check_inputs, finished_outcome, train_run
from pfl_tasks.tuning import tuned

# ----------------------------------------------------------------------------- round steps
TASK_OPTIONS = dict(cache_policy=NO_CACHE, persist_result=False)


def in_round(step: str = ""):
    """Task-run name of a step of round `round_idx + 1`: a round's tasks carry the number its
    evaluation, checkpoint and log line use (round 1 is the first)."""

    def name(parameters: dict) -> str:
        return f"round-{parameters['round_idx'] + 1}" + (f"/{step.format(**parameters)}" if step else "")

    return name


@task(**TASK_OPTIONS, task_run_name=in_round("sample_clients"))
def sample_clients(fed: Federation, round_idx: int):
    return fed.sample_clients(round_idx)


@task(**TASK_OPTIONS, task_run_name=in_round("local_update-chunk-{chunk_idx}"))
def local_update(fed, round_idx: int, chunk_idx: int, payload, ids, rows):
    return fed.local_update(round_idx, payload, ids, rows)


@task(**TASK_OPTIONS, task_run_name=in_round("local_update-chunk-{chunk_idx}"))
def remote_local_update(fed, round_idx: int, chunk_idx: int, payload, ids, rows):
    """`local_update` on a Ray worker: what it returns travels back on the host."""
    return fed.local_update(round_idx, payload, ids, rows).to_host()


@task(**TASK_OPTIONS, task_run_name=in_round("aggregate"))
def aggregate(fed, round_idx: int, state, results):
    return fed.aggregate(state, results)


@task(**TASK_OPTIONS, task_run_name="round-{done}/evaluate")
def evaluate(fed, done: int, state):
    """The evaluation after round `done` (counted from 1)."""
    return fed.evaluate(state)


@task(**TASK_OPTIONS, task_run_name="round-{done}/checkpoint")
def checkpoint(path: Path, done: int, payload: dict):
    save_checkpoint(path, payload)


@task(**TASK_OPTIONS, task_run_name=in_round())
def federated_round(steps: Steps, fed, round_idx: int, state):
    return run_round(steps, fed, state, round_idx)


@task(**TASK_OPTIONS, task_run_name="rounds-{first_round}-{last_round}")
def federated_rounds(play, first_round: int, last_round: int):
    """Rounds `first_round` to `last_round` (counted from 1), each with its evaluation."""
    return play_rounds(play, first_round - 1, last_round)


class PrefectSteps(Steps):
    """Each step a Prefect task run; chunks are mapped onto the flow's task runner, each with
    only its own clients' rows of the client state."""

    sample = staticmethod(sample_clients)
    aggregate = staticmethod(aggregate)
    evaluate = staticmethod(evaluate)
    checkpoint = staticmethod(checkpoint)
    local_update = staticmethod(local_update)

    def local_updates(self, fed, round_idx, payload, chunks, clients):
        rows = [gather(clients, ids) for ids in chunks]
        return self.local_update.map(
            unmapped(self.shared(fed)), round_idx, range(len(chunks)), unmapped(self.shared(payload)), chunks, rows,
        ).result()

    def shared(self, value):
        return value


class RaySteps(PrefectSteps):
    """For the Ray task runner: what every chunk shares goes into Ray's object store once (the
    federation, with its data, once per run; the server payload once per round) and chunks
    receive references; workers upload a run's samples once and send their results back on
    the host (`ray_options`: GPUs and worker reuse)."""

    local_update = staticmethod(remote_local_update)

    def __init__(self):
        self._fed = None

    def local_updates(self, fed, round_idx, payload, chunks, clients):
        from prefect_ray.context import remote_options

        with remote_options(**ray_options(fed.exp.engine, fed.device)):
            return super().local_updates(fed, round_idx, payload, chunks, clients)

    def shared(self, value):
        import ray

        if isinstance(value, Federation):
            if self._fed is None or self._fed[0] is not value:
                self._fed = (value, ray.put(value))
            return self._fed[1]
        return ray.put(value)


def ray_options(engine: EngineConfig, device) -> dict:
    """A chunk task's Ray options. On a CUDA engine it asks for `engine.gpus_per_chunk` of a
    GPU, and a cluster offering less is refused (Ray would keep the tasks pending forever).
    Workers are reused across chunks and rounds (no new process and CUDA context per chunk)
    unless a node has several GPUs: a reused worker keeps the GPU of its first task, so there
    each GPU task gets a fresh process (Ray's own default), which sees the GPU it was given."""
    if device.type != "cuda":
        return {"num_gpus": 0}
    import ray

    offered = ray.cluster_resources().get("GPU", 0)
    if offered < engine.gpus_per_chunk:
        raise ConfigError(f"engine.device resolves to cuda, but the Ray cluster ({engine.ray_address or 'local'}) "
                          f"offers {offered:g} GPUs and a chunk asks for engine.gpus_per_chunk="
                          f"{engine.gpus_per_chunk:g}; set engine.device: cpu or add GPU nodes")
    per_node = max(node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"])
    return {"num_gpus": engine.gpus_per_chunk, "max_calls": 0 if per_node <= 1 else 1}


class RoundSteps(InlineSteps):
    """`engine.round_tasks: round`: a round is one task run, `round-N`, that samples, runs the
    chunks on its own threads and aggregates (the inline steps); evaluate and checkpoint stay tasks."""

    evaluate = staticmethod(evaluate)
    checkpoint = staticmethod(checkpoint)

    def round(self, fed, state, round_idx):
        return federated_round(self, fed, round_idx, state)


class IntervalSteps(InlineSteps):
    """`engine.round_tasks: interval`: one task run, `rounds-A-B`, for the rounds up to the
    next evaluation or checkpoint, with the evaluation; inside it the rounds' steps are plain
    calls (chunks on its threads). The fewest task runs, for short rounds: Prefect's cost per
    task run (tens of ms of client and server CPU) would otherwise dominate them."""

    spans_rounds = True

    def span(self, play, first, stop):
        return federated_rounds(play, first + 1, stop)


def prefect_steps(engine: EngineConfig):
    if engine.task_runner == "ray":
        return RaySteps()
    if engine.round_tasks == "steps":
        return PrefectSteps()
    return (RoundSteps if engine.round_tasks == "round" else IntervalSteps)(engine.max_workers)


@flow(name="pfl-train", flow_run_name="{experiment}-{run_name}-seed{seed}", persist_result=False)
def train_flow(
    experiment: str, run_name: str, seed: int, params_path: str = "params.yaml", root: str = ".",
    on_config_change: str = "refuse",
) -> dict[str, float]:
    from prefect.runtime import flow_run

    params = validate_params(load_params(params_path))
    exp = tuned(params, experiment, Path(root)).for_run(run_name, seed)
    return train_run(
        exp, run_name, exp.hyper[run_name], Path(root), prefect_steps(exp.engine), on_config_change,
        params.tracking, str(flow_run.id),
    )


def task_runner(engine: EngineConfig):
    """The flow's task runner. For Ray, one Ray connection serves every flow run of this
    process: a local instance, or the cluster at `engine.ray_address`."""
    if engine.task_runner == "thread":
        return ThreadPoolTaskRunner(max_workers=engine.max_workers)
    try:
        import ray
        from prefect_ray import RayTaskRunner
    except ImportError:
        raise ConfigError("engine.task_runner is 'ray' but prefect-ray is not installed: "
                          "pip install -r requirements-ray.txt -c requirements.lock") from None
    if not ray.is_initialized():
        ray.init(address=engine.ray_address, include_dashboard=False, namespace="prefect")
    return RayTaskRunner()


def train_experiment(
    experiment: str, params_path: str = "params.yaml", root: str = ".",
    on_config_change: str = "refuse", algorithms: list[str] | None = None, seeds: list[int] | None = None,
) -> dict[str, dict[str, float]]:
    """Every algorithm and seed of `experiment` (or the configured ones among `algorithms`,
    `seeds`), in this one process (one Prefect start); results keyed by (algorithm, seed)."""
    params = validate_params(load_params(params_path))
    exp = tuned(params, experiment, Path(root))
    known = set(params.algorithms) | set(ALGORITHMS)
    for name in sorted(set(algorithms or []) - known):  # a typo, not a run for a sweep
        near = get_close_matches(name, sorted(known), 1)
        raise ConfigError(f"--algorithms: '{name}' is no algorithm and no entry under `algorithms` in {params_path}"
                          + (f" (did you mean '{near[0]}'?)" if near else ""))
    for key, asked, configured in (("algorithms", algorithms, exp.algorithms), ("seeds", seeds, exp.seeds)):
        unlisted = sorted(set(asked or []) - set(configured))
        if unlisted:
            raise ConfigError(f"experiments.{experiment} does not run {key} {unlisted} (it runs {configured}): "
                              "runs it does not configure are a sweep (python -m flows.sweep); if dvc.yaml asked "
                              "for them, it is older than params.yaml: python -m flows.dvc_yaml")
    results, started = {}, time.monotonic()
    runs = [(run_name, seed) for run_name in exp.algorithms if algorithms is None or run_name in algorithms
            for seed in exp.seeds if seeds is None or seed in seeds]
    todo = []
    for run_name, seed in runs:
        outcome = finished_outcome(exp.for_run(run_name, seed), run_name, exp.hyper[run_name], Path(root))
        if outcome is None:
            todo.append((run_name, seed))
        else:
            results[run_name, seed] = outcome
    try:
        check_inputs(exp, todo, Path(root), on_config_change)
    except ConfigError as err:  # a key of the params file
        raise ConfigError(f"{params_path}: {err}") from None
    orchestrated = exp.engine.orchestrator == "prefect"
    if orchestrated and todo:
        check_prefect_api()
    uri = tracking_uri(params.tracking.mlflow_uri)
    open_store(uri)
    kept = {pinned_run(outcome): key for key, outcome in results.items()}
    unmarked = [kept[run_id] for run_id in unmarked_runs(uri, list(kept), params.tracking.retry_seconds)]
    if unmarked:  # a finished run is one whose checkpoint, metrics and MLflow mark agree
        print(f"{experiment}: {len(unmarked)} finished runs are not marked FINISHED in {uri} (failed, left "
              "RUNNING or lost with the store): resumed from their last checkpoints to log and mark them")
        todo = [key for key in runs if key in todo or key in unmarked]
        if orchestrated:
            check_prefect_api()
    if len(todo) < len(runs):
        print(f"{experiment}: {len(runs) - len(todo)} of {len(runs)} runs already finished under the same "
              "config, data and code: kept")
    if todo:
        print(f"{experiment}: {torch_threads(exp.engine)} torch thread(s) a process (engine.threads: "
              f"{exp.engine.threads}; {usable_cores()} cores, {exp.engine.max_workers} chunk workers)")
    with prefect_api() if orchestrated and todo else contextlib.nullcontext():
        for run_name, seed in todo:
            if orchestrated:
                results[run_name, seed] = train_flow.with_options(task_runner=task_runner(exp.engine))(
                    experiment, run_name, seed, params_path, root, on_config_change
                )
            else:
                results[run_name, seed] = train_run(
                    exp.for_run(run_name, seed), run_name, exp.hyper[run_name],
                    Path(root), InlineSteps(exp.engine.max_workers), on_config_change, params.tracking,
                )
    if todo:
        print(f"{experiment}: {len(todo)} runs trained in {time.monotonic() - started:.0f} s")
    return results


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)

    def train() -> dict:
        if args.set or args.name:
            raise ConfigError(f"--{'set' if args.set else 'name'} makes a sweep: python -m flows.sweep "
                              f"{args.experiment} ... (the same options)")
        return train_experiment(args.experiment, args.params, args.root, args.on_config_change, args.algorithms,
                                args.seeds)

    return stage_main("train", train)


if __name__ == "__main__":
    sys.exit(main())
