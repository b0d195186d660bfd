"""The GPU check (`python -m bench.run --device cuda`, or `bash bench/gpu_check.sh` on a bare
GPU machine): about 5 minutes on one GPU, with neither Prefect nor MLflow.

  tests        tests/test_device.py and tests/test_engine.py, which run every case on CUDA too
  P1, P3       the benchmark's executor ratio and cost-in-K cases, on CUDA
  cpu vs cuda  one round's time on each device: P1/P3 cases and the digits CNN
  traffic      host<->device copies (count, bytes) and synchronizing calls in one round, with the
               client stacks on the GPU and on the host: digits CNN K=20, 100k MLP K=1,000
  determinism  reruns and a resume bit-identical on CUDA, with deterministic kernels and without

Writes bench/results/<date>-<host>-cuda.json and .md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bench.common import HYPER, digits_shaped, experiment, interleaved, one_round, p1, p3
from pfl_tasks.algorithms import build
from pfl_tasks.engine.checkpoint import load_checkpoint, save_checkpoint
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.state import leaves
from pfl_tasks.engine.rounds import InlineSteps, run_round

REPS = 3


def federation(model, k, alg, data, device="cuda", chunk=128, **engine) -> Federation:
    return Federation(experiment(model, "vectorized", k, chunk, device, **engine), build(alg, HYPER[alg]), data)


def rounds(fed: Federation, stop: int, state=None, start: int = 0):
    state = state or fed.initial_state()
    for r in range(start, stop):
        state = run_round(InlineSteps(1), fed, state, r)
    return state


def identical(a, b) -> bool:
    pairs = zip(leaves({"s": a.server, "c": a.clients}), leaves({"s": b.server, "c": b.clients}))
    return all(torch.equal(x.cpu(), y.cpu()) for (_, x), (_, y) in pairs)


# ----------------------------------------------------------------------------- sections
def device_tests() -> dict:
    """The device-parametrized tests, in a process of their own."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_device.py",
           "tests/test_engine.py", "-rfE", "--tb=line"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    return {"exit": done.returncode, "summary": done.stdout.strip().splitlines()[-1:], "tail": done.stdout[-3000:]}


def cpu_vs_cuda(reps: int) -> list[dict]:
    rows = []
    for name, alg, model, k, n, chunk in (
            ("fedavg mlp K=100", "fedavg", "mlp", 100, 100, 128),
            ("fedavg cnn (digits) K=20", "fedavg", "cnn", 20, 20, 128),
            ("ditto mlp100k K=100 N=1,000", "ditto", "mlp100k", 100, 1000, 128),
            ("ditto mlp100k K=1,000", "ditto", "mlp100k", 1000, 1000, 128)):
        data = digits_shaped(n, 50 if model != "mlp100k" else 20, image=model == "cnn")
        t = interleaved({d: one_round(federation(model, k, alg, data, d, chunk)) for d in ("cpu", "cuda")}, reps)
        rows.append({"case": name, "cpu_s": t["cpu"], "cuda_s": t["cuda"], "cpu/cuda": t["cpu"] / t["cuda"]})
        print(f"  {name}: cpu {t['cpu']:.3f}s, cuda {t['cuda']:.3f}s", flush=True)
    return rows


def copies(fn) -> dict:
    """Host<->device copies in fn(), from the CUDA profiler's trace: count and bytes each way."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(tmp, "trace.json").read_text())
    found = {"HtoD": {"n": 0, "bytes": 0}, "DtoH": {"n": 0, "bytes": 0}}
    for event in trace.get("traceEvents", []):
        name = str(event.get("name", ""))
        for way, tally in found.items():
            if name.startswith("Memcpy") and way in name:
                tally["n"] += 1
                tally["bytes"] += int((event.get("args") or {}).get("bytes", 0))
    return found


def syncs(fn) -> dict:
    """Calls in fn() that waited for the device, by source line."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    lines: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{os.path.relpath(w.filename)}:{w.lineno}"
            lines[key] = lines.get(key, 0) + 1
    return {"total": sum(lines.values()), "top": sorted(lines.items(), key=lambda kv: -kv[1])[:8]}


def traffic() -> list[dict]:
    rows = []
    for name, model, k, alg, n, per in (("digits cnn K=20", "cnn", 20, "fedavg", 20, 50),
                                        ("digits cnn K=20", "cnn", 20, "ditto", 20, 50),
                                        ("mlp100k K=1,000", "mlp100k", 1000, "ditto", 1000, 20)):
        data = digits_shaped(n, per, image=model == "cnn")
        for placement in ("device", "host"):
            fed = federation(model, k, alg, data, client_state=placement)
            box = {"state": rounds(fed, 1), "r": 1}

            def one():
                box["state"] = run_round(InlineSteps(1), fed, box["state"], box["r"])
                box["r"] += 1

            start = time.perf_counter()
            one()
            torch.cuda.synchronize()
            row = {"case": f"{name} {alg}, client stacks on {placement}", "round_s": time.perf_counter() - start,
                   "round copies": copies(one), "round syncs": syncs(one),
                   "evaluate copies": copies(lambda: fed.evaluate(box["state"]))}
            rows.append(row)
            print(f"  {row['case']}: {row['round copies']}, syncs {row['round syncs']['total']}", flush=True)
    return rows


