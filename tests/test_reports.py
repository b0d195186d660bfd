"""The comparison reports: which runs count, their statistics and marks, both reports agreeing,
diverged runs listed, and `compare` against a real `mlflow server`."""

import json
import re
import os
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from conftest import background_server, free_port, mlflow_uri, ranked_result, tiny_params

from flows.tables import build_table, markdown
from pfl_tasks.config import PlateauRule, VerdictConfig, parse_params
from pfl_tasks.errors import ComparisonError
from pfl_tasks.outputs import pin, write_csv
from pfl_tasks.reports import write_report
from pfl_tasks.reports.results import collect, plateaued, variant
from pfl_tasks.reports.text import best_line, markdown as report_markdown
from pfl_tasks.reports.verdicts import summarize, winner_on_validation
from pfl_tasks.stats import mean_ci
from pfl_tasks.tracking import MlflowRun

REPO = Path(__file__).resolve().parents[1]


def log_run(tmp, experiment, algorithm, seed, clients, global_clients=None, status="FINISHED",
            diverged_at=None, metric="acc", val=None, partition=None):
    """A run as training logs one: per-round records, final metrics and the selected round's
    per-client table; seed s trained on partition `part-s` unless `partition` says otherwise."""
    run = MlflowRun(mlflow_uri(), experiment, f"{algorithm}-seed{seed}", None)
    run.log_params_and_tags({}, {"algorithm": algorithm.split("_")[0], "variant": algorithm, "seed": str(seed),
                                 "data_hash": partition or f"part-{seed}",
                                 "task": "classification" if metric == "acc" else "regression"})
    mean = float(np.mean(clients)) if clients else 0.0
    for step in (1, 2):
        value = mean * step / 2
        curve = {f"test/personalized/{metric}_mean": value, f"val/personalized/{metric}_mean": value,
                 "compute/grad_samples": 100 * step}
        if global_clients:
            curve[f"test/global/{metric}_mean"] = float(np.mean(global_clients)) * step / 2
        run.log_metrics(curve, step=step)
    if diverged_at is not None:
        run.set_tag("diverged_at", str(diverged_at))
        run.finish("FAILED", f"diverged at round {diverged_at}")
        time.sleep(0.01)
        return run.run_id
    run.log_metrics({f"selected/test/personalized/{metric}_mean": mean,
                     f"selected/val/personalized/{metric}_mean": mean if val is None else val,
                     f"selected/test/personalized/{metric}_worst10":
                     min(clients), "selected/round": 2, "final/compute/grad_samples": 200,
                     "final/comm/bytes_up": 10, "final/comm/bytes_down": 20,
                     "selected/personalized_is_global": float(global_clients is not None and global_clients == clients)},
                    step=2)
    upload = Path(tmp) / uuid.uuid4().hex
    upload.mkdir()
    rows = [{"client_id": k, "n_test": 10, f"test_personalized_{metric}": v} for k, v in enumerate(clients)]
    for row, g in zip(rows, global_clients or []):
        row[f"test_global_{metric}"] = g
    write_csv(upload / "clients_selected.csv", rows)
    run.log_artifacts(upload)
    run.finish(status)
    time.sleep(0.01)  # distinct start times: the newest run of (algorithm, seed) counts
    return run.run_id


def store_with_stale_and_extra_runs(tmp_path):
    """Experiment with methods a (best), b (close to a), c (far worse, and global-only), d
    (diverged on seed 1); plus runs that must not count."""
    from mlflow.tracking import MlflowClient

    experiment = f"cmp-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(0)
    base = {s: rng.uniform(0.5, 0.9, 20) for s in (0, 1)}
    log_run(tmp_path, experiment, "a", 0, [0.0] * 20)  # superseded by the newer run of a, seed 0
    for s in (0, 1):
        log_run(tmp_path, experiment, "a", s, list(base[s] + 0.05))
        noise = rng.normal(0, 0.02, 20)
        log_run(tmp_path, experiment, "b", s, list(base[s] + 0.05 + noise - noise.mean() - 0.001),  # a - 0.001
                val=0.99)  # but the best on validation
        worse = list(base[s] - 0.3)
        log_run(tmp_path, experiment, "c", s, worse, global_clients=worse)
    log_run(tmp_path, experiment, "d", 0, [1.0] * 20)
    log_run(tmp_path, experiment, "d", 1, [1.0] * 20)  # superseded by its newer, diverged run
    log_run(tmp_path, experiment, "d", 1, [], diverged_at=7)
    log_run(tmp_path, experiment, "a", 2, [1.0] * 20)  # a seed no longer configured
    log_run(tmp_path, experiment, "renamed", 0, [1.0] * 20)  # a method no longer configured
    log_run(tmp_path, experiment, "b", 0, [1.0] * 20, status="FAILED")  # crashed: not a result
    raw = tiny_params(algorithms=["a", "b", "c", "d"], seeds=[0, 1])
    raw["experiments"] = {experiment: raw["experiments"]["tiny"]}
    raw["tables"] = {"t": {"experiments": [experiment]}}
    return MlflowClient(mlflow_uri()), experiment, parse_params(raw), base


