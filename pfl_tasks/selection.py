"""What a run's numbers are: per-client metrics summarized over clients, the evaluation selected
on validation (never on test), the final and selected metrics, and the plateau verdict. Pure
rules, shared by the training loop, the Learn2pFed flow and the reports (which judge plateaus,
under the configured `verdicts.plateau`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pfl_tasks.config import PlateauRule
from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER, NOISE_ONLY, summarize
from pfl_tasks.errors import CheckpointError

PRIMARY = {"classification": "acc", "regression": "mse"}


def summarize_eval(metrics: dict[str, dict[str, dict[str, torch.Tensor]]]) -> dict[str, float]:
    """Flat aggregates over clients, such as `val/personalized/acc_mean`, `test/global/loss_worst10`,
    from per-client metrics split -> model (personalized, global) -> metric -> [N]."""
    flat = {}
    for split, models in metrics.items():
        for kind, values_of in models.items():
            weights = values_of["n"]
            for metric, values in values_of.items():
                if metric == "n" or metric in NOISE_ONLY:
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
    "the latest evaluation whose mean validation metric is not worse than the best evaluation's beyond one "
    "standard error of their difference on the same validation rows (paired)")


@dataclass
class Score:
    """An evaluation's validation score: the personalized mean over clients of the task's
    primary metric, its standard error from the rows' sampling noise (as if alone: what MLflow
    logs as `..._se`), and, to pair it with another evaluation on the same rows, each row's
    own metric (client after client) and each client's row count."""

    mean: float
    se: float
    rows: torch.Tensor | None = None
    counts: torch.Tensor | None = None


def validation_score(metrics: dict[str, dict[str, dict[str, torch.Tensor]]], task: str,
                     rows: torch.Tensor | None = None) -> Score | None:
    """The `Score` of per-client metrics (with their per-row metric `rows`, if given): a row's
    accuracy is a Bernoulli draw, a row's squared error spreads as `mse_sq` says. None without a
    validation split."""
    if "val" not in metrics:
        return None
    val = metrics["val"]["personalized"]
    n, value = val["n"].double(), val[PRIMARY[task]].double()
    spread = value * (1 - value) if task == "classification" else val["mse_sq"].double() - value**2
    se = math.sqrt((spread.clamp(min=0) / n.clamp(min=1)).sum().item()) / len(value)
    return Score(value.mean().item(), se, rows, None if rows is None else val["n"].round().long())


def paired_se(a: Score, b: Score) -> float:
    """The standard error of the difference of two scores on the same validation rows: each
    client's mean row difference has the spread of its rows' differences over its row count, and
    the score is the mean over clients. Rows two models get equally right cost no noise."""
    diff = a.rows.double() - b.rows.double()
    n = a.counts.double()
    owner = torch.repeat_interleave(torch.arange(len(n)), a.counts)
    mean = torch.zeros_like(n).index_add_(0, owner, diff) / n.clamp(min=1)
    square = torch.zeros_like(n).index_add_(0, owner, diff * diff) / n.clamp(min=1)
    return math.sqrt(((square - mean**2).clamp(min=0) / n.clamp(min=1)).sum().item()) / len(n)


def paired_se_over(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> float | None:
    """The standard error of the mean difference of two results' per-client metrics, paired over
    the seeds (keys) and clients both have; None with fewer than two pairs."""
    diff = np.concatenate([a[seed] - b[seed] for seed in sorted(a.keys() & b.keys())] or [np.empty(0)])
    return None if len(diff) < 2 else float(np.std(diff, ddof=1) / math.sqrt(len(diff)))


def within_noise(shortfall: float, se: float) -> bool:
    """Whether falling short of the best by `shortfall` (positive: worse) is within the
    standard error `se` of the difference."""
    return shortfall <= se


@dataclass
class Selection:
    """The evaluation (a round, a meta-epoch) selected on validation by `SELECTION_RULE`, offered
    one after another with its `Score`: the best score is kept, rows and all, and an evaluation
    within noise of it is selected over the earlier ones, so the rule needs no look back (the
    selection after n offers is the one before or the n-th). `state`: what the caller keeps of
    the selected evaluation. Without a validation score, the latest is selected."""

    higher_is_better: bool
    index: int = -1
    best_index: int = -1
    best: Score | None = None
    state: object = None

    def offer(self, index: int, score: Score | None, state: object = None) -> bool:
        """Whether evaluation `index`, with validation `score`, is now the selected one."""
        if score is not None:
            sign = 1 if self.higher_is_better else -1
            if self.best is None or sign * score.mean > sign * self.best.mean:
                self.best, self.best_index = score, index
            elif not within_noise(sign * (self.best.mean - score.mean), paired_se(self.best, score)):
                return False
        self.index, self.state = index, state
        return True

    def as_dict(self) -> dict:
        return {"higher_is_better": self.higher_is_better, "index": self.index, "best_index": self.best_index,
                "best": None if self.best is None else vars(self.best), "state": self.state}

    @classmethod
    def from_dict(cls, saved: dict) -> Selection:
        """The selection `as_dict` saved; refused, in one line, from before the paired rule."""
        best = saved["best"]
        if best is not None and not isinstance(best, dict):
            raise CheckpointError("written before the paired selection rule; rerun with --on-config-change restart")
        return cls(**{**saved, "best": None if best is None else Score(**best)})


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
