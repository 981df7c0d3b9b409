"""Helpers shared by the benchmark suites (``benchmarks/bench_<op>.py``), their conftest
and ``report.py``.

Plain module with no relative imports: the ``bench_*.py`` files import it as ``_common``
(pytest puts ``benchmarks/`` on ``sys.path``), ``report.py`` loads it by path.

The suite interface: what a ``benchmarks/bench_<op>.py`` provides
-----------------------------------------------------------------
* **The file name is the op family.** ``report.py`` finds the suites by globbing
  ``bench_*.py`` (``ctxfast bench --ops <op>`` picks ``bench_<op>.py``); no list of ops
  is kept anywhere else. Add the op's baseline backend to ``report.BASELINES`` (or put
  ``baseline=`` in :func:`describe`).
* **One pytest test, parametrised** by :func:`params` over ``(case, mode, backend)``,
  taking pytest-benchmark's ``benchmark`` fixture and the ``bench_device`` fixture
  (``conftest.py``). Cases are small objects with ``.name`` and ``.devices``; the quick
  set (``CTXFAST_BENCH_QUICK=1``) must cover the op on a 2-core CPU in well under a
  minute. The op's baseline is one of the backends: it is timed in the same run on the
  same inputs, and ``report.py`` pairs every other backend with it.
* **Describe the benchmark first**, with :func:`describe` (op, case, mode, backend,
  dtype, device, and where they mean something ``T`` (the x axis of the speedup plot),
  ``series`` (one line of that plot), ``flops`` (FLOPs of one call: TFLOP/s in the
  report), ``min_bytes`` (least memory traffic of one call: GB/s in the report) and, for
  whole models, ``tokens`` (token positions one call processes: tokens/s in the report)).
  It must come before anything that can run out of memory, so an OOM can be recorded.
* **Inputs**: fresh ``torch.randn`` (never zeros), made by :func:`input_sets` (several
  rotated sets where they fit in the GPU's L2). Check the backend against the reference
  before timing it; put that setup inside ``with oom_guard(benchmark):``.
* **Time** with :func:`measure` — warm-up, then one timed loop that holds the op and
  nothing else (CUDA events on a GPU, at least :data:`MIN_REPS` repetitions, median),
  peak memory on CUDA, and an out-of-memory error recorded as a result
  (``extra_info["oom"]``) instead of a crash. Suites never catch OOM themselves, and
  never time anything themselves.

What :func:`measure` writes into ``benchmark.extra_info`` (read by ``report.py``):
``ms`` (median over all timed rounds, milliseconds per call), ``ms_min``, ``ms_max``,
``ms_pass1``, ``ms_pass2`` (medians of the first and second half of the rounds),
``spread`` (``|pass1 − pass2| / min``), ``rounds``, ``iterations``, ``reps`` (timed
calls), ``warmup``, ``timer`` (``"cuda-events"`` or ``"perf_counter"``),
``peak_mem_bytes`` (CUDA; None on the CPU, where it is not measured), ``op_backends``
({op: [backends]} that ctxfast's dispatch resolved in an untimed call after the timing),
with ``$CTXFAST_BENCH_PROFILE=1`` ``profiler_ms`` / ``profiler_wall_ms`` (one call under
``torch.profiler``) and, on an out-of-memory error, ``oom`` (the first line of the
message) with ``ms`` None; with ``paired=(peer, peer_fn)`` on the CPU, ``paired``
(:func:`measure`, step 5).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import importlib.metadata
import itertools
import json
import math
import os
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

#: Environment variable that selects the quick case set (set by ``report.py --quick``).
QUICK_ENV = "CTXFAST_BENCH_QUICK"
#: Environment variable that forces the device ("cpu", "cuda", "cuda:1"); default: CUDA
#: when available, else CPU.
DEVICE_ENV = "CTXFAST_BENCH_DEVICE"
#: Environment variable with the number of CPU threads to use (set by ``report.py
#: --threads``, applied by ``conftest.py``); default: torch's.
THREADS_ENV = "CTXFAST_BENCH_THREADS"
#: Environment variable: "0" turns off the CPU's interleaved timing against a peer
#: (:func:`measure`'s ``paired``); default on.
PAIRED_ENV = "CTXFAST_BENCH_PAIRED"
#: Environment variable that scales every timing budget (e.g. ``0.1`` for the pipeline's
#: own tests); default 1.
BUDGET_SCALE_ENV = "CTXFAST_BENCH_BUDGET_SCALE"


def quick() -> bool:
    """True when the quick case set is asked for (``CTXFAST_BENCH_QUICK=1``)."""
    return os.environ.get(QUICK_ENV, "0").strip() not in ("", "0", "false", "no")


def bench_device(device: Optional[str] = None) -> torch.device:
    """The device to benchmark on: `device`, else ``$CTXFAST_BENCH_DEVICE``, else CUDA
    if available, else CPU."""
    name = device or os.environ.get(DEVICE_ENV, "").strip()
    if not name:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@functools.lru_cache(maxsize=None)
def _cpu_model() -> str:
    """The CPU's model name, and its widest vector ISA where /proc/cpuinfo lists AVX-512 or
    AVX2 (", AVX-512"): a VM may name only the vendor ("AMD EPYC"), and the cpu kernels take
    different code on either (csrc/cpu/tile_avx512.h), so records of an AVX2 host and an
    AVX-512 host with the same name land in different results folders."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key == "model name" and not name:
                    name = " ".join(line.split(":", 1)[1].split())
                elif key == "flags" and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if not name:
        import platform
        name = platform.processor() or platform.machine() or "unknown CPU"
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return f"{name}, {isa}" if isa else name


