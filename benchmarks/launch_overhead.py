"""Host time of one Triton launch before the launcher: Triton's ``JITFunction.run`` against
ctxfast's fast path (``kernels/_launch.py``), on this machine, with no GPU.

Both paths run for real on the launches the launchers make (the compile test's cases,
recorded, so the arguments are the ones a GPU call passes), with a stand-in driver (device
0, a fixed stream, sm_90 target) and a stand-in compiled kernel whose launcher does
nothing: what is timed is everything Triton's Python and ours do per launch except the C
launcher itself (the same call on both paths: ~15 us on the H200 machine,
``host_profile.log``). Triton's path is its own code, unmodified: binder, cache key,
lookup, globals check, launch metadata.

    python benchmarks/launch_overhead.py            # table, us per launch (median of 5)
    python benchmarks/launch_overhead.py --json out.json

Run without TRITON_INTERPRET (the kernels must be JITFunctions).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


class _StandInDriver:
    """Just what JITFunction.run and the fast path ask a driver for."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 12345

    def get_current_target(self):
        return self.target


class _StandInKernel:
    """A compiled kernel whose launcher does nothing."""

    function = "function"
    packed_metadata = ("metadata",)
    src = None

    def launch_metadata(self, grid, stream, *args):  # what CompiledKernel builds, roughly
        from triton import knobs
        if knobs.runtime.launch_enter_hook is None:
            return None
        return {"name": "k", "function": self.function, "stream": stream}

    def run(self, *args):
        return None


def _recorded():
    import torch
    import test_triton_compile as tc
    torch.manual_seed(0)
    seen, out = set(), []
    for name, _, case in tc._cases():
        for fn, args, kwargs in tc._record(case):
            if fn.__name__ not in seen:  # the first launch of each kernel
                seen.add(fn.__name__)
                out.append((name, fn, args, kwargs))
    return out


def _us(fn, calls=2000, rounds=5):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1 (the kernels must be JITFunctions)")
    from triton.runtime import driver
    from ctxfast.kernels import _launch

    driver.set_active(_StandInDriver())
    _launch._device_stream = None
    stand_in = _StandInKernel()
    rows = []
    for case, fn, a, kw in _recorded():
        def compile_stand_in(key, signature, device, constexprs, options, attrs, warmup, fn=fn):
            fn.device_caches[device][0][key] = stand_in
            return stand_in
        fn._do_compile = compile_stand_in
        grid = (4, 8, 1)
        triton_us = _us(lambda: fn[grid](*a, **kw))
        fk = _launch.FastKernel(fn)
        fk[grid](*a, **kw)                                  # first call: Triton's path
        fast_us = _us(lambda: fk[grid](*a, **kw))
        assert fk.hits > 0
        rows.append(dict(kernel=fn.__name__, case=case, args=len(a) + len(kw),
                         triton_us=round(triton_us, 2), fast_us=round(fast_us, 2)))
        del fn._do_compile
    import torch
    import triton
    print(f"host us per launch before the launcher (median of 5 x 2000; torch "
          f"{torch.__version__}, triton {triton.__version__}, {os.cpu_count()} CPUs)")
    print(f"{'kernel':28s} {'args':>5s} {'triton':>8s} {'fast':>8s}  first case")
    for r in rows:
        print(f"{r['kernel']:28s} {r['args']:5d} {r['triton_us']:8.2f} {r['fast_us']:8.2f}"
              f"  {r['case']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, triton=triton.__version__, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
