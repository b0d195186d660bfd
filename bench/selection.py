"""The selection rule against the argmax and against the unpaired rule it replaced, on every run
of the chosen experiments, trained twice: under portable and under native numerics (the same
tuning, data and code; only the rounding differs).

  - regret: the test metric at the test-best evaluation minus that at the selected one (for MSE,
    the other way round), per run: a diagnostic of how far validation leads from test, reported,
    never optimized (choosing a rule on it would be choosing on test);
  - stability: how far the selected test metric moves, and how often the selected round does,
    between the two numerics: what rounding alone does to a reported number.

The rule is `pfl_tasks.selection.SELECTION_RULE` (the run's recorded selection); the unpaired
rule is the same rule with the standard error of a difference taken as if the two evaluations'
rows were independent (each evaluation's own standard error, logged as `..._se`, combined), the
rule before 2026-12-07; the argmax is the best mean validation metric over the run's evaluations
(the earliest of ties). Experiments without a committed tuning file train at their configured
values (the result names them).

    python -m bench.selection                      # mnist and poly1, about 25 minutes on 2 cores
    python -m bench.selection --experiments poly1  # a few minutes
    python -m bench.selection --params params-extended.yaml --experiments poly1_scarce poly2_scarce poly3_scarce

Writes bench/results/<date>-selection.{json,md} (other experiments: <date>-selection-<experiments>.{json,md}).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from pfl_tasks.code_deps import ROOT
from bench.paths import result_stem
from pfl_tasks.config import load_params
from pfl_tasks.engine.checkpoint import load_checkpoint
from pfl_tasks.engine.evaluate import HIGHER_IS_BETTER
from pfl_tasks.numerics import NUMERICS, PORTABLE
from pfl_tasks.runs import RunPaths
from pfl_tasks.selection import SELECTION_RULE

RULES = ("rule", "unpaired", "argmax")
RESTRICTIONS = ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")  # an older CPU's code paths, if set for the run


def untuned(params_file: Path, experiments: list[str]) -> list[str]:
    """The experiments that `params_file` tunes but that have no committed tuning file."""
    tuning = yaml.safe_load(params_file.read_text()).get("tuning") or {}
    return [e for e in experiments if e in tuning and not (ROOT / "tuning" / f"{e}.json").exists()]


def train(mode: str, root: Path, params_file: Path, experiments: list[str]) -> None:
    """The experiments' runs at their committed tuning (or, without one, their configured
    values), under `mode`, inline, into `root`."""
    raw = yaml.safe_load(params_file.read_text())
    for experiment in untuned(params_file, experiments):
        del raw["tuning"][experiment]
    raw.setdefault("engine", {}).update(numerics=mode, orchestrator="inline")
    raw["tracking"] = {"mlflow_uri": f"sqlite:///{root / 'mlflow.db'}"}
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    shutil.copytree(ROOT / "tuning", root / "tuning", dirs_exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k not in PORTABLE},  # each stage pins its own
           "PYTHONPATH": str(ROOT)}
    params = load_params(root / "params.yaml")
    for dataset in sorted({params.experiments[e].dataset for e in experiments}):
        subprocess.run([sys.executable, "-m", "flows.prepare", dataset, "--params", "params.yaml"],
                       cwd=root, env=env, check=True)
    for experiment in experiments:
        subprocess.run([sys.executable, "-m", "flows.train", experiment, "--params", "params.yaml", "--root", "."],
                       cwd=root, env=env, check=True)


def unpaired(val: list[float], se: list[float]) -> int:
    """The rule before pairing, replayed on a run's signed validation means (higher is better)
    and their own standard errors: the latest evaluation short of the best by at most the two
    standard errors combined as if independent."""
    best = selected = 0
    for i in range(len(val)):
        if val[i] > val[best]:
            best = selected = i
        elif val[best] - val[i] <= math.hypot(se[best], se[i]):
            selected = i
    return selected


def selections(root: Path, experiment: str) -> dict[str, dict]:
    """run -> the rule's, the unpaired rule's and the argmax's selected evaluation, and the
    test-best one, each with its round and test metric."""
    params = load_params(root / "params.yaml")
    exp = params.experiment(experiment)
    out = {}
    for run in exp.algorithms:
        for seed in exp.seeds:
            ckpt = load_checkpoint(RunPaths.of(root, experiment, run, seed).checkpoint, {})
            history = ckpt["history"]
            metric = next(m for m in ("acc", "mse") if f"val/personalized/{m}_mean" in history[0])
            sign = 1 if HIGHER_IS_BETTER[metric] else -1
            val = [sign * h[f"val/personalized/{metric}_mean"] for h in history]
            test = [h[f"test/personalized/{metric}_mean"] for h in history]
            se = [h[f"val/personalized/{metric}_se"] for h in history]
            picks = {"rule": ckpt["selection"]["index"], "unpaired": unpaired(val, se), "argmax": val.index(max(val)),
                     "test_best": max(range(len(test)), key=lambda i: (sign * test[i], -i))}
            out[f"{run}/seed{seed}"] = {"metric": metric, **{
                name: {"round": history[i]["round"], "test": test[i]} for name, i in picks.items()}}
    return out


def summary(runs: dict[str, dict[str, dict]], experiment: str) -> dict:
    """Per rule: mean and max regret over the runs (portable numerics), and between the numerics
    the mean and max move of the selected test metric and the runs whose selected round moved."""
    portable, native = runs["portable"], runs["native"]
    sign = 1 if HIGHER_IS_BETTER[next(iter(portable.values()))["metric"]] else -1
    out = {"experiment": experiment, "runs": len(portable)}
    for rule in RULES:
        regret = [sign * (r["test_best"]["test"] - r[rule]["test"]) for r in portable.values()]
        relative = [g / abs(r["test_best"]["test"]) for g, r in zip(regret, portable.values())]
        moves = [abs(portable[k][rule]["test"] - native[k][rule]["test"]) for k in portable]
        out[rule] = {"regret_mean": statistics.fmean(regret), "regret_max": max(regret),
                     "relative_regret_mean": statistics.fmean(relative), "relative_regret_max": max(relative),
                     "move_mean": statistics.fmean(moves), "move_max": max(moves),
                     "rounds_moved": sum(portable[k][rule]["round"] != native[k][rule]["round"] for k in portable)}
    return out


def markdown(result: dict) -> str:
    lines = [f"# Selection rule against the unpaired rule and the argmax ({result['date']})", "",
             f"Rule: {SELECTION_RULE}. Unpaired: the same with each evaluation's own standard error, combined as "
             "if independent (the rule before 2026-12-07). Argmax: the best mean validation metric.", "",
             *([f"Trained at their configured values (no committed tuning file): {', '.join(result['untuned'])}.", ""]
               if result.get("untuned") else []),
             "Regret: test at the test-best evaluation minus test at the selected one (MSE: the other way), "
             "per run, under portable numerics; a diagnostic, not a target. Move: the selected test metric's "
             "change between portable and native numerics (same tuning, data and code).", "",
             "| experiment | runs | selection | regret mean | regret max | relative regret mean | relative regret max "
             "| move mean | move max | selected round moved |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        for rule in RULES:
            r = s[rule]
            lines.append(f"| {s['experiment']} | {s['runs']} | {rule} | {r['regret_mean']:.4g} | {r['regret_max']:.4g} "
                         f"| {r['relative_regret_mean']:.2%} | {r['relative_regret_max']:.2%} "
                         f"| {r['move_mean']:.4g} | {r['move_max']:.4g} | {r['rounds_moved']} of {s['runs']} |")
    params = "" if result["params"] == "params.yaml" else f" --params {result['params']}"
    lines += ["", f"Command: `python -m bench.selection{params} --experiments {' '.join(result['experiments'])}`"
              + (f" with {result['environment']} set" if result.get("environment") else ""), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="the params file, relative to the project")
    parser.add_argument("--experiments", nargs="+", default=["mnist", "poly1"])
    parser.add_argument("--workdir", type=Path, help="train here and keep it (default: a temporary folder)")
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="selection-"))
    for mode in NUMERICS:
        train(mode, work / mode, ROOT / args.params, args.experiments)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "params": args.params,
              "experiments": args.experiments, "untuned": untuned(ROOT / args.params, args.experiments),
              "environment": " ".join(f"{k}={os.environ[k]}" for k in RESTRICTIONS if k in os.environ),
              "runs": {e: {mode: selections(work / mode, e) for mode in NUMERICS} for e in args.experiments}}
    result["summary"] = [summary(result["runs"][e], e) for e in args.experiments]
    suffix = "" if args.experiments == ["mnist", "poly1"] else "-" + "-".join(args.experiments)
    stem = result_stem(f"selection{suffix}")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    if args.workdir is None:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
