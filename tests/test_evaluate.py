import pytest
import torch

from conftest import split_from
from pfl_tasks.engine.evaluate import evaluate_clients, summarize
from pfl_tasks.config import PlateauRule
from pfl_tasks.errors import CheckpointError
from pfl_tasks.selection import (
    SPREAD, Score, Selection, final_metrics, paired_se, plateau, summarize_eval, tracked_series, validation_score,
    within_noise,
)
from torch import nn


def test_summary_statistics_by_hand():
    acc = torch.tensor([0.9, 0.5, 0.7, 0.1, 0.8, 0.6, 0.4, 0.3, 0.2, 1.0, 0.55, 0.65])
    n = torch.arange(1, 13, dtype=torch.float)
    s = summarize(acc, n, higher_is_better=True)
    assert abs(s["mean"] - acc.double().mean().item()) < 1e-6
    assert abs(s["weighted"] - (acc.double() * n).sum().item() / n.sum().item()) < 1e-6
    assert abs(s["worst10"] - (0.1 + 0.2) / 2) < 1e-6  # ceil(10% of 12) = 2 worst clients
    assert s["min"] == acc.double().min().item()
    loss = summarize(acc, n, higher_is_better=False)
    assert abs(loss["worst10"] - (1.0 + 0.9) / 2) < 1e-6


def test_mlflow_s_series_drop_only_the_spread_which_the_final_metrics_keep():
    """Per evaluation MLflow gets each summary's mean, weighted mean and worst 10%, the costs and
    an algorithm's round metrics; std, min and max only under final/ and selected/."""
    per_client = {"acc": torch.tensor([0.5, 0.9]), "loss": torch.tensor([1.0, 0.2]), "n": torch.tensor([3.0, 1.0])}
    summaries = summarize_eval({"val": {"personalized": per_client}, "test": {"global": per_client}})
    record = {"round": 4, **summaries, "compute/grad_samples": 10, "rounds/skipped": 0, "cfl/clusters": 2}
    series = tracked_series(record)
    stats = {k.rsplit("_", 1)[-1] for k in summaries}
    assert set(SPREAD) < stats
    assert {k.rsplit("_", 1)[-1] for k in series if k.count("/") == 2} == stats - set(SPREAD) == {"mean", "weighted", "worst10"}
    assert len(series) == 1 + 2 * 2 * 3 + 3 and list(series)[-1] == "cfl/clusters"
    final = final_metrics([record], 0)
    assert {f"final/{k}" for k in summaries} <= set(final) and "selected/val/personalized/acc_std" in final