def device_name(device: "torch.device | str") -> str:
    """E.g. ``"NVIDIA H100 80GB HBM3"`` or ``"AMD EPYC 7B13 (2 threads)"``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{_cpu_model()} ({torch.get_num_threads()} threads)"
    return device.type


def versions() -> dict:
    """``{"torch": torch.__version__, "triton": version or None}`` (triton not imported)."""
    try:
        triton_version: Optional[str] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version}


def describe(benchmark, *, op: str, case: str, mode: str, backend: str,
             dtype: torch.dtype, device: torch.device, **info) -> None:
    """Fill ``benchmark.extra_info`` with what ``report.py`` needs to pair and label the
    benchmark: op, case, mode, backend, dtype, device (and its name), torch and triton
    versions, plus `info` (e.g. ``T=``, ``series=``, ``flops=``, ``min_bytes=``,
    ``tokens=`` (token positions per call: tokens/s in the report), ``baseline=``,
    ``shape=``). Sets ``benchmark.group`` to "<op> <case> <mode>"."""
    ver = versions()
    benchmark.group = f"{op} {case} {mode}"
    benchmark.extra_info.update(
        op=op, case=case, mode=mode, backend=backend,
        dtype=str(dtype).replace("torch.", ""), device=str(device),
        device_name=device_name(device), torch=ver["torch"], triton=ver["triton"], **info)


def _l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    return 0


def input_sets(make: Callable[[], Sequence[torch.Tensor]], device: torch.device,
               max_total_bytes: int = 1 << 30) -> list:
    """Several input sets made by `make()`, to be rotated so that timings on a GPU do not
    come from a warm L2: enough sets to cover twice the L2 size (at most
    `max_total_bytes`, at most 256 sets). One set on the CPU (ratios only there)."""
    first = tuple(make())
    nbytes = sum(t.numel() * t.element_size() for t in first)
    l2 = _l2_bytes(device)
    if l2 == 0 or nbytes >= 2 * l2:
        return [first]
    n = min(256, math.ceil(2 * l2 / nbytes), max(1, max_total_bytes // nbytes))
    return [first] + [tuple(make()) for _ in range(n - 1)]


# --------------------------------------------------------------------------- out of memory

def _first_line(e: BaseException) -> str:
    """The first line of an exception's message ("" if it has none)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def _oom_message(e: BaseException) -> str:
    return _first_line(e) or "out of memory"


def _iterations(est: float) -> int:
    """Calls per timed round for calls of about `est` seconds: rounds of ~0.2 ms at least
    (perf_counter's resolution and the loop's own cost stay small), at most 1000 calls."""
    return max(1, min(1000, round(2e-4 / est)))


def _free_memory(device: Optional[torch.device] = None) -> None:
    gc.collect()
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.empty_cache()


