"""Time launch configurations of the attention and rel_attention Triton kernels on a GPU,
one kernel at a time, on the inputs of the cases that matter, and say which is fastest.

The launch rows in ``kernels/attention.py`` (``_CONFIGS``) and ``kernels/rel_attention.py``
(``_config``, ``_bwd_launch``) were chosen without timing them: by register spills and
wgmma use on sm_90 (benchmarks/NOTES.md). The first H100 round's sweep of the old forward
kernel spanned 248-418 TFLOP/s across configurations of one shape. This sweep sets each
module's ``LAUNCH_OVERRIDE`` to one candidate for one kernel (the others keep their rows),
runs forward + backward ``REPS`` times under ``torch.profiler`` after a warm-up call, and
records that kernel's device time per call. On a GPU every row of a case is compiled
first, side by side on threads (``kernels/_tune.compile_ahead``), so the warm-up finds it
compiled. A candidate that does not compile or run (shared memory, registers) is recorded
as failed.

    python benchmarks/config_sweep.py --out sweep.json [--time-budget 180]
    TRITON_INTERPRET=1 python benchmarks/config_sweep.py --quick   # CPU: the steps run

Every candidate is also checked: its output and gradients against float64 references of
the same inputs, each within 2x the error of the eager reference at the same dtype plus
the tests' floor (tests/utils.py's rule). ``err`` is the worst error as a multiple of
that bound (> 1: the candidate computes a wrong answer and is never "best"; the first
H200 round of the reworked rel_attention found its default 16-bit dQ launch wrong this
way, where the CPU interpreter could not).

    python benchmarks/config_sweep.py --ops rel_attention --kernels dq   # a subset

Output: one JSON row per (case, kernel, candidate) with ``us`` (device µs per call, or
null and the error) and ``err``, and a printed table: per kernel, the current row's time
and the fastest correct candidate's. Nothing is changed in the kernels: a row worth
taking goes into the tables by hand, with the numbers in benchmarks/NOTES.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import ctxfast  # noqa: E402
from ctxfast.kernels.rel_attention import FWD_MAXNREG_3CTA  # noqa: E402
from kernel_breakdown import make_inputs  # noqa: E402

REPS = 3
#: The tests' floor of the error bound per dtype (tests/test_attention.py FLOOR).
FLOOR = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (op, B, H, Tq, mem, D): GPT-2 / BERT-sized and long causal attention; Transformer-XL.
ATTENTION_CASES = ((16, 12, 1024, 0, 64), (4, 16, 4096, 0, 128))
REL_CASES = ((4, 16, 512, 1024, 64),)
# XL evaluation (fp32, forward only): 8 streams x 8 heads, 128 queries against 3,800 keys.
# Its 32 x 32 tiles run tf32 on mma.sync; 64 x 64 would put it on wgmma but spills
# 24-36 B per thread at 8 warps on sm_90 (benchmarks/NOTES.md): the candidates say which wins.
XL_EVAL_CASES = ((8, 8, 128, 3672, 64),)

# Candidates per kernel, the current rows first (so a cut sweep still has the baseline).
ATTENTION_CANDIDATES = {
    "fwd": [None, (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3),
            (128, 32, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2)],
    # dK/dV and dQ also at Triton's fused-attention tutorial's backward shapes (a 32-row
    # query loop against 128 keys, and its transpose, 4 warps, deeper pipelines): 8-warp
    # rows were the slow ones in rel_attention's H200 sweep
    "dkdv": [None, (32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 2),
             (128, 128, 8, 2), (64, 128, 4, 3), (32, 128, 4, 3), (32, 128, 4, 5)],
    "dq": [None, (64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2), (128, 128, 8, 2),
           (64, 32, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3)],
}
# The attention kernels with their loops' tiles through TMA descriptors (kernels/attention.py
# TMA_MODE "on"; by default only where round 4 timed them faster): the current rows, then
# rows that TMA's fewer registers make spill-free on sm_90 (benchmarks/NOTES.md). Timed
# right after each kernel's current row, so that a sweep cut by its budget has the
# comparison.
ATTENTION_TMA_CANDIDATES = {
    "fwd": [None, (128, 64, 8, 3), (128, 128, 8, 2)],
    "dkdv": [None, (64, 128, 8, 2)],
    "dq": [None, (128, 128, 8, 2)],
}
REL_TILES = (None, 32, 64, 128)         # None: the current tile; the same size is skipped
REL_LAUNCHES = (None, (4, 1), (4, 2), (8, 1), (8, 2), (4, 3), (8, 3))
# Variants of the rel_attention kernels (LAUNCH_OVERRIDE keys other than launches), each
# timed at these launches of the kernels it changes: the carried gather (forward, dQ)
# on and off.
# dr by atomic adds from the dQ kernel (no dR kernel): compare its dQ row with the default
# dQ + dR rows (the first H200 round timed it 11% faster at mem 3,072, unchecked then).
REL_VARIANTS = {
    # k, v and r's chunks through TMA descriptors (kernels/rel_attention.py TMA_MODE; by
    # default the forward's at 64 x 64 tiles); the forward's bf16 D 64 spills 48 B there, 212 B
    # with pointer tiles (benchmarks/NOTES.md)
    "tma": ({"tma": "on"}, ("fwd", "dq"), (None, (4, 1), (8, 3))),
    "carry": ({"carry": True}, ("fwd", "dq"), (None, (4, 1), (4, 3), (8, 1), (8, 3))),
    # the default carries where kernels/rel_attention.py _carry says so (16-bit D <= 64):
    # the other way, timed beside it
    "no_carry": ({"carry": False}, ("fwd", "dq"), (None, (4, 1), (4, 3), (8, 3))),
    "atomic_dr": ({"dr_mode": "atomic"}, ("dq",), (None, (4, 3), (8, 1))),
    # the forward's row bias as a product's operand on its TMA tiles (RB_MMA, opt-in)
    "rb_mma": ({"rb_mma": True}, ("fwd",), (None, (4, 1), (8, 3))),
    # the forward's registers capped so that three CTAs share an SM (FWD_MAXNREG_3CTA; two
    # stages, else its shared memory fits two)
    "three_ctas": ({"fwd_maxnreg": FWD_MAXNREG_3CTA}, ("fwd",), ((4, 2),)),
}
KERNEL_NAMES = {
    ("attention", "fwd"): "_attn_fwd_kernel", ("attention", "dkdv"): "_attn_bwd_dkdv_kernel",
    ("attention", "dq"): "_attn_bwd_dq_kernel",
    ("rel_attention", "fwd"): "_rel_attn_fwd_kernel",
    ("rel_attention", "dkdv"): "_rel_attn_bwd_dkdv_kernel",
    ("rel_attention", "dq"): "_rel_attn_bwd_dq_kernel",
    ("rel_attention", "dr"): "_rel_attn_bwd_dr_kernel",
}


def _overrides(op: str, kernel: str, cand, tile, variant) -> Dict:
    """The ``LAUNCH_OVERRIDE`` entries (the tuner's row keys, which a thread's rows give
    too) of one sweep row: the candidate launch of ``kernel``, rel_attention's tile, and the
    variant's settings. Attention's "tma" is ``"<kernel>:tma": True`` for its three
    kernels (what ``TMA_MODE`` "on" does for them); rel_attention's variants are
    :data:`REL_VARIANTS`' (its "tma" is ``{"tma": "on"}``)."""
    over = {}
    if cand is not None:
        over[kernel] = cand
    if tile is not None:
        over["tile"] = tile
    if variant == "tma" and op == "attention":
        over.update({k + ":tma": True for k in ATTENTION_CANDIDATES})
    elif variant is not None:
        over.update(REL_VARIANTS[variant][0])
    return over


