"""The ``ctxfast`` command.

    ctxfast info                       versions; which backends are built and usable per op
    ctxfast smoke                      run every op on every usable backend against the reference
    ctxfast bench [--quick] [--ops …] [--out DIR] [--device D] [--verbose] [--list]
                                       benchmarks against eager and the GPU peers (needs the
                                       source checkout and `pip install -e '.[bench]'`): one
                                       compact table per op, a report (JSON, markdown, PNG
                                       plots) in --out; `bench --help`
    ctxfast xl-eval [--quick] [--attn-lens …] [--out DIR] [--json F] [--plot F]
                                       Transformer-XL with memory vs a vanilla sliding window
                                       (the paper's Table 9); `xl-eval --help`
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

import ctxfast
from ctxfast import _dispatch, reference


def _devices() -> List[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _triton_version() -> str:
    if importlib.util.find_spec("triton") is None:
        return "not installed"
    import triton  # noqa: PLC0415 (imported only when asked for)
    return triton.__version__


# --------------------------------------------------------------------------- info

#: Environment variables that choose a backend, a kernel or a launch path (README): `info`
#: prints those that are set, so that a log says what ran.
_KERNEL_SETTINGS = ("CTXFAST_BACKEND", "CTXFAST_LSTM_CUDA_KERNEL", "CTXFAST_LSTM_CUDA_BWD_REDUCE",
                    "CTXFAST_TRITON_LAUNCH",
                    "CTXFAST_ATTN_BWD_DQ", "CTXFAST_REL_BWD_DR", "CTXFAST_ATTN_CPU_GEMM",
                    "CTXFAST_LSTM_CPU_GEMM", "CTXFAST_CPU_LINEAR", "CTXFAST_ATTN_CPU_SIMD",
                    "CTXFAST_CPU_CACHE_MB", "CTXFAST_ATTN_TMA", "CTXFAST_AUTOTUNE",
                    "CTXFAST_LINEAR_CUDA", "CTXFAST_REL_RB_MMA", "CTXFAST_TUNE_WS",
                    "CTXFAST_ATTN_CPU_TILE", "CTXFAST_ATTN_CPU_DEBUG", "CTXFAST_LSTM_CUDA_RING")


def cmd_info(args: argparse.Namespace) -> int:
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    print(f"ctxfast {ctxfast.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda or 'none'}), triton {_triton_version()}"
          f"{' (TRITON_INTERPRET=1)' if interp else ''}")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"GPU: {gpu}; CPU threads: {torch.get_num_threads()}")
    print("extensions:")
    print(f"  ctxfast._C     {'built' if _dispatch.c_available() else 'MISSING: ' + str(_dispatch._C_ERROR)}")
    cuda_state = "built" if _dispatch.cuda_ext_available() else _dispatch._cuda_ext_reason()
    print(f"  ctxfast._cuda  {cuda_state}")
    if _dispatch.c_available() and hasattr(torch.ops.ctxfast, "cpu_code_paths"):
        print(f"CPU code: {torch.ops.ctxfast.cpu_code_paths()}")
    try:                                # what float32 products may round to on a GPU
        from ctxfast.kernels._common import _rnn_tf32_allowed, _tf32_allowed
        print(f"float32 on a GPU: attention products {'TF32' if _tf32_allowed() else 'float32'}"
              f" (cuBLAS's setting), LSTM recurrence "
              f"{'TF32' if _rnn_tf32_allowed() else 'float32'} (cuDNN RNNs' setting)")
    except ImportError:                 # no triton: the settings' readers live beside it
        pass
    for name in _KERNEL_SETTINGS:       # the settings that pick a kernel or a path, if set
        value = os.environ.get(name, "")
        if value:
            print(f"{name}={value}")

    devices = ["cpu", "cuda"]
    print("backends per op (* = default for that device; tensors on cpu | cuda):")
    notes: Dict[str, int] = {}
    rows: List[Tuple[str, ...]] = []
    for op, supported in _dispatch.registered_ops().items():
        defaults = {dev: _dispatch.default_backend(op, torch.device(dev)) for dev in devices}
        for b in _dispatch.BACKENDS:
            cells = []
            for dev in devices:
                if b not in supported:
                    cells.append("-")
                    continue
                reason = _dispatch.why_unavailable(b, torch.device(dev))
                if reason is None:
                    mark = "*" if defaults[dev] == b else ""
                    cells.append("yes" + mark + (" (interpreter)" if b == "triton" and dev == "cpu" else ""))
                else:
                    n = notes.setdefault(reason, len(notes) + 1)
                    cells.append(f"no [{n}]")
            rows.append((op, b, *cells))
    widths = [max(len(r[c]) for r in rows + [("op", "backend", "cpu", "cuda")]) for c in range(4)]
    for r in [("op", "backend", "cpu", "cuda")] + rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)))
    for reason, n in notes.items():
        print(f"  [{n}] {reason}")
    lstm_ops = sys.modules.get("ctxfast.ops.lstm")
    default = getattr(lstm_ops, "CUDA_DEFAULT", None) if lstm_ops is not None else None
    if default in ("split", "triton"):
        runs = ("the triton forward and the cuda backward" if default == "split"
                else "both directions on triton")
        print(f"  lstm on cuda with no backend asked for: {runs} "
              "(ctxfast.ops.lstm.CUDA_DEFAULT), where both can run")
    linear_ops = sys.modules.get("ctxfast.ops.linear")
    if getattr(linear_ops, "CUDA_DEFAULT", None) == "triton":
        print("  linear on cuda float32 with no backend asked for: triton, tf32x3 unless torch "
              "allows TF32 (ctxfast.ops.linear.CUDA_DEFAULT)")
    return 0


# --------------------------------------------------------------------------- smoke

def _smoke_rel_shift(backend: str, device: str) -> float:
    """Forward and backward on random input; returns the max abs difference from the
    reference (0 expected: the op only moves data)."""
    x = torch.randn(2, 3, 17, 40, device=device, requires_grad=True)
    out = ctxfast.rel_shift(x, backend=backend)
    g = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, g)
    err_fwd = (out - reference.rel_shift(x.detach())).abs().max().item()
    err_bwd = (dx - reference.rel_unshift(g)).abs().max().item()
    return max(err_fwd, err_bwd)


def _smoke_attention(backend: str, device: str) -> float:
    """Causal attention with memory and padding, fp32, forward and backward; returns the
    largest relative error (out, dq, dk, dv) against the float64 reference."""
    B, H, Tq, Tk, D = 2, 2, 20, 29, 32
    q, k, v = (torch.randn(B, H, T, D, device=device, requires_grad=True) for T in (Tq, Tk, Tk))
    kpm = torch.rand(B, Tk, device=device) < 0.2
    out = ctxfast.attention(q, k, v, causal=True, key_padding_mask=kpm, backend=backend)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = reference.attention(*ref_in, causal=True, key_padding_mask=kpm)
    ref_grads = torch.autograd.grad(ref, ref_in, do.double())
    return max(((a.double() - b).norm() / b.norm()).item()
               for a, b in zip((out, *grads), (ref, *ref_grads)))


def _smoke_attention_varlen(backend: str, device: str) -> float:
    """Three packed sequences, causal, fp32, forward and backward; largest relative error
    against the float64 reference run one sequence at a time."""
    lens = [7, 19, 3]
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), 2, 16, device=device, requires_grad=True) for _ in range(3))
    out = ctxfast.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                   backend=backend)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    pieces, s = [], 0
    for n in lens:   # [n, H, D] -> [1, H, n, D] -> back
        qb, kb, vb = (t[s:s + n].transpose(0, 1).unsqueeze(0) for t in ref_in)
        pieces.append(reference.attention(qb, kb, vb, causal=True)[0].transpose(0, 1))
        s += n
    ref = torch.cat(pieces)
    ref_grads = torch.autograd.grad(ref, ref_in, do.double())
    return max(((a.double() - b).norm() / b.norm()).item()
               for a, b in zip((out, *grads), (ref, *ref_grads)))


def _smoke_rel_attention(backend: str, device: str) -> float:
    """Transformer-XL attention with memory, fp32, forward and backward of every input;
    largest relative error against the float64 reference."""
    B, H, Tq, Tk, D = 2, 2, 17, 29, 32
    ts = [torch.randn(*s, device=device, requires_grad=True)
          for s in ((B, H, Tq, D), (B, H, Tk, D), (B, H, Tk, D), (H, Tk, D), (H, D), (H, D))]
    out = ctxfast.rel_attention(*ts, backend=backend)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, ts, do)
    ref_in = [t.detach().double().requires_grad_(True) for t in ts]
    ref = reference.rel_attention(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, do.double())
    return max(((a.double() - b).norm() / b.norm()).item()
               for a, b in zip((out, *grads), (ref, *ref_grads)))


def _smoke_lstm(backend: str, device: str) -> float:
    """One LSTM layer with a DropConnect mask, projection and both clips, fp32, forward and
    backward of every input; largest relative error against the float64 reference. Run
    with cuDNN's TF32 setting off (restored after): the CUDA kernels follow it for float32
    as nn.LSTM does, and TF32's ~1e-3 is not what this checks."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        return _smoke_lstm_float32(backend, device)
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def _smoke_lstm_float32(backend: str, device: str) -> float:
    T, B, I, H, P = 5, 3, 7, 20, 12
    ts = [torch.randn(*s, device=device, requires_grad=True)
          for s in ((T, B, I), (B, P), (B, H), (4 * H, I), (4 * H, P), (4 * H,), (4 * H,),
                    (P, H))]
    mask = (torch.rand(4 * H, P, device=device) > 0.3).float()
    kw = dict(weight_mask=mask, weight_dropout=0.3, cell_clip=0.5, proj_clip=0.3)

    def run(x, h0, c0, *w, fn, **extra):
        out, (h, c) = fn(x, (h0, c0), *w, **kw, **extra)
        return out, h, c
    outs = run(*ts, fn=ctxfast.lstm, backend=backend)
    gs = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, ts, gs)
    ref_in = [t.detach().double().requires_grad_(True) for t in ts]
    kw["weight_mask"] = mask.double()
    refs = run(*ref_in, fn=reference.lstm)
    ref_grads = torch.autograd.grad(refs, ref_in, [g.double() for g in gs])
    return max(((a.double() - b).norm() / b.norm()).item()
               for a, b in zip((*outs, *grads), (*refs, *ref_grads)))


