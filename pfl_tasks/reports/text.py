"""A report's text: its verdict in words, the ranked tables in markdown, the rules and notes under them."""

from __future__ import annotations

from pfl_tasks.config import VerdictConfig
from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER
from pfl_tasks.reports.results import ALL_VALIDATION, Interval, MethodResult
from pfl_tasks.reports.verdicts import flips, ordered, top_group, verdicts, winner_on_validation
from pfl_tasks.selection import SELECTION_RULE
from pfl_tasks.stats import TEST_NAME, WEIGHTED_TEST_NAME


def interval(value: Interval | None) -> str:
    if value is None:
        return "–"
    point, low, high = value
    return f"{point:.4f} [{low:.4f}, {high:.4f}]"


def marks(result: MethodResult, chosen: bool, flipped: bool = False, weighted: bool = False) -> str:
    """≈: not significantly different from the best (by the statistic `weighted` says); †: its
    personalized model is the global one; ✓: `chosen`, the best on validation
    (`winner_on_validation`); ⚑: `flipped`, its verdict differs between the statistics (`flips`)."""
    return (("≈" if result.indistinguishable(weighted) else "") + ("†" if result.global_only else "")
            + ("✓" if chosen else "") + ("⚑" if flipped else ""))


def unranked_note(result: MethodResult) -> str:
    """Why a method is not ranked."""
    reasons = []
    if result.diverged:
        reasons.append("diverged at " + ", ".join(f"round {at} (seed {seed})" for seed, at in result.diverged))
    if result.too_few_rounds:
        reasons.append("too few rounds aggregated: " + ", ".join(
            f"{done} of {rounds} (seed {seed})" for seed, done, rounds in result.too_few_rounds))
    return "; ".join(reasons) or "no per-client results"


def _count(value: float | None, unit: float, suffix: str) -> str:
    return "–" if value is None else f"{value / unit:.3g}{suffix}"


def _aggregated(result: MethodResult) -> str:
    return ", ".join(f"{done}/{rounds}" for done, rounds in result.aggregated.values()) or "–"


def _plateau(result: MethodResult) -> str:
    if not result.plateaued:
        return "–"
    return f"{sum(result.plateaued)}/{len(result.plateaued)}"


def best_line(results: list[MethodResult], weighted: bool = False) -> str:
    """What a console line may claim of a ranking (by the client mean, or `weighted`): a best
    method only when it is significantly better than every other, else the top group (it and
    every method marked ≈); and, when not every run plateaued on validation, that the ranking
    may be premature."""
    ranked = ordered(results, weighted)
    if not ranked:
        return "none ranked"
    group = top_group(results, weighted)
    named = ", ".join(f"{r.method} ({r.score(weighted)[0]:.4f})" for r in group)
    line = f"best {named}" if len(group) == 1 else f"top group (not significantly different): {named}"
    verdicts = [reached for r in ranked for reached in r.plateaued]
    if not all(verdicts):
        line += f" ({sum(verdicts)} of {len(verdicts)} runs plateaued on validation: the ranking may be premature)"
    return line


def protocol_lines(rule: VerdictConfig) -> list[str]:
    """How a report's numbers and marks are made, a short sentence each."""
    return [
        "Cell: each client's test accuracy (higher is better) or MSE (lower is better) of its personalized model, "
        "mean over clients and seeds; 95% CI: two-level bootstrap (seeds, then clients). "
        f"Round: {SELECTION_RULE}. "
        f"≈: not significantly different from the best, rank 1 ({TEST_NAME}, α = {rule.alpha}). "
        "In the tables for a paper the best is in bold. "
        "†: the \"personalized\" model is the global model. "
        "✓: the best on validation, what a sweep selects. "
        f"Diverged runs, and runs that aggregated fewer than {rule.min_aggregated:.0%} of their rounds, are listed, "
        "not ranked.",
        f"Verdict rules (`verdicts` in the params file): α = {rule.alpha}, min_aggregated = {rule.min_aggregated}, "
        f"plateau: window {rule.plateau.window} of the rounds, gain below {rule.plateau.acc} accuracy "
        f"or {rule.plateau.mse:.0%} of the MSE.",
        RUNS_COUNTED,
    ]


METRIC_WORDS = {"acc": "test accuracy", "mse": "test MSE"}


BASELINES = ("fedavg", "local")  # the budgets are chosen so that these plateau (docs/protocol.md)


