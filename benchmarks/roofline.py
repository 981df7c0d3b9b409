"""Roofline floors of every benchmarked kernel, for ``benchmarks/NOTES.md``.

    python benchmarks/roofline.py                           # GPU floors of the GPU cases
    python benchmarks/roofline.py --results R.json [R2.json ...] --measure-cpu
                                                            # + CPU measured vs CPU floor

For each case of the suites (``bench_<op>.py``'s ``QUICK_CASES`` and ``FULL_CASES``,
imported, so the sizes never drift from the benchmarks) this counts the least work of
one call — FLOPs and bytes moved to and from memory (formulas in :func:`work` and in
NOTES.md) — and turns them into a time floor ``max(FLOPs / peak, bytes / bandwidth)``
against a ceiling:

* GPU: the ceilings measured on the project's GPU machines (``docs/ARCHITECTURE.md``, measured facts):
  bf16 dense matmul ≈ 790 TFLOP/s on H100 and H200; device copy ≈ 3.0 TB/s (H100) and
  ≈ 4.3 TB/s (H200). No fp32 matmul ceiling was measured: fp32 cases get a byte floor only.
* CPU (``--measure-cpu``): fp32 ``torch.mm`` of 2048² and a 256 MiB tensor copy measured
  now, with the threads torch uses (best of 5; the machine may be shared: the ceiling is
  then an underestimate and the gap too small).

``--results``: reports written by ``ctxfast bench``; each record's measured ``ms`` (and its
baseline's) is set against the CPU floor of its case: gap = measured / floor.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

GPU_CEILINGS = {   # name: (bf16 FLOP/s, bytes/s), docs/ARCHITECTURE.md
    "H100": (790e12, 3.0e12),
    "H200": (790e12, 4.3e12),
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# --------------------------------------------------------------------------- work

def _causal_pairs(Tq: int, Tk: int) -> int:
    """(i, j) pairs with j <= i + (Tk - Tq): query i sees keys 0 .. i + mem."""
    mem = Tk - Tq
    return Tq * (mem + 1) + Tq * (Tq - 1) // 2


def work(op: str, case, mode: str, elt: int) -> Tuple[float, float]:
    """(FLOPs, bytes) floor of one call of `op` on `case` in `mode` ("fwd", "bwd" or
    "fwd+bwd"), elements of `elt` bytes. Formulas (per (b, h) unless said):

    rel_shift  x [B,H,Tq,Tk]: no FLOPs; fwd reads x and writes out (2·N·elt), bwd the same
               for the gradient.
    attention  P = visible pairs (exact for causal; dense Tq·Tk for padding and
               permutation masks, as the suite counts them: a random permutation leaves
               no tile empty); fwd 4·P·D FLOPs (QKᵀ, PV), bwd 10·P·D (recompute QKᵀ, dV,
               dP, dQ, dK); bytes fwd: q, k, v, out + lse (fp32 [Tq]); bwd: q, k, v, out,
               dout, lse read, dq, dk, dv written.
    rel_attention  P = causal pairs with memory; fwd 6·P·D (AC, BD, PV), bwd 16·P·D
               (recompute AC and BD, dV, dP, dQ from AC and from BD, dK, dR); bytes as
               attention plus r [H, Tk, D] (and dr in bwd).
    lstm       what bench_lstm.py times, per layer and direction: the input projection
               (one GEMM, input size I) and the fused recurrence, G = 4H gates, P = proj
               or H. Recurrence: fwd 2·T·B·G·P FLOPs (h·W_hhᵀ) + 2·T·B·P·H with a
               projection; bwd twice that (dh and dW); bytes fwd: read xw [T,B,G],
               W_hh (+W_hr) once, write out [T,B,P], cells [T,B,H], gates [T,B,G]
               (saved for bwd); bwd: read dout, gates, cells, out, W, write dxw, dW.
               Input projection: fwd 2·T·B·G·I FLOPs, bytes x [T,B,I] and W_ih read,
               xw written; bwd twice the FLOPs (dx, dW_ih), bytes dxw, x, W_ih read,
               dx, dW_ih written. :func:`lstm_recurrence_work` gives the recurrence alone.
    """
    if mode == "fwd+bwd":
        f1, b1 = work(op, case, "fwd", elt)
        f2, b2 = work(op, case, "bwd", elt)
        return f1 + f2, b1 + b2
    bwd = mode == "bwd"
    if op == "rel_shift":
        B, H, Tq, Tk = case.shape
        return 0.0, 2.0 * B * H * Tq * Tk * elt
    if op == "attention":
        B, H, Tq, Tk, D = case.shape
        causal = case.mask in ("causal", "causal-memory")
        P = B * H * (_causal_pairs(Tq, Tk) if causal else Tq * Tk)
        qo, kv, lse = B * H * Tq * D * elt, B * H * Tk * D * elt, B * H * Tq * 4
        if bwd:
            return 10.0 * P * D, 4 * qo + 4 * kv + lse
        return 4.0 * P * D, 2 * qo + 2 * kv + lse
    if op == "rel_attention":
        B, H, Tq, mem, D = case.shape
        Tk = Tq + mem
        P = B * H * _causal_pairs(Tq, Tk)
        qo, kv, lse, r = B * H * Tq * D * elt, B * H * Tk * D * elt, B * H * Tq * 4, \
            H * Tk * D * elt
        if bwd:
            return 16.0 * P * D, 4 * qo + 4 * kv + lse + 2 * r
        return 6.0 * P * D, 2 * qo + 2 * kv + lse + r
    if op == "lstm":
        return _lstm_work(case, bwd, elt, input_projection=True)
    raise ValueError(f"no work formula for op {op!r}")


def lstm_recurrence_work(case, mode: str, elt: int) -> Tuple[float, float]:
    """(FLOPs, bytes) of the fused LSTM recurrences alone (no input projection)."""
    if mode == "fwd+bwd":
        f1, b1 = _lstm_work(case, False, elt, input_projection=False)
        f2, b2 = _lstm_work(case, True, elt, input_projection=False)
        return f1 + f2, b1 + b2
    return _lstm_work(case, mode == "bwd", elt, input_projection=False)


def _lstm_work(case, bwd: bool, elt: int, input_projection: bool) -> Tuple[float, float]:
    flops = nbytes = 0.0
    T, Bt = case.T, case.B
    for layer in case.layers:
        dirs = 2 if layer.bidirectional else 1
        H = layer.hidden_size
        P = layer.proj_size or H
        G = 4 * H
        w = (G * P + (P * H if layer.proj_size else 0)) * elt
        for k in range(layer.num_layers):
            I = layer.input_size if k == 0 else P * dirs
            for _ in range(dirs):
                f = 2.0 * T * Bt * G * P + (2.0 * T * Bt * P * H if layer.proj_size else 0)
                fi = 2.0 * T * Bt * G * I if input_projection else 0.0
                bi = (T * Bt * (I + G) + G * I) * elt if input_projection else 0.0
                if bwd:
                    flops += 2 * (f + fi)
                    nbytes += T * Bt * (P + G + H + P + G) * elt + 2 * w + 2 * bi
                else:
                    flops += f + fi
                    nbytes += T * Bt * (G + P + H + G) * elt + w + bi
    return flops, nbytes


def floor_s(flops: float, nbytes: float, peak: Optional[float], bw: float) -> Tuple[float, str]:
    """(seconds, 'compute' | 'memory') of the roofline floor; peak None: bytes only."""
    t_c = flops / peak if peak else 0.0
    t_m = nbytes / bw
    return (t_c, "compute") if t_c >= t_m else (t_m, "memory")


# --------------------------------------------------------------------------- suites

def suites() -> Dict[str, object]:
    """{op: the imported bench_<op>.py module} for the suites this script knows."""
    import importlib
    out = {}
    for op in ("rel_shift", "attention", "rel_attention", "lstm"):
        if (BENCH_DIR / f"bench_{op}.py").exists():
            out[op] = importlib.import_module(f"bench_{op}")
    return out


def _gpu_dtype(op: str, case) -> str:
    return getattr(case, "dtype", None) or "bfloat16"    # the suites time bf16 on CUDA


def _fmt_n(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _fmt_t(s: float) -> str:
    return f"{s * 1e6:.3g} µs" if s < 1e-3 else f"{s * 1e3:.3g} ms"


def gpu_tables(mods: Dict[str, object]) -> str:
    """One table per op: each GPU case's fwd and bwd floors on H100 / H200."""
    lines = []
    for op, module in mods.items():
        cases = [c for c in module.FULL_CASES if "cuda" in c.devices]
        lines += [f"#### {op} (GPU sizes of bench_{op}.py)", "",
                  "| case | dtype | fwd FLOPs | fwd bytes | fwd floor H100 / H200 | bwd FLOPs "
                  "| bwd bytes | bwd floor H100 / H200 | bound |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for case in cases:
            dtype = _gpu_dtype(op, case)
            peak_ok = dtype != "float32"
            cells, bounds = [], []
            for mode in ("fwd", "bwd"):
                f, b = work(op, case, mode, DTYPE_BYTES[dtype])
                ts, bs = [], []
                for peak, bw in GPU_CEILINGS.values():
                    t, bound = floor_s(f, b, peak if peak_ok else None, bw)
                    ts.append(_fmt_t(t))
                    bs.append(bound)
                bounds.append(" / ".join(bs) if len(set(bs)) > 1 else bs[0])
                cells += [_fmt_n(f, "FLOP"), _fmt_n(b, "B"), " / ".join(ts)]
            bound = bounds[0] if bounds[0] == bounds[1] else f"fwd {bounds[0]}, bwd {bounds[1]}"
            if not peak_ok and op != "rel_shift":
                bound = "bytes only (no fp32 ceiling measured)"
            lines.append(f"| {case.name} | {dtype} | " + " | ".join(cells) + f" | {bound} |")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CPU

def measure_cpu(n: int = 2048, copy_bytes: int = 256 << 20, repeat: int = 5) -> Tuple[float, float]:
    """(fp32 matmul FLOP/s, copy bytes/s: read + write) of this CPU now; best of `repeat`."""
    import torch
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    flops = 2 * n ** 3 / best
    src = torch.randn(copy_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return flops, 2 * copy_bytes / best


def cpu_table(mods: Dict[str, object], reports: Iterable[dict], peak: float, bw: float) -> str:
    lines = ["| op | case | mode | FLOPs | bytes | CPU floor | backend | measured | gap |",
             "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for rep in reports:
        done = set()
        for r in rep["records"]:
            module = mods.get(r["op"])
            if module is None:
                continue
            case = next((c for c in (*module.QUICK_CASES, *module.FULL_CASES)
                         if c.name == r["case"]), None)
            if case is None:
                continue
            f, b = work(r["op"], case, r["mode"], DTYPE_BYTES.get(r.get("dtype"), 4))
            t, bound = floor_s(f, b, peak, bw)
            rows = [(r["backend"], r["ms"])]
            key = (r["op"], r["case"], r["mode"])
            if key not in done:
                done.add(key)
                rows.insert(0, (f"{r['baseline']} (baseline)", r["baseline_ms"]))
            for backend, ms in rows:
                gap = f"{ms * 1e-3 / t:.3g}x" if ms is not None and t > 0 else "—"
                meas = f"{ms:.3g} ms" if ms is not None else "—"
                lines.append(f"| {r['op']} | {r['case']} | {r['mode']} | {_fmt_n(f, 'FLOP')} | "
                             f"{_fmt_n(b, 'B')} | {_fmt_t(t)} ({bound}) | {backend} | {meas} | "
                             f"{gap} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="*", type=Path, default=[],
                        help="ctxfast bench reports (JSON) with CPU measurements")
    parser.add_argument("--measure-cpu", action="store_true",
                        help="measure this CPU's fp32 matmul and copy ceilings now")
    parser.add_argument("--cpu-ceilings", nargs=2, type=float, metavar=("FLOPS", "BYTES_S"),
                        help="CPU ceilings to use instead of measuring")
    args = parser.parse_args(argv)
    mods = suites()
    print("## GPU floors (ceilings: docs/ARCHITECTURE.md)\n")
    print(gpu_tables(mods))
    if args.results:
        if args.cpu_ceilings:
            peak, bw = args.cpu_ceilings
        elif args.measure_cpu:
            peak, bw = measure_cpu()
        else:
            print("(--results needs --measure-cpu or --cpu-ceilings)", file=sys.stderr)
            return 1
        print(f"## CPU: measured vs floor (fp32 matmul {peak / 1e9:.3g} GFLOP/s, "
              f"copy {bw / 1e9:.3g} GB/s)\n")
        print(cpu_table(mods, [json.loads(p.read_text()) for p in args.results], peak, bw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
