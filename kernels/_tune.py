"""Launch rows timed on the running GPU at a first call (``CTXFAST_AUTOTUNE=on``).

The Triton kernels' launch rows (tile sizes, warps, pipeline stages, TMA tiles) come from
tables chosen by sm_90 compile facts and a few GPU sweeps (``kernels/attention.py``
``_CONFIGS``, ``kernels/rel_attention.py`` ``_config`` / ``_bwd_launch``): one row per head-dim
bucket and dtype, the same for every GPU and every size. With tuning on, the first call of
each *kind* on a CUDA device times a short list of candidate rows per kernel on that call's
own inputs and keeps the fastest whose outputs agree with the table row's; later calls of
that kind launch with it. A kind is what the launcher's key says (op, kernels, head dim,
dtype, mask kind and flags) plus the size class of the problem (batch x heads, queries and
keys, each rounded up to a power of two). The kernels of one launcher are tuned one after
the other, each with the rows already chosen for the ones before it: k kernels of c
candidates cost k·c trial runs, not c^k.

A candidate is chosen only if

* it compiles and runs (a row needing more shared memory than the GPU has is skipped, and
  recorded), and
* every output is within ``AGREE[dtype]`` of the table row's output of the same call,
  measured as ``max |candidate − table| / max |table|`` (equal infinities agree: the lse of
  a row that sees no key). Tile shapes change only the order of summation (fp32
  accumulators) and the rounding of ``P`` to the input dtype before ``P·V``, i.e. differences
  of about one ulp of the dtype; a miscompiled launch is off by far more (the H200 found
  rel_attention's 16-bit dQ at 8 warps with 2-3 stages 25x past the tests' error bound on
  every element): the check turns it away.

Timing (:func:`_time_us`): CUDA events around ``n`` back-to-back calls, queued behind a spin
kernel (``torch.cuda._sleep``) that holds the GPU for 1.5x the host time of issuing them, so
that the launcher's host time per call (tens of µs of Python) cannot hide the kernels' time;
the best of ``ROUNDS`` rounds of about ``ROUND_MS`` each. Nothing is tuned while a CUDA
graph is being captured (the table rows run; nothing is cached).

Cost of a first call: one compile per candidate kernel (Triton caches compiles on disk, so
a later process pays only the timing, a few ms per candidate) and a copy of the call's
outputs. On a GPU the candidates of a kernel are compiled side by side before the first is
timed (:func:`compile_ahead`, :data:`COMPILE_THREADS` threads: Triton's compile spends
most of its time outside the GIL, in its passes and in ptxas; the six kernels of a bf16
rel_attention training call compiled for sm_90 on a 2-core CPU in 4.3 s one after the
other, 2.3 s on two threads). Which row wins can differ between processes (timing
noise), so two processes may give results that differ in the last bits, as with
``triton.autotune``.

Kernel modules ask :func:`current` for the rows in force (a thread-local dict, empty
outside a tuned call) before their own tables; :func:`call` sets it around a launcher call.
"""
import contextlib
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

#: "off" (default) or "on". From ``CTXFAST_AUTOTUNE`` at import; any other value is refused
#: (by name) at the first call that would tune.
MODE = os.environ.get("CTXFAST_AUTOTUNE", "off")

#: Largest ``max |candidate − table| / max |table|`` of an output that still agrees:
#: 2 ulps of the dtype's precision at the output's largest element (fp32 dots may run on
#: TF32, whose products keep 10 mantissa bits: its ulp).
AGREE = {torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6, torch.float32: 2.0 ** -9,
         torch.float64: 1e-12}

#: Time per timed round (ms) and rounds per candidate; calls per round at most MAX_CALLS.
ROUND_MS = 5.0
ROUNDS = 3
MAX_CALLS = 100
#: The spin kernel ahead of a timed round holds the GPU for HOLD_MARGIN times the host time
#: the round's calls take (measured on the first timed call), counted in cycles of a clock
#: of HOLD_CLOCK_HZ (a GPU clocked lower holds longer: more margin, not less).
HOLD_MARGIN = 1.5
HOLD_CLOCK_HZ = 2.0e9

#: Threads compiling a kernel's candidate rows before they are timed (GPU calls;
#: :func:`compile_ahead`). 1: each candidate compiles when it first runs.
COMPILE_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                             else (os.cpu_count() or 1)))

#: Also tune calls on CPU tensors (the interpreter's kernels, wall-clock timing): for tests.
ON_CPU = False
#: ``timer(once, rows) -> µs per call`` replacing :func:`_time_us`'s own timing (tests).
TIMER = None

