"""The report's figures (matplotlib): learning curves, metric against compute, per-client spread, Learn2pFed's participation."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pandas as pd

from pfl_tasks.files import atomic_write
from pfl_tasks.reports.results import MethodResult, run_table
from pfl_tasks.reports.verdicts import top_group


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


MARKERS = "os^DvPX"  # 7 against 20 colors: no two of the first 140 methods share color and marker


# tab20 without its grey pair (indices 14, 15): a grey line means "outside the top group"
PALETTE = [2 * i for i in range(10) if i != 7] + [2 * i + 1 for i in range(10) if i != 7]


def method_styles(results: list[MethodResult]) -> dict[str, dict]:
    """Each ranked method's line style, the same in every figure of a report, the top group's
    first: tab20's nine dark colors but grey on solid lines, then its nine light ones on dashed
    lines, each with its own marker."""
    colors, top = _pyplot().get_cmap("tab20"), {r.method for r in top_group(results)}
    ranked = sorted((r.method for r in results if r.ranked), key=lambda method: method not in top)  # stable
    half = len(PALETTE) // 2
    return {method: {"color": colors(PALETTE[i % len(PALETTE)]), "linestyle": "--" if i // half % 2 else "-",
                     "marker": MARKERS[i % len(MARKERS)]} for i, method in enumerate(ranked)}


def seed_curve(client, run_ids: list[str], key: str) -> dict[int, tuple[float, float, float]]:
    """step -> mean, min and max over seeds of a per-round metric."""
    by_step: dict[int, list[float]] = {}
    for run_id in run_ids:
        for point in client.get_metric_history(run_id, key):
            by_step.setdefault(point.step, []).append(point.value)
    return {step: (statistics.fmean(values), min(values), max(values)) for step, values in sorted(by_step.items())}


GREYED = {"color": "0.72", "linestyle": "-", "marker": None, "linewidth": 0.9}  # a method outside the top group


def _legend(fig, styles: dict[str, dict], notes: dict[str, list[str]], greyed: list[str]) -> None:
    """One entry per method, in rank order, right of the panels, then one for the `greyed`;
    `notes` say whose lines hide its own."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], markersize=4, **style) for style in styles.values()]
    labels = [f"{m} ({'; '.join(notes[m])})" if m in notes else m for m in styles]
    if greyed:
        handles.append(Line2D([], [], **GREYED))
        labels.append(f"outside the top group ({len(greyed)}):\n" + "\n".join(", ".join(greyed[i:i + 3])
                                                                          for i in range(0, len(greyed), 3)))
    fig.legend(handles, labels, loc="outside right center", fontsize=8)


