"""Comparison reports: which runs count, and what every report says of them.

The per-experiment comparison (`flows.compare`) and the paper tables (`flows.tables`) both read
MLflow through `collect` and `summarize`, so they count the same runs: for each configured
(method, seed), the run its metrics file names, else its newest that finished or diverged
(`RUNS_COUNTED`), and nothing else.

The protocol (docs/protocol.md): a method's score is the test metric of its
personalized model at the round selected on validation, per client; the cell is the mean over
seeds of the client mean, with a 95% CI from a two-level bootstrap (seeds, then clients). The
best method is compared with each other one by a paired test over clients (`stats.TEST_NAME`);
methods it cannot tell apart at `verdicts.alpha` are marked. The same runs at the same rounds are also
scored sample-weighted (all correct over all test samples: published tables' statistic), with
its own CIs and tests, and a method whose verdict (against FedAvg, or in the top group) differs
between the two statistics is flagged (`flips`). A diverged run, or one that aggregated too few
of its rounds (`verdicts.min_aggregated`), is listed, never ranked. Each run's plateau is judged
here, on its validation curve, under `verdicts.plateau`; every report prints these rules.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from pfl_tasks.config import VerdictConfig, load_params
from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER
from pfl_tasks.errors import ComparisonError
from pfl_tasks.files import atomic_write, atomic_write_text, remove_stale_temporaries
from pfl_tasks.outputs import CLIENTS_CSV, pinned_run, write_csv
from pfl_tasks.runs import RunPaths
from pfl_tasks.selection import SELECTION_RULE, plateau
from pfl_tasks.stats import TEST_NAME, WEIGHTED_TEST_NAME, holm, mean_ci, paired_pvalue, paired_weighted_pvalue
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


def ordered(results: list[MethodResult], weighted: bool = False) -> list[MethodResult]:
    """The ranked methods best first by one statistic's point estimate (those with it)."""
    sign = -1 if results and HIGHER_IS_BETTER[results[0].metric] else 1
    return sorted((r for r in results if r.ranked and r.score(weighted) is not None),
                  key=lambda r: (sign * r.score(weighted)[0], r.method))


def _p_values(reference: MethodResult, others: list[MethodResult], weighted: bool) -> dict[str, float]:
    """Holm-adjusted p-values of `reference` against each of `others`, over their common seeds."""
    raw = {}
    for r in others:
        common = sorted(s for s in set(reference.clients) & set(r.clients)
                        if reference.data_hashes[s] == r.data_hashes[s])
        if not common:
            continue
        a, b = [reference.clients[s] for s in common], [r.clients[s] for s in common]
        raw[r.method] = (paired_weighted_pvalue(a, b, [reference.sizes[s] for s in common]) if weighted
                         else paired_pvalue(a, b))
    return holm(raw)


def summarize(client, newest: dict[str, dict[int, object]], metric: str,
              rule: VerdictConfig = VerdictConfig()) -> list[MethodResult]:
    """Every method, the ranked ones best first (by the client mean's point estimate), then the
    unranked; each ranked method but the best carries its Holm-adjusted p-value against the
    best, and likewise against the best by the sample-weighted statistic; verdicts by `rule`."""
    results = with_p_values([method_result(client, m, by_seed, metric, rule) for m, by_seed in newest.items()])
    by_method = {r.method: r for r in results}
    unranked = sorted((r for r in results if not r.ranked), key=lambda r: r.method)
    return [by_method[r.method] for r in ordered(results)] + unranked


def with_p_values(results: list[MethodResult]) -> list[MethodResult]:
    """`results`, each ranked method but the best with its Holm-adjusted p-values against the
    best by either statistic."""
    for weighted, key in ((False, "p_vs_best"), (True, "p_vs_best_weighted")):
        ranked = ordered(results, weighted)
        if len(ranked) > 1:
            adjusted = _p_values(ranked[0], ranked[1:], weighted)
            results = [replace(r, **{key: adjusted[r.method]}) if r.method in adjusted else r for r in results]
    return results


REFERENCE = "fedavg"  # the baseline whose global model every verdict is read against


@dataclass(frozen=True)
class Verdict:
    """A method's verdict by one statistic: its side of FedAvg's global model by a paired test
    ('better' or 'worse' where the Holm-adjusted p-value is below alpha, else 'level'; '' without
    a FedAvg row), that test's p-value and the point estimate's gap, and whether it is in the top
    group (not significantly different from the best)."""

    side: str
    p: float | None
    gap: float | None
    top: bool

    def said(self) -> str:
        relation = {"better": "significantly better than", "worse": "significantly worse than"}.get(
            self.side, "not significantly different from")
        p = "p < 0.001" if self.p < 0.001 else f"p = {self.p:.3g}"  # a bootstrap's 2,000 draws resolve no less
        return f"{relation} FedAvg ({self.gap:+.4f}, {p})"


def verdicts(results: list[MethodResult], weighted: bool) -> dict[str, Verdict]:
    """method -> its `Verdict` by one statistic (the ranked methods)."""
    ranked = ordered(results, weighted)
    if not ranked:
        return {}
    reference = next((r for r in ranked if r.method == REFERENCE), None)
    others = [r for r in ranked if r is not reference]
    p_values = _p_values(reference, others, weighted) if reference is not None else {}
    higher = HIGHER_IS_BETTER[ranked[0].metric]
    out = {}
    for r in ranked:
        side, gap, p = "", None, p_values.get(r.method)
        if p is not None:
            gap = r.score(weighted)[0] - reference.score(weighted)[0]
            side = "level" if p >= r.rule.alpha else "better" if (gap > 0) == higher else "worse"
        out[r.method] = Verdict(side, p, gap, r is ranked[0] or r.indistinguishable(weighted))
    return out


