"""Every entry point's config error, timed: a misspelled experiment, dataset or algorithm, bad
JSON, a wrong params path, and the README's own-data file with a wrong label column, a method
misspelled, a tuning grid's bad value or a misspelled file name. Each command runs 3 times in a
folder holding a copy of params.yaml and of the README's own-data file (its data made up); the
median wall time is reported against the 1 s a config error may take (the tests check that each
answers in one line before Prefect, MLflow or torch load, `tests/test_entry_points.py`).

    python -m bench.config_errors
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench  # noqa: F401  (pins the numerics first)
from bench.common import fresh_env, heading, write_results

REPO = Path(__file__).resolve().parents[1]
BOUND_S = 1.0
COMMANDS = {
    "train": ["flows.train", "mnsit"],
    "tune": ["flows.tune", "mnsit"],
    "learn2pfed": ["flows.learn2pfed", "mnsit"],
    "pipeline": ["flows.pipeline", "mnsit"],
    "compare": ["flows.compare", "mnsit"],
    "tables": ["flows.tables", "--params", "param.yaml"],
    "prepare": ["flows.prepare", "mnsit"],
    "sweep, experiment": ["flows.sweep", "mnsit"],
    "sweep, algorithm": ["flows.sweep", "mnist", "--algorithms", "dito"],
    "serve": ["flows.serve", "--sweep", "{"],
    "own file, label column": ["flows.pipeline", "--params", "own-label.yaml", "--root", "runs"],
    "own file, method typo": ["flows.pipeline", "--params", "own-typo.yaml", "--root", "runs"],
    "own file, grid value": ["flows.pipeline", "--params", "own-grid.yaml", "--root", "runs"],
    "own file, its name": ["flows.pipeline", "--params", "own-param.yaml", "--root", "runs"],
}


def own_files(folder: Path) -> None:
    """The README's own-data params file, three of its mistakes, and a made-up table for it."""
    import numpy as np
    import yaml

    block = re.search(r"<!-- own-params -->\n```yaml\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    rng = np.random.default_rng(0)
    rows = "".join(f"{a:.3f},{b:.3f},{int(a > 0)},s{i % 6}\n" for i, (a, b) in enumerate(rng.normal(size=(300, 2))))
    (folder / "data/own").mkdir(parents=True)
    (folder / "data/own/clinics.csv").write_text("x1,x2,outcome,site\n" + rows)
    mistakes = {"own-params": lambda d: None,
                "own-label": lambda d: d["datasets"]["clinics"]["source"].update(label="outcom"),
                "own-typo": lambda d: d["experiments"]["clinics"]["algorithms"].append("dito"),
                "own-grid": lambda d: d["tuning"]["clinics"]["hyper"]["ditto"].update(mu=[-1.0, 0.1])}
    for name, mistake in mistakes.items():
        data = yaml.safe_load(block)
        mistake(data)
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def timed(command: list[str], folder: Path) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", *command], cwd=folder, capture_output=True, text=True,
                          env=fresh_env(), timeout=120)
    return time.perf_counter() - start, proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shutil.copy(REPO / "params.yaml", folder / "params.yaml")
        own_files(folder)
        for name, command in COMMANDS.items():
            runs = [timed(command, folder) for _ in range(3)]
            rows.append({"entry point": name, "command": " ".join(command), "median_s": statistics.median(r[0] for r in runs),
                         "exit": runs[0][1], "line": runs[0][2]})
    lines = [heading("Config errors"), "",
             f"Median of 3 runs of `python -m <command>` in a folder with params.yaml; bound {BOUND_S:g} s.", "",
             "| entry point | command | seconds | within bound | exit | its line |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['entry point']} | `{r['command']}` | {r['median_s']:.2f} | {'yes' if r['median_s'] <= BOUND_S else 'NO'} "
              f"| {r['exit']} | {r['line'][:140]} |" for r in rows]
    write_results("config-errors", rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
