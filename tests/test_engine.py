"""The vectorized executor against the sequential reference, and the engine's building blocks."""

import pytest
import torch

from conftest import run_rounds, tiny_federation, tiny_params
from pfl_tasks.algorithms import ALGORITHMS
from pfl_tasks.config import parse_params
from pfl_tasks.engine.executor import SequentialTrainer, VectorizedTrainer, batch_schedule
from pfl_tasks.engine.state import tree_map


def run(data, algorithm, executor, rounds=3, hp=None, device="cpu", **overrides):
    fed = tiny_federation(data, algorithm, executor, device, hp, **overrides)
    return fed, run_rounds(fed, fed.initial_state(), 0, rounds)


def assert_trees_close(a, b, atol=1e-5):
    flat_a, flat_b = [], []
    tree_map(flat_a.append, a)
    tree_map(flat_b.append, b)
    assert len(flat_a) == len(flat_b) > 0
    for x, y in zip(flat_a, flat_b):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "local"])
@pytest.mark.parametrize("local", [
    {},
    {"optimizer": {"momentum": 0.9, "weight_decay": 1e-3}},
    {"epochs": 1, "optimizer": {"name": "adam", "lr": 0.01}},
])
def test_vectorized_equals_sequential(digits6, algorithm, local, device):
    fed, vec = run(digits6, algorithm, "vectorized", local=local, device=device)
    _, seq = run(digits6, algorithm, "sequential", local=local, device=device)
    _, start = run(digits6, algorithm, "sequential", rounds=0, local=local, device=device)
    vec_model, _ = fed.algorithm.personalized(vec.server, vec.clients)
    seq_model, _ = fed.algorithm.personalized(seq.server, seq.clients)
    start_model, _ = fed.algorithm.personalized(start.server, start.clients)
    assert_trees_close(vec_model, seq_model)
    assert vec.grad_samples == seq.grad_samples > 0  # the same compute, counted either way
    assert (vec_model["3.weight"] - start_model["3.weight"]).abs().max() > 1e-3  # it trained


def test_fedprox_differs_from_fedavg_when_mu_positive(digits6):
    _, avg = run(digits6, "fedavg", "vectorized")
    _, prox = run(digits6, "fedprox", "vectorized")
    diff = (avg.server["global"]["3.weight"] - prox.server["global"]["3.weight"]).abs().max()
    assert diff > 1e-4


def test_local_only_equals_independent_training_per_client(digits6):
    """Each client's Local-only model (vectorized, chunked beside others) is exactly what a
    plain torch loop over that client's data alone produces."""
    fed, together = run(digits6, "local", "vectorized")
    exp = parse_params(tiny_params()).experiment("tiny")
    init = fed.initial_state().clients["params"]
    for k in range(6):
        params = {name: value[k:k + 1] for name, value in init.items()}
        for r in range(3):
            alone = SequentialTrainer(fed.fresh_net(), "classification", digits6.train,
                                      torch.tensor([k]), exp.local, exp.seed, r)
            params = alone.fit(params)
        for name, value in params.items():
            torch.testing.assert_close(together.clients["params"][name][k], value[0], atol=1e-5, rtol=1e-4)