def verdict_lines(results: list[MethodResult]) -> list[str]:
    """A report's opening, in words: what its ranking concludes (the best, or the top group
    and that no method beats it), where a rank and the top group disagree, and what would make
    the ranking premature (a baseline's budget that did not plateau, runs that did not)."""
    ranked = ordered(results)
    if not ranked:
        return ["**Verdict:** no method is ranked; the runs below diverged or aggregated too few rounds."]
    best, group = ranked[0], top_group(results)
    statistic = f"the client mean of the personalized {METRIC_WORDS[best.metric]}"
    if len(group) == 1:
        lines = [f"**Verdict:** {best.method} is best by {statistic}, significantly better than every other "
                 "ranked method."]
    else:
        lines = [f"**Verdict:** no method is significantly better than the others by {statistic}. "
                 f"The top group, not significantly different from {best.method} (rank 1): "
                 f"{', '.join(r.method for r in group[1:])}."]
    rank = {r.method: i for i, r in enumerate(ranked, 1)}
    worse = [r for r in ranked[1:] if r.p_vs_best is not None and not r.indistinguishable()]
    untested = [r.method for r in ranked[1:] if r.p_vs_best is None]
    if worse:
        lines[0] += (f" The other {len(worse)} ranked methods are" if len(worse) > 1 else " The other ranked method is"
                     ) + f" significantly worse than {best.method}."
    if untested:
        lines[0] += f" Not tested against it (no partition in common): {', '.join(untested)}."
    outranking = [(r, [g for g in group if rank[g.method] > rank[r.method]]) for r in worse]
    for r, inside in (pair for pair in outranking if pair[1]):
        lines.append(f"{r.method} (rank {rank[r.method]}, p = {r.p_vs_best:.2g}) is outside the top group, while "
                     f"{', '.join(f'{g.method} ({rank[g.method]})' for g in inside)} "
                     f"{'are' if len(inside) > 1 else 'is'} inside.")
    if any(inside for _, inside in outranking):
        lines.append(f"Ranks order the means; the group is a paired test of each client's difference from "
                     f"{best.method}, which a consistent deficit fails.")
    by_method = {r.method: r for r in ranked}
    for name in BASELINES:
        seeds = by_method[name].plateaued if name in by_method else []
        if seeds and not all(seeds):
            lines.append(f"⚠ The protocol chooses budgets on which {name} plateaus, but it plateaued on "
                         f"{sum(seeds)} of {len(seeds)} seeds: its budget is short, and more rounds may change "
                         "the ranking.")
    verdicts = [reached for r in ranked for reached in r.plateaued]
    if not all(verdicts):
        lines.append(f"⚠ {sum(verdicts)} of {len(verdicts)} ranked runs plateaued on validation: the ranking "
                     "may be premature.")
    return lines


RUNS_COUNTED = (  # `configured_runs`, then `collect`
    "Runs: per configured method and seed, the MLflow run that its metrics file in this workspace names "
    "(metrics/<experiment>/<method>/seed-<seed>.json, as `dvc repro` or `dvc exp apply` left it). Where there is "
    "no such file, or the store does not hold that run (another clone's), the newest run of that method and seed "
    "that finished or diverged. A named run that was deleted, or a finished method without any run, stops the "
    "report.")


STATISTICS_NOTE = (
    "Two statistics of the same runs at the same validation-selected rounds. The table above ranks by the client "
    "mean: each client's accuracy counts once, as each client is a user of its own personalized model, which "
    "is what personalization promises. Published tables (PFLlib's among them) weight clients by their test "
    "samples (all correct over all test samples), which lets the largest clients decide: under label skew "
    "they hold few labels and do well locally, while small clients do not. Neither is wrong, so both are "
    "shown, and a method whose verdict changes between them is marked ⚑."
)


