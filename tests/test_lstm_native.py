"""The C++ LSTM recurrence ops (torch.ops.ctxfast.lstm_recurrence_native and
lstm_recurrence_backward_native, csrc/cpu through ctxfast._C) on CPU tensors, against
ctxfast.reference.lstm_recurrence in float64: forward (out, cells, gates) and every output
of the backward, with and without projection, mask, clips, reverse; odd sizes, T = 1 and
empty inputs; non-contiguous inputs; opcheck; gradcheck; bad inputs.

Non-contiguous inputs are made contiguous by the binding (csrc/bindings/lstm_cpu.cpp).
float16/bfloat16 are computed in float32 by the CPU binding (outputs rounded back)."""
import math
import os
import subprocess
import sys

import pytest
import torch

import ctxfast  # noqa: F401  (registers the fakes and autograd of the native ops)
from ctxfast import reference
from utils import REL_TOL, assert_close, assert_within_2x_eager

NATIVE = hasattr(torch.ops.ctxfast, "lstm_recurrence_native")


@pytest.fixture(autouse=True)
def _needs_native():
    # The extension is always built in CI: a missing op is a failure, not a skip.
    if not NATIVE:
        pytest.fail("ctxfast._C has no lstm_recurrence_native op: rebuild the extension "
                    "(pip install --no-build-isolation -e .)")


def fwd(*args):
    return torch.ops.ctxfast.lstm_recurrence_native(*args)


def bwd(*args):
    return torch.ops.ctxfast.lstm_recurrence_backward_native(*args)


def make_inputs(T, B, H, P, proj, use_mask):
    """Fresh random float64 inputs (callers cast), from the per-test seed of conftest.py.
    Weights ~ U(-3/sqrt(H), 3/sqrt(H)): gates neither saturated nor linear. P is ignored
    (P = H) without projection."""
    P = P if proj else H
    k = 3.0 / math.sqrt(H)

    def u(*shape):
        return (torch.rand(*shape, dtype=torch.float64) * 2 - 1) * k

    xw = torch.randn(T, B, 4 * H, dtype=torch.float64)
    h0 = torch.randn(B, P, dtype=torch.float64) * 0.5
    c0 = torch.randn(B, H, dtype=torch.float64)
    w_hh = u(4 * H, P)
    w_hr = u(P, H) * 2 if proj else None
    mask = (torch.rand(4 * H, P) >= 0.3).to(torch.float64) if use_mask else None
    return xw, h0, c0, w_hh, w_hr, mask


