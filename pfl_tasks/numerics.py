"""How a process's CPU arithmetic rounds (`engine.numerics`), set before torch loads.

`portable` (the default) pins the code path of every math library a run uses to one that rounds
the same on any x86-64 CPU with AVX2, Intel or AMD, so a `dvc repro` on another machine gives the
same bits:
- MKL (torch's matrix products): its conditional-numerical-reproducibility branch COMPATIBLE.
  MKL honours only AUTO and COMPATIBLE on non-Intel CPUs: `MKL_CBWR=AVX2` falls back to AUTO on
  an AMD CPU, silently, and AUTO rounds differently on Intel and AMD (MKL's developer guide,
  "Reproducibility Conditions"; `MKL_VERBOSE=1` prints `CNR:AUTO` there).
- ATen's vectorized kernels (reductions, exp/log, the optimizers' updates): the AVX2 build, the
  same machine code on every CPU that has AVX2; AVX-512 hosts would otherwise take 16-lane paths.
- oneDNN (convolutions): capped at AVX2, and off on CPU at run time (`engine.device.configure`):
  it sizes its blocking by the host's caches, which no setting pins.
- numpy's dispatched SIMD loops: capped at AVX2 as well.
- threads: one torch (and MKL) thread per process, since a parallel reduction's order follows
  the thread count (`engine.device.torch_threads`).
- square roots: `sqrt` below, since torch's CPU `Tensor.sqrt` is MKL's vector math, which no
  setting pins.

`native` lets each library take this CPU's fastest path: numbers then differ between machines,
and a run records which it used (`engine.device.platform`).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from pfl_tasks.errors import ConfigError

NUMERICS_NOTE = {"portable": "the same bits on any x86-64 CPU with AVX2",
                 "native": "this CPU's fastest code paths: numbers differ between machines"}
NUMERICS = tuple(NUMERICS_NOTE)
PORTABLE = {
    "MKL_CBWR": "COMPATIBLE",
    "MKL_DYNAMIC": "FALSE",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    # numpy 2.4's dispatch groups above AVX2 (x86-64-v3); one this CPU lacks only warns
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
}
# CPU flags (/proc/cpuinfo) the portable paths execute
REQUIRED_FLAGS = ("avx2", "fma")


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags, or None where /proc/cpuinfo does not list them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return None if line is None else set(line.split(":", 1)[1].split())


def active() -> str:
    """The numerics this process computes with: portable when every pinned variable holds its
    value (they are read when torch and numpy load), native otherwise."""
    return "portable" if all(os.environ.get(k) == v for k, v in PORTABLE.items()) else "native"


def pin(mode: str) -> None:
    """Set `mode`'s variables for this process and its children. Before torch loads, portable
    pins them; after, it can only check that they were pinned in time."""
    if mode not in NUMERICS:
        raise ConfigError(f"engine.numerics: '{mode}' is not one of {', '.join(NUMERICS)}")
    if mode == "native" or active() == "portable":
        return
    if "torch" in sys.modules or "numpy" in sys.modules:
        raise ConfigError("engine.numerics is 'portable', but torch loaded before its code paths were pinned: "
                          "run the stage as a command (`python -m flows.<stage>`), or call "
                          "pfl_tasks.numerics.pin('portable') before importing torch")
    flags = cpu_flags()
    missing = [f for f in REQUIRED_FLAGS if flags is not None and f not in flags]
    if missing:
        raise ConfigError(f"engine.numerics is 'portable', which runs AVX2 code, but this CPU lacks "
                          f"{', '.join(missing)}: set engine.numerics: native (its numbers are this machine's)")
    os.environ.update(PORTABLE)


def sqrt(t):
    """`t`'s elementwise square root, correctly rounded: the same bits on every CPU. torch's CPU
    `Tensor.sqrt` (and `** 0.5`, `_foreach_sqrt`) is MKL's vector math, off by an ulp in a fifth of
    float32 elements, and in other elements on Intel than on AMD even under MKL_CBWR=COMPATIBLE
    (docs/configuration.md, `numerics`). A float32 root goes through float64, whose error (an ulp of float64)
    its rounding to float32 absorbs; a float64 one (no gradient) through numpy's, the CPU's own
    instruction. Autograd goes through the float32 route; other devices take their own sqrt, and
    a Python number `math.sqrt`."""
    import torch

    if not isinstance(t, torch.Tensor):
        return math.sqrt(t)
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64):
        return t.sqrt()
    if t.dtype == torch.float32:
        return t.double().sqrt().float()
    if t.requires_grad:
        raise ValueError("numerics.sqrt: a float64 root takes no gradient (it is numpy's)")
    import numpy as np

    return torch.from_numpy(np.sqrt(t.numpy()))