def test_both_reports_count_the_same_runs_with_cis_marks_and_diverged_runs(tmp_path):
    client, experiment, params, base = store_with_stale_and_extra_runs(tmp_path)
    results = write_report(client, experiment, tmp_path / "reports", tmp_path / "figures",
                           {(m, s): None for m in "abcd" for s in (0, 1)})
    assert [r.method for r in results] == ["a", "b", "c", "d"]
    a, b, c, d = results
    assert a.seeds == [0, 1] and a.personalized == pytest.approx(mean_ci([base[0] + 0.05, base[1] + 0.05]))
    assert a.personalized[1] < a.personalized[0] < a.personalized[2]
    assert b.indistinguishable() and not c.indistinguishable() and a.p_vs_best is None
    assert c.global_only and not a.global_only and not b.global_only
    assert not d.ranked and d.diverged == [(1, 7)]
    assert winner_on_validation(results) is b  # what a sweep picks: never the test ranking

    report = (tmp_path / "reports" / f"{experiment}.md").read_text()
    # validation beside test, ✓ on the choice on validation
    assert "| seeds | validation | personalized, test (95% CI) |" in report
    assert f"| 1 | a | 2 | {a.val:.4f} | {a.personalized[0]:.4f} [" in report
    assert "| 2 | b≈✓ | 2 | 0.9900 |" in report and "| 3 | c† | 2 |" in report
    assert "- d: diverged at round 7 (seed 1)" in report and "renamed" not in report
    for name in ("curves", "compute", "clients"):
        png = tmp_path / "figures" / f"{experiment}-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"](../figures/{png.name})" in report
    # the ranked table for a paper: every number unrounded in the CSV, marks in the LaTeX
    paper = (tmp_path / "reports" / f"{experiment}.csv").read_text().splitlines()
    assert paper[1].startswith(f"a,{experiment},acc,higher,1,True,{a.personalized[0]!r},") and "diverged at round 7" in paper[-1]
    tex = (tmp_path / "reports" / f"{experiment}.tex").read_text()
    assert f"b & {b.personalized[0]:.3f} [{b.personalized[1]:.3f}, {b.personalized[2]:.3f}]$^{{\\approx}}$$^{{\\checkmark}}$" in tex

    rows = build_table(client, params, params.tables["t"], tmp_path)  # no DVC metrics there: the newest runs
    assert sorted(rows) == ["a", "b", "c", "d"]
    for r in (a, b, c):
        got = rows[r.method][experiment]
        assert (got["mean"], got["ci_low"], got["ci_high"]) == pytest.approx(r.personalized)
        assert got["seeds"] == 2 and got["marks"] == {"a": "", "b": "≈✓", "c": "†"}[r.method]
        assert got["best_on_validation"] == (r is b)
    assert rows["d"][experiment] == {"metric": "acc", "better": "higher", "status": "diverged at round 7 (seed 1)"}
    text = markdown("t", rows, [experiment], params.verdicts)
    assert "| d | diverged at round 7 (seed 1) |" in text
    json.dumps(rows, allow_nan=False)  # the DVC metrics file is strict JSON


def test_the_configured_verdict_rules_decide_the_marks_the_ranking_and_the_plateau(tmp_path):
    """`verdicts` is what every verdict is judged by, and the report says which rules it used:
    α behind ≈, the least share of rounds aggregated to be ranked, and the plateau rule, applied
    to each run's validation curve in MLflow."""
    client, experiment, params, _ = store_with_stale_and_extra_runs(tmp_path)
    newest = collect(client, experiment, {(m, s): None for m in "abcd" for s in (0, 1)})
    default = {r.method: r for r in summarize(client, newest, "acc")}
    strict = VerdictConfig(alpha=0.999, min_aggregated=0.7, plateau=PlateauRule(window=0.4, acc=0.01))
    judged = summarize(client, newest, "acc", strict)
    assert default["b"].indistinguishable() and not {r.method: r for r in judged}["b"].indistinguishable()
    header = report_markdown(experiment, "acc", judged, {}, rule=strict)
    assert ("Verdict rules (`verdicts` in the params file): α = 0.999, min_aggregated = 0.7, plateau: window 0.4 "
            "of the rounds, gain below 0.01 accuracy or 1% of the MSE.") in header
    assert "| 2 | b✓ |" in header and "over the last 40% of the rounds gained less than 0.01 accuracy" in header

    sparse = replace(ranked_result("x", 0.9), aggregated={0: (60, 100)})  # 60 of 100 rounds aggregated
    assert sparse.ranked and not replace(sparse, rule=strict).ranked

    run = MlflowRun(mlflow_uri(), experiment, "late-seed0", None)
    for step, value in curve_of([0.5, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.806, 0.806]).items():
        run.log_metrics({"val/personalized/acc_mean": value}, step=step)
    run.finish("FINISHED")
    assert plateaued(client, run.run_id, "acc", VerdictConfig()) is False  # gained 0.006 >= 0.005
    assert plateaued(client, run.run_id, "acc", VerdictConfig(plateau=PlateauRule(acc=0.01))) is True
    assert plateaued(client, run.run_id, "mse", VerdictConfig()) is None  # no such curve


def curve_of(values):
    return {10 * (i + 1): v for i, v in enumerate(values)}


def test_a_best_line_names_the_top_group_unless_the_best_is_significant_and_says_when_runs_did_not_plateau():
    best, close = ranked_result("ditto", 0.9455), ranked_result("local", 0.9401, p_vs_best=0.3)
    far = ranked_result("fedavg", 0.90, p_vs_best=0.001)
    assert best_line([best, far]) == "best ditto (0.9455)"
    assert best_line([best, close, far]) == "top group (not significantly different): ditto (0.9455), local (0.9401)"
    assert best_line([best, replace(far, plateaued=[False, False])]) == (
        "best ditto (0.9455) (2 of 4 runs plateaued on validation: the ranking may be premature)")
    assert best_line([]) == "none ranked"


def test_runs_are_told_apart_by_variant_and_older_runs_by_algorithm():
    def run(tags):
        return SimpleNamespace(data=SimpleNamespace(tags=tags))

    assert variant(run({"algorithm": "ditto", "variant": "ditto_mu1"})) == "ditto_mu1"
    assert variant(run({"algorithm": "ditto_mu1"})) == "ditto_mu1"  # logged before the `variant` tag


def test_seeds_on_one_partition_count_each_client_once(tmp_path):
    """chicago: every seed trains on the same stations, so a client is one sample, not one per seed."""
    from mlflow.tracking import MlflowClient

    experiment = f"same-{uuid.uuid4().hex[:8]}"
    seeds = {0: [0.2, 0.4, 0.9], 1: [0.4, 0.6, 0.7]}
    for seed, values in seeds.items():
        log_run(tmp_path, experiment, "a", seed, values, partition="stations")
    client = MlflowClient(mlflow_uri())
    (a,) = summarize(client, collect(client, experiment), "acc")
    assert list(a.clients) == [0] and a.clients[0] == pytest.approx([0.3, 0.5, 0.8])
    assert a.personalized == pytest.approx(mean_ci([np.array([0.3, 0.5, 0.8])]))