def reference_all(xw, h0, c0, w_hh, w_hr, mask, scale, cc, pc, reverse, grad_out, grad_cells,
                  dtype=torch.float64):
    """Reference forward and the gradients of sum(out*grad_out) + sum(cells*grad_cells)
    w.r.t. xw, h0, c0, w_hh, w_hr (None where w_hr is None), computed in `dtype` (float64:
    the reference; the kernels' dtype: eager's own error, for the 2x-eager rule)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (xw, h0, c0, w_hh)]
    w_hr64 = w_hr.detach().to(dtype).requires_grad_() if w_hr is not None else None
    mask64 = mask.to(dtype) if mask is not None else None
    out, cells, gates = reference.lstm_recurrence(*leaves, w_hr64, mask64, scale, cc, pc, reverse)
    inputs = leaves + ([w_hr64] if w_hr64 is not None else [])
    if out.numel() or cells.numel():
        grads = torch.autograd.grad((out, cells), inputs,
                                    (grad_out.to(dtype), grad_cells.to(dtype)), allow_unused=True)
        grads = [torch.zeros_like(i) if gr is None else gr for gr, i in zip(grads, inputs)]
    else:
        grads = [torch.zeros_like(i) for i in inputs]
    if w_hr64 is None:
        grads.append(None)
    return (out.detach(), cells.detach(), gates.detach()), grads


def check(T, B, H, P, proj, use_mask, cc, pc, reverse, dtype, scale=1.0 / 0.7):
    """The native ops against the float64 reference: float32 by the 2x-eager rule (the
    reference run in float32 gives eager's error; a fixed 1e-5 failed grad_xw at 1.012e-5
    with CTXFAST_TEST_SEED=6), float64 and the half types (computed in float32) within
    their dtype's REL_TOL."""
    xw, h0, c0, w_hh, w_hr, mask = (None if t is None else t.to(dtype) for t in
                                    make_inputs(T, B, H, P, proj, use_mask))
    args = (xw, h0, c0, w_hh, w_hr, mask, scale, cc, pc, reverse)
    out, cells, gates = fwd(*args)
    grad_out = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    grad_cells = torch.randn(cells.shape, dtype=torch.float64).to(dtype)
    (r_out, r_cells, r_gates), r_grads = reference_all(*args, grad_out, grad_cells)
    same = None
    if dtype == torch.float32:
        (s_out, s_cells, s_gates), s_grads = reference_all(*args, grad_out, grad_cells,
                                                           dtype=torch.float32)
        same = [s_out, s_cells, s_gates] + list(s_grads)

    def close(i, name, a, b):
        assert a.dtype == dtype, f"{name}: dtype {a.dtype}"
        if same is None:
            assert_close(a, b, REL_TOL[dtype], name)
        else:
            assert_within_2x_eager(a, same[i], b, FLOOR_F32, name=name)
    for i, (name, a, b) in enumerate((("out", out, r_out), ("cells", cells, r_cells),
                                      ("gates", gates, r_gates))):
        close(i, name, a, b)
    grads = bwd(grad_out, grad_cells, h0, c0, w_hh, w_hr, mask, scale, cc, pc, reverse,
                out, cells, gates)
    names = ("grad_xw", "grad_h0", "grad_c0", "grad_w_hh", "grad_w_hr")
    for i, (name, a, b) in enumerate(zip(names, grads, r_grads)):
        if b is None:
            assert a.shape == (0,), f"{name}: expected an empty [0] tensor, got {tuple(a.shape)}"
            continue
        close(3 + i, name, a, b)
    return out, cells


#: The float32 floor of the 2x-eager rule (tests/test_lstm.py's FLOOR).
FLOOR_F32 = 2e-6


