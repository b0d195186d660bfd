"""The benchmark and its side-by-side checks. They measure the numerics a run computes with,
pinned as this package loads, before torch: params.yaml's `engine.numerics`, or
`PFL_BENCH_NUMERICS` (portable, native) where a measurement sets it for a process of its own."""

import os

from pfl_tasks.code_deps import ROOT
from pfl_tasks.config import load_params
from pfl_tasks.numerics import pin

pin(os.environ.get("PFL_BENCH_NUMERICS") or load_params(ROOT / "params.yaml").engine.numerics)
