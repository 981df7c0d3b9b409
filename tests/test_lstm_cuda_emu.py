"""The persistent CUDA LSTM kernels (``csrc/cuda/lstm_kernels.cuh``: CUDA-core and
tensor-core forward and backward) run on the CPU under a CUDA emulator
(``tests/cuda_emu/cuda_emu.h``: one OS thread per CUDA thread; ``__syncthreads``,
``grid.sync()``, shuffles and WMMA as barriers among them), with the launch shapes the CUDA
build computes for a pretend device of a few SMs, against the float64 reference
(``ctxfast.reference.lstm_recurrence`` and autograd through it) with the 2x-eager rule of
``tests/test_lstm.py``.

What this checks without a GPU: the kernels' indexing, padding, tiling, split-K and
grid-wide phases, the tf32x3 split, the clips; WMMA alignment and leading-dimension rules;
that no never-written shared or workspace memory is read (both poisoned with NaN); no
out-of-bounds access (AddressSanitizer). What it cannot: speed, the hardware's memory
model, the tensor cores' own rounding inside an MMA (emulated: exact products, float32 sums
in k order; a tf32 operand must hold a tf32 value). The driver is
``tests/cuda_emu/lstm_emu.cpp``, built here with the host compiler (C++20) and the CUDA
headers (float16/bfloat16 types)."""
from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from torch.utils._python_dispatch import TorchDispatchMode
import torch

from ctxfast.kernels.lstm import _clip_values    # the clips as stored (the bindings' rule)
from test_cuda_bindings import _cuda_include
from test_lstm_native import make_inputs, reference_all
from utils import assert_within_2x_eager, cached_build, load_benchmark

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "cuda_emu"
FLOOR = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# "grouped": the tensor-core forward, the grouped tensor-core backward
KERNEL_CODE = {"fma": 0, "mma": 1, "grouped": 2}
SMEM_LIMIT = 232448          # an H100's opt-in shared memory per block


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    inc = _cuda_include()                        # the toolkit's headers: cuda_bf16.h too
    if cxx is None or inc is None or not (inc / "cuda_bf16.h").exists():
        pytest.skip("needs a C++20 host compiler and the CUDA headers (cuda_bf16.h)")
    exe = tmp_path_factory.mktemp("cuda_emu") / "lstm_emu"
    cmd = [cxx, "-std=c++20", "-O1", "-g", "-pthread", "-fsanitize=address",
           "-fno-omit-frame-pointer", f"-I{ROOT / 'csrc'}", f"-I{EMU}", f"-I{inc}",
           str(EMU / "lstm_emu.cpp"), "-o", str(exe)]
    run = cached_build(cmd, exe, [ROOT / "csrc", EMU], timeout=600)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}"
    return exe


def _inputs(T, B, H, P, *, mask, proj):
    """make_inputs' fresh random float64 inputs and upstream gradients, by name."""
    xw, h0, c0, w_hh, w_hr, m = make_inputs(T, B, H, P, proj, mask)
    return dict(xw=xw, h0=h0, c0=c0, w_hh=w_hh, mask=m, w_hr=w_hr,
                grad_out=torch.randn(T, B, P if proj else H, dtype=torch.float64),
                grad_cells=torch.randn(T, B, H, dtype=torch.float64))


def _run_emu(exe, tmp_path, kernel, dtype, ins, *, reverse, scale, cell_clip, proj_clip,
             sms, backward=True, tf32_one=False):
    T, B, H4 = ins["xw"].shape
    H, P = H4 // 4, ins["h0"].shape[1]
    has_mask, has_w_hr = ins["mask"] is not None, ins["w_hr"] is not None
    _, cs, cb = _clip_values(dtype, 1.0, cell_clip)
    _, ps, pb = _clip_values(dtype, 1.0, proj_clip)
    head = struct.pack("<12i", KERNEL_CODE[kernel], DTYPE_CODE[dtype], T, B, H, P, int(reverse),
                       int(has_mask), sms, int(has_w_hr), int(backward), SMEM_LIMIT)
    head += struct.pack("<8f", scale if has_mask else 1.0, cell_clip, cs, cb, proj_clip, ps,
                        pb, float(tf32_one))
    arrays = [ins["xw"], ins["h0"], ins["c0"], ins["w_hh"]]
    arrays += [ins["mask"]] if has_mask else []
    arrays += [ins["w_hr"]] if has_w_hr else []
    arrays += [ins["grad_out"], ins["grad_cells"]]
    fin, fout = tmp_path / f"{kernel}.in", tmp_path / f"{kernel}.out"
    with open(fin, "wb") as f:
        f.write(head)
        for a in arrays:    # the values the kernels see: rounded to the storage dtype first
            f.write(a.to(dtype).float().numpy().astype("<f4").tobytes())
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    run = subprocess.run([str(exe), str(fin), str(fout)], capture_output=True, text=True,
                         timeout=600, env=env)
    if run.returncode == 3:
        return None, run.stderr.strip()
    assert run.returncode == 0, f"emulated {kernel} kernels failed:\n{run.stderr[-3000:]}"
    raw = fout.read_bytes()
    ok, blocks, threads, units = struct.unpack("<4i", raw[:16])
    vals = torch.from_numpy(np.frombuffer(raw[16:], dtype="<f4").copy())
    shapes = [("out", (T, B, P)), ("cells", (T, B, H)), ("gates", (T, B, 4 * H)), ("c_T", (B, H))]
    if backward:
        shapes += [("dxw", (T, B, 4 * H)), ("dh0", (B, P)), ("dc0", (B, H))]
    if backward and has_w_hr:     # the binding's dL/dw_hr = sum_t dh_in_tᵀ hp_t
        shapes += [("hp", (T, B, H)), ("dh_in", (T, B, P))]
    res, off = {"blocks": blocks, "threads": threads, "units": units}, 0
    for name, shape in shapes:
        n = math.prod(shape)
        res[name] = vals[off:off + n].reshape(shape)
        off += n
    assert off == vals.numel()
    return res, None