def _smoke_linear(backend: str, device: str) -> float:
    """A decoder-like linear with a bias, fp32, forward and backward of every input;
    largest relative error against float64 (tf32x3 on a GPU's triton backend)."""
    ts = [torch.randn(*s, device=device, requires_grad=True) for s in ((2, 9, 24), (37, 24), (37,))]
    out = ctxfast.linear(*ts, backend=backend)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, ts, do)
    ref_in = [t.detach().double().requires_grad_(True) for t in ts]
    ref = reference.linear(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, do.double())
    return max(((a.double() - b).norm() / b.norm()).item()
               for a, b in zip((out, *grads), (ref, *ref_grads)))


SMOKE: Dict[str, Tuple[Callable[[str, str], float], float]] = {
    # op: (function(backend, device) -> error, allowed error)
    "rel_shift": (_smoke_rel_shift, 0.0),    # max abs error: the op only moves data
    "attention": (_smoke_attention, 1e-4),   # relative error, fp32 (tf32 on a GPU if enabled)
    "attention_varlen": (_smoke_attention_varlen, 1e-4),
    "rel_attention": (_smoke_rel_attention, 1e-4),
    "lstm": (_smoke_lstm, 1e-4),
    "linear": (_smoke_linear, 1e-5),         # relative error, fp32 (cuBLAS TF32 if enabled)
}


