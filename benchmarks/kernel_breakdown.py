"""Where one attention / rel_attention call spends its time: each kernel, each torch op
around the kernels, and the host.

The first H200 round (2026-11-26) timed ``ctxfast.attention``'s forward+backward at 0.7-1.3
ms at every size from 1 to 512 queries (forward: 0.13 ms), and rel_attention's backward at
6-7x its forward. A median per call cannot say which kernel, which fill or sum, or how much
host time that is; this script does, per case:

* ``fwd_ms``, ``fwd_bwd_ms``: CUDA-event medians of the call, as ``bench_*.py`` time it;
* ``host_us``: CPU time to issue one call (``perf_counter`` over calls issued back to
  back with no synchronisation; at small sizes the GPU waits for the host, and this is
  the floor);
* ``kernels``: one profiled forward+backward, device time per kernel name (ours and
  torch's: fills, casts, sums), largest first, and their total.

    python benchmarks/kernel_breakdown.py --out breakdown.json          # CUDA cases
    python benchmarks/kernel_breakdown.py --host-split                  # host time, by part
    python benchmarks/kernel_breakdown.py --host-profile 30             # host time, cProfile
    TRITON_INTERPRET=1 python benchmarks/kernel_breakdown.py --quick    # CPU: runs, no GPU

On a CPU (``--quick``, the interpreter) it only checks that every step runs: interpreter
timings say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import ctxfast  # noqa: E402

# (op, B, H, Tq, mem, D, causal): training and decoding shapes of the GPU suites.
CASES = (
    ("rel_attention", 4, 16, 512, 512, 64, True),
    ("rel_attention", 4, 16, 512, 3072, 64, True),
    ("rel_attention", 16, 16, 16, 3072, 64, True),
    ("attention", 4, 16, 512, 512, 64, True),
    ("attention", 16, 12, 1024, 0, 64, True),
    ("attention", 2, 16, 8192, 0, 128, True),
)
QUICK_CASES = (("rel_attention", 1, 2, 16, 16, 16, True), ("attention", 1, 2, 16, 16, 16, True))


def make_inputs(op, B, H, Tq, mem, D, device, dtype):
    """[q, k, v] (+ [r, r_w_bias, r_r_bias]) requiring grad, and a gradient of out."""
    Tk = Tq + mem
    mk = lambda *s: torch.randn(*s, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    ins = [mk(B, H, Tq, D), mk(B, H, Tk, D), mk(B, H, Tk, D)]
    if op == "rel_attention":
        ins += [mk(H, Tk, D), mk(H, D), mk(H, D)]
    return ins, torch.randn(B, H, Tq, D, device=device, dtype=dtype)


def _call(op, causal) -> Callable:
    if op == "rel_attention":
        return lambda *a: ctxfast.rel_attention(*a)     # causal with memory, as Transformer-XL
    return lambda *a: ctxfast.attention(*a, causal=causal)


def _host_us(fn, device, calls: int, rounds: int = 5) -> float:
    """CPU microseconds per call, issued back to back (synchronised only at the ends of a
    round): the median of `rounds` rounds of `calls` calls, after a few warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def _kernels(fn, device) -> List[Dict]:
    """Device time per kernel name of one profiled call (CPU: the ops' CPU time)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        if device.type == "cuda":
            us = getattr(evt, "self_device_time_total", None)
            if us is None:
                us = getattr(evt, "self_cuda_time_total", 0.0)
        else:
            us = evt.self_cpu_time_total
        if us and us > 0:
            rows.append({"name": evt.key[:90], "calls": evt.count, "us": round(us, 1)})
    rows.sort(key=lambda r: -r["us"])
    return rows


def run(cases, device, dtype, reps) -> List[Dict]:
    """Each case; on a GPU once per mode of the backward's atomic variant (attention:
    kernels.attention.DQ_MODE, rel_attention: kernels.rel_attention.DR_MODE; "kernel",
    then "atomic"), so one call compares the two."""
    from ctxfast.kernels import attention as attn_k
    from ctxfast.kernels import rel_attention as rel_k
    modules = {"attention": (attn_k, "DQ_MODE"), "rel_attention": (rel_k, "DR_MODE")}
    saved = {op: getattr(mod, attr) for op, (mod, attr) in modules.items()}
    results = []
    try:
        for case in cases:
            mod, attr = modules[case[0]]
            for mode in (("kernel", "atomic") if device.type == "cuda" else (None,)):
                if mode is not None:                    # CPU: the cpu backend, no modes
                    setattr(mod, attr, mode)
                results.append(_run_case(case, device, dtype, reps, mode))
    finally:
        for op, (mod, attr) in modules.items():
            setattr(mod, attr, saved[op])
    return results


def _run_case(case, device, dtype, reps, mode) -> Dict:
    """One case: timings, host time, the profiled kernels; printed and returned."""
    op, B, H, Tq, mem, D, causal = case
    ins, g = make_inputs(op, B, H, Tq, mem, D, device, dtype)
    call = _call(op, causal)

    def fwd():
        with torch.no_grad():
            call(*ins)

    def fwd_bwd():
        torch.autograd.grad(call(*ins), ins, g)

    kernels = _kernels(fwd_bwd, device)
    top = kernels[:15]
    rounds = 5 if device.type == "cuda" else 1        # the interpreter: that every step runs
    row = {"op": op, "case": f"B{B} H{H} Tq{Tq} mem{mem} D{D}", "dtype": str(dtype),
           "backward_mode": mode,
           "fwd_ms": _common.median_timer(device, reps)(fwd),
           "fwd_bwd_ms": _common.median_timer(device, reps)(fwd_bwd),
           "host_fwd_us": _host_us(fwd, device, reps, rounds),
           "host_fwd_bwd_us": _host_us(fwd_bwd, device, reps, rounds),
           "kernels_total_us": round(sum(r["us"] for r in kernels if device.type != "cuda"
                                         or not r["name"].startswith(("aten::", "cuda",
                                                                       "autograd::",
                                                                       "Activity"))), 1),
           "kernels": top}
    label = f" ({'dQ' if op == 'attention' else 'dr'} {mode})" if mode else ""
    print(f"{op} {row['case']} {dtype}{label}: fwd {row['fwd_ms']:.3f} ms, fwd+bwd "
          f"{row['fwd_bwd_ms']:.3f} ms; host per call fwd {row['host_fwd_us']:.0f} us, "
          f"fwd+bwd {row['host_fwd_bwd_us']:.0f} us; kernels {row['kernels_total_us']} us")
    for r in top:
        print(f"    {r['us']:>10.1f} us  x{r['calls']:<3} {r['name']}")
    sys.stdout.flush()
    return row


def host_profile(cases, device, dtype, calls: int, top: int = 25) -> List[Dict]:
    """cProfile of `calls` forward+backward calls of each op's first case (default backward
    modes), issued back to back: which Python functions the host time per call goes to.
    Rows: function, calls per op call, own and cumulative µs per op call, largest own
    time first."""
    import cProfile
    import pstats
    rows = []
    for op in dict.fromkeys(c[0] for c in cases):
        _, B, H, Tq, mem, D, causal = next(c for c in cases if c[0] == op)
        ins, g = make_inputs(op, B, H, Tq, mem, D, device, dtype)
        call = _call(op, causal)

        def fwd_bwd():
            torch.autograd.grad(call(*ins), ins, g)
        for _ in range(3):
            fwd_bwd()
        if device.type == "cuda":
            torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fwd_bwd()
        prof.disable()
        if device.type == "cuda":
            torch.cuda.synchronize()
        stats = pstats.Stats(prof)
        entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
        print(f"host profile: {op} B{B} H{H} Tq{Tq} mem{mem} D{D}, {calls} fwd+bwd calls "
              f"(µs per call: own, cumulative; calls per call)")
        for (path, line, name), (_, ncalls, tottime, cumtime, _) in entries:
            where = f"{os.path.basename(path)}:{line}({name})"
            row = {"op": op, "function": where, "calls": ncalls / calls,
                   "own_us": tottime / calls * 1e6, "cum_us": cumtime / calls * 1e6}
            rows.append(row)
            print(f"    {row['own_us']:8.1f} {row['cum_us']:8.1f}  x{row['calls']:<5.3g} {where}")
    sys.stdout.flush()
    return rows


class _Clone(torch.autograd.Function):
    """The cheapest autograd op on the device: one copy forward, one backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.clone()