def flips(results: list[MethodResult]) -> dict[str, str]:
    """method -> a sentence, for each method whose verdict differs between the client mean and
    the sample-weighted statistic by their tests: one calls it significantly better (or worse) than
    FedAvg's global model and the other does not, or says the opposite; or it is in the top group
    by one test and out of it by the other. A point estimate's side alone flags nothing."""
    by_mean, by_weight = verdicts(results, False), verdicts(results, True)
    out = {}
    for method in by_mean.keys() & by_weight.keys():
        mean, weight = by_mean[method], by_weight[method]
        top, w_top = mean.top, weight.top
        said = []
        if mean.side and weight.side and mean.side != weight.side:
            said.append(f"on the client mean it is {mean.said()}, sample-weighted {weight.said()}")
        if top != w_top:
            said.append(f"it is {'in' if top else 'out of'} the top group on the client mean but "
                        f"{'in' if w_top else 'out of'} it sample-weighted")
        if said:
            out[method] = "; ".join(said)
    return dict(sorted(out.items()))


def winner_on_validation(results: list[MethodResult]) -> MethodResult | None:
    """The ranked method with the best validation metric at its selected rounds: a sweep's
    choice, made without the test split; among the methods scored on every validation row."""
    scored = [r for r in results if r.ranked and r.val is not None and r.validation_rows == ALL_VALIDATION]
    if not scored:
        return None
    pick = max if HIGHER_IS_BETTER[scored[0].metric] else min
    return pick(scored, key=lambda r: r.val)


def best_per_method(rankings: dict[str, list[MethodResult]], method_of: dict[str, str]) -> dict[str, tuple[str, MethodResult]]:
    """method -> (experiment, variant) best on validation among its variants (`method_of`:
    variant -> method) over every experiment of a sweep: each method tuned, never on test."""
    candidates: dict[str, list[tuple[str, MethodResult]]] = {}
    for experiment, results in rankings.items():
        for r in results:
            if r.ranked and r.val is not None:
                candidates.setdefault(method_of.get(r.method, r.method), []).append((experiment, r))
    out = {}
    for method, found in sorted(candidates.items()):
        pick = max if HIGHER_IS_BETTER[found[0][1].metric] else min
        out[method] = pick(found, key=lambda pair: pair[1].val)
    return out


# ----------------------------------------------------------------------------- formatting
def interval(value: Interval | None) -> str:
    if value is None:
        return "–"
    point, low, high = value
    return f"{point:.4f} [{low:.4f}, {high:.4f}]"


def marks(result: MethodResult, chosen: bool, flipped: bool = False, weighted: bool = False) -> str:
    """≈: not significantly different from the best (by the statistic `weighted` says); †: its
    personalized model is the global one; ✓: `chosen`, the best on validation
    (`winner_on_validation`); ⚑: `flipped`, its verdict differs between the statistics (`flips`)."""
    return (("≈" if result.indistinguishable(weighted) else "") + ("†" if result.global_only else "")
            + ("✓" if chosen else "") + ("⚑" if flipped else ""))


def unranked_note(result: MethodResult) -> str:
    """Why a method is not ranked."""
    reasons = []
    if result.diverged:
        reasons.append("diverged at " + ", ".join(f"round {at} (seed {seed})" for seed, at in result.diverged))
    if result.too_few_rounds:
        reasons.append("too few rounds aggregated: " + ", ".join(
            f"{done} of {rounds} (seed {seed})" for seed, done, rounds in result.too_few_rounds))
    return "; ".join(reasons) or "no per-client results"


def _count(value: float | None, unit: float, suffix: str) -> str:
    return "–" if value is None else f"{value / unit:.3g}{suffix}"


def _aggregated(result: MethodResult) -> str:
    return ", ".join(f"{done}/{rounds}" for done, rounds in result.aggregated.values()) or "–"


def _plateau(result: MethodResult) -> str:
    if not result.plateaued:
        return "–"
    return f"{sum(result.plateaued)}/{len(result.plateaued)}"


def top_group(results: list[MethodResult], weighted: bool = False) -> list[MethodResult]:
    """The best ranked method by one statistic and every method ≈ to it, best first."""
    ranked = ordered(results, weighted)
    return ranked[:1] + [r for r in ranked[1:] if r.indistinguishable(weighted)]


def best_line(results: list[MethodResult], weighted: bool = False) -> str:
    """What a console line may claim of a ranking (by the client mean, or `weighted`): a best
    method only when it is significantly better than every other, else the top group (it and
    every method marked ≈); and, when not every run plateaued on validation, that the ranking
    may be premature."""
    ranked = ordered(results, weighted)
    if not ranked:
        return "none ranked"
    group = top_group(results, weighted)
    named = ", ".join(f"{r.method} ({r.score(weighted)[0]:.4f})" for r in group)
    line = f"best {named}" if len(group) == 1 else f"top group (not significantly different): {named}"
    verdicts = [reached for r in ranked for reached in r.plateaued]
    if not all(verdicts):
        line += f" ({sum(verdicts)} of {len(verdicts)} runs plateaued on validation: the ranking may be premature)"
    return line