def cmd_smoke(args: argparse.Namespace) -> int:
    failures = 0
    print("smoke: every op, every usable backend, forward + backward against ctxfast.reference")
    for op, supported in _dispatch.registered_ops().items():
        if op not in SMOKE:
            failures += 1
            print(f"  {op:<16} FAILED: no smoke run defined for this op (ctxfast/cli.py SMOKE)")
            continue
        fn, tol = SMOKE[op]
        for dev in _devices():
            for b in supported:
                reason = _dispatch.why_unavailable(b, torch.device(dev))
                if reason is not None:
                    print(f"  {op:<16} {b:<7} {dev:<5} skipped: {reason}")
                    continue
                t0 = time.perf_counter()
                try:
                    err = fn(b, dev)
                except Exception as e:  # report every failure, then exit non-zero
                    failures += 1
                    print(f"  {op:<16} {b:<7} {dev:<5} FAILED: {type(e).__name__}: {e}")
                    continue
                ms = (time.perf_counter() - t0) * 1e3
                ok = err <= tol
                failures += not ok
                print(f"  {op:<16} {b:<7} {dev:<5} {'ok' if ok else 'WRONG'}  "
                      f"err {err:.1e}  ({ms:.0f} ms incl. first-call compile)")
    print("smoke: all ok" if failures == 0 else f"smoke: {failures} FAILED")
    return 1 if failures else 0