def record_oom(benchmark, message: str) -> None:
    """Record an out-of-memory result: ``extra_info["oom"] = message``, no timing
    (``ms`` None). pytest-benchmark only writes a benchmark that ran, so where the fixture
    has not run yet a no-op is run once through it; its time means nothing (``report.py``
    reads ``extra_info``, never these stats, for an OOM)."""
    benchmark.extra_info.update(oom=message, ms=None, ms_min=None, ms_max=None,
                                ms_pass1=None, ms_pass2=None, spread=None,
                                peak_mem_bytes=None)
    if not getattr(benchmark, "_mode", None):        # fixture not used yet
        benchmark.pedantic(lambda: None, rounds=1, iterations=1, warmup_rounds=0)


@contextlib.contextmanager
def oom_guard(benchmark, device: Optional[torch.device] = None) -> Iterator[None]:
    """Run the body; if it raises ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``
    is the same class), record the OOM with :func:`record_oom` and go on instead of
    failing. Memory is freed after the exception (and the frames it holds) is gone."""
    message = None
    try:
        yield
    except torch.OutOfMemoryError as e:
        message = _oom_message(e)
    if message is not None:                      # outside the except: no frame keeps tensors
        _free_memory(device)
        if "oom" not in benchmark.extra_info:    # measure() may have recorded it already
            record_oom(benchmark, message)


# --------------------------------------------------------------------------- timing

#: Least number of timed calls per benchmark (docs/ARCHITECTURE.md, "Benchmark protocol": at least 10 repetitions).
MIN_REPS = 10
#: Warm-up stops early once the calls after the first have taken this long (seconds): a
#: 250 ms eager baseline needs no five warm-up calls to be compiled and allocated.
WARMUP_ENOUGH_S = 0.3
#: Environment variable: when "1", :func:`measure` runs one extra call of each benchmark
#: under ``torch.profiler`` after the timing (CUDA only) and records the GPU kernel time
#: it saw (``profiler_ms``), so the timed median can be checked against a profiler trace
#: of the same call (``ctxfast bench --profile-check``; the GPU round sets it).
PROFILE_ENV = "CTXFAST_BENCH_PROFILE"


def _cuda_events(rounds: int):
    """`rounds` pairs of timing CUDA events (a seam: the tests replace it on the CPU)."""
    return ([torch.cuda.Event(enable_timing=True) for _ in range(rounds)],
            [torch.cuda.Event(enable_timing=True) for _ in range(rounds)])


