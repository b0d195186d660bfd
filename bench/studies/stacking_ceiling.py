"""What stacking configurations into one fit could save on this CPU, at most.

Stacking C configurations (grid points, seeds) of a method makes its rows (configuration,
client): C times the clients in one vectorized step. Whatever per-row hyper-parameters add,
such a fit costs at least what a round of C copies of every client costs. So P8's training
round (mnist, MLP 784-100-10, 1 epoch of batch 10, all 20 clients, 1 thread, not evaluated) is
timed on the partition and on its clients repeated C times, one chunk each; C x t(1) / t(C) is
the most that stacking C configurations can gain over training them one after another. The same
again with two such rounds at once on threads of their own, as a stage trains runs side by side:
there, fewer steps to dispatch could also hold Python's lock less.

    python -m bench.studies.stacking_ceiling            # about 8 minutes

Writes bench/results/<date>-stacking-ceiling.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os

import torch

from bench.common import interleaved, one_round
from bench.paths import result_stem
from bench.run import matmul_gflops, p8_data, p8_federation
from flows.train import side_by_side
from pfl_tasks.data.store import ClientSplit
from pfl_tasks.engine.federation import Federation



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


def at_once(first, second):
    """A callable playing `first` and `second` at once, as a stage trains two runs side by side
    (`flows.train.side_by_side`: each on a thread of its own with one torch thread)."""
    plays = (first, second)
    return lambda: side_by_side([0, 1], lambda i: plays[i](), at_once=2, threads=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--copies", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "ditto", "pfedme", "fedcr", "pfedmac", "apfl",
                                                            "lp_proj"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    p8_data()
    gflops = matmul_gflops(5)
    rows = []
    for name in args.algorithms:
        setups = {}
        for c in [1, *args.copies]:
            setups[c] = round_of(name, c)
            setups[f"2x{c}"] = at_once(round_of(name, c), round_of(name, c))
        t = interleaved(setups, args.reps)
        for c in args.copies:
            rows.append({"algorithm": name, "copies": c, "one_s": t[1], "stacked_s": t[c], "most_saved": c * t[1] / t[c],
                         "two_s": t["2x1"], "two_stacked_s": t[f"2x{c}"], "most_saved_two": c * t["2x1"] / t[f"2x{c}"],
                         "most_saved_over_sequential": 2 * c * t[1] / t[f"2x{c}"]})
            r = rows[-1]
            print(f"  {name} x{c}: 1 thread {r['most_saved']:.2f}x, 2 runs side by side {r['most_saved_two']:.2f}x, "
                  f"stacked side by side against one configuration at a time {r['most_saved_over_sequential']:.2f}x",
                  flush=True)
    date = datetime.date.today().isoformat()
    out = {"date": date, "case": "P8's training round (mnist, MLP 784-100-10, 1 epoch of batch 10, SGD lr 0.05, every "
                                 "client, 1 torch thread, not evaluated) on C copies of every client, one chunk",
           "matmul_gflops": gflops, "cores": os.cpu_count(), "reps": args.reps, "rows": rows}
    result_stem("stacking-ceiling").with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# Stacking configurations: the ceiling on this CPU ({date})", "",
             f"{out['case']}; medians of {args.reps} interleaved rounds; {os.cpu_count()} cores; 1-thread 1024² matmul "
             f"at {gflops:.0f} GFLOP/s in this run. t(C): a round on C copies; t2(C): two such rounds at once, "
             "each on a thread of its own, as a stage trains runs side by side. C t(1) / t(C) and C t2(1) / t2(C) bound "
             "what stacking C configurations of a method into one fit can gain, alone and side by side; 2C t(1) / t2(C) "
             "what stacked fits side by side can gain over one configuration at a time.", "",
             "| algorithm | C | t(1) | t(C) | C t(1) / t(C) | t2(1) | t2(C) | C t2(1) / t2(C) | 2C t(1) / t2(C) |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['algorithm']} | {r['copies']} | {1e3 * r['one_s']:.0f} ms | {1e3 * r['stacked_s']:.0f} ms "
              f"| {r['most_saved']:.2f}x | {1e3 * r['two_s']:.0f} ms | {1e3 * r['two_stacked_s']:.0f} ms "
              f"| {r['most_saved_two']:.2f}x | {r['most_saved_over_sequential']:.2f}x |" for r in rows]
    best = max(rows, key=lambda r: r["most_saved_over_sequential"])
    lines += ["", f"The most any method gains over one configuration at a time: "
              f"{best['most_saved_over_sequential']:.2f}x ({best['algorithm']}, C = {best['copies']}). Where C copies "
              "cost C times one configuration, stacking saves nothing.", "",
              "Rerun: `python -m bench.studies.stacking_ceiling`."]
    result_stem("stacking-ceiling").with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
