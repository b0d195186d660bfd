"""Scale-out: the Ray task runner gives bit-identical runs to the thread runner."""

import shutil

import pytest
import torch
import yaml

from conftest import mlflow_uri, tiny_params

pytestmark = pytest.mark.slow


def run_with(task_runner: str, root, prepared_digits) -> dict:
    from flows.train import RunPaths, train_experiment

    shutil.copytree(prepared_digits, root / "data" / "partitions" / "digits")
    data = tiny_params(algorithms=["fedavg", "ditto"])
    data["algorithms"]["ditto"] = {"mu": 0.1}
    data["engine"] = {"orchestrator": "prefect", "device": "cpu", "chunk_size": 4, "task_runner": task_runner}
    data["federation"] = {"rounds": 2, "eval_every": 1, "checkpoint_every": 2}
    data["tracking"] = {"mlflow_uri": mlflow_uri()}
    (root / "params.yaml").write_text(yaml.safe_dump(data))
    finals = train_experiment("tiny", str(root / "params.yaml"), str(root))
    checkpoints = {alg: torch.load(RunPaths.of(root, "tiny", alg, 0).checkpoint, weights_only=True)
                   for alg in ("fedavg", "ditto")}
    return {"finals": finals, "checkpoints": checkpoints}


def test_ray_runner_is_bit_identical_to_the_thread_runner(tmp_path, prepared_digits, prefect_harness, monkeypatch):
    import ray

    from pfl_tasks.algorithms.federation import Federation

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    put, puts = ray.put, []
    monkeypatch.setattr(ray, "put", lambda value: puts.append(type(value).__name__) or put(value))
    ray.init(num_cpus=2, include_dashboard=False, namespace="prefect")
    try:
        (tmp_path / "thread").mkdir()
        (tmp_path / "ray").mkdir()
        thread = run_with("thread", tmp_path / "thread", prepared_digits)
        assert puts == []
        on_ray = run_with("ray", tmp_path / "ray", prepared_digits)
    finally:
        ray.shutdown()
    # 2 runs x 2 rounds of 2 chunks: the federation once per run, the payload once per round
    assert puts.count(Federation.__name__) == 2 and len(puts) == 2 + 2 * 2
    assert on_ray["finals"] == thread["finals"]
    for alg in ("fedavg", "ditto"):
        a, b = thread["checkpoints"][alg], on_ray["checkpoints"][alg]
        for part in ("server", "clients"):
            flat_a, flat_b = torch.utils._pytree.tree_flatten(a[part])[0], torch.utils._pytree.tree_flatten(b[part])[0]
            assert len(flat_a) == len(flat_b) > 0 or part == "clients"
            assert all(torch.equal(x, y) for x, y in zip(flat_a, flat_b)), (alg, part)
    assert len(torch.utils._pytree.tree_flatten(thread["checkpoints"]["ditto"]["clients"])[0]) > 0