def _sync(device: torch.device) -> None:
    """Wait for `device` (a no-op on the CPU). Never called inside the timed loop."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_rounds(fn: Callable, args: Sequence[tuple], device: torch.device,
                 iterations: int) -> List[float]:
    """Seconds per call of each round: round ``r`` calls ``fn(*a)`` for the
    `iterations` argument tuples ``args[r * iterations:(r + 1) * iterations]``.

    The timed region holds the calls of `fn` and nothing else: the argument tuples are
    picked before it, no check, hook, allocation or host synchronisation runs between
    the calls (``tests/test_bench.py`` holds this). CUDA: one pair of CUDA events around
    each round (GPU time of the kernels, their launches included where they keep the
    GPU waiting), one synchronisation before the first and after the last round only.
    CPU: ``time.perf_counter`` around each round.
    """
    rounds = len(args) // iterations
    if device.type == "cuda":
        starts, ends = _cuda_events(rounds)
        _sync(device)
        i = 0
        for r in range(rounds):
            starts[r].record()
            for _ in range(iterations):
                fn(*args[i])
                i += 1
            ends[r].record()
        _sync(device)
        return [s.elapsed_time(e) * 1e-3 / iterations for s, e in zip(starts, ends)]
    out = []
    i = 0
    clock = time.perf_counter
    for _ in range(rounds):
        t0 = clock()
        for _ in range(iterations):
            fn(*args[i])
            i += 1
        out.append((clock() - t0) / iterations)
    return out


def _time_paired(fn: Callable, peer: Callable, args: Sequence[tuple], iterations: int,
                 peer_iterations: int) -> tuple:
    """Interleaved rounds of `fn` and `peer` on the CPU: round ``r`` times
    ``iterations`` calls of ``fn(*args[r])`` and ``peer_iterations`` calls of
    ``peer(*args[r])``, `fn` first in even rounds and `peer` first in odd ones. Returns
    (seconds per call of `fn`, of `peer`), one value per round each. As in
    :func:`_time_rounds`, a timed region holds the calls and nothing else."""
    ours, theirs = [], []
    clock = time.perf_counter
    for r, a in enumerate(args):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            f, n = (fn, iterations) if which == 0 else (peer, peer_iterations)
            t0 = clock()
            for _ in range(n):
                f(*a)
            t = (clock() - t0) / n
            (ours if which == 0 else theirs).append(t)
    return ours, theirs


def _per_call_estimate(fn: Callable, args: tuple, calls: int = 3) -> float:
    """Median seconds of `calls` untimed-protocol calls of ``fn(*args)`` (CPU)."""
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return max(statistics.median(ts), 1e-7)


def _paired(fn: Callable, peer_name: str, peer: Callable, sets: list, est: float,
            budget_s: float, min_rounds: int, max_rounds: int) -> dict:
    """``measure``'s step 5: `fn` and `peer` timed in alternation (:func:`_time_paired`)
    on the same input sets for about `budget_s`. The speedup is the median over the rounds
    of peer time / our time, both from the same round; q1, q3 its quartiles."""
    peer(*sets[0])                                   # warm-up (allocator, first-call work)
    peer_est = _per_call_estimate(peer, sets[0])
    iterations, peer_iterations = _iterations(est), _iterations(peer_est)
    per_round = est * iterations + peer_est * peer_iterations
    rounds = int(min(max_rounds, max(min_rounds, budget_s / per_round)))
    cyc = itertools.cycle(sets)
    args = [next(cyc) for _ in range(rounds)]
    ours, theirs = _time_paired(fn, peer, args, iterations, peer_iterations)
    ratios = sorted(b / a for a, b in zip(ours, theirs) if a > 0)
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else ratios * 3
    return {"peer": peer_name, "speedup": statistics.median(ratios),
            "q1": q[0], "q3": q[2], "rounds": len(ratios),
            "ms": statistics.median(ours) * 1e3, "peer_ms": statistics.median(theirs) * 1e3}


def _feed_pytest_benchmark(benchmark, per_call_s: Sequence[float], iterations: int) -> None:
    """Give pytest-benchmark the rounds that :func:`measure` timed, so its table (``ctxfast
    bench --verbose``) and JSON show the same CUDA-event (or perf_counter) times as the
    report, without running the op again. Uses the fixture's stats API (pytest-benchmark
    3-5: ``_make_stats`` / ``Metadata.update``); where that is missing or the fixture is
    disabled, one no-op is run through ``pedantic`` so the benchmark is still recorded
    (its time means nothing: the report reads ``extra_info``)."""
    make = getattr(benchmark, "_make_stats", None)
    if make is not None and not getattr(benchmark, "_mode", None) \
            and getattr(benchmark, "enabled", True) is not False:
        try:
            stats = make(iterations)
        except (TypeError, AttributeError):
            stats = None
        if stats is not None:
            for t in per_call_s:
                stats.update(t * iterations)       # pytest-benchmark divides by iterations
            benchmark._mode = "ctxfast _common.measure"
            return
    if not getattr(benchmark, "_mode", None):
        benchmark.pedantic(lambda: None, rounds=1, iterations=1, warmup_rounds=0)


@contextlib.contextmanager
def _op_backend_spy(seen: Dict[str, List[str]]) -> Iterator[None]:
    """Record {op: [backends]} that ctxfast's dispatch resolves inside the block (nothing
    when ctxfast is not imported). Used around an untimed call only."""
    import sys
    dispatch = sys.modules.get("ctxfast._dispatch")
    if dispatch is None:
        yield
        return
    real = dispatch.resolve

    def resolve(op, device, backend=None):
        name = real(op, device, backend)
        if name not in seen.setdefault(op, []):
            seen[op].append(name)
        return name

    dispatch.resolve = resolve
    try:
        yield
    finally:
        dispatch.resolve = real


def profile_call(fn: Callable, args: Sequence, device: torch.device) -> Optional[dict]:
    """One ``fn(*args)`` under ``torch.profiler`` (CUDA only; None on the CPU): ``{"gpu_ms":
    sum of the device time of the kernels it ran, "wall_ms": its wall time with a
    synchronisation, "kernels": launches}``."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn(*args)
        _sync(device)
        wall = time.perf_counter() - t0
    gpu_us, kernels = 0.0, 0
    for ev in prof.events():                     # device-side events: kernels, memcpy, memset
        if "CUDA" not in str(getattr(ev, "device_type", "")):
            continue
        span = getattr(ev, "time_range", None)
        if span is not None:
            gpu_us += max(0.0, float(span.end - span.start))
            kernels += 1
    return {"gpu_ms": gpu_us * 1e-3, "wall_ms": wall * 1e3, "kernels": kernels}


