"""`train` stage: every algorithm of one experiment, each as one Prefect flow run.

Per round the flow runs tasks `sample_clients` -> `local_update` (mapped over client chunks,
in parallel on the task runner) -> `aggregate`, then `evaluate` every `eval_every` rounds and
`checkpoint` every `checkpoint_every` rounds. `engine.round_tasks: round` makes each round one
task run instead of 2 + one per chunk. `engine.orchestrator: inline` runs the very same steps as
plain calls, to measure Prefect's cost and to keep unit tests fast.

    python -m flows.train <experiment> [--on-config-change refuse|restart|resume]
    python -m flows.train digits --algorithms ditto fedavg --seeds 0 1        # some of its runs, in place
    python -m flows.train digits --algorithms ditto fedavg --set algorithms.ditto.mu=0.01,0.1,1
                                  # a grid: a sweep in sweeps/<name>/, one MLflow parent run, one table
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time
from pathlib import Path

import flows  # noqa: F401  (environment defaults)
from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import ValidationError

from pfl_tasks.algorithms import build, hyper_parameters, source_file, validate_params
from pfl_tasks.algorithms.federation import Federation, InlineSteps, RunState, play_rounds, run_round
from flows.stage import check_prefect_api, prefect_api, stage_main
from pfl_tasks.config import (
    ConfigError, EngineConfig, ResolvedExperiment, SweepConfig, TrackingConfig, config_hash, load_params,
    parse_assignment, parse_params,
)
from pfl_tasks.data import DataValidationError, FederatedData, load_partition, partition_dir
from pfl_tasks.data.store import read_manifest
from pfl_tasks.engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pfl_tasks.engine.device import describe, platform, resolve_device
from pfl_tasks.engine.state import gather
from pfl_tasks.imports import code_hash, numeric_code
from pfl_tasks.runs import Run, RunPaths, resume_point
from pfl_tasks.tracking import (
    dvc_curve,
    evaluation_line,
    final_metrics,
    flatten,
    learning_curve_png,
    open_store,
    per_client_rows,
    personalized_is_global,
    pinned_run,
    plateau,
    run_tags,
    selected_index,
    summarize_eval,
    tracking_uri,
    write_csv,
)

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
def federated_round(steps, fed, round_idx: int, state):
    return run_round(steps, fed, state, round_idx)


@task(**TASK_OPTIONS, task_run_name="rounds-{first_round}-{last_round}")
def federated_rounds(play, first_round: int, last_round: int):
    """Rounds `first_round` to `last_round` (counted from 1), each with its evaluation."""
    return play_rounds(play, first_round - 1, last_round)


class PrefectSteps:
    """Each step a Prefect task run; chunks are mapped onto the flow's task runner, each with
    only its own clients' rows of the client state."""

    sample = staticmethod(sample_clients)
    aggregate = staticmethod(aggregate)
    evaluate = staticmethod(evaluate)
    checkpoint = staticmethod(checkpoint)
    round = run_round
    local_update = staticmethod(local_update)
    span, spans_rounds = staticmethod(play_rounds), False

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


class RoundSteps:
    """`engine.round_tasks: round`: a round is one task run, `round-N`, that samples, runs the
    chunks on its own threads and aggregates; evaluate and checkpoint stay tasks."""

    evaluate = staticmethod(evaluate)
    checkpoint = staticmethod(checkpoint)
    span, spans_rounds = staticmethod(play_rounds), False

    def __init__(self, max_workers: int):
        self.inline = InlineSteps(max_workers)

    def round(self, fed, state, round_idx):
        return federated_round(self.inline, fed, round_idx, state)


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


# ----------------------------------------------------------------------------- one run
def run_identity(exp: ResolvedExperiment, run_name: str, raw_hp: dict, data_hash: str) -> dict:
    """What a checkpoint must share with this run to be resumed: config, data and the code that
    can change its numbers (`pfl_tasks.imports.numeric_code`). The hyper-parameters count in
    canonical form: a default spelled out in params.yaml is the same run as one left out.
    `federation.rounds` is left out (a longer run continues a shorter one), and so is the
    engine (another executor or chunking computes the same numbers up to rounding; the
    platform, which decides the rounding, is checked on its own)."""
    config = {
        "experiment": exp.model_dump(mode="json", exclude={"engine", "algorithms", "hyper", "seeds"}),
        "algorithm": hyper_parameters(run_name, raw_hp, defaults=False),
        "data": data_hash,
        "code": code_hash(numeric_code(source_file(run_name, raw_hp))),
    }
    config["experiment"]["federation"].pop("rounds")
    return {
        "experiment": exp.name,
        "algorithm": run_name,
        "config_hash": config_hash(config),
        "config": json.dumps(config, sort_keys=True),
    }