def protocol_lines(rule: VerdictConfig) -> list[str]:
    """How a report's numbers and marks are made, a short sentence each."""
    return [
        "Cell: each client's test accuracy (higher is better) or MSE (lower is better) of its personalized model, "
        "mean over clients and seeds; 95% CI: two-level bootstrap (seeds, then clients). "
        f"Round: {SELECTION_RULE}. "
        f"≈: not significantly different from the best, rank 1 ({TEST_NAME}, α = {rule.alpha}). "
        "In the tables for a paper the best is in bold. "
        "†: the \"personalized\" model is the global model. "
        "✓: the best on validation, what a sweep selects. "
        f"Diverged runs, and runs that aggregated fewer than {rule.min_aggregated:.0%} of their rounds, are listed, "
        "not ranked.",
        f"Verdict rules (`verdicts` in the params file): α = {rule.alpha}, min_aggregated = {rule.min_aggregated}, "
        f"plateau: window {rule.plateau.window} of the rounds, gain below {rule.plateau.acc} accuracy "
        f"or {rule.plateau.mse:.0%} of the MSE.",
        RUNS_COUNTED,
    ]


METRIC_WORDS = {"acc": "test accuracy", "mse": "test MSE"}
BASELINES = ("fedavg", "local")  # the budgets are chosen so that these plateau (docs/protocol.md)


def verdict_lines(results: list[MethodResult]) -> list[str]:
    """A report's opening, in words: what its ranking concludes (the best, or the top group
    and that no method beats it), where a rank and the top group disagree, and what would make
    the ranking premature (a baseline's budget that did not plateau, runs that did not)."""
    ranked = ordered(results)
    if not ranked:
        return ["**Verdict:** no method is ranked; the runs below diverged or aggregated too few rounds."]
    best, group = ranked[0], top_group(results)
    statistic = f"the client mean of the personalized {METRIC_WORDS[best.metric]}"
    if len(group) == 1:
        lines = [f"**Verdict:** {best.method} is best by {statistic}, significantly better than every other "
                 "ranked method."]
    else:
        lines = [f"**Verdict:** no method is significantly better than the others by {statistic}. "
                 f"The top group, not significantly different from {best.method} (rank 1): "
                 f"{', '.join(r.method for r in group[1:])}."]
    rank = {r.method: i for i, r in enumerate(ranked, 1)}
    worse = [r for r in ranked[1:] if r.p_vs_best is not None and not r.indistinguishable()]
    untested = [r.method for r in ranked[1:] if r.p_vs_best is None]
    if worse:
        lines[0] += (f" The other {len(worse)} ranked methods are" if len(worse) > 1 else " The other ranked method is"
                     ) + f" significantly worse than {best.method}."
    if untested:
        lines[0] += f" Not tested against it (no partition in common): {', '.join(untested)}."
    outranking = [(r, [g for g in group if rank[g.method] > rank[r.method]]) for r in worse]
    for r, inside in (pair for pair in outranking if pair[1]):
        lines.append(f"{r.method} (rank {rank[r.method]}, p = {r.p_vs_best:.2g}) is outside the top group, while "
                     f"{', '.join(f'{g.method} ({rank[g.method]})' for g in inside)} "
                     f"{'are' if len(inside) > 1 else 'is'} inside.")
    if any(inside for _, inside in outranking):
        lines.append(f"Ranks order the means; the group is a paired test of each client's difference from "
                     f"{best.method}, which a consistent deficit fails.")
    by_method = {r.method: r for r in ranked}
    for name in BASELINES:
        seeds = by_method[name].plateaued if name in by_method else []
        if seeds and not all(seeds):
            lines.append(f"⚠ The protocol chooses budgets on which {name} plateaus, but it plateaued on "
                         f"{sum(seeds)} of {len(seeds)} seeds: its budget is short, and more rounds may change "
                         "the ranking.")
    verdicts = [reached for r in ranked for reached in r.plateaued]
    if not all(verdicts):
        lines.append(f"⚠ {sum(verdicts)} of {len(verdicts)} ranked runs plateaued on validation: the ranking "
                     "may be premature.")
    return lines


RUNS_COUNTED = (  # `configured_runs`, then `collect`
    "Runs: per configured method and seed, the MLflow run that its metrics file in this workspace names "
    "(metrics/<experiment>/<method>/seed-<seed>.json, as `dvc repro` or `dvc exp apply` left it). Where there is "
    "no such file, or the store does not hold that run (another clone's), the newest run of that method and seed "
    "that finished or diverged. A named run that was deleted, or a finished method without any run, stops the "
    "report.")


STATISTICS_NOTE = (
    "Two statistics of the same runs at the same validation-selected rounds. The table above ranks by the client "
    "mean: each client's accuracy counts once, as each client is a user of its own personalized model, which "
    "is what personalization promises. Published tables (PFLlib's among them) weight clients by their test "
    "samples (all correct over all test samples), which lets the largest clients decide: under label skew "
    "they hold few labels and do well locally, while small clients do not. Neither is wrong, so both are "
    "shown, and a method whose verdict changes between them is marked ⚑."
)


