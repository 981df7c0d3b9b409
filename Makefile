# ctxfast — the two commands a newcomer runs:
#   make run    the main job: `ctxfast info`, a smoke run of every op on every backend, a
#               quick benchmark of every op against eager and `ctxfast xl-eval --quick`,
#               all written to reports/
#   make test   the whole test suite
# Both create .venv and install everything on first use; nothing needs installing by hand.
#
# On a machine whose python already has a CUDA torch (the GPU machines), the venv reuses
# it with --system-site-packages and downloads nothing. Elsewhere it installs torch 2.13.0
# (CPU build), triton, pytest, pytest-benchmark, pytest-xdist, hypothesis, numpy,
# transformers (optional test dependency of the Hugging Face integration) and matplotlib
# (PNG plots; optional: without it the reports skip the plots and say so).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ctxfast-deps
NVCC   ?= $(shell command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)
NVCC_FLAGS := -std=c++17 -Icsrc -gencode arch=compute_90,code=sm_90
CUDA_SRCS  := $(wildcard csrc/cuda/*.cu)
BUILD_SRCS := setup.py $(wildcard csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu csrc/*/*.cuh)

# Without a GPU the Triton kernels run in the interpreter (must be set before import).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
ifeq ($(HAS_GPU),0)
export TRITON_INTERPRET := 1
endif

.PHONY: run test install cuda-check bench clean

# The demo: versions and backends, a smoke run of every op, a quick benchmark of every op
# against eager, and Transformer-XL evaluation with memory vs a vanilla sliding window
# (the paper's lengths on a GPU). Everything lands in $(REPORT)/ (git-ignored).
REPORT ?= reports
run: install
	@mkdir -p $(REPORT)
	bash -o pipefail -c '$(VENV)/bin/ctxfast info | tee $(REPORT)/info.txt'
	bash -o pipefail -c '$(VENV)/bin/ctxfast smoke | tee $(REPORT)/smoke.txt'
	$(VENV)/bin/ctxfast bench --quick --out $(REPORT)/bench
	$(VENV)/bin/ctxfast xl-eval --quick --out $(REPORT)/xl-eval
	@echo "report: $(REPORT)/ (info.txt, smoke.txt, bench/, xl-eval/xl_eval.{md,json,png})"

# TEST_JOBS test processes (pytest-xdist, where installed; one module's tests stay in one
# process, so a module's fixtures -- the sm_90 compiles -- run once): on the 2-core CI
# machine 2 took the suite from ~12.3 to ~10.5 minutes (2026-11-24); ~7.5 minutes with 2
# since kernels/_interpreter.py skips the interpreter's dead work. TEST_JOBS=0: one process.
TEST_JOBS ?= 2
test: install
	$(PY) -m pytest tests -q -ra $$(test "$(TEST_JOBS)" != 0 && $(PY) -c "import xdist" \
	  2>/dev/null && echo "-n $(TEST_JOBS) --dist loadscope")

bench: install
	$(VENV)/bin/ctxfast bench --quick

install: $(VENV)/.ctxfast-built

$(STAMP):
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
	  echo "ctxfast: reusing the CUDA torch of $(PYTHON) (venv with --system-site-packages)"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV) && \
	  $(PY) -m pip install -q --upgrade pip setuptools wheel && \
	  $(PY) -m pip install -q torch==2.13.0 && \
	  $(PY) -m pip install -q "triton>=3.6" numpy ninja pytest pytest-benchmark pytest-xdist hypothesis transformers matplotlib; \
	fi
	@touch $@

# PIP_NO_INDEX=1: the README's install command must work on an offline machine (the GPU
# machines have no network); building with the index switched off guards that on every run.
$(VENV)/.ctxfast-built: $(STAMP) $(BUILD_SRCS) pyproject.toml
	PIP_NO_INDEX=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	@touch $@

# Compile every CUDA C++ file on its own (they include no torch header), as CI does.
cuda-check:
	@test -x "$(NVCC)" || { echo "cuda-check: nvcc not found (looked for $(NVCC))"; exit 1; }
	@test -n "$(CUDA_SRCS)" || { echo "cuda-check: no csrc/cuda/*.cu files"; exit 1; }
	@mkdir -p build/cuda-check
	@for f in $(CUDA_SRCS); do \
	  echo "nvcc -c $$f"; \
	  $(NVCC) -c $(NVCC_FLAGS) $$f -o build/cuda-check/$$(basename $$f .cu).o || exit 1; \
	done

clean:
	rm -rf build *.egg-info ctxfast/*.so ctxfast/_build_info.json $(VENV)