# Cell clip 0.9 and projection clip 0.35 clip a good share of the values at these inputs.
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("proj, use_mask, cc, pc", [
    (False, False, math.inf, math.inf),
    (False, True, 0.9, math.inf),
    (True, False, math.inf, math.inf),
    (True, True, 0.9, 0.35),
], ids=["plain", "mask+cellclip", "proj", "proj+mask+clips"])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_against_reference(dtype, T, proj, use_mask, cc, pc, reverse):
    out, cells = check(T, 3, 13, 5, proj, use_mask, cc, pc, reverse, dtype)
    if cc < math.inf:
        assert (cells.abs() >= cc).any(), "the cell clip was never active: the test is too easy"
    if proj and pc < math.inf:
        assert (out.abs() >= pc).any(), "the projection clip was never active"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_types_compute_in_float32(dtype):
    check(5, 3, 11, 6, True, True, 0.9, 0.35, False, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_types_store_clipped_values_exactly(dtype):
    # A value is stored as the clip rounded to the dtype iff it was clipped (in float32), so
    # the backward's |stored| < clip test is exact; an unclipped value that would round
    # onto the clip is stored one ulp inside (csrc/bindings/lstm_checks.h).
    cc, pc = 0.9, 0.3
    args = [t.to(dtype) for t in make_inputs(6, 8, 16, 8, True, False)[:5]]
    out, cells, _ = fwd(*args, None, 1.0, cc, pc, False)
    out32, cells32, _ = fwd(*(a.float() for a in args), None, 1.0, cc, pc, False)
    for name, y, y32, clip in (("cells", cells, cells32, cc), ("out", out, out32, pc)):
        clip_s = torch.tensor(clip, dtype=dtype).float()
        clipped = y32.abs() >= torch.tensor(clip, dtype=torch.float32)
        assert clipped.any() and (~clipped).any(), f"{name}: clip never or always active"
        assert torch.equal(y.float().abs() >= clip_s, clipped), name
        assert torch.equal(y.float()[clipped].abs(), clip_s.expand(int(clipped.sum()))), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_types_keep_unclipped_cells_off_the_clip(dtype):
    # Cells that are exactly +-clip_s (the clip 0.9 rounded to the dtype, < 0.9 in both) in
    # float32: unclipped, so never stored as +-clip_s (one ulp inside), or the backward would
    # block their gradient. i ~ 0 and f = 1 (pre-activations of size 20-30) make c = c0.
    T, B, H = 1, 4, 16
    clip_s = torch.tensor(0.9, dtype=dtype)
    assert clip_s.float() < 0.9
    xw, h0, _, w_hh, _, _ = make_inputs(T, B, H, H, False, False)
    xw[..., :H] = -(20 + 10 * torch.rand(T, B, H, dtype=torch.float64))
    xw[..., H:2 * H] = 20 + 10 * torch.rand(T, B, H, dtype=torch.float64)
    sign = torch.where(torch.rand(B, H) < 0.5, -1.0, 1.0).to(torch.float64)
    c0 = sign * torch.where(torch.rand(B, H) < 0.75, clip_s.double(), torch.tensor(1.5))
    args = [t.to(dtype) for t in (xw, h0, c0, w_hh)]
    _, cells, _ = fwd(*args, None, None, 1.0, 0.9, math.inf, False)
    _, cells32, _ = fwd(*(a.float() for a in args), None, None, 1.0, 0.9, math.inf, False)
    clipped = cells32.abs() >= 0.9
    assert clipped.any() and (~clipped).any(), "clip never or always active"
    stored_on_clip = cells.float().abs() >= clip_s.float()
    assert torch.equal(stored_on_clip, clipped), (
        f"{int((stored_on_clip & ~clipped).sum())} unclipped cells stored as the clip")


def test_bfloat16_keeps_unclipped_projections_off_the_clip():
    # bfloat16 rounds unclipped outputs in [0.8965, 0.9) onto clip_s = 0.8984 (the clip 0.9
    # rounded): ~0.2% of these outputs, which must be stored one ulp inside.
    args = [t.to(torch.bfloat16) for t in make_inputs(4, 32, 32, 128, True, False)[:5]]
    out, _, _ = fwd(*args, None, 1.0, math.inf, 0.9, False)
    out32, _, _ = fwd(*(a.float() for a in args), None, 1.0, math.inf, 0.9, False)
    clip_s = torch.tensor(0.9, dtype=torch.bfloat16).float()
    clipped = out32.abs() >= 0.9
    onto = (~clipped & (out32.abs().to(torch.bfloat16).float() >= clip_s)).sum()
    assert clipped.any() and onto > 0, "no unclipped output rounds onto the clip"
    stored_on_clip = out.float().abs() >= clip_s
    assert torch.equal(stored_on_clip, clipped), (
        f"{int((stored_on_clip & ~clipped).sum())} unclipped outputs stored as the clip")


def test_larger_odd_sizes_float32():
    # H = 37: the AVX2 cell loops and their scalar tails; 19 and 37 columns: partial panels
    # of the packed GEMM. B = 70 > 64 takes ATen's GEMM instead, except on an AMD CPU with
    # AVX-512 (the AVX-512 kernel, row blocks 12, 12, 12, 12, 11, 11; ATen there under
    # CTXFAST_LSTM_CPU_GEMM=avx2: test_recurrent_gemm_on_the_avx2_kernel) (csrc/cpu/lstm.cpp).
    check(9, 5, 37, 19, True, True, 1.5, 0.8, True, torch.float32)
    check(9, 5, 37, 0, False, False, math.inf, math.inf, False, torch.float32)
    check(3, 70, 9, 5, True, True, 1.5, 0.8, False, torch.float32)
    # batches cut into row tiles of near-equal height (B 8: 4 + 4, B 13: 5 + 5 + 3)
    check(4, 8, 37, 0, False, True, math.inf, math.inf, False, torch.float32)
    check(4, 13, 21, 11, True, False, 1.5, math.inf, True, torch.float32)


def test_cell_loops_split_mid_row_over_threads():
    # B * H = 3000 > the cell loops' grain (2048, csrc/cpu/lstm.cpp): on 2 threads each task
    # starts or ends inside a batch row (element 1500 = row 1, column 500), so a loop that
    # ran to the row's end would apply the activations twice to the shared columns.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check(2, 3, 1000, 0, False, True, 1.5, math.inf, False, torch.float32)
        check(2, 3, 1000, 0, False, False, math.inf, math.inf, True, torch.float64)
    finally:
        torch.set_num_threads(threads)

# The recurrent GEMM's blocks on the AVX-512 kernel (csrc/cpu/tile_avx512.h, pairs of
# 16-column panels, blocks of up to 12 batch rows) where the CPU has AVX-512, else on the
# AVX2 one (6 rows x 16 columns): 4H 16 / P 32 (one full register / two), 4H 48 (a pair and
# a lone panel), P 24 (a pair whose second register is partial), B 1, 12 and 25 (blocks of
# 1, 12, 9 + 8 + 8 rows).
@pytest.mark.parametrize("T, B, H, P", [(3, 12, 4, 32), (3, 25, 12, 24), (2, 1, 12, 0),
                                        (3, 7, 8, 0)])
def test_recurrent_gemm_blocks_float32(T, B, H, P):
    check(T, B, H, P, P > 0, True, math.inf, math.inf, False, torch.float32)


def test_recurrent_gemm_on_the_avx2_kernel():
    """CTXFAST_LSTM_CPU_GEMM=avx2 keeps the recurrent GEMM on the AVX2 kernel where the
    CPU has AVX-512 (read once per process): the odd-size checks pass there too, in a fresh
    process (on a CPU without AVX-512 this is the kernel the rest of the suite runs)."""
    here = os.path.dirname(os.path.abspath(__file__))
    tests = [os.path.join(here, "test_lstm_native.py::" + t) for t in
             ("test_larger_odd_sizes_float32", "test_recurrent_gemm_blocks_float32")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
                         + tests, env=dict(os.environ, CTXFAST_LSTM_CPU_GEMM="avx2"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize("var, value", [("CTXFAST_LSTM_CPU_GEMM", "fast"),
                                        ("CTXFAST_CPU_LINEAR", "mkl")])
def test_bad_settings_are_refused_before_any_kernel(var, value):
    """The native ops refuse an unusable CTXFAST_LSTM_CPU_GEMM / CTXFAST_CPU_LINEAR with a
    ValueError naming the variable and the value (read once: a fresh process), forward and
    backward, not silently the CPU's choice."""
    code = (
        "import torch, ctxfast\n"
        "xw = torch.randn(2, 3, 16); h0 = torch.randn(3, 4); c0 = torch.randn(3, 4)\n"
        "w = torch.randn(16, 4)\n"
        "args = (xw, h0, c0, w, None, None, 1.0, float('inf'), float('inf'), False)\n"
        "try:\n"
        "    torch.ops.ctxfast.lstm_recurrence_native(*args)\n"
        "except ValueError as e:\n"
        f"    assert {var!r} in str(e) and {value!r} in str(e), str(e)\n"
        "    print('refused')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, **{var: value}), timeout=300)
    assert run.returncode == 0 and "refused" in run.stdout, run.stdout + run.stderr[-3000:]


# H 24: the AVX2 cell loops only; H 21: 16 of them and a scalar tail of 5 (tanh_of).
@pytest.mark.parametrize("H", [24, 21])
def test_small_activations_keep_relative_precision(H):
    # Everything near 0 (inputs x 0.01): tanh computed as (1 - e) / (1 + e) would lose
    # ~eps/|x| of relative accuracy there (measured: out 1.3e-6 against eager's 9e-8). Rule
    # of tests/test_attention.py: at most twice the error of the eager reference in float32,
    # plus 1e-7 for the elementwise results; the GEMM outputs (grad_h0, grad_w_hh) get 5e-7
    # for a different summation order (measured 1.8e-7 against eager's 2.7e-8 for grad_h0).
    args64 = [t * 0.01 for t in make_inputs(5, 3, H, 0, False, False)[:4]]
    go64 = torch.randn(5, 3, H, dtype=torch.float64)
    (r_out, r_cells, _), r_grads = reference_all(*args64, None, None, 1.0, math.inf, math.inf,
                                                 False, go64, torch.zeros_like(go64))
    (e_out, e_cells, _), e_grads = reference_all(
        *(a.float() for a in args64), None, None, 1.0, math.inf, math.inf, False, go64.float(),
        torch.zeros(5, 3, H))
    out, cells, gates = fwd(*(a.float() for a in args64), None, None, 1.0, math.inf, math.inf,
                            False)
    grads = bwd(go64.float(), torch.zeros(5, 3, H), *(a.float() for a in args64[1:]), None,
                None, 1.0, math.inf, math.inf, False, out, cells, gates)
    for name, ours, eager, ref in (("out", out, e_out, r_out), ("cells", cells, e_cells, r_cells),
                                   *zip(("grad_xw", "grad_h0", "grad_c0", "grad_w_hh"),
                                        grads[:4], e_grads[:4], r_grads[:4])):
        floor = 5e-7 if name in ("grad_h0", "grad_w_hh") else 1e-7
        assert_within_2x_eager(ours, eager, ref, floor, name=name, min_scale=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_nan_propagates(dtype):
    # H = 16: the vectorised cell loops; a NaN must never be hidden by a clamp or an
    # approximate exp. One NaN pre-activation reaches every later h through the GEMM.
    xw, h0, c0, w_hh, _, _ = (t.to(dtype) if t is not None else None
                              for t in make_inputs(4, 2, 16, 0, False, False))
    xw[1, 0, 3] = math.nan
    for cc in (math.inf, 0.5):
        out, cells, gates = fwd(xw, h0, c0, w_hh, None, None, 1.0, cc, math.inf, False)
        assert torch.isnan(gates[1, 0, 3]) and torch.isnan(cells[1, 0, 3])
        assert torch.isnan(out[1, 0, 3]) and torch.isnan(out[2:, 0]).all()
        assert not torch.isnan(out[0]).any() and not torch.isnan(out[1, 1]).any()


def test_scale_is_not_used_without_mask():
    # As the reference: W = w_hh when mask is None, whatever scale is.
    xw, h0, c0, w_hh, _, _ = make_inputs(4, 2, 6, 0, False, False)
    a = fwd(xw, h0, c0, w_hh, None, None, 1.0, math.inf, math.inf, False)
    b = fwd(xw, h0, c0, w_hh, None, None, 3.0, math.inf, math.inf, False)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    check(4, 2, 6, 0, False, False, math.inf, math.inf, False, torch.float64, scale=3.0)


@pytest.mark.parametrize("T, B", [(0, 3), (4, 0)])
def test_empty(T, B):
    xw, h0, c0, w_hh, w_hr, mask = make_inputs(T, B, 5, 3, True, True)
    out, cells, gates = fwd(xw, h0, c0, w_hh, w_hr, mask, 2.0, 1.0, 1.0, False)
    assert out.shape == (T, B, 3) and cells.shape == (T, B, 5) and gates.shape == (T, B, 20)
    gxw, gh0, gc0, gw_hh, gw_hr = bwd(torch.randn_like(out), torch.randn_like(cells), h0, c0,
                                      w_hh, w_hr, mask, 2.0, 1.0, 1.0, False, out, cells, gates)
    assert gxw.shape == xw.shape and gh0.shape == h0.shape and gc0.shape == c0.shape
    assert gw_hh.shape == w_hh.shape and gw_hr.shape == w_hr.shape
    for gr in (gh0, gc0, gw_hh, gw_hr):
        assert not gr.any(), "a gradient of an empty sequence must be zero"


def test_non_contiguous_inputs():
    T, B, H, P = 6, 3, 9, 4
    xw, h0, c0, w_hh, w_hr, mask = (t.float() for t in make_inputs(T, B, H, P, True, True))
    # Same values, other strides: transposed storage, every other column.
    nc = {
        "xw": xw.transpose(0, 1).contiguous().transpose(0, 1),
        "h0": torch.stack([h0, h0], dim=2)[..., 0],
        "c0": c0.t().contiguous().t(),
        "w_hh": w_hh.t().contiguous().t(),
        "w_hr": torch.stack([w_hr, w_hr], dim=2)[..., 1],
        "mask": mask.t().contiguous().t(),
    }
    assert not any(v.is_contiguous() for v in nc.values())
    args = (0.75 ** -1, 1.0, 0.5, True)
    ref = fwd(xw, h0, c0, w_hh, w_hr, mask, *args)
    ours = fwd(nc["xw"], nc["h0"], nc["c0"], nc["w_hh"], nc["w_hr"], nc["mask"], *args)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    go = torch.randn(T, P, B).transpose(1, 2)                 # [T, B, P], non-contiguous
    gc = torch.randn(B, T, H).transpose(0, 1)                 # [T, B, H]
    out, cells, gates = ref
    g_ref = bwd(go.contiguous(), gc.contiguous(), h0, c0, w_hh, w_hr, mask, *args,
                out, cells, gates)
    g_nc = bwd(go, gc, nc["h0"], nc["c0"], nc["w_hh"], nc["w_hr"], nc["mask"], *args,
               out.transpose(0, 1).contiguous().transpose(0, 1), cells,
               gates.transpose(0, 1).contiguous().transpose(0, 1))
    for a, b in zip(g_nc, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradcheck_through_autograd_registration():
    # Finite differences of the registered op (forward C++ op, backward C++ op) in float64.
    xw, h0, c0, w_hh, w_hr, mask = make_inputs(3, 2, 4, 3, True, True)
    leaves = [t.requires_grad_() for t in (xw, h0, c0, w_hh, w_hr)]

    def f(xw, h0, c0, w_hh, w_hr):
        out, cells, _ = fwd(xw, h0, c0, w_hh, w_hr, mask, 1.25, math.inf, math.inf, True)
        return out, cells

    assert torch.autograd.gradcheck(f, leaves)


def test_opcheck():
    xw, h0, c0, w_hh, w_hr, mask = (t.float() for t in make_inputs(3, 2, 5, 3, True, True))
    args = (xw, h0, c0, w_hh, w_hr, mask, 1.5, 0.9, 0.4, False)
    torch.library.opcheck(torch.ops.ctxfast.lstm_recurrence_native.default,
                          tuple(t.requires_grad_() if isinstance(t, torch.Tensor) and i < 5
                                else t for i, t in enumerate(args)))
    out, cells, gates = (t.detach() for t in fwd(*args))
    torch.library.opcheck(torch.ops.ctxfast.lstm_recurrence_backward_native.default,
                          (torch.randn_like(out), torch.randn_like(cells), h0.detach(),
                           c0.detach(), w_hh.detach(), w_hr.detach(), mask, 1.5, 0.9, 0.4,
                           False, out, cells, gates))
    # Without the optional tensors, reversed.
    xw, h0, c0, w_hh, _, _ = (t.float() if t is not None else None
                              for t in make_inputs(2, 3, 4, 0, False, False))
    torch.library.opcheck(torch.ops.ctxfast.lstm_recurrence_native.default,
                          (xw, h0, c0, w_hh, None, None, 1.0, math.inf, math.inf, True))


# --------------------------------------------------------------------------- bad inputs

def _good():
    xw, h0, c0, w_hh, w_hr, mask = (t.float() for t in make_inputs(3, 2, 5, 4, True, True))
    return dict(xw=xw, h0=h0, c0=c0, w_hh=w_hh, w_hr=w_hr, mask=mask, scale=1.0,
                cell_clip=math.inf, proj_clip=math.inf, reverse=False)


def _call(kw):
    return fwd(*(kw[k] for k in ("xw", "h0", "c0", "w_hh", "w_hr", "mask", "scale",
                                 "cell_clip", "proj_clip", "reverse")))


@pytest.mark.parametrize("change, exc, words", [
    (dict(xw=torch.randn(3, 2, 20)[0]), ValueError, "xw must have shape [T, B, 4H]"),
    (dict(xw=torch.randn(3, 2, 18)), ValueError, "xw must have shape [T, B, 4H]"),
    (dict(w_hh=torch.randn(16, 4)), ValueError, "w_hh must have shape [4H, P]"),
    (dict(w_hr=torch.randn(4, 6)), ValueError, "w_hr must have shape [P, H]"),
    (dict(w_hr=None), ValueError, "without w_hr"),
    (dict(mask=torch.ones(20, 5)), ValueError, "mask must have shape [4H, P]"),
    (dict(h0=torch.randn(2, 5)), ValueError, "h0 must have shape [B, P]"),
    (dict(c0=torch.randn(3, 5)), ValueError, "c0 must have shape [B, H]"),
    (dict(h0=torch.randn(2, 4, dtype=torch.float64)), TypeError, "h0 must have xw's dtype"),
    (dict(mask=torch.ones(20, 4, dtype=torch.bool)), TypeError, "mask must have xw's dtype"),
    (dict(xw=torch.ones(3, 2, 20, dtype=torch.int32)), TypeError, "xw must be float16"),
    (dict(cell_clip=0.0), ValueError, "cell_clip must be > 0"),
    (dict(proj_clip=-1.0), ValueError, "proj_clip must be > 0"),
    (dict(scale=math.nan), ValueError, "scale must be finite"),
    (dict(scale=math.inf), ValueError, "scale must be finite"),
    (dict(cell_clip=math.nan), ValueError, "cell_clip must be > 0"),
    (dict(proj_clip=math.nan), ValueError, "proj_clip must be > 0"),
    # H = 0 with a projection: every other shape agrees, the op would return zeros.
    (dict(xw=torch.randn(3, 2, 0), c0=torch.randn(2, 0), w_hh=torch.randn(0, 4),
          w_hr=torch.randn(4, 0), mask=None), ValueError, "[T, B, 4H] with H >= 1"),
])
def test_bad_inputs_forward(change, exc, words):
    kw = _good()
    kw.update(change)
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        _call(kw)


@pytest.mark.parametrize("which, bad, words", [
    ("grad_out", torch.randn(3, 2, 5), "grad_out must have shape [T, B, P]"),
    ("grad_cells", torch.randn(2, 2, 5), "grad_cells must have shape [T, B, H]"),
    ("out", torch.randn(3, 2, 4, dtype=torch.float64), "out must have gates's dtype"),
    ("cells", torch.randn(3, 2, 4), "cells must have shape [T, B, H]"),
])
def test_bad_inputs_backward(which, bad, words):
    kw = _good()
    out, cells, gates = _call(kw)
    b = dict(grad_out=torch.randn_like(out), grad_cells=torch.randn_like(cells), out=out,
             cells=cells)
    b[which] = bad
    exc = TypeError if "dtype" in words else ValueError
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        bwd(b["grad_out"], b["grad_cells"], kw["h0"], kw["c0"], kw["w_hh"], kw["w_hr"],
            kw["mask"], 1.0, math.inf, math.inf, False, b["out"], b["cells"], gates)