# --------------------------------------------------------------------------- bench

def _find_report(explicit: Optional[str]) -> Path:
    candidates = [Path(explicit)] if explicit else [
        Path(__file__).resolve().parents[1] / "benchmarks",   # editable install: the repo
        Path.cwd() / "benchmarks",
    ]
    for c in candidates:
        if (c / "report.py").is_file():
            return c / "report.py"
    raise SystemExit("ctxfast bench: benchmarks/report.py not found (run from the source "
                     "checkout, or pass --bench-dir)")


def cmd_bench(args: argparse.Namespace, rest: List[str]) -> int:
    path = _find_report(args.bench_dir)
    spec = importlib.util.spec_from_file_location("ctxfast_bench_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.main(rest) or 0)


# --------------------------------------------------------------------------- main

def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="ctxfast", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions and backends")
    sub.add_parser("smoke", help="every op on every usable backend vs the reference")
    bench = sub.add_parser("bench", help="benchmarks against eager PyTorch (see benchmarks/)",
                           add_help=False)
    bench.add_argument("--bench-dir", default=None, help="the checkout's benchmarks/ folder")
    sub.add_parser("xl-eval", add_help=False,
                   help="Transformer-XL evaluation with memory vs vanilla (see xl-eval --help)")
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "bench":
        return cmd_bench(args, rest)
    if args.cmd == "xl-eval":
        from .eval import xl_eval  # noqa: PLC0415 (imports the models only when asked for)
        try:
            _dispatch.requested_backend()      # a bad CTXFAST_BACKEND: one line, not a trace
        except ValueError as e:
            parser.exit(2, f"ctxfast xl-eval: error: {e}\n")
        try:
            return xl_eval.main(rest)
        except _dispatch.BackendUnavailable as e:   # e.g. CTXFAST_BACKEND=triton, no GPU
            parser.exit(2, f"ctxfast xl-eval: error: {e}\n")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        rc = {"info": cmd_info, "smoke": cmd_smoke}[args.cmd](args)
        sys.stdout.flush()                 # a closed pipe raises here, not at interpreter exit
        return rc
    except BrokenPipeError:
        # The reader closed the pipe (`ctxfast info | head -3`): stop quietly, as Unix tools
        # do; point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
