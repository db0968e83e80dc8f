#!/usr/bin/env bash
# One full run on a lent GPU machine (see tests/gpu/README.md): install the carried wheels,
# then run the CUDA tests and, with "bench", the GPU benchmark. Logs go to $OUT.
# Usage (from the carried checkout's root): bash tests/gpu/run_on_device.sh [tests|bench|all] [pytest args...]
set -o pipefail
MODE=${1:-tests}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-../.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/proto:$PWD/router:$PWD/shard:$PWD/launcher:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
status=0
if [[ $MODE == tests || $MODE == all ]]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu tests/unit/shard "$@" 2>&1 | tee "$OUT/tests.log" || status=1
fi
if [[ $MODE == bench || $MODE == all ]]; then
  timeout 300 python3 bench/bench_gpu.py --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
fi
exit $status