def _kernel_calls(op: str, checked):
    """``run()``: the kernel-level forward (and backward) that one real call of ``checked``
    (``_call``'s checked call of ``op``) makes, replayed. A thread's rows reach those
    launchers; an autograd backward runs on the engine's own thread, which sees none."""
    from ctxfast.kernels import attention as attn_k
    from ctxfast.kernels import rel_attention as rel_k
    module, name = (attn_k, "attention") if op == "attention" else (rel_k, "rel_attention")
    calls = _common.record_calls(module, [name + "_forward", name + "_backward"], checked)
    if not calls:
        raise RuntimeError(f"{op}: the call made no kernel-level forward ({name}_forward)")
    return _common.replayer(calls)


def _compile_ahead(jobs, calls, device) -> None:
    """On a GPU, every row of the sweep compiled side by side before any is timed
    (``kernels/_tune.compile_ahead``: one thread per row, its overrides in force there as
    a tuned call's rows, launches compiling only), per case, by replaying the kernel-level
    calls of one real call (:func:`_kernel_calls`): each row's warm-up call then finds its
    kernels compiled."""
    if device.type != "cuda":
        return
    from ctxfast.kernels import _tune
    for key, call in calls.items():
        rows = [_overrides(op, kernel, cand, tile, variant)
                for op, case, kernel, cand, tile, variant in jobs if (op, case) == key]
        _tune.compile_ahead(rows, _kernel_calls(key[0], call[1]), device)


