"""Which runs count and what each method's runs say: reading MLflow into `MethodResult`s."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from pfl_tasks.config import VerdictConfig, load_params
from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER
from pfl_tasks.errors import ComparisonError
from pfl_tasks.outputs import CLIENTS_CSV, pinned_run
from pfl_tasks.runs import RunPaths
from pfl_tasks.selection import plateau
from pfl_tasks.stats import mean_ci
from pfl_tasks.tracking import local_artifact_dir, open_store, sqlite_path


ALL_VALIDATION = "every client's validation rows"


CLIENTS_TABLE = CLIENTS_CSV["selected"]  # each client's metrics at the round selected on validation


# PFLlib's published statistic (Zhang et al., JMLR 2025): the test metric weighted by the clients'
# test samples (its sum of correct over sum of samples), at the best round *on test*
TEST_SELECTED = "test/personalized/{metric}_weighted"


def configured_runs(params, experiment: str, root: Path | None = None) -> dict[tuple[str, int], str | None]:
    """(method, seed) of every run the params file configures for `experiment`, Learn2pFed's
    included (runs under names or seeds since removed do not count), each with the MLflow run
    its DVC metrics file under `root` names: the run whose outputs the workspace holds (after
    `dvc exp apply` too), None where there is no such file."""
    exp = params.experiment(experiment)
    names = list(exp.algorithms)
    if experiment in params.learn2pfed:
        names += [f"learn2pfed-{s}" for s in params.learn2pfed[experiment].supervision]
    runs = {}
    for name in names:
        where = f"learn2pfed/{experiment}" if name.startswith("learn2pfed-") else experiment
        for seed in exp.seeds:
            path = RunPaths.of(root, where, name, seed).metrics if root is not None else None
            try:
                record = json.loads(path.read_text()) if path is not None and path.exists() else {}
                if not isinstance(record, dict):
                    raise ValueError(f"a JSON {type(record).__name__}, not an object")
            except ValueError as err:  # garbled JSON or text
                raise ComparisonError(f"{path}: not a metrics file ({err}): rerun its run's stage or delete it") from None
            runs[name, seed] = pinned_run(record)
    return runs


def downstream_methods(params, experiment: str) -> dict[str, str]:
    """method -> the method whose trained runs it is trained on (Learn2pFed's `features_from`)."""
    cfg = params.learn2pfed.get(experiment)
    if cfg is None or cfg.features_from is None:
        return {}
    return {f"learn2pfed-{supervision}": cfg.features_from for supervision in cfg.supervision}


def results_store(uri: str, experiments: list[str], params_path: str, every: bool = True):
    """(MlflowClient, those of `experiments` it holds) for the store a report reads; a
    ComparisonError that says what to run first when it holds none of them or (`every`) not all.
    A sqlite store that is not there yet stays so (MLflow would create an empty one); one that
    cannot be read, or a server that does not answer, is `open_store`'s TrackingError."""
    from mlflow.tracking import MlflowClient

    path = sqlite_path(uri)
    if path is None or path.exists():
        open_store(uri)
    client = MlflowClient(tracking_uri=uri) if path is None or path.exists() else None
    held = [e for e in experiments if client is not None and client.get_experiment_by_name(e) is not None]
    if len(held) < len(experiments) and (every or not held):
        first = ("`dvc repro` (or `make run`)" if Path(params_path) == Path("params.yaml")
                 else f"`python -m flows.pipeline --params {params_path}`")
        missing = [e for e in experiments if e not in held]
        configured = load_params(params_path).experiments
        unknown = [e for e in missing if e not in configured]
        if unknown:  # neither run nor configured: a typo, not a stage to run
            raise ComparisonError(f"no experiment(s) {unknown} in {uri}, and {params_path} configures none of that "
                                  f"name (it has {sorted(configured)})")
        raise ComparisonError(f"no runs of experiment(s) {missing} in {uri}: run {first} first (a store lost or "
                              f"reset: `python -m flows.train {missing[0]}` logs its finished runs anew from their "
                              "checkpoints)")
    return client, held


def collect(client, experiment: str, only: dict[tuple[str, int], str | None] | None = None) -> dict[str, dict[int, object]]:
    """method -> seed -> the run that counts: of the (method, seed) pairs in `only` when given,
    the run it names, else (or when this store does not hold that run finished) the newest run
    that FINISHED or diverged (FAILED with `diverged_at`)."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ComparisonError(f"MLflow at {client.tracking_uri} has no experiment '{experiment}'")
    runs, token = [], None
    while True:
        page = client.search_runs(
            [found.experiment_id], "",
            order_by=["attributes.start_time DESC"], max_results=1000, page_token=token,
        )
        runs += page
        token = page.token
        if not token:
            break
    ended = [r for r in runs if (r.info.status == "FINISHED" or "diverged_at" in r.data.tags)
             and "algorithm" in r.data.tags and "seed" in r.data.tags]
    ids = {r.info.run_id for r in ended}
    if only is not None:
        refuse_deleted(client, experiment, {key: run_id for key, run_id in only.items()
                                            if run_id is not None and run_id not in ids})
    chosen: dict[str, dict[int, object]] = {}
    for run in ended:
        key = variant(run), int(run.data.tags["seed"])
        if only is not None and key not in only:
            continue
        pinned = only[key] if only is not None else None
        if pinned is not None and pinned not in ids:  # not in this store (another clone's, or reset): say so
            print(f"{experiment}: {key[0]} seed {key[1]}: the workspace names MLflow run {pinned}, which "
                  f"{client.tracking_uri} does not hold finished; the newest run counts", file=sys.stderr)
            only = {**only, key: None}
        elif pinned is not None and pinned != run.info.run_id:
            continue
        chosen.setdefault(key[0], {}).setdefault(key[1], run)
    if not chosen:
        raise ComparisonError(f"MLflow experiment '{experiment}' has no finished runs tagged with an algorithm "
                              f"(`python -m flows.train {experiment}` marks those its checkpoints and metrics finished)")
    lost = [f"{m} seed {seed}" for (m, seed), run_id in (only or {}).items()
            if run_id is not None and seed not in chosen.get(m, {})]
    if lost:
        raise ComparisonError(f"{experiment}: {', '.join(lost)} finished in this workspace (its metrics file) but "
                              f"{client.tracking_uri} holds no finished run of it: rerun its stage, or compare "
                              "against the store that trained it")
    return chosen


def refuse_deleted(client, experiment: str, missing: dict[tuple[str, int], str]) -> None:
    """A ComparisonError naming the first configured run whose metrics file names an MLflow run
    that was deleted (a report would silently lose it)."""
    from mlflow.exceptions import MlflowException

    for (method, seed), run_id in missing.items():
        try:
            deleted = client.get_run(run_id).info.lifecycle_stage == "deleted"
        except MlflowException:  # not in this store: another clone's
            continue
        if deleted:
            raise ComparisonError(
                f"{experiment}: {method} seed {seed}: its metrics file names MLflow run {run_id}, which is deleted in "
                f"{client.tracking_uri}: restore it (`mlflow runs restore --run-id {run_id}`) or rerun its stage")


def variant(run) -> str:
    """The run name a run was configured under (`ditto_mu1`; tag `algorithm` is its class,
    `ditto`); runs logged before the `variant` tag carried the run name as `algorithm`."""
    return run.data.tags.get("variant", run.data.tags["algorithm"])


def selection_metric(metric: str) -> str:
    """What a sweep selects on: the mean personalized validation metric at a run's selected round."""
    return f"selected/val/personalized/{metric}_mean"


def primary_metric(newest: dict[str, dict[int, object]]) -> str:
    tasks = {run.data.tags.get("task") for by_seed in newest.values() for run in by_seed.values()}
    if tasks & {"classification", "regression"}:
        return "acc" if "classification" in tasks else "mse"
    keys = {k for by_seed in newest.values() for run in by_seed.values() for k in run.data.metrics}
    return "acc" if "selected/test/personalized/acc_mean" in keys else "mse"


Interval = tuple[float, float, float]  # point, low, high


@dataclass(frozen=True)
class MethodResult:
    method: str
    metric: str  # acc or mse
    seeds: list[int]  # of its finished runs
    run_ids: list[str]
    diverged: list[tuple[int, int]]  # (seed, round) of its diverged runs: then it is not ranked
    personalized: Interval | None  # selected round, test split, mean over clients and seeds
    val: float | None  # selected round, validation split: what a sweep selects on
    global_: Interval | None  # None: no global model
    worst10: float | None
    selected_rounds: list[int]
    plateaued: list[bool]  # per seed with a plateau verdict
    grad_samples: float | None  # training compute of the whole run, mean over seeds
    eval_grad_samples: float | None  # personalization compute of one evaluation
    comm_bytes: float | None  # up + down, the whole run
    global_only: bool  # the personalized model is the global one
    # seed -> per-client test metric at the selected round; when every seed trained on the same
    # partition (a natural one, split by time), one entry: each client's mean over seeds
    clients: dict[int, np.ndarray]
    data_hashes: dict[int, str]  # seed -> its partition's hash: only runs on one partition pair up
    p_vs_best: float | None = None  # Holm-adjusted; None for the best and for the unranked
    # seed -> (rounds aggregated, rounds run) of its finished runs that count their skipped rounds
    aggregated: dict[int, tuple[int, int]] = field(default_factory=dict)
    test_selected: float | None = None  # `test_selected`: for published numbers only, ranks nothing
    # the same selected rounds, sample-weighted: seed -> each client's test samples (aligned
    # with `clients`), the interval, and the Holm-adjusted p-value against the weighted best
    sizes: dict[int, np.ndarray] = field(default_factory=dict)
    weighted: Interval | None = None
    p_vs_best_weighted: float | None = None
    # the validation rows `val` is on: every client's (the split), or those its runs' tag
    # `validation_rows` names (Learn2pFed's `val` supervision), not comparable with the others'
    validation_rows: str = ALL_VALIDATION
    rule: VerdictConfig = VerdictConfig()  # what its verdicts are judged by
    # a downstream method's validation metric at its curve's step 0 (Learn2pFed: the initial
    # Theta), mean over its seeds, on the rows `val` is on
    initial_val: float | None = None
    # Learn2pFed: the test metric of its untrained Theta (meta-epoch 0), mean over its seeds
    initial_test: float | None = None
    # seed -> per-client validation metric at the selected round (what tuning pairs points on)
    val_clients: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def too_few_rounds(self) -> list[tuple[int, int, int]]:
        """(seed, rounds aggregated, rounds run) of its runs below `min_aggregated`: then it is not ranked."""
        return [(seed, done, rounds) for seed, (done, rounds) in self.aggregated.items()
                if done < self.rule.min_aggregated * rounds]

    @property
    def ranked(self) -> bool:
        return not self.diverged and not self.too_few_rounds and self.personalized is not None

    def indistinguishable(self, weighted: bool = False) -> bool:
        p = self.p_vs_best_weighted if weighted else self.p_vs_best
        return p is not None and p >= self.rule.alpha

    def score(self, weighted: bool = False) -> Interval | None:
        return self.weighted if weighted else self.personalized


def clients_table(client, run_id: str) -> pd.DataFrame | None:
    table = run_table(client, run_id, CLIENTS_TABLE)
    return None if table is None else table.set_index("client_id")


def run_table(client, run_id: str, name: str) -> pd.DataFrame | None:
    """The run's CSV artifact `name`, None where it has none."""
    local = local_artifact_dir(client.tracking_uri, client.get_run(run_id).info.artifact_uri)
    if local is not None:  # read in place (found after the checkout moved, too)
        return pd.read_csv(local / name) if (local / name).exists() else None
    if not any(a.path == name for a in client.list_artifacts(run_id)):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return pd.read_csv(client.download_artifacts(run_id, name, tmp))


def test_selected(client, run_ids: list[str], metric: str) -> float | None:
    """PFLlib's statistic, for comparison with published numbers only: each run's best
    evaluation on the test split (sample-weighted over clients), mean over seeds. It is chosen
    on test, so it is biased upward (downward for MSE) and ranks nothing."""
    best = []
    for run_id in run_ids:
        values = [m.value for m in client.get_metric_history(run_id, TEST_SELECTED.format(metric=metric))]
        if values:
            best.append(max(values) if HIGHER_IS_BETTER[metric] else min(values))
    return statistics.fmean(best) if best else None


def _mean(runs: list, key: str) -> float | None:
    values = [run.data.metrics[key] for run in runs if key in run.data.metrics]
    return statistics.fmean(values) if values else None


def initial_validation(client, run_ids: list[str], metric: str) -> float | None:
    """The mean over runs of the validation curve's step 0, None where a run has none."""
    first = [next((m.value for m in client.get_metric_history(run_id, f"val/personalized/{metric}_mean") if m.step == 0),
                  None) for run_id in run_ids]
    return None if not first or None in first else statistics.fmean(first)


def plateaued(client, run_id: str, metric: str, rule: VerdictConfig) -> bool | None:
    """Whether the run's mean personalized validation curve (MLflow's history) has plateaued
    under `rule.plateau`; None when its curve is too short to tell."""
    curve = {m.step: m.value for m in client.get_metric_history(run_id, f"val/personalized/{metric}_mean")}
    verdict = plateau(curve, metric, rule.plateau) if curve else None
    return None if verdict is None else verdict[1]


def method_result(client, method: str, by_seed: dict[int, object], metric: str,
                  rule: VerdictConfig = VerdictConfig()) -> MethodResult:
    finished = {s: r for s, r in sorted(by_seed.items()) if "diverged_at" not in r.data.tags}
    diverged = [(s, int(r.data.tags["diverged_at"])) for s, r in sorted(by_seed.items()) if s not in finished]
    runs = list(finished.values())
    tables = {s: clients_table(client, r.info.run_id) for s, r in finished.items()}
    hashes = {s: r.data.tags.get("data_hash", "") for s, r in finished.items()}
    personal = _per_partition({s: t[f"test_personalized_{metric}"].to_numpy() for s, t in tables.items()
                               if t is not None}, hashes)
    sizes = _per_partition({s: t["n_test"].to_numpy(dtype=float) for s, t in tables.items()
                            if t is not None and "n_test" in t}, hashes)
    shared = _per_partition({s: t[f"test_global_{metric}"].to_numpy() for s, t in tables.items()
                             if t is not None and f"test_global_{metric}" in t}, hashes)
    complete = all(t is not None for t in tables.values())
    up, down = _mean(runs, "final/comm/bytes_up"), _mean(runs, "final/comm/bytes_down")
    return MethodResult(
        method, metric, list(finished), [r.info.run_id for r in runs], diverged,
        mean_ci(list(personal.values())) if personal and complete else None,
        _mean(runs, selection_metric(metric)),
        mean_ci(list(shared.values())) if shared and complete else None,
        _mean(runs, f"selected/test/personalized/{metric}_worst10"),
        [int(r.data.metrics["selected/round"]) for r in runs if "selected/round" in r.data.metrics],
        [v for v in (plateaued(client, r.info.run_id, metric, rule) for r in runs) if v is not None],
        _mean(runs, "final/compute/grad_samples"), _mean(runs, "final/compute/eval_grad_samples"),
        None if up is None or down is None else up + down,
        bool(runs) and all(r.data.metrics.get("selected/personalized_is_global") == 1 for r in runs),
        personal, hashes,
        aggregated={s: (int(r.data.metrics["final/round"] - r.data.metrics["final/rounds/skipped"]),
                        int(r.data.metrics["final/round"]))
                    for s, r in finished.items() if "final/rounds/skipped" in r.data.metrics},
        test_selected=test_selected(client, [r.info.run_id for r in runs], metric),
        sizes=sizes,
        weighted=(mean_ci(list(personal.values()), weights=[sizes[s] for s in personal])
                  if personal and complete and set(sizes) == set(personal) else None),
        validation_rows=next((r.data.tags["validation_rows"] for r in runs if "validation_rows" in r.data.tags),
                             ALL_VALIDATION),
        rule=rule,
        initial_test=_mean(runs, f"initial/test/personalized/{metric}_mean"),
        val_clients={s: t[f"val_personalized_{metric}"].to_numpy() for s, t in tables.items()
                     if t is not None and f"val_personalized_{metric}" in t},
    )


def _per_partition(values: dict[int, np.ndarray], hashes: dict[int, str]) -> dict[int, np.ndarray]:
    """Per-seed client values; seeds that share one partition (the same clients, so not
    independent samples of them) as one entry of each client's mean over those seeds."""
    if len(values) > 1 and len({hashes[s] for s in values}) == 1:
        return {min(values): np.mean(list(values.values()), axis=0)}
    return values