def test_batches_stay_inside_each_client_and_are_reproducible():
    counts = torch.tensor([5, 40, 17])
    ids = torch.tensor([3, 8, 9])
    local = parse_params(tiny_params()).experiment("tiny").local
    a = batch_schedule(counts, ids, local, seed=0, round_idx=2, stream=0)
    b = batch_schedule(counts, ids, local, seed=0, round_idx=2, stream=0)
    c = batch_schedule(counts, ids, local, seed=0, round_idx=3, stream=0)
    assert torch.equal(a.index, b.index) and not torch.equal(a.index, c.index)
    for k, n in enumerate(counts.tolist()):
        assert (a.index[k][a.mask[k]] < n).all()
        assert a.mask[k].sum(-1).tolist() == [min(16, n)] * 3
    # a client's draws do not depend on who else is in its chunk
    alone = batch_schedule(counts[1:2], ids[1:2], local, seed=0, round_idx=2, stream=0)
    assert torch.equal(alone.index[0], a.index[1][:, :16])
    # draws are whole epochs: every row once before any row twice
    for k, n in enumerate(counts.tolist()):
        drawn = a.index[k][a.mask[k]]
        for epoch in drawn[: len(drawn) // n * n].view(-1, n):
            assert sorted(epoch.tolist()) == list(range(n))
        assert len(set(drawn[len(drawn) // n * n:].tolist())) == len(drawn) % n
    assert not torch.equal(a.index[1], batch_schedule(counts, ids, local, 0, 2, stream=1).index[1])


def test_epochs_budget_gives_each_client_its_own_step_count():
    local = parse_params(tiny_params(local={"epochs": 2})).experiment("tiny").local
    sched = batch_schedule(torch.tensor([5, 40]), torch.tensor([0, 1]), local, 0, 0, 0)
    assert sched.active.sum(1).tolist() == [2, 6]  # 2 * ceil(n / min(16, n))


@pytest.mark.parametrize("budget", [{}, {"epochs": 1}], ids=["steps", "epochs"])  # epochs: uneven step counts
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_vectorized_equals_sequential_for_every_algorithm(digits6, algorithm, device, budget):
    hp = {"feddyn": {"alpha": 0.1}}.get(algorithm, {})
    fed, vec = run(digits6, algorithm, "vectorized", hp=hp, device=device, local=budget)
    _, seq = run(digits6, algorithm, "sequential", hp=hp, device=device, local=budget)
    assert vec.grad_samples == seq.grad_samples  # the last round's compute, counted either way
    assert vec.grad_samples > 0 or algorithm == "l2sgd"  # L2SGD's third round only communicates
    for view in (fed.algorithm.personalized, lambda s, c: (fed.algorithm.global_model(s, c), False)):
        a, _ = view(vec.server, vec.clients)
        b, _ = view(seq.server, seq.clients)
        if a is not None:
            assert_trees_close(a, b)


def test_uneven_clients_cost_their_real_steps_and_results_do_not_depend_on_chunking(digits6):
    """Each vectorized step runs only the clients still within their budget, and how clients
    are chunked changes no result."""
    fed = tiny_federation(digits6, "fedavg", local={"epochs": 1})
    ids = torch.arange(6)
    local = fed.exp.local
    sched = batch_schedule(digits6.train.counts, ids, local, 0, 0, 0)
    steps = sched.active.sum(1)
    assert steps.min() < steps.max()  # uneven
    trainer = VectorizedTrainer(fed.fresh_net(), "classification", fed.train, ids, local, 0, 0)
    _, plans = trainer._plan(sched)
    assert [p.width for p in plans] == [int((steps > s).sum()) for s in range(int(steps.max()))]
    assert sum(p.width for p in plans) == steps.sum()  # no masked steps
    runs = [run(digits6, "fedavg", "vectorized", local={"epochs": 1}, chunk_size=c)[1] for c in (1, 4, 6)]
    for other in runs[1:]:
        assert_trees_close(other.server, runs[0].server, atol=1e-6)


@pytest.mark.parametrize("algorithm,views", [("fedavg", 1), ("ditto", 2), ("local", 1)])
def test_evaluation_runs_once_per_distinct_view(digits6, algorithm, views):
    """FedAvg's personalized model is its global one: evaluated once per split, reported for both."""
    fed, state = run(digits6, algorithm, "vectorized", rounds=1, hp={})
    calls, original = [], fed._eval
    fed._eval = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    result = fed.evaluate(state).metrics
    assert len(calls) == 2 * views * len(fed.chunks(torch.arange(6)))
    assert len(result["val"]["personalized"]["acc"]) == len(result["test"]["personalized"]["acc"]) == 6


def perturbed_start(data):
    """The MLP's initial parameters for 6 clients, each slightly off the others."""
    from pfl_tasks.engine.state import replicate
    from pfl_tasks.nets import init_params

    start = replicate(init_params(tiny_federation(data, "fedavg").net, 0), 6)
    return {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in start.items()}


def fits_by_both_step_forms(data, monkeypatch, start, **fit_args):
    """One fit of the MLP's 6 clients from `start` (1 epoch: uneven budgets), by the stacked
    step and by vmap(grad): {form: (models, compute)}, and how often the stacked step ran."""
    from pfl_tasks.engine import executor

    fed = tiny_federation(data, "fedavg")
    calls = []
    stacked_forward = executor.stacked_forward
    monkeypatch.setattr(executor, "stacked_forward", lambda *a, **k: calls.append(1) or stacked_forward(*a, **k))
    out = {}
    for form, stackable in (("stacked", executor.stackable), ("vmap", lambda net: False)):
        monkeypatch.setattr(executor, "stackable", stackable)
        trainer = VectorizedTrainer(fed.fresh_net(), "classification", fed.train, torch.arange(6),
                                    fed.exp.local.model_copy(update={"epochs": 1, "steps": None}), 0, 0)
        out[form] = (trainer.fit(dict(start), **fit_args), trainer.grad_samples)
    return out, len(calls)


@pytest.mark.parametrize("form", ["data", "proximal", "feddyn", "unmarked", "frozen body"])
def test_the_stacked_step_equals_vmap_grad(digits6, monkeypatch, form):
    """The MLP's stacked step (batched matmuls, autograd on the summed client objectives; a
    frozen body's features computed once a fit) gives every client the model and compute
    count that vmap(grad) gives, for each form of objective: the data loss, clientwise ones
    called once on the stack, and an unmarked one vmapped around the stacked losses."""
    from pfl_tasks.algorithms.base import proximal
    from pfl_tasks.algorithms.feddyn import FedDyn

    start = perturbed_start(digits6)
    anchor = tree_map(lambda t: t.flip(0), start)  # another client's model
    fit_args = {"data": {}, "proximal": {"objective": proximal(0.5), "aux": anchor},
                "feddyn": {"objective": FedDyn(FedDyn.Hyper(alpha=0.1)).objective(),
                           "aux": FedDyn(FedDyn.Hyper(alpha=0.1)).pull_target(anchor, tree_map(lambda t: 0.1 * t, start))},
                "unmarked": {"objective": lambda *args: proximal(0.5)(*args), "aux": anchor},
                "frozen body": {"trainable": {"3.weight", "3.bias"}}}[form]
    out, calls = fits_by_both_step_forms(digits6, monkeypatch, start, **fit_args)
    assert calls > 0  # the stacked form ran
    (stacked, stacked_cost), (vmapped, vmapped_cost) = out["stacked"], out["vmap"]
    assert_trees_close(stacked, vmapped, atol=1e-6)
    assert stacked_cost == vmapped_cost > 0
    moved = {k: (stacked[k] - start[k]).abs().max() for k in start}
    if form == "frozen body":
        assert moved["1.weight"] == 0 and moved["3.weight"] > 1e-3  # only the head trained
    else:
        assert min(moved.values()) > 1e-4


def test_a_stacked_objective_must_take_the_loss_of_its_own_parameters(digits6, monkeypatch):
    def elsewhere(data_loss, params, aux):
        return data_loss({k: 2 * v for k, v in params.items()})

    with pytest.raises(ValueError, match="data loss of the parameters it is given"):
        fits_by_both_step_forms(digits6, monkeypatch, perturbed_start(digits6), objective=elsewhere, aux={})


def test_a_cnn_keeps_the_vmapped_step_and_equals_the_sequential_reference(digits6):
    from pfl_tasks.nets import stackable

    model = {"kind": "cnn", "channels": [4], "hidden": 8}
    fed, vec = run(digits6, "fedprox", "vectorized", model=model)
    _, seq = run(digits6, "fedprox", "sequential", model=model)
    assert not stackable(fed.net) and stackable(tiny_federation(digits6, "fedprox").net)
    assert_trees_close(vec.server, seq.server)


@pytest.mark.parametrize("algorithm", ["pfedme", "pfedmac"])
@pytest.mark.parametrize("optimizer", [{}, {"name": "adam", "lr": 0.01}], ids=["sgd", "adam"])
def test_a_clientwise_scan_step_runs_on_the_whole_stack_and_equals_the_reference(digits6, monkeypatch,
                                                                                 algorithm, optimizer):
    """pFedMe's and pFedMac's steps (nested gradient solves) run once on the MLP's whole stack,
    their data gradients backpropagated by hand (`stacked_backward`), and give the sequential
    reference's models, with per-client Adam step counts too."""
    from pfl_tasks.engine import executor

    calls = []
    stacked_backward = executor.stacked_backward
    monkeypatch.setattr(executor, "stacked_backward", lambda *a: calls.append(1) or stacked_backward(*a))
    local = {"epochs": 1, "optimizer": optimizer}
    fed, vec = run(digits6, algorithm, "vectorized", local=local)
    _, seq = run(digits6, algorithm, "sequential", local=local)
    assert calls  # the stacked form ran
    # Adam divides by its second moment's root, which magnifies the two forms' rounding
    atol = 1e-4 if optimizer else 1e-5
    for view in (fed.algorithm.personalized, lambda s, c: (fed.algorithm.global_model(s, c), False)):
        assert_trees_close(view(vec.server, vec.clients)[0], view(seq.server, seq.clients)[0], atol)


@pytest.mark.parametrize("descend", [False, True], ids=["gradient", "sgd step"])
@pytest.mark.parametrize("trainable", ["all", "head", "body"])
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_backpropagation_by_hand_equals_autograd(trainable, task, descend):
    """`stacked_backward` gives each client the gradient autograd gives it, for a two-hidden-layer
    MLP over image-shaped inputs (Flatten first), for every parameter or only some of them, and
    writes nothing else; with an lr it steps those parameters by -lr times that gradient."""
    from pfl_tasks.engine.executor import VectorizedTrainer
    from pfl_tasks.engine.state import replicate
    from pfl_tasks.nets import build_net, head_keys, init_params, stacked_backward, stacked_forward
    from pfl_tasks.config import MLPNet

    k, b, outputs = 3, 5, 4 if task == "classification" else 1
    net = build_net(MLPNet(kind="mlp", hidden=[6, 5]), (1, 3, 3), outputs)
    gen = torch.Generator().manual_seed(0)
    params = {n: v + 0.1 * torch.randn(v.shape, generator=gen) for n, v in replicate(init_params(net, 0), k).items()}
    x = torch.randn(k, b, 1, 3, 3, generator=gen)
    y = torch.randint(outputs, (k, b), generator=gen) if task == "classification" else torch.randn(k, b, generator=gen)
    mask = torch.ones(k, b)
    mask[0, 3:] = 0  # a client with fewer real rows
    names = {"all": set(params), "head": head_keys(params), "body": set(params) - head_keys(params)}[trainable]

    leaves = {n: v.clone().requires_grad_() for n, v in params.items()}
    out = stacked_forward(net, leaves, x)
    losses = per_sample(task, out, y)
    ((losses * mask).sum(1) / mask.sum(1)).sum().backward()

    trainer = VectorizedTrainer.__new__(VectorizedTrainer)
    trainer.task = task
    saved = []
    out = stacked_forward(net, params, x, saved=saved)
    d_out = trainer._loss_gradient(out, y, mask)
    if descend:
        moved = {n: v.clone() for n, v in params.items()}
        stacked_backward(net, moved, saved, d_out, {n: moved[n] for n in names}, lr=0.5)
        for n in params:
            expected = params[n] - 0.5 * leaves[n].grad if n in names else params[n]
            torch.testing.assert_close(moved[n], expected, atol=1e-6, rtol=1e-5)
        return
    grads = {n: torch.full_like(params[n], float("nan")) for n in names}
    stacked_backward(net, params, saved, d_out, grads)
    assert set(grads) == names
    for n in names:
        torch.testing.assert_close(grads[n], leaves[n].grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_a_step_at_an_interpolation_by_hand_equals_autograd(task):
    """`interpolated_forward` and `interpolated_backward` (APFL's fused step) give each client's
    loss at a v + (1 - a) theta its autograd gradients, for a two-hidden-layer MLP over
    image-shaped inputs: v steps by -lr times the gradient in v (a times the one at the
    interpolation), theta stays, and the derivative in a is returned."""
    from pfl_tasks.config import MLPNet
    from pfl_tasks.engine.state import interpolate, replicate
    from pfl_tasks.nets import build_net, init_params, interpolated_backward, interpolated_forward, stacked_forward

    k, b, outputs = 3, 5, 4 if task == "classification" else 1
    net = build_net(MLPNet(kind="mlp", hidden=[6, 5]), (1, 3, 3), outputs)
    gen = torch.Generator().manual_seed(1)
    base = replicate(init_params(net, 0), k)
    v, theta = ({n: t + 0.3 * torch.randn(t.shape, generator=gen) for n, t in base.items()} for _ in range(2))
    a = torch.tensor([0.2, 0.5, 0.9])
    x = torch.randn(k, b, 1, 3, 3, generator=gen)
    y = torch.randint(outputs, (k, b), generator=gen) if task == "classification" else torch.randn(k, b, generator=gen)
    mask = torch.ones(k, b)
    mask[1, 2:] = 0

    leaves = {n: t.clone().requires_grad_() for n, t in v.items()}
    share = a.clone().requires_grad_()
    losses = per_sample(task, stacked_forward(net, interpolate(share, leaves, theta), x), y)
    ((losses * mask).sum(1) / mask.sum(1)).sum().backward()

    trainer = VectorizedTrainer.__new__(VectorizedTrainer)
    trainer.task = task
    moved, kept = ({n: t.clone() for n, t in tree.items()} for tree in (v, theta))
    saved, gaps = [], {}
    out = interpolated_forward(net, a, moved, kept, x, saved, gaps)
    slope = interpolated_backward(net, a, moved, kept, saved, gaps, trainer._loss_gradient(out, y, mask), lr=0.5)
    torch.testing.assert_close(slope, share.grad, atol=1e-6, rtol=1e-5)
    for n in v:
        torch.testing.assert_close(moved[n], v[n] - 0.5 * leaves[n].grad, atol=1e-6, rtol=1e-5)
        assert torch.equal(kept[n], theta[n])


def per_sample(task, out, y):
    from pfl_tasks.engine.executor import per_sample_loss

    return per_sample_loss(task, out.flatten(0, 1), y.flatten()).view(y.shape)


def penalized_objectives():
    """Each `penalized` objective of the registry, and its aux for a stack of 2 clients from
    two further stacks like the parameters."""
    from pfl_tasks.algorithms.base import proximal
    from pfl_tasks.algorithms.lp_proj import coupled

    proj = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    return {"proximal": (proximal(0.3), lambda anchor, other: anchor),
            "lp_proj": (coupled(0.7, proj), lambda anchor, other: {"w": anchor["w"][:, 0, :3]})}


def test_feddyn_s_pull_toward_its_shifted_anchor_is_the_paper_s_local_gradient():
    """FedDyn's local problem, run as a proximal pull toward anchor + g / alpha, has the paper's
    gradient beyond the data loss, -g_k + alpha (theta - anchor), by autograd on the paper's
    form: a dropped linear term or a flipped sign fails."""
    from pfl_tasks.algorithms.feddyn import FedDyn

    algo = FedDyn(FedDyn.Hyper(alpha=0.2))
    gen = torch.Generator().manual_seed(0)
    theta, anchor, g = ({"w": torch.randn(2, 4, 3, generator=gen), "b": torch.randn(2, 4, generator=gen)}
                        for _ in range(3))
    leaves = {n: v.clone().requires_grad_() for n, v in theta.items()}
    paper = sum(-(g[n] * leaves[n]).sum() + 0.1 * ((leaves[n] - anchor[n]) ** 2).sum() for n in theta)
    paper.backward()
    grads = {n: torch.zeros_like(v) for n, v in theta.items()}
    algo.objective().penalty_gradient(grads, theta, algo.pull_target(anchor, g))
    for n in theta:
        torch.testing.assert_close(grads[n], leaves[n].grad)


@pytest.mark.parametrize("form", ["proximal", "lp_proj"])
def test_a_penalty_gradient_is_the_gradient_of_its_objective_beyond_the_data_loss(form):
    """What the vectorized executor adds to the data loss's gradient by hand is, client by
    client, autograd's gradient of the objective less its data loss: a dropped term or a
    flipped sign fails."""
    objective, aux_of = penalized_objectives()[form]
    gen = torch.Generator().manual_seed(0)
    params, anchor, other = ({"w": torch.randn(2, 4, 3, generator=gen), "b": torch.randn(2, 4, generator=gen)}
                             for _ in range(3))
    aux = aux_of(anchor, other)
    expected = {n: torch.empty_like(v) for n, v in params.items()}
    for k in range(2):  # the objective as written, for one client
        leaves = {n: v[k].clone().requires_grad_() for n, v in params.items()}
        objective(lambda p: sum((v ** 3).sum() for v in p.values()), leaves, tree_map(lambda t: t[k], aux)).backward()
        for n in params:
            expected[n][k] = leaves[n].grad
    grads = {n: 3 * v ** 2 for n, v in params.items()}  # the data loss's own
    objective.penalty_gradient(grads, params, aux)
    for n in params:
        torch.testing.assert_close(grads[n], expected[n])
        assert (grads[n] - 3 * params[n] ** 2).abs().max() > 1e-3  # the penalty counts


def test_one_shared_model_is_evaluated_unpadded_as_the_same_model_per_client(digits6):
    """A shared model's evaluation (every client's rows, unpadded) gives each client exactly
    the numbers its own copy gives in the padded per-client path."""
    from pfl_tasks.engine.evaluate import evaluate_clients
    from pfl_tasks.engine.state import replicate

    fed = tiny_federation(digits6, "fedavg")
    params = fed.initial_state().server["global"]
    ids = torch.tensor([4, 0, 2])
    shared = evaluate_clients(fed.fresh_net(), "classification", fed.splits["test"], ids, params, False)
    copies = evaluate_clients(fed.fresh_net(), "classification", fed.splits["test"], ids, replicate(params, 3), True)
    assert shared["n"].tolist() == digits6.test.counts[ids].float().tolist()
    for metric in ("loss", "acc"):
        torch.testing.assert_close(shared[metric], copies[metric])


def test_apfl_with_a_decaying_step_size_per_client_equals_the_reference(digits6):
    """APFL's clientwise step on the whole stack, where each client's step count sets its own
    lr (decay_mu), gives the sequential reference's models."""
    hp = {"decay_mu": 1.0}
    fed, vec = run(digits6, "apfl", "vectorized", hp=hp, local={"epochs": 1})
    _, seq = run(digits6, "apfl", "sequential", hp=hp, local={"epochs": 1})
    assert_trees_close(fed.algorithm.personalized(vec.server, vec.clients)[0],
                       fed.algorithm.personalized(seq.server, seq.clients)[0])
    torch.testing.assert_close(vec.clients["alpha"], seq.clients["alpha"], atol=1e-5, rtol=1e-4)
    assert vec.clients["alpha"].std() > 0  # each client its own alpha


@pytest.mark.parametrize("numerics,cores,workers,threads,expected", [
    ("native", 2, 2, "auto", 1), ("native", 2, 1, "auto", 1), ("native", 16, 2, "auto", 7),
    ("native", 16, 1, "auto", 15), ("native", 2, 2, 3, 3), ("portable", 16, 1, "auto", 1), ("portable", 2, 2, 3, 3)])
def test_torch_threads_never_outnumber_the_cores_unless_asked(monkeypatch, numerics, cores, workers, threads, expected):
    """auto: one under portable numerics (a reduction's order follows the thread count), else the
    cores less one (the Prefect server's), shared by the chunk workers; a configured count is
    taken as it is; `configure` sets it for the process."""
    from pfl_tasks.config import EngineConfig
    from pfl_tasks.engine import device

    monkeypatch.setattr(device, "usable_cores", lambda: cores)
    monkeypatch.setattr(device.numerics, "active", lambda: numerics)
    engine = EngineConfig(max_workers=workers, threads=threads, numerics=numerics)
    assert device.torch_threads(engine) == expected
    before, onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    try:
        device.configure(engine, torch.device("cpu"))
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
        torch.backends.mkldnn.enabled = onednn
