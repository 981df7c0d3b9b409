#!/usr/bin/env bash
# The GPU round: from a fresh checkout on a GPU machine with no network, build ctxfast, run
# the whole test suite on CUDA, compute-sanitizer (memcheck, racecheck) over every test of
# the CUDA C++ kernels, the full benchmarks, and `ctxfast xl-eval` at the paper's lengths;
# everything lands in $OUT as one summary file and one archive per call.
#
#   bash benchmarks/gpu_round.sh --stage build-test  # build, info, smoke, whole suite, xl-eval (fp32, bf16)
#   bash benchmarks/gpu_round.sh --stage sanitize    # profile check, compute-sanitizer
#   bash benchmarks/gpu_round.sh --stage bench       # the full benchmark set
#   bash benchmarks/gpu_round.sh --stage all         # the three, one after the other
#   bash benchmarks/gpu_round.sh --stage tests       # build and the suite only (a short lease)
#   bash benchmarks/gpu_round.sh --stage ncu         # host-time split, ncu of the attention kernels
#   bash benchmarks/gpu_round.sh --stage verify      # one 15-minute lease: the GPU-only checks
#   bash benchmarks/gpu_round.sh --stage followup    # ~3 minutes, right after verify: AWD-LSTM step
#                                                    # of the last changes, LSTM vs cuDNN, attention sweep
#   bash benchmarks/gpu_round.sh --stage bench --dry-run # print the commands, run nothing
#
# Each stage fits in one command of under 10 minutes (STAGE_BUDGET seconds, default 560):
# every step gets a timeout cut to what is left of it, and a step that fails or times out
# is written to the summary and the round goes on (a sanitizer error in one test file
# does not stop the others). Each stage builds first when ctxfast._cuda does not import
# (a fresh machine). BENCH_OPS (e.g. "rel_attention attention") limits the bench stage's
# suites, BENCH_TIME its time budget (s), LSTM_COMPARE=0 skips the LSTM launch forms,
# PROFILE_CHECK=1 adds --profile-check, SWEEP=1 runs benchmarks/config_sweep.py before the
# suites, BREAKDOWN=0 skips benchmarks/kernel_breakdown.py; SUITE_FILES (e.g. "tests/gpu
# tests/test_rel_attention.py") limits the tests stage's suite to those files. Output: $OUT/summary.txt (appended, one line per step with its exit status and
# the lines that matter) and $OUT/gpu_round-<stage>.tgz (every log and report of the
# stage). OUT defaults to ./gpu_round_out; PYTHON to python3.
set -uo pipefail

STAGE=""
DRY=0
while (( $# )); do
  case $1 in
    --stage) STAGE=${2:-}; shift 2 || { echo "gpu_round: --stage needs a value" >&2; exit 2; } ;;
    --stage=*) STAGE=${1#--stage=}; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_round: unknown argument '$1' (use --stage build-test|tests|sanitize|bench|ncu|verify|followup|all, --dry-run)" >&2; exit 2 ;;
  esac
done
case $STAGE in
  build-test|tests|sanitize|bench|ncu|verify|followup|all) ;;
  "") echo "gpu_round: give --stage build-test|tests|sanitize|bench|ncu|verify|followup|all" >&2; exit 2 ;;
  *) echo "gpu_round: unknown stage '$STAGE' (build-test|tests|sanitize|bench|ncu|verify|followup|all)" >&2; exit 2 ;;
esac

PY=${PYTHON:-python3}
OUT=${OUT:-gpu_round_out}
R=$OUT/r
S=$OUT/summary.txt
BUDGET=${STAGE_BUDGET:-560}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
cd "$(dirname "$0")/.." || exit 2
(( DRY )) || mkdir -p "$R"

# The tests of the CUDA C++ kernels (ctxfast._cuda: LSTM and rel_shift) and of the Triton
# LSTM's grid-synchronised kernels, "file|-k expression", one sanitizer run each.
SANITIZE_TESTS=(
  "tests/gpu/test_lstm_gpu.py|"
  "tests/gpu/test_rel_shift_gpu.py|not triton and not inductor"
  "tests/test_cuda_bindings.py|"
  "tests/test_lstm_native.py|"
  "tests/test_lstm.py|cuda or triton_launch_forms or triton_persistent"
  "tests/test_rel_shift.py|cuda"
)