def identity_with_platform(exp: ResolvedExperiment, run_name: str, raw_hp: dict, data_hash: str) -> dict:
    """`run_identity` with the platform this process computes on: what its checkpoint records."""
    return {**run_identity(exp, run_name, raw_hp, data_hash),
            "platform": describe(platform(exp.engine, resolve_device(exp.engine.device)))}


def partition(directory: Path) -> FederatedData:
    """`load_partition`, once per process while its files stay as they are: an experiment's
    runs share their seed's partition (the samples are read, never written)."""
    files = sorted(Path(directory).iterdir()) if Path(directory).is_dir() else []
    return _loaded(Path(directory).resolve(), tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files))


@functools.lru_cache(maxsize=4)
def _loaded(directory: Path, files: tuple) -> FederatedData:
    return load_partition(directory)


def finished_outcome(exp: ResolvedExperiment, run_name: str, raw_hp: dict, root: Path) -> dict | None:
    """The DVC metrics of this run when it already finished under this very identity (config,
    data, numeric code, platform) and budget, checkpoint and metrics naming one MLflow run:
    rerunning it would compute the same numbers. None when it has to run."""
    paths = RunPaths.of(root, exp.name, run_name, exp.seed)
    try:
        outcome = json.loads(paths.metrics.read_text())
        manifest = read_manifest(partition_dir(root, exp.dataset, exp.seed))
    except (OSError, ValueError, DataValidationError):
        return None
    if outcome.get("status") != "finished" or not paths.checkpoint.exists():
        return None
    identity = identity_with_platform(exp, run_name, raw_hp, manifest.table_sha256[:16])
    try:
        ckpt = load_checkpoint(paths.checkpoint, {k: identity[k] for k in ("experiment", "algorithm", "config_hash")})
    except CheckpointError:
        return None
    same = (ckpt["round"] == exp.federation.rounds and ckpt.get("platform") == identity["platform"]
            and ckpt.get("mlflow_run_id") == pinned_run(outcome))
    return outcome if same else None


def check_inputs(exp: ResolvedExperiment, runs: list[tuple[str, int]], root: Path, on_config_change: str) -> None:
    """What `runs` (algorithm, seed) read and write, checked before the store opens, Prefect
    starts or a lock is taken, so that a bad input leaves nothing behind: the device, each seed's
    partition, each run's output folders and its checkpoint (readable and this run's; under
    `refuse`, of this configuration and platform too)."""
    resolve_device(exp.engine.device)
    for run_name, seed in runs:
        data = partition(partition_dir(root, exp.dataset, seed))  # cached for the run
        paths = RunPaths.of(root, exp.name, run_name, seed)
        paths.check_writable()
        if on_config_change == "refuse":  # then every problem of a checkpoint is an error
            identity = identity_with_platform(exp.model_copy(update={"seed": seed}), run_name,
                                              exp.hyper[run_name], data.manifest_hash)
            resume_point(paths.checkpoint, identity, exp.federation.rounds, on_config_change)
        elif paths.checkpoint.exists():
            load_checkpoint(paths.checkpoint, {"experiment": exp.name, "algorithm": run_name})