def _kernel_us(fn, name: str, device) -> Optional[float]:
    """Device µs per call of the kernel named `name` over REPS profiled calls (CPU: the
    wall time of one call, for the quick check only: interpreted, each call takes seconds
    and its time says nothing of a GPU's)."""
    from torch.profiler import ProfilerActivity, profile
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for evt in prof.key_averages():
        if name in evt.key:
            us = getattr(evt, "self_device_time_total", None)
            total += us if us is not None else getattr(evt, "self_cuda_time_total", 0.0)
    return total / REPS if total > 0 else None


def _call(op, ins, g, forward_only=False):
    """(timed call, checked call) on kernel_breakdown.make_inputs' (ins, g): the checked
    one returns [out, *grads] (forward_only: [out])."""
    if op == "rel_attention":
        f = lambda: ctxfast.rel_attention(*ins, backend="triton")  # noqa: E731
    else:
        f = lambda: ctxfast.attention(*ins, causal=True, backend="triton")  # noqa: E731
    if forward_only:
        def fwd():
            with torch.no_grad():
                return f()
        return fwd, lambda: [fwd()]

    def checked():
        out = f()
        return [out.detach(), *torch.autograd.grad(out, ins, g)]
    return (lambda: torch.autograd.grad(f(), ins, g)), checked


def _bounds(op, ins, g, forward_only=False):
    """(float64 references, bounds) of [out, *grads] on the same inputs: bound_i =
    2·‖eager_i − ref_i‖ + floor·max(‖ref_i‖, 1), eager the reference at the inputs' dtype."""
    from ctxfast import reference
    dtype = ins[0].dtype
    fn = (reference.rel_attention if op == "rel_attention"
          else lambda *a: reference.attention(*a, causal=True))

    def run(tensors, grad):
        leaves = [t.detach().clone().requires_grad_(not forward_only) for t in tensors]
        out = fn(*leaves)
        if forward_only:
            return [out.detach()]
        return [out.detach(), *torch.autograd.grad(out, leaves, grad)]
    refs = run([t.double() for t in ins], g.double())
    same = run(ins, g)
    bounds = [2 * (s.double() - r).norm().item() + FLOOR[dtype] * max(r.norm().item(), 1.0)
              for s, r in zip(same, refs)]
    return refs, bounds


def _ratios(outs, refs, bounds) -> List[float]:
    """‖ours − ref‖ / bound for each of [out, *grads]."""
    return [round((o.double() - r).norm().item() / b, 3) for o, r, b in zip(outs, refs, bounds)]


