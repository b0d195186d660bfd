"""Per-method tuning on validation (pfl_tasks/tuning.py): the grid it runs, the choice it makes
(on validation, never on test), and how the training runs read it."""

import json
from dataclasses import replace

import numpy as np
import pytest

from conftest import ranked_result, tiny_params
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import parse_params
from pfl_tasks.errors import ConfigError
from pfl_tasks.reports.text import tuning_lines
from pfl_tasks.tuning import LOCAL_LR, beyond, choose, points, tune_name, tuned, tuning_params, tuning_path, widened


def tuning_raw() -> dict:
    raw = tiny_params(algorithms=["local", "fedprox", "l2sgd"], seeds=[3, 4, 5],
                      run_overrides={"l2sgd": {"federation": {"rounds": 40}}})
    raw["federation"] = {"rounds": 10, "eval_every": 2, "checkpoint_every": 5}
    raw["algorithms"]["l2sgd"] = {"p": 0.5}
    raw["algorithms"]["fedprox"] = {}  # a tuned key stays at its default
    raw["tuning"] = {"tiny": {"lr": [0.05, 0.5], "rounds_fraction": 0.5,
                              "hyper": {"fedprox": {"mu": [0.01, 1.0]}, "l2sgd": {"lr": [0.5, 2.0]}}}}
    return raw


def test_a_tuned_key_set_off_its_default_is_refused_naming_its_grid():
    """The tuning's choice replaces `algorithms.fedprox.mu`: a value there (a `dvc exp run -S`)
    would change what DVC shows and nothing that trains, so it is refused, naming the way to run
    it; pinned as the grid's one value, it runs."""
    raw = tuning_raw()
    raw["algorithms"]["fedprox"] = {"mu": 0.5}
    with pytest.raises(ConfigError, match=r"^algorithms\.fedprox\.mu is 0\.5, but tuning\.tiny\.hyper\.fedprox\.mu tunes "
                                          r"it over \[0\.01, 1\.0\].* set tuning\.tiny\.hyper\.fedprox\.mu: \[0\.5\]"):
        validate_params(parse_params(raw))
    raw["algorithms"]["fedprox"] = {"mu": 0.01}  # its default, spelled out
    validate_params(parse_params(raw))
    raw["experiments"]["tiny"]["algorithm_overrides"] = {"fedprox": {"mu": 1.0}}
    with pytest.raises(ConfigError, match=r"^experiments\.tiny\.algorithm_overrides\.fedprox\.mu is 1\.0"):
        validate_params(parse_params(raw))
    raw["experiments"]["tiny"]["algorithm_overrides"] = {}
    raw["tuning"]["tiny"]["hyper"]["fedprox"]["mu"] = [0.5]
    assert points(validate_params(parse_params(raw)), "tiny")["fedprox_lr0.05_mu0.5"] == ("fedprox", {LOCAL_LR: 0.05, "mu": 0.5})


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
    assert exp.seeds == [3, 4]  # the experiment's first two seeds, a run each per point
    run = exp.for_run("fedprox_lr0.5_mu0.01")
    assert (run.local.optimizer.lr, exp.hyper["fedprox_lr0.5_mu0.01"]["mu"], run.federation.rounds) == (0.5, 0.01, 5)
    l2sgd = exp.for_run("l2sgd_lr2.0")
    assert (l2sgd.federation.rounds, exp.hyper["l2sgd_lr2.0"]) == (20, {"p": 0.5, "algorithm": "l2sgd", "lr": 2.0})


def seeded(method: str, test: float, val: float, seeds=(3, 4), spread: float | None = 0.0):
    """A ranked tuning point over the tuning seeds of `tuning_raw`: its mean validation `val`,
    each seed's two clients at `val` + `spread` and `val` - `spread` (None: no client tables).
    Against a point of spread 0, the paired standard error is `spread` / sqrt(3)."""
    clients = {} if spread is None else {seed: np.array([val + spread, val - spread]) for seed in seeds}
    return replace(ranked_result(method, test, val), seeds=list(seeds), val_clients=clients)


