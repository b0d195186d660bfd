"""The train stage's Prefect side, imported only when `engine.orchestrator` is `prefect`
(an inline stage, a test or a benchmark then skips Prefect's import, about 0.8 s): a run as a
Prefect flow, its round steps as tasks (`engine.round_tasks`), and its task runner (threads, or Ray)."""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from pfl_tasks import numerics
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import EngineConfig, load_params
from pfl_tasks.engine.checkpoint import save_checkpoint
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.rounds import InlineSteps, Steps, play_rounds, run_round
from pfl_tasks.engine.state import gather
from pfl_tasks.errors import ConfigError
from pfl_tasks.training import train_run
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
    if not ray.is_initialized():  # a cluster's workers take this process's numerics before their torch loads
        pinned = {k: os.environ[k] for k in numerics.PORTABLE if k in os.environ}
        ray.init(address=engine.ray_address, include_dashboard=False, namespace="prefect",
                 runtime_env={"env_vars": pinned})
    return RayTaskRunner()