note() { if (( DRY )); then echo "# $*"; else echo "== $(date -u +%T) $* ==" | tee -a "$S"; fi; }

# step <name> <timeout s> <log file under $R> <command...>: run it (or print it), record
# its exit status (124: timed out) in the summary; never stops the round.
step() {
  local name=$1 want=$2 logf=$3; shift 3
  local t
  t=$(left_for "$want")
  if (( DRY )); then
    printf '[%s] timeout %s' "$STAGE_NOW" "$want"; printf ' %q' "$@"; printf ' > %s 2>&1\n' "$R/$logf"
    return 0
  fi
  if (( t < 5 )); then
    echo "$name: not run (the stage's ${BUDGET} s are spent)" | tee -a "$S"; return 0
  fi
  note "$name (timeout ${t}s)"
  # -k 15: a process whose SIGTERM handler cannot run (its main thread stuck in a CUDA
  # synchronisation on a hung kernel) is killed 15 s later, not waited on past the call
  timeout -k 15 "$t" "$@" > "$R/$logf" 2>&1
  local rc=$?
  STEP_RC=$rc
  echo "$name rc=$rc$([ $rc = 124 ] && echo ' (timed out)')" | tee -a "$S"
  return 0
}

# left_for <want s>: the timeout a step that wants <want> s gets now: <want>, or what is
# left of the stage's budget (less 10 s) when that is less. A dry run runs nothing, so no
# time passes in it: its clock stays at the stage's start (on a loaded CPU its own second
# of bash moved every budget by one).
left_for() {
  local now=$SECONDS
  (( DRY )) && now=$STAGE_START
  local left=$(( STAGE_START + BUDGET - now - 10 ))
  echo $(( $1 < left ? $1 : left ))
}

# script_budget <step timeout s> <budget s> [margin s, 20]: the --time-budget of a script run
# by a step that wants <step timeout> s: its own <budget>, or, when the stage has less left
# (the step's timeout is cut), that cut timeout less the margin, so that the script stops
# starting cases (and writes what it has) before the timeout ends it; at least 5.
script_budget() {
  local b=$(( $(left_for "$1") - ${3:-20} ))
  (( b > $2 )) && b=$2
  (( b < 5 )) && b=5
  echo "$b"
}

summarize() {  # summarize <log> <grep -E pattern> <lines>
  (( DRY )) && return 0
  [ -f "$R/$1" ] && grep -E "$2" "$R/$1" | tail -"$3" >> "$S"
  return 0
}

build() {
  if (( ! DRY )) && "$PY" -c "import ctxfast._cuda, ctxfast.kernels" 2>/dev/null; then
    echo "build: ctxfast._cuda already imports" | tee -a "$S"; return 0
  fi
  # The README's command, with the index switched off: it must work offline (pyproject.toml).
  # -v: the log keeps the compile and link lines (the H200's modules came out with a static
  # libstdc++ and a quiet log could not say from which link line).
  step "build" 400 build.log env PIP_NO_INDEX=1 "$PY" -m pip install --no-build-isolation --no-deps -e . -v
  summarize build.log "Successfully|ERROR|error:" 5
  (( DRY )) && { probe; return 0; }
  "$PY" -c "import ctxfast._cuda, ctxfast.kernels" >> "$S" 2>&1 \
    || echo "build: ctxfast._cuda does not import after the build (see r/build.log)" | tee -a "$S"
  # PROBE=0: skip it (~45 s; round 4 found every refusal raising with the system libstdc++)
  (( ${PROBE:-1} )) && probe
  return 0
}