def train_run(
    exp: ResolvedExperiment, run_name: str, raw_hp: dict, root: Path, steps,
    on_config_change: str = "refuse", tracking: TrackingConfig = TrackingConfig(),
    flow_run_id: str = "",
) -> dict[str, float]:
    data = partition(partition_dir(root, exp.dataset, exp.seed))
    fed = Federation(exp, build(run_name, raw_hp), data)
    paths = RunPaths.of(root, exp.name, run_name, exp.seed)
    identity = {**run_identity(exp, run_name, raw_hp, data.manifest_hash), "platform": describe(fed.platform)}
    fedcfg = exp.federation

    with Run(paths, identity, tracking, exp.seed, total=fedcfg.rounds, unit="round",
             on_config_change=on_config_change) as run:
        ckpt = run.resumed
        if ckpt is None:
            state, history, tables, spent, skipped = fed.initial_state(), [], {}, dict.fromkeys(COSTS, 0), 0
        else:
            if "spent" not in ckpt:
                raise CheckpointError(f"{paths.checkpoint}: written before validation splits and cost accounting; "
                                      "rerun with --on-config-change restart")
            state = fed.restore(ckpt["round"], ckpt["server"], ckpt["clients"])
            history, tables, spent, skipped = ckpt["history"], ckpt["tables"], ckpt["spent"], ckpt["skipped"]
            print(f"{run.label}: resuming from round {state.round}")
        run.track(exp.name, flatten({"experiment": exp.model_dump(mode="json", exclude={"hyper"}),
                                     "algorithm": hyper_parameters(run_name, raw_hp)}),
                  {**run_tags(exp, data.task, data.partition, run_name, fed.algorithm.name, fed.algorithm.citation,
                              data.manifest_hash, identity["config_hash"], flow_run_id),
                   **{f"platform.{key}": value for key, value in fed.platform.items()}, **tracking.tags})
        run.log(history)  # what a failed MLflow write left unlogged

        def snapshot() -> dict:
            return {
                **identity, "round": state.round, "budget": fedcfg.rounds, "server": state.server,
                "clients": state.clients,
                "history": history, "tables": tables, "mlflow_run_id": run.tracker.run_id,
                "spent": spent, "skipped": skipped, "seed": exp.seed,
            }

        run.snapshot = snapshot

        def play(round_idx: int) -> str | None:
            """One round, then its evaluation when one is due; what is not finite after the
            round, if anything (a diverged run)."""
            nonlocal state, spent, skipped
            state = steps.round(fed, state, round_idx)
            done = state.round
            spent = add_costs(spent, state)
            if state.reported == 0:
                skipped += 1
                print(f"{run.label} round {done}: no sampled client reported (federation.dropout="
                      f"{fedcfg.dropout}); round skipped", file=sys.stderr)
            broken = fed.nonfinite(state)
            if broken is not None:
                return f"{broken} is not finite after round {done}"
            if done % fedcfg.eval_every == 0 or done == fedcfg.rounds:
                evaluation = steps.evaluate(fed, done, state)
                history.append({"round": done, **summarize_eval(evaluation.metrics), **spent,
                                "compute/eval_grad_samples": evaluation.grad_samples,
                                "rounds/skipped": skipped, **fed.algorithm.round_metrics(state.server)})
                tables["last"] = evaluation.metrics
                if selected_index(history, data.task) == len(history) - 1:
                    tables["selected"] = evaluation.metrics
            return None

        # a task per round, or (round_tasks: interval) per span of rounds up to the next
        # evaluation or checkpoint
        stride = math.gcd(fedcfg.eval_every, fedcfg.checkpoint_every) if steps.spans_rounds else 1
        for first, stop in run.spans(state.round, stride):
            with run.mutating():  # the rounds, each with its evaluation
                broken = steps.span(play, first, stop)
            done = state.round
            if broken is not None:
                return run.diverged(done, broken, dvc_curve(history, data.task))
            if done % fedcfg.checkpoint_every == 0 or done == fedcfg.rounds:
                steps.checkpoint(paths.checkpoint, done, snapshot())
            if history and history[-1]["round"] == done:  # evaluated
                run.log(history)
                run.note(evaluation_line(history[-1], data.task), at=done)

        final = {**final_metrics(history, data.task), **plateau(history, data.task),
                 "selected/personalized_is_global": float(personalized_is_global(tables["selected"]))}

        def artifacts(tmp: Path) -> None:
            write_csv(tmp / "clients_last.csv", per_client_rows(tables["last"]))
            write_csv(tmp / "clients_selected.csv", per_client_rows(tables["selected"]))
            learning_curve_png(tmp / "learning_curve.png", history, data.task, f"{exp.name}: {run_name}")

        run.finish(final, dvc_curve(history, data.task), artifacts)
    return final


# a run's cumulative cost, summed over clients: local compute (samples x forward-backward
# passes) and bytes sent up and down
COSTS = ("compute/grad_samples", "comm/bytes_up", "comm/bytes_down")


def add_costs(spent: dict[str, int], state: RunState) -> dict[str, int]:
    return {key: spent[key] + value for key, value in zip(COSTS, (state.grad_samples, state.bytes_up, state.bytes_down))}


