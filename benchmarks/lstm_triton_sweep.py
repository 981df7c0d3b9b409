"""The Triton LSTM forward's launch configurations, timed side by side on a GPU: the
table's (``kernels/lstm.py`` ``_config``) and each candidate of :data:`CANDIDATES`
(``kernels.lstm.CONFIG_OVERRIDE``), at the benchmark's ULMFiT and ELMo layer sizes, bf16
and float32, DropConnect 0.2. The forward is what ``ctxfast.lstm`` runs on CUDA tensors by
default (``ctxfast.ops.lstm.CUDA_DEFAULT``); the round 5 H200 run found the table's
first guess (ULMFiT: 72 programs of 64 rows x 16 units, BLOCK_K 32, 4 warps, Triton's
default 3 stages) at 0.79 ms in bf16, 2.29 ms in float32.

    python benchmarks/lstm_triton_sweep.py [--quick] [--backward] [--time-budget S]
                                           [--out FILE.json]

``--backward`` times the backward kernels instead (one forward with the table row first;
``kernels.lstm.CONFIG_OVERRIDE`` sets both directions' launches, so a row adopted for one
is checked for the other).

Each candidate's output is compared with the table row's (relative error, the same
inputs): a candidate that disagrees beyond the dtype's bound (another summation order
moves a few ulps; a miscompiled launch moves everything) is reported and never the
winner. Timing: CUDA events, median of ``--reps`` after 2 warm-up calls. On a GPU every
row of a case is compiled first, side by side (``kernels/_tune.py`` ``compile_ahead``, each
row in force on its own thread: the ``"lstm_config"`` row ``kernels.lstm`` reads before
``CONFIG_OVERRIDE``). ``--quick`` on a CPU: tiny sizes under the interpreter, wall-clock
time, the first three candidates and the last (a check that the script runs, not a
timing). The time budget stops starting candidates when spent (and says so); each row
prints as it lands.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from ctxfast.kernels import _tune  # noqa: E402
from ctxfast.kernels import lstm as klstm  # noqa: E402

#: (name, hidden, proj, T, B): the recurrence's sizes (the input projection is not timed)
FULL = [("ULMFiT layer 1152", 1152, 0, 70, 64), ("ELMo layer 4096/512", 4096, 512, 50, 32)]
QUICK = [("tiny", 20, 0, 4, 3), ("tiny proj", 20, 12, 4, 3)]
P_DROP = 0.2

#: Overrides tried after the table's row (keys of ``kernels.lstm.CONFIG_OVERRIDE``), most
#: promising first (the time budget may stop the list). Why deeper pipelines: the table's
#: row keeps 3 stages of (64 x 32 h + 64 x 32 w_hh) bf16 = 24 KB in flight per SM, and at
#: ~1 us of loaded L2 latency that moves ~24 KB/us: the 294 KB a program reads per step
#: take ~12 us, round 5's whole 11.2 us step. These rows keep 64-128 KB in flight. All
#: compile for sm_90 without spills and fit its shared memory (Triton 3.9: 87-164
#: registers, 45-180 KB); 64 x 32 rows (BLOCK_B 32) would leave wgmma for mma.sync. Rows
#: with more tiles than SMs give some programs two tiles a step.
CANDIDATES: List[Dict[str, int]] = [
    {"BLOCK_K": 128, "num_stages": 3, "num_warps": 8}, {"BLOCK_K": 64, "num_stages": 6},
    {"BLOCK_K": 128, "num_stages": 4, "num_warps": 8}, {"BLOCK_K": 64, "num_stages": 4},
    {"BLOCK_K": 128, "num_stages": 3}, {"BLOCK_K": 64}, {"BLOCK_K": 64, "num_warps": 8},
    {"BLOCK_B": 64, "BLOCK_K": 64, "num_stages": 4},          # ELMo's B 32 in a 64-row tile
    {"BLOCK_H": 32, "BLOCK_K": 64, "num_warps": 8}, {"BLOCK_H": 8, "BLOCK_K": 64},
    {"BLOCK_K": 32, "num_stages": 5},
]
#: float32 (one TF32 product; the table: BLOCK_K 16, 8 warps at 64 x 64 tiles, 3 stages of
#: 16 KB): 64-128 KB in flight (sm_90: 83-130 registers, no spill, 64-180 KB)
CANDIDATES_FP32: List[Dict[str, int]] = [
    {"BLOCK_K": 32, "num_stages": 4}, {"BLOCK_K": 64, "num_stages": 3, "num_warps": 8},
    {"BLOCK_K": 32, "num_stages": 6}, {"BLOCK_K": 64, "num_stages": 4, "num_warps": 8},
    {"BLOCK_K": 64, "num_stages": 2}, {"BLOCK_K": 32}, {"BLOCK_K": 16, "num_stages": 5},
    {"BLOCK_H": 32, "BLOCK_K": 32}, {"BLOCK_K": 32, "num_warps": 4},
]
#: --backward, first: the split-K backward (``kernels.lstm.BWD_SPLIT_K``) with its own
#: slice count (KSPLIT 0; ULMFiT: 64-wide tiles of dh̃, 18 of them x 7 slices of the 4,608
#: gate columns = 126 tiles; ELMo: 16 x 8 of 16,384), then at slice counts and output
#: widths around it, then the unsplit kernel's rows above. A tile of B x BLOCK_PS outputs
#: over one slice reads B x 4H/KSPLIT of dz and 4H/KSPLIT x BLOCK_PS of w_hh a step.
#: Its product tiles keep 3 stages of (B x BLOCK_K + BLOCK_K x BLOCK_PS) in flight (24 KB
#: at ULMFiT's bf16 64 x 32 x 64): the rows with deeper K blocks or more stages keep 2-4x
#: that (for no-projection layers BLOCK_K only shapes these tiles). Every row compiles for
#: sm_90 without spills at ULMFiT's bf16 size (Triton 3.9: 86-152 registers; 14 slices of
#: 128 columns at 4 warps spilled 96 B, so that row has 8).
CANDIDATES_SPLIT: List[Dict[str, int]] = [
    {"KSPLIT": 0}, {"KSPLIT": 0, "BLOCK_K": 64, "num_stages": 4},
    {"KSPLIT": 0, "BLOCK_K": 128, "num_warps": 8}, {"KSPLIT": 14, "BLOCK_PS": 128, "num_warps": 8},
    {"KSPLIT": 3, "BLOCK_PS": 32}, {"KSPLIT": 0, "BLOCK_PS": 64},
    {"KSPLIT": 7, "num_stages": 4}, {"KSPLIT": 4}, {"KSPLIT": 7, "BLOCK_K": 64},
    {"KSPLIT": 9, "BLOCK_PS": 128, "num_warps": 8},
]
#: the agreement bound with the table row's output (relative error)
AGREE = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _inputs(H: int, P: int, T: int, B: int, dtype, device):
    Pe = P or H
    g = torch.Generator(device=device).manual_seed(0)

    def r(*s, scale=1.0):
        return (torch.randn(*s, device=device, generator=g) * scale).to(dtype)
    mask = (torch.rand(4 * H, Pe, device=device, generator=g) >= P_DROP).to(dtype)
    return (r(T, B, 4 * H), r(B, Pe), r(B, H), r(4 * H, Pe, scale=Pe ** -0.5),
            r(Pe, H, scale=H ** -0.5) if P else None, mask, 1.0 / (1.0 - P_DROP),
            3.0 if P else float("inf"), 3.0 if P else float("inf"), False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run(quick: bool, reps: int, dtypes: List[str], budget: float,
        backward: bool = False, out_path: Optional[str] = None) -> List[dict]:
    """Every row; as each case and dtype ends, its fastest agreeing row is printed and the
    rows so far are written to `out_path` (a run cut by its timeout keeps them)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    time_ms = _common.median_timer(device, 1 if quick else reps)
    start = time.monotonic()
    rows: List[dict] = []
    for (name, H, P, T, B) in (QUICK if quick else FULL):
        for dt_name in dtypes:
            dtype = getattr(torch, dt_name)
            args = _inputs(H, P, T, B, dtype, device)
            if backward:   # the backward alone, on the table row's forward outputs
                out_, cells_, gates_ = klstm.lstm_forward(*args)
                g = torch.Generator(device=device).manual_seed(1)
                bargs = (torch.randn(out_.shape, generator=g, device=device).to(dtype),
                         torch.randn(cells_.shape, generator=g, device=device).to(dtype),
                         *args[1:3], *args[3:], out_, cells_, gates_)

                def call():
                    return klstm.lstm_backward(*bargs)
            else:
                def call():
                    return klstm.lstm_forward(*args)
            cands = CANDIDATES_FP32 if dtype == torch.float32 else CANDIDATES
            if backward:
                cands = CANDIDATES_SPLIT + cands
            if quick:                                 # a check that each kind of row runs
                cands = cands[:3] + cands[-1:]
            if device.type == "cuda":   # every row compiled side by side, before any is timed
                _tune.compile_ahead([{"lstm_config": over} for over in [None] + cands], call,
                                    device)
            first = len(rows)
            timed = set()                             # the launches timed for this case
            table_out: Optional[torch.Tensor] = None
            table_ms: Optional[float] = None
            for over in [None] + cands:
                if time.monotonic() - start > budget:
                    print(f"{name} {dt_name} {over}: not run (time budget)", flush=True)
                    rows.append(dict(case=name, dtype=dt_name, override=over,
                                     error="not run: time budget"))
                    continue
                row = dict(case=name, dtype=dt_name, override=over)
                klstm.CONFIG_OVERRIDE = over
                try:
                    cfg, grid, _ = klstm._plan(B, H, P or H, dtype, device)
                    if backward:                      # the split-K backward's constants
                        cfg = {**cfg, **klstm._bwd_split_config(cfg, B, H, P or H, device)}
                    key = json.dumps(cfg, sort_keys=True)
                    if key in timed:                  # the same launch as a row before
                        continue
                    timed.add(key)
                    row.update(config=cfg, programs=grid)
                    out = call()[0]                   # out, or grad_xw (backward)
                    ms = time_ms(call)
                except (RuntimeError, ValueError, OutOfResources, CompilationError) as e:
                    # a row that cannot compile or launch here says why; the sweep goes on
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    print(f"{name} {dt_name} {over}: {row['error']}", flush=True)
                    rows.append(row)
                    continue
                finally:
                    klstm.CONFIG_OVERRIDE = None
                if over is None:
                    table_out, table_ms = out, ms
                gap = _rel(out, table_out) if table_out is not None else 0.0
                row.update(direction="bwd" if backward else "fwd", ms=round(ms, 4), gap=gap,
                           agrees=gap <= AGREE[dtype],
                           vs_table=round(table_ms / ms, 3) if table_ms else None)
                rows.append(row)
                print(f"{name:20s} {dt_name:9s} {str(over or 'table'):62s} {grid!s:>4} progs "
                      f"{row['direction']} {ms:8.3f} ms ({row['vs_table']}x)"
                      f"{'' if row['agrees'] else f'  DISAGREES (gap {gap:.2g})'}", flush=True)
            agreeing = [r for r in rows[first:] if r.get("agrees")]
            if agreeing:
                r = min(agreeing, key=lambda r: r["ms"])
                print(f"fastest {name} {dt_name} {r['direction']}: {r['override'] or 'table'} "
                      f"{r['ms']} ms ({r['vs_table']}x the table)", flush=True)
            _common.write_rows(out_path, rows)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_script_args(ap, reps=10, gpu_dtypes=("bfloat16", "float32"))
    ap.add_argument("--time-budget", type=float, default=120.0)
    ap.add_argument("--backward", action="store_true",
                    help="time the backward kernels (on the table row's forward outputs)")
    args = ap.parse_args(argv)
    dtypes = _common.script_setup(args, "lstm_triton_sweep")
    if dtypes is None:
        return 2
    run(args.quick, args.reps, dtypes, args.time_budget, args.backward, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
