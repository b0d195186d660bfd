"""`engine.numerics`: portable numerics give the same bits whatever code paths the CPU's math
libraries would take, native ones do not, and a process computes only with the numerics its
params ask for."""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import tiny_params
from pfl_tasks import numerics
from pfl_tasks.code_deps import ROOT
from pfl_tasks.config import EngineConfig
from pfl_tasks.errors import ConfigError

# three algorithms' short runs on the tiny digits experiment, in a process that pins `mode` first;
# prints a digest of every model and of the evaluation
SHORT_RUNS = """
import sys
from pfl_tasks.numerics import pin
pin(sys.argv[1])
import hashlib, json
from pfl_tasks.algorithms import build
from pfl_tasks.config import parse_params
from pfl_tasks.data import build_partition, FederatedData
from pfl_tasks.data.store import _client_split
from pfl_tasks.engine.federation import Federation
from pfl_tasks.engine.rounds import InlineSteps, run_round
from pfl_tasks.engine.state import tree_map
params = parse_params(json.loads(sys.argv[2]))
df, manifest = build_partition("digits", params.datasets["digits"], 0)
shape = tuple(manifest["feature_shape"])
data = FederatedData("digits", "classification", 10, shape,
                     *(_client_split(df[df.split == s], 6, shape) for s in ("train", "val", "test")), "x")
digest = hashlib.sha256()
for algorithm in ("fedavg", "ditto", "fedcr"):
    fed = Federation(params.experiment("tiny"), build(algorithm, {}), data)
    state = fed.initial_state()
    for r in range(3):
        state = run_round(InlineSteps(1), fed, state, r)
    tree_map(lambda t: digest.update(t.detach().contiguous().numpy().tobytes()), {"s": state.server, "c": state.clients})
    tree_map(lambda t: digest.update(t.detach().contiguous().numpy().tobytes()), fed.evaluate(state).metrics)
print(digest.hexdigest())
"""
# what another CPU would make the libraries do: MKL and ATen held to AVX2 or below, set before the pinning
OLDER_CPU = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "default"}


def digest(mode: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in numerics.PORTABLE and k not in OLDER_CPU}
    params = tiny_params()
    params["engine"]["numerics"] = mode
    proc = subprocess.run([sys.executable, "-c", SHORT_RUNS, mode, json.dumps(params)], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.slow
def test_portable_numerics_give_the_same_bits_under_another_cpus_code_paths_and_native_do_not():
    portable = digest("portable")
    assert digest("portable", **OLDER_CPU) == portable
    assert digest("native", **OLDER_CPU) != digest("native")  # the perturbation is real


def test_portable_pins_every_library_before_torch_loads_and_refuses_after(monkeypatch):
    assert numerics.active() == "portable"  # conftest pinned it, as every entry point does
    assert all(os.environ[k] == v for k, v in numerics.PORTABLE.items())
    numerics.pin("portable")  # already pinned: nothing to do
    monkeypatch.delenv("MKL_CBWR")
    assert numerics.active() == "native"
    with pytest.raises(ConfigError, match="torch loaded before its code paths were pinned"):
        numerics.pin("portable")


def test_a_run_computes_only_with_the_numerics_its_params_ask_for():
    from pfl_tasks.engine.device import configure, platform, torch_threads

    with pytest.raises(ConfigError, match="engine.numerics is 'native', but this process computes with portable"):
        configure(EngineConfig(numerics="native"), torch.device("cpu"))
    engine = EngineConfig()
    configure(engine, torch.device("cpu"))
    assert not torch.backends.mkldnn.enabled  # oneDNN's blocking follows the host's caches
    assert torch_threads(engine) == 1 and torch.get_num_threads() == 1
    assert platform(engine, torch.device("cpu"))["numerics"] == "portable"


def test_portable_refuses_a_cpu_without_avx2_in_one_line(monkeypatch):
    monkeypatch.setattr(numerics, "cpu_flags", lambda: {"sse2", "avx"})
    monkeypatch.setattr(numerics, "active", lambda: "native")
    monkeypatch.setattr(sys, "modules", {k: v for k, v in sys.modules.items() if k not in ("torch", "numpy")})
    with pytest.raises(ConfigError, match="this CPU lacks avx2, fma: set engine.numerics: native"):
        numerics.pin("portable")


def test_a_stage_pins_its_params_numerics_before_torch_loads(tmp_path):
    """`python -m flows.train` answers a params file asking for unknown numerics in one line,
    before torch loads."""
    (tmp_path / "params.yaml").write_text(json.dumps({"engine": {"numerics": "fast"}}))
    proc = subprocess.run([sys.executable, "-m", "flows.train", "x", "--params", str(tmp_path / "params.yaml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "engine.numerics" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_sqrt_is_correctly_rounded_where_torchs_cpu_sqrt_is_not():
    """`numerics.sqrt` equals the CPU's own square-root instruction (numpy's) on every element,
    float32 and float64, where MKL's (`Tensor.sqrt`) misses some: those it misses differ by vendor."""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        values = torch.rand(100_000, generator=generator, dtype=dtype) * 1e-3
        exact = torch.from_numpy(np.sqrt(values.numpy()))
        assert torch.equal(numerics.sqrt(values), exact)
        assert not torch.equal(values.sqrt(), exact)  # the path `numerics.sqrt` stands in for
    assert numerics.sqrt(2.0) == math.sqrt(2.0)


def test_sqrt_takes_a_float32_gradient_and_refuses_a_float64_one():
    values = torch.tensor([0.25, 4.0], requires_grad=True)
    numerics.sqrt(values).sum().backward()
    assert torch.equal(values.grad, torch.tensor([1.0, 0.25]))
    with pytest.raises(ValueError, match="no gradient"):
        numerics.sqrt(values.detach().double().requires_grad_())


def test_every_square_root_of_the_library_is_numerics_sqrt():
    """One place for roots: no module but `numerics` takes torch's CPU sqrt (`.sqrt(`, `** 0.5`,
    `_foreach_sqrt`), and an Adam of torch's is its fused kernel, but the sequential reference's."""
    lines = [(path.relative_to(ROOT).as_posix(), line.split("#")[0])
             for path in sorted((ROOT / "pfl_tasks").rglob("*.py")) if path.name != "numerics.py"
             for line in path.read_text().splitlines()]
    roots = [(path, line) for path, line in lines if re.search(r"(?<!math)\.sqrt\(|\*\*\s*0\.5|_foreach_sqrt", line)]
    adams = [path for path, line in lines if "optim.Adam(" in line and "fused=True" not in line]
    assert roots == [] and adams == ["pfl_tasks/engine/optim.py"], (roots, adams)