# Does a C++ op's refusal reach Python as an exception? (The first H200 round: every one
# was a segfault, extension built by /opt/gcc/bin/g++.) If not, and the system g++ is
# another compiler, rebuild with it and probe again: the rest of the stage then runs on
# the build that raises, and the summary says which compiler that was.
probe() {
  step "exception probe" 120 exception_probe.log "$PY" benchmarks/exception_probe.py
  summarize exception_probe.log "." 25
  (( DRY )) && return 0
  grep -q "^probe .*FAILED" "$R/exception_probe.log" 2>/dev/null || return 0
  [ -x /usr/bin/g++ ] && [ "$(readlink -f /usr/bin/g++)" != "$(readlink -f "$(command -v c++)")" ] \
    || { echo "exception probe: failed; no other g++ to rebuild with" | tee -a "$S"; return 0; }
  step "build (CXX=/usr/bin/g++)" 400 build_system_gxx.log env CXX=/usr/bin/g++ CC=/usr/bin/gcc \
    PIP_NO_INDEX=1 "$PY" -m pip install --no-build-isolation --no-deps -e .
  summarize build_system_gxx.log "Successfully|ERROR|error:" 5
  step "exception probe (system g++)" 120 exception_probe_system_gxx.log \
    "$PY" benchmarks/exception_probe.py
  summarize exception_probe_system_gxx.log "." 25
}

device_lines() {
  note "device"
  if (( ! DRY )); then
    nvidia-smi -L | tee -a "$S"
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$S"
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" | tee -a "$S"
  fi
}

# The whole suite on CUDA (tests/gpu included), after the C++ LSTM ops' bad-input checks.
suite() {
  # The first round's xdist workers crashed on the C++ LSTM ops' ValueError checks (CPU
  # tensors, torch 2.11; not reproduced on torch 2.13): run them once in one process first,
  # with faulthandler, so a crash is attributed to the op and not to xdist.
  step "bad-input checks of the C++ LSTM ops (one process)" 120 lstm_bad_inputs.log \
    "$PY" -X faulthandler -m pytest tests/test_lstm_native.py tests/gpu/test_lstm_gpu.py -q \
    -p no:cacheprovider -p no:xdist -k "bad_inputs"
  summarize lstm_bad_inputs.log "Fatal| passed| failed" 5
  local xdist=() per_test=()
  if (( DRY )) || "$PY" -c "import xdist" 2>/dev/null; then xdist=(-n 12); fi
  # One hung test (a grid-synchronised kernel that never meets its barrier) must not take
  # the whole step: pytest-timeout ends that worker, xdist starts another.
  if (( DRY )) || "$PY" -c "import pytest_timeout" 2>/dev/null; then
    per_test=(-o timeout=150 -o timeout_method=thread)
  fi
  # -v: one line per test as it ends, so a step cut by its timeout still names what failed
  # (the first H200 round's -q log said only "F" at 80%).
  # OMP_NUM_THREADS=2: the C++ CPU kernels' tests run at::parallel_for in every worker;
  # 12 workers x 16 threads on 16 cores was oversubscribed (the suite ran past 330 s).
  # Order: tests/gpu and the files that run CUDA kernels first, the CPU-only files (the
  # C++ CPU kernels, docs, layout, the bench harness; CI runs them on every landing) last,
  # so a step cut by its timeout has run what only a GPU can check.
  local cpu_last=(tests/test_attention_cpu.py tests/test_rel_attention_cpu.py
                  tests/test_output_cache.py tests/test_docs.py tests/test_layout.py
                  tests/test_bench.py)
  local files=(tests/gpu) f
  for f in tests/test_*.py; do
    [[ " ${cpu_last[*]} " == *" $f "* ]] || files+=("$f")
  done
  files+=("${cpu_last[@]}")
  # SUITE_FILES="tests/gpu tests/test_rel_attention.py ...": those files only (a short lease)
  [ -n "${SUITE_FILES:-}" ] && read -r -a files <<< "$SUITE_FILES"
  step "tests (whole suite on CUDA, tests/gpu included)" "${1:-330}" tests.log \
    env OMP_NUM_THREADS=2 "$PY" -m pytest "${files[@]}" -v -ra --durations=25 \
    -p no:cacheprovider "${xdist[@]}" "${per_test[@]}"
  summarize tests.log "^(FAILED|ERROR)| (FAILED|ERROR) | passed| failed|Timeout|node down" 80
}

