"""`--estimate`: each algorithm's steps timed on this machine, the other costs measured by a
probe (the file's own pipeline, shortened, in a temporary folder), multiplied out to the whole
run, writing nothing where the pipeline writes."""

import time

import pytest
import yaml
from conftest import tiny_params

from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import parse_params
from pfl_tasks.estimate import (Probe, ProbeRun, Timing, measured_cost, planned_runs, probe_params, report,
                                time_steps, whole)


def tuned_raw() -> dict:
    raw = tiny_params(algorithms=["local", "fedprox"], seeds=[3, 4, 5])
    raw["federation"] = {"rounds": 20, "eval_every": 5, "checkpoint_every": 10}
    raw["algorithms"]["fedprox"] = {}  # a tuned key stays at its default
    raw["tuning"] = {"tiny": {"lr": [0.05, 0.5], "rounds_fraction": 0.5, "hyper": {"fedprox": {"mu": [0.01, 0.1, 1.0]}}}}
    raw["learn2pfed"] = {"tiny": {"supervision": ["train"], "features_from": "fedprox", "meta": {"epochs": 40}}}
    return raw


def test_the_plan_counts_every_grid_point_and_seed_at_its_rounds_and_evaluations():
    """Tuning: each grid point on the two tuning seeds (the experiment's first two)."""
    params = validate_params(parse_params(tuned_raw()))
    assert [(r.stage, r.algorithm, r.count, r.rounds, r.evaluations) for r in planned_runs(params, "tiny")] == [
        ("tune-tiny", "local", 4, 10, 2), ("tune-tiny", "fedprox", 12, 10, 2),
        ("train-tiny", "local", 3, 20, 4), ("train-tiny", "fedprox", 3, 20, 4)]


def test_the_probe_is_the_pipeline_on_the_first_seed_for_two_intervals_a_run():
    raw = tuned_raw()
    params = validate_params(parse_params(raw))
    probe = probe_params(raw, params, ["tiny"], "sqlite:////tmp/probe.db")
    shortened = validate_params(parse_params(probe))
    exp = shortened.experiment("tiny")
    assert exp.seeds == [3]
    assert {(f.rounds, f.eval_every, f.checkpoint_every) for f in
            (exp.for_run(name).federation for name in exp.algorithms)} == {(10, 5, 5)}
    assert shortened.tuning["tiny"].lr == [0.05] and shortened.tuning["tiny"].hyper == {"fedprox": {"mu": [0.01]}}
    assert shortened.learn2pfed["tiny"].meta.epochs == 40 and shortened.tracking.mlflow_uri == "sqlite:////tmp/probe.db"
    assert raw == tuned_raw()  # the file as read is left alone