def test_every_client_evaluated_on_its_own_split_with_its_own_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2))
    sizes = [1, 700, 5]  # 700 > one sample block, 1 = a lone test sample
    xs = [torch.randn(n, 3) for n in sizes]
    ys = [torch.randint(0, 2, (n,)) for n in sizes]
    test = split_from(xs, ys)
    stack = {"0.weight": torch.randn(3, 2, 3), "0.bias": torch.randn(3, 2)}
    got = evaluate_clients(net, "classification", test, torch.arange(3), stack, stacked=True)
    for k in range(3):
        out = xs[k] @ stack["0.weight"][k].T + stack["0.bias"][k]
        loss = nn.functional.cross_entropy(out, ys[k])
        acc = (out.argmax(1) == ys[k]).float().mean()
        torch.testing.assert_close(got["loss"][k], loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["acc"][k], acc)
        assert got["n"][k] == sizes[k]
    shared = {"0.weight": stack["0.weight"][1], "0.bias": stack["0.bias"][1]}
    same = evaluate_clients(net, "classification", test, torch.tensor([1]), shared, stacked=False)
    torch.testing.assert_close(same["acc"][0], got["acc"][1])


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_variants_scored_in_one_pass_equal_one_evaluation_each(stacked, task):
    """`variants=V`: a forward giving V outputs of each row scores V candidates at once, [V, K],
    each exactly as its own evaluation would (over sample blocks and padding too)."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 2 if task == "classification" else 1))
    sizes = [1, 700, 5]
    xs = [torch.randn(n, 3) for n in sizes]
    ys = [torch.randint(0, 2, (n,)) if task == "classification" else torch.randn(n) for n in sizes]
    test = split_from(xs, ys)
    shape = {"0.weight": net[0].weight.shape, "0.bias": net[0].bias.shape}
    params = {k: torch.randn(3, *v) if stacked else torch.randn(*v) for k, v in shape.items()}
    scales = torch.tensor([0.5, 1.0, -2.0])

    def forward(scale):
        return lambda net_, p, x: scale * torch.func.functional_call(net_, p, (x,))

    def scaled(net_, p, x):  # [V, rows, outputs]
        return scales[:, None, None] * torch.func.functional_call(net_, p, (x,))

    together = evaluate_clients(net, task, test, torch.arange(3), params, stacked, scaled, variants=3)
    metric = "acc" if task == "classification" else "mse"
    assert together[metric].shape == (3, 3)
    for v, scale in enumerate(scales):
        alone = evaluate_clients(net, task, test, torch.arange(3), params, stacked, forward(scale))
        for name in ("loss", "acc") if task == "classification" else ("mse",):
            assert torch.equal(together[name][v], alone[name])
        assert torch.equal(together["n"], alone["n"])


def test_final_and_selected_metrics_come_from_the_last_and_the_selected_evaluation():
    history = [{"round": 5, "test/personalized/acc_mean": 0.5}, {"round": 10, "test/personalized/acc_mean": 0.6},
               {"round": 15, "test/personalized/acc_mean": 0.9}]
    final = final_metrics(history, 1)
    assert final["selected/round"] == 10 and final["final/round"] == 15
    assert final["final/test/personalized/acc_mean"] == 0.9 and final["selected/test/personalized/acc_mean"] == 0.6


def score(rows: list[list[float]]) -> Score:
    """The `Score` of clients' per-row metrics (its own standard error unused by the rule)."""
    flat = torch.tensor([v for client in rows for v in client])
    return Score(sum(sum(c) / len(c) for c in rows) / len(rows), 0.0, flat, torch.tensor([len(c) for c in rows]))


def selected(scores: list[Score], higher_is_better: bool = True) -> int:
    selection = Selection(higher_is_better)
    for i, one in enumerate(scores):
        selection.offer(i, one)
    return selection.index


def flipped(rows: list[list[float]], wrong: int, right: int = 0) -> list[list[float]]:
    """Each client's rows with its first `wrong` hits missed and its first `right` misses hit."""
    out = []
    for client in rows:
        client, hits, misses = list(client), [i for i, v in enumerate(client) if v], [i for i, v in enumerate(client) if not v]
        for i in hits[:wrong]:
            client[i] = 0.0
        for i in misses[:right]:
            client[i] = 1.0
        out.append(client)
    return out


def negated(rows: list[list[float]]) -> list[list[float]]:
    return [[-v for v in client] for client in rows]


BEST = [[1.0] * 80 + [0.0] * 20, [1.0] * 80 + [0.0] * 20]  # two clients, 100 validation rows each, 0.8


def test_the_noise_of_a_difference_is_paired_on_the_rows_by_hand():
    """Two clients: client 0's rows differ by (1, 0, 0, -1), client 1's by (0, 0, 1); the
    standard error of the difference of the client means is sqrt(sum of var_c / n_c) / 2, with
    var_c each client's spread of its row differences."""
    a, b = score([[1, 1, 0, 0], [1, 0, 1]]), score([[0, 1, 0, 1], [1, 0, 0]])
    var = (0.5 / 4, (1 / 3 - 1 / 9) / 3)
    assert paired_se(a, b) == pytest.approx(sum(var) ** 0.5 / 2)
    assert paired_se(a, a) == 0  # rows two models get equally right cost no noise