def markdown(experiment: str, metric: str, results: list[MethodResult], figures: dict[str, str],
             tuning: dict | None = None, downstream: dict[str, str] | None = None,
             rule: VerdictConfig = VerdictConfig()) -> str:
    window = f"{rule.plateau.window:.0%}"
    tolerance = f"{rule.plateau.acc} accuracy" if metric == "acc" else f"{rule.plateau.mse:.0%} of the MSE"
    lines = [
        f"# {experiment}: comparison",
        "",
        *verdict_lines(results),
        "",
        *protocol_lines(rule),
        "⚑: the verdict differs between the client mean and the sample-weighted statistic, each by its own paired "
        "test, Holm-adjusted. "
        "Either one statistic finds it significantly better or worse than FedAvg's global model and the other does "
        "not, or it is in one statistic's top group only. "
        "A difference of point estimates alone flags nothing.",
        f"Plateaued: seeds whose mean validation metric over the last {window} of the rounds gained less than "
        f"{tolerance} on the {window} before. Rounds aggregated: per seed, the rounds in which a sampled client "
        "reported, of the rounds run. Compute: samples × forward-backward passes over all clients, the whole run. "
        "Beside it, one evaluation's personalization, and the tuning's: every grid point the method was tuned over. "
        "Communication: bytes up and down, the whole run.",
        "",
        "| rank | method | seeds | validation | personalized, test (95% CI) | global, test (95% CI) "
        "| worst 10% of clients | selected rounds | rounds aggregated | plateaued | compute | + per evaluation "
        "| + tuning | communication |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    chosen, flipped = winner_on_validation(results), flips(results)
    tuning_cost = {m: e.get("grad_samples") for m, e in (tuning or {}).get("methods", {}).items()}
    for i, r in enumerate((r for r in results if r.ranked), 1):
        lines.append(
            f"| {i} | {r.method}{marks(r, r is chosen, r.method in flipped)} | {len(r.seeds)} "
            f"| {'–' if r.val is None else f'{r.val:.4f}'} | {interval(r.personalized)} | {interval(r.global_)} "
            f"| {'–' if r.worst10 is None else f'{r.worst10:.4f}'} | {', '.join(map(str, r.selected_rounds)) or '–'} "
            f"| {_aggregated(r)} | {_plateau(r)} | {_count(r.grad_samples, 1e6, 'M')} "
            f"| {_count(r.eval_grad_samples, 1e6, 'M')} | {_count(tuning_cost.get(r.method), 1e6, 'M')} "
            f"| {_count(r.comm_bytes, 2**20, ' MiB')} |"
        )
    ranked = [r for r in results if r.ranked]
    if chosen is not None and chosen is not ranked[0]:
        lines += ["", f"✓ {chosen.method}, ranked {ranked.index(chosen) + 1} here, is the best on validation: "
                      "what choosing among these rows (a sweep's variants, a method's settings) picks. The ranks "
                      "order the rows by test, to compare methods each chosen on validation; choosing the rank-1 "
                      "row among variants would be choosing on test."]
    for r in results:
        if r.validation_rows != ALL_VALIDATION:
            lines += ["", f"{r.method}'s validation number is on {r.validation_rows}, not every row the others' "
                          "are on: it is not compared for ✓."]
    shown = {r.method for r in results}
    for method, upstream in (downstream or {}).items():
        if method not in shown:
            continue
        lines += ["", f"{method} is trained on the frozen body of {upstream}'s trained runs, seed for seed: "
                      f"{upstream}'s compute and communication (its row, and its tuning) come before its own, "
                      "whose passes are over the linear head alone."]
    for r in results:
        if r.initial_val is None or r.val is None:
            continue
        gained = r.val > r.initial_val if HIGHER_IS_BETTER[metric] else r.val < r.initial_val
        lines += ["", f"{r.method}'s meta-training: validation {metric} {r.initial_val:.4f} at meta-epoch 0 (the initial "
                      f"Θ), {r.val:.4f} at the selected meta-epochs, mean over seeds"
                      + ("." if gained else ": its meta-training adds nothing here; what it gains comes from its "
                         "cells run at the initial Θ.")]
    for r in results:
        if r.initial_test is not None and r.personalized is not None:
            lines += ["", f"{r.method} with its untrained Θ (meta-epoch 0) scores test {metric} {r.initial_test:.4f}, "
                          f"against {r.personalized[0]:.4f} at the selected meta-epochs (mean over seeds; shown, "
                          "not tested, never selected on)."]
    unranked = [r for r in results if not r.ranked]
    if unranked:
        lines += ["", "Not ranked:", ""]
        lines += [f"- {r.method}: {unranked_note(r)}" for r in unranked]
    lines += weighted_lines(results, flipped, rule)
    lines += tuning_lines(tuning)
    lines += test_selected_lines(results)
    lines.append("")
    lines += [f"![{caption}]({path})\n" for caption, path in figures.items()]
    return "\n".join(lines)


def weighted_lines(results: list[MethodResult], flipped: dict[str, str], rule: VerdictConfig) -> list[str]:
    """The second statistic's table, ranked by it with its own CIs and tests, then a sentence
    for each method whose verdict flips between the two."""
    ranked = ordered(results, weighted=True)
    if not ranked:
        return []
    lines = ["", "## Sample-weighted, validation-selected", "", STATISTICS_NOTE, "",
             "The same runs at the same selected rounds, scored as all correct over all test samples of each "
             f"seed (MSE: weighted by test samples), mean over seeds, with a 95% CI (two-level bootstrap). ≈: not "
             f"significantly different from this table's best ({WEIGHTED_TEST_NAME}, α = {rule.alpha}).", "",
             "| rank | method | sample-weighted, test (95% CI) | client mean, test | rank by client mean |",
             "|---|---|---|---|---|"]
    by_mean = {r.method: i for i, r in enumerate(ordered(results), 1)}
    for i, r in enumerate(ranked, 1):
        lines.append(f"| {i} | {r.method}{marks(r, False, r.method in flipped, weighted=True)} "
                     f"| {interval(r.weighted)} | {r.personalized[0]:.4f} | {by_mean.get(r.method, '–')} |")
    lines += ["", "Where the verdict flips between the statistics:", ""]
    lines += [f"- ⚑ {method}: {sentence}." for method, sentence in flipped.items()] or ["- nowhere."]
    return lines


def _value(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def tuning_lines(tuning: dict | None) -> list[str]:
    """Each method's grid, as widened, and choice (`pfl_tasks.tuning`); a choice that stays at
    a grid's edge marked, with why."""
    if not tuning:
        return []
    seeds = tuning["seeds"]
    lines = ["", "## Tuning, on validation", "",
             f"Each method's values above were chosen on the mean over seed{'s' * (len(seeds) > 1)} "
             f"{', '.join(map(str, seeds))} of the validation metric at {tuning['rounds_fraction']:.0%} of its rounds "
             f"(`{tuning['selected_on']}` at its selected round; the test split is not read), over the grid below "
             f"(`tuning/{tuning['experiment']}.json`, stage `tune-{tuning['experiment']}`: "
             f"{tuning['seconds'] / 60:.1f} min of training on the machine that ran it). Of the points within "
             "noise of the best (short of it by at most the standard error of their difference, paired over "
             "the seeds and clients; – with a single pair), the choice is the one with the most keys inside their "
             "grids. A best point at a grid's edge widened the grid one step past it, within the key's "
             "bounds, and the new points trained; values in italics are those widenings. ◆: the choice stays at the "
             "edge, so the best may lie beyond it; the last column says why.", "",
             "| method | grid | chosen | validation (± SE of the difference from the best) | best, where not chosen | points finished | ◆ why |",
             "|---|---|---|---|---|---|---|"]
    for method, entry in tuning["methods"].items():
        grid = "; ".join(f"{_key(key)} {', '.join(_value(v) if v in entry['grid'][key] else f'*{_value(v)}*' for v in values)}"
                         for key, values in entry["tried"].items())
        chosen = ("none finished: the configured values" if entry["chosen"] is None else
                  ", ".join(f"{_key(key)} {_value(v)}{' ◆' if key in entry['at_edge'] else ''}"
                            for key, v in entry["chosen"].items()))
        finished = sum(not isinstance(v, str) for v in entry["points"].values())
        val, why = entry["val"], "; ".join(f"{_key(key)}: {reason}" for key, reason in entry["edge_reasons"].items())
        noise = "–" if entry.get("se") is None else f"{entry['se']:.4f}"
        best = entry.get("best")
        other = ("–" if best in (None, entry["chosen"]) else
                 f"{', '.join(f'{_key(key)} {_value(v)}' for key, v in best.items())}: {entry['best_val']:.4f}")
        lines.append(f"| {method} | {grid} | {chosen} | {'–' if val is None else f'{val:.4f} ± {noise}'} "
                     f"| {other} | {finished}/{len(entry['points'])} | {why or '–'} |")
    return lines


def _key(key: str) -> str:
    return key.removeprefix("local.optimizer.")


def test_selected_lines(results: list[MethodResult]) -> list[str]:
    """The test-selected statistic of published tables (PFLlib's), in a section of its own, for
    the ranked methods (an unranked run's best round says nothing comparable)."""
    shown = [r for r in results if r.ranked and r.test_selected is not None]
    if not shown:
        return []
    return ["", "## Test-selected and sample-weighted, for comparison with published numbers only", "",
            "PFLlib's leaderboard (and many papers) report each method's best round chosen on the test split. "
            "That number is below, for comparing with them: the personalized test metric weighted by the "
            "clients' test samples, at each run's best evaluation on test, mean over seeds. It is selected on "
            "test, so it is optimistic, and it ranks nothing: the table above does. Beside it, the same runs "
            "at their validation-selected rounds: sample-weighted (the same statistic, chosen without the "
            "test split) and the client mean (the ranked table's).", "",
            "| method | test-selected (best evaluation on test, sample-weighted) | validation-selected, sample-weighted "
            "| validation-selected, client mean |", "|---|---|---|---|",
            *(f"| {r.method} | {r.test_selected:.4f} | {'–' if r.weighted is None else f'{r.weighted[0]:.4f}'} "
              f"| {r.personalized[0]:.4f} |" for r in shown)]


# ----------------------------------------------------------------------------- paper forms
def column_cells(results: list[MethodResult], metric: str) -> dict[str, dict]:
    """A table's column: method -> its cell (`flows.tables`, and the report's own .csv/.tex).
    A ranked cell holds its rank by the client mean (1: the best, the reference of ≈) and
    whether it is the column's best on validation (✓); an unranked one says why."""
    chosen, rank = winner_on_validation(results), {r.method: i for i, r in enumerate(ordered(results), 1)}
    cells = {}
    for r in results:
        better = "higher" if HIGHER_IS_BETTER[metric] else "lower"
        if not r.ranked:
            cells[r.method] = {"metric": metric, "better": better, "status": unranked_note(r)}
            continue
        point, low, high = r.personalized
        cells[r.method] = {"metric": metric, "better": better, "rank": rank[r.method], "best": rank[r.method] == 1, "mean": point,
                           "ci_low": low, "ci_high": high, "seeds": len(r.seeds),
                           "not_worse_than_best": r.indistinguishable(), "global_only": r.global_only,
                           "best_on_validation": r is chosen, "marks": marks(r, r is chosen),
                           **({"weighted": r.weighted[0]} if r.weighted else {})}
    return cells


CSV_FIELDS = ("method", "experiment", "metric", "better", "rank", "best", "mean", "ci_low", "ci_high", "seeds", "weighted",
              "not_worse_than_best", "global_only", "best_on_validation", "status")


def csv_rows(rows: dict[str, dict[str, dict]], columns: list[str]) -> list[dict]:
    """The table in long form, a row per (method, experiment), every number unrounded (for a
    paper's own formatting or plots): `metric` (acc, mse) and which way is `better` (higher,
    lower), `rank` by the client mean and `best` (rank 1), which
    `not_worse_than_best` (≈) is relative to; `status` says why a cell is not ranked."""
    return [{"method": method, "experiment": experiment,
             **{key: row[experiment].get(key, "") for key in CSV_FIELDS[2:]}}
            for method, row in rows.items() for experiment in columns if experiment in row]


LATEX_MARKS = {"≈": r"$^{\approx}$", "†": r"$^{\dagger}$", "✓": r"$^{\checkmark}$"}  # \checkmark: amssymb


def latex(rows: dict[str, dict[str, dict]], columns: list[str], comment: str) -> str:
    """The table as a booktabs `tabular` (a paper's `\\input`) under a `% comment` line, rendered
    and escaped by pandas' Styler: each column headed by its experiment, metric and direction,
    mean [95% CI] to 3 decimals with the markdown's marks, the column's best in bold; an
    unranked cell says why in a footnote-sized line."""

    def text(c: dict | None) -> str:
        if c is None:
            return "--"
        return c["status"] if "status" in c else f"{c['mean']:.3f} [{c['ci_low']:.3f}, {c['ci_high']:.3f}]"

    def heading(col: str) -> str:
        metric = next((row[col]["metric"] for row in rows.values() if col in row), None)
        if metric is None:
            return col
        return f"{col} ({'accuracy' if metric == 'acc' else 'MSE'}, {'higher' if HIGHER_IS_BETTER[metric] else 'lower'} is better)"

    table = pd.DataFrame([[method, *(text(row.get(col)) for col in columns)] for method, row in rows.items()],
                         columns=["Method", *map(heading, columns)])
    styler = table.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1)
    for i, row in enumerate(rows.values()):
        for col in columns:
            cell = row.get(col) or {}
            marks = "".join(LATEX_MARKS.get(mark, "") for mark in cell.get("marks", ""))
            bold = (lambda v: r"\textbf{" + v + "}") if cell.get("best") else (lambda v: v)
            wrap = ((lambda v: r"{\footnotesize " + v + "}") if "status" in cell
                    else (lambda v, m=marks, b=bold: b(v) + m))
            styler.format(wrap, subset=pd.IndexSlice[[i], [heading(col)]], escape="latex")
    body = styler.to_latex(hrules=True, column_format="l" + "c" * len(columns))
    return f"% {comment}\n{body}"


def write_paper_table(stem: Path, rows: dict[str, dict[str, dict]], columns: list[str], comment: str) -> None:
    """`stem`.csv (`csv_rows`) and `stem`.tex (`latex`): a table's forms for a paper."""
    write_csv(stem.parent / f"{stem.name}.csv", csv_rows(rows, columns))
    atomic_write_text(stem.parent / f"{stem.name}.tex", latex(rows, columns, comment))


# ----------------------------------------------------------------------------- figures
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


MARKERS = "os^DvPX"  # 7 against 20 colors: no two of the first 140 methods share color and marker


# tab20 without its grey pair (indices 14, 15): a grey line means "outside the top group"
PALETTE = [2 * i for i in range(10) if i != 7] + [2 * i + 1 for i in range(10) if i != 7]


def method_styles(results: list[MethodResult]) -> dict[str, dict]:
    """Each ranked method's line style, the same in every figure of a report, the top group's
    first: tab20's nine dark colors but grey on solid lines, then its nine light ones on dashed
    lines, each with its own marker."""
    colors, top = _pyplot().get_cmap("tab20"), {r.method for r in top_group(results)}
    ranked = sorted((r.method for r in results if r.ranked), key=lambda method: method not in top)  # stable
    half = len(PALETTE) // 2
    return {method: {"color": colors(PALETTE[i % len(PALETTE)]), "linestyle": "--" if i // half % 2 else "-",
                     "marker": MARKERS[i % len(MARKERS)]} for i, method in enumerate(ranked)}


def seed_curve(client, run_ids: list[str], key: str) -> dict[int, tuple[float, float, float]]:
    """step -> mean, min and max over seeds of a per-round metric."""
    by_step: dict[int, list[float]] = {}
    for run_id in run_ids:
        for point in client.get_metric_history(run_id, key):
            by_step.setdefault(point.step, []).append(point.value)
    return {step: (statistics.fmean(values), min(values), max(values)) for step, values in sorted(by_step.items())}


GREYED = {"color": "0.72", "linestyle": "-", "marker": None, "linewidth": 0.9}  # a method outside the top group


def _legend(fig, styles: dict[str, dict], notes: dict[str, list[str]], greyed: list[str]) -> None:
    """One entry per method, in rank order, right of the panels, then one for the `greyed`;
    `notes` say whose lines hide its own."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], markersize=4, **style) for style in styles.values()]
    labels = [f"{m} ({'; '.join(notes[m])})" if m in notes else m for m in styles]
    if greyed:
        handles.append(Line2D([], [], **GREYED))
        labels.append(f"outside the top group ({len(greyed)}):\n" + "\n".join(", ".join(greyed[i:i + 3])
                                                                          for i in range(0, len(greyed), 3)))
    fig.legend(handles, labels, loc="outside right center", fontsize=8)


def _two_panels(results: list[MethodResult], title: str, panels: dict[str, str], xlabel: str, ylabel: str,
                lines, style, highlight: set[str] | None = None):
    """One figure of two panels (key -> title) sharing y, a line per ranked method in each with
    its seeds' min-max band; `lines(r, panel)` gives x -> (mean, min, max) over seeds and
    `style(ax)` sets up an x axis. A line equal to one already in its panel (FedAvg's global
    model, which is Ditto's too) is drawn once, for the method whose personalized model it is if
    any, and the legend says so. With `highlight`, the other methods are thin grey lines under
    them, without bands. None if no line was drawn."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True, layout="constrained")
    styles = method_styles(results)
    if highlight is not None:
        styles = {m: style if m in highlight else GREYED for m, style in styles.items()}
    # a shared curve is drawn once, by the first of its methods: a highlighted one, then one whose
    # personalized model is the global one
    owners_first = sorted((r for r in results if r.ranked),
                          key=lambda r: (highlight is not None and r.method not in highlight, not r.global_only))
    listed, notes = set(), {}
    for ax, (panel, panel_title) in zip(axes, panels.items()):
        owner_of: dict[tuple, str] = {}  # a drawn line's points -> its method
        for r in owners_first:
            points = lines(r, panel)
            if not points:
                continue
            listed.add(r.method)
            key = tuple(points.items())
            if key in owner_of:
                notes.setdefault(r.method, []).append(f"{panel} = {owner_of[key]}'s")
                continue
            owner_of[key] = r.method
            x = list(points)
            mean, low, high = zip(*points.values())
            greyed = styles[r.method] is GREYED
            ax.plot(x, mean, markersize=4, label=r.method, zorder=1 if greyed else 2, **styles[r.method])
            if len(r.run_ids) > 1 and not greyed:
                ax.fill_between(x, low, high, color=styles[r.method]["color"], alpha=0.15, linewidth=0)
        ax.set_title(panel_title)
        ax.grid(alpha=0.3)
        style(ax)
    if not listed:
        plt.close(fig)
        return None
    if highlight is not None:
        _focus(axes[0], [line for ax in axes for line in ax.get_lines() if line.get_label() in highlight])
    axes[0].set_ylabel(ylabel)
    fig.supxlabel(xlabel, fontsize="medium")  # one label under both panels
    fig.suptitle(title)
    _legend(fig, {m: s for m, s in styles.items() if m in listed and s is not GREYED}, notes,
            [m for m, s in styles.items() if m in listed and s is GREYED])
    return fig


def _focus(ax, lines) -> None:
    """The y range of `lines` over the later half of each one's x, padded: the highlighted
    methods told apart where they end, not squeezed by the others' or their own early rounds."""
    ys = [y for line in lines for x, y in zip(line.get_xdata(), line.get_ydata())
          if x >= (min(line.get_xdata()) + max(line.get_xdata())) / 2]
    if ys:
        low, high = min(ys), max(ys)
        pad = max(high - low, 1e-3 * max(abs(high), 1e-12)) * 0.25
        ax.set_ylim(low - pad, high + pad)


def curves_figure(client, results: list[MethodResult], metric: str, title: str):
    """Personalized and global test metric against the share of each method's own rounds (so
    that a method of ten times the rounds, L2SGD's, spans the axis as the others do), one line
    per ranked method: the top group (the best by the client mean and the methods ≈ to it) in
    color, the others in grey, the y axis the top group's range over the later half of its
    rounds; all in color when no method of the top group has a round curve (a downstream
    Learn2pFed's)."""
    kinds = {"personalized": "personalized model", "global": "global model"}
    curves = {(r.method, kind): seed_curve(client, r.run_ids, f"test/{kind}/{metric}_mean")
              for r in results if r.ranked for kind in kinds}
    rounds = {method: max(curve) for (method, _), curve in curves.items() if curve}

    def lines(r, kind):
        return {step / rounds[r.method]: value for step, value in curves[r.method, kind].items()}

    def style(ax):
        ax.set_xlim(0, 1)
        ax.xaxis.set_major_formatter(_pyplot().matplotlib.ticker.PercentFormatter(1.0))

    if not rounds:
        return None
    usual = statistics.mode(rounds.values())
    others = "".join(f"; {m}: {n}" for m, n in rounds.items() if n != usual)
    top = {r.method for r in top_group(results)}
    return _two_panels(results, title, kinds, f"share of the method's rounds ({usual} rounds{others})",
                       f"test {metric}, mean over clients", lines, style, top if top & set(rounds) else None)


def compute_figure(client, results: list[MethodResult], metric: str, title: str):
    """Personalized validation and test metric against cumulative training compute."""
    spent_of: dict[str, dict] = {}  # method -> its compute per round, read once for both panels

    def lines(r, split):
        if r.method not in spent_of:
            spent_of[r.method] = seed_curve(client, r.run_ids, "compute/grad_samples")
        spent = spent_of[r.method]
        curve = seed_curve(client, r.run_ids, f"{split}/personalized/{metric}_mean")
        return {spent[s][0]: v for s, v in curve.items() if s in spent}

    def style(ax):
        ax.set_xscale("log")

    return _two_panels(results, title, {"val": "validation", "test": "test"},
                       "training compute (samples × forward-backward passes)",
                       f"personalized {metric}, mean over clients", lines, style)


def clients_figure(client, results: list[MethodResult], metric: str, title: str):
    """Distribution over clients (all seeds) of the selected round's personalized test metric,
    a box per ranked method in its color, its mean in its marker."""
    per_method = {r.method: np.concatenate(list(r.clients.values())) for r in results if r.ranked and r.clients}
    if not per_method:
        return None
    plt = _pyplot()
    styles = method_styles(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(per_method) + 2), 4.5), layout="constrained")
    boxes = ax.boxplot(list(per_method.values()), showmeans=True, patch_artist=True, medianprops={"color": "black"})
    for box, mean, method in zip(boxes["boxes"], boxes["means"], per_method):
        box.set(facecolor=styles[method]["color"], alpha=0.7)
        mean.set(marker=styles[method]["marker"], markerfacecolor="white", markeredgecolor="black")
    ax.set_xticks(range(1, len(per_method) + 1), list(per_method), rotation=45, ha="right")
    ax.set_ylabel(f"personalized test {metric} per client\n(the clients of every seed)")
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    return fig


