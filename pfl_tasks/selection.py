"""What a run's numbers are: per-client metrics summarized over clients, the evaluation selected
on validation (never on test), the final and selected metrics, and the plateau verdict. Pure
rules, shared by the training loop, the Learn2pFed flow and the reports (which judge plateaus,
under the configured `verdicts.plateau`)."""

from __future__ import annotations

import torch

from pfl_tasks.config import PlateauRule
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


SPREAD = ("std", "min", "max")  # of `summarize`'s statistics, the ones MLflow gets only at the end


def tracked_series(record: dict) -> dict:
    """A history record as MLflow's series get it at each evaluation: without the spread
    (std, min, max) of its per-client summaries, which MLflow holds for the last and the
    selected evaluation (`final_metrics`) and the run's checkpoint for every one. MLflow's store
    spends about 50 us of CPU a record, and a standard-protocol round can take 25 ms."""
    return {k: v for k, v in record.items() if not (k.count("/") == 2 and k.rsplit("_", 1)[-1] in SPREAD)}


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


def plateau(curve: dict[int, float], metric: str, rule: PlateauRule) -> tuple[float, bool] | None:
    """(gain, plateaued) of a run's mean personalized validation `metric` by round (`curve`):
    what its mean over the last `rule.window` of the rounds gained on the window before (absolute
    for accuracy; relative for MSE, and from an MSE of 0 the MSE lost), and whether that is below
    the rule's tolerance. None when either window holds no evaluation."""
    total, w = max(curve), rule.window
    edges = [round(total * (1 - k * w), 6) for k in (2, 1, 0)]  # rounded: 1 - 2 * 0.4 is not 0.2 in floats
    windows = [[v for r, v in curve.items() if lo < r <= hi] for lo, hi in zip(edges, edges[1:])]
    if not all(windows):
        return None
    before, last = (sum(values) / len(values) for values in windows)
    if HIGHER_IS_BETTER[metric]:
        gain = last - before
    else:
        gain = (before - last) / before if before else -last
    return gain, gain < getattr(rule, metric)


def personalized_is_global(metrics: dict[str, dict[str, dict[str, torch.Tensor]]]) -> bool:
    """Whether every client's personalized model scored as the global one on validation (FedAvg,
    FedDyn, an unsplit CFL): a personalized column that is a global model in disguise."""
    val = metrics["val"]
    if "global" not in val:
        return False
    return all(torch.allclose(val["personalized"][m], val["global"][m], rtol=1e-6, atol=1e-7)
               for m in val["personalized"])