def test_tuning_picks_the_validation_best_beyond_noise_never_the_test_best_and_marks_a_choice_at_the_edge():
    params = validate_params(parse_params(tuning_raw()))
    results = [
        seeded("fedprox_lr0.05_mu0.01", test=0.95, val=0.80),  # best on test
        seeded("fedprox_lr0.05_mu1.0", test=0.85, val=0.90),  # best on validation
        seeded("fedprox_lr0.5_mu0.01", test=0.90, val=0.85),
        replace(seeded("fedprox_lr0.5_mu1.0", test=0.99, val=0.99), diverged=[(3, 4)]),  # never chosen
        seeded("local_lr0.05", test=0.7, val=0.7), seeded("local_lr0.5", test=0.7, val=0.7),
        seeded("l2sgd_lr0.5", test=0.6, val=0.6),
        seeded("l2sgd_lr2.0", test=0.99, val=0.99, seeds=[3]),  # one tuning seed of two: never chosen
    ]
    record = choose(params, "tiny", results, seconds=12.4)
    fedprox = record["methods"]["fedprox"]
    assert fedprox["chosen"] == {LOCAL_LR: 0.05, "mu": 1.0} and fedprox["val"] == 0.90
    assert fedprox["at_edge"] == [LOCAL_LR, "mu"]
    assert fedprox["edge_reasons"] == {LOCAL_LR: "no bound to widen into (tuning.tiny.lr_bounds)",
                                       "mu": "no bound to widen into (tuning.tiny.hyper_bounds.fedprox.mu)"}
    assert fedprox["points"]["fedprox_lr0.5_mu1.0"] == "diverged"
    assert record["methods"]["local"]["chosen"] == {LOCAL_LR: 0.05}  # a tie: the earlier point
    assert record["methods"]["l2sgd"]["points"] == {"l2sgd_lr0.5": 0.6, "l2sgd_lr2.0": "1/2 seeds finished"}
    assert (record["seeds"], record["seconds"], record["selected_on"]) == ([3, 4], 12, "validation/personalized/acc_mean")


def test_of_the_points_within_noise_of_the_best_the_choice_has_the_most_keys_inside_their_grids():
    raw = tuning_raw()
    raw["tuning"]["tiny"].update(lr=[0.005, 0.05, 0.5], lr_bounds=[0.005, 5.0])
    raw["tuning"]["tiny"]["hyper"]["fedprox"]["mu"] = [0.001, 0.01, 1.0]
    params = validate_params(parse_params(raw))
    lrs = (("0.005", 0.70), ("0.05", 0.79), ("0.5", 0.80))

    def local(se: float | None, metric: str = "acc") -> dict:
        """lr 0.5 the best; the others with a paired standard error `se` against it."""
        results = [replace(seeded(f"local_lr{lr}", 0.7, val if metric == "acc" else 1 - val,
                                  spread=None if se is None else 0.0 if lr == "0.5" else se * 3 ** 0.5), metric=metric)
                   for lr, val in lrs]
        return choose(params, "tiny", results, seconds=1)["methods"]["local"]

    quiet, noisy, unknown = local(se=0.001), local(se=0.015), local(se=None)
    assert quiet["chosen"] == quiet["best"] == {LOCAL_LR: 0.5} and quiet["at_edge"] == [LOCAL_LR]  # beyond noise
    assert noisy["chosen"] == {LOCAL_LR: 0.05} and noisy["best"] == {LOCAL_LR: 0.5}  # 0.01 short: within noise
    assert (noisy["at_edge"], noisy["val"], noisy["best_val"]) == ([], 0.79, 0.80) and noisy["se"] == pytest.approx(0.015)
    # the grid widens past the best's edge, not the choice's: a better lr may lie beyond 0.5
    assert widened(params, "tiny", {"methods": {"local": noisy}}) == {"local": {LOCAL_LR: [0.005, 0.05, 0.5, 5.0]}}
    assert unknown["chosen"] == {LOCAL_LR: 0.5} and unknown["points_se"] == dict.fromkeys(unknown["points"])
    assert local(se=0.015, metric="mse")["chosen"] == {LOCAL_LR: 0.05}  # MSE: lower is better, the same rule
    assert local(se=0.001, metric="mse")["chosen"] == {LOCAL_LR: 0.5}
    row = next(line for line in tuning_lines(choose(params, "tiny", [], seconds=1) | {"methods": {"local": noisy}})
               if line.startswith("| local |"))
    assert row == "| local | lr 0.005, 0.05, 0.5 | lr 0.05 | 0.7900 ± 0.0150 | lr 0.5: 0.8000 | 3/3 | – |"
    # FedProx: lr 0.5 (an edge) and mu 0.01 (inside) are best; lr 0.05 with mu 1.0 is within noise but
    # at mu's edge; lr 0.05 with mu 0.01, inside both, is further short but within noise too: chosen
    fedprox = [seeded("fedprox_lr0.5_mu0.01", 0.7, 0.800), seeded("fedprox_lr0.05_mu1.0", 0.7, 0.799, spread=0.01),
               seeded("fedprox_lr0.05_mu0.01", 0.7, 0.795, spread=0.01), seeded("fedprox_lr0.005_mu0.001", 0.7, 0.5)]
    assert choose(params, "tiny", fedprox, seconds=1)["methods"]["fedprox"]["chosen"] == {LOCAL_LR: 0.05, "mu": 0.01}


