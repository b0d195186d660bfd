"""Benchmark of the engine and its orchestration. Every figure is a ratio of setups timed side
by side in this one run: repetitions interleave the setups, and each time is a median of
`--reps` (at least 5), because shared machines are noisy.

  P1  vectorized vs sequential executor: one round of the same work with the same seed
  P2  Prefect vs inline orchestration of the digits CNN experiment (params-digits.yaml)'s rounds, with a task
      per step and with one task per round (engine.round_tasks)
  P3  per-round time at K=100 sampled clients for N = 100, 1,000, 10,000 clients of a
      ~100k-parameter model with per-client state (Ditto), all in one process; peak RSS
  P4  uneven clients: vectorized vs sequential FedProx round, one epoch of batch 8 per client,
      on FedProx Synthetic(0.5, 0.5) (natural lognormal sizes, linear model) and on digits
      Dirichlet(0.1); and what one vmapped step costs eager and under torch.compile
  P8  first its vectorized round under portable and under native numerics (`engine.numerics`),
      each mode in processes of its own, alternating; then the standard-protocol round (mnist,
      MLP 784-100-10, 1 epoch of batch 10, all 20 clients,
      1 thread, evaluated) of every registered algorithm, vectorized and sequential, against its
      floor (counted sample-passes x FLOPs per pass / this machine's measured matmul rate); and
      the share of a training run's evaluated round that its bookkeeping takes (against the same
      rounds played bare, half before the run and half after); and a stage's fixed costs
      (`flows.train`'s --help, a config error, process start to a 1-round run's first round)
  profile  where one default training run's time goes, model math or not

    make bench                        # = python -m bench.run
    python -m bench.run --quick       # smaller K and reps: a smoke run
    python -m bench.run --only-p8     # P8 alone, about 6 minutes
    python -m bench.run --numerics-only  # P8's round under portable vs native numerics, about 4 minutes
    python -m bench.run --device cuda # the GPU check (bench/gpu.py), about 5 minutes

Writes bench/results/<date>-<host>.json, .md and .png (-numerics.json and .md for the numerics
alone, -cuda.json and .md for the GPU check)
and prints the table. Only P2 and the profile need Prefect and MLflow.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import functools
import json
import os
import platform
import pstats
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from bench.common import MODELS, interleaved, one_round, p1, p3
from bench.paths import RESULTS, result_stem
from pfl_tasks import numerics
from pfl_tasks.algorithms import ALGORITHMS, build
from pfl_tasks.code_deps import ROOT
from pfl_tasks.config import TrackingConfig, load_params, parse_params
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.rounds import InlineSteps, run_round

# ----------------------------------------------------------------------------- P4
UNEVEN = {
    "Synthetic(0.5, 0.5) natural, 30 clients, linear": (
        {"source": {"name": "synthetic", "alpha": 0.5, "beta": 0.5, "n_clients": 30, "size_max": 2000},
         "partition": {"kind": "natural"}}, {"kind": "linear"}, 10),
    "digits Dirichlet(0.1), 20 clients, mlp": (
        {"source": {"name": "digits"}, "partition": {"kind": "dirichlet", "n_clients": 20, "alpha": 0.1,
                                                     "min_samples": 10}}, MODELS["mlp"], None),
}


def uneven_federation(dataset: dict, model: dict, executor: str, device: str = "cpu") -> Federation:
    """FedProx (mu 0.01) on `dataset`'s seed-0 partition, one epoch of batch 8 per round."""
    from pfl_tasks.estimate import built_partition

    params = parse_params({
        "datasets": {"d": dataset}, "experiments": {"e": {"dataset": "d", "model": model, "algorithms": ["fedprox"]}},
        "federation": {"rounds": 1}, "local": {"epochs": 1, "batch_size": 8, "optimizer": {"lr": 0.05}},
        "engine": {"executor": executor, "device": device, "orchestrator": "inline"}})
    data = built_partition("d", params.datasets["d"], 0)
    return Federation(params.experiment("e"), build("fedprox", {"mu": 0.01}), data)