def determinism() -> dict:
    data = digits_shaped(6, 50, image=True)
    out = {}
    for mode, engine in (("deterministic, TF32 off", {}), ("non-deterministic, TF32 on",
                                                            {"deterministic": False, "tf32": True})):
        for alg in ("fedavg", "ditto", "pfedme"):
            runs = [rounds(federation("cnn", 6, alg, data, chunk=4, **engine), 3) for _ in range(2)]
            out[f"{mode}: {alg} cnn rerun identical"] = identical(*runs)
    fed = federation("cnn", 6, "ditto", data, chunk=4)
    full, half = rounds(fed, 4), rounds(fed, 2)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        save_checkpoint(path, {"round": half.round, "server": half.server, "clients": half.clients})
        ckpt = load_checkpoint(path, {})
    fresh = federation("cnn", 6, "ditto", data, chunk=4)
    resumed = rounds(fresh, 4, fresh.restore(ckpt["round"], ckpt["server"], ckpt["clients"]), 2)
    out["deterministic: ditto cnn resume identical"] = identical(full, resumed)
    return out


# ----------------------------------------------------------------------------- report
def section(result: dict, name: str, fn, stem: Path) -> None:
    """Run one section and write everything so far: a check cut short keeps what it measured."""
    print(f"== {name}", flush=True)
    start = time.perf_counter()
    try:
        result[name] = fn()
    except Exception as err:  # a section's failure is a result too: the others still run
        result[name] = {"error": f"{type(err).__name__}: {err}"}
        print(f"   FAILED {result[name]['error']}", flush=True)
    result.setdefault("seconds", {})[name] = time.perf_counter() - start
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    Path(f"{stem}.md").write_text(markdown(result))


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# GPU check {result['date']} on {m['host']}", "", f"{m['device']}, torch {m['torch']}, "
             f"CUDA {torch.version.cuda}; medians of {REPS} interleaved repetitions.", ""]
    tests = result.get("tests", {})
    lines += [f"Device tests (test_device.py, test_engine.py): {' '.join(tests.get('summary', [])) or tests}", ""]
    lines += [f"Sections' seconds: {', '.join(f'{k} {v:.0f}' for k, v in result.get('seconds', {}).items())}", ""]
    if isinstance(result.get("cpu vs cuda"), list):
        lines += ["| one round | cpu | cuda | cpu / cuda |", "|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['cpu_s']:.3f}s | {r['cuda_s']:.3f}s | {r['cpu/cuda']:.1f}x |"
                  for r in result["cpu vs cuda"]]
    if isinstance(result.get("P1 on cuda"), list):
        lines += ["", "| P1 on cuda | sequential | vectorized | ratio |", "|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['sequential_s']:.3f}s | {r['vectorized_s']:.3f}s | {r['ratio']:.1f}x |"
                  for r in result["P1 on cuda"]]
    if isinstance(result.get("P3 on cuda"), dict):
        r = result["P3 on cuda"]
        lines += ["", f"{r['case']}: " + ", ".join(f"N={n}: {s:.3f}s" for n, s in r["round_s"].items())
                  + f" (max/min {r['ratio']:.2f}x)"]
    if isinstance(result.get("traffic"), list):
        lines += ["", "| per round | time | host→device | device→host | syncs | evaluation host→device |",
                  "|---|---|---|---|---|---|"]
        for r in result["traffic"]:
            c, e = r["round copies"], r["evaluate copies"]
            lines.append(f"| {r['case']} | {r['round_s']:.3f}s | {c['HtoD']['n']} copies, {c['HtoD']['bytes']:,} B "
                         f"| {c['DtoH']['n']} copies, {c['DtoH']['bytes']:,} B | {r['round syncs']['total']} "
                         f"| {e['HtoD']['n']} copies, {e['HtoD']['bytes']:,} B |")
    if isinstance(result.get("determinism"), dict):
        lines += [""] + [f"- {k}: {v}" for k, v in result["determinism"].items()]
    failed = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    lines += ["", "Failed sections: " + (", ".join(f"{k} ({result[k]['error']})" for k in failed) or "none")]
    return "\n".join(lines) + "\n"


def main(result: dict, results_dir: Path) -> int:
    if not torch.cuda.is_available():
        print("the GPU check needs a CUDA device", file=sys.stderr)
        return 2
    results_dir.mkdir(exist_ok=True)
    stem = results_dir / f"{result['date'][:10]}-{result['machine']['host']}-cuda"
    for name, fn in (("tests", device_tests), ("determinism", determinism), ("traffic", traffic),
                     ("cpu vs cuda", lambda: cpu_vs_cuda(REPS)),
                     ("P1 on cuda", lambda: p1(REPS, [100, 1000], "cuda")),
                     ("P3 on cuda", lambda: p3(REPS, [100, 1000, 10_000], 100, "cuda"))):
        section(result, name, fn, stem)
    print(markdown(result))
    print(f"-> {stem}.json, .md")
    failed = result["tests"].get("exit") != 0 or any(isinstance(v, dict) and "error" in v for v in result.values())
    return 1 if failed else 0