def test_a_shortfall_that_is_noise_on_unpaired_rows_is_real_on_the_same_rows():
    """A later evaluation that misses 3 rows of each client the best got right, and gets nothing
    else differently, is 0.03 short: within an unpaired band (0.04: two accuracies of 0.8 on 200
    rows), beyond the paired one (0.012): the best is kept."""
    later = flipped(BEST, wrong=3)
    unpaired = 2 ** 0.5 * (2 * 0.8 * 0.2 / 100) ** 0.5 / 2
    shortfall = score(BEST).mean - score(later).mean
    assert shortfall == pytest.approx(0.03) and paired_se(score(BEST), score(later)) < shortfall < unpaired
    assert selected([score(flipped(BEST, wrong=10)), score(BEST), score(later)]) == 1
    assert selected([score(negated(r)) for r in (flipped(BEST, wrong=10), BEST, later)], higher_is_better=False) == 1


def test_a_later_evaluation_that_differs_from_the_best_by_noise_is_selected_over_it():
    """A later evaluation that misses 4 of the best's hits and hits 3 of its misses per client is
    0.01 short, against a paired standard error of 0.019: noise, so the later one stands where
    the argmax keeps the earlier. MSE mirrors it."""
    later = flipped(BEST, wrong=4, right=3)
    shortfall = score(BEST).mean - score(later).mean
    assert shortfall == pytest.approx(0.01) and shortfall < paired_se(score(BEST), score(later))
    assert selected([score(flipped(BEST, wrong=10)), score(BEST), score(later)]) == 2
    assert selected([score(negated(r)) for r in (flipped(BEST, wrong=10), BEST, later)], higher_is_better=False) == 2