def test_the_whole_run_is_the_probe_plus_every_run_less_the_probes_own():
    params = validate_params(parse_params(tuned_raw()))
    timings = {"tiny": {"local": Timing((0.1, 0.1, 0.3), 0.5), "fedprox": Timing((0.2, 0.2, 0.2), 1.0)}}
    # the probe's runs: 2 intervals of 5 rounds; metrics logged at each interval's end; 1 s between runs
    # in an experiment, 8 s from the train stage to Learn2pFed's (a median ignores it)
    probe = Probe(30.0, {
        ("tiny", "local-seed3"): ProbeRun(5.0, 100.0, (2.0, 3.5)),  # interval 1.5 s: 5 x 0.1 + 0.5 steps, 0.5 orchestration
        ("tiny", "fedprox-seed3"): ProbeRun(6.0, 106.0, (2.5, 4.5)),  # interval 2.0 s: 5 x 0.2 + 1.0 steps, nothing else
        ("tiny-tune", "local_lr0.05-seed3"): ProbeRun(2.0, 50.0, (1.5,)),
        ("tiny-tune", "fedprox_lr0.05_mu0.01-seed3"): ProbeRun(3.0, 53.0, (2.5,)),
        ("tiny", "learn2pfed-train-seed3"): ProbeRun(4.0, 120.0, ()),
    })
    assert probe.between_runs_s() == 1.0
    lines, learn2pfed, low, high = whole(params, ["tiny"], timings, probe)
    costs = {(line.runs.stage, line.runs.algorithm): (round(line.cost.run_s, 9), round(line.cost.interval_s, 9))
             for line in lines}
    assert costs == {("tune-tiny", "local"): (3.0, 0.5), ("train-tiny", "local"): (3.0, 0.5),
                     ("tune-tiny", "fedprox"): (3.0, 0.0), ("train-tiny", "fedprox"): (3.0, 0.0)}
    local = lambda rounds, evals, round_s: 3.0 + rounds * round_s + evals * (0.5 + 0.5)  # noqa: E731
    fedprox = lambda rounds, evals: 3.0 + rounds * 0.2 + evals * 1.0  # noqa: E731
    beyond = {"low": 4 * local(10, 2, 0.1) - 3.0 + 12 * fedprox(10, 2) - 4.0 + 3 * local(20, 4, 0.1) - 6.0
              + 3 * fedprox(20, 4) - 7.0,
              "high": 4 * local(10, 2, 0.3) - 3.0 + 12 * fedprox(10, 2) - 4.0 + 3 * local(20, 4, 0.3) - 6.0
              + 3 * fedprox(20, 4) - 7.0}  # tuning: every grid point on both tuning seeds
    assert learn2pfed == {"tiny": pytest.approx((4.0 + 1.0) * 2)}  # its other seeds, each with the gap before it
    assert (low, high) == pytest.approx((30.0 + learn2pfed["tiny"] + beyond["low"], 30.0 + learn2pfed["tiny"] + beyond["high"]))
    text = report("params.yaml", "cpu", probe, lines, learn2pfed, low, high)
    assert text.splitlines()[-1].startswith("total: ") and "learn2pfed-tiny" in text


def test_a_probe_run_with_one_logged_interval_measures_nothing():
    one = ProbeRun(3.0, 0.0, (2.0,))
    assert measured_cost(one, 5, Timing((0.1,), 0.5), 1.0) == measured_cost(None, 5, Timing((0.1,), 0.5), 1.0)
    assert measured_cost(one, 5, Timing((0.1,), 0.5), 1.0).run_s == 1.0  # what comes between runs is still there


def test_the_steps_of_every_algorithm_are_timed_writing_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = []
    platform, timings = time_steps(validate_params(parse_params(tiny_params(algorithms=["local", "fedprox"]))), "tiny",
                                   progress=lines.append)
    assert list(timings) == ["local", "fedprox"] and "device cpu" in platform
    assert [line.split(":")[1].split("(")[0].strip() for line in lines] == ["timing local", "timing fedprox"]
    assert all(len(t.round_s) == 3 and min(t.round_s) > 0 and t.evaluation_s > 0 for t in timings.values())
    assert list(tmp_path.iterdir()) == []


def test_the_pipeline_estimate_runs_its_probe_elsewhere_and_prints_a_total(tmp_path, monkeypatch, capsys):
    import flows.pipeline

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    raw = tiny_params(algorithms=["local", "fedavg"], seeds=[0, 1])
    raw["tracking"] = {"mlflow_uri": "sqlite:///mlflow.db"}
    raw["tables"] = {"tiny": {"experiments": ["tiny"]}}  # as the README's own file: its stage's run evaluates nothing
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    probes, probe_of = [], flows.pipeline.probe
    monkeypatch.setattr(flows.pipeline, "probe", lambda *args: probes.append(probe_of(*args)) or probes[-1])
    started = time.time()
    assert flows.pipeline.main(["--params", "params.yaml", "--estimate"]) == 0
    out = capsys.readouterr().out
    runs = probes[0].runs.values()  # its MLflow times read in seconds
    assert runs and all(started < run.start_s < run.start_s + run.wall_s < time.time() for run in runs)
    assert 0 <= probes[0].between_runs_s() < probes[0].wall_s
    assert "params.yaml: estimated on device cpu" in out
    probe = next(line for line in out.splitlines() if line.startswith("probe "))
    assert not probe.rstrip().endswith(" 0 s")  # the probe ran and was timed
    assert out.splitlines()[-1].startswith("total: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # no store, partition or run here
