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
in k order, tf32 operands truncated). The driver is ``tests/cuda_emu/lstm_emu.cpp``, built
here with the host compiler (C++20) and the CUDA headers (float16/bfloat16 types)."""
from __future__ import annotations

import math
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ctxfast import reference
from utils import assert_within_2x_eager

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "cuda_emu"
FLOOR = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KERNEL_CODE = {"fma": 0, "mma": 1}
SMEM_LIMIT = 232448          # an H100's opt-in shared memory per block


def _cuda_include() -> Path | None:
    cands = []
    try:
        from torch.utils import cpp_extension
        if cpp_extension.CUDA_HOME:
            cands.append(Path(cpp_extension.CUDA_HOME) / "include")
    except (ImportError, OSError):
        pass
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(Path(os.path.realpath(nvcc)).parent.parent / "include")
    cands.append(Path("/usr/local/cuda/include"))
    return next((c for c in cands if (c / "cuda_bf16.h").exists()), None)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    inc = _cuda_include()
    if cxx is None or inc is None:
        pytest.skip("needs a C++20 host compiler and the CUDA headers (cuda_bf16.h)")
    exe = tmp_path_factory.mktemp("cuda_emu") / "lstm_emu"
    cmd = [cxx, "-std=c++20", "-O1", "-g", "-pthread", "-fsanitize=address",
           "-fno-omit-frame-pointer", f"-I{ROOT / 'csrc'}", f"-I{EMU}", f"-I{inc}",
           str(EMU / "lstm_emu.cpp"), "-o", str(exe)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}"
    return exe


def _storage_clip(clip: float, dtype: torch.dtype) -> tuple:
    """(clip as the kernels compare it, the largest stored value below it): as
    csrc/bindings/lstm_checks.h (storage_clip, clip_below)."""
    if math.isinf(clip):
        return clip, clip
    s = torch.tensor(clip, dtype=torch.float32).to(dtype)
    if dtype == torch.float32:
        return float(s), float(s)
    below = torch.nextafter(s, torch.zeros_like(s))
    return float(s), float(below)


def _inputs(T, B, H, P, *, mask, proj, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, dtype=torch.float64) * scale
    ins = dict(xw=r(T, B, 4 * H), h0=r(B, P, scale=0.5), c0=r(B, H, scale=0.5),
               w_hh=r(4 * H, P, scale=1 / math.sqrt(P)),
               mask=(torch.rand(4 * H, P, generator=g) > 0.3).double() if mask else None,
               w_hr=r(P, H, scale=1 / math.sqrt(H)) if proj else None,
               grad_out=r(T, B, P), grad_cells=r(T, B, H))
    return ins


def _run_emu(exe, tmp_path, kernel, dtype, ins, *, reverse, scale, cell_clip, proj_clip,
             sms, backward=True):
    T, B, H4 = ins["xw"].shape
    H, P = H4 // 4, ins["h0"].shape[1]
    has_mask, has_w_hr = ins["mask"] is not None, ins["w_hr"] is not None
    cs, cb = _storage_clip(cell_clip, dtype)
    ps, pb = _storage_clip(proj_clip, dtype)
    head = struct.pack("<12i", KERNEL_CODE[kernel], DTYPE_CODE[dtype], T, B, H, P, int(reverse),
                       int(has_mask), sms, int(has_w_hr), int(backward), SMEM_LIMIT)
    head += struct.pack("<8f", scale if has_mask else 1.0, cell_clip, cs, cb, proj_clip, ps,
                        pb, 0.0)
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
    res, off = {"blocks": blocks, "threads": threads, "units": units}, 0
    for name, shape in shapes:
        n = math.prod(shape)
        res[name] = vals[off:off + n].reshape(shape)
        off += n
    assert off == vals.numel()
    return res, None


def _reference(ins, dtype, *, reverse, scale, cell_clip, proj_clip):
    """Forward outputs and the gradients of sum(out * grad_out) + sum(cells * grad_cells)
    with respect to xw, h0, c0, computed in `dtype` (eager) from the inputs rounded to the
    kernels' storage dtype `storage`."""
    x = {k: (None if v is None else v.clone().to(dtype)) for k, v in ins.items()}
    for k in ("xw", "h0", "c0"):
        x[k].requires_grad_(True)
    out, cells, gates = reference.lstm_recurrence(
        x["xw"], x["h0"], x["c0"], x["w_hh"], x["w_hr"], x["mask"], scale, cell_clip,
        proj_clip, reverse)
    loss = (out * x["grad_out"]).sum() + (cells * x["grad_cells"]).sum()
    dxw, dh0, dc0 = torch.autograd.grad(loss, (x["xw"], x["h0"], x["c0"]))
    c_T = cells[0] if reverse else cells[-1]
    return dict(out=out, cells=cells, gates=gates, c_T=c_T, dxw=dxw, dh0=dh0, dc0=dc0)