def p4(reps: int, device: str = "cpu") -> list[dict]:
    rows = []
    for case, (dataset, model, target) in UNEVEN.items():
        feds = {ex: uneven_federation(dataset, model, ex, device) for ex in ("sequential", "vectorized")}
        counts = feds["vectorized"].train.counts
        steps = -(-counts // counts.clamp(max=8))
        t = interleaved({ex: one_round(fed) for ex, fed in feds.items()}, reps)
        rows.append({"case": f"P4 fedprox {case}, 1 epoch of batch 8", "sequential_s": t["sequential"],
                     "vectorized_s": t["vectorized"], "ratio": t["sequential"] / t["vectorized"], "target": target,
                     "client_steps": int(steps.sum()), "padded_client_steps": len(steps) * int(steps.max()),
                     "vmapped_steps": int(steps.max())})
        print(f"  {rows[-1]['case']}: {rows[-1]['ratio']:.1f}x", flush=True)
    return rows


def compiled_step(reps: int) -> dict:
    """One vmapped FedProx SGD step of 30 linear clients (the P4 Synthetic shapes: 60 features,
    10 classes, batch 8), eager and under torch.compile; and the compile's one-off cost."""
    from torch.func import functional_call, grad, vmap
    import torch.nn.functional as F

    k, batch, features, classes = 30, 8, 60, 10
    gen = torch.Generator().manual_seed(0)
    net = torch.nn.Linear(features, classes)
    params = {n: torch.randn(k, *v.shape, generator=gen) for n, v in net.named_parameters()}
    anchor = {n: v.clone() for n, v in params.items()}
    x, y = torch.randn(k, batch, features, generator=gen), torch.randint(classes, (k, batch), generator=gen)

    def objective(p, g, x, y):
        prox = sum(((p[n] - g[n]) ** 2).sum() for n in p)
        return F.cross_entropy(functional_call(net, p, (x,)), y) + 0.005 * prox

    grads_of = vmap(grad(objective))

    def sgd_step(p, g, x, y):
        grads = grads_of(p, g, x, y)
        return {n: p[n] - 0.05 * grads[n] for n in p}

    compiled = torch.compile(sgd_step)
    start = time.perf_counter()
    compiled(params, anchor, x, y)
    compile_s = time.perf_counter() - start

    def many(step):
        return lambda: [step(params, anchor, x, y) for _ in range(100)]

    t = interleaved({"eager": many(sgd_step), "compiled": many(compiled)}, reps)
    row = {"case": "P4 one vmapped FedProx step, 30 linear clients", "eager_us": t["eager"] * 1e4,
           "compiled_us": t["compiled"] * 1e4, "ratio": t["eager"] / t["compiled"], "compile_s": compile_s}
    print(f"  {row['case']}: eager {row['eager_us']:.0f}us, compiled {row['compiled_us']:.0f}us, "
          f"compile {compile_s:.0f}s", flush=True)
    return row


# ----------------------------------------------------------------------------- P8
P8_PROTOCOL = "mnist (MNIST-5k, Dirichlet(0.1), 20 clients), MLP 784-100-10, 1 epoch of batch 10, SGD lr 0.05, " \
              "all 20 clients, 1 torch thread, every round evaluated"


def matmul_gflops(reps: int) -> float:
    """This machine's 1-thread float32 matmul throughput: the median of `reps` 1024x1024 products."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        times.append((time.perf_counter() - start) / 10)
    return 2 * 1024**3 / statistics.median(times) / 1e9


def p8_federation(algorithm: str, executor: str, hyper: dict | None = None) -> Federation:
    """The standard local protocol on the default benchmark's partition (seed 0), the
    algorithm at its paper defaults, or with `hyper` changed."""
    base = load_params("params.yaml")
    params = parse_params({
        "datasets": {"mnist": base.datasets["mnist"].model_dump(mode="json")},
        "experiments": {"p8": {"dataset": "mnist", "model": {"kind": "mlp", "hidden": [100]}, "algorithms": [algorithm]}},
        "federation": {"rounds": 1, "eval_every": 1}, "local": {"epochs": 1, "batch_size": 10, "optimizer": {"lr": 0.05}},
        "engine": {"executor": executor, "device": "cpu", "orchestrator": "inline", "numerics": numerics.active()},
        "algorithms": {algorithm: hyper or {}}})
    exp = params.experiment("p8")
    return Federation(exp, build(algorithm, exp.hyper[algorithm]), p8_data())


@functools.cache
def p8_data():
    """The default benchmark's mnist partition, seed 0, built once a process."""
    from pfl_tasks.estimate import built_partition

    return built_partition("mnist", load_params("params.yaml").datasets["mnist"], 0)


def evaluated_round(fed: Federation):
    """A callable playing the next round and evaluating every client, as a run with
    eval_every 1 does; it adds the round's counted sample-passes to `passes`: training
    (forward-backward, and any fine-tuning at evaluation) and evaluation (forward only)."""
    state, done = fed.initial_state(), [0]
    passes = {"train": [], "forward": []}
    evaluate_rows, original = [0], fed._eval

    def counting_eval(split, ids, *args, **kwargs):
        evaluate_rows[0] += int(fed.splits[split].counts[ids.cpu()].sum())
        return original(split, ids, *args, **kwargs)

    fed._eval = counting_eval

    def play():
        nonlocal state
        state = run_round(InlineSteps(1), fed, state, done[0])
        evaluate_rows[0] = 0
        evaluation = fed.evaluate(state)
        passes["train"].append(state.grad_samples + evaluation.grad_samples)
        passes["forward"].append(evaluate_rows[0])
        done[0] += 1

    return play, passes


MATMULS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::baddbmm_", "aten::addmm_"}


def matmul_seconds(play) -> float:
    """CPU seconds one call of `play` spends inside matrix-product kernels (torch's profiler):
    the round's arithmetic as these kernels run it at its shapes, the method's own included."""
    from torch.profiler import profile

    with profile() as prof:
        play()
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMULS) / 1e6