_EMPTY: dict = {}
_TUNED: dict = {}          # kind -> {override name: value} chosen
_RECORDS: list = []        # one dict per trial run, for :func:`records`
_LOCK = threading.RLock()
_LOCAL = threading.local()


def check_mode(mode=None) -> bool:
    """``CTXFAST_AUTOTUNE``'s value ("off" | "on") as a bool; anything else is refused."""
    mode = MODE if mode is None else mode
    if mode not in ("off", "on"):
        raise ValueError(f"CTXFAST_AUTOTUNE must be 'off' or 'on', got {mode!r}")
    return mode == "on"


def current() -> dict:
    """The launch rows in force on this thread: ``{name: value}`` of the kernel module's
    override names (e.g. ``"fwd": (BLOCK_M, BLOCK_N, num_warps, num_stages)``), empty
    outside a tuned call."""
    return getattr(_LOCAL, "rows", _EMPTY)


@contextlib.contextmanager
def active(rows: dict):
    """Run the body with ``rows`` in force (:func:`current`) on this thread."""
    saved = current()
    _LOCAL.rows = rows
    try:
        yield
    finally:
        _LOCAL.rows = saved


def override(table: dict, name: str, default=None):
    """The value of launch setting ``name``: the tuned call's rows in force (:func:`current`)
    first, then ``table`` (a kernel module's ``LAUNCH_OVERRIDE``, set by the config sweep),
    else ``default``."""
    rows = current()
    if rows and name in rows:
        return rows[name]
    return table.get(name, default) if table else default


def size_class(n: int) -> int:
    """n rounded up to a power of two (0 and 1 stay): the size part of a kind."""
    return n if n <= 1 else 1 << (int(n) - 1).bit_length()


def wanted(device: torch.device) -> bool:
    """Whether calls on ``device`` are tuned now: tuning is on, the device is a GPU (or a CPU
    with :data:`ON_CPU`), and no CUDA graph is being captured. Refuses a bad setting."""
    if not check_mode():
        return False
    if device.type != "cuda":
        return ON_CPU and device.type == "cpu"
    return not torch.cuda.is_current_stream_capturing()


def call(kind, kernels, run, outputs, device, dtype):
    """``run()`` (a launcher call writing the tensors ``outputs``, or a function returning
    them after a run) with the rows tuned for ``kind``, tuning them first if this is the
    kind's first call. dtype: the call's input dtype, whose ``AGREE`` bounds every output
    (an fp32 output of 16-bit inputs carries their rounding).

    kernels: ``[(name, candidates), ...]`` in launch order; candidates a list of dicts of
    override names and values, the first ``{}`` (the table row), or a function of the rows
    chosen for the kernels before it returning that list. A kernel with ``{}`` alone is not
    run for it. Callers check :func:`wanted` first (and call ``run()`` themselves where it
    is False)."""
    with _LOCK:
        rows = _TUNED.get(kind)
        if rows is None:
            tol = AGREE.get(dtype, AGREE[torch.float32])
            rows = _tune(kind, kernels, run, outputs, device, tol)
            _TUNED[kind] = rows
    with active(rows):
        return run()


def tuned() -> dict:
    """``{kind: rows}`` chosen so far in this process (a copy)."""
    with _LOCK:
        return dict(_TUNED)


def records() -> list:
    """One dict per trial run so far: kind, kernel, candidate, ``us`` (µs per call, None if it
    did not run or disagreed), ``gap`` (its outputs' distance from the table row's, in
    units of the dtype's AGREE), ``error``, ``chosen``."""
    with _LOCK:
        return [dict(r) for r in _RECORDS]


def reset() -> None:
    """Forget every tuned kind and record (the next call of each kind tunes again)."""
    with _LOCK:
        _TUNED.clear()
        _RECORDS.clear()


