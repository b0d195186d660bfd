"""Prefect flows and the thin entry points that `dvc.yaml` stages call. Each entry point sets
the environment's defaults (`flows.environment`) before Prefect and MLflow load; importing a
flow changes no environment."""