def p8(reps: int, algorithms: list[str]) -> dict:
    """Every registered algorithm's evaluated round on the standard protocol, vectorized and
    sequential, against its floor: its counted sample-passes times the model's FLOPs per pass
    (6 x multiply-adds for a forward-backward pass, 2 x for a forward one) over this machine's
    1-thread matmul throughput, measured in the same run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gflops = matmul_gflops(max(reps, 5))
        rows = []
        for name in algorithms:
            feds = {ex: p8_federation(name, ex) for ex in ("vectorized", "sequential")}
            macs = sum(m.weight.numel() for m in feds["vectorized"].net if isinstance(m, torch.nn.Linear))
            played = {ex: evaluated_round(fed) for ex, fed in feds.items()}
            t = interleaved({ex: play for ex, (play, _) in played.items()}, reps)
            passes = played["vectorized"][1]
            train, forward = statistics.median(passes["train"]), statistics.median(passes["forward"])
            floor_s = (6 * train + 2 * forward) * macs / (gflops * 1e9)
            kernels_s = matmul_seconds(played["vectorized"][0])
            rows.append({"algorithm": name, "vectorized_s": t["vectorized"], "sequential_s": t["sequential"],
                         "matmul_kernels_s": kernels_s, "over_kernels": t["vectorized"] / kernels_s,
                         "speedup": t["sequential"] / t["vectorized"], "floor_s": floor_s,
                         "over_floor": t["vectorized"] / floor_s, "train_passes": train, "forward_passes": forward,
                         "target_over_floor": 4 if name == "fedavg" else 8})
            print(f"  {name}: {1e3 * t['vectorized']:.0f} ms, {rows[-1]['over_floor']:.1f}x floor, "
                  f"{rows[-1]['speedup']:.1f}x sequential", flush=True)
    finally:
        torch.set_num_threads(threads)
    return {"case": f"P8 the standard-protocol round: {P8_PROTOCOL}", "matmul_gflops": gflops,
            "multiply_adds_per_sample": macs, "rows": rows}


def p8_vectorized(reps: int, algorithms: list[str]) -> dict[str, float]:
    """algorithm -> the median seconds of its vectorized evaluated P8 round, 1 thread, in this
    process's numerics."""
    torch.set_num_threads(1)
    return {name: interleaved({name: evaluated_round(p8_federation(name, "vectorized"))[0]}, reps)[name]
            for name in algorithms}


def p8_numerics(reps: int, algorithms: list[str]) -> dict:
    """P8's vectorized round under portable and under native numerics, each in processes of its
    own (they are pinned before torch loads), alternating: `reps` processes a mode, each the
    median of 3 rounds an algorithm; the ratio is portable's median over native's."""
    seconds = {mode: {name: [] for name in algorithms} for mode in numerics.NUMERICS}
    for _ in range(reps):
        for mode in numerics.NUMERICS:
            env = {**{k: v for k, v in os.environ.items() if k not in numerics.PORTABLE}, "PFL_BENCH_NUMERICS": mode}
            out = subprocess.run([sys.executable, "-m", "bench.run", "--p8-vectorized", *algorithms], env=env,
                                 cwd=ROOT, capture_output=True, text=True, check=True)
            for name, value in json.loads(out.stdout.splitlines()[-1]).items():
                seconds[mode][name].append(value)
    rows = [{"algorithm": name, **{f"{mode}_s": statistics.median(seconds[mode][name]) for mode in seconds},
             "portable_over_native": statistics.median(seconds["portable"][name])
             / statistics.median(seconds["native"][name])} for name in algorithms]
    for row in rows:
        print(f"  {row['algorithm']}: portable {1e3 * row['portable_s']:.0f} ms, native {1e3 * row['native_s']:.0f} ms, "
              f"{row['portable_over_native']:.2f}x", flush=True)
    return {"case": f"P8's vectorized round under portable vs native numerics ({P8_PROTOCOL})", "reps": reps,
            "rows": rows, "median_ratio": statistics.median(r["portable_over_native"] for r in rows)}