def markdown(experiment: str, metric: str, results: list[MethodResult], figures: dict[str, str],
             tuning: dict | None = None, downstream: dict[str, str] | None = None,
             rule: VerdictConfig = VerdictConfig()) -> str:
    window = f"{rule.plateau.window:.0%}"
    tolerance = f"{rule.plateau.acc} accuracy" if metric == "acc" else f"{rule.plateau.mse:.0%} of the MSE"
    lines = [
        f"# {experiment}: comparison",
        "",
        *verdict_lines(results),
        "",
        *protocol_lines(rule),
        "⚑: the verdict differs between the client mean and the sample-weighted statistic, each by its own paired "
        "test, Holm-adjusted. "
        "Either one statistic finds it significantly better or worse than FedAvg's global model and the other does "
        "not, or it is in one statistic's top group only. "
        "A difference of point estimates alone flags nothing.",
        f"Plateaued: seeds whose mean validation metric over the last {window} of the rounds gained less than "
        f"{tolerance} on the {window} before. Rounds aggregated: per seed, the rounds in which a sampled client "
        "reported, of the rounds run. Compute: samples × forward-backward passes over all clients, the whole run. "
        "Beside it, one evaluation's personalization, and the tuning's: every grid point the method was tuned over. "
        "Communication: bytes up and down, the whole run.",
        "",
        "| rank | method | seeds | validation | personalized, test (95% CI) | global, test (95% CI) "
        "| worst 10% of clients | selected rounds | rounds aggregated | plateaued | compute | + per evaluation "
        "| + tuning | communication |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    chosen, flipped = winner_on_validation(results), flips(results)
    tuning_cost = {m: e.get("grad_samples") for m, e in (tuning or {}).get("methods", {}).items()}
    for i, r in enumerate((r for r in results if r.ranked), 1):
        lines.append(
            f"| {i} | {r.method}{marks(r, r is chosen, r.method in flipped)} | {len(r.seeds)} "
            f"| {'–' if r.val is None else f'{r.val:.4f}'} | {interval(r.personalized)} | {interval(r.global_)} "
            f"| {'–' if r.worst10 is None else f'{r.worst10:.4f}'} | {', '.join(map(str, r.selected_rounds)) or '–'} "
            f"| {_aggregated(r)} | {_plateau(r)} | {_count(r.grad_samples, 1e6, 'M')} "
            f"| {_count(r.eval_grad_samples, 1e6, 'M')} | {_count(tuning_cost.get(r.method), 1e6, 'M')} "
            f"| {_count(r.comm_bytes, 2**20, ' MiB')} |"
        )
    ranked = [r for r in results if r.ranked]
    if chosen is not None and chosen is not ranked[0]:
        lines += ["", f"✓ {chosen.method}, ranked {ranked.index(chosen) + 1} here, is the best on validation: "
                      "what choosing among these rows (a sweep's variants, a method's settings) picks. The ranks "
                      "order the rows by test, to compare methods each chosen on validation; choosing the rank-1 "
                      "row among variants would be choosing on test."]
    for r in results:
        if r.validation_rows != ALL_VALIDATION:
            lines += ["", f"{r.method}'s validation number is on {r.validation_rows}, not every row the others' "
                          "are on: it is not compared for ✓."]
    shown = {r.method for r in results}
    for method, upstream in (downstream or {}).items():
        if method not in shown:
            continue
        lines += ["", f"{method} is trained on the frozen body of {upstream}'s trained runs, seed for seed: "
                      f"{upstream}'s compute and communication (its row, and its tuning) come before its own, "
                      "whose passes are over the linear head alone."]
    for r in results:
        if r.initial_val is None or r.val is None:
            continue
        gained = r.val > r.initial_val if HIGHER_IS_BETTER[metric] else r.val < r.initial_val
        lines += ["", f"{r.method}'s meta-training: validation {metric} {r.initial_val:.4f} at meta-epoch 0 (the initial "
                      f"Θ), {r.val:.4f} at the selected meta-epochs, mean over seeds"
                      + ("." if gained else ": its meta-training adds nothing here; what it gains comes from its "
                         "cells run at the initial Θ.")]
    for r in results:
        if r.initial_test is not None and r.personalized is not None:
            lines += ["", f"{r.method} with its untrained Θ (meta-epoch 0) scores test {metric} {r.initial_test:.4f}, "
                          f"against {r.personalized[0]:.4f} at the selected meta-epochs (mean over seeds; shown, "
                          "not tested, never selected on)."]
    unranked = [r for r in results if not r.ranked]
    if unranked:
        lines += ["", "Not ranked:", ""]
        lines += [f"- {r.method}: {unranked_note(r)}" for r in unranked]
    lines += weighted_lines(results, flipped, rule)
    lines += tuning_lines(tuning)
    lines += test_selected_lines(results)
    lines.append("")
    lines += [f"![{caption}]({path})\n" for caption, path in figures.items()]
    return "\n".join(lines)


def weighted_lines(results: list[MethodResult], flipped: dict[str, str], rule: VerdictConfig) -> list[str]:
    """The second statistic's table, ranked by it with its own CIs and tests, then a sentence
    for each method whose verdict flips between the two."""
    ranked = ordered(results, weighted=True)
    if not ranked:
        return []
    lines = ["", "## Sample-weighted, validation-selected", "", STATISTICS_NOTE, "",
             "The same runs at the same selected rounds, scored as all correct over all test samples of each "
             f"seed (MSE: weighted by test samples), mean over seeds, with a 95% CI (two-level bootstrap). ≈: not "
             f"significantly different from this table's best ({WEIGHTED_TEST_NAME}, α = {rule.alpha}).", "",
             "| rank | method | sample-weighted, test (95% CI) | client mean, test | rank by client mean |",
             "|---|---|---|---|---|"]
    by_mean = {r.method: i for i, r in enumerate(ordered(results), 1)}
    for i, r in enumerate(ranked, 1):
        lines.append(f"| {i} | {r.method}{marks(r, False, r.method in flipped, weighted=True)} "
                     f"| {interval(r.weighted)} | {r.personalized[0]:.4f} | {by_mean.get(r.method, '–')} |")
    lines += ["", "Where the verdict flips between the statistics:", ""]
    lines += [f"- ⚑ {method}: {sentence}." for method, sentence in flipped.items()] or ["- nowhere."]
    return lines


def _value(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def tuning_lines(tuning: dict | None) -> list[str]:
    """Each method's grid, as widened, and choice (`pfl_tasks.tuning`); a choice that stays at
    a grid's edge marked, with why."""
    if not tuning:
        return []
    seeds = tuning["seeds"]
    lines = ["", "## Tuning, on validation", "",
             f"Each method's values above were chosen on the mean over seed{'s' * (len(seeds) > 1)} "
             f"{', '.join(map(str, seeds))} of the validation metric at {tuning['rounds_fraction']:.0%} of its rounds "
             f"(`{tuning['selected_on']}` at its selected round; the test split is not read), over the grid below "
             f"(`tuning/{tuning['experiment']}.json`, stage `tune-{tuning['experiment']}`: "
             f"{tuning['seconds'] / 60:.1f} min of training on the machine that ran it). Of the points within "
             "noise of the best (short of it by at most the standard error of their difference, paired over "
             "the seeds and clients; – with a single pair), the choice is the one with the most keys inside their "
             "grids. A best point at a grid's edge widened the grid one step past it, within the key's "
             "bounds, and the new points trained; values in italics are those widenings. ◆: the choice stays at the "
             "edge, so the best may lie beyond it; the last column says why.", "",
             "| method | grid | chosen | validation (± SE of the difference from the best) | best, where not chosen | points finished | ◆ why |",
             "|---|---|---|---|---|---|---|"]
    for method, entry in tuning["methods"].items():
        grid = "; ".join(f"{_key(key)} {', '.join(_value(v) if v in entry['grid'][key] else f'*{_value(v)}*' for v in values)}"
                         for key, values in entry["tried"].items())
        chosen = ("none finished: the configured values" if entry["chosen"] is None else
                  ", ".join(f"{_key(key)} {_value(v)}{' ◆' if key in entry['at_edge'] else ''}"
                            for key, v in entry["chosen"].items()))
        finished = sum(not isinstance(v, str) for v in entry["points"].values())
        val, why = entry["val"], "; ".join(f"{_key(key)}: {reason}" for key, reason in entry["edge_reasons"].items())
        noise = "–" if entry.get("se") is None else f"{entry['se']:.4f}"
        best = entry.get("best")
        other = ("–" if best in (None, entry["chosen"]) else
                 f"{', '.join(f'{_key(key)} {_value(v)}' for key, v in best.items())}: {entry['best_val']:.4f}")
        lines.append(f"| {method} | {grid} | {chosen} | {'–' if val is None else f'{val:.4f} ± {noise}'} "
                     f"| {other} | {finished}/{len(entry['points'])} | {why or '–'} |")
    return lines


def _key(key: str) -> str:
    return key.removeprefix("local.optimizer.")


def test_selected_lines(results: list[MethodResult]) -> list[str]:
    """The test-selected statistic of published tables (PFLlib's), in a section of its own, for
    the ranked methods (an unranked run's best round says nothing comparable)."""
    shown = [r for r in results if r.ranked and r.test_selected is not None]
    if not shown:
        return []
    return ["", "## Test-selected and sample-weighted, for comparison with published numbers only", "",
            "PFLlib's leaderboard (and many papers) report each method's best round chosen on the test split. "
            "That number is below, for comparing with them: the personalized test metric weighted by the "
            "clients' test samples, at each run's best evaluation on test, mean over seeds. It is selected on "
            "test, so it is optimistic, and it ranks nothing: the table above does. Beside it, the same runs "
            "at their validation-selected rounds: sample-weighted (the same statistic, chosen without the "
            "test split) and the client mean (the ranked table's).", "",
            "| method | test-selected (best evaluation on test, sample-weighted) | validation-selected, sample-weighted "
            "| validation-selected, client mean |", "|---|---|---|---|",
            *(f"| {r.method} | {r.test_selected:.4f} | {'–' if r.weighted is None else f'{r.weighted[0]:.4f}'} "
              f"| {r.personalized[0]:.4f} |" for r in shown)]