def _reference(ins, dtype, *, reverse, scale, cell_clip, proj_clip):
    """reference_all in `dtype`: out, cells, gates, c_T and the gradients of xw, h0, c0 and
    (None without a projection) w_hr."""
    (out, cells, gates), grads = reference_all(
        ins["xw"], ins["h0"], ins["c0"], ins["w_hh"], ins["w_hr"], ins["mask"], scale,
        cell_clip, proj_clip, reverse, ins["grad_out"], ins["grad_cells"], dtype=dtype)
    return dict(out=out, cells=cells, gates=gates, c_T=cells[0] if reverse else cells[-1],
                dxw=grads[0], dh0=grads[1], dc0=grads[2], dw_hr=grads[4])


def _grad_w_hr(got, dtype):
    """dL/dw_hr [P, H] as the binding forms it from the backward kernels' workspaces: dh_in
    and hp rounded to the storage dtype, then sum_t dh_in_tᵀ hp_t (float32 accumulation;
    here in float64)."""
    dh_in, hp = (got[k].to(dtype).double() for k in ("dh_in", "hp"))
    return torch.einsum("tbp,tbh->ph", dh_in, hp)


def _preclip(ins, ref, reverse):
    """The values the clips compare, from a reference run: the cell before its clip
    (f c_{t-1} + i g) and, with a projection, h before its clip (o tanh(c) @ w_hrᵀ)."""
    gates, cells = ref["gates"], ref["cells"]
    H = cells.shape[2]
    i, f, g, o = gates.split(H, dim=2)
    prev = torch.cat([cells[1:], ins["c0"][None]]) if reverse else \
        torch.cat([ins["c0"][None], cells[:-1]])
    v = f * prev + i * g
    y = (o * torch.tanh(cells)) @ ins["w_hr"].t() if ins["w_hr"] is not None else None
    return v, y


def _gap_clips(values, n=24):
    """Candidate clips that bite (between the 50th and 90th percentiles of |values|), in
    the widest relative gaps between those values, widest first."""
    a = values.abs().flatten().sort().values
    lo, hi = int(0.5 * a.numel()), int(0.9 * a.numel())
    mids = (a[lo + 1:hi] + a[lo:hi - 1]) / 2
    gaps = (a[lo + 1:hi] - a[lo:hi - 1]) / mids
    return [float(mids[i]) for i in gaps.argsort(descending=True)[:n]]


def _margin(values, clip):
    """The smallest relative distance of |values| from the clip (1 without a clip)."""
    if values is None or math.isinf(clip):
        return 1.0
    return float(((values.abs() - clip).abs() / clip).min())


def _clips_off_the_boundary(ins, reverse, scale, proj):
    """(cell_clip, proj_clip) for inputs `ins` that clip some values (and with a projection
    some outputs) but leave every clipped quantity at least 0.5% from its clip in the
    float64 reference, clipping included. A value within rounding of a clip gets a gradient
    of 0 or of its full size depending on its last bit, in eager at 16 bits as in any
    kernel, so the 2x-eager rule cannot judge it; the clips' code paths are exercised all
    the same (values on both sides)."""
    run = functools.partial(_reference, ins, torch.float64, reverse=reverse, scale=scale)

    def margin(cc, pc):
        v, y = _preclip(ins, run(cell_clip=cc, proj_clip=pc), reverse)
        return min(_margin(v, cc), _margin(y, pc))

    v0, _ = _preclip(ins, run(cell_clip=math.inf, proj_clip=math.inf), reverse)
    cc = max(_gap_clips(v0), key=lambda c: margin(c, math.inf))
    pc = math.inf
    if proj:
        _, y0 = _preclip(ins, run(cell_clip=cc, proj_clip=math.inf), reverse)
        pc = max(_gap_clips(y0), key=lambda c: margin(cc, c))
    assert margin(cc, pc) > 0.005, f"no clips 0.5% off every value ({margin(cc, pc):.2g})"
    v, y = _preclip(ins, run(cell_clip=cc, proj_clip=pc), reverse)
    assert (v.abs() > cc).any() and (not proj or (y.abs() > pc).any()), "the clips must bite"
    return cc, pc