def _skippable():
    """Exceptions of a candidate that cannot compile or launch (the table row's are raised)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime import errors
    return (CompilationError, RuntimeError, ValueError,
            *(getattr(errors, n) for n in ("OutOfResources", "PTXASError") if hasattr(errors, n)))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gap(outs, refs, tol=None) -> float:
    """max over outputs of max |out − ref| / max |ref| (finite elements), in units of
    ``tol`` (default: the output dtype's AGREE); inf if an output is not finite where its
    reference is."""
    worst = 0.0
    for o, r in zip(outs, refs):
        if o.numel() == 0:
            continue
        t = AGREE.get(o.dtype, AGREE[torch.float32]) if tol is None else tol
        wide = torch.float64 if o.dtype == torch.float64 else torch.float32
        o, r = o.detach().to(wide), r.to(wide)
        same = o == r                                   # equal infinities too
        if not bool(torch.isfinite(o[~same]).all()):
            return math.inf
        finite = torch.isfinite(r)
        scale = float(r[finite].abs().max()) if bool(finite.any()) else 1.0
        diff = float((o - r).abs().masked_fill(same, 0.0).max())
        if diff == 0.0:
            continue
        worst = max(worst, diff / (max(scale, 1e-30) * t))
    return worst


def _time_us(once, rows, device) -> float:
    """µs per call of ``once`` (compiled; it runs with ``rows`` in force): :data:`TIMER` if
    set; wall clock on a CPU; on a GPU, CUDA events over back-to-back calls queued behind a
    spin kernel, best of :data:`ROUNDS` rounds."""
    if TIMER is not None:
        return float(TIMER(once, rows))
    if device.type != "cuda":
        t0 = time.perf_counter()
        once()
        return (time.perf_counter() - t0) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    once()
    end.record()
    host_s = time.perf_counter() - t0                  # the host's time to issue one call
    end.synchronize()
    calls = max(1, min(MAX_CALLS, int(ROUND_MS / max(start.elapsed_time(end), 1e-3))))
    hold = getattr(torch.cuda, "_sleep", None)
    cycles = int(calls * max(host_s, 20e-6) * HOLD_MARGIN * HOLD_CLOCK_HZ)
    best = math.inf
    for _ in range(ROUNDS):
        if hold is not None:
            hold(cycles)
        start.record()
        for _ in range(calls):
            once()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best * 1e3


def compile_ahead(rows_list, run, device) -> None:
    """Compile the launches of ``run()`` under each of ``rows_list`` (e.g. a kernel's
    candidates, each merged with the rows chosen before it) without running them, on up to
    :data:`COMPILE_THREADS` threads side by side, each with its rows in force
    (:func:`active`) and launches compiling only (``_launch.compile_only``). Later runs
    then find them compiled. Such a run writes nothing a kernel computes, so ``run`` must
    keep nothing from it for later runs (rel_attention's forward builds its split row-bias
    table anew there instead of keeping it). ``run`` is called directly on the threads,
    under ``no_grad``: never through autograd, whose engine runs the backward on a thread
    of its own that sees none of these rows. An error here (a row that cannot compile) is
    left for the later runs to meet again (the tuner records it, or raises the table row's)."""
    from ._launch import compile_only

    def one(rows):
        try:
            # no_grad: a new thread has none of the caller's dispatch state (below autograd)
            with torch.cuda.device(device), torch.no_grad(), active(rows), compile_only():
                run()
        except Exception:   # noqa: BLE001 -- met again, and recorded, by the timed loop
            pass

    if rows_list:
        with ThreadPoolExecutor(max_workers=min(COMPILE_THREADS, len(rows_list))) as ex:
            list(ex.map(one, rows_list))


def _tune(kind, kernels, run, outputs, device, tol) -> dict:
    """The rows for ``kind``: per kernel in order, the fastest candidate that runs and agrees
    (within ``tol``) with the first run (all table rows)."""
    skippable = _skippable()
    written = outputs if callable(outputs) else (lambda: outputs)
    chosen: dict = {}
    ref = None
    for name, candidates in kernels:
        if callable(candidates):
            candidates = candidates(chosen)
        if len(candidates) < 2:
            continue                            # nothing to choose
        if device.type == "cuda" and COMPILE_THREADS > 1:
            compile_ahead([{**chosen, **c} for c in candidates], run, device)
        best_us, best, best_rec = math.inf, {}, None
        for cand in candidates:
            rows = {**chosen, **cand}
            rec = {"kind": kind, "kernel": name, "candidate": dict(cand), "us": None,
                   "gap": None, "error": None, "chosen": False}
            _RECORDS.append(rec)
            try:
                with active(rows):
                    run()
                _sync(device)
            except skippable as e:
                if not cand:
                    raise                       # the table row: what runs without tuning
                _sync(device)
                first = str(e).splitlines()[0][:200] if str(e) else ""
                rec["error"] = f"{type(e).__name__}: {first}"
                continue
            if ref is None:
                ref = [o.detach().clone() for o in written()]
                rec["gap"] = 0.0
            else:
                rec["gap"] = _gap(written(), ref, tol)
                if rec["gap"] > 1.0:
                    rec["error"] = "outputs disagree with the table row's"
                    continue

            def once(rows=rows):
                with active(rows):
                    run()
            rec["us"] = _time_us(once, rows, device)
            if rec["us"] < best_us:
                best_us, best, best_rec = rec["us"], cand, rec
        if best_rec is not None:
            best_rec["chosen"] = True
        chosen.update(best)
    return chosen
