"""The whole default pipeline, timed as a new user runs it: `make run` (`python -m flows.repro`)
on a fresh clone of this commit, then the edit-reruns-only-dependents check on that clone.

  - wall time of the whole `dvc repro`, and per stage (from the stage start lines);
  - the console: lines printed in all;
  - a stage process's fixed start: `import flows.train` in a fresh interpreter;
  - a run's fixed cost: a 1-round poly1 FedAvg run through Prefect in a warm process (flow run,
    MLflow, checkpoint, PNG, evaluation), against its 120-round run;
  - edits: after appending a comment to pfl_tasks/reports/text.py, the MLflow store
    (pfl_tasks/tracking.py) or the run outputs (pfl_tasks/outputs.py), which stages `dvc status`
    calls changed (expected: tables, compare: no training); to the train CLI (flows/train.py):
    none; to pfl_tasks/algorithms/ditto.py: the tune and train stages of the experiments running
    Ditto, whose flows then retrain only its runs; to the selection rules
    (pfl_tasks/selection.py): every tune, train and Learn2pFed stage, and the reports.

    python -m bench.repro             # make run's time, plus about 2 minutes
    python -m bench.repro --params params-quick.yaml   # the quickstart's matrix: a smoke run

Writes bench/results/<date>-<host>-repro.{json,md}, rewritten after every stage, so a run cut
short still leaves its stage times.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.paths import result_stem

REPO = Path(__file__).resolve().parents[1]


def clone(into: Path, params: str) -> Path:
    """A fresh clone of HEAD with this checkout's virtualenv, `params` as its params.yaml."""
    dst = into / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(dst)], check=True)
    (dst / ".venv").symlink_to(REPO / ".venv")
    if params != "params.yaml":
        shutil.copy(REPO / params, dst / "params.yaml")
    return dst


def changed_stages(root: Path, env: dict) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, env=env, capture_output=True,
                         text=True, check=True)
    return set(json.loads(out.stdout or "{}"))


def stages(root: Path) -> set[str]:
    return set(yaml.safe_load((root / "dvc.yaml").read_text())["stages"])


def edit(path: Path) -> None:
    path.write_text(path.read_text() + "# an edit\n")


def stage_start() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import flows.train"], cwd=REPO, check=True)
    return time.perf_counter() - start