def _two_panels(results: list[MethodResult], title: str, panels: dict[str, str], xlabel: str, ylabel: str,
                lines, style, highlight: set[str] | None = None):
    """One figure of two panels (key -> title) sharing y, a line per ranked method in each with
    its seeds' min-max band; `lines(r, panel)` gives x -> (mean, min, max) over seeds and
    `style(ax)` sets up an x axis. A line equal to one already in its panel (FedAvg's global
    model, which is Ditto's too) is drawn once, for the method whose personalized model it is if
    any, and the legend says so. With `highlight`, the other methods are thin grey lines under
    them, without bands. None if no line was drawn."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True, layout="constrained")
    styles = method_styles(results)
    if highlight is not None:
        styles = {m: style if m in highlight else GREYED for m, style in styles.items()}
    # a shared curve is drawn once, by the first of its methods: a highlighted one, then one whose
    # personalized model is the global one
    owners_first = sorted((r for r in results if r.ranked),
                          key=lambda r: (highlight is not None and r.method not in highlight, not r.global_only))
    listed, notes = set(), {}
    for ax, (panel, panel_title) in zip(axes, panels.items()):
        owner_of: dict[tuple, str] = {}  # a drawn line's points -> its method
        for r in owners_first:
            points = lines(r, panel)
            if not points:
                continue
            listed.add(r.method)
            key = tuple(points.items())
            if key in owner_of:
                notes.setdefault(r.method, []).append(f"{panel} = {owner_of[key]}'s")
                continue
            owner_of[key] = r.method
            x = list(points)
            mean, low, high = zip(*points.values())
            greyed = styles[r.method] is GREYED
            ax.plot(x, mean, markersize=4, label=r.method, zorder=1 if greyed else 2, **styles[r.method])
            if len(r.run_ids) > 1 and not greyed:
                ax.fill_between(x, low, high, color=styles[r.method]["color"], alpha=0.15, linewidth=0)
        ax.set_title(panel_title)
        ax.grid(alpha=0.3)
        style(ax)
    if not listed:
        plt.close(fig)
        return None
    if highlight is not None:
        _focus(axes[0], [line for ax in axes for line in ax.get_lines() if line.get_label() in highlight])
    axes[0].set_ylabel(ylabel)
    fig.supxlabel(xlabel, fontsize="medium")  # one label under both panels
    fig.suptitle(title)
    _legend(fig, {m: s for m, s in styles.items() if m in listed and s is not GREYED}, notes,
            [m for m, s in styles.items() if m in listed and s is GREYED])
    return fig


def _focus(ax, lines) -> None:
    """The y range of `lines` over the later half of each one's x, padded: the highlighted
    methods told apart where they end, not squeezed by the others' or their own early rounds."""
    ys = [y for line in lines for x, y in zip(line.get_xdata(), line.get_ydata())
          if x >= (min(line.get_xdata()) + max(line.get_xdata())) / 2]
    if ys:
        low, high = min(ys), max(ys)
        pad = max(high - low, 1e-3 * max(abs(high), 1e-12)) * 0.25
        ax.set_ylim(low - pad, high + pad)


def curves_figure(client, results: list[MethodResult], metric: str, title: str):
    """Personalized and global test metric against the share of each method's own rounds (so
    that a method of ten times the rounds, L2SGD's, spans the axis as the others do), one line
    per ranked method: the top group (the best by the client mean and the methods ≈ to it) in
    color, the others in grey, the y axis the top group's range over the later half of its
    rounds; all in color when no method of the top group has a round curve (a downstream
    Learn2pFed's)."""
    kinds = {"personalized": "personalized model", "global": "global model"}
    curves = {(r.method, kind): seed_curve(client, r.run_ids, f"test/{kind}/{metric}_mean")
              for r in results if r.ranked for kind in kinds}
    rounds = {method: max(curve) for (method, _), curve in curves.items() if curve}

    def lines(r, kind):
        return {step / rounds[r.method]: value for step, value in curves[r.method, kind].items()}

    def style(ax):
        ax.set_xlim(0, 1)
        ax.xaxis.set_major_formatter(_pyplot().matplotlib.ticker.PercentFormatter(1.0))

    if not rounds:
        return None
    usual = statistics.mode(rounds.values())
    others = "".join(f"; {m}: {n}" for m, n in rounds.items() if n != usual)
    top = {r.method for r in top_group(results)}
    return _two_panels(results, title, kinds, f"share of the method's rounds ({usual} rounds{others})",
                       f"test {metric}, mean over clients", lines, style, top if top & set(rounds) else None)


def compute_figure(client, results: list[MethodResult], metric: str, title: str):
    """Personalized validation and test metric against cumulative training compute."""
    spent_of: dict[str, dict] = {}  # method -> its compute per round, read once for both panels

    def lines(r, split):
        if r.method not in spent_of:
            spent_of[r.method] = seed_curve(client, r.run_ids, "compute/grad_samples")
        spent = spent_of[r.method]
        curve = seed_curve(client, r.run_ids, f"{split}/personalized/{metric}_mean")
        return {spent[s][0]: v for s, v in curve.items() if s in spent}

    def style(ax):
        ax.set_xscale("log")

    return _two_panels(results, title, {"val": "validation", "test": "test"},
                       "training compute (samples × forward-backward passes)",
                       f"personalized {metric}, mean over clients", lines, style)