def test_the_run_the_workspace_holds_counts_not_the_newest(tmp_path):
    """After `dvc exp apply` the workspace's DVC metrics name an older MLflow run of a (method,
    seed): the reports take that one, not the newest; without such a file, the newest."""
    from mlflow.tracking import MlflowClient

    from pfl_tasks.reports.results import configured_runs
    from pfl_tasks.runs import RunPaths

    experiment = f"pinned-{uuid.uuid4().hex[:8]}"
    data = tiny_params()
    data["experiments"] = {experiment: {"dataset": "digits", "model": {"kind": "mlp"}, "algorithms": ["a"]}}
    params = parse_params(data)
    applied = log_run(tmp_path, experiment, "a", 0, [0.9, 0.9])  # the experiment applied to the workspace
    log_run(tmp_path, experiment, "a", 0, [0.1, 0.1])  # a newer run of another experiment
    client = MlflowClient(mlflow_uri())
    assert collect(client, experiment, configured_runs(params, experiment, tmp_path))["a"][0].data.metrics[
        "selected/test/personalized/acc_mean"] == pytest.approx(0.1)
    path = RunPaths.of(tmp_path, experiment, "a", 0).metrics
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"status": "finished", **pin(applied)}))
    only = configured_runs(params, experiment, tmp_path)
    assert only == {("a", 0): applied}
    assert collect(client, experiment, only)["a"][0].info.run_id == applied
    # a run this store does not hold (another clone's store): the newest counts, not a gap
    newest = collect(client, experiment, {("a", 0): "f" * 32})["a"][0]
    assert newest.data.metrics["selected/test/personalized/acc_mean"] == pytest.approx(0.1)


def test_a_deleted_or_missing_run_of_a_finished_method_stops_the_report_in_one_line(tmp_path):
    """`mlflow runs delete` of the run a metrics file names would silently drop its method from
    the report (and change the verdict): refused, naming the run and how to restore it. A
    method finished in the workspace of which the store holds no run at all is refused too."""
    from mlflow.tracking import MlflowClient

    experiment = f"deleted-{uuid.uuid4().hex[:8]}"
    local = log_run(tmp_path, experiment, "local", 0, [0.3, 0.3])
    fedavg = log_run(tmp_path, experiment, "fedavg", 0, [0.2, 0.2])
    client = MlflowClient(mlflow_uri())
    client.delete_run(local)
    with pytest.raises(ComparisonError, match=f"local seed 0: its metrics file names MLflow run {local}, which is "
                                              f"deleted in .*mlflow runs restore --run-id {local}"):
        collect(client, experiment, {("local", 0): local, ("fedavg", 0): fedavg})
    with pytest.raises(ComparisonError, match="fedavg seed 1 finished in this workspace .* holds no finished run"):
        collect(client, experiment, {("fedavg", 0): fedavg, ("fedavg", 1): "f" * 32})
    client.restore_run(local)
    assert set(collect(client, experiment, {("local", 0): local, ("fedavg", 0): fedavg})) == {"local", "fedavg"}


def test_a_dvc_experiments_runs_use_the_projects_store_and_name_the_experiment(monkeypatch, tmp_path):
    """`dvc exp run --temp` runs the stages in a temporary copy with DVC_ROOT the project: a
    relative sqlite store is the project's; every run is tagged with its DVC experiment."""
    from pfl_tasks.tracking import artifact_location, run_tags, tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    exp = parse_params(tiny_params()).experiment("tiny")
    assert run_tags(exp, "classification", "p", "fedavg", "fedavg", "c", "d", "h", "s", "f")["dvc_experiment"] == "workspace"
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_EXP_NAME", "lucid-mole")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "abc123")
    assert tracking_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert tracking_uri("sqlite:////elsewhere/m.db") == "sqlite:////elsewhere/m.db"
    assert tracking_uri("sqlite:///m.db?timeout=5") == f"sqlite:///{tmp_path.resolve()}/m.db?timeout=5"
    # a new experiment's artifacts go beside the store, not under the (temporary) working directory
    assert artifact_location(tracking_uri("sqlite:///mlflow.db"), "e").startswith((tmp_path.resolve() / "mlruns").as_uri())
    tags = run_tags(exp, "classification", "p", "fedavg", "fedavg", "c", "d", "h", "s", "f")
    assert tags["dvc_experiment"] == "lucid-mole" and tags["dvc_baseline"] == "abc123" and tags["config_hash"] == "h"


def test_reports_read_per_client_tables_after_the_checkout_moved(tmp_path):
    """MLflow's sqlite store records artifact paths absolutely; a moved checkout still finds
    them below the `mlruns/` beside its store."""
    import shutil

    from mlflow.tracking import MlflowClient

    from pfl_tasks.reports.results import clients_table

    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    run = MlflowRun(f"sqlite:///{before}/mlflow.db", "moved", "a-seed0", None)
    (tmp_path / "upload").mkdir()
    write_csv(tmp_path / "upload" / "clients_selected.csv", [{"client_id": 0, "test_personalized_acc": 0.5}])
    run.log_artifacts(tmp_path / "upload")
    run.finish()
    shutil.move(before, after)
    table = clients_table(MlflowClient(f"sqlite:///{after}/mlflow.db"), run.run_id)
    assert table is not None and table.loc[0, "test_personalized_acc"] == 0.5


def test_the_test_selected_statistic_is_printed_apart_and_ranks_nothing(tmp_path):
    """PFLlib's number: each run's best evaluation on test (sample-weighted), mean over seeds, in
    its own labelled section. Method b peaks on test at an unselected round, above a's; a still
    ranks first, on its selected round."""
    from mlflow.tracking import MlflowClient


    experiment = f"peak-{uuid.uuid4().hex[:8]}"
    peaks = {("a", 0): [0.80, 0.82], ("a", 1): [0.84, 0.86], ("b", 0): [0.95, 0.70], ("b", 1): [0.93, 0.72]}
    for (method, seed), history in peaks.items():
        run_id = log_run(tmp_path, experiment, method, seed, [0.9, 0.8] if method == "a" else [0.7, 0.7])
        run = MlflowRun(mlflow_uri(), experiment, "", run_id)
        for step, value in enumerate(history, 1):
            run.log_metrics({"test/personalized/acc_weighted": value}, step=step)
        run.finish()
    client = MlflowClient(mlflow_uri())
    results = summarize(client, collect(client, experiment), "acc")
    assert [r.method for r in results] == ["a", "b"]
    assert [r.test_selected for r in results] == pytest.approx([0.84, 0.94])
    text = report_markdown(experiment, "acc", results, {})
    section = text.split("## Test-selected and sample-weighted, for comparison with published numbers only")[1]
    assert "| a | 0.8400 |" in section and "| b | 0.9400 |" in section and "ranks nothing" in section
    by_method = {r.method: r for r in results}
    assert f"| b | 0.9400 | {by_method['b'].weighted[0]:.4f} | {by_method['b'].personalized[0]:.4f} |" in section