def _measure(fn, name, device) -> Tuple[Optional[float], Optional[str]]:
    try:
        if device.type == "cuda":                       # (the interpreter compiles nothing)
            fn()                                        # compiles this candidate
            torch.cuda.synchronize()
        return _kernel_us(fn, name, device), None
    except Exception as e:  # noqa: BLE001  (a candidate that cannot compile or run)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _jobs(dtype, quick: bool, ops=None, kernels=None) -> List[tuple]:
    """The sweep's rows in the order they are timed: (op, case, kernel, candidate, tile,
    variant)."""
    from ctxfast.kernels import rel_attention as rel_k
    att_cases = ((1, 2, 16, 0, 16),) if quick else ATTENTION_CASES
    rel_cases = ((1, 2, 16, 16, 16),) if quick else REL_CASES
    xl_cases = ((1, 2, 16, 16, 16),) if quick else XL_EVAL_CASES
    jobs = []
    for case in att_cases:
        for kernel, cands in ATTENTION_CANDIDATES.items():   # current row: pointers, TMA
            jobs += [("attention", case, kernel, None, None, None),
                     ("attention", case, kernel, None, None, "tma")]
        for kernel, cands in ATTENTION_CANDIDATES.items():
            for cand in (cands[1:2] if quick else cands[1:]):
                jobs.append(("attention", case, kernel, cand, None, None))
            for cand in ATTENTION_TMA_CANDIDATES[kernel][1:2 if quick else None]:
                jobs.append(("attention", case, kernel, cand, None, "tma"))
    def tiles(case, dt):
        current = rel_k._config(case[4], case[2], dt)[0]
        return [t for t in (REL_TILES[:1] if quick else REL_TILES) if t != current]

    for case in rel_cases:
        # the current rows, each variant at the current launch (TMA tiles, the carried
        # gather, atomic dr), the current tile's other launches, the variants' other
        # launches, then the other tiles: a sweep cut by its time budget has measured what
        # the next change would be chosen from
        rel_kernels = ("fwd", "dkdv", "dq", "dr")
        jobs += [("rel_attention", case, kernel, None, None, None) for kernel in rel_kernels]
        jobs += [("rel_attention", case, kernel, launches[0], None, variant)
                 for variant, (_, kernels_of, launches) in REL_VARIANTS.items()
                 for kernel in kernels_of]
        for tile in tiles(case, dtype):
            for kernel in rel_kernels:
                for launch in (REL_LAUNCHES[:2] if quick else REL_LAUNCHES):
                    if launch is None and (tile is None or kernel != "fwd"):
                        continue            # the current row: above; a new tile's default
                    jobs.append(("rel_attention", case, kernel, launch, tile, None))  # (fwd)
            if tile is None and not quick:
                for variant, (_, kernels_of, launches) in REL_VARIANTS.items():
                    for kernel in kernels_of:
                        for launch in launches[1:]:
                            jobs.append(("rel_attention", case, kernel, launch, None, variant))
    for case in xl_cases:                   # fp32 forward only (XL evaluation)
        for tile in tiles(case, torch.float32):
            for launch in (REL_LAUNCHES[:2] if quick else REL_LAUNCHES):
                jobs.append(("rel_attention fp32 fwd", case, "fwd", launch, tile, None))
    return [j for j in jobs if (not ops or j[0].split()[0] in ops)
            and (not kernels or j[2] in kernels)]


