"""Scale-out: the Ray task runner gives bit-identical runs to the thread runner."""

import pytest

from conftest import assert_same_runs, train_tiny

pytestmark = pytest.mark.slow


def test_ray_runner_is_bit_identical_to_the_thread_runner(tmp_path, prepared_digits, prefect_harness, monkeypatch):
    import ray

    from pfl_tasks.engine.federation import Federation

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    put, puts = ray.put, []
    monkeypatch.setattr(ray, "put", lambda value: puts.append(type(value).__name__) or put(value))
    ray.init(num_cpus=2, include_dashboard=False, namespace="prefect")
    try:
        (tmp_path / "thread").mkdir()
        (tmp_path / "ray").mkdir()
        thread = train_tiny(tmp_path / "thread", prepared_digits, task_runner="thread")
        assert puts == []
        on_ray = train_tiny(tmp_path / "ray", prepared_digits, task_runner="ray")
    finally:
        ray.shutdown()
    # 2 runs x 2 rounds of 2 chunks: the federation once per run, the payload once per round
    assert puts.count(Federation.__name__) == 2 and len(puts) == 2 + 2 * 2
    assert_same_runs(thread, on_ray)