def header_sentences(text: str) -> list[str]:
    """The sentences of a report above its first table."""
    header = text.split("\n| rank |", 1)[0]
    return [s for line in header.splitlines()[1:] for s in re.split(r"(?<=[.!?])\s+", line.strip()) if s]


def test_a_report_opens_with_its_verdict_in_short_sentences_and_its_premises_warned():
    """A reader gets the verdict from the first line: the top group and what it means. A rank
    outside the group above a rank inside it is explained, a baseline that did not plateau is a
    warning (the protocol's budgets assume it does), and no header sentence runs past 30 words."""
    results = [ranked_result("fedavg_ft", 0.96), ranked_result("ditto", 0.955, p_vs_best=0.4),
               ranked_result("learn2pfed-train", 0.952, p_vs_best=0.01),
               ranked_result("feddyn", 0.950, p_vs_best=0.001),
               ranked_result("knnper", 0.949, p_vs_best=0.2),
               ranked_result("fedavg", 0.926, p_vs_best=0.001, plateaued=(True, False)),
               ranked_result("local", 0.90, p_vs_best=0.001)]
    text = report_markdown("e", "acc", results, {})
    first = text.splitlines()[2]
    assert first.startswith("**Verdict:** no method is significantly better than the others by the client mean of "
                            "the personalized test accuracy. The top group, not significantly different from "
                            "fedavg_ft (rank 1): ditto, knnper. The other 4 ranked methods are significantly worse "
                            "than fedavg_ft."), first
    assert "learn2pfed-train (rank 3, p = 0.01) is outside the top group, while knnper (5) is inside." in text
    assert "feddyn (rank 4, p = 0.001) is outside the top group, while knnper (5) is inside." in text
    assert text.count("Ranks order the means") == 1  # explained once
    assert "⚠ The protocol chooses budgets on which fedavg plateaus, but it plateaued on 1 of 2 seeds" in text
    assert "⚠ 13 of 14 ranked runs plateaued on validation: the ranking may be premature." in text
    long = [s for s in header_sentences(text) if len(s.split()) > 30]
    assert not long, long
    alone = report_markdown("e", "acc", [ranked_result("a", 0.9), ranked_result("b", 0.8, p_vs_best=0.001)], {})
    assert alone.splitlines()[2] == ("**Verdict:** a is best by the client mean of the personalized test accuracy, "
                                     "significantly better than every other ranked method. The other ranked "
                                     "method is significantly worse than a.")
    assert "⚠" not in alone


def test_regression_ranks_lowest_mse_first_and_missing_experiment_is_named(tmp_path):
    from mlflow.tracking import MlflowClient

    experiment = f"mse-{uuid.uuid4().hex[:8]}"
    log_run(tmp_path, experiment, "worse", 0, [2.0, 2.5], metric="mse")
    log_run(tmp_path, experiment, "better", 0, [0.5, 0.7], metric="mse")
    client = MlflowClient(mlflow_uri())
    assert [r.method for r in summarize(client, collect(client, experiment), "mse")] == ["better", "worse"]
    with pytest.raises(ComparisonError, match="no experiment 'nowhere'"):
        write_report(client, "nowhere", tmp_path, tmp_path)


def drawn_texts(fig) -> list:
    """Every text a draw of `fig` shows: the visible non-empty ones but labels of ticks out of view."""
    from matplotlib.text import Text

    fig.canvas.draw()
    off_view = set()
    for ax in fig.axes:
        for axis, limits in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            low, high = sorted(limits)
            off_view |= {t.label1 for t in axis.get_major_ticks() + axis.get_minor_ticks() if not low <= t.get_loc() <= high}
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text() and t not in off_view]


def test_figures_fit_their_text_band_the_seeds_and_draw_a_shared_global_curve_once(tmp_path):
    """Each figure of a report: its texts inside it and apart, a min-max band per method of more
    than one seed, a method's colors the same in every figure and distinct from the others', and
    a global curve that another method's hides listed once, under the method that draws it."""
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_rgb
    from mlflow.tracking import MlflowClient

    from pfl_tasks.reports.figures import FIGURES, GREYED
    from pfl_tasks.reports.verdicts import ordered

    experiment = f"figs-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(1)
    for seed in (0, 1):
        fedavg = list(rng.uniform(0.4, 0.6, 5))
        log_run(tmp_path, experiment, "fedavg", seed, fedavg, global_clients=fedavg)  # its global model is personal
        log_run(tmp_path, experiment, "ditto", seed, list(rng.uniform(0.7, 0.9, 5)), global_clients=fedavg)
        log_run(tmp_path, experiment, "local", seed, list(rng.uniform(0.5, 0.8, 5)))  # no global model
    log_run(tmp_path, experiment, "one_seed", 0, list(rng.uniform(0.5, 0.8, 5)))
    client = MlflowClient(mlflow_uri())
    results = summarize(client, collect(client, experiment), "acc")
    figures = {name: build(client, results, "acc", f"{experiment}: {caption}") for name, build, caption in FIGURES}
    assert figures.pop("participation") is None  # no Learn2pFed run here (test_participation_figure_...)

    for name, fig in figures.items():
        boxes = [(t.get_text(), t.get_window_extent()) for t in drawn_texts(fig)]
        for text, box in boxes:
            assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1, \
                (name, text)
        overlapping = [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:] if box.overlaps(other)]
        assert not overlapping, name

    legend = figures["compute"].legends[0]
    labels = [t.get_text() for t in legend.get_texts()]
    assert sorted(labels) == ["ditto", "fedavg", "local", "one_seed"]
    color_of = {label.split(" (")[0]: to_rgb(h.get_color()) for label, h in zip(labels, legend.legend_handles)}
    assert len(set(color_of.values())) == 4
    # the learning curves: the top group in its colors over the others in grey, named in one entry
    top = {ordered(results)[0].method} | {r.method for r in results if r.ranked and r.indistinguishable()}
    greyed = {r.method for r in results if r.ranked} - top
    curves = [t.get_text() for t in figures["curves"].legends[0].get_texts()]
    assert sorted(label.split(" (")[0] for label in curves if not label.startswith("outside")) == sorted(top)
    assert all(m in curves[-1] for m in greyed) and curves[-1].startswith(f"outside the top group ({len(greyed)})")
    grey = to_rgb(GREYED["color"])
    personalized, shared = figures["curves"].axes
    # ditto's global curve is fedavg's: drawn once, by a method of the top group first
    assert [line.get_label() for line in shared.get_lines()] == ["ditto" if "ditto" in top else "fedavg"]
    for name in ("curves", "compute"):
        for ax in figures[name].axes:
            lines = {line.get_label(): to_rgb(line.get_color()) for line in ax.get_lines()}
            assert lines == {m: grey if name == "curves" and m in greyed else color_of[m] for m in lines}
            bands = [to_rgb(c.get_facecolor()[0]) for c in ax.collections if isinstance(c, PolyCollection)]
            assert sorted(bands) == sorted(color for m, color in lines.items()
                                           if m != "one_seed" and color != grey), (name, ax.get_title())
    assert len(personalized.get_lines()) == 4
    assert all(0 < x <= 1 for line in personalized.get_lines() for x in line.get_xdata())  # shares of its rounds
    clients = figures["clients"].axes[0]
    methods = [t.get_text() for t in clients.get_xticklabels()]
    assert [to_rgb(box.get_facecolor()) for box in clients.patches] == [color_of[m] for m in methods]


