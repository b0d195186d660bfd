"""Statistics for the comparison reports: a hierarchical bootstrap CI over seeds and clients
(`mean_ci`), a two-sided Wilcoxon signed-rank test on paired per-client differences
(`paired_pvalue`) and Holm–Bonferroni adjustment over the methods compared with the best
(`holm`).

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


def mean_ci(per_seed: list[np.ndarray], level: float = 0.95, resamples: int = 2000,
            seed: int = 0) -> tuple[float, float, float]:
    """(point, low, high): the mean over seeds of client means, with a percentile interval
    of a two-level bootstrap (seeds with replacement, then each drawn seed's clients)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    seeds = _checked(per_seed)
    point = float(np.mean([x.mean() for x in seeds]))
    rng = np.random.default_rng(seed)
    n = len(seeds)
    picked = rng.integers(0, n, size=(resamples, n))  # seed drawn in each (resample, slot)
    slot_means = np.empty((resamples, n))
    for s, x in enumerate(seeds):
        hit = picked == s
        # every draw of a seed resamples its clients independently
        clients = rng.integers(0, x.size, size=(int(hit.sum()), x.size))
        slot_means[hit] = x[clients].mean(axis=1)
    stats = slot_means.mean(axis=1)
    low, high = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
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


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm–Bonferroni step-down adjusted p-values, in the input's key order."""
    names = sorted(pvalues, key=pvalues.__getitem__)
    m = len(names)
    adjusted, running = {}, 0.0
    for rank, name in enumerate(names):
        running = max(running, min(1.0, (m - rank) * pvalues[name]))
        adjusted[name] = running
    return {name: adjusted[name] for name in pvalues}