def sweep(device, dtype, budget_s: float, quick: bool, ops=None, kernels=None) -> List[Dict]:
    from ctxfast.kernels import attention as attn_k
    from ctxfast.kernels import rel_attention as rel_k
    start = time.monotonic()
    rows: List[Dict] = []
    jobs = _jobs(dtype, quick, ops, kernels)
    calls, checks = {}, {}
    for op, case, *_ in jobs:
        key = (op, case)
        if key not in calls:
            xl = op == "rel_attention fp32 fwd"
            base_op, dt = ("rel_attention", torch.float32) if xl else (op, dtype)
            ins, g = make_inputs(base_op, *case, device, dt)
            calls[key] = _call(base_op, ins, g, forward_only=xl)
            checks[key] = _bounds(base_op, ins, g, forward_only=xl)
    _compile_ahead(jobs, calls, device)
    for op, case, kernel, cand, tile, variant in jobs:
        if time.monotonic() - start > budget_s:
            rows.append({"op": op, "case": case, "kernel": kernel, "candidate": cand,
                         "tile": tile, "variant": variant, "us": None,
                         "error": "not run: time budget"})
            continue
        mod = attn_k if op == "attention" else rel_k
        xl = op == "rel_attention fp32 fwd"
        mod.LAUNCH_OVERRIDE.clear()
        mod.LAUNCH_OVERRIDE.update(_overrides(op, kernel, cand, tile, variant))
        key = (op, case)
        worst, ratios = None, None
        try:
            us, err = _measure(calls[key][0], KERNEL_NAMES[("rel_attention" if xl else op, kernel)],
                               device)
            if err is None:
                ratios = _ratios(calls[key][1](), *checks[key])
                worst = max(ratios)
        finally:
            mod.LAUNCH_OVERRIDE.clear()
        names = ["out"] + (["q", "k", "v", "r", "r_w_bias", "r_r_bias"] if "rel" in op
                           else ["q", "k", "v"])
        row = {"op": op, "case": "B{} H{} Tq{} mem{} D{}".format(*case), "kernel": kernel,
               "candidate": cand, "tile": tile, "variant": variant, "us": us, "error": err,
               "err": worst,
               "errs": None if ratios is None else dict(zip(names, ratios))}
        if worst is not None and worst > 1:
            row["wrong"] = " ".join(n for n, x in zip(names, ratios) if x > 1)
        rows.append(row)
        print(f"{op:13s} {row['case']:24s} {kernel:5s} tile {tile or 'default':>7} "
              f"{str(cand or 'default'):18s} {variant or '':9s}" + (f"{us:9.1f} us" if us else f"failed: {err}")
              + (f"  err {worst:.2f}x bound" if worst is not None else "")
              + (f"  WRONG ({row['wrong']})" if "wrong" in row else ""))
        sys.stdout.flush()
    return rows


def summary(rows: List[Dict]) -> List[str]:
    """Per (op, case, kernel): the current row's time and the fastest candidate."""
    lines = []
    groups: Dict[tuple, List[Dict]] = {}
    for r in rows:
        if r["us"] and "wrong" not in r:
            groups.setdefault((r["op"], r["case"], r["kernel"]), []).append(r)
    for (op, case, kernel), rs in groups.items():
        cur = next((r for r in rs if r["candidate"] is None and r["tile"] is None
                    and r.get("variant") is None), None)
        best = min(rs, key=lambda r: r["us"])
        lines.append(f"{op} {case} {kernel}: current "
                     f"{cur['us']:.1f} us" if cur else f"{op} {case} {kernel}: current n/a")
        lines[-1] += (f"; best tile {best['tile'] or 'default'} {best['candidate'] or 'default'}"
                      f"{' ' + best['variant'] if best.get('variant') else ''} {best['us']:.1f} us"
                      + (f" ({cur['us'] / best['us']:.2f}x)" if cur else ""))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two candidates, tiny case (CPU)")
    ap.add_argument("--time-budget", type=float, default=180.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ops", nargs="*", default=None, choices=["attention", "rel_attention"],
                    help="only these ops' kernels")
    ap.add_argument("--kernels", nargs="*", default=None, choices=["fwd", "dkdv", "dq", "dr"],
                    help="only these kernels")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = sweep(device, dtype, args.time_budget, args.quick or device.type != "cuda",
                 args.ops, args.kernels)
    lines = summary(rows)
    wrong = [r for r in rows if "wrong" in r]
    lines += [f"WRONG: {r['op']} {r['case']} {r['kernel']} tile {r['tile'] or 'default'} "
              f"{r['candidate'] or 'default'}{' ' + r['variant'] if r.get('variant') else ''}: "
              f"{r['wrong']} {r['err']}x the bound" for r in wrong]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda"
                       else "cpu", "torch": torch.__version__, "rows": rows,
                       "summary": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
