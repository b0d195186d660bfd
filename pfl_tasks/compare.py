"""Comparison reports from MLflow (tracking layer): a ranking over seeds, learning curves and
per-client distributions of one MLflow experiment.

Everything is read through the MLflow client — run search, metric histories and each run's
`clients_last.csv` artifact — so a report is the same from the local sqlite store and from a
remote `mlflow server`. Of several finished runs of one (algorithm, seed), the newest counts.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER
from pfl_tasks.files import atomic_write, atomic_write_text


class ComparisonError(ValueError):
    pass


Spread = tuple[float, float | None]  # mean and sample std over seeds (None for one seed)


@dataclass(frozen=True)
class Ranked:
    method: str
    seeds: list[int]
    personalized: Spread
    global_: Spread | None  # None: the method has no global model
    worst10: Spread
    std_clients: Spread
    best: Spread
    run_ids: list[str]


def newest_finished_runs(client, experiment: str, only: set[tuple[str, int]] | None = None
                         ) -> dict[str, dict[int, object]]:
    """algorithm -> seed -> its newest FINISHED run; of the (algorithm, seed) pairs in `only`
    when given (what the params file still configures)."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ComparisonError(f"MLflow at {client.tracking_uri} has no experiment '{experiment}'")
    runs, token = [], None
    while True:
        page = client.search_runs(
            [found.experiment_id], "attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"], max_results=1000, page_token=token,
        )
        runs += page
        token = page.token
        if not token:
            break
    newest: dict[str, dict[int, object]] = {}
    for run in runs:
        tags = run.data.tags
        if "algorithm" in tags and "seed" in tags and (only is None or (tags["algorithm"], int(tags["seed"])) in only):
            newest.setdefault(tags["algorithm"], {}).setdefault(int(tags["seed"]), run)
    if not newest:
        raise ComparisonError(f"MLflow experiment '{experiment}' has no finished runs tagged with an algorithm")
    return newest


def primary_metric(newest: dict[str, dict[int, object]]) -> str:
    any_run = next(iter(next(iter(newest.values())).values()))
    return "acc" if "final/personalized/acc_mean" in any_run.data.metrics else "mse"


def _spread(runs: list, key: str) -> Spread | None:
    values = [run.data.metrics[key] for run in runs if key in run.data.metrics]
    if not values:
        return None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def rank(newest: dict[str, dict[int, object]], metric: str) -> list[Ranked]:
    """Methods ordered best first by their final personalized mean over clients, averaged over seeds."""
    rows = []
    for method, by_seed in newest.items():
        runs = [by_seed[s] for s in sorted(by_seed)]
        final = f"final/personalized/{metric}"
        if _spread(runs, f"{final}_mean") is None:
            continue  # not a training run (no final metrics)
        rows.append(Ranked(
            method, sorted(by_seed), _spread(runs, f"{final}_mean"), _spread(runs, f"final/global/{metric}_mean"),
            _spread(runs, f"{final}_worst10"), _spread(runs, f"{final}_std"),
            _spread(runs, f"best/personalized/{metric}_mean"), [r.info.run_id for r in runs],
        ))
    sign = -1 if HIGHER_IS_BETTER[metric] else 1
    return sorted(rows, key=lambda r: (sign * r.personalized[0], r.method))


def mean_curve(client, run_ids: list[str], key: str) -> list[tuple[int, float]]:
    """(round, mean over seeds) of a per-round metric."""
    by_step: dict[int, list[float]] = {}
    for run_id in run_ids:
        for point in client.get_metric_history(run_id, key):
            by_step.setdefault(point.step, []).append(point.value)
    return [(step, statistics.fmean(values)) for step, values in sorted(by_step.items())]


