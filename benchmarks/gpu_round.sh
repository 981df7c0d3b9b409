#!/usr/bin/env bash
# One GPU lease, one script: build, test on CUDA, sanitize the CUDA C++ kernels, benchmark.
# Everything lands in $OUT (default: ./gpu_round_out). Run from the repository root:
#   bash benchmarks/gpu_round.sh [--quick]
# Not yet run on a GPU (written 2026-11-21 without one): expect to fix it on first use.
set -uo pipefail
OUT=${OUT:-gpu_round_out}
mkdir -p "$OUT"
QUICK=${1:-}
export PYTHONUNBUFFERED=1
log() { echo "== $* ==" | tee -a "$OUT/summary.txt"; }

log "device"
nvidia-smi -L | tee -a "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/summary.txt"

log "build (pip install --no-build-isolation --no-deps -e .)"
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
echo "build rc=$?" | tee -a "$OUT/summary.txt"
ctxfast info | tee "$OUT/info.txt"

log "tests on CUDA (whole suite, tests/gpu included)"
python3 -m pytest tests -q -ra -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc=$?; $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"

log "compute-sanitizer on the CUDA C++ kernel tests"
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 1 \
    python3 -m pytest tests/gpu/test_rel_shift_gpu.py -q -k "cuda" -p no:cacheprovider \
    > "$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool rc=$?; $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)" \
    | tee -a "$OUT/summary.txt"
done

log "benchmarks"
ctxfast bench ${QUICK:+--quick} --out "$OUT/bench" > "$OUT/bench.log" 2>&1
echo "bench rc=$?" | tee -a "$OUT/summary.txt"
tail -40 "$OUT/bench.log"
