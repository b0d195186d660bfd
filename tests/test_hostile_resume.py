"""Careless resumes and starved runs (issue 28): `--on-config-change resume` continues only
across a change of when to evaluate and checkpoint, never into other clients, data, model or
training; and a run that aggregated too few of its rounds is listed, never ranked."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from conftest import mlflow_uri, tiny_params, tracking
from flows.prepare import prepare
from flows.tables import build_table
from pfl_tasks.config import parse_params
from pfl_tasks.engine.checkpoint import load_checkpoint, save_checkpoint
from pfl_tasks.engine.rounds import InlineSteps
from pfl_tasks.errors import CheckpointError
from pfl_tasks.reports import write_report
from pfl_tasks.reports.results import configured_runs
from pfl_tasks.reports.text import best_line
from pfl_tasks.runs import RunPaths
from pfl_tasks.training import finished_outcome, train_run


def configured(**federation) -> dict:
    return tiny_params(federation={"rounds": 4, "eval_every": 2, "checkpoint_every": 2, **federation})


def train(root, data: dict, algorithm: str, on_config_change: str = "refuse") -> dict:
    params = parse_params(data)
    return train_run(params.experiment("tiny"), algorithm, params.algorithms[algorithm], root, InlineSteps(2),
                     on_config_change, tracking())


def with_clients(root, data: dict, n_clients: int) -> dict:
    """`data` over `n_clients` clients, its partition prepared under `root` as `dvc repro` would."""
    data["datasets"]["digits"]["partition"]["n_clients"] = n_clients
    (root / "params.yaml").write_text(yaml.safe_dump(data))
    prepare("digits", str(root / "params.yaml"), root / "data" / "partitions")
    return data


def with_value(data: dict, path: str, value) -> dict:
    """`data` with the dotted key `path` set to `value`."""
    node = data
    for key in path.split(".")[:-1]:
        node = node[key]
    node[path.split(".")[-1]] = value
    return data


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, prepared_digits):
    """A root whose Local-only run checkpointed round 2 of the tiny experiment."""
    root = tmp_path_factory.mktemp("checkpointed")
    shutil.copytree(prepared_digits, root / "data" / "partitions" / "digits")
    train(root, configured(rounds=2), "local")
    return root


@pytest.mark.parametrize("change, names", [
    (lambda root, data: with_clients(root, data, 4), r"data [0-9a-f]{16} -> [0-9a-f]{16}"),  # fewer clients
    (lambda root, data: with_clients(root, data, 8), r"data [0-9a-f]{16} -> [0-9a-f]{16}"),  # more: no IndexError
    (lambda root, data: with_value(data, "experiments.tiny.model.hidden", [32]),
     r"experiment.model.hidden \[16\] -> \[32\]"),
    (lambda root, data: with_value(with_value(data, "local.optimizer.lr", 0.2),
                                   "experiments.tiny.federation.dropout", 0.5),
     r"experiment.federation.dropout 0.0 -> 0.5; experiment.local.optimizer.lr 0.1 -> 0.2"),
    (lambda root, data: with_value(data, "experiments.tiny.federation.rounds", 1),
     r"it is at step 2, beyond the configured 1"),
], ids=["fewer-clients", "more-clients", "model", "training", "fewer-rounds"])
def test_a_resume_into_other_clients_data_model_or_training_is_refused_naming_the_change(
        project, checkpointed, change, names):
    shutil.copytree(checkpointed / "models", project / "models")
    path = RunPaths.of(project, "tiny", "local", 0).checkpoint
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=rf"cannot resume: .*{names}.*--on-config-change restart"):
        train(project, change(project, configured()), "local", on_config_change="resume")
    assert path.read_bytes() == before


def test_a_run_is_kept_only_when_it_finished_under_this_identity_and_budget_pinning_its_mlflow_run(
        project, checkpointed):
    """What a train stage skips (`finished_outcome`): any other budget, cadence, model or
    platform, or metrics naming another MLflow run than the checkpoint's, and the run runs."""
    for folder in ("models", "metrics"):
        shutil.copytree(checkpointed / folder, project / folder)
    paths = RunPaths.of(project, "tiny", "local", 0)

    def kept(data: dict) -> dict | None:
        params = parse_params(data)
        return finished_outcome(params.experiment("tiny"), "local", params.algorithms["local"], project)

    assert kept(configured(rounds=2)) == json.loads(paths.metrics.read_text())
    assert kept(configured(rounds=3)) is None
    assert kept(configured(rounds=2, eval_every=1)) is None
    assert kept(with_value(configured(rounds=2), "experiments.tiny.model.hidden", [32])) is None
    ckpt = load_checkpoint(paths.checkpoint, {})
    save_checkpoint(paths.checkpoint, {**ckpt, "platform": "another machine"})
    assert kept(configured(rounds=2)) is None
    save_checkpoint(paths.checkpoint, ckpt)
    assert kept(configured(rounds=2)) is not None  # restored: the pin alone decides below
    outcome = json.loads(paths.metrics.read_text())
    paths.metrics.write_text(json.dumps({**outcome, "mlflow_run": ["another run"]}))
    assert kept(configured(rounds=2)) is None