class TimedSteps(InlineSteps):
    """Inline steps that note the run's CPU time when each round of a training run starts (this
    process's, every thread's, and its children's: the MLflow store process's, found once at
    the first round, since looking for children scans every process), and the main thread's
    CPU time inside each round and evaluation."""

    def __init__(self):
        super().__init__(1)
        self.starts, self.engine, self.children = [], [], None

    def round(self, fed, state, round_idx):
        if self.children is None:
            import psutil

            self.children = psutil.Process().children()
        self.starts.append(time.process_time() + sum(sum(child.cpu_times()[:2]) for child in self.children))
        return self._timed(super().round, fed, state, round_idx)

    def evaluate(self, fed, done, state):
        return self._timed(super().evaluate, fed, done, state)

    def _timed(self, step, *args):
        start = time.thread_time()
        try:
            return step(*args)
        finally:
            self.engine.append(time.thread_time() - start)


def p8_bookkeeping(rounds: int, reps: int) -> dict:
    """What a training run (`train_run`: MLflow, the run's history and outputs, its console
    line, its checks) adds to each evaluated round on the P8 setup with FedAvg, evaluation every
    round, 1 thread: the CPU time from the first round's start to the last's of every thread of
    the process and of the MLflow store process (the run's start and finish not counted), less
    the main thread's CPU time inside those rounds and their evaluations, as a share of the
    former; the median over `reps` runs, each into a fresh output and MLflow store, and their
    range. Both from the same run: the difference against rounds played bare in other minutes
    moved by ten points from run to run on a shared VM, more than the effect measured."""
    from flows.prepare import prepare
    from pfl_tasks.training import train_run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    exp = p8_federation("fedavg", "vectorized").exp
    exp = exp.model_copy(update={"federation": exp.federation.model_copy(
        update={"rounds": rounds, "checkpoint_every": rounds}), "seed": 0, "dataset": "mnist"})
    shares, round_s, engine_s = [], [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prepare("mnist", "params.yaml", Path(tmp) / "data" / "partitions")
            for rep in range(reps):
                root = Path(tmp) / f"run-{rep}"
                shutil.copytree(Path(tmp) / "data", root / "data")
                steps = TimedSteps()
                train_run(exp, "fedavg", {}, root, steps,
                          tracking=TrackingConfig(mlflow_uri=f"sqlite:///{root}/mlflow.db"))
                window = len(steps.starts) - 1  # rounds between the first start and the last
                round_s.append((steps.starts[-1] - steps.starts[0]) / window)
                engine_s.append(sum(steps.engine[: 2 * window]) / window)  # a round, then its evaluation
                shares.append(1 - engine_s[-1] / round_s[-1])
    finally:
        torch.set_num_threads(threads)
    row = {"case": f"P8 bookkeeping: fedavg training runs of {rounds} rounds, every round evaluated and logged",
           "reps": reps, "round_s": statistics.median(round_s), "engine_s": statistics.median(engine_s),
           "share": statistics.median(shares), "share_range": [min(shares), max(shares)], "target_max": 0.10}
    print(f"  bookkeeping {100 * row['share']:.1f}% of an evaluated round's CPU time (median of {reps} runs, "
          f"{100 * min(shares):.1f} to {100 * max(shares):.1f}%; {1e3 * row['round_s']:.0f} ms, "
          f"{1e3 * row['engine_s']:.0f} ms in the engine)", flush=True)
    return row


def answer_seconds(command: list[str], cwd: Path, status: int, until: str = "") -> float:
    """Wall seconds from starting `python -m <command>` to its first output line containing
    `until` (to its exit, if empty); the process then runs to its end, which must be `status`."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", *command], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    seconds, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if until and seconds is None and until in line:
            seconds = time.perf_counter() - start
    if proc.wait() != status or (until and seconds is None):
        raise RuntimeError(f"{' '.join(command)}: exit {proc.returncode}, no line with {until!r}:\n"
                           + "".join(lines[-20:]))
    return seconds if until else time.perf_counter() - start


def p8_start(reps: int) -> dict:
    """A stage's fixed costs as its user meets them, medians over `reps` fresh processes: `--help`;
    a config error to its one line (an unknown key, answered before torch; a bad hyper-parameter,
    which needs torch); and the start of a 1-round FedAvg run of `make run`'s mnist experiment
    (`flows.train`, inline orchestration: under `make run` the stages share one Prefect server)
    to the console line of its first evaluated round, into a fresh MLflow store (the first stage
    ever) and into an existing one (every later stage: no migrations)."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    mnist = {**raw["experiments"]["mnist"], "algorithms": ["fedavg"], "seeds": [0], "run_overrides": {},
             "federation": {"rounds": 1, "eval_every": 1, "checkpoint_every": 1}}
    cases = {"unknown key": {"federation": {**raw["federation"], "roundz": 1}},
             "hyper-parameter": {"algorithms": {**raw["algorithms"], "fedavg": {"weighting": "nosuch"}}}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = {k: v for k, v in raw.items() if k not in ("tuning", "tables")}
        base.update(datasets={"mnist": raw["datasets"]["mnist"]}, experiments={"mnist": mnist},
                    engine={**raw["engine"], "orchestrator": "inline"})
        (tmp / "run.yaml").write_text(yaml.safe_dump(base))
        for case, change in cases.items():
            (tmp / f"{case}.yaml").write_text(yaml.safe_dump({**base, **change}))
        from flows.prepare import prepare

        prepare("mnist", str(tmp / "run.yaml"), tmp / "data" / "partitions")
        seconds = {"--help": [], "unknown key": [], "hyper-parameter": [], "first round": [],
                   "first round, existing store": []}
        for rep in range(reps):
            seconds["--help"].append(answer_seconds(["flows.train", "--help"], tmp, 0))
            for case in cases:
                seconds[case].append(answer_seconds(["flows.train", "mnist", "--params", f"{case}.yaml"], tmp, 2,
                                                    "train failed:"))
            run = tmp / f"run-{rep}"
            shutil.copytree(tmp / "data", run / "data")
            seconds["first round"].append(answer_seconds(
                ["flows.train", "mnist", "--params", str(tmp / "run.yaml"), "--root", "."], run, 0, " round 1:"))
            again = tmp / f"run-{rep}-existing-store"  # its own outputs, the store the run above made
            shutil.copytree(tmp / "data", again / "data")
            shutil.copy(run / "mlflow.db", again / "mlflow.db")
            seconds["first round, existing store"].append(answer_seconds(
                ["flows.train", "mnist", "--params", str(tmp / "run.yaml"), "--root", "."], again, 0, " round 1:"))
    row = {"case": "P8 start: flows.train's --help, a config error's line, and a 1-round FedAvg run of make run's mnist "
                   "experiment (inline orchestration) to its first round's console line, into a fresh MLflow store "
                   "and into an existing one",
           "seconds": {k: statistics.median(v) for k, v in seconds.items()},
           "targets": {"--help": 2.0, "unknown key": 2.0, "hyper-parameter": 2.0, "first round": 3.0,
                       "first round, existing store": 3.0}}
    print("  " + ", ".join(f"{k} {v:.1f} s" for k, v in row["seconds"].items()), flush=True)
    return row


# ----------------------------------------------------------------------------- P2
def server_quiet(timeout: float = 60.0) -> float:
    """Wait until the processes this one started (the temporary Prefect server) use under 5% of
    a core for longer than the server's flush interval (it records task runs from their events
    in batches, after they ran); the time they went quiet, at the start of that window."""
    import psutil
    from prefect.settings import get_current_settings

    services = get_current_settings().server.services
    window = 0.5 + max(services.task_run_recorder.flush_interval, services.event_persister.flush_interval)

    def cpu_seconds() -> float:
        total = 0.0
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += sum(child.cpu_times()[:2])
        return total

    deadline, last = time.perf_counter() + timeout, cpu_seconds()
    while time.perf_counter() < deadline:
        time.sleep(window)
        now = cpu_seconds()
        if now - last < 0.05 * window:
            return time.perf_counter() - window
        last = now
    raise RuntimeError(f"the Prefect server stayed busy for {timeout:.0f}s after a benchmark run")


def p2(reps: int, rounds: int) -> list[dict]:
    """Per-round time of inline steps against Prefect flows with a task per step and with one
    task per round (engine.round_tasks), each setup one flow run of `rounds` rounds."""
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.prepare import prepare
    from flows.prefect_rounds import PrefectSteps, RoundSteps

    params = load_params("params-digits.yaml")
    exp = params.experiment("digits").model_copy(update={"seed": 0})
    with tempfile.TemporaryDirectory() as tmp:
        from pfl_tasks.data import load_partition

        data = load_partition(prepare("digits", "params-digits.yaml", Path(tmp)) / "seed-0")
    fed = Federation(exp, build("fedavg", exp.hyper["fedavg"]), data)
    every, workers = exp.federation.eval_every, exp.engine.max_workers

    def rounds_with(steps):
        state = fed.initial_state()
        for r in range(rounds):
            state = steps.round(fed, state, r)
            if (r + 1) % every == 0:
                steps.evaluate(fed, r + 1, state)

    def prefect_flow(make_steps):
        @flow(name="bench-rounds", persist_result=False, task_runner=ThreadPoolTaskRunner(max_workers=workers))
        def prefect_rounds():
            rounds_with(make_steps())

        return lambda: (prefect_rounds(), server_quiet())[1]

    # a Prefect run's time includes the server's catching up; every run starts on a quiet server
    t = interleaved({"inline": lambda: rounds_with(InlineSteps(workers)),
                     "steps": prefect_flow(PrefectSteps), "round": prefect_flow(lambda: RoundSteps(workers))},
                    reps, before=server_quiet)
    chunks = len(fed.chunks(fed.sample_clients(0)))
    rows = []
    for mode, tasks in (("steps", 2 + chunks), ("round", 1)):
        rows.append({"case": f"P2 digits fedavg, {rounds} rounds, round_tasks={mode}: {tasks} task run(s) per round "
                             f"+ evaluate every {every}", "round_tasks": mode,
                     "inline_s_per_round": t["inline"] / rounds, "prefect_s_per_round": t[mode] / rounds,
                     "overhead": t[mode] / t["inline"] - 1, "target_max": 0.10})
        print(f"  {rows[-1]['case']}: overhead {100 * rows[-1]['overhead']:.1f}%", flush=True)
    return rows


# ----------------------------------------------------------------------------- profile
def profile(rounds: int) -> dict:
    """cProfile of a digits CNN training run (params-digits.yaml) (inline, FedAvg) as a `train` stage runs it:
    the second run of the process, on an existing MLflow store, so one-off imports and store
    creation are left out. Shares of its wall time."""
    from flows.prepare import prepare
    from pfl_tasks.training import train_run

    params = load_params("params-digits.yaml")
    exp = params.experiment("digits")
    exp = exp.model_copy(update={"federation": exp.federation.model_copy(update={"rounds": rounds})})
    with tempfile.TemporaryDirectory() as tmp:
        prepare("digits", "params-digits.yaml", Path(tmp) / "data" / "partitions")

        def run(seed: int):
            train_run(exp.model_copy(update={"seed": seed}), "fedavg", exp.hyper["fedavg"], Path(tmp),
                      InlineSteps(2), tracking=TrackingConfig(mlflow_uri=f"sqlite:///{tmp}/mlflow.db"))

        run(0)
        prof = cProfile.Profile()
        prof.enable()
        run(1)
        prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (calls, ..., total, cumulative, ...)
    total = max(v[3] for v in stats.values())  # the outermost call's cumulative time

    def share(*names: str, file: str = "") -> float:
        return sum(v[3] for (f, _, name), v in stats.items() if name in names and f.endswith(file)) / total

    shares = {
        "local updates (model math)": share("local_update", file="federation.py"),
        "evaluation": share("evaluate", file="federation.py"),
        "checkpoints": share("save_checkpoint"),
        "MLflow": share("__init__", "log_params_and_tags", "log_metrics", "log_artifacts", "finish",
                        file="tracking.py"),
        "learning-curve PNG": share("learning_curve_png"),
    }
    shares["rest (data loading, set-up)"] = 1 - sum(shares.values())
    row = {"case": f"profile: a digits fedavg run of {rounds} rounds, inline, warm process", "total_s": total,
           "shares": shares}
    print("  " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items()), flush=True)
    return row