def test_the_top_group_is_drawn_in_colors_none_grey_and_framed_by_its_own_range():
    """Every method of the top group has a color of its own and none is grey (tab20's eighth
    pair, which FedCR drew at rank 8), and the curves' y axis is the top group's later range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    from pfl_tasks.reports.figures import _focus, method_styles
    from pfl_tasks.reports.verdicts import top_group

    results = ([ranked_result(f"m{i}", 0.9 - i / 1000, p_vs_best=None if i == 0 else 0.001) for i in range(7)]
               + [ranked_result(f"top{i}", 0.8 - i / 1000, p_vs_best=0.5) for i in range(12)])
    results[0] = ranked_result("m0", 0.95)
    styles = method_styles(results)
    greys = {to_rgb(plt.get_cmap("tab20")(i)) for i in (14, 15)}
    assert not {to_rgb(style["color"]) for style in styles.values()} & greys
    top = [r.method for r in top_group(results)]
    assert len(top) == 13 and len({(to_rgb(styles[m]["color"]), styles[m]["linestyle"]) for m in top}) == 13
    fig, ax = plt.subplots()
    x = [0.1 * i for i in range(1, 11)]
    ax.plot(x, [0.1 + 0.09 * i for i in range(10)], label="a")  # climbs to 0.91, then holds
    ax.plot(x, [0.93] * 10, label="b")
    ax.plot(x, [0.3] * 10, label="other")
    _focus(ax, [line for line in ax.get_lines() if line.get_label() in ("a", "b")])
    low, high = ax.get_ylim()
    assert (low, high) == pytest.approx((0.55 - 0.095, 0.93 + 0.095))  # a's later half and b, padded; not 'other'
    plt.close(fig)


@pytest.mark.slow
def test_compare_against_a_real_mlflow_server(project, tmp_path):
    """Two runs logged by the training flow's tracking code through a loopback `mlflow server`,
    then ranked by `compare` over its REST API."""
    from flows.compare import compare
    from flows.train import train_experiment

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
              "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
              "--artifacts-destination", str(tmp_path / "art")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "DO_NOT_TRACK": "true"}
    data = tiny_params(algorithms=["local", "fedavg"])
    data["federation"] = {"rounds": 2, "eval_every": 1, "checkpoint_every": 2}
    data["tracking"] = {"mlflow_uri": uri}
    (project / "params.yaml").write_text(yaml.safe_dump(data))

    with background_server(server, f"{uri}/health", tmp_path / "mlflow.log", env):
        results = train_experiment("tiny", str(project / "params.yaml"), str(project))
        rankings = compare(["tiny"], str(project / "params.yaml"), root=str(project))

    key = "selected/test/personalized/acc_mean"
    assert [r.method for r in rankings["tiny"]] == sorted(("local", "fedavg"), key=lambda a: -results[a, 0][key])
    for r in rankings["tiny"]:
        assert r.personalized[0] == pytest.approx(results[r.method, 0][key])  # one seed: the client mean
    assert (project / "reports/compare/tiny.md").exists()
    assert (project / "reports/figures/tiny-clients.png").exists()  # artifacts came through the server


def two_client_result(method: str, accs, p=None, p_weighted=None):
    """One seed of two clients of 10 and 100 test samples: both statistics from `accs`."""
    from pfl_tasks.reports.results import MethodResult

    clients, sizes = {0: np.array(accs)}, {0: np.array([10.0, 100.0])}
    return MethodResult(method, "acc", [0], ["r"], [], mean_ci(list(clients.values())), 0.5, None, None, [2],
                        [True], None, None, None, method == "fedavg", clients, {0: "h"}, p, sizes=sizes,
                        weighted=mean_ci(list(clients.values()), weights=list(sizes.values())),
                        p_vs_best_weighted=p_weighted)


def clients_result(method: str, accs: list[float], sizes: list[float]):
    """One seed of clients with these accuracies and test samples: both statistics, no p-values yet."""
    from pfl_tasks.reports.results import MethodResult

    clients, weights = {0: np.array(accs)}, {0: np.array(sizes)}
    return MethodResult(method, "acc", [0], ["r"], [], mean_ci(list(clients.values())), 0.5, None, None, [2],
                        [True], None, None, None, method == "fedavg", clients, {0: "h"}, sizes=weights,
                        weighted=mean_ci(list(clients.values()), weights=list(weights.values())))


# 20 clients: 15 small ones (10 test samples each) and 5 large ones (100 each)
SIZES = [10.0] * 15 + [100.0] * 5
FEDAVG = [0.60 + 0.002 * i for i in range(15)] + [0.90 + 0.002 * i for i in range(5)]


def test_a_method_whose_tests_disagree_between_the_statistics_is_marked_with_a_sentence():
    """Local loses 0.2 on each small client and gains 0.05 on each large one: significantly below
    FedAvg on the client mean, not significantly different sample-weighted. Flagged ⚑ in both
    tables, with a sentence giving both gaps and p-values; Ditto, above FedAvg on every client and
    best by both, is not."""
    from pfl_tasks.reports.verdicts import flips, verdicts, with_p_values

    results = with_p_values([
        clients_result("ditto", [a + 0.1 for a in FEDAVG], SIZES), clients_result("fedavg", FEDAVG, SIZES),
        clients_result("local", [a - 0.2 for a in FEDAVG[:15]] + [a + 0.05 for a in FEDAVG[15:]], SIZES)])
    mean, weighted = verdicts(results, False)["local"], verdicts(results, True)["local"]
    assert (mean.side, weighted.side) == ("worse", "level") and mean.p < 0.05 <= weighted.p
    assert verdicts(results, False)["ditto"].side == verdicts(results, True)["ditto"].side == "better"
    sentence = flips(results)["local"]
    assert sentence == f"on the client mean it is {mean.said()}, sample-weighted {weighted.said()}"
    assert mean.said() == "significantly worse than FedAvg (-0.1375, p < 0.001)"
    assert weighted.said() == f"not significantly different from FedAvg ({weighted.gap:+.4f}, p = {weighted.p:.3g})"
    assert "ditto" not in flips(results)
    text = report_markdown("e", "acc", results, {})
    assert "| 3 | local⚑ |" in text and f"- ⚑ local: {sentence}." in text
    assert "| 1 | ditto |" in text


def test_a_point_estimate_difference_that_no_test_supports_flags_nothing():
    """The CFL case: a method level with FedAvg within noise, 0.001 above it on the client mean
    and 0.001 below it sample-weighted. Its sides by point estimate differ; neither test calls
    it different from FedAvg, so it is no flip (the tables still show both numbers)."""
    from pfl_tasks.reports.verdicts import flips, verdicts, with_p_values

    cfl = [a + (0.004 if i % 2 else -0.002) for i, a in enumerate(FEDAVG[:15])] + [a + d for a, d in zip(FEDAVG[15:], [-0.006, 0.002, -0.004, 0.003, -0.005])]
    results = with_p_values([clients_result("fedavg", FEDAVG, SIZES), clients_result("cfl", cfl, SIZES)])
    mean, weighted = verdicts(results, False)["cfl"], verdicts(results, True)["cfl"]
    assert mean.gap > 0 > weighted.gap and abs(mean.gap) < 0.002 and abs(weighted.gap) < 0.002
    assert (mean.side, weighted.side) == ("level", "level")
    assert flips(results) == {}
    assert "⚑ cfl" not in report_markdown("e", "acc", results, {})


def test_a_method_in_the_top_group_by_one_test_only_is_flagged():
    from pfl_tasks.reports.verdicts import flips

    results = [two_client_result("ditto", [0.70, 0.95]), two_client_result("fedavg", [0.60, 0.90], 0.01, 0.01),
               two_client_result("local", [0.50, 0.95], 0.01, 0.5)]
    assert flips(results)["local"] == "it is out of the top group on the client mean but in it sample-weighted"
    assert best_line(results, weighted=True) == "top group (not significantly different): ditto (0.9273), local (0.9091)"


def test_a_per_method_sweep_names_each_methods_best_point_on_validation_over_every_experiment():
    from pfl_tasks.reports.verdicts import best_per_method

    rankings = {
        "m-lr-lr0.1": [ranked_result("ditto_mu0.1", 0.95, val=0.80), ranked_result("fedavg", 0.90, val=0.85)],
        "m-lr-lr1": [ranked_result("ditto_mu0.1", 0.90, val=0.91), ranked_result("ditto_mu1", 0.99, val=0.70),
                     replace(ranked_result("fedavg", 0.99, val=0.99), diverged=[(0, 3)])],
    }
    best = best_per_method(rankings, {"ditto_mu0.1": "ditto", "ditto_mu1": "ditto", "fedavg": "fedavg"})
    assert {m: (e, r.method) for m, (e, r) in best.items()} == {
        "ditto": ("m-lr-lr1", "ditto_mu0.1"),  # its best on validation, not ditto_mu1 (best on test)
        "fedavg": ("m-lr-lr0.1", "fedavg"),  # a diverged point is never chosen
    }


def test_a_table_exports_to_latex_and_csv_with_its_marks_and_unranked_reasons():
    """The paper forms of a table: a booktabs tabular (marks as superscripts, names escaped, an
    unranked cell's reason), and a CSV row per cell with every number unrounded."""
    from pfl_tasks.reports.paper import csv_rows, latex

    best = {"metric": "acc", "better": "higher", "rank": 2, "best": False, "mean": 0.91234, "ci_low": 0.9, "ci_high": 0.925, "seeds": 3,
            "weighted": 0.9, "not_worse_than_best": True, "global_only": False, "best_on_validation": True,
            "marks": "≈✓"}
    rows = {"fed_avg": {"mnist": {**best, "rank": 1, "best": True, "not_worse_than_best": False, "marks": "†",
                                  "best_on_validation": False, "global_only": True}},
            "ditto": {"mnist": best, "cifar": {"metric": "acc", "better": "higher", "status": "diverged at round 3 (seed 0)"}}}
    comment = "t: written by `python -m flows.tables` (reports/markdown/t.md says how to read it)"
    assert latex(rows, ["mnist", "cifar"], comment).splitlines() == [
        "% t: written by `python -m flows.tables` (reports/markdown/t.md says how to read it)",
        r"\begin{tabular}{lcc}", r"\toprule",
        r"Method & mnist (accuracy, higher is better) & cifar (accuracy, higher is better) \\", r"\midrule",
        r"fed\_avg & \textbf{0.912 [0.900, 0.925]}$^{\dagger}$ & -- \\",
        r"ditto & 0.912 [0.900, 0.925]$^{\approx}$$^{\checkmark}$ & {\footnotesize diverged at round 3 (seed 0)} \\",
        r"\bottomrule", r"\end{tabular}"]
    odd = latex({"lr~1e^-2\\x": {"50%_#": {**best, "marks": ""}}}, ["50%_#"], comment)  # pandas escapes them all
    assert r"lr\textasciitilde 1e\textasciicircum -2\textbackslash x & 0.912" in odd and r"50\%\_\#" in odd
    csv = csv_rows(rows, ["mnist", "cifar"])
    assert [(r["method"], r["experiment"], r["mean"], r["status"]) for r in csv] == [
        ("fed_avg", "mnist", 0.91234, ""), ("ditto", "mnist", 0.91234, ""),
        ("ditto", "cifar", "", "diverged at round 3 (seed 0)")]
    assert csv[1]["best_on_validation"] is True and csv[0]["global_only"] is True
    assert {(r["metric"], r["better"]) for r in csv} == {("acc", "higher")}  # what the numbers are, and which way is better
    assert [(r["rank"], r["best"]) for r in csv] == [(1, True), (2, False), ("", "")]


def test_a_columns_cells_rank_the_methods_and_the_top_group_includes_the_best():
    """Filtering a paper CSV on `best or not_worse_than_best` gives the top group, winner included
    (`not_worse_than_best` alone is False for the winner and for significantly worse methods)."""
    from conftest import ranked_result

    from pfl_tasks.reports.paper import column_cells, csv_rows

    results = [ranked_result("ditto", 0.90, val=0.80), ranked_result("fedavg", 0.89, val=0.85, p_vs_best=0.4),
               ranked_result("local", 0.70, val=0.70, p_vs_best=0.001)]
    cells = column_cells(results, "acc")
    assert {m: (c["rank"], c["best"], c["not_worse_than_best"], c["best_on_validation"]) for m, c in cells.items()} == {
        "ditto": (1, True, False, False), "fedavg": (2, False, True, True), "local": (3, False, False, False)}
    rows = csv_rows({m: {"e": c} for m, c in cells.items()}, ["e"])
    assert [r["method"] for r in rows if r["best"] or r["not_worse_than_best"]] == ["ditto", "fedavg"]
    assert {(r["metric"], r["better"]) for r in csv_rows({m: {"e": c} for m, c in column_cells(results, "mse").items()},
                                                         ["e"])} == {("mse", "lower")}


def test_every_report_header_says_which_runs_it_counts():
    """The runs a report ranks are those the workspace's metrics files name (after `dvc exp
    apply` too), not simply the newest: both headers say so."""
    from conftest import ranked_result

    from flows.tables import markdown as table_markdown
    from pfl_tasks.config import VerdictConfig
    from pfl_tasks.reports.text import RUNS_COUNTED

    assert "its metrics file in this workspace names" in RUNS_COUNTED
    for text in (report_markdown("e", "acc", [ranked_result("ditto", 0.9, val=0.8)], {}),
                 table_markdown("t", {}, ["e"], VerdictConfig())):
        assert RUNS_COUNTED in text and "Runs: the newest" not in text


def test_a_report_whose_best_on_validation_is_not_rank_one_says_which_row_a_choice_picks():
    """A sweep's rank 1 is the best on test; its choice (✓, on validation) may rank lower: the
    report says that row is the one to pick among variants."""
    from conftest import ranked_result

    results = [ranked_result("ditto_mu1", 0.90, val=0.80), ranked_result("ditto_mu0.1", 0.88, val=0.85)]
    text = report_markdown("e", "acc", results, {})
    assert "| 2 | ditto_mu0.1✓ |" in text
    assert "✓ ditto_mu0.1, ranked 2 here, is the best on validation: what choosing among these rows" in text
    assert "✓ ditto_mu1" not in report_markdown("e", "acc", [ranked_result("ditto_mu1", 0.90, val=0.90),
                                                             results[1]], {})


def test_a_method_trained_downstream_of_another_says_whose_costs_precede_its_own():
    """Learn2pFed on a trained body: its compute column counts head passes of its meta-training
    only, so the report names the runs it stands on, for the methods it shows."""
    from conftest import ranked_result
    from pfl_tasks.config import parse_params
    from pfl_tasks.reports.results import downstream_methods

    params = parse_params({
        "datasets": {"d": {"source": {"name": "digits"}}},
        "experiments": {"e": {"dataset": "d", "model": {"kind": "mlp", "hidden": [8]}, "algorithms": ["fedavg"]},
                        "r": {"dataset": "d", "model": {"kind": "linear"}, "algorithms": ["fedavg"]}},
        "learn2pfed": {"e": {"features_from": "fedavg", "supervision": ["train", "val"]}, "r": {}},
    })
    assert downstream_methods(params, "e") == {"learn2pfed-train": "fedavg", "learn2pfed-val": "fedavg"}
    assert downstream_methods(params, "r") == {} and downstream_methods(params, "nosuch") == {}
    text = report_markdown("e", "acc", [ranked_result("learn2pfed-train", 0.9), ranked_result("fedavg", 0.8)], {},
                           downstream=downstream_methods(params, "e"))
    assert "learn2pfed-train is trained on the frozen body of fedavg's trained runs" in text
    assert "learn2pfed-val" not in text  # not among the rows
    # the meta-training's effect on validation, and where it had none, what the rank comes from
    from dataclasses import replace

    flat, learned = (replace(ranked_result("learn2pfed-train", 0.9, val=0.95), initial_val=v) for v in (0.95, 0.93))
    for result, adds_nothing in ((flat, True), (learned, False)):
        text = report_markdown("e", "acc", [result, ranked_result("fedavg", 0.8)], {}, downstream=downstream_methods(params, "e"))
        assert f"validation acc {result.initial_val:.4f} at meta-epoch 0" in text and "0.9500 at the selected" in text
        assert ("its meta-training adds nothing here" in text) == adds_nothing


def test_a_method_scored_on_other_validation_rows_is_not_the_choice_on_validation():
    """Learn2pFed under `val` supervision selects on half of each client's validation rows (its
    runs' `validation_rows` tag): its number is not comparable with the others', so ✓ skips it
    and the report says why."""
    from dataclasses import replace

    from conftest import ranked_result
    from pfl_tasks.algorithms.learn2pfed_meta import HELD_OUT_HALF
    from pfl_tasks.reports.verdicts import winner_on_validation

    half = replace(ranked_result("learn2pfed-val", 0.90, val=0.99), validation_rows=HELD_OUT_HALF)
    results = [half, ranked_result("learn2pfed-train", 0.89, val=0.95)]
    assert winner_on_validation(results).method == "learn2pfed-train"
    text = report_markdown("e", "acc", results, {})
    assert "| 2 | learn2pfed-train✓ |" in text
    assert f"learn2pfed-val's validation number is on {HELD_OUT_HALF}" in text


def test_participation_figure_shows_each_group_initial_and_learned_and_fits_its_text():
    """Learn2pFed's participation figure: per client, Lambda's diagonal per parameter group and
    rho, the initial Theta's and the learned one's, its texts inside the figure and apart."""
    import pandas as pd
    import torch

    from pfl_tasks.algorithms.learn2pfed import Cells, Problem
    from pfl_tasks.algorithms.learn2pfed_meta import participation_table
    from pfl_tasks.reports.figures import participation_figure_of

    problem = Problem(torch.ones(3, 4, 5, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.long),
                      torch.ones(3, 4, dtype=torch.float64), n_classes=2)
    init = dict(rho=0.01, eta=0.01, gamma=0.01, theta=0.01, lam=0.001)
    initial, learned = (Cells(problem, 2, True, init, torch.Generator().manual_seed(0)) for _ in range(2))
    with torch.no_grad():
        learned.raw["rho"] += 1.0
        learned.raw["lam"][..., 5::6] += 2.0  # the biases of a [2 classes, 5 + 1] head
    table = pd.DataFrame(participation_table(initial, learned, problem))
    assert sorted(table.group.unique()) == ["bias", "weights"] and len(table) == 3 * 2
    bias, weights = (table[table.group == g] for g in ("bias", "weights"))
    assert np.allclose(bias.lam_learned / bias.lam_initial, np.exp(2.0), rtol=1e-2)
    assert np.allclose(weights.lam_learned, weights.lam_initial)
    assert np.allclose(table.rho_learned / table.rho_initial, np.exp(1.0), rtol=1e-2)

    fig = participation_figure_of({"learn2pfed-train, seed 0": table, "learn2pfed-val, seed 0": table}, "poly: participation")
    assert len(fig.axes) == 4 and all(len(ax.get_lines()) >= 2 for ax in fig.axes)
    boxes = [(t.get_text(), t.get_window_extent()) for t in drawn_texts(fig)]
    for text, box in boxes:
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1, text
    assert not [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:] if box.overlaps(other)]


