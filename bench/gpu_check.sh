#!/usr/bin/env bash
# The GPU check on a lent GPU machine: `python -m bench.run --device cuda` (bench/gpu.py),
# about 5 minutes, results in bench/results/<date>-<host>-cuda.{json,md} and copied to $OUT.
#
#   bash bench/gpu_check.sh wheels   # here, with the package index: the wheels a bare GPU
#                                    # machine lacks (its python3 has torch, pandas, sklearn,
#                                    # pytest) into .whl/, which .git/info/exclude keeps out of git
#   bash bench/gpu_check.sh          # there (carry .whl): .venv/bin/python if present, else python3
set -uo pipefail
WHEELS="pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 pandera==0.35.0 typeguard==4.6.1"

if [ "${1:-}" = wheels ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $WHEELS
fi

OUT=${OUT:-$PWD/gpu_check_out}; mkdir -p "$OUT"
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  PY=python3
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
export PYTHONUNBUFFERED=1 DO_NOT_TRACK=true
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
} 2>&1 | tee "$OUT/env.txt"
$PY -c 'import pydantic, pandera, sklearn, pytest' || { echo "ABORT: missing packages (bash bench/gpu_check.sh wheels, then carry .whl)"; exit 3; }

timeout 540 $PY -m bench.run --device cuda 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
newest=$(ls -t bench/results/*-cuda.json 2>/dev/null | head -1)  # written after each section
[ -n "$newest" ] && cp "$newest" "${newest%.json}.md" "$OUT/"
echo "gpu check exit: $status"
exit "$status"