# ----------------------------------------------------------------------------- report
def machine() -> dict:
    return {"host": socket.gethostname(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "python": platform.python_version()}


def numerics_markdown(result: dict) -> list[str]:
    cost = result["p8_numerics"]
    lines = [f"{cost['case']}: medians over {cost['reps']} processes a mode, alternating. Portable costs "
             f"{cost['median_ratio']:.2f}x native at the median algorithm; it is the default because only it gives "
             "the same bits on every x86-64 CPU (pfl_tasks/numerics.py).", "",
             "| algorithm | portable | native | portable / native |", "|---|---|---|---|"]
    lines += [f"| {r['algorithm']} | {1e3 * r['portable_s']:.0f} ms | {1e3 * r['native_s']:.0f} ms "
              f"| {r['portable_over_native']:.2f}x |" for r in cost["rows"]]
    return lines + [""]


def p8_markdown(result: dict) -> list[str]:
    p8, book = result["p8"], result["p8_bookkeeping"]
    lines = [f"{p8['case']}. Floor: the round's counted sample-passes x {p8['multiply_adds_per_sample']:,} "
             f"multiply-adds x 6 (forward-backward) or 2 (evaluation's forward), over this machine's 1-thread "
             f"matmul throughput measured in this run, {p8['matmul_gflops']:.0f} GFLOP/s. Medians of interleaved "
             "evaluated rounds. Matmul kernels: the CPU time one more vectorized round spends inside matrix-product "
             "kernels (torch's profiler), its arithmetic at the shapes it runs, the method's own included.", "",
             "| algorithm | vectorized | sequential | vectorized / sequential | floor | round / floor | target | met "
             "| matmul kernels | round / kernels |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in p8["rows"]:
        lines.append(f"| {r['algorithm']} | {1e3 * r['vectorized_s']:.0f} ms | {1e3 * r['sequential_s']:.0f} ms "
                     f"| {r['speedup']:.1f}x | {1e3 * r['floor_s']:.1f} ms | {r['over_floor']:.1f}x "
                     f"| ≤ {r['target_over_floor']}x | {'yes' if r['over_floor'] <= r['target_over_floor'] else 'NO'} "
                     f"| {1e3 * r['matmul_kernels_s']:.0f} ms | {r['over_kernels']:.1f}x |")
    lines += ["", f"{book['case']}: {1e3 * book['round_s']:.0f} ms of CPU a round, {1e3 * book['engine_s']:.0f} ms "
              f"of it the main thread's inside the round and its evaluation (medians of {book['reps']} runs), so "
              f"bookkeeping (MLflow, outputs, console) is {100 * book['share']:.1f}% of it (from "
              f"{100 * book['share_range'][0]:.1f} to {100 * book['share_range'][1]:.1f}% by run) "
              f"(target ≤ {100 * book['target_max']:.0f}%: "
              f"{'yes' if book['share'] <= book['target_max'] else 'NO'}).", ""]
    start = result.get("p8_start")
    if start:
        lines += [f"{start['case']}, wall seconds, medians: " + "; ".join(
            f"{k} {v:.1f} s (target ≤ {start['targets'][k]:.0f} s: {'yes' if v <= start['targets'][k] else 'NO'})"
            for k, v in start["seconds"].items()) + ".", ""]
    return lines


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Benchmark {result['date']} on {m['host']}", "",
             f"{m['cores']} cores, {m['torch_threads']} torch threads, device {m['device']}, torch {m['torch']}; "
             f"medians of {result['reps']} interleaved repetitions.", "",
             *numerics_markdown(result)]
    if "p8" not in result:
        return "\n".join(lines)
    lines += [*p8_markdown(result), "| case | measured | ratio | target | met |", "|---|---|---|---|---|"]
    if "p1" not in result:
        return "\n".join(lines[:-2]) + "\n"
    for r in result["p1"]:
        met = "" if r["target"] is None else ("yes" if r["ratio"] >= r["target"] else "NO")
        lines.append(f"| {r['case']} (sequential / vectorized) | {r['sequential_s']:.3f}s / {r['vectorized_s']:.3f}s "
                     f"| {r['ratio']:.1f}x | {'≥ %dx' % r['target'] if r['target'] else ''} | {met} |")
    for r in result["p2"]:
        lines.append(f"| {r['case']} (Prefect / inline, per round) | {r['prefect_s_per_round']:.3f}s / "
                     f"{r['inline_s_per_round']:.3f}s | {100 * r['overhead']:+.1f}% | ≤ +10% | "
                     f"{'yes' if r['overhead'] <= r['target_max'] else 'NO'} |")
    for r in result.get("p4", []):
        met = "" if r["target"] is None else ("yes" if r["ratio"] >= r["target"] else "NO")
        lines.append(f"| {r['case']} (sequential / vectorized; {r['client_steps']} client-steps, "
                     f"{r['padded_client_steps']} if padded, {r['vmapped_steps']} vmapped steps) "
                     f"| {r['sequential_s']:.3f}s / {r['vectorized_s']:.3f}s | {r['ratio']:.1f}x "
                     f"| {'≥ %dx' % r['target'] if r['target'] else ''} | {met} |")
    if "p4_compiled" in result:
        r = result["p4_compiled"]
        lines.append(f"| {r['case']} (eager / torch.compile; compiling took {r['compile_s']:.0f}s) "
                     f"| {r['eager_us']:.0f}us / {r['compiled_us']:.0f}us | {r['ratio']:.1f}x | | |")
    r = result["p3"]
    per_n = ", ".join(f"N={n}: {s:.3f}s" for n, s in r["round_s"].items())
    lines.append(f"| {r['case']} (round time, max / min over N) | {per_n} | {r['ratio']:.2f}x | ≤ 1.2x "
                 f"| {'yes' if r['ratio'] <= r['target_max'] else 'NO'} |")
    lines += ["", f"P3 at N={max(map(int, r['round_s']))}: {r['params']:,} parameters per model, client state "
              f"{r['clients_state_bytes'] / 2**30:.2f} GiB, evaluation of every client {r['evaluate_all_s']:.1f}s, "
              f"peak RSS of the process {r['peak_rss_bytes'] / 2**30:.2f} GiB."]
    if "profile" in result:
        p = result["profile"]
        lines += ["", f"{p['case']}: {p['total_s']:.1f}s; " + ", ".join(
            f"{k} {100 * v:.0f}%" for k, v in p["shares"].items())]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    p1 = result["p1"] + result.get("p4", [])
    axes[0].barh([r["case"][3:] for r in p1], [r["ratio"] for r in p1])
    for target in {r["target"] for r in p1 if r["target"]}:
        axes[0].axvline(target, ls="--", color="gray")
    axes[0].set(xlabel="sequential / vectorized", title="P1 speed-up", xscale="log")
    p2 = result["p2"]
    axes[1].bar(["inline"] + [r["round_tasks"] for r in p2],
                [p2[0]["inline_s_per_round"]] + [r["prefect_s_per_round"] for r in p2])
    axes[1].set(ylabel="seconds per round", title="P2 Prefect overhead " + ", ".join(
        f"{100 * r['overhead']:+.0f}%" for r in p2))
    p3 = result["p3"]
    axes[2].plot([int(n) for n in p3["round_s"]], list(p3["round_s"].values()), marker="o")
    axes[2].set(xscale="log", xlabel="total clients N", ylabel="seconds per round (K=100)",
                title=f"P3 max/min {p3['ratio']:.2f}x", ylim=(0, None))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="K=20/100 and N up to 1,000: a smoke run")
    parser.add_argument("--only-p8", action="store_true", help="P8 alone (about 5 minutes)")
    parser.add_argument("--p8-vectorized", nargs="+", metavar="ALGORITHM", help=argparse.SUPPRESS)  # p8_numerics' child
    parser.add_argument("--numerics-only", action="store_true", help="P8 under portable vs native numerics alone")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the GPU check instead (bench/gpu.py: tests, P1/P3, CPU vs CUDA, traffic, determinism)")
    args = parser.parse_args(argv)
    if args.reps < 5 and not args.quick:
        parser.error("--reps must be at least 5")
    reps = 2 if args.quick else args.reps
    if args.p8_vectorized:
        print(json.dumps(p8_vectorized(3, args.p8_vectorized)))
        return 0
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(), "reps": reps}
    if args.device == "cuda":
        from bench import gpu

        return gpu.main(result, RESULTS)
    from flows.environment import local_defaults

    local_defaults()  # before Prefect and MLflow load
    print("P8 under portable vs native numerics", flush=True)
    result["p8_numerics"] = p8_numerics(reps, sorted(ALGORITHMS))
    if args.numerics_only:
        return write(result, args.quick, "-numerics")
    print("P8 the standard-protocol round against the floor", flush=True)
    result["p8"] = p8(reps, sorted(ALGORITHMS))
    result["p8_bookkeeping"] = p8_bookkeeping(20 if args.quick else 100, 2 if args.quick else 7)
    result["p8_start"] = p8_start(1 if args.quick else 3)
    if args.only_p8:
        return write(result, args.quick)
    print("P1 vectorized vs sequential", flush=True)
    result["p1"] = p1(reps, [20, 100] if args.quick else [100, 1000])
    print("P4 uneven clients", flush=True)
    result["p4"] = p4(reps)
    result["p4_compiled"] = compiled_step(reps)
    print("P2 Prefect vs inline", flush=True)
    result["p2"] = p2(reps, 5 if args.quick else 20)
    print("P3 cost in sampled K, not total N", flush=True)
    result["p3"] = p3(reps, [100, 1000] if args.quick else [100, 1000, 10_000], 100)
    print("profile", flush=True)
    result["profile"] = profile(5 if args.quick else 20)

    return write(result, args.quick)


def write(result: dict, quick: bool, part: str = "") -> int:
    stem = result_stem(f"{result['machine']['host']}{part}{'-quick' if quick else ''}")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    stem.with_suffix(".md").write_text(text)
    if "p1" in result:
        plot(result, stem.with_suffix(".png"))
    print(text)
    print(f"-> {stem}.json, .md{', .png' if 'p1' in result else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
