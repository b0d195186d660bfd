"""FedAvg's server optimizer (pfl_tasks/algorithms/server_optimizer.py): FedAvgM, FedAdagrad,
FedAdam and FedYogi are configurations, each checked against its paper's update by hand."""

import math

import pytest
import torch

from conftest import assert_rel_close, least_squares_clients, lsq_federation, pooled_least_squares
from pfl_tasks.algorithms import build
from pfl_tasks.errors import ConfigError

LR = 0.05  # the clients' one full-batch gradient step a round


def hand_rounds(hp: dict, rounds: int) -> tuple[torch.Tensor, set[int]]:
    """The paper's update in float64, one coordinate at a time, on the least-squares clients: the
    round's average is x - LR sum_k n_k/n grad f_k(x) (one local GD step), delta = average - x.
    Also the signs of (v - delta^2) that Yogi met."""
    xs, ys = least_squares_clients()
    n = sum(len(y) for y in ys)
    x = lsq_federation("fedavg", rounds=0)[3].server["global"]["1.weight"][0].double().tolist()
    kind, lr = hp.get("server_optimizer", "sgd"), hp.get("server_lr", 1.0)
    beta, (b1, b2), tau = hp.get("server_momentum", 0.0), hp.get("server_betas", (0.9, 0.99)), hp.get("server_tau", 1e-3)
    m, v, signs = [0.0] * len(x), [tau**2] * len(x), set()
    for _ in range(rounds):
        w = torch.tensor(x, dtype=torch.float64)
        grad = sum(len(b) / n * 2 * a.double().T @ (a.double() @ w - b.double()) / len(b) for a, b in zip(xs, ys))
        delta = (-LR * grad).tolist()
        for i, d in enumerate(delta):
            if kind == "sgd":  # Hsu et al. 2019: v <- beta v + delta w (their delta w is our -delta)
                m[i] = beta * m[i] + d
                x[i] += lr * m[i]
                continue
            m[i] = b1 * m[i] + (1 - b1) * d  # Reddi et al. 2021, Algorithm 2
            if kind == "adagrad":
                v[i] = v[i] + d * d
            elif kind == "adam":
                v[i] = b2 * v[i] + (1 - b2) * d * d
            else:
                sign = (v[i] > d * d) - (v[i] < d * d)
                signs.add(sign)
                v[i] = v[i] - (1 - b2) * d * d * sign
            x[i] += lr * m[i] / (math.sqrt(v[i]) + tau)
    return torch.tensor(x, dtype=torch.float64), signs


CASES = {
    "fedavgm": {"server_momentum": 0.9, "server_lr": 0.5},
    "fedadagrad": {"server_optimizer": "adagrad", "server_lr": 0.3, "server_tau": 0.1},
    "fedadam": {"server_optimizer": "adam", "server_lr": 0.3, "server_betas": (0.8, 0.99), "server_tau": 0.1},
    "fedyogi": {"server_optimizer": "yogi", "server_lr": 0.3, "server_betas": (0.9, 0.9), "server_tau": 0.1},
}


@pytest.mark.parametrize("executor", ["vectorized", "sequential"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_server_optimizer_is_its_papers_update(case, executor):
    """Six rounds against the hand computation; the step moved far from plain FedAvg's, so a
    dropped factor (1 - b1), a wrong v rule or a flipped sign would show."""
    hp = CASES[case]
    expected, signs = hand_rounds(hp, 6)
    state = lsq_federation("fedavg", hp, lr=LR, rounds=6, executor=executor)[3]
    assert_rel_close(state.server["global"]["1.weight"][0], expected, tol=1e-5)
    plain = lsq_federation("fedavg", lr=LR, rounds=6, executor=executor)[3].server["global"]["1.weight"][0]
    assert (plain.double() - expected).norm() / expected.norm() > 1e-2
    if case == "fedyogi":
        assert signs == {-1, 1}  # both branches of its v rule were taken


def test_every_rule_differs_from_the_others():
    """Adam's, Yogi's and Adagrad's v rules give different models at the same settings."""
    common = {"server_lr": 0.3, "server_tau": 0.1, "server_betas": (0.9, 0.9)}
    finals = [hand_rounds({"server_optimizer": kind, **common}, 6)[0] for kind in ("adagrad", "adam", "yogi")]
    assert min((a - b).norm() for i, a in enumerate(finals) for b in finals[i + 1:]) > 1e-3


def test_the_default_is_plain_fedavg_bit_for_bit_with_no_server_state():
    default = lsq_federation("fedavg", lr=LR, rounds=3)[3]
    spelled = lsq_federation("fedavg", {"server_optimizer": "sgd", "server_lr": 1.0}, lr=LR, rounds=3)[3]
    assert set(default.server) == {"global"}
    assert torch.equal(default.server["global"]["1.weight"], spelled.server["global"]["1.weight"])


@pytest.mark.parametrize("hp", [{"server_momentum": 0.9, "server_lr": 0.1},
                                {"server_optimizer": "adam", "server_lr": 0.01}],
                         ids=["fedavgm", "fedadam"])
def test_params_yaml_server_optimizers_reach_the_pooled_optimum(hp):
    """FedAvgM and FedAdam at params.yaml's settings (the papers' betas and tau) converge where
    FedAvg does: the pooled least-squares solution."""
    xs, ys, _, state = lsq_federation("fedavg", hp, lr=LR, rounds=400)
    assert_rel_close(state.server["global"]["1.weight"][0], pooled_least_squares(xs, ys), tol=2e-3)


def test_the_body_of_fedper_takes_the_server_step_too():
    """FedPer and FedRep share FedAvg's hyper-parameters, so their body takes the step (never
    silently ignored), and its state never goes down the wire."""
    fedper = build("fedper", {"server_optimizer": "adam", "server_lr": 0.1})
    body = {"0.weight": torch.zeros(2)}
    server = fedper.init_server({**body, "2.weight": torch.zeros(3)}, None)
    assert set(server["server_optimizer"]["v"]) == {"0.weight"} and set(fedper.payload(server)) == {"body"}
    messages = {"body": {"0.weight": torch.tensor([[1.0, -1.0], [3.0, -3.0]])}}
    moved = fedper.aggregate(server, messages, torch.tensor([1.0, 1.0]), torch.tensor([0, 1]))["body"]["0.weight"]
    # first Adam step from m = 0, v = tau^2: x + lr 0.1 d / (sqrt(0.99 tau^2 + 0.01 d^2) + tau), d = +-2
    step = 0.1 * 0.1 * 2 / (math.sqrt(0.99e-6 + 0.01 * 4) + 1e-3)
    torch.testing.assert_close(moved, torch.tensor([step, -step]))


@pytest.mark.parametrize("hp,named", [({"server_optimizer": "adam", "server_momentum": 0.9}, "server_momentum"),
                                      ({"server_tau": 0.01}, "server_tau")])
def test_a_setting_its_optimizer_ignores_is_refused(hp, named):
    with pytest.raises(ConfigError, match=named):
        build("fedavg", hp)
    build("fedavg", {**hp, named: build("fedavg", {}).hp.model_dump()[named]})  # its default may be spelled out
