"""One federated run from start (or its checkpoint) to its final metrics: `train_run`, the
training loop every orchestration shares (plain calls, Prefect tasks, Ray), with the run's
identity, the check that it already finished, and the inputs checked before anything starts.

    final = train_run(exp, "ditto", exp.hyper["ditto"], root, InlineSteps(2))
"""

from __future__ import annotations

import functools
import json
import math
import sys
import threading
from pathlib import Path

from pfl_tasks.algorithms import build, hyper_parameters, source_file
from pfl_tasks.config import ResolvedExperiment, TrackingConfig, config_hash, setting_hash
from pfl_tasks.data import FederatedData, load_partition, partition_dir
from pfl_tasks.data.store import read_manifest
from pfl_tasks.engine.checkpoint import load_checkpoint
from pfl_tasks.engine.device import describe, platform, resolve_device, torch_threads
from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER
from pfl_tasks.engine.federation import Federation, RunState, clients_per_round
from pfl_tasks.engine.rounds import Steps
from pfl_tasks.errors import CheckpointError, DataValidationError
from pfl_tasks.code_deps import code_hash, numeric_code
from pfl_tasks.outputs import dvc_curve, evaluation_line, learning_curve_png, pinned_run, write_client_tables
from pfl_tasks.runs import Run, RunPaths, checkpoint_problem, resume_point
from pfl_tasks.selection import (
    PRIMARY, Selection, final_metrics, personalized_is_global, summarize_eval, validation_score,
)
from pfl_tasks.tracking import flatten, run_tags

# a run's cumulative cost, summed over clients: local compute (samples x forward-backward
# passes) and bytes sent up and down
COSTS = ("compute/grad_samples", "comm/bytes_up", "comm/bytes_down")


def run_identity(exp: ResolvedExperiment, run_name: str, raw_hp: dict, data_hash: str) -> dict:
    """What a checkpoint must share with this run to be resumed: config, data and the code that
    can change its numbers (`pfl_tasks.code_deps.numeric_code`), and the platform this process
    computes on, which decides the rounding. The hyper-parameters count in canonical form: a
    default spelled out in params.yaml is the same run as one left out. `federation.rounds` is
    left out (a longer run continues a shorter one), and so is the engine (another executor or
    chunking computes the same numbers up to rounding)."""
    config = {
        "experiment": exp.model_dump(mode="json", exclude={"engine", "algorithms", "hyper", "seeds", "run_overrides"}),
        "algorithm": hyper_parameters(run_name, raw_hp, defaults=False),
        "data": data_hash,
        "code": code_hash(numeric_code(source_file(run_name, raw_hp))),
    }
    # the setting is what the run trains with, its rounds included (another budget is another
    # setting): the registered algorithm and every hyper-parameter, defaults spelled out
    algorithm = build(run_name, raw_hp)
    setting = setting_hash({**config, "algorithm": {"name": algorithm.name, **algorithm.hp.model_dump(mode="json")}})
    config["experiment"]["federation"].pop("rounds")
    return {
        "experiment": exp.name,
        "algorithm": run_name,
        "config_hash": config_hash(config),
        "setting_hash": setting,
        "config": json.dumps(config, sort_keys=True),
        "platform": describe(platform(exp.engine, resolve_device(exp.engine.device))),
    }


# a net's construction and its seeded initial parameters (`init_params`) draw from torch's
# global generator: one run at a time, where runs train side by side on threads
GLOBAL_RNG = threading.Lock()


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
    return finished(exp, run_name, raw_hp, root)[0]


def finished(exp: ResolvedExperiment, run_name: str, raw_hp: dict, root: Path) -> tuple[dict | None, str]:
    """(`finished_outcome`, "") for a finished run; (None, why it is not) otherwise."""
    paths = RunPaths.of(root, exp.name, run_name, exp.seed)
    try:
        outcome = json.loads(paths.metrics.read_text())
    except FileNotFoundError:
        return None, f"no {paths.metrics}"
    except (OSError, ValueError) as err:
        return None, f"{paths.metrics} unreadable ({type(err).__name__})"
    try:
        manifest = read_manifest(partition_dir(root, exp.dataset, exp.seed))
    except DataValidationError as err:
        return None, str(err)
    if not isinstance(outcome, dict) or outcome.get("status") != "finished":
        return None, f"{paths.metrics} says {outcome.get('status') if isinstance(outcome, dict) else outcome!r}"
    identity = run_identity(exp, run_name, raw_hp, manifest.table_sha256[:16])
    try:
        ckpt = load_checkpoint(paths.checkpoint, {k: identity[k] for k in ("experiment", "algorithm")})
    except CheckpointError as err:
        return None, str(err)
    problem, _ = checkpoint_problem(ckpt, identity, exp.federation.rounds)
    if problem is None and ckpt["round"] != exp.federation.rounds:
        problem = f"it is at round {ckpt['round']} of {exp.federation.rounds}"
    if problem is None and ckpt.get("mlflow_run_id") != pinned_run(outcome):
        problem = f"it and {paths.metrics} name different MLflow runs"
    return (None, problem) if problem else (outcome, "")


