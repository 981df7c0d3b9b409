"""Where a step of the CUDA tensor-core LSTM spends its time, phase by phase, read from the
kernels' own clocks (no profiler): the persistent kernels (``csrc/cuda/lstm_kernels.cuh``)
stamp each block's SM clock (``clock64()``) when its threads finish each phase of each step
(``LstmDims::phase_clock``), and ``%globaltimer`` at entry and exit to turn cycles into time.
Turned on for a call by ``torch.ops.ctxfast.lstm_cuda_phase_clock(True)`` (the CUDA module's
profiling op), which also hands back the clocks of the calls made since.

    python benchmarks/lstm_phase_clock.py [--out FILE.json] [--cases ulmfit,elmo]
                                          [--dtypes bfloat16,float32]

Per kernel (forward; backward with per-block sums; grouped backward) and phase, the mean
time a step spends there over blocks and steps, and the spread of the per-block means (min,
max). A grid barrier's time is each block's wait for the slowest block plus the barrier's
own latency: its minimum over blocks (the block that arrived last) is the barrier itself.
One call each after a warm-up call; the clocks cost a block barrier per phase (a few
hundred cycles a step), so the call is a little slower than an unclocked one.

``phase_table`` (the reading of one clock tensor) runs on the CPU too:
``tests/test_lstm_cuda_emu.py`` feeds it the clocks of the kernels run under the CUDA
emulator.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Sequence

import torch

#: LstmClockKind (csrc/cuda/lstm.h) -> (kernel, the step columns' phase names)
KINDS = {
    1: ("forward", ("products", "cell", "projection products",
                    "projection barrier + sums", "barrier")),
    2: ("backward (per-block sums)", ("projection dL/dhp", "cell", "products", "barrier",
                                      "sums", "barrier (sums)")),
    3: ("backward (grouped)", ("cell", "barrier", "dz staged", "products",
                               "barrier (products)")),
}
COLS = 6  # kLstmClockCols

#: name -> (input size, hidden, projection (0: none), T, B, cell clip)
CASES = {"ulmfit": ("ULMFiT layer 1152", 1152, 0, 70, 64, None),
         "elmo": ("ELMo layer 4096/512", 4096, 512, 50, 32, 3.0)}


def phase_table(clock: torch.Tensor, kind: int) -> Dict:
    """Read one kernel's phase clock: ``clock`` int64 [blocks, T + 1, 6] (row 0: entry
    clock, clock after the prologue, exit clock, entry ns, exit ns; row 1 + i: the clocks at
    the end of each phase of the i-th step processed, 0 where the call has no such phase).

    Returns ``{"kernel", "blocks", "steps", "cycles_per_ns", "total_us", "prologue_us",
    "step_us", "tail_us", "phases": [{"phase", "mean_us", "min_block_us", "max_block_us"}]}``:
    each phase's time is its stamp minus the previous stamp of the same block (the previous
    step's last phase for a step's first), averaged over steps per block, then over blocks
    (``mean_us``) with the spread of the per-block means."""
    if clock.dim() != 3 or clock.shape[2] != COLS or clock.shape[1] < 2:
        raise ValueError(f"clock must be int64 [blocks, T + 1, {COLS}], got {tuple(clock.shape)}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind}")
    c = clock.detach().to("cpu", torch.int64).double()
    head, steps = c[:, 0, :], c[:, 1:, :]
    name, names = KINDS[kind]
    used = [k for k in range(len(names)) if bool((steps[:, :, k] != 0).any())]
    if not used:
        raise ValueError("the clock holds no step stamps (was the phase clock on?)")
    missing = [k for k in used if bool((steps[:, :, k] == 0).any())]
    if missing:
        raise ValueError(f"phases {[names[k] for k in missing]} are stamped in some steps "
                         "and blocks only")
    ns = head[:, 4] - head[:, 3]
    cycles = head[:, 2] - head[:, 0]
    if bool((ns <= 0).any()) or bool((cycles <= 0).any()):
        raise ValueError("entry / exit stamps missing or out of order")
    rate = cycles / ns                                   # cycles per ns, per block
    stamps = steps[:, :, used]                           # [blocks, T, phases]
    prev = torch.cat([head[:, 1:2], stamps[:, :-1, -1]], dim=1)  # [blocks, T]
    edges = torch.cat([prev.unsqueeze(2), stamps], dim=2)
    dur = edges[:, :, 1:] - edges[:, :, :-1]             # [blocks, T, phases] cycles
    if bool((dur < 0).any()):
        raise ValueError("phase stamps out of order within a block")
    us = dur / rate.view(-1, 1, 1) / 1e3
    per_block = us.mean(dim=1)                           # [blocks, phases]
    to_us = (lambda x: x / rate / 1e3)
    phases = [{"phase": names[k], "mean_us": float(per_block[:, i].mean()),
               "min_block_us": float(per_block[:, i].min()),
               "max_block_us": float(per_block[:, i].max())} for i, k in enumerate(used)]
    return {"kernel": name, "blocks": int(c.shape[0]), "steps": int(steps.shape[1]),
            "cycles_per_ns": float(rate.median()),
            "total_us": float(ns.mean() / 1e3),
            "prologue_us": float(to_us(head[:, 1] - head[:, 0]).mean()),
            "step_us": float(us.sum(dim=2).mean()),
            "tail_us": float(to_us(head[:, 2] - stamps[:, -1, -1]).mean()),
            "phases": phases}


def format_table(title: str, t: Dict) -> str:
    lines = [f"{title}: {t['kernel']}, {t['blocks']} blocks, {t['steps']} steps, "
             f"{t['total_us']:.1f} us in all ({t['cycles_per_ns']:.2f} cycles/ns); "
             f"prologue {t['prologue_us']:.1f} us, {t['step_us']:.2f} us a step, "
             f"tail {t['tail_us']:.1f} us",
             f"  {'phase':<28} {'mean us/step':>12} {'min block':>10} {'max block':>10}"]
    for p in t["phases"]:
        lines.append(f"  {p['phase']:<28} {p['mean_us']:>12.2f} {p['min_block_us']:>10.2f} "
                     f"{p['max_block_us']:>10.2f}")
    return "\n".join(lines)


def _inputs(case: Sequence, dtype: torch.dtype, device: str, seed: int = 0):
    _, H, P, T, B, _ = case
    P = P or H
    g = torch.Generator(device="cpu").manual_seed(seed)
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)
    w_hh = rnd(4 * H, P, scale=P ** -0.5)
    mask = (torch.rand(4 * H, P, generator=g) >= 0.2).to(device, dtype)
    w_hr = rnd(P, H, scale=H ** -0.5) if case[2] else None
    return dict(xw=rnd(T, B, 4 * H), h0=rnd(B, P, scale=0.5), c0=rnd(B, H, scale=0.5),
                w_hh=w_hh, w_hr=w_hr, mask=mask)


def run_case(key: str, dtype: torch.dtype) -> List[Dict]:
    """One forward and one backward of the layer with the phase clock on (after a warm-up
    call of each); the tables of the kernels that ran."""
    case = CASES[key]
    ins = _inputs(case, dtype, "cuda")
    clip = case[5] if case[5] is not None else math.inf   # inf: no clip (the op's contract)
    fwd_args = (ins["xw"], ins["h0"], ins["c0"], ins["w_hh"], ins["w_hr"], ins["mask"],
                1.25, clip, clip, False)
    op = torch.ops.ctxfast

    def call():
        out, cells, gates = op.lstm_recurrence_native(*fwd_args)
        grads = op.lstm_recurrence_backward_native(
            torch.randn_like(out), torch.randn_like(cells), ins["h0"], ins["c0"], ins["w_hh"],
            ins["w_hr"], ins["mask"], 1.25, clip, clip, False, out, cells, gates)
        return grads

    call()                                                # warm-up, no clock
    torch.cuda.synchronize()
    op.lstm_cuda_phase_clock(True)
    try:
        call()
        torch.cuda.synchronize()
    finally:
        clocks, kinds = op.lstm_cuda_phase_clock(False)
    if not clocks:
        raise RuntimeError(f"{case[0]} {dtype}: no tensor-core persistent kernel ran "
                           "(CTXFAST_LSTM_CUDA_KERNEL, or the plan refused the sizes)")
    out = []
    for clock, kind in zip(clocks, kinds):
        t = phase_table(clock, int(kind))
        t.update(case=case[0], dtype=str(dtype).replace("torch.", ""))
        out.append(t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="ulmfit,elmo")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--out", default=None, help="write the tables as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("lstm_phase_clock: needs a CUDA GPU (the kernels' clocks)", file=sys.stderr)
        return 2
    import ctxfast  # noqa: F401  (loads ctxfast._cuda: the ops)
    if not hasattr(torch.ops.ctxfast, "lstm_cuda_phase_clock"):
        print("lstm_phase_clock: ctxfast._cuda is not loaded (built without CUDA?)",
              file=sys.stderr)
        return 2
    tables = []
    for key in args.cases.split(","):
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            try:
                got = run_case(key, dtype)
            except RuntimeError as e:             # a refused plan is a result, not a crash
                print(f"{CASES[key][0]} {name}: {e}", flush=True)
                tables.append({"case": CASES[key][0], "dtype": name, "error": str(e)})
                continue
            for t in got:
                print(format_table(f"{t['case']} {t['dtype']}", t), flush=True)
                tables.append(t)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "tables": tables}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