def run_cost(tmp: Path) -> dict:
    """Seconds of a 1-round and of a 120-round poly1 FedAvg run, Prefect-orchestrated, warm."""
    code = f"""
import json, os, sys, time, yaml
sys.path.insert(0, {str(REPO)!r})
from flows.environment import local_defaults
local_defaults()
from flows.precheck import pin_numerics_first
pin_numerics_first("cost", {str(REPO / 'params.yaml')!r})
from flows.prepare import prepare
from flows.stage import prefect_api
from flows.train import train_experiment
from pathlib import Path

import yaml
os.chdir({str(tmp)!r})
params = yaml.safe_load(open({str(REPO / 'params.yaml')!r}))
params["tracking"] = {{"mlflow_uri": "sqlite:///{tmp}/mlflow.db"}}
params.pop("tuning")  # FedAvg at its params.yaml values: no tuning file to read
yaml.safe_dump(params, open("params.yaml", "w"))
prepare("poly1", "params.yaml", Path("data/partitions"))
times = {{}}
with prefect_api():
    for rounds in (1, 1, 120):  # the first run warms the process up
        params["experiments"]["poly1"]["federation"]["rounds"] = rounds
        yaml.safe_dump(params, open("params.yaml", "w"))
        start = time.perf_counter()
        train_experiment("poly1", "params.yaml", ".", "restart", ["fedavg"], [0])
        times[rounds] = time.perf_counter() - start
print(json.dumps(times))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    times = json.loads(out.stdout.strip().splitlines()[-1])
    return {"one_round_s": times["1"], "rounds_120_s": times["120"]}


def host_speed() -> float:
    """The 1-thread matmul GFLOP/s of this host now (`bench.run.matmul_gflops`)."""
    import torch

    from bench.run import matmul_gflops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return matmul_gflops(5)
    finally:
        torch.set_num_threads(threads)


def markdown(r: dict) -> str:
    lines = [f"# Whole pipeline {r['date']} on {r['host']} ({r['cores']} cores), params {r['params']}", "",
             f"- `make run` (`python -m flows.repro`), fresh clone: **{r.get('total_s', float('nan')) / 60:.1f} min** "
             f"for {len(r['stages'])} stages{'' if r.get('finished') else ' (cut short)'}; "
             f"{r.get('console_lines', '?')} console lines",
             f"- a stage process's start (`import flows.train`): {r['stage_start_s']:.1f} s",
             *([f"- this machine's 1-thread 1024² matmul, before and after: {r['matmul_gflops'][0]:.0f} and "
                f"{r['matmul_gflops'][-1]:.0f} GFLOP/s (about 95 on an unloaded VM of this kind): a slower host "
                "stretches every time above"] if r.get("matmul_gflops") else []),
             f"- a run's fixed cost (1-round poly1 FedAvg via Prefect, warm): {r['run_cost']['one_round_s']:.2f} s; "
             f"its 120-round run {r['run_cost']['rounds_120_s']:.2f} s"]
    if "edits" in r:
        for what, e in r["edits"].items():
            lines.append(f"- edit `{what}`: `dvc status` changed {sorted(e['changed'])}; expected {sorted(e['expected'])}: "
                         f"{'yes' if e['changed'] == e['expected'] else 'NO'}")
    groups: dict[str, float] = {}
    for name, seconds in r["stages"].items():
        key = name.split("-")[0] + ("-" + name.split("-")[1] if name.startswith(("train", "learn2pfed")) else "")
        groups[key] = groups.get(key, 0.0) + seconds
    lines += ["", "| stages | minutes |", "|---|---|"]
    lines += [f"| {k} | {v / 60:.1f} |" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--workdir", type=Path, help="clone and run here, and keep it (default: a temporary folder)")
    args = parser.parse_args(argv)
    stem = result_stem(f"{socket.gethostname()}-repro{'' if args.params == 'params.yaml' else '-quick'}")
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
              "cores": os.cpu_count(), "params": args.params, "stages": {}}

    def save() -> None:
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=sorted))
        stem.with_suffix(".md").write_text(markdown(result))

    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory() as tmp:
        result["matmul_gflops"] = [host_speed()]
        result["stage_start_s"] = stage_start()
        (Path(tmp) / "cost").mkdir()
        result["run_cost"] = run_cost(Path(tmp) / "cost")
        root = clone(Path(tmp), args.params)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "MLFLOW_TRACKING_URI"))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        start = last = time.perf_counter()
        current, lines = None, 0
        proc = subprocess.Popen([sys.executable, "-m", "flows.repro"], cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            lines += 1
            sys.stdout.write(line)
            if match := re.search(r"Running stage '([^']+)'", line):
                now = time.perf_counter()
                if current:
                    result["stages"][current] = now - last
                    save()
                current, last = match.group(1), now
        status = proc.wait()
        now = time.perf_counter()
        if current:
            result["stages"][current] = now - last
        result.update(total_s=now - start, console_lines=lines, finished=status == 0)
        result["matmul_gflops"].append(host_speed())
        save()
        if status:
            print(f"make run failed with status {status}", file=sys.stderr)
            return status
        result["edits"] = {}
        reports = {"tables", "compare"} & stages(root)
        params = yaml.safe_load((root / "params.yaml").read_text())
        with_ditto = {f"{kind}-{name}" for name, exp in params["experiments"].items() if "ditto" in exp["algorithms"]
                      for kind in ("train", "tune") if kind == "train" or name in params.get("tuning", {})}
        trained = {name for name in stages(root) if name.startswith(("tune-", "train-", "learn2pfed-"))}
        for rel, expected in (("pfl_tasks/reports/text.py", reports), ("pfl_tasks/tracking.py", reports),
                              ("pfl_tasks/outputs.py", reports), ("flows/train.py", set()),
                              ("pfl_tasks/algorithms/ditto.py", with_ditto),
                              ("pfl_tasks/selection.py", trained | reports)):
            edit(root / rel)
            result["edits"][rel] = {"changed": changed_stages(root, env), "expected": expected}
            subprocess.run(["git", "checkout", "-q", rel], cwd=root, check=True)
        save()
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
