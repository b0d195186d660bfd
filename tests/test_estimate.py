"""`--estimate`: a dry run that times each algorithm's round and evaluation on this machine and
multiplies them out, writing nothing."""

import pytest
from conftest import tiny_params

from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import parse_params
from pfl_tasks.estimate import Estimate, estimate, report


def test_an_estimate_is_runs_times_rounds_and_evaluations():
    e = Estimate("fedavg", round_s=(0.5, 0.7, 0.6), evaluation_s=2.0, runs=3, rounds=2000, evaluations=100)
    assert e.range_s == (3 * (2000 * 0.5 + 100 * 2.0), 3 * (2000 * 0.7 + 100 * 2.0))


def test_the_estimate_times_every_algorithm_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tiny_params(algorithms=["local", "fedprox"], seeds=[0, 1])
    data["federation"] = {"rounds": 11, "eval_every": 5, "checkpoint_every": 5}
    lines = []
    platform, estimates = estimate(validate_params(parse_params(data)), "tiny", progress=lines.append)
    assert [e.algorithm for e in estimates] == ["local", "fedprox"]
    assert [line.split(":")[1].split("(")[0].strip() for line in lines] == ["timing local", "timing fedprox"]
    assert all(len(e.round_s) == 3 and min(e.round_s) > 0 and e.evaluation_s > 0 for e in estimates)
    assert {(e.runs, e.rounds, e.evaluations) for e in estimates} == {(2, 11, 3)}  # rounds 5, 10 and the last
    text = report("tiny", platform, estimates)
    assert "device cpu" in text and "3 timed rounds" in text and text.splitlines()[-1].startswith("total")
    assert " - " in text.splitlines()[-1]  # a range
    assert list(tmp_path.iterdir()) == []


def test_the_pipeline_estimate_starts_no_prefect_server(tmp_path, monkeypatch, capsys):
    import yaml

    import flows.pipeline

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(algorithms=["fedavg"])))
    monkeypatch.setattr(flows.pipeline, "prefect_api", lambda: pytest.fail("a Prefect server started"))
    assert flows.pipeline.main(["--params", "params.yaml", "--estimate"]) == 0
    assert "tiny: estimated on device cpu" in capsys.readouterr().out