def test_the_selection_offered_one_at_a_time_is_the_latest_evaluation_within_noise_of_the_best():
    """The rule needs no look back: after every offer, the selection equals the definition
    applied to all evaluations so far (random row metrics, both directions)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(100):
        higher, sign = trial % 2 == 0, 1 if trial % 2 == 0 else -1
        base = (torch.rand(2, 30, generator=gen) < 0.7).float()
        curve = []
        for _ in range(10):
            flips = torch.rand(2, 30, generator=gen) < 0.1
            rows = torch.where(flips, 1 - base, base) * sign
            curve.append(score(rows.tolist()))
        selection = Selection(higher)
        for n, one in enumerate(curve, 1):
            selection.offer(n - 1, one)
            best = max(range(n), key=lambda i: (sign * curve[i].mean, -i))
            assert selection.best_index == best
            assert selection.index == max(i for i in range(n) if within_noise(
                sign * (curve[best].mean - curve[i].mean), paired_se(curve[best], curve[i])))


def test_a_selection_saved_before_the_paired_rule_is_refused_in_one_line():
    saved = Selection(True)
    saved.offer(0, score(BEST))
    assert Selection.from_dict(saved.as_dict()).best.rows.equal(score(BEST).rows)
    with pytest.raises(CheckpointError, match="written before the paired selection rule"):
        Selection.from_dict({**saved.as_dict(), "best": (0.8, 0.01)})


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_each_row_s_metric_comes_client_after_client_and_averages_to_its_client_s(stacked, task):
    gen = torch.Generator().manual_seed(1)
    sizes = (5, 9, 3)
    xs = [torch.randn(n, 3, generator=gen) for n in sizes]
    ys = [torch.randint(0, 4, (n,), generator=gen) if task == "classification" else torch.randn(n, generator=gen)
          for n in sizes]
    net = nn.Linear(3, 4 if task == "classification" else 1)
    one = {k: v.detach() for k, v in net.named_parameters()}
    params = {k: v.expand(3, *v.shape).clone() for k, v in one.items()} if stacked else one
    metrics = evaluate_clients(net, task, split_from(xs, ys), torch.arange(3), params, stacked=stacked, by_row=True)
    rows = metrics["rows"].split(list(sizes))
    primary = metrics["acc" if task == "classification" else "mse"]
    assert torch.stack([r.mean() for r in rows]) == pytest.approx(primary, rel=1e-6)
    for x, y, r in zip(xs, ys, rows):  # each row its own model's metric, in the client's order
        out = net(x)
        expected = (out.argmax(-1) == y).float() if task == "classification" else (out.squeeze(-1) - y) ** 2
        assert r == pytest.approx(expected.detach(), rel=1e-5)


def test_the_validation_noise_is_the_sampling_noise_of_the_clients_rows():
    """Accuracy: each row a Bernoulli draw, var p(1 - p); MSE: the spread of the rows' squared
    errors, which `evaluate_clients` returns as mse_sq. The standard error of the client mean is
    sqrt(sum of var_c / n_c) / clients, checked against the rows by hand."""
    acc = {"val": {"personalized": {"n": torch.tensor([4.0, 10.0]), "acc": torch.tensor([0.75, 0.5])}}}
    one = validation_score(acc, "classification")
    mean, se = one.mean, one.se
    assert mean == pytest.approx(0.625) and se == pytest.approx((0.75 * 0.25 / 4 + 0.25 / 10) ** 0.5 / 2)
    gen = torch.Generator().manual_seed(0)
    xs, ys = [torch.randn(n, 3, generator=gen) for n in (5, 9)], [torch.randn(n, generator=gen) for n in (5, 9)]
    net = nn.Linear(3, 1)
    params = {k: v.detach() for k, v in net.named_parameters()}
    metrics = evaluate_clients(net, "regression", split_from(xs, ys), torch.arange(2), params, stacked=False)
    one = validation_score({"val": {"personalized": metrics}}, "regression")
    mean, se = one.mean, one.se
    errors = [((net(x).squeeze(-1) - y) ** 2).detach().double() for x, y in zip(xs, ys)]
    assert mean == pytest.approx(sum(e.mean().item() for e in errors) / 2, rel=1e-5)
    assert se == pytest.approx(sum(e.var(unbiased=False).item() / len(e) for e in errors) ** 0.5 / 2, rel=1e-4)
    assert validation_score({"test": {}}, "regression") is None


def curve(values):
    """Evaluations every 10 rounds."""
    return {10 * (i + 1): v for i, v in enumerate(values)}


def test_plateau_is_the_gain_of_the_mean_validation_metric_from_one_fifth_of_the_rounds_to_the_last():
    rule = PlateauRule()  # 10 evaluations: the windows are rounds 70-80 and 90-100
    assert plateau(curve([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]), "acc", rule) == (pytest.approx(0.2), False)
    noisy = plateau(curve([0.5, 0.7, 0.8, 0.8, 0.8, 0.8, 0.79, 0.81, 0.78, 0.82]), "acc", rule)
    assert noisy == (pytest.approx(0.0), True)
    late = plateau(curve([0.5, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.806, 0.806]), "acc", rule)
    assert late == (pytest.approx(0.006), False)
    mse = plateau(curve([4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.995, 0.995]), "mse", rule)
    assert mse == (pytest.approx(0.005), True)
    assert plateau(curve([0.5, 0.6]), "acc", rule) is None  # no evaluation in the fifth before the last


def test_the_plateau_rule_is_the_configured_one():
    """Its window and tolerances are `verdicts.plateau`: a wider window or a looser tolerance
    turns the same curve's verdict."""
    late = curve([0.5, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.806, 0.806])
    assert plateau(late, "acc", PlateauRule(acc=0.01)) == (pytest.approx(0.006), True)
    # window 0.4: rounds 30-60 (mean 0.8) against 70-100 (mean 0.803)
    assert plateau(late, "acc", PlateauRule(window=0.4)) == (pytest.approx(0.003), True)
    mse = curve([4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.995, 0.995])
    assert plateau(mse, "mse", PlateauRule(mse=0.001)) == (pytest.approx(0.005), False)


def test_a_perfect_mse_before_the_last_window_is_no_division_by_zero():
    """From an MSE of 0 the relative gain is the MSE lost (nothing left to gain: plateaued)."""
    rule = PlateauRule()
    assert plateau(curve([1.0] * 6 + [0.0, 0.0, 0.0, 0.0]), "mse", rule) == (0.0, True)
    assert plateau(curve([1.0] * 6 + [0.0, 0.0, 0.5, 0.5]), "mse", rule) == (-0.5, True)