def test_tables_builds_the_tables_it_can_and_names_those_it_skips(tmp_path, monkeypatch, capsys):
    """A params file whose second table's experiment has no runs yet: the first is written,
    the second skipped with a line naming what it lacks."""
    import yaml

    from conftest import tiny_params
    from flows.tables import write_tables

    name = f"tables-some-{os.getpid()}"
    for seed in (0, 1):
        log_run(tmp_path, name, "fedavg", seed, [0.5, 0.7])
    data = tiny_params(algorithms=["fedavg"], seeds=[0, 1])
    data["experiments"] = {name: data["experiments"]["tiny"], "untrained": data["experiments"]["tiny"]}
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    data["tables"] = {"built": {"experiments": [name]}, "later": {"experiments": [name, "untrained"]}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    written = write_tables("params.yaml", str(tmp_path))
    assert [p.name for p in written] == ["built.md"]
    assert "tables: later skipped: no runs of experiment(s) ['untrained'] yet (train them first)" in capsys.readouterr().err


def test_a_per_method_sweeps_choice_is_saved_in_its_folder_as_json_and_a_table(tmp_path):
    """`--per-method`'s answer outlives the console: each method's variant best on validation,
    with its validation and test numbers, in the sweep's folder."""
    from conftest import ranked_result

    from flows.sweep import write_per_method

    best = {"ditto": ("m-lr-lr1", ranked_result("ditto_mu0.1", 0.88, val=0.85)),
            "fedavg": ("m-lr-lr0.1", ranked_result("fedavg", 0.80, val=0.79))}
    chosen = write_per_method(tmp_path, "lr", best)
    saved = json.loads((tmp_path / "per_method.json").read_text())
    assert saved == chosen and saved["ditto"]["variant"] == "ditto_mu0.1" and saved["ditto"]["val"] == 0.85
    assert saved["ditto"]["test"] == {"mean": 0.88, "ci_low": 0.87, "ci_high": 0.89}
    table = (tmp_path / "per_method.md").read_text()
    assert "| ditto | ditto_mu0.1 | m-lr-lr1 | 0.8500 | 0.8800 [0.8700, 0.8900] |" in table


def test_the_setting_hash_tag_tells_settings_apart_and_groups_a_settings_seeds():
    """After `dvc exp run -S algorithms.ditto.mu=1.0`, runs of both mu values carry variant
    `ditto`: grouping by `setting_hash` keeps them apart while pooling each setting's seeds."""
    from conftest import tiny_params
    from pfl_tasks.config import parse_params
    from pfl_tasks.training import run_identity

    def setting(mu: float, seed: int, rounds: int = 10, data: str = "d") -> str:
        raw = tiny_params(algorithms=["ditto"], seeds=[0, 1])
        raw["federation"]["rounds"] = rounds
        exp = parse_params(raw).experiment("tiny").for_run("ditto", seed)
        return run_identity(exp, "ditto", {"mu": mu}, f"{data}-{seed}")["setting_hash"]

    assert setting(0.1, 0) == setting(0.1, 1)  # a setting's seeds (and their partitions) share it
    assert setting(0.1, 0) != setting(1.0, 0)  # another mu is another setting
    assert setting(0.1, 0) != setting(0.1, 0, rounds=20)  # and so is another budget


def test_no_two_methods_of_the_benchmark_share_a_setting_hash():
    """The README's MLflow grouping (`tags.setting_hash`) is one method at one setting: at
    params.yaml's tuned values, methods at the same lr with default hyper-parameters (Local,
    FedAvg, Ditto, ...) fall into groups of their own."""
    from pfl_tasks.config import load_params
    from pfl_tasks.training import run_identity
    from pfl_tasks.tuning import tuned

    params = load_params(REPO / "params.yaml")
    for name in params.experiments:
        exp = tuned(params, name, REPO)
        groups = {}
        for run in exp.algorithms:
            tag = run_identity(exp.for_run(run, exp.seeds[0]), run, exp.hyper[run], "data")["setting_hash"]
            groups.setdefault(tag, []).append(run)
        assert all(len(runs) == 1 for runs in groups.values()), (name, groups)


def test_learn2pfed_s_untrained_theta_is_shown_beside_its_selected_score():
    """Its meta-training is measured against meta-epoch 0: both test numbers, in one sentence."""
    results = [replace(ranked_result("learn2pfed-val", 0.9), initial_test=0.93), ranked_result("local", 0.8)]
    text = report_markdown("e", "acc", results, {})
    assert ("learn2pfed-val with its untrained Θ (meta-epoch 0) scores test acc 0.9300, against 0.9000 at the "
            "selected meta-epochs") in text
    assert text.count("untrained Θ") == 1  # local has none