def measure(benchmark, fn: Callable, sets: list, device: torch.device, *,
            budget_s: float, min_rounds: int = MIN_REPS, max_rounds: int = 2000,
            warmup: int = 5, peak_memory: bool = True,
            paired: Optional[tuple] = None):
    """Time ``fn(*s)`` over the input sets `sets` (rotated) under the project's protocol
    (docs/ARCHITECTURE.md, "Benchmark protocol") and record the result in ``benchmark.extra_info`` (keys: see the module
    docstring). Returns what `fn` returned in the untimed call of step 4 (None after an OOM).

    1. Warm-up: `warmup` calls (fewer, at least two, once the calls after the first have
       taken :data:`WARMUP_ENOUGH_S`), each synchronised (compilation, autotuning and
       allocator growth stay out of the timing); their median (the first call excluded) sets the
       number of rounds so that the timing lasts about `budget_s` (between
       ``max(min_rounds, MIN_REPS)`` and `max_rounds`; calls shorter than ~0.2 ms are
       grouped `iterations` to a round). ``$CTXFAST_BENCH_BUDGET_SCALE`` multiplies
       `budget_s`.
    2. One timed loop (:func:`_time_rounds`): CUDA events on a GPU, ``perf_counter`` on
       the CPU; nothing but `fn` inside. ``ms`` is the median over the rounds; the rounds
       are split into two halves (first, second) whose medians are ``ms_pass1`` and
       ``ms_pass2``: ``spread`` is their relative difference — the same code timed twice,
       so a speedup closer to 1 than that is noise.
    3. pytest-benchmark is given those same rounds (:func:`_feed_pytest_benchmark`): no
       extra timing pass of its own.
    4. After the timing, untimed: on CUDA (`peak_memory`) the peak memory of one call
       beyond what was allocated; the ctxfast op backends that call resolved
       (``op_backends``); with ``$CTXFAST_BENCH_PROFILE=1`` one call under
       ``torch.profiler`` (``profiler_ms``, ``profiler_wall_ms``).

    5. On the CPU, with ``paired=(peer, peer_fn)`` (``peer_fn`` takes the same
       arguments; ``$CTXFAST_BENCH_PAIRED=0`` skips it): `fn` and ``peer_fn`` timed again
       in alternating rounds for another `budget_s` (:func:`_paired`), so that both see
       the same stretch of a shared machine's load. ``paired`` = {``peer``, ``speedup``
       (median over the rounds of peer time / ours in the same round), ``q1``, ``q3``,
       ``rounds``, ``ms``, ``peer_ms``}. The separate timings of step 2 (one backend
       after the other, each for its own seconds) can each land on a slow stretch of the
       host: on the 2-core dev machine a ratio read 1.82x-2.10x across four runs of the
       same code. Not on a GPU (CUDA events time the kernels, not the host's load). Where
       the peer raises, ``paired`` = {``peer``, ``error``} and the rest of the result
       stands.

    ``torch.OutOfMemoryError`` anywhere in 1–5 is recorded (:func:`record_oom`) instead
    of raised.
    """
    budget_s *= float(os.environ.get(BUDGET_SCALE_ENV, "1") or 1)
    min_rounds = max(int(min_rounds), MIN_REPS)
    result = []
    oom = None
    try:
        times = []
        cyc = itertools.cycle(sets)
        for _ in range(max(1, warmup)):          # warm-up calls, timed for the estimate
            t0 = time.perf_counter()
            fn(*next(cyc))
            _sync(device)
            times.append(time.perf_counter() - t0)
            if len(times) >= 2 and sum(times[1:]) > WARMUP_ENOUGH_S:
                break                            # long calls: compiled and allocated already
        later = sorted(times[1:] or times)        # the first call may compile or allocate
        est = max(later[len(later) // 2], 1e-7)
        iterations = _iterations(est)
        rounds = int(min(max_rounds, max(min_rounds, budget_s / (est * iterations))))
        rounds += rounds % 2                      # two equal halves
        args = [next(cyc) for _ in range(rounds * iterations)]   # picked before the timing
        per_call = _time_rounds(fn, args, device, iterations)
        del args
        half = len(per_call) // 2
        m1, m2 = statistics.median(per_call[:half]), statistics.median(per_call[half:])
        benchmark.extra_info.update(
            ms=statistics.median(per_call) * 1e3, ms_min=min(per_call) * 1e3,
            ms_max=max(per_call) * 1e3, ms_pass1=m1 * 1e3, ms_pass2=m2 * 1e3,
            spread=abs(m1 - m2) / min(m1, m2) if min(m1, m2) > 0 else None,
            rounds=len(per_call), iterations=iterations, reps=len(per_call) * iterations,
            warmup=max(1, warmup),
            timer="cuda-events" if device.type == "cuda" else "perf_counter")
        _feed_pytest_benchmark(benchmark, per_call, iterations)
        seen: Dict[str, List[str]] = {}
        with _op_backend_spy(seen):
            if peak_memory:
                result.append(record_peak_memory(benchmark, fn, sets[0], device))
            else:
                result.append(fn(*sets[0]))
        if seen:
            before = benchmark.extra_info.get("op_backends")
            if before and before != seen:          # the suite's check saw other backends
                benchmark.extra_info["check_op_backends"] = before
            benchmark.extra_info["op_backends"] = seen
        if (paired is not None and device.type == "cpu"
                and os.environ.get(PAIRED_ENV, "1").strip() != "0"):
            peer_name, peer_fn = paired
            try:
                benchmark.extra_info["paired"] = _paired(
                    fn, peer_name, peer_fn, sets, est, budget_s, min_rounds, max_rounds)
            except Exception as e:   # the peer failed: our own timing above still stands
                benchmark.extra_info["paired"] = {
                    "peer": peer_name, "error": f"{type(e).__name__}: {_first_line(e)}"}
        if os.environ.get(PROFILE_ENV, "0").strip() == "1":
            prof = profile_call(fn, sets[0], device)
            if prof is not None:
                benchmark.extra_info.update(profiler_ms=prof["gpu_ms"],
                                            profiler_wall_ms=prof["wall_ms"],
                                            profiler_kernels=prof["kernels"])
    except torch.OutOfMemoryError as e:
        oom = _oom_message(e)
    if oom is not None:                          # outside the except: no frame keeps tensors
        result.clear()
        _free_memory(device)
        record_oom(benchmark, oom)
        return None
    return result[0] if result else None


def record_peak_memory(benchmark, fn: Callable, args: Sequence, device: torch.device) -> None:
    """``benchmark.extra_info["peak_mem_bytes"]``: on CUDA the peak memory of one
    ``fn(*args)`` beyond what was already allocated; None on the CPU (not measured there)
    and after an OOM. :func:`measure` calls it; a second call (older suites) measures
    again. An OOM here leaves the timing alone: ``peak_mem_bytes`` None and
    ``peak_mem_note`` says why. Returns what `fn` returned (None after an OOM)."""
    if device.type != "cuda" or benchmark.extra_info.get("oom"):
        benchmark.extra_info["peak_mem_bytes"] = None
        return None if benchmark.extra_info.get("oom") else fn(*args)
    failed = None
    out = None
    try:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn(*args)
        torch.cuda.synchronize(device)
        benchmark.extra_info["peak_mem_bytes"] = (torch.cuda.max_memory_allocated(device)
                                                  - before)
    except torch.OutOfMemoryError as e:
        failed = _oom_message(e)
    if failed is not None:                       # the timing stands; only the peak is lost
        _free_memory(device)
        benchmark.extra_info["peak_mem_bytes"] = None
        benchmark.extra_info["peak_mem_note"] = f"OOM while measuring the peak: {failed}"
    return out


def params(quick_cases, full_cases, modes, backends) -> list:
    """``pytest.param(case, mode, backend)`` for the device chosen now (the quick or full
    cases, those whose ``devices`` include it); parametrisation only, no work."""
    import pytest
    device_type = bench_device().type
    cases = quick_cases if quick() else full_cases
    return [pytest.param(case, mode, backend,
                         id=f"{case.name.replace(' ', '-')}-{mode}-{backend}")
            for case in cases if device_type in case.devices
            for mode in modes
            for backend in backends]


SCRIPT_DTYPES = ("float32", "float16", "bfloat16")


def add_script_args(ap, reps: int, gpu_dtypes: Sequence[str]) -> None:
    """The arguments the standalone LSTM scripts share (lstm_launch_compare.py,
    lstm_triton_sweep.py): --quick (tiny sizes, a CPU check), --reps, --dtypes (refused by
    name unless one of SCRIPT_DTYPES; default `gpu_dtypes` on a GPU, float32 on a CPU),
    --out (JSON)."""
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU check)")
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--dtypes", nargs="+", default=None, choices=SCRIPT_DTYPES,
                    help=f"default: {' '.join(gpu_dtypes)} on a GPU, float32 on a CPU")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.set_defaults(gpu_dtypes=list(gpu_dtypes))


