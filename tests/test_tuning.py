"""Per-method tuning on validation (pfl_tasks/tuning.py): the grid it runs, the choice it makes
(on validation, never on test), and how the training runs read it."""

import json
from dataclasses import replace

import pytest

from conftest import ranked_result, tiny_params
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import parse_params
from pfl_tasks.errors import ConfigError
from pfl_tasks.tuning import LOCAL_LR, choose, points, tune_name, tuned, tuning_params, tuning_path


def tuning_raw() -> dict:
    raw = tiny_params(algorithms=["local", "fedprox", "l2sgd"], seeds=[3, 4],
                      run_overrides={"l2sgd": {"federation": {"rounds": 40}}})
    raw["federation"] = {"rounds": 10, "eval_every": 2, "checkpoint_every": 5}
    raw["algorithms"]["l2sgd"] = {"p": 0.5}
    raw["tuning"] = {"tiny": {"lr": [0.05, 0.5], "rounds_fraction": 0.5,
                              "hyper": {"fedprox": {"mu": [0.01, 1.0]}, "l2sgd": {"lr": [0.5, 2.0]}}}}
    return raw


def test_the_grid_is_every_lr_times_every_key_value_at_a_fraction_of_each_methods_rounds():
    raw = tuning_raw()
    params = validate_params(parse_params(raw))
    assert points(params, "tiny") == {
        "local_lr0.05": ("local", {LOCAL_LR: 0.05}), "local_lr0.5": ("local", {LOCAL_LR: 0.5}),
        "fedprox_lr0.05_mu0.01": ("fedprox", {LOCAL_LR: 0.05, "mu": 0.01}),
        "fedprox_lr0.05_mu1.0": ("fedprox", {LOCAL_LR: 0.05, "mu": 1.0}),
        "fedprox_lr0.5_mu0.01": ("fedprox", {LOCAL_LR: 0.5, "mu": 0.01}),
        "fedprox_lr0.5_mu1.0": ("fedprox", {LOCAL_LR: 0.5, "mu": 1.0}),
        # L2SGD's steps ignore the local lr: its own lr is its grid
        "l2sgd_lr0.5": ("l2sgd", {"lr": 0.5}), "l2sgd_lr2.0": ("l2sgd", {"lr": 2.0}),
    }
    tune = validate_params(parse_params(tuning_params(raw, params, "tiny")))
    exp = tune.experiment(tune_name("tiny"))
    assert exp.seeds == [3]  # the experiment's first seed, one run per point
    run = exp.for_run("fedprox_lr0.5_mu0.01")
    assert (run.local.optimizer.lr, exp.hyper["fedprox_lr0.5_mu0.01"]["mu"], run.federation.rounds) == (0.5, 0.01, 5)
    l2sgd = exp.for_run("l2sgd_lr2.0")
    assert (l2sgd.federation.rounds, exp.hyper["l2sgd_lr2.0"]) == (20, {"p": 0.5, "algorithm": "l2sgd", "lr": 2.0})


def test_tuning_picks_the_validation_best_point_never_the_test_best_and_marks_a_choice_at_the_edge():
    params = validate_params(parse_params(tuning_raw()))
    results = [
        ranked_result("fedprox_lr0.05_mu0.01", test=0.95, val=0.80),  # best on test
        ranked_result("fedprox_lr0.05_mu1.0", test=0.85, val=0.90),  # best on validation
        ranked_result("fedprox_lr0.5_mu0.01", test=0.90, val=0.85),
        replace(ranked_result("fedprox_lr0.5_mu1.0", test=0.99, val=0.99), diverged=[(3, 4)]),  # never chosen
        ranked_result("local_lr0.05", test=0.7, val=0.7), ranked_result("local_lr0.5", test=0.7, val=0.7),
        ranked_result("l2sgd_lr0.5", test=0.6, val=0.6),
    ]
    record = choose(params, "tiny", results, seconds=12.4)
    fedprox = record["methods"]["fedprox"]
    assert fedprox["chosen"] == {LOCAL_LR: 0.05, "mu": 1.0} and fedprox["val"] == 0.90
    assert fedprox["at_edge"] == [LOCAL_LR, "mu"]
    assert fedprox["points"]["fedprox_lr0.5_mu1.0"] == "diverged"
    assert record["methods"]["local"]["chosen"] == {LOCAL_LR: 0.05}  # a tie: the earlier point
    assert record["methods"]["l2sgd"]["points"] == {"l2sgd_lr0.5": 0.6, "l2sgd_lr2.0": "no result"}
    assert (record["seed"], record["seconds"], record["selected_on"]) == (3, 12, "validation/personalized/acc_mean")


def test_training_reads_the_choices_and_refuses_a_missing_or_stale_tuning_file(tmp_path):
    raw = tuning_raw()
    params = validate_params(parse_params(raw))
    with pytest.raises(ConfigError, match=r"tuning/tiny.json: missing: tune first \(`dvc repro tune-tiny`"):
        tuned(params, "tiny", tmp_path)
    record = choose(params, "tiny", [ranked_result("fedprox_lr0.5_mu0.01", 0.9, 0.9),
                                     ranked_result("local_lr0.05", 0.8, 0.8),
                                     ranked_result("l2sgd_lr2.0", 0.7, 0.7)], seconds=1)
    path = tuning_path(tmp_path, "tiny")
    path.parent.mkdir()
    path.write_text(json.dumps(record))
    exp = tuned(params, "tiny", tmp_path)
    assert exp.for_run("fedprox", 4).local.optimizer.lr == 0.5 and exp.hyper["fedprox"]["mu"] == 0.01
    assert exp.for_run("local").local.optimizer.lr == 0.05
    assert exp.hyper["l2sgd"]["lr"] == 2.0 and exp.for_run("l2sgd").local.optimizer.lr == 0.1  # its own lr only
    assert exp.for_run("l2sgd").federation.rounds == 40  # its own rounds kept
    raw["tuning"]["tiny"]["hyper"]["fedprox"]["mu"] = [0.01, 0.1]
    with pytest.raises(ConfigError, match="holds no choice for fedprox over its grid .* rerun `dvc repro tune-tiny`"):
        tuned(validate_params(parse_params(raw)), "tiny", tmp_path)
    path.write_text("<<<<<<< HEAD")
    with pytest.raises(ConfigError, match="tuning/tiny.json: not a tuning file"):
        tuned(params, "tiny", tmp_path)


def test_a_run_override_names_its_key_and_an_experiment_without_tuning_is_as_configured():
    raw = tuning_raw()
    raw["experiments"]["tiny"]["run_overrides"]["l2sgd"]["federation"]["rounds"] = 0
    with pytest.raises(ConfigError, match="experiments.tiny.run_overrides.l2sgd.federation.rounds"):
        parse_params(raw).experiment("tiny")
    raw = tuning_raw()
    raw["tuning"]["tiny"]["hyper"]["ditto"] = {"mu": [1.0]}
    with pytest.raises(ConfigError, match=r"tuning.tiny.hyper: \['ditto'\] are not among experiments.tiny's"):
        parse_params(raw)
    raw = tiny_params()
    assert tuned(parse_params(raw), "tiny", None) == parse_params(raw).experiment("tiny")
