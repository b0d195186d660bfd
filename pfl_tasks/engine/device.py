"""Where the engine computes, and the numerics it promises there.

On CUDA, `configure` makes a process's kernels deterministic (with cuBLAS's fixed workspace)
and makes TF32 an explicit choice, so a rerun or a resume on the same GPU, torch and CUDA is
bit-identical. On the CPU it holds the process to `engine.numerics` (`pfl_tasks.numerics`):
under portable, a run is bit-identical on any x86-64 CPU with AVX2 and the same torch build.
`platform` names all of that for the run's checkpoint and MLflow tags. Across devices results
agree only to rounding.
"""

from __future__ import annotations

import os

import torch

from pfl_tasks import numerics
from pfl_tasks.config import EngineConfig
from pfl_tasks.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device is 'cuda' but torch sees no CUDA device here: "
                          "set engine.device: cpu (or auto)")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    # indexed, as the device of a tensor on it is: `t.device == device` must hold there
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def torch_threads(engine: EngineConfig) -> int:
    """`engine.threads`, or (auto) one under portable numerics (a parallel reduction's order
    follows the thread count), else the cores this process may use less one, shared by the
    chunks that train at once, at least 1."""
    if engine.threads != "auto":
        return engine.threads
    if engine.numerics == "portable":
        return 1
    return max(1, (usable_cores() - 1) // engine.max_workers)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def configure(engine: EngineConfig, device: torch.device) -> None:
    """Process-wide: torch's thread count (`torch_threads`), and the numerics for computing on
    `device`. They stay set for the process: a CPU run after a CUDA one in the same process keeps
    deterministic mode on, which changes none of its numbers."""
    if torch.get_num_threads() != torch_threads(engine):
        torch.set_num_threads(torch_threads(engine))
    if device.type != "cuda":
        if numerics.active() != engine.numerics:
            raise ConfigError(f"engine.numerics is '{engine.numerics}', but this process computes with "
                              f"{numerics.active()} numerics (pinned before torch loaded): run the stage as a "
                              "command (`python -m flows.<stage>`), which pins them from its params file")
        # oneDNN blocks its convolutions by the host's cache sizes: portable runs take ATen's
        torch.backends.mkldnn.enabled = engine.numerics == "native"
        return
    # read when cuBLAS creates its handle: before this process's first GPU matmul
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(engine.deterministic)
    torch.backends.cudnn.deterministic = engine.deterministic
    torch.backends.cudnn.benchmark = not engine.deterministic
    torch.backends.cuda.matmul.allow_tf32 = engine.tf32
    torch.backends.cudnn.allow_tf32 = engine.tf32


def platform(engine: EngineConfig, device: torch.device) -> dict[str, str]:
    """What a run's numbers depend on besides its configuration and code."""
    facts = {"device": device.type, "torch": torch.__version__}
    if device.type == "cpu":
        facts |= {"numerics": numerics.active(), "threads": str(torch_threads(engine))}
    if device.type == "cuda":
        facts |= {"gpu": torch.cuda.get_device_name(device), "cuda": str(torch.version.cuda),
                  "cudnn": str(torch.backends.cudnn.version()), "tf32": str(engine.tf32),
                  "deterministic": str(engine.deterministic)}
    return facts


def describe(facts: dict[str, str]) -> str:
    return ", ".join(f"{key} {value}" for key, value in facts.items())
