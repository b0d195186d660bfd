"""Writes dvc.yaml from params.yaml: one `train-<experiment>` stage per experiment, each one
process (one start-up for all its runs). Each stage depends on the params keys its runs read,
on the code that can change their numbers (`pfl_tasks.code_deps.numeric_code`) and on the
training loop, and its flow skips every run whose checkpoint is finished under the same
identity: editing one algorithm's module retrains only that algorithm's runs (and reruns the
reports after them), and editing the flows, the MLflow store, run outputs or reports reruns
no train stage. `make run` writes it before
`dvc repro`; after changing an experiment's list of algorithms, run it yourself:

    python -m flows.dvc_yaml            # dvc.yaml from params.yaml
    python -m flows.dvc_yaml --check    # exit 1 if dvc.yaml is not what params.yaml gives
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from flows.environment import local_defaults


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="dvc.yaml")
    parser.add_argument("--check", action="store_true", help="only check that --out is up to date")
    return parser


def refuse_other_params(params_path: str) -> None:
    """dvc.yaml's stages read `params.yaml` in their root, which is what DVC experiments vary
    (`dvc exp run -S`): another params file is refused in one line naming the route that runs it."""
    if Path(params_path).name != "params.yaml":
        print(f"stages failed: dvc.yaml's stages (and `dvc exp`) run params.yaml, not {params_path}: run that file "
              f"with `python -m flows.pipeline --params {params_path}`, or copy its sections into params.yaml",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":  # --help and a command-line error answer before Prefect and MLflow load, which read their settings then
    local_defaults()
    refuse_other_params(arguments().parse_args().params)

from flows.learn2pfed import learn2pfed_code
from flows.stage import stage_main, stage_name
from pfl_tasks.algorithms import hyper_parameters, source_file, validate_params
from pfl_tasks.config import load_params, read_params
from pfl_tasks.errors import ConfigError
from pfl_tasks.files import atomic_write_text
from pfl_tasks.code_deps import ROOT, numeric_code, run_code
from pfl_tasks.tuning import tuning_path

HEADER = """\
# Written by `python -m flows.dvc_yaml` from params.yaml (`make run` does it first): edit params.yaml,
# not this file. `dvc repro` runs prepare-<dataset> -> tune-, train-<experiment> -> learn2pfed-<experiment>
# -> tables, compare; each stage is a thin call into flows/ and depends on the params keys its runs
# read and the source files that can change their numbers.
"""
GLOBAL_KEYS = ["seed", "federation", "local", "engine", "tracking"]


def run_keys(params, raw: dict, experiment: str) -> list[str]:
    """The params keys an experiment's runs read: its whole `experiments.<experiment>` entry (so
    that a key added later, `dvc exp run -S '+experiments.<e>.algorithm_overrides.ditto.mu=1'`,
    stales the stage too; the stage then keeps every run whose identity did not change) and its
    runs' `algorithms` entries."""
    exp = params.experiment(experiment)
    keys = [f"algorithms.{run}" for run in exp.algorithms if raw["algorithms"][run]]  # `local` has none
    return [*GLOBAL_KEYS, f"experiments.{experiment}", *keys]


def run_code_deps(params, experiment: str) -> list[str]:
    exp = params.experiment(experiment)
    code = numeric_code(*(source_file(run, exp.hyper[run]) for run in exp.algorithms))
    return [f"data/partitions/{exp.dataset}", "pfl_tasks/training.py", *map(str, code)]


def tune_stage(params, raw: dict, experiment: str) -> dict:
    """Its one output, the choices, is committed (cache: false): a fresh clone reuses it."""
    return {
        "cmd": f"python -m flows.tune {experiment}",
        "deps": [*run_code_deps(params, experiment), "pfl_tasks/tuning.py"],
        "params": [*run_keys(params, raw, experiment), f"tuning.{experiment}"],
        "outs": [{str(tuning_path(Path("."), experiment)): {"cache": False}}],
    }


def train_stage(params, raw: dict, experiment: str) -> dict:
    tuned = [str(tuning_path(Path("."), experiment))] if experiment in params.tuning else []
    # persistent outputs: DVC leaves them in place, and the flow keeps the runs it skips
    return {
        "cmd": f"python -m flows.train {experiment} --on-config-change restart",
        "deps": [*run_code_deps(params, experiment), *tuned],
        "params": run_keys(params, raw, experiment),
        # the learning curves are data (the reports draw them): DVC's own plots would be Vega
        # charts that load their scripts from a CDN, blank offline
        # each run's headline is an output, not DVC metrics: `dvc exp show` shows reports/ranking.json's
        # means, not a column per run and seed
        "outs": [{f"models/{experiment}": {"persist": True}},
                 {f"plots/{experiment}": {"cache": False, "persist": True}},
                 {f"metrics/{experiment}": {"cache": False, "persist": True}}],
    }


def learn2pfed_stage(params, experiment: str) -> dict:
    exp, upstream = params.experiment(experiment), params.learn2pfed[experiment].features_from
    return {
        "cmd": f"python -m flows.learn2pfed {experiment} --on-config-change restart",
        "deps": [f"data/partitions/{exp.dataset}", *([f"models/{experiment}/{upstream}"] if upstream else []),
                 *map(str, learn2pfed_code(params, experiment))],
        "params": ["seed", f"experiments.{experiment}", f"learn2pfed.{experiment}"],
        "outs": [{f"models/learn2pfed/{experiment}": {"persist": True}},
                 {f"plots/learn2pfed/{experiment}": {"cache": False}},
                 {f"metrics/learn2pfed/{experiment}": {"cache": False}}],
    }