@flow(name="pfl-train", flow_run_name="{experiment}-{run_name}-seed{seed}", persist_result=False)
def train_flow(
    experiment: str, run_name: str, seed: int, params_path: str = "params.yaml", root: str = ".",
    on_config_change: str = "refuse",
) -> dict[str, float]:
    from prefect.runtime import flow_run

    params = validate_params(load_params(params_path))
    exp = params.experiment(experiment).model_copy(update={"seed": seed})
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
    exp = params.experiment(experiment)
    unlisted = sorted(set(algorithms or []) - set(exp.algorithms))
    if unlisted:
        raise ConfigError(f"experiments.{experiment} does not run {unlisted} (it runs {exp.algorithms}); "
                          "if dvc.yaml asked for them, it is older than params.yaml: python -m flows.stages")
    results, started = {}, time.monotonic()
    runs = [(run_name, seed) for run_name in exp.algorithms if algorithms is None or run_name in algorithms
            for seed in exp.seeds if seeds is None or seed in seeds]
    todo = []
    for run_name, seed in runs:
        outcome = finished_outcome(exp.model_copy(update={"seed": seed}), run_name, exp.hyper[run_name], Path(root))
        if outcome is None:
            todo.append((run_name, seed))
        else:
            results[run_name, seed] = outcome
    if len(todo) < len(runs):
        print(f"{experiment}: {len(runs) - len(todo)} of {len(runs)} runs already finished under the same "
              "config, data and code: kept")
    check_inputs(exp, todo, Path(root), on_config_change)
    orchestrated = exp.engine.orchestrator == "prefect"
    if orchestrated and todo:
        check_prefect_api()
    open_store(tracking_uri(params.tracking.mlflow_uri))
    with prefect_api() if orchestrated and todo else contextlib.nullcontext():
        for run_name, seed in todo:
            if orchestrated:
                results[run_name, seed] = train_flow.with_options(task_runner=task_runner(exp.engine))(
                    experiment, run_name, seed, params_path, root, on_config_change
                )
            else:
                results[run_name, seed] = train_run(
                    exp.model_copy(update={"seed": seed}), run_name, exp.hyper[run_name],
                    Path(root), InlineSteps(exp.engine.max_workers), on_config_change, params.tracking,
                )
    if todo:
        print(f"{experiment}: {len(todo)} runs trained in {time.monotonic() - started:.0f} s")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--root", default=".", help="where its data, models, metrics and sweeps are (as flows.pipeline's)")
    parser.add_argument(
        "--on-config-change", choices=["refuse", "restart", "resume"], default="refuse",
        help="what to do with a checkpoint written under another configuration",
    )
    parser.add_argument("--algorithms", nargs="+", metavar="RUN", help="default: the experiment's")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help="default: the experiment's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=V1[,V2...]",
                        help="a grid over a key (repeatable), e.g. algorithms.ditto.mu=0.01,0.1,1 or "
                             "local.optimizer.lr=0.1,0.2: runs as a sweep in sweeps/<name>/")
    parser.add_argument("--name", help="the sweep's name (default: from the --set keys, or 'runs')")
    args = parser.parse_args(argv)
    try:
        sweep = as_sweep(args)
    except ConfigError as err:
        print(f"train failed: {err}", file=sys.stderr)
        return 2
    if sweep is not None:
        from flows.sweep import run_sweep

        return stage_main("train", lambda: run_sweep(sweep, args.root))
    return stage_main("train", lambda: train_experiment(args.experiment, args.params, args.root,
                                                        args.on_config_change, args.algorithms, args.seeds))


def as_sweep(args) -> SweepConfig | None:
    """None when the command runs configured algorithms and seeds of the experiment in place;
    else the sweep it asks for (a grid, or runs the params file does not configure), checked
    before anything starts: an error names the key."""
    params = load_params(args.params)
    exp = params.experiment(args.experiment)
    configured = set(args.algorithms or []) <= set(exp.algorithms) and set(args.seeds or []) <= set(exp.seeds)
    if not args.set and args.name is None and configured:
        return None
    grid = dict(parse_assignment(text) for text in args.set)
    name = args.name or "_".join(key.rsplit(".", 1)[-1] for key in grid) or "runs"
    try:
        sweep = SweepConfig(name=name, experiment=args.experiment, algorithms=args.algorithms, seeds=args.seeds,
                            grid=grid, params_path=args.params)
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(f"--{first['loc'][0]} {getattr(args, str(first['loc'][0]), name)!r}: {first['msg']}") from None
    validate_params(parse_params(sweep.params()))
    return sweep


if __name__ == "__main__":
    sys.exit(main())
