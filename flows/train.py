"""`train` stage: every algorithm of one experiment, each as one Prefect flow run.

Per round the flow runs tasks `sample_clients` -> `local_update` (mapped over client chunks,
in parallel on the task runner) -> `aggregate`, then `evaluate` every `eval_every` rounds and
`checkpoint` every `checkpoint_every` rounds. `engine.round_tasks: round` makes each round one
task run instead of 2 + one per chunk. `engine.orchestrator: inline` runs the very same steps as
plain calls, to measure Prefect's cost and to keep unit tests fast.

The training loop itself is the library's (`pfl_tasks.training.train_run`);
`flows.prefect_rounds` adapts its steps (`pfl_tasks.engine.rounds.Steps`) to Prefect tasks and
Ray, and is imported only for a Prefect-orchestrated stage.

    python -m flows.train <experiment> [--on-config-change refuse|restart|resume]
    python -m flows.train digits --algorithms ditto fedavg --seeds 0 1        # some of its runs, in place

A grid, or runs the params file does not configure, is a sweep: `python -m flows.sweep`.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import queue
import signal
import sys
import threading
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

import torch

from flows.stage import check_prefect_api, prefect_api, stage_main
from pfl_tasks.algorithms import ALGORITHMS, build, validate_params
from pfl_tasks.config import load_params
from pfl_tasks.data import partition_dir
from pfl_tasks.engine.device import resolve_device, torch_threads, usable_cores
from pfl_tasks.engine.federation import clients_per_round
from pfl_tasks.engine.rounds import InlineSteps
from pfl_tasks.errors import ConfigError, RunStopped
from pfl_tasks.numerics import NUMERICS_NOTE
from pfl_tasks.outputs import pinned_run
from pfl_tasks.runs import stop_runs
from pfl_tasks.tracking import open_store, tracking_uri, unmarked_runs
from pfl_tasks.training import check_inputs, finished_outcome, partition, train_run
from pfl_tasks.tuning import tuned


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
    open_store(uri, params.tracking.retry_seconds)
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
    at_once = runs_at_once(exp, todo, Path(root))
    if todo:
        print(f"{experiment}: {exp.engine.numerics} numerics ({NUMERICS_NOTE[exp.engine.numerics]}), "
              f"{torch_threads(exp.engine)} torch thread(s) a run (engine.threads: {exp.engine.threads}; "
              f"{usable_cores()} cores, {exp.engine.max_workers} workers: {at_once} run(s) at once)")
    if orchestrated and todo:
        from flows.prefect_rounds import task_runner, train_flow

    def train_one(key: tuple[str, int]) -> dict[str, float]:
        run_name, seed = key
        if orchestrated:
            return train_flow.with_options(task_runner=task_runner(exp.engine))(
                experiment, run_name, seed, params_path, root, on_config_change
            )
        return train_run(exp.for_run(run_name, seed), run_name, exp.hyper[run_name],
                         Path(root), InlineSteps(exp.engine.max_workers), on_config_change, params.tracking)

    with prefect_api() if orchestrated and todo else contextlib.nullcontext():
        results |= side_by_side(todo, train_one, at_once, torch_threads(exp.engine))
    if todo:
        print(f"{experiment}: {len(todo)} runs trained in {time.monotonic() - started:.0f} s")
    return results


def runs_at_once(exp, todo: list[tuple[str, int]], root: Path) -> int:
    """How many runs train side by side: `engine.max_workers` on CPU threads when every run's
    round fits one chunk (`engine.chunk_size`), as mnist's 20 clients do (a run then keeps one
    core busy); else one at a time, its chunks side by side."""
    if not todo or exp.engine.task_runner != "thread" or resolve_device(exp.engine.device).type != "cpu":
        return 1
    widest = max(clients_per_round(exp.for_run(run_name, seed), build(run_name, exp.hyper[run_name]),
                                   partition(partition_dir(root, exp.dataset, seed)).n_clients)
                 for run_name, seed in todo)
    return max(1, exp.engine.max_workers // -(-widest // exp.engine.chunk_size))


def side_by_side(todo: list, train_one, at_once: int, threads: int) -> dict:
    """`train_one(key)` for each key of `todo`, `at_once` at a time, each on a thread of its own
    that computes with `threads` torch threads (MKL's count is each thread's own: a new thread
    would take one per core); the results by key, in `todo`'s order. Every run computes what it
    computes alone. A signal stops every run under way after its round under way (each
    checkpointed and marked KILLED), as it stops a run in the main thread, and starts no other;
    a second leaves at once. A failed run lets those under way finish, starts no other, and is
    raised."""
    if at_once <= 1 or len(todo) <= 1:
        return {key: train_one(key) for key in todo}
    pending, results, failures, stopping = queue.SimpleQueue(), {}, [], threading.Event()
    for key in todo:
        pending.put(key)

    def work() -> None:
        torch.set_num_threads(threads)
        while not failures and not stopping.is_set():
            try:
                key = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results[key] = train_one(key)
            except BaseException as err:  # the main thread raises it
                failures.append(err)

    workers = [threading.Thread(target=contextvars.copy_context().run, args=(work,), name=f"run-{i}", daemon=True)
               for i in range(min(at_once, len(todo)))]  # each in the stage's context: its Prefect API
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join()
    except (RunStopped, KeyboardInterrupt) as stop:
        stopping.set()
        while any(worker.is_alive() for worker in workers):  # a second signal leaves them (daemons)
            stop_runs(getattr(stop, "signum", signal.SIGINT))  # again for a run that began meanwhile
            for worker in workers:
                worker.join(0.1)
        raise
    if failures:
        raise failures[0]
    return {key: results[key] for key in todo}


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
