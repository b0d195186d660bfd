"""`--estimate` against the run it estimates: for each case, `python -m flows.pipeline ...
--estimate`, then the same pipeline for real, each in a fresh folder holding a copy of the
params file (a fresh MLflow store, as on a fresh clone), one after the other on this machine.

    python -m bench.estimate            # make quick's file, and params.yaml's poly1
    python -m bench.estimate --mnist    # and params.yaml's mnist too (about 20 more minutes)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench  # noqa: F401  (pins the numerics first)
from bench.common import fresh_env, heading, write_results

REPO = Path(__file__).resolve().parents[1]
CASES = [("params-quick.yaml", []), ("params-quick.yaml", []), ("params.yaml", ["poly1"])]
UNITS = {"s": 1, "min": 60, "h": 3600}


def seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def pipeline(params: str, experiments: list[str], *extra: str) -> tuple[float, str]:
    """Its wall time and output, run in a fresh folder."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(REPO / params, Path(tmp) / params)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "flows.pipeline", "--params", params, *experiments, *extra],
                              cwd=tmp, capture_output=True, text=True, env=fresh_env())
        wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{params} {experiments} {extra}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return wall, proc.stdout


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist", action="store_true", help="also params.yaml's mnist")
    args = parser.parse_args(argv)
    rows = []
    for params, experiments in CASES + ([("params.yaml", ["mnist"])] if args.mnist else []):
        estimate_wall, out = pipeline(params, experiments, "--estimate")
        low, high = (seconds(t) for t in re.search(r"^total: (.+?) - (.+?) \(", out, re.M).groups())
        wall, _ = pipeline(params, experiments)
        rows.append({"params": params, "experiments": experiments, "low_s": low, "high_s": high, "wall_s": wall,
                     "estimate_wall_s": estimate_wall, "off": (low + high) / 2 / wall - 1})
        print(rows[-1], flush=True)
    lines = [heading("--estimate against the run"), "",
             "Each case: `python -m flows.pipeline --params <file> [experiments] --estimate`, then the pipeline itself, "
             "each in a fresh folder with a copy of the file, one after the other (`python -m bench.estimate`).", "",
             "| params | experiments | estimate | the run | off by | the estimate took |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['params']} | {' '.join(r['experiments']) or 'all'} | {r['low_s']:.0f}-{r['high_s']:.0f} s "
              f"| {r['wall_s']:.0f} s | {100 * r['off']:+.0f}% | {r['estimate_wall_s']:.0f} s |" for r in rows]
    write_results("estimate", rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