def _check(exe, tmp_path, kernel, dtype, T, B, H, P, *, mask=True, proj=False, reverse=False,
           cell_clip=math.inf, proj_clip=math.inf, sms=3, seed=0, expect_blocks=None):
    ins = _inputs(T, B, H, P, mask=mask, proj=proj, seed=seed)
    ins = {k: (None if v is None else v.to(dtype).double()) for k, v in ins.items()}
    scale = 1 / 0.7 if mask else 1.0
    kw = dict(reverse=reverse, scale=scale, cell_clip=cell_clip, proj_clip=proj_clip)
    got, refused = _run_emu(exe, tmp_path, kernel, dtype, ins, sms=sms, **kw)
    assert refused is None, refused
    if expect_blocks is not None:
        assert got["blocks"] == expect_blocks, got
    ref = _reference(ins, torch.float64, **kw)
    same = _reference(ins, dtype, **kw)
    for name in ("out", "cells", "gates", "c_T", "dxw", "dh0", "dc0"):
        assert_within_2x_eager(got[name], same[name], ref[name], FLOOR[dtype],
                               name=f"{kernel} {dtype} {name}")
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_persistent_kernels_against_reference(emulator, tmp_path, kernel, dtype):
    """Several blocks (H 20 over 3 SMs: the last block's units fewer), B and P not multiples
    of the tiles, mask and scale, a cell clip that bites, four steps."""
    got = _check(emulator, tmp_path, kernel, dtype, T=4, B=5, H=20, P=20, cell_clip=0.6)
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
    threads, units, smem, ksplit."""
    head = struct.pack("<12i", KERNEL_CODE[kernel], DTYPE_CODE[dtype], T, B, H, P, 0, 1, sms,
                       int(P != H), -1, SMEM_LIMIT) + struct.pack("<8f", *([1.0] * 8))
    fin, fout = tmp_path / "shape.in", tmp_path / "shape.out"
    fin.write_bytes(head)
    run = subprocess.run([str(exe), str(fin), str(fout)], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, ASAN_OPTIONS="detect_leaks=0"))
    assert run.returncode == 0, run.stderr
    vals = struct.unpack("<12i", fout.read_bytes())
    keys = ("ok", "blocks", "threads", "units", "smem", "ksplit")
    return dict(zip(keys, vals[:6])), dict(zip(keys, vals[6:]))


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


@pytest.mark.parametrize("dtype, P", [(torch.float32, 72), (torch.bfloat16, 176)],
                         ids=["float32", "bfloat16"])
def test_tensor_core_forward_ring_of_h_tiles(emulator, tmp_path, dtype, P):
    """Enough K steps per warp (10 and 11: B 129 gives 9 batch tiles, more than the 8
    warps, so one K slice; K = P, the projection's width) that the forward's ring of four h
    tiles wraps more than once and ends part-way through a round."""
    _check(emulator, tmp_path, "mma", dtype, T=2, B=129, H=16, P=P, proj=True, sms=2)


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
           cell_clip=0.5, proj_clip=0.3, sms=3)


def test_projection_reverse_without_mask(emulator, tmp_path):
    _check(emulator, tmp_path, "mma", torch.float32, T=2, B=17, H=9, P=24, proj=True,
           mask=False, reverse=True, sms=2)


def test_a_wrong_kernel_fails_the_check(emulator, tmp_path, monkeypatch):
    """The comparison can fail: the reference with a different mask scale than the kernels
    ran with is rejected."""
    ins = _inputs(2, 3, 8, 8, mask=True, proj=False, seed=2)
    got, _ = _run_emu(emulator, tmp_path, "mma", torch.float32, ins, reverse=False, scale=1.5,
                      cell_clip=math.inf, proj_clip=math.inf, sms=2)
    ref = _reference(ins, torch.float64, reverse=False, scale=1.4, cell_clip=math.inf,
                     proj_clip=math.inf)
    same = _reference(ins, torch.float32, reverse=False, scale=1.4, cell_clip=math.inf,
                      proj_clip=math.inf)
    with pytest.raises(AssertionError):
        assert_within_2x_eager(got["out"], same["out"], ref["out"], FLOOR[torch.float32])
