"""What the benchmark (`bench.run`) and the GPU check (`bench.gpu`) share: the set-ups (random
digits-shaped federations, one-experiment params), side-by-side timing, and the P1 and P3 cases."""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from bench.paths import result_stem
from pfl_tasks.algorithms import build
from pfl_tasks.config import parse_params
from pfl_tasks.data import ClientSplit, FederatedData
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.state import tree_bytes
from pfl_tasks.engine.rounds import InlineSteps, run_round

HYPER = {"fedavg": {}, "fedprox": {"mu": 0.01}, "ditto": {"mu": 0.1},
         "pfedme": {"lam": 15.0, "inner_steps": 5, "personal_lr": 0.01, "beta": 1.0}}
MODELS = {"mlp": {"kind": "mlp", "hidden": [100]},  # 64-100-10
          "cnn": {"kind": "cnn", "channels": [16, 32], "hidden": 64},  # the digits experiment's
          "mlp100k": {"kind": "mlp", "hidden": [512, 128]}}  # 64-512-128-10: 100,234 parameters


# ----------------------------------------------------------------------------- set-ups
def digits_shaped(n_clients: int, per_client: int, image: bool, seed: int = 0) -> FederatedData:
    """Random 8x8 'digits' with a learnable label rule, `per_client` train and a quarter of
    that validation and test samples per client."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, 8, 8) if image else (64,)

    def split(n: int) -> ClientSplit:
        x = torch.randn(n_clients * n, 64, generator=gen)
        y = (x[:, :10].argmax(1) + torch.arange(n_clients).repeat_interleave(n)) % 10
        counts = torch.full((n_clients,), n)
        return ClientSplit(x.reshape(-1, *shape), y, torch.arange(n_clients) * n, counts)

    held_out = max(1, per_client // 4)
    return FederatedData("bench", "classification", 10, shape, split(per_client), split(held_out), split(held_out),
                         "bench")


def experiment(model: str, executor: str, clients_per_round: int, chunk_size: int = 128, device: str = "cpu",
               **engine):
    params = parse_params({
        "datasets": {"bench": {"source": {"name": "digits"}}},
        "experiments": {"bench": {"dataset": "bench", "model": MODELS[model]}},
        "federation": {"rounds": 1, "clients_per_round": clients_per_round},
        "local": {"steps": 10, "batch_size": 32, "optimizer": {"lr": 0.05}},
        "engine": {"executor": executor, "device": device, "orchestrator": "inline", "chunk_size": chunk_size,
                   **engine},
        "algorithms": HYPER,
    })
    return params.experiment("bench")


def interleaved(setups: dict, reps: int, before=lambda: None) -> dict[str, float]:
    """Median seconds of each setup's callable; one warm-up call each, then `reps` rounds of
    all setups in turn, each call after an untimed `before()`. A callable may return the
    perf_counter() at which its work ended, if that was before it returned."""
    for run in setups.values():
        run()
    times = {name: [] for name in setups}
    for _ in range(reps):
        for name, run in setups.items():
            before()
            start = time.perf_counter()
            ended = run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append((ended if isinstance(ended, float) else time.perf_counter()) - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def one_round(fed: Federation):
    state = fed.initial_state()
    steps = InlineSteps(fed.exp.engine.max_workers)
    return lambda: run_round(steps, fed, state, 0)


# ----------------------------------------------------------------------------- P1
def p1(reps: int, ks: list[int], device: str = "cpu") -> list[dict]:
    cases = [("fedavg", "mlp", k) for k in ks] + [(alg, "mlp", ks[0]) for alg in ("fedprox", "ditto", "pfedme")]
    cases.append(("fedavg", "cnn", ks[0]))
    rows = []
    for alg, model, k in cases:
        data = digits_shaped(k, 50, image=model == "cnn")
        feds = {ex: Federation(experiment(model, ex, k, device=device), build(alg, HYPER[alg]), data)
                for ex in ("sequential", "vectorized")}
        t = interleaved({ex: one_round(fed) for ex, fed in feds.items()}, reps)
        rows.append({"case": f"P1 {alg} {model} K={k}", "sequential_s": t["sequential"],
                     "vectorized_s": t["vectorized"], "ratio": t["sequential"] / t["vectorized"],
                     "target": {("fedavg", "mlp", 100): 10, ("fedavg", "mlp", 1000): 20}.get((alg, model, k))})
        print(f"  {rows[-1]['case']}: {rows[-1]['ratio']:.1f}x", flush=True)
    return rows


# ----------------------------------------------------------------------------- P3
def p3(reps: int, ns: list[int], k: int, device: str = "cpu") -> dict:
    feds = {}
    for n in ns:
        fed = Federation(experiment("mlp100k", "vectorized", k, device=device), build("ditto", HYPER["ditto"]),
                         digits_shaped(n, 20, image=False))
        feds[n] = (fed, fed.initial_state())
    t = interleaved({n: (lambda f=f, s=s: run_round(InlineSteps(f.exp.engine.max_workers), f, s, 0))
                     for n, (f, s) in feds.items()}, reps)
    biggest, state = feds[max(ns)]
    start = time.perf_counter()
    biggest.evaluate(state)
    eval_s = time.perf_counter() - start
    params = sum(v.numel() for v in state.server["global"].values()) if "global" in state.server else None
    row = {"case": f"P3 ditto mlp100k K={k} on {device}", "params": params,
           "round_s": {str(n): t[n] for n in ns}, "ratio": max(t.values()) / min(t.values()), "target_max": 1.2,
           "clients_state_bytes": tree_bytes(state.clients), "evaluate_all_s": eval_s,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print(f"  {row['case']}: max/min {row['ratio']:.2f}, N={max(ns)} evaluation {eval_s:.1f}s, "
          f"peak RSS {row['peak_rss_bytes'] / 2**30:.1f} GiB", flush=True)
    return row




def fresh_env() -> dict[str, str]:
    """A subprocess's environment as on a fresh shell in a clone: no Prefect server, MLflow store
    or DVC root inherited, the project importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "DVC_ROOT")}
    return {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def heading(title: str) -> str:
    """A results file's first line: what, when and on which machine."""
    return f"# {title}, {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename} ({os.cpu_count()} cores)"


def write_results(name: str, record, text: str) -> None:
    """bench/results/<today>-<name>.{json,md}, and the text on the console."""
    stem = result_stem(name)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text(text)
    print(text, end="")


# Learn2pFed's polynomial tasks, by params file (its studies and `bench.learn2pfed_selection`)
TASKS = {"params.yaml": ["poly1"],
         "params-extended.yaml": ["poly2", "poly3", "poly1_scarce", "poly2_scarce", "poly3_scarce"]}


def problems(params, experiment: str, seed: int, bias: bool):
    """(train, val, test) stacks of the experiment's partition for `seed`, as the stage builds them."""
    from pfl_tasks.algorithms.learn2pfed_meta import padded_problem
    from pfl_tasks.estimate import built_partition

    exp = params.experiment(experiment)
    data = built_partition(exp.dataset, params.datasets[exp.dataset], seed)

    def features(x):
        flat = x.flatten(1)
        return torch.cat([flat, torch.ones(len(x), 1)], 1) if bias else flat

    return tuple(padded_problem(split, features(split.x), 0, name) for split, name in
                 ((data.train, "training"), (data.val, "validation"), (data.test, "test")))