def test_a_resume_across_a_new_budget_and_evaluation_cadence_is_bit_identical(project, tmp_path_factory):
    """More rounds, evaluated and checkpointed at another cadence: the state is that of an
    uninterrupted run under the new configuration, and so is every metric of its last round."""
    other = tmp_path_factory.mktemp("uninterrupted")
    shutil.copytree(project / "data", other / "data")
    new = configured(rounds=6, eval_every=3, checkpoint_every=3)
    uninterrupted = train(other, new, "fedprox")

    train(project, configured(), "fedprox")
    resumed = train(project, new, "fedprox", on_config_change="resume")

    assert {k: v for k, v in resumed.items() if k.startswith("final/")} == \
        {k: v for k, v in uninterrupted.items() if k.startswith("final/")}
    a, b = (load_checkpoint(RunPaths.of(root, "tiny", "fedprox", 0).checkpoint, {}) for root in (other, project))
    leaves = [torch.utils._pytree.tree_flatten([c["server"], c["clients"]])[0] for c in (a, b)]
    assert leaves[0] and len(leaves[0]) == len(leaves[1])
    assert all(torch.equal(x, y) for x, y in zip(*leaves))
    assert [h["round"] for h in b["history"]] == [2, 4, 6]  # each evaluation at the cadence of its time


@pytest.fixture(scope="module")
def starved_and_normal(tmp_path_factory, prepared_digits):
    """Local-only with 99% of its sampled clients dropping (few rounds aggregated) and FedAvg
    without dropout, in one experiment; the report, the table and Local's run's skipped rounds."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("dropout")
    shutil.copytree(prepared_digits, root / "data" / "partitions" / "digits")
    data = {**tiny_params(algorithms=["local", "fedavg"]), "tables": {"t": {"experiments": ["tiny"]}}}
    skipped = train(root, {**data, "federation": {"rounds": 4, "eval_every": 2, "dropout": 0.99}},
                    "local")["final/rounds/skipped"]
    train(root, {**data, "federation": {"rounds": 4, "eval_every": 2}}, "fedavg")
    params, client = parse_params(data), MlflowClient(mlflow_uri())
    results = write_report(client, "tiny", root / "reports", root / "figures", configured_runs(params, "tiny", root))
    return {"results": results, "report": (root / "reports" / "tiny.md").read_text(), "skipped": int(skipped),
            "table": build_table(client, params, params.tables["t"], root)}


def test_a_run_that_aggregated_too_few_rounds_is_listed_not_ranked_saying_why(starved_and_normal):
    skipped, report = starved_and_normal["skipped"], starved_and_normal["report"]
    assert skipped > 2  # of 4: fewer than half aggregated
    why = f"too few rounds aggregated: {4 - skipped} of 4 (seed 0)"
    assert f"- local: {why}" in report and "| local" not in report
    assert starved_and_normal["table"]["local"]["tiny"] == {"metric": "acc", "better": "higher", "status": why}
    assert "aggregated fewer than 50% of their rounds" in report  # the protocol says so
    local, = (r for r in starved_and_normal["results"] if r.method == "local")
    assert not local.ranked
    assert best_line(starved_and_normal["results"]).startswith("best fedavg (")


def test_a_normal_run_shows_every_round_aggregated(starved_and_normal):
    report = starved_and_normal["report"]
    assert "| selected rounds | rounds aggregated | plateaued |" in report
    ranked_table = report.split("## Sample-weighted")[0]
    row, = (line for line in ranked_table.splitlines() if line.startswith("| 1 | fedavg"))
    assert "| 4/4 |" in row
    assert "mean" in starved_and_normal["table"]["fedavg"]["tiny"]


def test_a_run_resumed_on_other_numerics_says_so_in_its_platform_tags(project, checkpointed):
    """Rounds 1-2 computed under native numerics (the checkpoint says so), 3-4 under portable
    (this process): `--on-config-change resume` continues, and the MLflow run's tag says
    `native, then portable`, not the last alone; a second resume keeps the history."""
    from mlflow.tracking import MlflowClient

    from pfl_tasks.runs import mixed_platform_tags

    shutil.copytree(checkpointed / "models", project / "models")
    path = RunPaths.of(project, "tiny", "local", 0).checkpoint
    ckpt = load_checkpoint(path, {})
    here = ckpt["platform"]
    assert "numerics portable" in here
    save_checkpoint(path, {**ckpt, "platform": here.replace("numerics portable", "numerics native")})
    final = train(project, configured(), "local", on_config_change="resume")
    run = MlflowClient(mlflow_uri()).get_run(json.loads(RunPaths.of(project, "tiny", "local", 0).metrics.read_text())
                                             ["mlflow_run"][0])
    assert run.data.tags["platform.numerics"] == "native, then portable" and final["final/round"] == 4
    assert load_checkpoint(path, {})["platforms"] == [here.replace("numerics portable", "numerics native"), here]
    assert mixed_platform_tags(["device cpu, numerics portable", "device cpu, numerics native",
                                "device cpu, numerics portable"]) == {
        "platform.numerics": "portable, then native, then portable"}
    assert mixed_platform_tags([here]) == {}
