"""Another vendor's CPU, emulated: short runs under portable numerics on this CPU and under
`qemu-x86_64 -cpu Haswell` (an Intel CPU with AVX2 and FMA, as cpuid tells MKL and ATen), their
models compared bit for bit; and the square roots behind the one difference the pins left
(docs/configuration.md, `numerics`): torch's CPU `Tensor.sqrt` against `numerics.sqrt`.

    python -m bench.emulated_cpu      # about 2 minutes; needs qemu-user (apt install qemu-user)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import bench  # noqa: F401  (pins the numerics first)
from bench.common import fresh_env, heading, write_results

REPO = Path(__file__).resolve().parents[1]
EMULATOR = ["qemu-x86_64", "-cpu", "Haswell"]
# each (algorithm, local optimizer): 3 rounds of the tiny digits experiment, then a digest of every
# model; FedAvg with FedAdam's server step. Then the roots of 100,000 float32 values by each route.
RUNS = """
import sys
sys.path.insert(0, "tests")
from pfl_tasks import numerics
numerics.pin("portable")
import hashlib, json
import torch
from conftest import tiny_params
from pfl_tasks.algorithms import build
from pfl_tasks.config import parse_params
from pfl_tasks.data import build_partition, FederatedData
from pfl_tasks.data.store import _client_split
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.rounds import InlineSteps, run_round
from pfl_tasks.engine.state import tree_map

def digest(tree):
    h = hashlib.sha256()
    tree_map(lambda t: h.update(t.detach().contiguous().numpy().tobytes()), tree)
    return h.hexdigest()[:16]

out = {}
for optimizer in ("sgd", "adam"):
    raw = tiny_params()
    raw["local"]["optimizer"] = {"name": optimizer, "lr": 0.01}
    params = parse_params(raw)
    df, manifest = build_partition("digits", params.datasets["digits"], 0)
    shape = tuple(manifest["feature_shape"])
    data = FederatedData("digits", "classification", 10, shape,
                         *(_client_split(df[df.split == s], 6, shape) for s in ("train", "val", "test")), "x")
    for name, hp in (("fedavg", {"server_optimizer": "adam", "server_lr": 0.01}), ("ditto", {}),
                     ("pfedme", {}), ("fedcr", {}), ("fpfc", {})):
        fed = Federation(params.experiment("tiny"), build(name, hp), data)
        state = fed.initial_state()
        for r in range(3):
            state = run_round(InlineSteps(1), fed, state, r)
        out[f"{name} ({'FedAdam server, ' if name == 'fedavg' else ''}{optimizer})"] = digest(
            {"s": state.server, "c": state.clients})
values = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 1e-3
out["Tensor.sqrt of 100,000 float32"] = digest({"r": values.sqrt()})
out["numerics.sqrt of the same"] = digest({"r": numerics.sqrt(values)})
print(json.dumps(out))
"""


def digests(prefix: list[str]) -> dict[str, str]:
    proc = subprocess.run([*prefix, sys.executable, "-c", RUNS], capture_output=True, text=True, env=fresh_env(),
                          cwd=REPO, timeout=1200)
    if proc.returncode:
        sys.exit(f"bench.emulated_cpu: {' '.join(prefix) or 'native'} run failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if shutil.which(EMULATOR[0]) is None:
        sys.exit("bench.emulated_cpu: qemu-x86_64 not found: apt install qemu-user")
    native, emulated = digests([]), digests(EMULATOR)
    rows = [{"what": k, "native": native[k], "emulated": emulated[k], "same": native[k] == emulated[k]} for k in native]
    lines = [heading("Portable numerics on an emulated Intel CPU"), "",
             f"This CPU against `{' '.join(EMULATOR)}`; a digest of every model after 3 rounds of the tiny "
             "digits experiment, then of 100,000 float32 roots.", "",
             "| what | this CPU | emulated Haswell | same bits |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | `{r['native']}` | `{r['emulated']}` | {'yes' if r['same'] else 'NO'} |" for r in rows]
    write_results("emulated-cpu", rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