def clients_figure(client, results: list[MethodResult], metric: str, title: str):
    """Distribution over clients (all seeds) of the selected round's personalized test metric,
    a box per ranked method in its color, its mean in its marker."""
    per_method = {r.method: np.concatenate(list(r.clients.values())) for r in results if r.ranked and r.clients}
    if not per_method:
        return None
    plt = _pyplot()
    styles = method_styles(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(per_method) + 2), 4.5), layout="constrained")
    boxes = ax.boxplot(list(per_method.values()), showmeans=True, patch_artist=True, medianprops={"color": "black"})
    for box, mean, method in zip(boxes["boxes"], boxes["means"], per_method):
        box.set(facecolor=styles[method]["color"], alpha=0.7)
        mean.set(marker=styles[method]["marker"], markerfacecolor="white", markeredgecolor="black")
    ax.set_xticks(range(1, len(per_method) + 1), list(per_method), rotation=45, ha="right")
    ax.set_ylabel(f"personalized test {metric} per client\n(the clients of every seed)")
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    return fig


PARTICIPATION_CSV = "participation.csv"  # a Learn2pFed run's (learn2pfed_meta.participation_table)


def draw_participation(axes, table: pd.DataFrame, label: str) -> None:
    """Two axes: Lambda's diagonal per client and parameter group, and rho per client, initial
    (hollow, dashed) against learned (filled); geometric means over untied cells."""
    from matplotlib.ticker import MaxNLocator

    mean = table.groupby(["client_id", "group"], sort=False)[
        ["lam_initial", "lam_learned", "rho_initial", "rho_learned"]].agg(lambda x: float(np.exp(np.log(x).mean())))
    clients = mean.index.get_level_values(0).unique()
    lam_ax, rho_ax = axes
    for k, group in enumerate(mean.index.get_level_values(1).unique()):
        rows = mean.xs(group, level="group")
        color = f"C{k % 10}"
        lam_ax.plot(clients, rows["lam_initial"], "o--", color=color, markerfacecolor="white", alpha=0.7)
        lam_ax.plot(clients, rows["lam_learned"], "o-", color=color, label=group)
    rho = mean.groupby(level="client_id").first()
    rho_ax.plot(clients, rho["rho_initial"], "o--", color="gray", markerfacecolor="white", label="initial")
    rho_ax.plot(clients, rho["rho_learned"], "o-", color="black", label="learned")
    for ax, what in ((lam_ax, "Lambda's diagonal (large: tied to w)"), (rho_ax, "rho")):
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("client")
        ax.set_ylabel(f"{label}\n{what}")
        ax.grid(alpha=0.3)
    lam_ax.legend(title="learned (hollow: initial)", fontsize="small")
    rho_ax.legend(fontsize="small")


def participation_figure_of(tables: dict[str, pd.DataFrame], title: str):
    """A row of two panels (`draw_participation`) per labelled participation table."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(tables), 2, figsize=(11, 3.6 * len(tables)), layout="constrained", squeeze=False)
    for row, (label, table) in zip(axes, tables.items()):
        draw_participation(row, table, label)
    fig.suptitle(title)
    return fig


def participation_figure(client, results: list[MethodResult], metric: str, title: str):
    """Learn2pFed's learned participation: each of its methods' first seed."""
    tables = {}
    for r in results:
        if r.method.startswith("learn2pfed-") and r.run_ids:
            table = run_table(client, r.run_ids[0], PARTICIPATION_CSV)
            if table is not None:
                tables[f"{r.method}, seed {r.seeds[0]}"] = table
    return participation_figure_of(tables, title) if tables else None


def save_figure(fig, path: Path) -> None:
    atomic_write(path, lambda fh: fig.savefig(fh, dpi=100, format="png"), binary=True)
    _pyplot().close(fig)


FIGURES = (  # file name, builder, caption
    ("curves", curves_figure, "learning curves (y: the top group's range)"),
    ("compute", compute_figure, "metric against compute"),
    ("clients", clients_figure, "per-client distribution"),
    ("participation", participation_figure, "Learn2pFed's learned participation"),
)