def prepare_keys(raw: dict, dataset: str) -> list[str]:
    """The params keys a dataset's partitions depend on: the dataset's entry, and the seeds of the
    experiments that train on it (one partition per seed; the global `seed` where one lists
    none), so that another dataset's experiment stales nothing of it."""
    users = [name for name, entry in raw["experiments"].items() if entry["dataset"] == dataset]
    seeds = [f"experiments.{name}.seeds" for name in users if "seeds" in raw["experiments"][name]]
    return ["seed", f"datasets.{dataset}", *(f"experiments.{name}.dataset" for name in users), *seeds]


def own_data(source) -> list[str]:
    """A `file` source's file: the prepare stage reruns when the data changes."""
    return [source.path.as_posix()] if source.name == "file" else []


def unlisted_defaults(params, raw: dict) -> dict[str, dict]:
    """Per configured run, the hyper-parameters its `algorithms.<run>` entry leaves to the code's
    defaults: DVC sees only the keys params.yaml holds (`dvc exp run -S` can change no other)."""
    listed = raw.get("algorithms") or {}
    runs = dict.fromkeys(run for name in params.experiments for run in params.experiment(name).algorithms)
    missing = {run: {k: v for k, v in hyper_parameters(run, listed.get(run) or {}).items()
                     if k not in (listed.get(run) or {})} for run in runs}
    return {run: keys for run, keys in missing.items() if keys or run not in listed}


def stages(params_path: str = "params.yaml") -> dict:
    """dvc.yaml's content for this params file, which lists every hyper-parameter of every
    configured run (so that each can be changed with `dvc exp run -S`, rerunning its runs)."""
    params, raw = validate_params(load_params(params_path)), read_params(Path(params_path))
    missing = unlisted_defaults(params, raw)
    if missing:
        entries = "; ".join(f"{run}: {yaml.safe_dump(keys, default_flow_style=True, width=1000, sort_keys=False).strip()}"
                            for run, keys in missing.items())
        raise ConfigError(f"{params_path}: every configured run lists its hyper-parameters under `algorithms` "
                          f"(so `dvc exp run -S algorithms.<run>.<key>=...` can change them); add their "
                          f"defaults: {entries}")
    out = {}
    for dataset in sorted({params.experiment(e).dataset for e in params.experiments}):
        out[stage_name("prepare", dataset)] = {
            "cmd": f"python -m flows.prepare {dataset}",
            "deps": ["flows/prepare.py", *map(str, run_code(ROOT / "pfl_tasks/data/__init__.py")),
                     *own_data(params.datasets[dataset].source)],
            "params": prepare_keys(raw, dataset),
            "outs": [f"data/partitions/{dataset}"],
        }
    for experiment in params.tuning:
        out[stage_name("tune", experiment)] = tune_stage(params, raw, experiment)
    for experiment in params.experiments:
        out[stage_name("train", experiment)] = train_stage(params, raw, experiment)
    for experiment in params.learn2pfed:
        out[stage_name("learn2pfed", experiment)] = learn2pfed_stage(params, experiment)
    # every run's final metrics (the MLflow runs changed when these did) and the tuning choices
    reads = ["metrics", *(str(tuning_path(Path("."), e)) for e in params.tuning)]
    verdicts = ["verdicts"] if "verdicts" in raw else []  # the rules the reports judge by (else the defaults)
    if params.tables:
        out["tables"] = {  # the comparison tables: methods x experiments, from MLflow as compare
            "cmd": "python -m flows.tables", "deps": reads + list(map(str, run_code(ROOT / "flows/tables.py"))),
            "params": ["tables", "tracking", "experiments", *verdicts],
            "outs": [{"reports/tables": {"cache": False}}, {"reports/markdown": {"cache": False}}],
        }
    out["compare"] = {  # per experiment, from MLflow: ranking over seeds, learning curves, per-client spread
        "cmd": "python -m flows.compare", "deps": reads + list(map(str, run_code(ROOT / "flows/compare.py"))),
        "params": ["tracking", "experiments", *verdicts], "outs": [{"reports/compare": {"cache": False}}],
        "metrics": [{"reports/ranking.json": {"cache": False}}],  # DVC's only metrics: `dvc exp show`'s columns
        "plots": [{"reports/figures": {"cache": False}}],
    }
    return {"stages": out}


def dvc_yaml(params_path: str = "params.yaml") -> str:
    return HEADER + yaml.safe_dump(stages(params_path), sort_keys=False, width=120)


def write_dvc_yaml(params_path: str = "params.yaml", out: Path = Path("dvc.yaml")) -> None:
    """`out` as `params_path` gives it, rewritten (atomically) only where it differs."""
    text = dvc_yaml(params_path)
    if not out.exists() or out.read_text() != text:
        atomic_write_text(out, text)
        print(f"{out}: written from {params_path}")


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    refuse_other_params(args.params)

    def work() -> None:
        out = Path(args.out)
        if not args.check:
            write_dvc_yaml(args.params, out)
        elif not out.exists() or out.read_text() != dvc_yaml(args.params):
            raise ConfigError(f"{out} is not what {args.params} gives: run `python -m flows.dvc_yaml`")

    return stage_main("stages", work)


if __name__ == "__main__":
    sys.exit(main())