def test_the_next_value_past_an_edge_repeats_the_step_there_within_the_bound():
    assert beyond([0.1, 0.3, 1.0], "high", [0.01, 10.0]) == 3.0  # the ratio 1/0.3 again, to 1 digit
    assert beyond([0.1, 0.3, 1.0], "low", [0.01, 10.0]) == 0.03
    assert beyond([1.0, 1.2], "high", [0.01, 10.0]) == 1.4  # 1.44: 1 digit would not pass 1.2
    assert beyond([0.1, 0.3, 1.0], "high", [0.01, 2.5]) == 2.5  # cut at the bound
    assert beyond([0.1, 0.3, 2.0], "high", [0.01, 2.0]) is None  # at it
    assert beyond([1, 5, 10], "high", [1, 15]) == 15 and beyond([1, 5, 10], "low", [1, 15]) is None  # integers
    assert beyond([4, 5], "high", [1, 100]) == 7 and beyond([4, 5], "low", [1, 100]) == 3
    assert beyond([0.0, 0.5], "low", [-1.0, 1.0]) == -0.5  # not both positive: the difference again


def test_a_choice_at_an_edge_widens_its_grid_within_the_bounds_and_says_why_an_edge_stays():
    raw = tuning_raw()
    raw["tuning"]["tiny"].update(lr_bounds=[0.05, 5.0], hyper_bounds={"fedprox": {"mu": [0.001, 1.0]}}, extensions=2)
    params = validate_params(parse_params(raw))
    first = choose(params, "tiny", [seeded("fedprox_lr0.5_mu0.01", 0.9, 0.9), seeded("local_lr0.5", 0.8, 0.8),
                                    seeded("local_lr0.05", 0.7, 0.7), seeded("l2sgd_lr0.5", 0.7, 0.7)], seconds=1)
    tried = widened(params, "tiny", first)
    # FedProx at lr 0.5 (high) and mu 0.01 (low): both widen; Local's lr 0.5 too; L2SGD's own lr has no bound
    assert tried == {"local": {LOCAL_LR: [0.05, 0.5, 5.0]}, "fedprox": {LOCAL_LR: [0.05, 0.5, 5.0], "mu": [0.001, 0.01, 1.0]},
                     "l2sgd": {"lr": [0.5, 2.0]}}
    assert set(points(params, "tiny", tried)) >= {"fedprox_lr5.0_mu0.001", "local_lr5.0"}
    tune = validate_params(parse_params(tuning_params(raw, params, "tiny", tried)))
    assert tune.experiment(tune_name("tiny")).for_run("fedprox_lr5.0_mu0.001").local.optimizer.lr == 5.0
    second = choose(params, "tiny", [seeded("fedprox_lr5.0_mu0.001", 0.9, 0.95), seeded("local_lr0.5", 0.8, 0.8),
                                     seeded("l2sgd_lr0.5", 0.7, 0.7)], seconds=1, tried=tried)
    fedprox = second["methods"]["fedprox"]
    assert (fedprox["grid"], fedprox["tried"]) == ({LOCAL_LR: [0.05, 0.5], "mu": [0.01, 1.0]}, tried["fedprox"])
    assert fedprox["edge_reasons"] == {LOCAL_LR: "at its bound 5", "mu": "at its bound 0.001"}
    assert second["methods"]["local"]["at_edge"] == []  # inside its widened grid
    assert second["methods"]["l2sgd"]["edge_reasons"] == {"lr": "no bound to widen into (tuning.tiny.hyper_bounds.l2sgd.lr)"}
    assert widened(params, "tiny", second) == tried  # nothing left to widen: the stage stops
    row = next(line for line in tuning_lines(second) if line.startswith("| fedprox |"))
    assert row.startswith("| fedprox | lr 0.05, 0.5, *5*; mu *0.001*, 0.01, 1 | lr 5 ◆, mu 0.001 ◆ |")
    assert row.endswith("| lr: at its bound 5; mu: at its bound 0.001 |")
    raw["tuning"]["tiny"]["lr_bounds"] = [0.1, 5.0]
    with pytest.raises(ConfigError, match=r"lr_bounds: \[0.1, 5.0\] does not hold the grid \[0.05, 0.5\]"):
        parse_params(raw)


