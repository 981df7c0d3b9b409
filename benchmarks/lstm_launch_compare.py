"""How each LSTM implementation runs the recurrence, timed side by side (persistent against
per-step launches): the Triton kernels in one persistent cooperative launch and launched per step
(``kernels/lstm.py``'s ``LAUNCH``; the persistent one also with exact fp32 dots instead of
tf32x3, ``FP32_PRECISION``), the CUDA C++ kernels persistent (CUDA cores; and tensor cores,
``persistent-mma``) and per step
(``CTXFAST_LSTM_CUDA_KERNEL``), and cuDNN's ``nn.LSTM`` with fastai-style WeightDropout
(``bench_lstm.FastaiWeightDropLSTM``), one layer each at the benchmark's ULMFiT and ELMo
sizes, forward and forward+backward, fp32 and bf16; "triton persistent split-proj" (the
projection over the unit blocks, ``kernels.lstm.PROJ_SPLIT``; layers with one); "triton
persistent split-k" (the backward's product split over the gate columns,
``kernels.lstm.BWD_SPLIT_K``); "triton stepwise graphed" and "cuda per-step graphed"
(the per-step launches captured once in a CUDA graph and replayed: the other way to take
the host out of a per-step recurrence); "triton persistent f16-operands" (float32
with TF32 allowed: the forward's recurrence products on fp16 operands,
``kernels.lstm.F16_OPERANDS``; float32, layers without projection or with a proj clip);
"triton persistent split-k f16-operands" (both); and
"auto", what ``ctxfast.lstm`` runs
on CUDA tensors with no backend asked for (``ctxfast.ops.lstm.CUDA_DEFAULT``: the Triton
forward with the CUDA C++ backward).

float32: both cuDNN and the CUDA tensor-core kernels follow torch's TF32 setting for cuDNN
RNNs (on by default: one TF32 product per MMA). The forms ending in " tf32x3" (ours:
three TF32 products, float32-level error) and " ieee" (cuDNN) run with that setting off.
" groups": the grouped tensor-core backward (the default; plain "cuda persistent-mma" sums
one partial per block); " ring4" / " ring8": the tensor-core forward's product loop with
4 or 8 h tiles in its ring (``CTXFAST_LSTM_CUDA_RING``; the default is 8 for fp16/bf16 and
4 for float32, as round 5 timed them).

    python benchmarks/lstm_launch_compare.py [--quick] [--out FILE.json]

Timing: CUDA events around each call, median of ``--reps`` after 3 warm-up calls (the first
compiles); on a CPU (``--quick`` only: tiny sizes, the Triton interpreter) wall-clock time.
The point is the ratios between forms in one run, not a table for the README (that is
``bench_lstm.py``'s). Every timed call is the public op on the same inputs; nothing else
runs inside the timed region.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Dict, List

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
import ctxfast  # noqa: E402
from ctxfast import _dispatch  # noqa: E402

#: (name, input size, hidden, proj, T, B, clip)
FULL = [("ULMFiT layer 1152", 1152, 1152, 0, 70, 64, None),
        ("ELMo layer 4096/512", 512, 4096, 512, 50, 32, 3.0)]
QUICK = [("tiny", 8, 20, 0, 5, 3, None), ("tiny proj", 8, 20, 12, 5, 3, 3.0)]
P_DROP = 0.2


def _triton_rows(name: str) -> Dict[str, object]:
    """The ``kernels.lstm`` settings of a Triton form, as ``{"lstm:<setting>": value}``: what
    :func:`_form` sets on the module, and what a thread compiling the form ahead has in
    force (``kernels/_tune.py`` ``compile_ahead``); empty for other forms."""
    rows: Dict[str, object] = {}
    if name.startswith("triton stepwise"):      # (" graphed": the same launches, replayed)
        rows["lstm:LAUNCH"] = "stepwise"
    elif name.startswith("triton persistent"):
        rows["lstm:LAUNCH"] = "persistent"
        if name.endswith("ieee"):                 # exact fp32 products (FMA), not tf32x3
            rows["lstm:FP32_PRECISION"] = "ieee"
        if name.endswith("split-proj"):           # the projection over the unit blocks
            rows["lstm:PROJ_SPLIT"] = True
        if " split-k" in name:                    # the backward over gate-column slices
            rows["lstm:BWD_SPLIT_K"] = True
        if " f16-operands" in name:               # float32's products on fp16 operands
            rows["lstm:F16_OPERANDS"] = True
    return rows


def _kernel_calls(run_once) -> List[tuple]:
    """(function, args, kwargs) of the kernel-level LSTM forward and backward that
    ``run_once()`` makes (its first of each), recorded while it runs for real."""
    from ctxfast.kernels import lstm as lstm_kernels
    return _common.record_calls(lstm_kernels, ("lstm_forward", "lstm_backward"), run_once)


def _compile_forms(forms: List[str], run_once, device) -> None:
    """The Triton forms' kernels compiled side by side before any form is timed (GPU): the
    kernel-level forward and backward of one real call (``run_once``), replayed on one
    thread per form with its settings in force (:func:`_triton_rows`), launches compiling
    only."""
    rows = [_triton_rows(f) for f in forms if _triton_rows(f)]
    if device.type != "cuda" or not rows:
        return
    from ctxfast.kernels import _tune
    _tune.compile_ahead(list({repr(r): r for r in rows}.values()),
                        _common.replayer(_kernel_calls(run_once)), device)


@contextlib.contextmanager
def _form(name: str):
    """Select a launch form for the duration of the block (set before timing, restored
    after: never inside the timed call)."""
    from ctxfast.kernels import lstm as lstm_kernels
    saved_launch, saved_precision = lstm_kernels.LAUNCH, lstm_kernels.FP32_PRECISION
    saved_split, saved_split_k = lstm_kernels.PROJ_SPLIT, lstm_kernels.BWD_SPLIT_K
    saved_f16 = lstm_kernels.F16_OPERANDS
    saved_env = os.environ.get("CTXFAST_LSTM_CUDA_KERNEL")
    saved_reduce = os.environ.get("CTXFAST_LSTM_CUDA_BWD_REDUCE")
    saved_ring = os.environ.get("CTXFAST_LSTM_CUDA_RING")
    saved_tf32 = torch.backends.cudnn.allow_tf32
    if name.startswith(("cuda ", "cuDNN")) and name.endswith((" tf32x3", " ieee")):
        torch.backends.cudnn.allow_tf32 = False   # float32 without TF32 (ours: tf32x3)
    for key, value in _triton_rows(name).items():   # the Triton forms' settings
        setattr(lstm_kernels, key[len("lstm:"):], value)
    if name.startswith("cuda "):
        os.environ["CTXFAST_LSTM_CUDA_KERNEL"] = name.split()[1].replace("-", "_")
        # the grouped tensor-core backward (the default), or one partial per block
        os.environ["CTXFAST_LSTM_CUDA_BWD_REDUCE"] = "groups" if " groups" in name else "blocks"
        # the tensor-core forward's ring of h tiles: " ring4" / " ring8", else the
        # default (8 for fp16/bf16, 4 for float32)
        ring = "4" if " ring4" in name else "8" if " ring8" in name else ""
        os.environ["CTXFAST_LSTM_CUDA_RING"] = ring
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = saved_tf32
        lstm_kernels.LAUNCH, lstm_kernels.FP32_PRECISION = saved_launch, saved_precision
        lstm_kernels.PROJ_SPLIT, lstm_kernels.BWD_SPLIT_K = saved_split, saved_split_k
        lstm_kernels.F16_OPERANDS = saved_f16
        for var, saved in (("CTXFAST_LSTM_CUDA_KERNEL", saved_env),
                           ("CTXFAST_LSTM_CUDA_BWD_REDUCE", saved_reduce),
                           ("CTXFAST_LSTM_CUDA_RING", saved_ring)):
            if saved is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = saved


def _graphed(fn):
    """`fn` captured in a CUDA graph: warm-up calls on a side stream (compiles, caches), one
    capture, and the graph's replay returned (what is timed: the same launches without their
    host-side cost). Raises RuntimeError where the call cannot be captured (a host sync)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _forms(device: torch.device) -> List[str]:
    forms = []
    if _dispatch.why_unavailable("triton", device) is None:
        forms += ["triton persistent", "triton stepwise", "triton persistent ieee",
                  "triton persistent split-proj", "triton persistent split-k",
                  "triton persistent f16-operands", "triton persistent split-k f16-operands"]
    if device.type == "cuda" and _dispatch.why_unavailable("cuda", device) is None:
        forms += ["cuda persistent", "cuda persistent-mma", "cuda persistent-mma groups",
                  "cuda persistent-mma groups ring4", "cuda persistent-mma groups ring8",
                  "cuda persistent-mma tf32x3",
                  "cuda persistent-mma groups tf32x3", "cuda per-step"]
    if device.type == "cuda" and not [f for f in ("triton", "cuda")
                                      if _dispatch.why_unavailable(f, device) is not None]:
        forms.append("auto")               # no backend asked for: Triton forward, CUDA backward
    if device.type == "cuda":
        forms += ["cuDNN+WeightDropout", "cuDNN+WeightDropout ieee"]
        # the per-step launches captured in a CUDA graph, last: a capture that fails can
        # leave the stream unusable for what would follow
        forms += [f + " graphed" for f in ("triton stepwise", "cuda per-step") if f in forms]
    return forms