def script_setup(args, script: str) -> Optional[List[str]]:
    """The dtypes to run, or None (after saying why) when the full sizes have no GPU."""
    if not args.quick and not torch.cuda.is_available():
        print(f"{script}: the full sizes need a GPU (use --quick on a CPU)")
        return None
    return args.dtypes or (args.gpu_dtypes if torch.cuda.is_available() else ["float32"])


def assert_within_2x_eager(label: str, ours, eager, ref, floor: float) -> None:
    """The project's accuracy rule for a suite's check before timing: ``‖ours − ref‖ <=
    2·‖eager − ref‖ + floor·‖ref‖`` (``ref`` float64; ``eager`` the eager computation at
    ours' dtype), else AssertionError naming `label` and both relative errors."""
    ref = ref.double()
    rn = ref.norm().item()
    err = (ours.double() - ref).norm().item() / rn
    eager_err = (eager.double() - ref).norm().item() / rn
    if not err <= 2 * eager_err + floor:
        raise AssertionError(f"{label}: relative error {err:.3g} > 2 x eager's "
                             f"{eager_err:.3g} + {floor:g}")


def finish_script(out: Optional[str], rows: list, lines: Sequence[str]) -> int:
    """The standalone scripts' end: the rows as JSON at `out` (:func:`write_rows`), then
    the summary `lines` printed; 0 (the exit status)."""
    write_rows(out, rows)
    for line in lines:
        print(line, flush=True)
    return 0


