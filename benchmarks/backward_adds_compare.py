"""How the attention backwards add their cross-block sums, timed: ``ctxfast.attention``'s
dQ and ``ctxfast.rel_attention``'s dr, each as a kernel of its own, by element-wise atomic
adds, or by TMA bulk reductions of whole tiles.

Forms (``LAUNCH_OVERRIDE``'s ``dq_mode`` / ``dr_mode``, set outside the timed calls):

* ``kernel``: a second kernel recomputes the scores and sums without atomics (attention's
  default; rel_attention's dR kernel);
* ``atomic``: the dK/dV kernel (attention) or the dQ kernel (rel_attention) adds each
  tile's partial with relaxed element-wise reductions (``red``/``atom ... add.f32``; the
  H200 timed attention's 1.2-1.8x slower than ``kernel``, rel_attention's 1.05x faster: its
  16-bit default);
* ``bulk``: the same partials, each staged in shared memory and added by one
  ``cp.reduce.async.bulk.tensor`` (FlashAttention-3 adds its dQ tiles so), not yet timed;
* ``gemm`` (rel_attention): no adds; the dQ kernel stores dS (``[B, H, Tq, Tk]``) and two
  GEMMs read it along its diagonals (dq's position term, dr), not yet timed;
* ``stored`` (rel_attention): the same with P stored too, and dK, dV by a GEMM over the
  two (no dK/dV kernel), not yet timed.

Each form's outputs are compared with the ``kernel`` form's on the same inputs
(``agree``: the tuner's rule, ``kernels/_tune.py`` ``_gap``; > 1 means a wrong answer, and
the form's time does not count). Rows: the backward alone (forward once, outside the
timed region; ``retain_graph``) and forward + backward, in µs, with SDPA's for scale at
attention's shapes.

    python benchmarks/backward_adds_compare.py [--reps 10] [--dtypes bfloat16] [--out FILE.json]
    TRITON_INTERPRET=1 python benchmarks/backward_adds_compare.py --quick   # CPU: runs

Timing: ``_common.median_timer`` (CUDA events, the median of ``--reps`` after 3 warm-up
calls; the wall clock on a CPU, after one). Nothing but the call runs in the timed region.
On a GPU every form's backward kernels are compiled side by side before the first form
runs (:func:`_compile_forms`: the tuner's ``compile_ahead``).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
import ctxfast  # noqa: E402
from kernel_breakdown import make_inputs  # noqa: E402
from ctxfast.kernels import _tune  # noqa: E402
from ctxfast.kernels import attention as kattn  # noqa: E402
from ctxfast.kernels import rel_attention as krel  # noqa: E402

#: (op, B, H, Tq, mem, D): Transformer-XL training (rel_attention, memory 1,024; first: its
#: backward's forms are the ones a cut step must not lose), GPT-2's and the long causal D
#: 128 shapes (the widest backward gap to SDPA), bf16.
FULL = (("rel_attention", 4, 16, 512, 1024, 64), ("attention", 16, 12, 1024, 0, 64),
        ("attention", 4, 16, 4096, 0, 128))
QUICK = (("attention", 1, 2, 37, 0, 16), ("rel_attention", 1, 2, 19, 14, 16))
#: The forms per op: rel_attention's dr also "gemm" (dS stored, summed along its diagonals).
MODES = {"attention": ("kernel", "atomic", "bulk"),
         "rel_attention": ("kernel", "atomic", "bulk", "gemm", "stored")}


def _op(op):
    if op == "rel_attention":
        return lambda *a: ctxfast.rel_attention(*a, backend="triton")
    return lambda *a: ctxfast.attention(*a, causal=True, backend="triton")


def _sdpa(*a):
    return F.scaled_dot_product_attention(*a, is_causal=True)


#: The kernel-level backward each op's autograd calls (looked up there at every call).
_BACKWARDS = {"rel_attention": (krel, "rel_attention_backward"),
              "attention": (kattn, "attention_backward")}


def _backward_call(op, fn, ins, g):
    """(function, args, kwargs) of the kernel-level backward that one call of ``fn`` makes,
    recorded while it runs for real (forward and backward)."""
    module, name = _BACKWARDS[op]
    calls = _common.record_calls(module, [name], lambda: torch.autograd.grad(fn(*ins), ins, g))
    if not calls:
        raise RuntimeError(f"{op}: the call made no kernel-level backward ({name})")
    return calls[0]


def _compile_forms(op, fn, ins, g, key, modes, device) -> None:
    """Every form's backward kernels compiled side by side (``_tune.compile_ahead``: one
    thread per form, its mode in force there, launches compiling only) by replaying the
    kernel-level backward of one real call: the forms' first calls then find them
    compiled. GPU only (the interpreter compiles nothing)."""
    if device.type != "cuda":
        return
    backward, args, kwargs = _backward_call(op, fn, ins, g)
    _tune.compile_ahead([{key: m} for m in modes], lambda: backward(*args, **kwargs), device)


def _timed(fn, ins, g, time_ms) -> Dict[str, float]:
    """{"bwd_us", "fwd_bwd_us"} of fn(*ins) with upstream gradient g."""
    out = fn(*ins)

    def bwd():
        return torch.autograd.grad(out, ins, g, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(fn(*ins), ins, g)
    return {"bwd_us": round(time_ms(bwd) * 1e3, 1), "fwd_bwd_us": round(time_ms(fwd_bwd) * 1e3, 1)}


def run(quick: bool, reps: int, dtypes: List[str], out: Optional[str] = None) -> List[Dict]:
    """Every case's rows; after each case its rows are written to `out` (JSON) and its
    ratio lines printed, so that a run cut by its timeout keeps the cases it finished. A
    form that fails is a row with its error, and the run goes on (the bulk, gemm and stored
    forms had never run on a GPU)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    time_ms = _common.median_timer(device, reps)
    rows = []
    for (op, B, H, Tq, mem, D), dtype in ((c, getattr(torch, d)) for d in dtypes
                                          for c in (QUICK if quick else FULL)):
        torch.manual_seed(0)
        ins, g = make_inputs(op, B, H, Tq, mem, D, device, dtype)
        case = f"{op} {str(dtype)[6:]} B{B} H{H} Tq{Tq} mem{mem} D{D}"
        module, key = (krel, "dr_mode") if op == "rel_attention" else (kattn, "dq_mode")
        fn = _op(op)
        first = len(rows)
        try:
            _compile_forms(op, fn, ins, g, key, MODES[op], device)
        except Exception as e:      # a form that does not compile fails again below, named
            print(f"{case}: compiling the forms ahead failed: {_error(e)}", flush=True)
        base = None
        for mode in MODES[op]:
            module.LAUNCH_OVERRIDE[key] = mode
            try:
                out_ = fn(*ins)
                outs = [out_.detach(), *torch.autograd.grad(out_, ins, g)]
                base = outs if base is None else base
                row = dict(case=case, form=f"{key} {mode}", agree=_tune._gap(outs, base),
                           **_timed(fn, ins, g, time_ms))
            except Exception as e:  # recorded; the other forms and cases still run
                row = dict(case=case, form=f"{key} {mode}", agree=None, error=_error(e))
            finally:
                del module.LAUNCH_OVERRIDE[key]
            rows.append(row)
            _print(row)
        if op == "attention" and device.type == "cuda":
            row = dict(case=case, form="sdpa", agree=None, **_timed(_sdpa, ins, g, time_ms))
            rows.append(row)
            _print(row)
        _common.write_rows(out, rows)
        for line in ratios(rows[first:]):
            print(line, flush=True)
    return rows


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _print(row):
    if "error" in row:
        print(f"{row['case']:48s} {row['form']:16s} Error {row['error']}", flush=True)
        return
    agree = "" if row["agree"] is None else f"  agree {row['agree']:.2f}"
    print(f"{row['case']:48s} {row['form']:16s} bwd {row['bwd_us']:10.1f} us  "
          f"fwd+bwd {row['fwd_bwd_us']:10.1f} us{agree}", flush=True)


def ratios(rows: List[Dict]) -> List[str]:
    """Each form's backward and forward + backward as a multiple of the ``kernel`` form's
    speed in the same case (> 1: faster), and SDPA's; WRONG where it disagrees."""
    lines = []
    rows = [r for r in rows if "error" not in r]
    for r in rows:
        base = next((b for b in rows if b["case"] == r["case"] and b["form"].endswith("kernel")),
                    None)
        if base is None or r is base:
            continue
        wrong = "  WRONG (agree > 1)" if r["agree"] is not None and r["agree"] > 1 else ""
        lines.append(f"ratio {r['case']:48s} {r['form']:16s} bwd "
                     f"{base['bwd_us'] / r['bwd_us']:5.2f}x  fwd+bwd "
                     f"{base['fwd_bwd_us'] / r['fwd_bwd_us']:5.2f}x {base['form']}{wrong}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_script_args(ap, reps=10, gpu_dtypes=("bfloat16",))
    args = ap.parse_args(argv)
    dtypes = _common.script_setup(args, "backward_adds_compare")
    if dtypes is None:
        return 2
    run(args.quick, args.reps, dtypes, args.out)     # writes and prints as each case ends
    return 0


if __name__ == "__main__":
    sys.exit(main())
