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