def write_rows(path: Optional[str], rows: list) -> None:
    """``{"device", "torch", "rows"}`` as JSON at `path` (nothing if None)."""
    if path:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with open(path, "w") as f:
            json.dump({"device": device_name(device), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


def median_timer(device: torch.device, reps: int) -> Callable[[Callable[[], object]], float]:
    """``time_ms(fn)``: the median ms of `reps` calls of fn after 3 warm-up calls, from CUDA
    events on a GPU (all recorded, one synchronisation), else from the wall clock with no
    warm-up (on a CPU the scripts run their ``--quick`` check in the interpreter, which
    compiles nothing: what it times is that the steps run, and each call there takes
    0.1-1 s). For the standalone scripts (lstm_launch_compare.py, kernel_breakdown.py);
    the suites use :func:`measure`."""
    def cuda_ms(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize(device)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize(device)
        return statistics.median(a.elapsed_time(b) for a, b in ev)

    def wall_ms(fn):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    return cuda_ms if device.type == "cuda" else wall_ms


def record_calls(module, names: Sequence[str], run_once: Callable[[], object]) -> list:
    """``[(function, args, kwargs), ...]``: the first call of each of ``module``'s functions
    ``names`` that ``run_once()`` makes (looked up on the module at call time, as ctxfast's
    ops look up their kernel-level launchers), recorded while it runs for real, in the
    order of ``names``; a function it did not call is left out. For replaying those calls
    on threads that compile ahead (``kernels/_tune.py`` ``compile_ahead``)."""
    saved = {n: getattr(module, n) for n in names}
    calls: Dict[str, tuple] = {}

    def recorder(name):
        def call(*args, **kwargs):
            calls.setdefault(name, (saved[name], args, kwargs))
            return saved[name](*args, **kwargs)
        return call
    try:
        for name in names:
            setattr(module, name, recorder(name))
        run_once()
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
    return [calls[n] for n in names if n in calls]


def replayer(calls: Sequence[tuple]) -> Callable[[], None]:
    """``run()`` that makes the calls :func:`record_calls` recorded again, in order (the
    ``run`` of ``kernels/_tune.compile_ahead``: on its threads the rows in force reach these
    kernel-level launchers, which an autograd backward, run on the engine's own thread,
    would not)."""
    def run():
        for fn, args, kwargs in calls:
            fn(*args, **kwargs)
    return run