def host_split(device, dtype) -> List[Dict]:
    """Where ctxfast.attention's host time per forward+backward goes (and rel_attention's
    total), each part timed
    alone (µs per call, issued back to back): the autograd engine's round trip (a
    one-copy autograd Function), a Triton launch (a kernel of 4 arguments and one of 48),
    our launchers called directly (kernels.attention forward / backward, no autograd),
    the public op's forward, forward+backward, and the same with every Triton launch
    replaced by a no-op (our Python and torch's, no launch). Launches through Triton's JIT
    and through the fast path (kernels/_launch.py), each."""
    import triton
    import triton.language as tl
    from ctxfast.kernels import _launch
    from ctxfast.kernels import attention as attn_k

    def launched(mode, fn):
        def run():
            saved, _launch.LAUNCH = _launch.LAUNCH, mode
            try:
                return fn()
            finally:
                _launch.LAUNCH = saved
        return run

    @triton.jit
    def _tiny(X, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(X + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)

    @triton.jit
    def _wide(X, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
              a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30,
              a31, a32, a33, a34, a35, a36, a37, a38, a39, a40, a41, a42, a43, a44, n,
              BLOCK: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(X + offs, tl.load(X + offs, mask=offs < n) + a0 + a44, mask=offs < n)

    x = torch.randn(64, device=device)
    B, H, T, D = (4, 16, 512, 64) if device.type == "cuda" else (1, 1, 16, 16)
    # on a CPU (the interpreter) only that every part runs: one round of one call
    calls, rounds = (200, 5) if device.type == "cuda" else (1, 1)
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    g = torch.randn(B, H, T, D, device=device, dtype=dtype)
    xs = torch.randn(64, device=device, requires_grad=True)
    rel = [q, k, v] + [torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
                       for shape in ((H, T, D), (H, D), (H, D))]   # r, r_w_bias, r_r_bias
    out, lse = attn_k.attention_forward(q, k, v, causal=True)
    parts = {
        "autograd round trip (one-copy Function)":
            lambda: torch.autograd.grad(_Clone.apply(xs), (xs,), torch.ones_like(xs)),
        "Triton launch, 4 arguments": lambda: _tiny[(1,)](x, 64, BLOCK=64),
        "Triton launch, 48 arguments": lambda: _wide[(1,)](x, *range(45), 64, BLOCK=64,
                                                           F1=True, F2=False),
        "fast-path launch, 4 arguments": lambda: _launch.fast(_tiny)[(1,)](x, 64, BLOCK=64),
        "fast-path launch, 48 arguments":
            lambda: _launch.fast(_wide)[(1,)](x, *range(45), 64, BLOCK=64, F1=True, F2=False),
        "kernels.attention_forward (direct)":
            lambda: attn_k.attention_forward(q, k, v, causal=True),
        "kernels.attention_backward (direct)":
            lambda: attn_k.attention_backward(g, q, k, v, out, lse, causal=True),
        "ctxfast.attention forward (grad on)":
            lambda: ctxfast.attention(q, k, v, causal=True, backend="triton"),
        "ctxfast.attention forward+backward":
            lambda: torch.autograd.grad(ctxfast.attention(q, k, v, causal=True,
                                                          backend="triton"), (q, k, v), g),
        "ctxfast.rel_attention forward+backward":
            lambda: torch.autograd.grad(ctxfast.rel_attention(*rel, backend="triton"), rel, g),
    }
    for name in [n for n in parts if n.startswith(("kernels.", "ctxfast."))]:
        fn = parts.pop(name)
        parts[name + ", JIT launches"] = launched("jit", fn)
        parts[name + ", fast-path launches"] = launched("fast", fn)
    rows = [{"part": name, "us": round(_host_us(fn, device, calls, rounds), 1)}
            for name, fn in parts.items()]
    # every Triton launch a no-op: what is left is Python and torch (allocations, autograd)
    kind = type(attn_k._attn_fwd_kernel)       # JITFunction (InterpretedFunction on a CPU)
    saved = kind.__getitem__
    kind.__getitem__ = lambda self, grid: (lambda *a, **kw: None)
    try:
        fb = parts["ctxfast.attention forward+backward, JIT launches"]  # (a stub on every launch)
        rows.append({"part": "ctxfast.attention forward+backward, launches stubbed",
                     "us": round(_host_us(fb, device, calls, rounds), 1)})
    finally:
        kind.__getitem__ = saved
    print(f"host split ({device.type}, {dtype}, B{B} H{H} T{T} D{D} causal): us per call")
    for r in rows:
        print(f"    {r['us']:8.1f}  {r['part']}")
    sys.stdout.flush()
    return rows


def ncu_target(device, dtype, target: str = "all") -> None:
    """The calls `gpu_round.sh --stage ncu` profiles: rel_attention forward+backward (B4 H16
    Tq512 mem3072 D64, Transformer-XL training) and ctxfast.attention's forward+backward at
    the same shape, each warmed up (compiled) first, then once inside the NVTX range
    "profile" (ncu --nvtx --nvtx-include "profile/" keeps only those launches). ``target``
    "rel" (benchmarks/ncu_stalls.py): the two ops only, at the tuner's rel_attention shape
    (mem 1,024, where round 5 timed both)."""
    calls = []
    shape = ((4, 16, 512, 3072 if target == "all" else 1024, 64) if device.type == "cuda"
             else (1, 2, 16, 16, 16))
    for op in ("rel_attention", "attention"):
        ins, g = make_inputs(op, *shape, device, dtype)
        call = _call(op, True)
        calls.append(lambda call=call, ins=ins, g=g: torch.autograd.grad(call(*ins), ins, g))
    lstm = device.type == "cuda" and ctxfast._dispatch.cuda_ext_available() and target == "all"
    # the CUDA LSTM's persistent kernels (auto: the tensor-core ones) at the ULMFiT layer,
    # T 70 B 64 H 1152 with DropConnect: where a step's 28 us (bf16 forward) and 82 us
    # (float32 forward, one TF32 product at torch's default) go on the H200 is the question
    # (rounds 3 and 4: the float32 kernel is not bound by its products)
    for lstm_dtype in ((dtype, torch.float32) if lstm else ()):
        T, B, H = 70, 64, 1152
        mk = lambda *s, dt=lstm_dtype: (  # noqa: E731
            torch.randn(*s, device=device, dtype=dt) * 0.03).requires_grad_()
        x, w_ih, w_hh = mk(T, B, H), mk(4 * H, H), mk(4 * H, H)
        b_ih, b_hh = mk(4 * H), mk(4 * H)
        mask = (torch.rand(4 * H, H, device=device) >= 0.2).to(lstm_dtype)
        gl = torch.randn(T, B, H, device=device, dtype=lstm_dtype)
        leaves = [x, w_ih, w_hh, b_ih, b_hh]
        calls.append(lambda x=x, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh, mask=mask, gl=gl,
                     leaves=leaves: torch.autograd.grad(ctxfast.lstm(
                         x, None, w_ih, w_hh, b_ih, b_hh, weight_mask=mask, weight_dropout=0.2,
                         backend="cuda")[0], leaves, gl))
    for fn in calls:
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
    for fn in calls:
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print(f"ncu target: rel_attention and attention forward+backward, B{shape[0]} H{shape[1]} "
          f"Tq{shape[2]} mem{shape[3]} D{shape[4]}"
          + ("; the CUDA LSTM forward+backward, T70 B64 H1152, bf16 and float32" if lstm
             else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny cases (CPU check)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    ap.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                    help="only cProfile CALLS fwd+bwd calls of each op (host time by function)")
    ap.add_argument("--ncu-target", nargs="?", const="all", choices=("all", "rel"),
                    help="only run the calls gpu_round.sh --stage ncu profiles (rel: "
                         "benchmarks/ncu_stalls.py's)")
    ap.add_argument("--host-split", action="store_true",
                    help="only time the parts of attention's host time alone (GPU)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases = QUICK_CASES if args.quick or device.type != "cuda" else CASES
    if args.ncu_target:
        ncu_target(device, dtype, args.ncu_target)
        return 0
    if args.host_split:
        result = {"host_split": host_split(device, dtype)}
    elif args.host_profile:
        result = {"host_profile": host_profile(cases, device, dtype, args.host_profile)}
    else:
        result = {"rows": run(cases, device, dtype, 3 if device.type != "cuda" else args.reps)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda"
                       else "cpu", "torch": torch.__version__, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