def test_training_reads_the_choices_and_refuses_a_missing_or_stale_tuning_file(tmp_path):
    raw = tuning_raw()
    params = validate_params(parse_params(raw))
    with pytest.raises(ConfigError, match=r"tuning/tiny.json: missing: tune first \(`dvc repro tune-tiny`"):
        tuned(params, "tiny", tmp_path)
    record = choose(params, "tiny", [seeded("fedprox_lr0.5_mu0.01", 0.9, 0.9), seeded("local_lr0.05", 0.8, 0.8),
                                     seeded("l2sgd_lr2.0", 0.7, 0.7)], seconds=1)
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
    with pytest.raises(ConfigError, match=r"tuning.tiny.hyper: \['ditto'\] are not among experiments.tiny.algorithms"):
        parse_params(raw)
    raw = tiny_params()
    assert tuned(parse_params(raw), "tiny", None) == parse_params(raw).experiment("tiny")


@pytest.mark.slow
def test_the_stage_trains_each_widened_point_once_until_its_choice_is_inside_its_grid(project, prefect_harness):
    """`flows.tune` end to end: Local, at learning rates too small for 2 rounds, is best at its
    largest each time beyond noise, so its grid widens (x3 a step) up to the bound 0.1, where
    0.1 beats 0.09 by less than noise: the choice is 0.09, inside. Every point runs once on both
    tuning seeds, though the stage pins its params files, and the file it writes is what
    training reads."""
    import mlflow
    import yaml

    from conftest import mlflow_uri
    from flows.tune import tune_flow
    from pfl_tasks.config import params_snapshot

    raw = tiny_params(algorithms=["local"], seeds=[0, 1, 2])
    raw["tracking"] = {"mlflow_uri": mlflow_uri()}
    raw["tuning"] = {"tiny": {"lr": [0.003, 0.01], "lr_bounds": [0.003, 0.1], "extensions": 3}}
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    with params_snapshot():  # as the stage runs it: its params file pinned at its first read
        record = tune_flow("tiny", str(project / "params.yaml"), str(project))
    local, lrs = record["methods"]["local"], ("0.003", "0.01", "0.03", "0.09", "0.1")
    assert local["tried"] == {LOCAL_LR: [float(lr) for lr in lrs]} and record["seeds"] == [0, 1]
    assert (local["best"], local["chosen"], local["at_edge"]) == ({LOCAL_LR: 0.1}, {LOCAL_LR: 0.09}, [])
    assert set(local["points"]) == {f"local_lr{lr}" for lr in lrs}
    mlflow.set_tracking_uri(mlflow_uri())
    runs = mlflow.search_runs(experiment_names=[tune_name("tiny")], filter_string="attributes.status = 'FINISHED'")
    assert sorted(runs["tags.mlflow.runName"]) == sorted(f"local_lr{lr}-seed{s}" for lr in lrs for s in (0, 1))
    params = validate_params(parse_params(raw))
    assert tuned(params, "tiny", project).for_run("local").local.optimizer.lr == 0.09


def test_a_params_file_edited_while_the_grid_trains_leaves_no_tuning_file(project, monkeypatch):
    """The stage fails at its end on a params file edited meanwhile; it must not first write a
    tuning file chosen under the old one, which training would then read without a word."""
    import yaml

    import flows.tune
    from pfl_tasks.config import params_snapshot

    raw = tiny_params(algorithms=["local"])
    raw["tuning"] = {"tiny": {"lr": [0.003, 0.01]}}
    path = project / "params.yaml"
    path.write_text(yaml.safe_dump(raw))

    def edited(*args, **kwargs):
        path.write_text(yaml.safe_dump({**raw, "seed": 7}))

    monkeypatch.setattr(flows.tune, "prepare", lambda *args: None)
    monkeypatch.setattr(flows.tune, "train_experiment", edited)
    monkeypatch.setattr(flows.tune, "grid_results", lambda *args: [])
    monkeypatch.setattr(flows.tune, "run_seconds", lambda *args: 0.0)
    with pytest.raises(ConfigError, match="params.yaml changed during the stage"), params_snapshot():
        flows.tune.tune_flow.fn("tiny", str(path), str(project))
    assert not tuning_path(project, "tiny").exists()