PARTICIPATION_CSV = "participation.csv"  # a Learn2pFed run's (learn2pfed_meta.participation_table)


def draw_participation(axes, table: pd.DataFrame, label: str) -> None:
    """Two axes: Lambda's diagonal per client and parameter group, and rho per client, initial
    (hollow, dashed) against learned (filled); geometric means over untied cells."""
    from matplotlib.ticker import MaxNLocator

    mean = table.groupby(["client_id", "group"], sort=False)[
        ["lam_initial", "lam_learned", "rho_initial", "rho_learned"]].agg(lambda x: float(np.exp(np.log(x).mean())))
    clients = mean.index.get_level_values(0).unique()
    lam_ax, rho_ax = axes
    for k, group in enumerate(mean.index.get_level_values(1).unique()):
        rows = mean.xs(group, level="group")
        color = f"C{k % 10}"
        lam_ax.plot(clients, rows["lam_initial"], "o--", color=color, markerfacecolor="white", alpha=0.7)
        lam_ax.plot(clients, rows["lam_learned"], "o-", color=color, label=group)
    rho = mean.groupby(level="client_id").first()
    rho_ax.plot(clients, rho["rho_initial"], "o--", color="gray", markerfacecolor="white", label="initial")
    rho_ax.plot(clients, rho["rho_learned"], "o-", color="black", label="learned")
    for ax, what in ((lam_ax, "Lambda's diagonal (large: tied to w)"), (rho_ax, "rho")):
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("client")
        ax.set_ylabel(f"{label}\n{what}")
        ax.grid(alpha=0.3)
    lam_ax.legend(title="learned (hollow: initial)", fontsize="small")
    rho_ax.legend(fontsize="small")