def check_inputs(exp: ResolvedExperiment, runs: list[tuple[str, int]], root: Path, on_config_change: str) -> None:
    """What `runs` (algorithm, seed) read and write, checked before the store opens, Prefect
    starts or a lock is taken, so that a bad input leaves nothing behind: the device, each seed's
    partition, the federation each run asks of it, each run's output folders and its checkpoint
    (readable and this run's; under `refuse`, of this configuration and platform too)."""
    resolve_device(exp.engine.device)
    for run_name, seed in runs:
        data = partition(partition_dir(root, exp.dataset, seed))  # cached for the run
        clients_per_round(exp.for_run(run_name, seed), build(run_name, exp.hyper[run_name]), data.n_clients)
        paths = RunPaths.of(root, exp.name, run_name, seed)
        paths.check_writable()
        if on_config_change == "refuse":  # then every problem of a checkpoint is an error
            run = exp.for_run(run_name, seed)
            identity = run_identity(run, run_name, exp.hyper[run_name], data.manifest_hash)
            resume_point(paths.checkpoint, identity, run.federation.rounds, on_config_change)
        elif paths.checkpoint.exists():
            load_checkpoint(paths.checkpoint, {"experiment": exp.name, "algorithm": run_name})


def train_run(
    exp: ResolvedExperiment, run_name: str, raw_hp: dict, root: Path, steps: Steps,
    on_config_change: str = "refuse", tracking: TrackingConfig = TrackingConfig(),
    flow_run_id: str = "",
) -> dict[str, float]:
    data = partition(partition_dir(root, exp.dataset, exp.seed))
    with GLOBAL_RNG:
        fed = Federation(exp, build(run_name, raw_hp), data)
    paths = RunPaths.of(root, exp.name, run_name, exp.seed)
    identity = run_identity(exp, run_name, raw_hp, data.manifest_hash)
    fedcfg = exp.federation

    with Run(paths, identity, tracking, exp.seed, total=fedcfg.rounds, unit="round",
             on_config_change=on_config_change) as run:
        ckpt = run.resumed
        if ckpt is None:
            with GLOBAL_RNG:
                state = fed.initial_state()
            history, tables, spent, skipped = [], {}, dict.fromkeys(COSTS, 0), 0
            selection = Selection(HIGHER_IS_BETTER[PRIMARY[data.task]])
        else:
            try:
                if "selection" not in ckpt:
                    raise CheckpointError("written before the noise-aware selection rule; "
                                          "rerun with --on-config-change restart")
                selection = Selection.from_dict(ckpt["selection"])
                with GLOBAL_RNG:
                    state = fed.restore(ckpt["round"], ckpt["server"], ckpt["clients"])
            except CheckpointError as err:
                raise CheckpointError(f"{paths.checkpoint}: {err}") from None
            history, tables, spent, skipped = ckpt["history"], ckpt["tables"], ckpt["spent"], ckpt["skipped"]
            print(f"{run.label}: resuming from round {state.round}")
        run.track(exp.name, flatten({"experiment": exp.model_dump(mode="json", exclude={"hyper", "run_overrides"}),
                                     "algorithm": hyper_parameters(run_name, raw_hp)}),
                  {**run_tags(exp, data.task, data.partition, run_name, fed.algorithm.name, fed.algorithm.citation,
                              data.manifest_hash, identity["config_hash"], identity["setting_hash"], flow_run_id),
                   **{f"platform.{key}": value for key, value in fed.platform.items()},
                   "engine.torch_threads": str(torch_threads(exp.engine)), **tracking.tags})
        run.log(history)  # what a failed MLflow write left unlogged

        def snapshot() -> dict:
            return {
                **identity, "round": state.round, "budget": fedcfg.rounds, "server": state.server,
                "clients": state.clients,
                "history": history, "tables": tables, "mlflow_run_id": run.tracker.run_id,
                "spent": spent, "skipped": skipped, "seed": exp.seed, "selection": selection.as_dict(),
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
                score = validation_score(evaluation.metrics, data.task, evaluation.val_rows)
                history.append({"round": done, **summarize_eval(evaluation.metrics), **spent,
                                **({} if score is None else {f"val/personalized/{PRIMARY[data.task]}_se": score.se}),
                                "compute/eval_grad_samples": evaluation.grad_samples,
                                "rounds/skipped": skipped, **fed.algorithm.round_metrics(state.server)})
                tables["last"] = evaluation.metrics
                if selection.offer(len(history) - 1, score):
                    tables["selected"] = evaluation.metrics
            return None

        def advance(first: int, stop: int) -> tuple[int, str] | None:
            problem = steps.span(play, first, stop)
            return None if problem is None else (state.round, problem)

        def summary(done: int) -> str | None:
            evaluated = history and history[-1]["round"] == done
            return evaluation_line(history[-1], data.task) if evaluated else None

        # a task per round, or (round_tasks: interval) per span of rounds up to the next
        # evaluation or checkpoint
        stride = math.gcd(fedcfg.eval_every, fedcfg.checkpoint_every) if steps.spans_rounds else 1
        diverged = run.play(state.round, stride, advance, steps.checkpoint, fedcfg.checkpoint_every, history, summary)
        if diverged is not None:
            return run.diverged(*diverged, dvc_curve(history, data.task))

        final = {**final_metrics(history, selection.index),
                 "selected/personalized_is_global": float(personalized_is_global(tables["selected"]))}

        def artifacts(tmp: Path) -> None:
            write_client_tables(tmp, tables, data.client_names)
            learning_curve_png(tmp / "learning_curve.png", history, data.task, f"{exp.name}: {run_name}")

        run.finish(final, dvc_curve(history, data.task), artifacts)
    return final


def add_costs(spent: dict[str, int], state: RunState) -> dict[str, int]:
    return {key: spent[key] + value for key, value in zip(COSTS, (state.grad_samples, state.bytes_up, state.bytes_down))}
