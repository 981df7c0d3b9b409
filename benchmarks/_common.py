"""Helpers shared by the benchmark files, their conftest and ``report.py``.

Plain module with no relative imports: the ``bench_*.py`` files import it as ``_common``
(pytest puts ``benchmarks/`` on ``sys.path``), ``report.py`` loads it by path.

* :func:`bench_device` — which device the benchmarks run on.
* :func:`device_name` — a human-readable name of that device (GPU model, or CPU model
  and thread count), used in results and in the results folder name.
* :func:`versions` — torch and triton versions.
* :func:`measure` — time one callable with pytest-benchmark under the project's protocol.
"""
from __future__ import annotations

import functools
import importlib.metadata
import itertools
import math
import os
import time
from typing import Callable, Optional, Sequence

import torch

#: Environment variable that selects the quick case set (set by ``report.py --quick``).
QUICK_ENV = "CTXFAST_BENCH_QUICK"
#: Environment variable that forces the device ("cpu", "cuda", "cuda:1"); default: CUDA
#: when available, else CPU.
DEVICE_ENV = "CTXFAST_BENCH_DEVICE"


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
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown CPU"


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


def measure(benchmark, fn: Callable, sets: list, device: torch.device, *,
            budget_s: float, min_rounds: int = 5, max_rounds: int = 2000,
            warmup: int = 5):
    """Time ``fn(*s)`` over the input sets `sets` (rotated) with ``benchmark.pedantic``.

    Warms up first (compilation, autotuning and allocator growth stay out of the timing);
    on CUDA each call is followed by ``torch.cuda.synchronize()`` so the time covers the
    kernels, not just their launch. The number of rounds is chosen from the median of the
    warm-up calls (the first excluded) so that the benchmark lasts about `budget_s`
    (between `min_rounds` and `max_rounds`);
    calls shorter than ~0.2 ms are grouped into iterations of one round.
    Returns what the last call of `fn` returned.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    nxt = itertools.cycle(sets).__next__

    def call():
        r = fn(*nxt())
        sync()
        return r

    times = []
    for _ in range(max(1, warmup)):             # warm-up calls, timed for the estimate
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    later = sorted(times[1:] or times)            # the first call may compile or allocate
    est = max(later[len(later) // 2], 1e-7)
    iterations = max(1, min(1000, round(2e-4 / est)))
    rounds = int(min(max_rounds, max(min_rounds, budget_s / (est * iterations))))
    return benchmark.pedantic(call, rounds=rounds, iterations=iterations, warmup_rounds=0)


def record_peak_memory(benchmark, fn: Callable, args: Sequence, device: torch.device) -> None:
    """On CUDA, store the peak memory of one ``fn(*args)`` beyond what was already
    allocated as ``benchmark.extra_info["peak_mem_bytes"]`` (nothing on the CPU)."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn(*args)
    torch.cuda.synchronize(device)
    benchmark.extra_info["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device) - before


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