def _tf32(x):
    """x (float32) rounded to TF32 as ``cvt.rna.tf32.f32`` (and the emulator) rounds it:
    to nearest, ties away from zero, 10 mantissa bits."""
    i = x.contiguous().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32)


class _TF32Products(TorchDispatchMode):
    """Every float32 matrix product (mm, addmm, bmm, baddbmm: the forward's and autograd's)
    with its two operands rounded to TF32 first and float32 sums: eager as cuBLAS / cuDNN
    compute it where torch allows TF32."""
    PAIRS = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.bmm.default: (0, 1),
             torch.ops.aten.addmm.default: (1, 2), torch.ops.aten.baddbmm.default: (1, 2)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        pair = self.PAIRS.get(func)
        if pair is not None and args[pair[0]].dtype == torch.float32:
            args = list(args)
            for i in pair:
                args[i] = _tf32(args[i])
        return func(*args, **(kwargs or {}))


def _check(exe, tmp_path, kernel, dtype, T, B, H, P, *, mask=True, proj=False, reverse=False,
           clips=False, sms=3, expect_blocks=None, drop=None, tf32_one=False, draws=1):
    """Run the kernels on fresh inputs and compare every output and gradient with the
    reference (2x-eager rule); clips=True: a cell clip (and a projection clip) that bite,
    chosen off the values (_clips_off_the_boundary); with a projection also dL/dw_hr as the
    binding forms it from the kernels' dh_in and hp (_grad_w_hr). tf32_one: the kernels' float32
    products as one TF32 product each, and eager with TF32 products (_TF32Products).
    draws: the rule on that many draws of inputs together (each error the norm over all of
    them: a root-mean-square), where one draw's ratio to eager's error is too noisy to
    test. Returns the first draw's results."""
    runs = []
    for _ in range(draws):
        ins = _inputs(T, B, H, P, mask=mask, proj=proj)
        if drop is not None:                   # drop(mask) zeroes the rows it chooses
            drop(ins["mask"])
        ins = {k: (None if v is None else v.to(dtype).double()) for k, v in ins.items()}
        scale = 1 / 0.7 if mask else 1.0
        cell_clip, proj_clip = (_clips_off_the_boundary(ins, reverse, scale, proj) if clips
                                else (math.inf, math.inf))
        kw = dict(reverse=reverse, scale=scale, cell_clip=cell_clip, proj_clip=proj_clip)
        got, refused = _run_emu(exe, tmp_path, kernel, dtype, ins, sms=sms, tf32_one=tf32_one,
                                **kw)
        assert refused is None, refused
        if expect_blocks is not None:
            assert got["blocks"] == expect_blocks, got
        ref = _reference(ins, torch.float64, **kw)
        with _TF32Products() if tf32_one else contextlib.nullcontext():
            same = _reference(ins, dtype, **kw)
        runs.append((got, same, ref))
    names = ("out", "cells", "gates", "c_T", "dxw", "dh0", "dc0")
    if proj:
        names += ("dw_hr",)
        for run in runs:
            run[0]["dw_hr"] = _grad_w_hr(run[0], dtype)
    for name in names:
        ours, same, ref = (torch.cat([run[i][name].flatten() for run in runs])
                           for i in range(3))
        assert_within_2x_eager(ours, same, ref, FLOOR[dtype], name=f"{kernel} {dtype} {name}")
    return runs[0][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_persistent_kernels_against_reference(emulator, tmp_path, kernel, dtype):
    """Several blocks (H 20 over 3 SMs: the last block's units fewer), B and P not multiples
    of the tiles, mask and scale, a cell clip that bites, four steps."""
    got = _check(emulator, tmp_path, kernel, dtype, T=4, B=5, H=20, P=20, clips=True)
    assert got["blocks"] >= 2


@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_reverse_and_no_mask(emulator, tmp_path, kernel):
    _check(emulator, tmp_path, kernel, torch.float32, T=3, B=3, H=12, P=12, mask=False,
           reverse=True, sms=2)


@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_one_step_one_row(emulator, tmp_path, kernel):
    _check(emulator, tmp_path, kernel, torch.bfloat16, T=1, B=1, H=9, P=9, sms=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_core_row_tiles_that_overlap(emulator, tmp_path, dtype):
    """4U not a multiple of 16: H 18 over 2 SMs gives U 9 (36 rows: tiles at rows 0, 16 and
    20, the last overlapping; float32 stores 40 weight rows, so a tile at row 32 would run
    past them); H 20 over 3 SMs U 7 (28 rows); H 10 over 4 SMs U 3 (12 rows, one tile
    reading 4 zero rows) and a last block of one unit."""
    got = _check(emulator, tmp_path, "mma", dtype, T=3, B=6, H=18, P=18, sms=2)
    assert got["units"] == 9
    got = _check(emulator, tmp_path, "mma", dtype, T=3, B=6, H=20, P=20, sms=3)
    assert got["units"] == 7
    got = _check(emulator, tmp_path, "mma", dtype, T=3, B=6, H=10, P=10, sms=4)
    assert got["units"] == 3 and got["blocks"] == 4


def _shapes(exe, tmp_path, kernel, dtype, T, B, H, P, sms):
    """The launch shapes (forward, backward) the CUDA build computes: dicts of ok, blocks,
    threads, units, smem, ksplit, groups, chunks."""
    head = struct.pack("<12i", KERNEL_CODE[kernel], DTYPE_CODE[dtype], T, B, H, P, 0, 1, sms,
                       int(P != H), -1, SMEM_LIMIT) + struct.pack("<8f", *([1.0] * 8))
    fin, fout = tmp_path / "shape.in", tmp_path / "shape.out"
    fin.write_bytes(head)
    run = subprocess.run([str(exe), str(fin), str(fout)], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, ASAN_OPTIONS="detect_leaks=0"))
    assert run.returncode == 0, run.stderr
    vals = struct.unpack("<16i", fout.read_bytes())
    keys = ("ok", "blocks", "threads", "units", "smem", "ksplit", "groups", "chunks")
    return dict(zip(keys, vals[:8])), dict(zip(keys, vals[8:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_core_plans_at_the_benchmark_sizes(emulator, tmp_path, dtype):
    """On an H100/H200 (132 SMs, 227 KiB of shared memory per block): the ULMFiT layer
    (H 1152, B 64) runs persistent on the tensor cores in float32 too (U 9: 36 weight rows
    per block, no padding to 48), AWD-LSTM's 1150 likewise; ELMo's cell (H 4096, P 512,
    B 32) in bfloat16 only (float32: 33.5 MB of w_hh, more than all the shared memory);
    H 4608 (U 35) is refused."""
    for H in (1152, 1150):
        fwd, bwd = _shapes(emulator, tmp_path, "mma", dtype, 70, 64, H, H, 132)
        assert fwd["ok"] and bwd["ok"], (fwd, bwd)
        assert fwd["units"] == 9 and fwd["blocks"] == 128 and fwd["smem"] <= SMEM_LIMIT
    fwd, bwd = _shapes(emulator, tmp_path, "mma", dtype, 50, 32, 4096, 512, 132)
    assert (fwd["ok"] and bwd["ok"]) == (dtype == torch.bfloat16), (fwd, bwd)
    fwd, _ = _shapes(emulator, tmp_path, "mma", dtype, 70, 64, 4608, 4608, 132)
    assert not fwd["ok"]


@pytest.mark.parametrize("ring", [8, 4])
@pytest.mark.parametrize("dtype, P", [(torch.float32, 72), (torch.bfloat16, 176)],
                         ids=["float32", "bfloat16"])
def test_tensor_core_forward_ring_of_h_tiles(emulator, tmp_path, monkeypatch, dtype, P, ring):
    """Enough K steps per warp (10 and 11: B 129 gives 9 batch tiles, more than the 8
    warps, so one K slice; K = P, the projection's width) that the forward's ring of h tiles
    (LstmDims::ring: 8, the default, or 4) wraps and ends part-way through a round; the
    other tests run the default ring with fewer K steps than it holds."""
    monkeypatch.setenv("LSTM_EMU_RING", str(ring))
    _check(emulator, tmp_path, "mma", dtype, T=2, B=129, H=16, P=P, proj=True, sms=2)


@pytest.mark.parametrize("kernel", ["mma", "grouped"])
def test_tensor_core_cell_phases_take_several_pairs_a_thread(emulator, tmp_path, kernel):
    """One block (H 20 on one SM: 20 units) and B 70: 1,400 (batch row, unit) pairs for 256
    threads, so a thread's cell phase loads kCellBatch (4) pairs at once and goes round
    twice, the second time part-full."""
    got = _check(emulator, tmp_path, kernel, torch.bfloat16, T=3, B=70, H=20, P=20, sms=1)
    assert got["blocks"] == 1 and got["units"] == 20


def test_tensor_core_kernels_with_batch_tiles_and_k_slices(emulator, tmp_path):
    """B 33: three 16-row batch tiles (the last mostly padding); P 40: K padded to 48, so
    the forward splits K between warps (ksplit > 1) and sums the slices."""
    _check(emulator, tmp_path, "mma", torch.bfloat16, T=2, B=33, H=40, P=40, sms=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_projection_and_clips(emulator, tmp_path, kernel, dtype):
    """ELMo's cell: a projection P < H and both clips biting, mask, several blocks (the
    tensor-core forward sums per-block partial projections; its backward's dL/dhp is a
    tensor-core product with K sliced over the warps)."""
    _check(emulator, tmp_path, kernel, dtype, T=3, B=4, H=20, P=12, proj=True,
           clips=True, sms=3)


def test_projection_reverse_without_mask(emulator, tmp_path):
    _check(emulator, tmp_path, "mma", torch.float32, T=2, B=17, H=9, P=24, proj=True,
           mask=False, reverse=True, sms=2)


@pytest.mark.parametrize("kernel, tf32_one", [("fma", False), ("mma", False),
                                              ("grouped", False), ("mma", True),
                                              ("grouped", True)])
def test_dropped_units_and_everything_dropped(emulator, tmp_path, kernel, tf32_one):
    """DropConnect masks that drop whole rows: every gate row of units 0-4 (the first
    block's units: its weight slice all zero) and every row of gate g; then a mask that
    drops everything (W = 0: only xw drives the cell). No NaN, same results as eager (with
    tf32_one: as eager with TF32 products)."""
    def rows(m):
        H = m.shape[0] // 4
        for g in range(4):
            m[g * H:g * H + 5] = 0
        m[2 * H:3 * H] = 0

    def everything(m):
        m.zero_()
    for drop in (rows, everything):
        _check(emulator, tmp_path, kernel, torch.float32, T=3, B=5, H=15, P=15, sms=3,
               drop=drop, tf32_one=tf32_one)


# ------------------------------------------------------------ the grouped backward

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_backward_against_reference(emulator, tmp_path, dtype):
    """The grouped tensor-core backward (a 2-D distribution of w_hh for dL/dh's product):
    H 40 over 10 SMs in groups x chunks that the plan picks (4 x 2 in float32, 3 x 3 in
    16 bits: a short last group, chunks padded to 16 or 32 columns), B 5, mask and scale, a
    cell clip that bites, three steps; forward and every gradient against the reference."""
    fwd, bwd = _shapes(emulator, tmp_path, "grouped", dtype, 3, 5, 40, 40, 10)
    assert bwd["ok"] and bwd["groups"] > 1 and bwd["chunks"] > 1, bwd
    assert bwd["groups"] * bwd["chunks"] <= bwd["blocks"] == 10
    _check(emulator, tmp_path, "grouped", dtype, T=3, B=5, H=40, P=40, clips=True, sms=10)


@pytest.mark.parametrize("kernel", ["mma", "grouped"])
def test_tensor_core_float32_one_tf32_product(emulator, tmp_path, kernel):
    """LstmDims::tf32_one (float32 on the tensor cores as one TF32 product per MMA, as
    cuDNN's RNNs where torch allows TF32): every output and gradient within 2x the error
    of eager with TF32 products (each float32 product's operands rounded to TF32) against
    float64, with the projection (mma) or the grouped backward, several blocks; and the
    mode reaches the kernels: its outputs are further from float64 than the tf32x3 run's
    on the same inputs by orders of magnitude. No clips here: TF32's rounding (~1e-3) is
    larger than the 0.5% margin _clips_off_the_boundary keeps, so a value may land on
    either side of a clip in ours and in eager (the clip code is the same in both modes
    and tested with tf32x3). Ratios to eager's error seen without clips: 0.4-1.8 over 24
    draws, and 2.2 (dh0, 60 values) with CTXFAST_TEST_SEED=3: two TF32 roundings of the
    same products are two samples of one error, so the rule is taken over 4 draws."""
    if kernel == "mma":
        _check(emulator, tmp_path, "mma", torch.float32, T=3, B=5, H=20, P=12, proj=True,
               sms=3, tf32_one=True, draws=4)
    else:
        _check(emulator, tmp_path, "grouped", torch.float32, T=3, B=5, H=40, P=40, sms=10,
               tf32_one=True, draws=4)
    torch.manual_seed(1)
    ins = {k: (None if v is None else v.float().double())
           for k, v in _inputs(3, 5, 20, 20, mask=True, proj=False).items()}
    kw = dict(reverse=False, scale=1 / 0.7, cell_clip=math.inf, proj_clip=math.inf, sms=3)
    one, _ = _run_emu(emulator, tmp_path, kernel, torch.float32, ins, tf32_one=True, **kw)
    three, _ = _run_emu(emulator, tmp_path, kernel, torch.float32, ins, **kw)
    ref = _reference(ins, torch.float64, **{k: v for k, v in kw.items() if k != "sms"})
    for name in ("out", "dxw"):
        err_one = (one[name].double() - ref[name]).norm()
        err_three = (three[name].double() - ref[name]).norm()
        assert err_one > 30 * err_three, (name, err_one.item(), err_three.item())


@pytest.mark.parametrize("sms", [1, 2, 5])
def test_grouped_backward_shapes(emulator, tmp_path, sms):
    """One block (one group, one chunk; H 30: the forward takes at most 32 units a block),
    and 2 and 5 blocks over odd sizes (H 37, B 17: two batch tiles), reverse, T 1 and B 1,
    no mask."""
    H = 30 if sms == 1 else 37
    _check(emulator, tmp_path, "grouped", torch.bfloat16, T=3, B=17, H=H, P=H, sms=sms,
           reverse=True)
    _check(emulator, tmp_path, "grouped", torch.float32, T=1, B=1, H=9, P=9, sms=sms,
           mask=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_backward_plans(emulator, tmp_path, dtype):
    """At ULMFiT's layer (H 1152, B 64, 132 SMs: 128 blocks) the grouped backward fits in
    both dtypes with a few groups (the partials per element) and its weight tile under the
    limit; with a projection it refuses (the plain tensor-core backward runs there)."""
    _, bwd = _shapes(emulator, tmp_path, "grouped", dtype, 70, 64, 1152, 1152, 132)
    assert bwd["ok"] and bwd["blocks"] == 128 and bwd["smem"] <= SMEM_LIMIT, bwd
    assert 2 <= bwd["groups"] <= 32 and 96 <= bwd["groups"] * bwd["chunks"] <= 128, bwd
    _, bwd = _shapes(emulator, tmp_path, "grouped", dtype, 50, 32, 4096, 512, 132)
    assert not bwd["ok"]


def test_a_wrong_kernel_fails_the_check(emulator, tmp_path, monkeypatch):
    """The comparison can fail: the reference with a different mask scale than the kernels
    ran with is rejected."""
    ins = _inputs(2, 3, 8, 8, mask=True, proj=False)
    got, _ = _run_emu(emulator, tmp_path, "mma", torch.float32, ins, reverse=False, scale=1.5,
                      cell_clip=math.inf, proj_clip=math.inf, sms=2)
    ref = _reference(ins, torch.float64, reverse=False, scale=1.4, cell_clip=math.inf,
                     proj_clip=math.inf)
    same = _reference(ins, torch.float32, reverse=False, scale=1.4, cell_clip=math.inf,
                      proj_clip=math.inf)
    with pytest.raises(AssertionError):
        assert_within_2x_eager(got["out"], same["out"], ref["out"], FLOOR[torch.float32])


def _read_clocks(path):
    """The emulator's LSTM_EMU_CLOCK file: [(kind, int64 [blocks, rows, 6])] in run order."""
    raw, off, out = path.read_bytes(), 0, []
    while off < len(raw):
        kind, blocks, rows = struct.unpack_from("<3i", raw, off)
        off += 12
        n = blocks * rows * 6
        vals = np.frombuffer(raw, dtype="<i8", count=n, offset=off).copy()
        off += 8 * n
        out.append((kind, torch.from_numpy(vals).reshape(blocks, rows, 6)))
    return out


@pytest.mark.parametrize("kernel,proj", [("mma", False), ("mma", True), ("grouped", False)])
def test_phase_clock(emulator, tmp_path, monkeypatch, kernel, proj):
    """The tensor-core kernels' phase clock (LstmDims::phase_clock, read by
    benchmarks/lstm_phase_clock.py): turning it on changes no output bit; every block stamps
    every phase the call has, in order, and nothing else; phase_table's phases add up to the
    kernel's time between its entry and exit stamps."""
    T, H = 3, 20
    ins = _inputs(T, 5, H, 12 if proj else H, mask=True, proj=proj)
    ins = {k: (None if v is None else v.double()) for k, v in ins.items()}
    kw = dict(reverse=False, scale=1.25, cell_clip=math.inf, proj_clip=math.inf, sms=3)
    plain, _ = _run_emu(emulator, tmp_path, kernel, torch.float32, ins, **kw)
    path = tmp_path / "clock.bin"
    monkeypatch.setenv("LSTM_EMU_CLOCK", str(path))
    clocked, _ = _run_emu(emulator, tmp_path, kernel, torch.float32, ins, **kw)
    for name, v in plain.items():
        assert (v == clocked[name]) if isinstance(v, int) else torch.equal(v, clocked[name]), name
    records = _read_clocks(path)
    want_kinds = [1, 3 if kernel == "grouped" else 2]
    assert [k for k, _ in records] == want_kinds
    want = {1: (["products", "cell", "projection products", "projection barrier + sums",
                 "barrier"] if proj else ["products", "cell", "barrier"]),
            2: ((["projection dL/dhp"] if proj else [])
                + ["cell", "products", "barrier", "sums", "barrier (sums)"]),
            3: ["cell", "barrier", "dz staged", "products", "barrier (products)"]}
    mod = load_benchmark("lstm_phase_clock.py")
    for kind, clock in records:
        assert clock.shape[:2] == (plain["blocks"] if kind == 1 else clock.shape[0], T + 1)
        t = mod.phase_table(clock, kind)
        assert [p["phase"] for p in t["phases"]] == want[kind]
        assert t["steps"] == T and t["blocks"] == clock.shape[0]
        assert abs(t["cycles_per_ns"] - 1.0) < 1e-3      # the emulator's clocks are both ns
        whole = t["prologue_us"] + T * t["step_us"] + t["tail_us"]
        assert math.isclose(whole, t["total_us"], rel_tol=1e-3), t
        assert all(p["min_block_us"] <= p["mean_us"] <= p["max_block_us"] for p in t["phases"])
        bad = clock.clone()                              # a stamp out of order is refused
        first = int((clock[0, 2] != 0).nonzero()[0])     # step 2's first phase, before
        bad[0, 2, first] = bad[0, 0, 1] - 1              # the prologue ended
        with pytest.raises(ValueError, match="out of order"):
            mod.phase_table(bad, kind)
    mod.format_table("emulated", mod.phase_table(records[0][1], records[0][0]))


@pytest.mark.parametrize("proj", [False, True], ids=["plain", "proj"])
def test_partial_sums_over_more_blocks_than_one_round(emulator, tmp_path, proj):
    """18 blocks: the per-block backward sums 18 partials per element (and with a
    projection the forward sums 18 of h_t's), past sum_partials' 16 loads a round: a full
    round and a ragged one."""
    _check(emulator, tmp_path, "mma", torch.float32, T=2, B=3, H=36, P=20 if proj else 36,
           proj=proj, sms=18, expect_blocks=18)


@pytest.mark.parametrize("kernel, proj", [("fma", False), ("mma", False), ("mma", True)])
def test_a_nan_input_stays_nan_through_the_clips(emulator, tmp_path, kernel, proj):
    """clamp(NaN) is NaN (torch.clamp, the CPU kernels): CUDA's fminf / fmaxf return the
    other operand, which turned a NaN cell or output into -clip, a finite value that the
    recurrence carried on. One NaN in xw (step 1, batch row 1) must reach out, cells and
    c_T where the reference's NaN are, with a cell and a projection clip set."""
    ins = _inputs(3, 3, 20, 12 if proj else 20, mask=True, proj=proj)
    ins["xw"][1, 1, 0] = float("nan")
    kw = dict(reverse=False, scale=1 / 0.7, cell_clip=0.5, proj_clip=0.2 if proj else math.inf)
    got, refused = _run_emu(exe=emulator, tmp_path=tmp_path, kernel=kernel,
                            dtype=torch.float32, ins=ins, sms=2, backward=False, **kw)
    assert refused is None, refused
    ref = _reference(ins, torch.float64, **kw)
    for name in ("out", "cells", "c_T"):
        want = ref[name].isnan()
        assert want.any() and not want[..., 0, :].any(), name     # the test's premise
        assert torch.equal(got[name].isnan(), want), \
            f"{kernel} {name}: NaN not where the reference's is"


def _onto_the_clip(ins, dtype, scale):
    """(flat index, clip, reference with that cell clip) for one-step inputs `ins`: a cell
    clip 1e-4 (relative) above one cell's |f c0 + i g|, so that the unclipped value rounds
    onto the clip as `dtype` stores it, every other cell at least 0.2% from the clip, and
    that cell's gradient into c0 sizable in the float64 reference."""
    kw = dict(reverse=False, scale=scale, proj_clip=math.inf)
    v, _ = _preclip(ins, _reference(ins, torch.float64, cell_clip=math.inf, **kw), False)
    a = v.abs().flatten()

    def stored(x):
        return float(torch.tensor(float(x), dtype=torch.float32).to(dtype).float())

    for idx in a.argsort(descending=True).tolist():
        clip = float(a[idx]) * (1 + 1e-4)
        clip_s = _clip_values(dtype, 1.0, clip)[1]
        others = torch.cat([a[:idx], a[idx + 1:]])
        if stored(a[idx] * (1 - 1e-5)) != clip_s or stored(a[idx]) != clip_s:
            continue
        if ((others - clip).abs() / clip).min() < 2e-3:
            continue
        ref = _reference(ins, torch.float64, cell_clip=clip, **kw)
        if ref["dc0"].flatten()[idx].abs() > 0.05:
            return idx, clip, ref
    raise AssertionError("no cell to put a clip just above")


@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_an_unclipped_cell_that_rounds_onto_the_clip_keeps_its_gradient(emulator, tmp_path,
                                                                         kernel):
    """bfloat16, one step, a cell clip just above one cell's value (_onto_the_clip): the
    cell is not clipped but rounds onto the stored clip, so the forward stores it one ulp
    inside (store_clipped: clip_below) and the backward, for which |stored| < clip_s means
    unclipped, passes its gradient on to c0 as the float64 reference does. Stored as the
    clip itself, the cell would read as clipped and its gradient would be dropped."""
    dtype = torch.bfloat16
    ins = _inputs(1, 5, 20, 20, mask=True, proj=False)
    ins = {k: (None if v is None else v.to(dtype).double()) for k, v in ins.items()}
    scale = 1 / 0.7
    idx, clip, ref = _onto_the_clip(ins, dtype, scale)
    _, clip_s, below = _clip_values(dtype, 1.0, clip)
    got, refused = _run_emu(emulator, tmp_path, kernel, dtype, ins, reverse=False, scale=scale,
                            cell_clip=clip, proj_clip=math.inf, sms=3)
    assert refused is None, refused
    cell = float(got["cells"].flatten()[idx])
    assert abs(cell) == below != clip_s, \
        f"{kernel}: unclipped cell stored as {cell}, not one ulp inside the clip ({below})"
    want, dc0 = float(ref["dc0"].flatten()[idx]), float(got["dc0"].flatten()[idx])
    assert abs(dc0 - want) <= 0.05 * abs(want), \
        f"{kernel}: dL/dc0 of the cell under the clip {dc0}, reference {want}"


def test_tensor_core_k_slices_of_unequal_length(emulator, tmp_path):
    """float32 with a projection, P 40 (K padded to 48: 6 K steps of 8), B 17 (two batch
    tiles), H 9 over 2 SMs: the forward's product and the backward's dL/dhp split the 6 K
    steps over 4 warps, slices of 1 or 2 steps (a slice ends at (ks + 1) KT / ksplit; one
    that ends at its start + KT / ksplit drops the remainder). The other tests' K splits
    divide K evenly in float32 with a projection."""
    fwd, bwd = _shapes(emulator, tmp_path, "mma", torch.float32, 2, 17, 9, 40, 2)
    kt = 48 // 8
    assert fwd["ksplit"] > 1 and kt % fwd["ksplit"], fwd
    assert bwd["ksplit"] > 1 and kt % bwd["ksplit"], bwd
    _check(emulator, tmp_path, "mma", torch.float32, T=2, B=17, H=9, P=40, proj=True, sms=2)


@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_persistent_grids_fit_the_device(emulator, tmp_path, kernel):
    """A persistent grid is one block per SM, all resident at once (the binding refuses a
    plan whose blocks outnumber what the device holds): blocks <= SMs, and the blocks'
    units cover H with no block left empty, for sizes that do not divide evenly."""
    for H, sms in ((20, 3), (10, 4), (37, 5), (100, 7), (1150, 132)):
        for plan in _shapes(emulator, tmp_path, kernel, torch.float32, 3, 5, H, H, sms):
            assert plan["ok"], (H, sms, plan)
            blocks, units = plan["blocks"], plan["units"]
            assert blocks <= sms, f"{kernel} H {H} on {sms} SMs: {blocks} blocks"
            assert (blocks - 1) * units < H <= blocks * units, (H, sms, plan)


def test_cuda_core_projection_of_a_width_not_a_multiple_of_4(emulator, tmp_path):
    """The CUDA-core forward's projection phase takes w_hr's rows 4 at a time: with P 10 the
    last warp item's rows 10 and 11 do not exist and must not be read (AddressSanitizer
    stops a read past w_hr); the existing projection tests have P 12."""
    _check(emulator, tmp_path, "fma", torch.float32, T=2, B=5, H=12, P=10, proj=True, sms=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_core_projection_over_more_than_16_units_a_block(emulator, tmp_path, dtype):
    """H 40 over 2 SMs: 20 units a block, more than one 16-unit tile: the forward's partial
    projection hp_t . w_hr^T runs over more than one K tile of units and the backward's
    dL/dhp over two column tiles of them (the other projection tests have at most 8 units
    a block)."""
    got = _check(emulator, tmp_path, "mma", dtype, T=2, B=5, H=40, P=24, proj=True, sms=2)
    assert got["units"] == 20, got["units"]
