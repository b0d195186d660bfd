import pytest

from conftest import tiny_params
from pfl_tasks.algorithms import validate_params
from pfl_tasks.config import load_params, parse_params
from pfl_tasks.errors import ConfigError


def error_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        validate_params(parse_params(data))
    return str(info.value)


def test_repo_params_yaml_is_valid():
    params = validate_params(load_params("params.yaml"))
    assert set(params.experiments) >= {"mnist", "poly1"} and set(params.learn2pfed) >= {"poly1"}


@pytest.mark.parametrize("path", ["params-quick.yaml", "params-fmnist.yaml", "params-digits.yaml",
                                  "params-extended.yaml"])
def test_repo_other_params_files_are_valid(path):
    validate_params(load_params(path))


def test_unknown_key_names_its_path_and_the_allowed_keys():
    data = tiny_params()
    data["local"]["optimizer"]["learning_rate"] = 0.1
    msg = error_of(data)
    assert "local.optimizer" in msg and "learning_rate" in msg and "'lr'" in msg


def test_ill_typed_key_names_its_path():
    data = tiny_params()
    data["federation"]["rounds"] = "many"
    assert "federation.rounds" in error_of(data)


def test_bad_choice_lists_allowed_values_without_union_tags():
    data = tiny_params()
    data["datasets"]["digits"]["partition"]["kind"] = "dirichlett"
    msg = error_of(data)
    assert "datasets.digits.partition" in msg and "dirichlet" in msg and "shards" in msg


def test_nested_error_inside_tagged_union_has_clean_path():
    data = tiny_params()
    data["datasets"]["digits"]["partition"]["alpha"] = -1
    assert "datasets.digits.partition.alpha" in error_of(data)


def test_experiment_override_is_validated_under_its_own_path():
    data = tiny_params(local={"optimizer": {"lr": "fast"}})
    assert "experiments.tiny.local.optimizer.lr" in error_of(data)


def test_experiment_override_merges_into_defaults():
    params = parse_params(tiny_params(local={"epochs": 2, "optimizer": {"momentum": 0.9}}))
    exp = params.experiment("tiny")
    assert exp.local.epochs == 2 and exp.local.steps is None
    assert exp.local.optimizer.momentum == 0.9 and exp.local.optimizer.lr == 0.1


def test_algorithm_hyperparameters_are_typed():
    data = tiny_params()
    data["algorithms"]["fedprox"] = {"mu": "big"}
    assert "algorithms.fedprox.mu" in error_of(data)
    data["algorithms"]["fedprox"] = {"mew": 1}
    assert "algorithms.fedprox.mew" in error_of(data)
    data["algorithms"] = {"fedsomething": {}}
    msg = error_of(data)
    assert "fedsomething" in msg and "fedavg" in msg


def test_algorithm_variants_by_explicit_class():
    data = tiny_params()
    data["algorithms"]["prox_strong"] = {"algorithm": "fedprox", "mu": 1.0}
    validate_params(parse_params(data))


def test_dangling_dataset_reference():
    data = tiny_params(dataset="nope")
    assert "experiments.tiny.dataset" in error_of(data)


def test_a_typo_between_an_experiments_runs_and_its_tuning_names_both_spellings():
    """A method misspelled in the experiment's list, or in its tuning grid: the error names the
    two spellings, not only that the tuning section is wrong."""
    for listed, tuned in ((["fedavg", "dito"], "ditto"), (["fedavg", "ditto"], "dito")):
        raw = tiny_params(algorithms=listed)
        raw["tuning"] = {"tiny": {"lr": [0.1], "hyper": {tuned: {"mu": [0.1]}}}}
        assert (f"tuning.tiny.hyper: [{tuned!r}] are not among experiments.tiny.algorithms {listed}: "
                f"{tuned!r} here and {listed[1]!r} there, a typo in one of them?") in error_of(raw)


def test_a_tuning_grids_value_is_checked_as_its_algorithm_checks_it_naming_the_grid():
    """Before any grid point is written or trained: the grid's key, not the point's internal run name."""
    raw = tiny_params(algorithms=["fedavg", "ditto"])
    raw["tuning"] = {"tiny": {"lr": [0.1], "hyper": {"ditto": {"mu": [0.1, -1.0]}}}}
    assert error_of(raw) == "tuning.tiny.hyper.ditto.mu: Input should be greater than or equal to 0 (its grid's value -1.0)"


def test_a_missing_params_file_names_the_closest_yaml_file_here(tmp_path):
    (tmp_path / "own-params.yaml").write_text("seed: 0\n")
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    with pytest.raises(ConfigError) as info:
        load_params(tmp_path / "own-param.yaml")
    assert str(info.value).endswith("own-param.yaml: no such params file (did you mean 'own-params.yaml'?) "
                                    f"(YAML files in {tmp_path}: own-params.yaml)")