def client_values(client, run_ids: list[str], metric: str) -> pd.Series | None:
    """Each client's final personalized metric, averaged over seeds (clients are the same)."""
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for run_id in run_ids:
            if any(a.path == "clients_last.csv" for a in client.list_artifacts(run_id)):
                path = client.download_artifacts(run_id, "clients_last.csv", tmp)
                tables.append(pd.read_csv(path).set_index("client_id")[f"personalized_{metric}"])
    return pd.concat(tables, axis=1).mean(axis=1) if tables else None


def _fmt(spread: Spread | None) -> str:
    if spread is None:
        return "–"
    mean, std = spread
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def markdown(experiment: str, metric: str, ranked: list[Ranked], figures: dict[str, str]) -> str:
    what = "accuracy (higher is better)" if metric == "acc" else "MSE (lower is better)"
    lines = [
        f"# {experiment}: comparison",
        "",
        f"Final-round test {what} over every client, from MLflow experiment `{experiment}` (the newest "
        "finished run of each algorithm and seed). Each entry is the mean over seeds ± the std over seeds.",
        "",
        "| rank | method | seeds | personalized | global | worst 10% of clients | std over clients "
        "| best round, personalized |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(ranked, 1):
        lines.append(
            f"| {i} | {r.method} | {len(r.seeds)} | {_fmt(r.personalized)} | {_fmt(r.global_)} | {_fmt(r.worst10)} "
            f"| {_fmt(r.std_clients)} | {_fmt(r.best)} |"
        )
    lines.append("")
    lines += [f"![{caption}]({path})\n" for caption, path in figures.items()]
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves_png(path: Path, client, ranked: list[Ranked], metric: str, title: str) -> bool:
    """Personalized and global mean over clients per round, one line per method."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    colors = plt.get_cmap("tab20")
    drawn = False
    for i, r in enumerate(ranked):
        for ax, kind in zip(axes, ("personalized", "global")):
            curve = mean_curve(client, r.run_ids, f"{kind}/{metric}_mean")
            if curve:
                ax.plot(*zip(*curve), marker=".", color=colors(i % 20),
                        label=r.method if kind == "personalized" else None)
                drawn = True
    for ax, kind in zip(axes, ("personalized", "global")):
        ax.set(xlabel="round", title=f"{kind} model", ylabel=f"{metric}, mean over clients")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    fig.legend(loc="center left", bbox_to_anchor=(0.85, 0.5), fontsize=8)
    if drawn:
        _save(fig, path)
    plt.close(fig)
    return drawn


def clients_png(path: Path, client, ranked: list[Ranked], metric: str, title: str) -> bool:
    """Distribution over clients of the final personalized metric, one box per method."""
    per_method = {r.method: client_values(client, r.run_ids, metric) for r in ranked}
    per_method = {m: v for m, v in per_method.items() if v is not None}
    if not per_method:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(per_method) + 2), 4))
    ax.boxplot(list(per_method.values()), showmeans=True)
    ax.set_xticks(range(1, len(per_method) + 1), list(per_method), rotation=45, ha="right")
    ax.set(ylabel=f"personalized {metric} per client", title=f"{title} (mean over seeds)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def _save(fig, path: Path) -> None:
    atomic_write(path, lambda fh: fig.savefig(fh, dpi=100, format="png"), binary=True)


def write_report(client, experiment: str, report_dir: Path, figure_dir: Path,
                 only: set[tuple[str, int]] | None = None) -> list[Ranked]:
    """`report_dir/<experiment>.md` and its PNGs in `figure_dir`; returns the ranking."""
    newest = newest_finished_runs(client, experiment, only)
    metric = primary_metric(newest)
    ranked = rank(newest, metric)
    figures = {}
    for name, draw, caption in (
        ("curves", curves_png, "learning curves"),
        ("clients", clients_png, "per-client distribution"),
    ):
        png = figure_dir / f"{experiment}-{name}.png"
        if draw(png, client, ranked, metric, f"{experiment}: {caption}"):
            figures[caption] = Path(os.path.relpath(png, report_dir)).as_posix()
    atomic_write_text(report_dir / f"{experiment}.md", markdown(experiment, metric, ranked, figures))
    return ranked
