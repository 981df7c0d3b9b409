"""``ctxfast.linear`` against ``F.linear`` at language models' decoder sizes, float32: what
decides ``ctxfast.ops.linear.CUDA_DEFAULT``.

Forms, each timed forward (no grad) and forward+backward (grad of x, weight and bias):

* ``cublas fp32``: ``F.linear`` with torch's defaults (no TF32: cuBLAS's float32 GEMMs on
  the CUDA cores), what a float32 model's decoder runs today, fastai's AWD-LSTM included;
* ``triton tf32x3``: ``ctxfast.linear(..., backend="triton")`` with TF32 off (three TF32
  products a multiply, float32-level error), at the launch table's tiles and at the
  ``--sweep`` rows (``kernels.linear.CONFIG_OVERRIDE``); ``promote``: each K step's
  products summed apart and added on the CUDA cores (``kernels.linear.PROMOTE``: what the
  tensor cores' truncating sums cost in error over long K, and what avoiding them costs);
* ``cublas tf32`` / ``triton tf32``: both with TF32 allowed (one product; what a user who
  allows TF32 gets), for scale.

Each row also gives the error of its output and gradients against float64 (the largest of
the relative norms ‖ours − ref‖ / ‖ref‖), and ``ratio`` lines print each form's speed as a
multiple of ``cublas fp32``'s with its error beside cuBLAS's: tf32x3 may become the default
only if it is faster and its error stays within 2x cuBLAS's float32 error (the ops' rule).

    python benchmarks/linear_compare.py [--quick] [--sweep] [--reps N] [--out FILE.json]

Timing: ``_common.median_timer`` (CUDA events, median of ``--reps`` after 3 warm-up calls;
the wall clock on a CPU with ``--quick``: tiny sizes in the interpreter, a check that the
script runs). Nothing but the call runs in the timed region.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
import ctxfast  # noqa: E402
from ctxfast import reference  # noqa: E402

#: (name, rows M, in features I, out features N): ULMFiT's decoder (B 64 x T 70 rows, 400 ->
#: 60,000 words, fastai's AWD-LSTM LM) and the benchmark's ELMo-small softmax (B 128 x T 20
#: rows, both directions, 128 -> 32,768): the float32 models' (GPT-2's head trains in 16
#: bits, cuBLAS's own; bench_linear.py times it in float32 too).
FULL = [("ULMFiT decoder", 4480, 400, 60000), ("ELMo-small softmax", 2 * 2560, 128, 32768)]
QUICK = [("tiny", 37, 19, 23)]
#: Launch rows ``--sweep`` times besides the table's 128 x 128 x 32, 8 warps, 3 stages (each
#: compiled tf32x3 for sm_90 with Triton 3.9: registers / spill bytes 224 / 0, 255 / 0,
#: the table's, 171 / 0; benchmarks/NOTES.md).
SWEEP = [dict(BLOCK_K=16, num_stages=4), dict(num_stages=4), dict(GROUP_M=4),
         dict(BLOCK_N=64, num_stages=4)]


@contextlib.contextmanager
def _tf32(allowed: bool):
    """TF32 for float32 matmuls on or off for the block (set outside the timed calls)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@contextlib.contextmanager
def _override(cfg: Optional[dict], promote: bool):
    """The launch override and PROMOTE for the block (set outside the timed calls)."""
    from ctxfast.kernels import linear as klinear
    old = klinear.CONFIG_OVERRIDE, klinear.PROMOTE
    klinear.CONFIG_OVERRIDE, klinear.PROMOTE = cfg, promote
    try:
        yield
    finally:
        klinear.CONFIG_OVERRIDE, klinear.PROMOTE = old


