"""What a run's numbers are: per-client metrics summarized over clients, the evaluation selected
on validation (never on test), the final and selected metrics, and the plateau verdict. Pure
rules, shared by the training loop, the Learn2pFed flow and the reports."""

from __future__ import annotations

import torch

from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER, summarize

PRIMARY = {"classification": "acc", "regression": "mse"}


def summarize_eval(metrics: dict[str, dict[str, dict[str, torch.Tensor]]]) -> dict[str, float]:
    """Flat aggregates over clients, such as `val/personalized/acc_mean`, `test/global/loss_worst10`,
    from per-client metrics split -> model (personalized, global) -> metric -> [N]."""
    flat = {}
    for split, models in metrics.items():
        for kind, values_of in models.items():
            weights = values_of["n"]
            for metric, values in values_of.items():
                if metric == "n":
                    continue
                for stat, value in summarize(values, weights, HIGHER_IS_BETTER[metric]).items():
                    flat[f"{split}/{kind}/{metric}_{stat}"] = value
    return flat


def selected_index(history: list[dict], task: str) -> int:
    """The evaluation selected on validation: the best personalized mean of the primary metric
    on the clients' validation splits (the earliest of ties); the last one without validation."""
    key = f"val/personalized/{PRIMARY[task]}_mean"
    if key not in history[-1]:
        return len(history) - 1
    values = [h[key] for h in history]
    pick = max if HIGHER_IS_BETTER[PRIMARY[task]] else min
    return values.index(pick(values))


def final_metrics(history: list[dict], task: str) -> dict[str, float]:
    """`final/...` from the last evaluation and `selected/...` from the one selected on
    validation, with their rounds."""
    last, selected = history[-1], history[selected_index(history, task)]
    out = {f"final/{k}": v for k, v in last.items() if k != "round"}
    out.update({f"selected/{k}": v for k, v in selected.items() if k != "round"})
    out["selected/round"] = selected["round"]
    out["final/round"] = last["round"]
    return out


# a run has plateaued when its mean personalized validation metric over the evaluations of the
# last fifth of its rounds is better than over the fifth before by less than half a point of
# accuracy, or 1% of the MSE (window means: one noisy evaluation decides nothing)
PLATEAU_WINDOW = 0.2


PLATEAU_TOLERANCE = {"acc": 0.005, "mse": 0.01}


def plateau(history: list[dict], task: str) -> dict[str, float]:
    """`plateau/gain`, what the mean validation metric gained from the second-to-last fifth of
    the rounds to the last (absolute for accuracy, relative for MSE), and `plateau/reached` (1 or
    0, by PLATEAU_TOLERANCE); nothing when either window holds no evaluation."""
    metric = PRIMARY[task]
    key, total = f"val/personalized/{metric}_mean", history[-1]["round"]
    windows = [[h[key] for h in history if key in h and lo < h["round"] <= hi]
               for lo, hi in ((total * (1 - 2 * PLATEAU_WINDOW), total * (1 - PLATEAU_WINDOW)),
                              (total * (1 - PLATEAU_WINDOW), total))]
    if not all(windows):
        return {}
    before, last = (sum(w) / len(w) for w in windows)
    gain = last - before if HIGHER_IS_BETTER[metric] else (before - last) / before
    return {"plateau/gain": gain, "plateau/reached": float(gain < PLATEAU_TOLERANCE[metric])}


def personalized_is_global(metrics: dict[str, dict[str, dict[str, torch.Tensor]]]) -> bool:
    """Whether every client's personalized model scored as the global one on validation (FedAvg,
    FedDyn, an unsplit CFL): a personalized column that is a global model in disguise."""
    val = metrics["val"]
    if "global" not in val:
        return False
    return all(torch.allclose(val["personalized"][m], val["global"][m], rtol=1e-6, atol=1e-7)
               for m in val["personalized"])
