import pytest
import torch
from torch.func import functional_call, grad, vmap

from conftest import tiny_params
from pfl_tasks.algorithms import build
from pfl_tasks.config import CNNNet, LinearNet, LSTMNet, MLPNet, parse_params
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.state import replicate
from pfl_tasks.nets import UnrolledLSTM, build_net, head_keys, init_params


@pytest.mark.parametrize("cfg,shape", [
    (CNNNet(kind="cnn"), (1, 8, 8)),
    (CNNNet(kind="cnn", channels=[8, 16, 16]), (1, 28, 28)),
    (MLPNet(kind="mlp", hidden=[20, 10]), (1, 28, 28)),
    (LinearNet(kind="linear"), (60,)),
    (LSTMNet(kind="lstm"), (7,)),
])
def test_nets_vmap_over_stacked_clients(cfg, shape):
    net = build_net(cfg, shape, 10)
    stack = replicate(init_params(net, 0), 3)
    x = torch.randn(3, 5, *shape)
    y = torch.randint(0, 10, (3, 5))

    def loss(p, xb, yb):
        return torch.nn.functional.cross_entropy(functional_call(net, p, (xb,)), yb)

    grads = vmap(grad(loss))(stack, x, y)
    for k in range(3):
        single = grad(loss)({n: v[k] for n, v in stack.items()}, x[k], y[k])
        for name in stack:
            torch.testing.assert_close(grads[name][k], single[name], atol=1e-5, rtol=1e-4)


def test_lstm_matches_torch_lstm_with_a_linear_head():
    net = build_net(LSTMNet(kind="lstm", hidden=12, layers=2), (7,), 1)
    reference = torch.nn.LSTM(1, 12, num_layers=2, batch_first=True)
    net[1].load_state_dict(reference.state_dict())  # same parameter names and shapes
    x = torch.randn(5, 7)
    hidden, _ = reference(x.unsqueeze(-1))
    torch.testing.assert_close(net(x), net[2](hidden[:, -1]))
    assert head_keys(dict(net.named_parameters())) == {"2.weight", "2.bias"}
    torch.manual_seed(3)
    torch_init = torch.nn.LSTM(1, 12, num_layers=2).state_dict()
    torch.manual_seed(3)
    own_init = UnrolledLSTM(1, 12, 2).state_dict()
    assert all(torch.equal(torch_init[k], own_init[k]) for k in torch_init)


def test_lstm_vmaps_over_clients_with_their_own_params():
    net = build_net(LSTMNet(kind="lstm"), (7,), 1)
    params = [init_params(net, seed) for seed in range(3)]
    stack = {name: torch.stack([p[name] for p in params]) for name in params[0]}
    x = torch.randn(3, 4, 7)
    out = vmap(lambda p, xb: functional_call(net, p, (xb,)))(stack, x)
    for k in range(3):
        torch.testing.assert_close(out[k], functional_call(net, params[k], (x[k],)))


def test_init_params_is_seeded_and_leaves_global_rng_alone():
    net = build_net(MLPNet(kind="mlp"), (4,), 2)
    before = torch.random.get_rng_state()
    a, b = init_params(net, 7), init_params(net, 7)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(init_params(net, 8)["1.weight"], a["1.weight"])
    assert torch.equal(torch.random.get_rng_state(), before)


def federation(**federation):
    params = parse_params(tiny_params(federation={"rounds": 2, **federation}))
    from pfl_tasks.data import ClientSplit, FederatedData

    split = ClientSplit(torch.zeros(10, 1, 8, 8), torch.zeros(10, dtype=torch.long),
                        torch.arange(10), torch.ones(10, dtype=torch.long))
    data = FederatedData("d", "classification", 10, (1, 8, 8), split, split, split, "h")
    return Federation(params.experiment("tiny"), build("fedavg", {}), data)


def test_sampling_by_fraction_and_count_is_seeded_without_replacement():
    fed = federation(participation=0.3)
    draws = [fed.sample_clients(r) for r in range(20)]
    assert all(len(d) == 3 and len(set(d.tolist())) == 3 for d in draws)
    assert torch.equal(draws[4], fed.sample_clients(4))
    assert len({tuple(d.tolist()) for d in draws}) > 10
    assert len(federation(clients_per_round=7).sample_clients(0)) == 7
    assert federation(participation=1.0).sample_clients(3).tolist() == list(range(10))


def test_fmnist_experiments_use_pfllibs_fedavg_cnn():
    """params-fmnist.yaml validates, and its CNN is PFLlib's FedAvgCNN: 5x5 unpadded convolutions
    of 32 and 64 channels, each pooled, 1024 flattened features, dense 512 and 10."""
    from pfl_tasks.algorithms import validate_params
    from pfl_tasks.config import load_params
    from pfl_tasks.nets import build_net

    params = validate_params(load_params("params-fmnist.yaml"))
    for name in ("fmnist-dir0.1", "fmnist-dir0.1-cpu"):
        net = build_net(params.experiment(name).model, (1, 28, 28), 10)
        dense = [m for m in net if isinstance(m, torch.nn.Linear)]
        assert [(m.in_features, m.out_features) for m in dense] == [(1024, 512), (512, 10)]
        assert sum(p.numel() for p in net.parameters()) == 582_026