def run(quick: bool, reps: int, dtypes: List[str], only=None) -> List[Dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    time_ms = _common.median_timer(device, reps)
    rows = []
    for (name, I, H, P, T, B, clip) in (QUICK if quick else FULL):
        for dt_name in dtypes:
            dtype = getattr(torch, dt_name)
            torch.manual_seed(0)
            ref = nn.LSTM(I, H, proj_size=P, device=device, dtype=dtype)
            x = torch.randn(T, B, I, device=device, dtype=dtype, requires_grad=True)
            Pe = P or H
            mask = (torch.rand(4 * H, Pe, device=device) >= P_DROP).to(dtype)
            g = torch.randn(T, B, Pe, device=device, dtype=dtype)
            params = [ref.weight_ih_l0, ref.weight_hh_l0, ref.bias_ih_l0, ref.bias_hh_l0]
            w_hr = ref.weight_hr_l0 if P else None
            forms = [f for f in _forms(device) if not (only and f not in only) and not (
                (f.endswith("split-proj") and not P)
                or (" f16-operands" in f and (dtype != torch.float32 or (P and clip is None))))]
            # (left out: the same launch as "triton persistent")

            def triton_call():
                out = ctxfast.lstm(x, None, *params, w_hr, weight_mask=mask,
                                   weight_dropout=P_DROP, cell_clip=clip, proj_clip=clip,
                                   backend="triton")[0]
                torch.autograd.grad(out, [x, *params], g, allow_unused=True)
            with _form("triton persistent"):
                _compile_forms(forms, triton_call, device)
            for form in forms:
                if form.startswith("cuDNN+WeightDropout"):
                    if clip is not None:
                        continue                                    # nn.LSTM cannot clip
                    from bench_lstm import FastaiWeightDropLSTM
                    mod = FastaiWeightDropLSTM(ref, P_DROP).train()

                    def fwd():
                        return mod(x)[0]
                    leaves = [x, *mod.parameters()]       # the raw w_hh included
                else:
                    backend = None if form == "auto" else form.split()[0]

                    def fwd():
                        return ctxfast.lstm(x, None, *params, w_hr, weight_mask=mask,
                                            weight_dropout=P_DROP, cell_clip=clip,
                                            proj_clip=clip, backend=backend)[0]
                    leaves = [x, *params] + ([w_hr] if w_hr is not None else [])

                def fwd_nograd():
                    with torch.no_grad():
                        return fwd()

                def fwd_bwd():
                    return torch.autograd.grad(fwd(), leaves, g, allow_unused=True)
                with _form(form):
                    try:
                        timed = (fwd_nograd, fwd_bwd)
                        if form.endswith(" graphed"):
                            timed = tuple(_graphed(f) for f in timed)
                        row = dict(case=name, dtype=dt_name, form=form,
                                   fwd_ms=round(time_ms(timed[0]), 4),
                                   fwd_bwd_ms=round(time_ms(timed[1]), 4))
                    except RuntimeError as e:
                        # a forced kernel that cannot run at this size refuses (never a
                        # silent fallback), a call that cannot be captured says why: a row
                        # that says so, and the run goes on
                        if "cannot run at these sizes" not in str(e) \
                                and not form.endswith(" graphed"):
                            raise
                        why = str(e).split("cannot run at these sizes: ")[-1].splitlines()[0]
                        rows.append(dict(case=name, dtype=dt_name, form=form, fwd_ms=None,
                                         fwd_bwd_ms=None, refused=why))
                        print(f"{name:22s} {dt_name:9s} {form:22s} does not run here: {why}",
                              flush=True)
                        continue
                rows.append(row)
                print(f"{name:22s} {dt_name:9s} {form:22s} fwd {row['fwd_ms']:9.3f} ms   "
                      f"fwd+bwd {row['fwd_bwd_ms']:9.3f} ms", flush=True)
    return rows


def ratios(rows: List[Dict]) -> List[str]:
    """One line per timed form where the same case and dtype has a cuDNN+WeightDropout row:
    its speed as a multiple of cuDNN's, forward and forward+backward (> 1: faster)."""
    lines = []
    for r in rows:
        base = next((b for b in rows if b["case"] == r["case"] and b["dtype"] == r["dtype"]
                     and b["form"] == "cuDNN+WeightDropout" and b.get("fwd_ms")), None)
        if base is None or not r.get("fwd_ms") or r is base:
            continue
        lines.append(f"{r['case']:22s} {r['dtype']:9s} {r['form']:38s} "
                     f"fwd {base['fwd_ms'] / r['fwd_ms']:5.2f}x cuDNN   "
                     f"fwd+bwd {base['fwd_bwd_ms'] / r['fwd_bwd_ms']:5.2f}x cuDNN")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_script_args(ap, reps=20, gpu_dtypes=("float32", "bfloat16"))
    ap.add_argument("--forms", nargs="+", default=None,
                    help='only these forms (e.g. "cuda persistent" "cuda persistent-mma")')
    args = ap.parse_args(argv)
    dtypes = _common.script_setup(args, "lstm_launch_compare")
    if dtypes is None:
        return 2
    rows = run(args.quick, args.reps, dtypes, args.forms)
    return _common.finish_script(args.out, rows, ratios(rows))


if __name__ == "__main__":
    sys.exit(main())