stage_build_test() {
  device_lines
  build
  step "info" 60 info.txt "$PY" -m ctxfast.cli info
  step "smoke" 120 smoke.txt "$PY" -m ctxfast.cli smoke
  summarize smoke.txt "FAIL|smoke:" 10
  suite
  step "xl-eval (paper lengths)" 240 xl_eval.log "$PY" -m ctxfast.cli xl-eval --out "$R/xl-eval" --no-progress
  summarize xl_eval.log "." 25
  # bf16 too (what users train in; the paper measured fp32): run when the stage has time left
  step "xl-eval bf16 (paper lengths)" 240 xl_eval_bf16.log "$PY" -m ctxfast.cli xl-eval \
    --dtype bfloat16 --out "$R/xl-eval-bf16" --no-progress
  summarize xl_eval_bf16.log "." 25
}

stage_tests() {   # build-test without smoke and xl-eval: what a 15-minute lease has room for
  device_lines
  build
  suite 480        # the rest of the stage's budget (cut to it)
}

stage_sanitize() {
  build
  # The timed medians against torch.profiler, once per case, for the suites where the
  # first GPU round disagreed with a profile (the AWD-LSTM train step, 2026-11-22).
  step "profile check (lstm, models)" 150 profile_check.log "$PY" -m ctxfast.cli bench \
    --ops lstm models --profile-check --time-budget "$(script_budget 150 120 30)" --no-plots --no-progress \
    --out "$R/profile-check"
  summarize profile_check.log "profiler saw|timed call ran|report" 30
  local tool spec
  for spec in "${SANITIZE_TESTS[@]}"; do     # both tools per file: a cut stage still has both
    for tool in memcheck racecheck; do
      local file=${spec%%|*} k=${spec#*|}
      local args=("$file" -q -p no:cacheprovider -p no:xdist)
      [ -n "$k" ] && args+=(-k "$k")
      local name
      name=$(basename "$file" .py)
      step "compute-sanitizer $tool $file${k:+ -k '$k'}" 90 "sanitizer_${tool}_${name}.log" \
        compute-sanitizer --tool "$tool" --error-exitcode 99 "$PY" -m pytest "${args[@]}"
      summarize "sanitizer_${tool}_${name}.log" "ERROR SUMMARY| passed| failed" 2
    done
  done
}

stage_bench() {
  build
  # The LSTM's launch forms side by side (Triton persistent / per step, CUDA C++ persistent /
  # per step, cuDNN + WeightDropout), first: the first GPU numbers of the new LSTM kernels.
  (( ${LSTM_COMPARE:-1} )) && step "lstm launch forms" 100 lstm_launch_compare.log \
    "$PY" benchmarks/lstm_launch_compare.py --out "$R/lstm_launch_compare.json"
  summarize lstm_launch_compare.log "ms" 20
  # Where one call's time goes (each kernel and torch op, host time per call), first: the
  # first H200 round could not tell kernel time from host time.
  (( ${BREAKDOWN:-1} )) && step "kernel breakdown" 240 kernel_breakdown.log \
    "$PY" benchmarks/kernel_breakdown.py --out "$R/kernel_breakdown.json"
  summarize kernel_breakdown.log "fwd\+bwd" 10
  # SWEEP=1: the attention and rel_attention kernels' launch rows against candidates, one
  # kernel at a time (benchmarks/config_sweep.py; SWEEP_TIME s, default 180).
  (( ${SWEEP:-0} )) && step "config sweep" $(( ${SWEEP_TIME:-180} + 60 )) config_sweep.log \
    "$PY" benchmarks/config_sweep.py \
    --time-budget "$(script_budget $(( ${SWEEP_TIME:-180} + 60 )) "${SWEEP_TIME:-180}" 60)" --out "$R/config_sweep.json"
  summarize config_sweep.log ": current" 20
  # The whole set in under 9 minutes: the runner's time budget stops starting cases when
  # it is spent (and names them); a fifth of the default timing budget per case still
  # gives every case its warm-up and >= 10 CUDA-event repetitions.
  local ops=() profile=()
  [ -n "${BENCH_OPS:-}" ] && ops=(--ops ${BENCH_OPS})
  # PROFILE_CHECK=1: each case also once under torch.profiler (its kernel time next to the
  # timed median): the first H200 round's attention fwd+bwd read ~0.7-1.2 ms at every size
  # from Tq 1 to Tq 512 x 3,584 keys, a floor that looks like host time, not kernels.
  (( ${PROFILE_CHECK:-0} )) && profile=(--profile-check)
  step "bench (${BENCH_OPS:-full})" 540 bench.log \
    env CTXFAST_BENCH_BUDGET_SCALE="${CTXFAST_BENCH_BUDGET_SCALE:-0.2}" \
    "$PY" -m ctxfast.cli bench --time-budget "$(script_budget 540 "${BENCH_TIME:-420}" 120)" \
    --no-progress --out "$R/bench" \
    "${ops[@]}" "${profile[@]}"
  summarize bench.log "report|note:|failed|speedup" 30
}

# Where the time goes, on the device: the host time of attention's forward+backward split
# into its parts, then ncu (hardware counters; Firecracker machines only, clocks left
# alone) over every kernel of one rel_attention and one attention forward+backward at
# Transformer-XL's training shape: throughput of each unit, warp stalls, shared-memory
# and local-memory (spill) traffic, occupancy.
# What a persistent LSTM step costs before arithmetic: a grid barrier, and the barrier
# with the exchange of h (benchmarks/grid_sync_probe.cu: plain CUDA, built here with nvcc).
grid_sync_probe() {
  step "grid-sync probe (LSTM step floor)" "${1:-60}" grid_sync_probe.log bash -c \
    "nvcc -O3 -arch=sm_90 -o '$R/grid_sync_probe' benchmarks/grid_sync_probe.cu && '$R/grid_sync_probe'"
  summarize grid_sync_probe.log "us per step|device|error" 6
}

# Where each step of the tensor-core LSTM kernels goes, phase by phase, from the kernels'
# own clocks (benchmarks/lstm_phase_clock.py; ULMFiT and ELMo layers, bf16 and float32).
lstm_phase_clock() {
  step "lstm phase clock" "${1:-60}" lstm_phase_clock.log "$PY" benchmarks/lstm_phase_clock.py \
    --out "$R/lstm_phase_clock.json"
  summarize lstm_phase_clock.log "us a step|^  [a-z]|Error|error" 60
}

stage_ncu() {
  build
  grid_sync_probe 60
  lstm_phase_clock 60
  # the Triton LSTM's persistent kernels have never been timed on a GPU (compiles included
  # in the first call of each: the step may end before ELMo's; each row prints as it lands)
  step "lstm: Triton persistent against cuDNN" 60 lstm_triton_compare.log "$PY" \
    benchmarks/lstm_launch_compare.py --reps 5 --forms "triton persistent" \
    "cuDNN+WeightDropout" --out "$R/lstm_triton_compare.json"
  summarize lstm_triton_compare.log "ms|does not" 10
  step "host split" 90 host_split.log "$PY" benchmarks/kernel_breakdown.py --host-split \
    --out "$R/host_split.json"
  summarize host_split.log "us per call|^ +[0-9]" 20
  step "ncu (rel_attention, attention fwd+bwd)" 420 ncu.log ncu --clock-control none \
    --nvtx --nvtx-include "profile/" --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    --section Occupancy "$PY" benchmarks/kernel_breakdown.py --ncu-target
  summarize ncu.log "==PROF==|_kernel|Compute \(SM\) Throughput|Memory Throughput|Duration" 60
}

# One short lease (15 minutes of device time, one call): the build and the refusal probe,
# the test files whose kernels or build changed since the last GPU round (tests/gpu first),
# then the timings: attention's and rel_attention's launch rows tuned against SDPA,
# dQ / dr summed by each form, the CUDA LSTM's tensor-core kernels against cuDNN, the LSTM
# launch sweeps. SUITE_FILES replaces the file list.
VERIFY_FILES="tests/gpu tests/test_linear.py tests/test_lstm.py tests/test_tune.py
  tests/test_build_flags.py tests/test_cuda_bindings.py tests/test_lstm_native.py tests/test_attention.py
  tests/test_rel_attention.py tests/test_rel_attention_bwd.py tests/test_rel_attention_decode.py
  tests/test_rel_attention_precision.py tests/test_grad_call.py tests/test_launch.py
  tests/test_dispatch.py tests/test_gpu_limits.py"
stage_verify() {
  device_lines
  build
  # The suite first (39th session): the device code of twenty sessions without a GPU
  # (warp-specialised attention, TMA bulk reductions, the tf32x3 decoder, rel_attention's
  # backward recomputing the forward's rounding, NaN through the LSTM clips) has never run,
  # and correctness comes before speed. Before, the timing steps came first and asked for
  # ~1,050 s of a 560 s stage between them: the suite got nothing (round 4: 200 s reached
  # 581 of 591 tests).
  SUITE_FILES=${SUITE_FILES:-$(echo $VERIFY_FILES)} suite 200
  # the warp-specialised attention kernels (the tuner's "<kernel>:ws" candidates, never run
  # on a GPU; Triton's split of them is new) launched once each at GPT-2's size against
  # float64 first: if one fails or hangs, the tuner leaves them out (CTXFAST_TUNE_WS=0), so
  # that a hung candidate cannot take the tune report's step (compiles the tuner reuses)
  ws_guard 60
  # attention's launch rows tuned on this GPU (CTXFAST_AUTOTUNE's tuner: each candidate
  # checked against the table row) against the table rows and SDPA, per headline case: the
  # speed tuning gives and the rows to adopt (the per-kernel sweep: SWEEP=1 in bench)
  # (round 4: 130 s reached 6 of its 8 cases; round 5: 169 s for 4 cases) (rel_attention's
  # case first, with its untimed candidates -- the row bias product, register caps for more
  # CTAs an SM, the stored-dS backward at two stages: ~25 compiles; a cut step keeps every
  # trial timed, tune_report.py writes them on SIGTERM)
  step "tune report (rel_attention, attention)" 170 tune_report.log "$PY" \
    benchmarks/tune_report.py --time-budget "$(script_budget 170 150 20)" \
    --out "$R/tune_report.json"
  summarize tune_report.log "^case |x\)|chosen|Error|error|stopped" 48
  # attention's dQ and rel_attention's dr summed by a kernel, element-wise atomics or TMA
  # bulk reductions, and rel_attention's backward over a stored dS ("gemm") and P
  # ("stored") (untimed): the backward alone and fwd+bwd, each checked against the kernel
  # form (~14 compiles; rel_attention first); a winner becomes DQ_MODE / DR_MODE "auto"'s
  step "attention backward: dQ / dr by kernel, atomics, TMA bulk adds, stored dS" 100 \
    backward_adds_compare.log "$PY" benchmarks/backward_adds_compare.py \
    --out "$R/backward_adds_compare.json"
  summarize backward_adds_compare.log "^ratio|WRONG|Error" 12
  step "lstm: CUDA kernels against cuDNN" 110 lstm_cuda_compare.log "$PY" \
    benchmarks/lstm_launch_compare.py --reps 10 --forms "cuda persistent-mma groups" \
    "cuda persistent-mma groups ring4" "cuda persistent-mma groups ring8" "triton persistent" \
    "triton persistent split-proj" "triton persistent split-k" "triton persistent f16-operands" \
    "triton persistent split-k f16-operands" \
    "auto" "cuDNN+WeightDropout" "cuDNN+WeightDropout ieee" "triton stepwise graphed" \
    --out "$R/lstm_cuda_compare.json"
  summarize lstm_cuda_compare.log "x cuDNN" 40
  # What is left of the budget: the Triton forward (the CUDA default's) under other tiles
  # and pipelines: rows to adopt
  step "lstm: Triton forward sweep" 80 lstm_triton_sweep.log "$PY" \
    benchmarks/lstm_triton_sweep.py --time-budget "$(script_budget 80 65 15)" \
    --out "$R/lstm_triton_sweep.json"
  summarize lstm_triton_sweep.log "fastest|DISAGREES|Error" 12
  # the Triton backward's launches, the split-K rows first (CONFIG_OVERRIDE sets both
  # directions: a forward winner must not lose here), bf16
  lstm_backward_sweep 60
  # (round 5 measured it: GRID_PROBE=1 to run it again; ~6 s: nvcc, then 3 x 6 launches)
  (( ${GRID_PROBE:-0} )) && grid_sync_probe 25
  lstm_phase_clock 30
}

# The warp-specialised attention kernels' GPU test at one size (bf16 D 64, causal T 1024:
# every candidate row of the three kernels) in one process; CTXFAST_TUNE_WS=0 for the rest
# of the stage unless it passes.
ws_guard() {
  STEP_RC=0
  step "warp-specialised attention kernels, once each" "${1:-60}" ws_guard.log "$PY" -m pytest \
    tests/gpu/test_attention_gpu.py -q -p no:cacheprovider -p no:xdist \
    -k "warp_specialised and bfloat16 and 64 and 1024-1024-True"
  summarize ws_guard.log " passed| failed|Error" 4
  (( DRY )) && return 0
  if [ "$STEP_RC" != 0 ]; then
    export CTXFAST_TUNE_WS=0
    echo "ws guard: rc=$STEP_RC: CTXFAST_TUNE_WS=0 for the rest of the stage" | tee -a "$S"
  fi
}

# The Triton LSTM backward's launch sweep (benchmarks/lstm_triton_sweep.py --backward), bf16.
lstm_backward_sweep() {
  step "lstm: Triton backward sweep" "${1:-60}" lstm_triton_sweep_bwd.log "$PY" \
    benchmarks/lstm_triton_sweep.py --backward --dtypes bfloat16 \
    --time-budget "$(script_budget "${1:-60}" $(( ${1:-60} - 15 )) 15)" \
    --out "$R/lstm_triton_sweep_bwd.json"
  summarize lstm_triton_sweep_bwd.log "fastest|DISAGREES|Error" 6
}

# A second, short call on the still-warm machine after verify (round 5 had ~3 minutes
# left: a machine idle for 30 s is given back, so this runs at once, unread): the AWD-LSTM
# (ULMFiT) train step against fastai's (nn.LSTM + WeightDropout) at the benchmark's sizes,
# the warp stalls of rel_attention's and attention's kernels (ncu, ~1.5 min),
# Transformer-XL evaluation in float32 and bf16 (xl-eval --quick: the paper's lengths, a
# smaller sample; not run on a GPU since the first H100 round), memcheck over the new backward code, the LSTM
# model tests on CUDA (STAGE_BUDGET: the seconds left; the steps after it are cut).
stage_followup() {
  build
  step "AWD-LSTM train step against fastai's" 90 models_awd_lstm.log "$PY" -m pytest \
    benchmarks/bench_models.py -q -p no:cacheprovider \
    -k "awd_lstm and ULMFiT and train and not eager"
  summarize models_awd_lstm.log "test_models\[|passed|failed|Error" 12
  # where rel_attention's (and attention's) warps wait: round 5 timed its forward at 112 us
  # where its SASS issues ~28 us and its products take ~24 us; ncu's warp states and stall
  # samples per SASS line, exported as CSV (read again on a CPU: ncu_stalls.py --raw)
  step "ncu: warp stalls of rel_attention and attention (fwd+bwd)" 110 ncu_stalls.log \
    "$PY" benchmarks/ncu_stalls.py --out-dir "$R/ncu_stalls" --timeout 95
  summarize ncu_stalls.log "kernel|stalled|samples" 24
  # a float32 decoder on the Triton GEMM (tf32x3, and with each K step summed apart)
  # against cuBLAS's float32 GEMMs at the ULMFiT and ELMo sizes, with its error: what
  # decides ctxfast.ops.linear.CUDA_DEFAULT (~9 compiles first; SWEEP rows: --sweep)
  step "linear: tf32x3 decoder against cuBLAS" 75 linear_compare.log "$PY" \
    benchmarks/linear_compare.py --out "$R/linear_compare.json"
  summarize linear_compare.log "^ratio|Error" 30
  # the same step with the decoder on the Triton GEMM (tf32x3; CTXFAST_LINEAR_CUDA, read
  # at import): the decoder's share of the step (linear_compare in verify times it alone)
  step "AWD-LSTM train step, decoder on ctxfast.linear (triton)" 60 \
    models_awd_lstm_linear.log env CTXFAST_LINEAR_CUDA=triton "$PY" -m pytest \
    benchmarks/bench_models.py -q -p no:cacheprovider \
    -k "awd_lstm and ULMFiT and train and ctxfast"
  summarize models_awd_lstm_linear.log "test_models\[|passed|failed|Error" 8
  # float32 first: the paper's dtype and the first H100 round's (kernel gain 0.78x at 3,800
  # then); ctxfast now also keeps the memory's keys and values (TransformerXLConfig.reuse_kv)
  step "xl-eval --quick float32" 60 xl_eval_quick.log "$PY" -m ctxfast.cli xl-eval \
    --quick --out "$R/xl-eval-quick" --no-progress
  summarize xl_eval_quick.log "." 16
  step "xl-eval --quick bf16" 60 xl_eval_quick_bf16.log "$PY" -m ctxfast.cli xl-eval \
    --quick --dtype bfloat16 --out "$R/xl-eval-quick-bf16" --no-progress
  summarize xl_eval_quick_bf16.log "." 16
  # decoding (1 and 16 queries against an 8,192-key cache, D 128, bf16): ours against SDPA,
  # never timed on a GPU (the benchmark's harness and its check against the reference)
  step "attention decoding against SDPA" 45 attention_decode.log "$PY" -m pytest \
    benchmarks/bench_attention.py -q -p no:cacheprovider -k "decode and (triton or sdpa)" \
    --benchmark-json "$R/attention_decode.json"
  summarize attention_decode.log "decode|passed|failed|Error" 12
  # the kernels alone at 3,800 (float32, ctxfast only): against the first float32 run's
  # ctxfast row, what the K/V reuse gives
  step "xl-eval 3800 float32, no K/V reuse" 40 xl_eval_no_reuse.log "$PY" -m ctxfast.cli \
    xl-eval --quick --attn-lens 3800 --backends ctxfast --no-reuse-kv \
    --json "$R/xl-eval-no-reuse.json" --no-progress
  summarize xl_eval_no_reuse.log "." 8
  # round 5's new device code under memcheck: the grouped backward's cp.async staging and
  # the weight gradients' cublasGemmEx (small sizes: memcheck is slow)
  step "compute-sanitizer memcheck (grouped backward, TF32 weight gradients)" 60 \
    sanitizer_memcheck_followup.log compute-sanitizer --tool memcheck --error-exitcode 99 \
    "$PY" -m pytest tests/gpu/test_lstm_gpu.py -q -p no:cacheprovider -p no:xdist \
    -k "float32_weight_gradients or tensor_core_backward_reductions"
  summarize sanitizer_memcheck_followup.log "ERROR SUMMARY| passed| failed" 3
  step "LSTM model tests on CUDA" 60 lstm_models_tests.log "$PY" -m pytest -q \
    -p no:cacheprovider tests/test_models_awd_lstm.py tests/test_nn_lstm.py
  summarize lstm_models_tests.log "passed|failed|FAILED" 10
}

pack() {
  (( DRY )) && { echo "[$STAGE_NOW] tar czf $OUT/gpu_round-$STAGE.tgz -C $OUT r summary.txt"; return 0; }
  note "done: $OUT/summary.txt, $OUT/gpu_round-$STAGE.tgz"
  tar czf "$OUT/gpu_round-$STAGE.tgz" -C "$OUT" r summary.txt
}

run_stage() {
  STAGE_NOW=$1
  STAGE_START=$SECONDS
  note "stage $1"
  case $1 in
    build-test) stage_build_test ;;
    tests) stage_tests ;;
    sanitize) stage_sanitize ;;
    bench) stage_bench ;;
    ncu) stage_ncu ;;
    verify) stage_verify ;;
    followup) stage_followup ;;
  esac
}

if [ "$STAGE" = all ]; then
  for s in build-test sanitize bench; do run_stage "$s"; done
else
  run_stage "$STAGE"
fi
pack
