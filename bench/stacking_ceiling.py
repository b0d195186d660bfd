"""What stacking configurations into one fit could save on this CPU, at most.

Stacking C configurations (grid points, seeds) of a method makes its rows (configuration,
client): C times the clients in one vectorized step. Whatever per-row hyper-parameters add,
such a fit costs at least what a round of C copies of every client costs. So P8's training
round (mnist, MLP 784-100-10, 1 epoch of batch 10, all 20 clients, 1 thread, not evaluated) is
timed on the partition and on its clients repeated C times, one chunk each; C x t(1) / t(C) is
the most that stacking C configurations can gain over training them one after another.

    python -m bench.stacking_ceiling            # about 3 minutes

Writes bench/results/<date>-stacking-ceiling.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path

import torch

from bench.common import interleaved, one_round
from bench.run import matmul_gflops, p8_data, p8_federation
from pfl_tasks.data.store import ClientSplit
from pfl_tasks.engine.federation import Federation

RESULTS = Path(__file__).parent / "results"


def repeated(split: ClientSplit, copies: int) -> ClientSplit:
    """`split` with its clients repeated `copies` times (copy c of client k is client c N + k)."""
    counts = split.counts.repeat(copies)
    return ClientSplit(x=split.x.repeat(copies, *[1] * (split.x.dim() - 1)), y=split.y.repeat(copies),
                       offsets=torch.cumsum(counts, 0) - counts, counts=counts)


def round_of(algorithm: str, copies: int):
    """A callable playing P8's training round of `algorithm` on `copies` copies of every client."""
    fed, data = p8_federation(algorithm, "vectorized"), p8_data()
    if copies > 1:
        data = dataclasses.replace(data, **{s: repeated(getattr(data, s), copies) for s in ("train", "val", "test")})
    return one_round(Federation(fed.exp, fed.algorithm, data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--copies", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "ditto", "pfedme"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    p8_data()
    gflops = matmul_gflops(5)
    rows = []
    for name in args.algorithms:
        t = interleaved({c: round_of(name, c) for c in [1, *args.copies]}, args.reps)
        for c in args.copies:
            rows.append({"algorithm": name, "copies": c, "one_s": t[1], "stacked_s": t[c],
                         "most_saved": c * t[1] / t[c]})
            print(f"  {name} x{c}: {1e3 * t[1]:.0f} ms alone, {1e3 * t[c]:.0f} ms for {c} copies: "
                  f"at most {rows[-1]['most_saved']:.2f}x", flush=True)
    date = datetime.date.today().isoformat()
    out = {"date": date, "case": "P8's training round (mnist, MLP 784-100-10, 1 epoch of batch 10, SGD lr 0.05, every "
                                 "client, 1 torch thread, not evaluated) on C copies of every client, one chunk",
           "matmul_gflops": gflops, "reps": args.reps, "rows": rows}
    (RESULTS / f"{date}-stacking-ceiling.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# Stacking configurations: the ceiling on this CPU ({date})", "",
             f"{out['case']}; medians of {args.reps} interleaved rounds; 1-thread 1024² matmul at "
             f"{gflops:.0f} GFLOP/s in this run. C × t(1) / t(C) bounds what stacking C configurations of a "
             "method into one fit can gain over training them one after another.", "",
             "| algorithm | C | one configuration | C copies in one fit | at most |", "|---|---|---|---|---|"]
    lines += [f"| {r['algorithm']} | {r['copies']} | {1e3 * r['one_s']:.1f} ms | {1e3 * r['stacked_s']:.1f} ms "
              f"| {r['most_saved']:.2f}x |" for r in rows]
    best = max(rows, key=lambda r: r["most_saved"])
    lines += ["", f"The most any method gains: {best['most_saved']:.2f}x ({best['algorithm']}, C = {best['copies']}). "
              "Where C copies cost C times one configuration, stacking saves nothing.", "",
              "Rerun: `python -m bench.stacking_ceiling`."]
    (RESULTS / f"{date}-stacking-ceiling.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
