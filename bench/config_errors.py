"""Every entry point's config error, timed: a misspelled experiment, dataset or algorithm, bad
JSON, a wrong params path. Each command runs 3 times in a folder holding a copy of params.yaml;
the median wall time is reported against the 1 s a config error may take (the tests check that
each answers in one line before Prefect, MLflow or torch load, `tests/test_entry_points.py`).

    python -m bench.config_errors
"""

from __future__ import annotations

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
}


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
