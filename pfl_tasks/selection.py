"""What a run's numbers are: per-client metrics summarized over clients, the evaluation selected
on validation (never on test), the final and selected metrics, and the plateau verdict. Pure
rules, shared by the training loop, the Learn2pFed flow and the reports (which judge plateaus,
under the configured `verdicts.plateau`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


SELECTION_RULE = (
    "the latest evaluation whose mean validation metric over clients is within one standard error of the "
    "best evaluation's (the standard error of the clients' paired differences): a later evaluation stands "
    "unless an earlier one is better beyond the validation noise")


def within_noise(best: torch.Tensor, other: torch.Tensor, higher_is_better: bool) -> bool:
    """Whether `other`'s per-client values fall short of `best`'s by at most one standard error:
    the mean of the clients' paired shortfalls against their standard error (none with one client)."""
    shortfall = (best.double() - other.double()) * (1 if higher_is_better else -1)
    noise = shortfall.std().item() / math.sqrt(len(shortfall)) if len(shortfall) > 1 else 0.0
    return shortfall.mean().item() <= noise


@dataclass
class Selection:
    """The evaluation (a round, a meta-epoch) selected on validation by `SELECTION_RULE`, offered
    one after another with each client's validation metric: the best mean is tracked, and an
    evaluation within noise of it is selected over the earlier ones, so the rule needs no look
    back (the selection after n offers is the one before or the n-th). `state`: what the caller
    keeps of the selected evaluation. Without validation values, the latest is selected."""

    higher_is_better: bool
    index: int = -1
    best_index: int = -1
    best: torch.Tensor | None = None  # the best evaluation's per-client values
    state: object = None

    def offer(self, index: int, values: torch.Tensor | None, state: object = None) -> bool:
        """Whether evaluation `index`, with per-client validation `values`, is now the selected one."""
        if values is not None:
            values = values.double()
            sign = 1 if self.higher_is_better else -1
            if self.best is None or sign * values.mean() > sign * self.best.mean():
                self.best, self.best_index = values, index
            elif not within_noise(self.best, values, self.higher_is_better):
                return False
        self.index, self.state = index, state
        return True

    def as_dict(self) -> dict:
        return {"higher_is_better": self.higher_is_better, "index": self.index, "best_index": self.best_index,
                "best": self.best, "state": self.state}


def validation_values(metrics: dict[str, dict[str, dict[str, torch.Tensor]]], task: str) -> torch.Tensor | None:
    """Each client's personalized validation value of the task's primary metric, if it has a validation split."""
    return metrics["val"]["personalized"][PRIMARY[task]] if "val" in metrics else None


def final_metrics(history: list[dict], selected: int) -> dict[str, float]:
    """`final/...` from the last evaluation and `selected/...` from `history[selected]`, the one
    selected on validation, with their rounds."""
    last, chosen = history[-1], history[selected]
    out = {f"final/{k}": v for k, v in last.items() if k != "round"}
    out.update({f"selected/{k}": v for k, v in chosen.items() if k != "round"})
    out["selected/round"] = chosen["round"]
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
