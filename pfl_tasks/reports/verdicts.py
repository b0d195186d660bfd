"""The verdicts and their statistics: ranks, paired tests against the best, the top group, flips between statistics."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pfl_tasks.config import VerdictConfig
from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER
from pfl_tasks.reports.results import ALL_VALIDATION, MethodResult, method_result
from pfl_tasks.stats import holm, paired_pvalue, paired_weighted_pvalue


def ordered(results: list[MethodResult], weighted: bool = False) -> list[MethodResult]:
    """The ranked methods best first by one statistic's point estimate (those with it)."""
    sign = -1 if results and HIGHER_IS_BETTER[results[0].metric] else 1
    return sorted((r for r in results if r.ranked and r.score(weighted) is not None),
                  key=lambda r: (sign * r.score(weighted)[0], r.method))


def _p_values(reference: MethodResult, others: list[MethodResult], weighted: bool) -> dict[str, float]:
    """Holm-adjusted p-values of `reference` against each of `others`, over their common seeds."""
    raw = {}
    for r in others:
        common = sorted(s for s in set(reference.clients) & set(r.clients)
                        if reference.data_hashes[s] == r.data_hashes[s])
        if not common:
            continue
        a, b = [reference.clients[s] for s in common], [r.clients[s] for s in common]
        raw[r.method] = (paired_weighted_pvalue(a, b, [reference.sizes[s] for s in common]) if weighted
                         else paired_pvalue(a, b))
    return holm(raw)


def summarize(client, newest: dict[str, dict[int, object]], metric: str,
              rule: VerdictConfig = VerdictConfig()) -> list[MethodResult]:
    """Every method, the ranked ones best first (by the client mean's point estimate), then the
    unranked; each ranked method but the best carries its Holm-adjusted p-value against the
    best, and likewise against the best by the sample-weighted statistic; verdicts by `rule`."""
    results = with_p_values([method_result(client, m, by_seed, metric, rule) for m, by_seed in newest.items()])
    by_method = {r.method: r for r in results}
    unranked = sorted((r for r in results if not r.ranked), key=lambda r: r.method)
    return [by_method[r.method] for r in ordered(results)] + unranked


def with_p_values(results: list[MethodResult]) -> list[MethodResult]:
    """`results`, each ranked method but the best with its Holm-adjusted p-values against the
    best by either statistic."""
    for weighted, key in ((False, "p_vs_best"), (True, "p_vs_best_weighted")):
        ranked = ordered(results, weighted)
        if len(ranked) > 1:
            adjusted = _p_values(ranked[0], ranked[1:], weighted)
            results = [replace(r, **{key: adjusted[r.method]}) if r.method in adjusted else r for r in results]
    return results


REFERENCE = "fedavg"  # the baseline whose global model every verdict is read against


@dataclass(frozen=True)
class Verdict:
    """A method's verdict by one statistic: its side of FedAvg's global model by a paired test
    ('better' or 'worse' where the Holm-adjusted p-value is below alpha, else 'level'; '' without
    a FedAvg row), that test's p-value and the point estimate's gap, and whether it is in the top
    group (not significantly different from the best)."""

    side: str
    p: float | None
    gap: float | None
    top: bool

    def said(self) -> str:
        relation = {"better": "significantly better than", "worse": "significantly worse than"}.get(
            self.side, "not significantly different from")
        p = "p < 0.001" if self.p < 0.001 else f"p = {self.p:.3g}"  # a bootstrap's 2,000 draws resolve no less
        return f"{relation} FedAvg ({self.gap:+.4f}, {p})"


def verdicts(results: list[MethodResult], weighted: bool) -> dict[str, Verdict]:
    """method -> its `Verdict` by one statistic (the ranked methods)."""
    ranked = ordered(results, weighted)
    if not ranked:
        return {}
    reference = next((r for r in ranked if r.method == REFERENCE), None)
    others = [r for r in ranked if r is not reference]
    p_values = _p_values(reference, others, weighted) if reference is not None else {}
    higher = HIGHER_IS_BETTER[ranked[0].metric]
    out = {}
    for r in ranked:
        side, gap, p = "", None, p_values.get(r.method)
        if p is not None:
            gap = r.score(weighted)[0] - reference.score(weighted)[0]
            side = "level" if p >= r.rule.alpha else "better" if (gap > 0) == higher else "worse"
        out[r.method] = Verdict(side, p, gap, r is ranked[0] or r.indistinguishable(weighted))
    return out


def flips(results: list[MethodResult]) -> dict[str, str]:
    """method -> a sentence, for each method whose verdict differs between the client mean and
    the sample-weighted statistic by their tests: one calls it significantly better (or worse) than
    FedAvg's global model and the other does not, or says the opposite; or it is in the top group
    by one test and out of it by the other. A point estimate's side alone flags nothing."""
    by_mean, by_weight = verdicts(results, False), verdicts(results, True)
    out = {}
    for method in by_mean.keys() & by_weight.keys():
        mean, weight = by_mean[method], by_weight[method]
        top, w_top = mean.top, weight.top
        said = []
        if mean.side and weight.side and mean.side != weight.side:
            said.append(f"on the client mean it is {mean.said()}, sample-weighted {weight.said()}")
        if top != w_top:
            said.append(f"it is {'in' if top else 'out of'} the top group on the client mean but "
                        f"{'in' if w_top else 'out of'} it sample-weighted")
        if said:
            out[method] = "; ".join(said)
    return dict(sorted(out.items()))


def winner_on_validation(results: list[MethodResult]) -> MethodResult | None:
    """The ranked method with the best validation metric at its selected rounds: a sweep's
    choice, made without the test split; among the methods scored on every validation row."""
    scored = [r for r in results if r.ranked and r.val is not None and r.validation_rows == ALL_VALIDATION]
    if not scored:
        return None
    pick = max if HIGHER_IS_BETTER[scored[0].metric] else min
    return pick(scored, key=lambda r: r.val)


def best_per_method(rankings: dict[str, list[MethodResult]], method_of: dict[str, str]) -> dict[str, tuple[str, MethodResult]]:
    """method -> (experiment, variant) best on validation among its variants (`method_of`:
    variant -> method) over every experiment of a sweep: each method tuned, never on test."""
    candidates: dict[str, list[tuple[str, MethodResult]]] = {}
    for experiment, results in rankings.items():
        for r in results:
            if r.ranked and r.val is not None:
                candidates.setdefault(method_of.get(r.method, r.method), []).append((experiment, r))
    out = {}
    for method, found in sorted(candidates.items()):
        pick = max if HIGHER_IS_BETTER[found[0][1].metric] else min
        out[method] = pick(found, key=lambda pair: pair[1].val)
    return out


def top_group(results: list[MethodResult], weighted: bool = False) -> list[MethodResult]:
    """The best ranked method by one statistic and every method ≈ to it, best first."""
    ranked = ordered(results, weighted)
    return ranked[:1] + [r for r in ranked[1:] if r.indistinguishable(weighted)]