def participation_figure_of(tables: dict[str, pd.DataFrame], title: str):
    """A row of two panels (`draw_participation`) per labelled participation table."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(tables), 2, figsize=(11, 3.6 * len(tables)), layout="constrained", squeeze=False)
    for row, (label, table) in zip(axes, tables.items()):
        draw_participation(row, table, label)
    fig.suptitle(title)
    return fig


def participation_figure(client, results: list[MethodResult], metric: str, title: str):
    """Learn2pFed's learned participation: each of its methods' first seed."""
    tables = {}
    for r in results:
        if r.method.startswith("learn2pfed-") and r.run_ids:
            table = run_table(client, r.run_ids[0], PARTICIPATION_CSV)
            if table is not None:
                tables[f"{r.method}, seed {r.seeds[0]}"] = table
    return participation_figure_of(tables, title) if tables else None


def save_figure(fig, path: Path) -> None:
    atomic_write(path, lambda fh: fig.savefig(fh, dpi=100, format="png"), binary=True)
    _pyplot().close(fig)


FIGURES = (  # file name, builder, caption
    ("curves", curves_figure, "learning curves (y: the top group's range)"),
    ("compute", compute_figure, "metric against compute"),
    ("clients", clients_figure, "per-client distribution"),
    ("participation", participation_figure, "Learn2pFed's learned participation"),
)


def write_report(client, experiment: str, report_dir: Path, figure_dir: Path,
                 only: dict[tuple[str, int], str | None] | None = None, tuning: dict | None = None,
                 downstream: dict[str, str] | None = None, rule: VerdictConfig = VerdictConfig()) -> list[MethodResult]:
    """`report_dir/<experiment>.md`, its ranked table for a paper as `.tex` and `.csv`, and its PNGs
    in `figure_dir`, after removing what a killed writer left of their temporaries (call as their
    one writer); returns the ranking."""
    remove_stale_temporaries(*(report_dir / f"{experiment}.{suffix}" for suffix in ("md", "tex", "csv")),
                             *(figure_dir / f"{experiment}-{name}.png" for name, _, _ in FIGURES))
    newest = collect(client, experiment, only)
    metric = primary_metric(newest)
    results = [replace(r, initial_val=initial_validation(client, r.run_ids, metric)) if r.method in (downstream or {})
               else r for r in summarize(client, newest, metric, rule)]
    figures = {}
    for name, build, caption in FIGURES:
        fig = build(client, results, metric, f"{experiment}: {caption}")
        if fig is not None:
            png = figure_dir / f"{experiment}-{name}.png"
            save_figure(fig, png)
            figures[caption] = Path(os.path.relpath(png, report_dir)).as_posix()
    atomic_write_text(report_dir / f"{experiment}.md", markdown(experiment, metric, results, figures, tuning, downstream, rule))
    write_paper_table(report_dir / experiment, {m: {experiment: c} for m, c in column_cells(results, metric).items()},
                      [experiment], f"{experiment}: written by `python -m flows.compare` (its .md says how to read it)")
    return results
