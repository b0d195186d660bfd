from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import wilcoxon

from pfl_tasks.stats import holm, mean_ci, paired_pvalue


def _seeds(rng, n_seeds=3, n_clients=20, loc=0.5, scale=0.1):
    return [rng.normal(loc, scale, n_clients) for _ in range(n_seeds)]


# mean_ci

def test_point_is_mean_of_seed_means():
    per_seed = [np.array([1.0, 2.0, 3.0]), np.array([10.0]), np.array([4.0, 6.0])]
    point, _, _ = mean_ci(per_seed)
    assert point == pytest.approx((2.0 + 10.0 + 5.0) / 3)  # not the pooled mean 4.5


def test_single_value_collapses():
    assert mean_ci([np.array([0.7])]) == (0.7, 0.7, 0.7)


def test_constant_seed_collapses():
    point, low, high = mean_ci([np.full(25, 0.3)])
    assert (point, low, high) == pytest.approx((0.3, 0.3, 0.3))


def test_ci_contains_point_and_scales_with_spread():
    rng = np.random.default_rng(1)
    per_seed = _seeds(rng)
    point, low, high = mean_ci(per_seed)
    assert low < point < high
    # same resampling indices, so the interval around the point scales exactly
    wide = [point + 3 * (x - point) for x in per_seed]
    p2, low2, high2 = mean_ci(wide)
    assert p2 == pytest.approx(point)
    assert high2 - low2 == pytest.approx(3 * (high - low))


def test_higher_level_is_wider():
    per_seed = _seeds(np.random.default_rng(2))
    _, lo90, hi90 = mean_ci(per_seed, level=0.90)
    _, lo99, hi99 = mean_ci(per_seed, level=0.99)
    assert lo99 <= lo90 and hi90 <= hi99


def test_coverage_is_near_95_percent_and_the_width_near_normal_theory():
    rng = np.random.default_rng(3)
    hits, widths = 0, []
    for rep in range(200):
        _, low, high = mean_ci(_seeds(rng, n_clients=30), resamples=500, seed=rep)
        hits += low <= 0.5 <= high
        widths.append(high - low)
    assert 180 <= hits <= 198  # 95% of 200 is 190, binomial sd 3.1; 199-200 would be too wide
    # the grand mean of 3 x 30 draws of sd 0.1: a 95% interval 2 x 1.96 x 0.1 / sqrt(90) wide; resampling
    # 3 seeds adds their (here null) spread's noise: measured 1.23x. A far too wide interval fails
    assert 1.0 <= np.mean(widths) / (2 * 1.96 * 0.1 / np.sqrt(90)) <= 1.5


def test_deterministic():
    per_seed = _seeds(np.random.default_rng(4))
    assert mean_ci(per_seed, seed=7) == mean_ci(per_seed, seed=7)
    assert mean_ci(per_seed, seed=7) != mean_ci(per_seed, seed=8)


@pytest.mark.parametrize("bad", [[np.array([0.1, np.nan])], [], [np.array([])]])
def test_mean_ci_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        mean_ci(bad)


# paired_pvalue

def test_identical_is_one():
    a = _seeds(np.random.default_rng(5))
    assert paired_pvalue(a, [x.copy() for x in a]) == 1.0


def test_constant_shift_is_significant():
    a = _seeds(np.random.default_rng(6))
    assert paired_pvalue([x + 0.1 for x in a], a) < 1e-3


def test_symmetric():
    rng = np.random.default_rng(7)
    a, b = _seeds(rng), _seeds(rng)
    assert paired_pvalue(a, b) == pytest.approx(paired_pvalue(b, a))


@pytest.mark.parametrize("n_clients", [3, 30])  # permutation (n <= 13) and asymptotic
def test_pools_pairs_over_seeds(n_clients):
    rng = np.random.default_rng(8)
    a, b = _seeds(rng, n_clients=n_clients), _seeds(rng, n_clients=n_clients)
    b[0][0] = a[0][0]  # a zero difference
    diffs = np.concatenate(a) - np.concatenate(b)
    expected = wilcoxon(diffs, zero_method="zsplit", method="auto").pvalue
    assert paired_pvalue(a, b) == pytest.approx(expected)


def test_mismatch_names_seed():
    a = [np.zeros(3), np.zeros(4)]
    with pytest.raises(ValueError, match="seed 1"):
        paired_pvalue(a, [np.zeros(3), np.zeros(5)])


# holm

def test_holm_hand_computed():
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert list(adjusted) == ["a", "b", "c"]
    # sorted a, c, b: 3*0.01, max(0.03, 2*0.03), max(0.06, 1*0.04)
    assert adjusted == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})


def test_holm_monotone_and_capped():
    rng = np.random.default_rng(9)
    raw = {f"m{i}": float(p) for i, p in enumerate(rng.uniform(0, 0.6, 8))}
    adjusted = holm(raw)
    order = sorted(raw, key=raw.get)
    values = [adjusted[m] for m in order]
    assert values == sorted(values)
    assert all(adjusted[m] >= raw[m] for m in raw)
    assert max(values) <= 1.0
    assert holm({"a": 0.5, "b": 0.9}) == {"a": 1.0, "b": 1.0}


def test_holm_empty():
    assert holm({}) == {}


def test_the_sample_weighted_statistic_weights_clients_by_their_samples_and_its_test_pairs_them():
    from pfl_tasks.stats import paired_weighted_pvalue

    rng = np.random.default_rng(1)
    values, sizes = [rng.uniform(0, 1, 40), rng.uniform(0, 1, 30)], [rng.integers(5, 500, 40), rng.integers(5, 500, 30)]
    point, low, high = mean_ci(values, weights=sizes)
    expected = np.mean([(w * x).sum() / w.sum() for x, w in zip(values, sizes)])
    assert point == pytest.approx(expected) and low < point < high
    assert mean_ci(values, weights=[np.ones(40), np.ones(30)]) == mean_ci(values)  # equal weights: the client mean
    better = [x + 0.05 for x in values]
    assert paired_weighted_pvalue(better, values, sizes) < 0.01  # a consistent gain, however noisy the clients
    assert paired_weighted_pvalue(values, values, sizes) == 1.0
    # only the large clients gain: decisive sample-weighted
    big = [np.where(w > 250, x + 0.2, x - 0.02) for x, w in zip(values, sizes)]
    assert paired_weighted_pvalue(big, values, sizes) < 0.01
    with pytest.raises(ValueError, match="every client's must be positive"):
        mean_ci(values, weights=[np.zeros(40), np.ones(30)])
