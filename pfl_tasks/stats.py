"""Statistics for the comparison reports: a hierarchical bootstrap CI over seeds and clients
(`mean_ci`) of the client mean or of the sample-weighted mean, a two-sided Wilcoxon
signed-rank test on paired per-client differences (`paired_pvalue`), its counterpart for the
sample-weighted mean (`paired_weighted_pvalue`, a paired bootstrap) and Holm–Bonferroni
adjustment over the methods compared with the best (`holm`).

A method's result is `list[np.ndarray]`: one 1-D array per seed of that seed's per-client
values of a metric. Seeds are different client partitions; within a seed, two methods'
arrays are aligned client by client, so they are paired.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import wilcoxon

TEST_NAME = (
    "two-sided Wilcoxon signed-rank test on per-client differences pooled over seeds, "
    "Holm–Bonferroni over the methods compared with the best"
)
WEIGHTED_TEST_NAME = (
    "two-sided paired two-level bootstrap (seeds, then clients) of the sample-weighted difference, "
    "Holm–Bonferroni over the methods compared with the best"
)


def _checked(per_seed: list[np.ndarray]) -> list[np.ndarray]:
    seeds = [np.asarray(x, dtype=float) for x in per_seed]
    if not seeds:
        raise ValueError("no seeds")
    for i, x in enumerate(seeds):
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"seed {i}: expected a non-empty 1-D array, got shape {x.shape}")
        if np.isnan(x).any():
            raise ValueError(f"seed {i}: NaN in per-client values")
    return seeds


def _weighted_means(x: np.ndarray, w: np.ndarray | None, clients: np.ndarray) -> np.ndarray:
    """Per row of client indices, the (weighted) mean of x over those clients."""
    if w is None:
        return x[clients].mean(axis=1)
    return (w[clients] * x[clients]).sum(axis=1) / w[clients].sum(axis=1)


def _bootstrap(seeds: list[np.ndarray], weights: list[np.ndarray] | None, resamples: int,
               seed: int) -> np.ndarray:
    """`resamples` draws of the mean over seeds of each seed's (weighted) client mean, seeds
    drawn with replacement and each drawn seed's clients too."""
    rng = np.random.default_rng(seed)
    n = len(seeds)
    picked = rng.integers(0, n, size=(resamples, n))  # seed drawn in each (resample, slot)
    slot_means = np.empty((resamples, n))
    for s, x in enumerate(seeds):
        hit = picked == s
        # every draw of a seed resamples its clients independently
        clients = rng.integers(0, x.size, size=(int(hit.sum()), x.size))
        slot_means[hit] = _weighted_means(x, None if weights is None else weights[s], clients)
    return slot_means.mean(axis=1)


def _checked_weights(weights: list[np.ndarray] | None, seeds: list[np.ndarray]) -> list[np.ndarray] | None:
    if weights is None:
        return None
    ws = [np.asarray(w, dtype=float) for w in weights]
    if len(ws) != len(seeds) or any(w.shape != x.shape for w, x in zip(ws, seeds)):
        raise ValueError("weights: one array per seed, one weight per client")
    if any((w <= 0).any() for w in ws):
        raise ValueError("weights: every client's must be positive")
    return ws


def mean_ci(per_seed: list[np.ndarray], level: float = 0.95, resamples: int = 2000,
            seed: int = 0, weights: list[np.ndarray] | None = None) -> tuple[float, float, float]:
    """(point, low, high): the mean over seeds of client means (with `weights`, per client: of
    sample-weighted means, sum(w x) / sum(w)), with a percentile interval of a two-level
    bootstrap (seeds with replacement, then each drawn seed's clients)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    seeds = _checked(per_seed)
    ws = _checked_weights(weights, seeds)
    point = float(np.mean([x.mean() if ws is None else (ws[i] * x).sum() / ws[i].sum()
                           for i, x in enumerate(seeds)]))
    low, high = np.quantile(_bootstrap(seeds, ws, resamples, seed), [(1 - level) / 2, (1 + level) / 2])
    return point, float(low), float(high)


def paired_pvalue(best: list[np.ndarray], other: list[np.ndarray]) -> float:
    """Two-sided Wilcoxon signed-rank p-value of best − other, each (seed, client) one pair."""
    a, b = _checked(best), _checked(other)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} seeds vs {len(b)} seeds")
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise ValueError(f"seed {i}: {x.shape[0]} clients vs {y.shape[0]} clients")
    diffs = np.concatenate(a) - np.concatenate(b)
    if not diffs.any():
        return 1.0
    return float(wilcoxon(diffs, zero_method="zsplit", method="auto").pvalue)


def paired_weighted_pvalue(best: list[np.ndarray], other: list[np.ndarray], weights: list[np.ndarray],
                           resamples: int = 2000, seed: int = 0) -> float:
    """Two-sided p-value that the sample-weighted mean of best − other is 0: the paired
    two-level bootstrap of that difference, 2 min(P(<= 0), P(>= 0)), at most 1."""
    a, b = _checked(best), _checked(other)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise ValueError("best and other: the same seeds and clients")
    diffs = [x - y for x, y in zip(a, b)]
    if not any(d.any() for d in diffs):
        return 1.0
    stats = _bootstrap(diffs, _checked_weights(weights, diffs), resamples, seed)
    return float(min(1.0, 2 * min((stats <= 0).mean(), (stats >= 0).mean())))


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm–Bonferroni step-down adjusted p-values, in the input's key order."""
    names = sorted(pvalues, key=pvalues.__getitem__)
    m = len(names)
    adjusted, running = {}, 0.0
    for rank, name in enumerate(names):
        running = max(running, min(1.0, (m - rank) * pvalues[name]))
        adjusted[name] = running
    return {name: adjusted[name] for name in pvalues}