def _forms(sweep: bool):
    """(name, function, TF32 allowed, launch override, PROMOTE)."""
    def cublas(x, w, b):
        return F.linear(x, w, b)

    def triton(x, w, b):
        return ctxfast.linear(x, w, b, backend="triton")
    forms = [("cublas fp32", cublas, False, None, False),
             ("triton tf32x3", triton, False, None, False),
             ("triton tf32x3 promote", triton, False, None, True)]
    if sweep:
        forms += [("triton tf32x3 " + ",".join(f"{k}={v}" for k, v in cfg.items()), triton,
                   False, cfg, False) for cfg in SWEEP]
    return forms + [("cublas tf32", cublas, True, None, False),
                    ("triton tf32", triton, True, None, False)]


def _error(fn, x, w, b, g, ref) -> float:
    """max over output and gradients of ‖ours − ref‖ / ‖ref‖ (float64 references)."""
    y = fn(x, w, b)
    outs = [y, *torch.autograd.grad(y, (x, w, b), g)]
    return max(((o.double() - r).norm() / r.norm()).item() for o, r in zip(outs, ref))


def run(quick: bool, reps: int, sweep: bool) -> List[Dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    time_ms = _common.median_timer(device, reps)
    rows = []
    for name, M, I, N in (QUICK if quick else FULL):
        torch.manual_seed(0)
        x = torch.randn(M, I, device=device, requires_grad=True)
        w = (torch.randn(N, I, device=device) * I ** -0.5).requires_grad_()
        b = torch.zeros(N, device=device).uniform_(-0.1, 0.1).requires_grad_()
        g = torch.randn(M, N, device=device) / (M * N) ** 0.5
        x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
        y64 = reference.linear(x64, w64, b64)                 # the specification
        ref = [y64.detach(), *torch.autograd.grad(y64, (x64, w64, b64), g.double())]
        del y64
        for form, fn, tf32, cfg, promote in _forms(sweep):
            with _tf32(tf32), _override(cfg, promote):
                def fwd():
                    with torch.no_grad():
                        return fn(x, w, b)

                def fwd_bwd():
                    return torch.autograd.grad(fn(x, w, b), (x, w, b), g)
                row = dict(case=name, M=M, I=I, N=N, form=form,
                           fwd_ms=round(time_ms(fwd), 4), fwd_bwd_ms=round(time_ms(fwd_bwd), 4),
                           rel_err=_error(fn, x, w, b, g, ref))
            flop = 2 * M * I * N
            row["fwd_tflops"] = round(flop / row["fwd_ms"] / 1e9, 1)
            row["fwd_bwd_tflops"] = round(3 * flop / row["fwd_bwd_ms"] / 1e9, 1)
            rows.append(row)
            print(f"{name:20s} {form:42s} fwd {row['fwd_ms']:8.3f} ms "
                  f"({row['fwd_tflops']:6.1f} TFLOP/s)  fwd+bwd {row['fwd_bwd_ms']:8.3f} ms "
                  f"({row['fwd_bwd_tflops']:6.1f})  err {row['rel_err']:.2e}", flush=True)
    return rows


def ratios(rows: List[Dict]) -> List[str]:
    """Each form's speed as a multiple of ``cublas fp32``'s in the same case, and its error
    as a multiple of cuBLAS float32's (the rule: <= 2)."""
    lines = []
    for r in rows:
        base = next(b for b in rows if b["case"] == r["case"] and b["form"] == "cublas fp32")
        if r is base:
            continue
        lines.append(f"ratio {r['case']:20s} {r['form']:42s} fwd "
                     f"{base['fwd_ms'] / r['fwd_ms']:5.2f}x  fwd+bwd "
                     f"{base['fwd_bwd_ms'] / r['fwd_bwd_ms']:5.2f}x cublas fp32   error "
                     f"{r['rel_err'] / max(base['rel_err'], 1e-30):6.2f}x")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU check)")
    ap.add_argument("--sweep", action="store_true", help="also the SWEEP launch rows")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        print("linear_compare: the full sizes need a GPU (use --quick on a CPU)")
        return 2
    rows = run(args.quick, args.reps, args.sweep)
    return _common.finish_script(args.out, rows, ratios(rows))


if __name__ == "__main__":
    sys.exit(main())
