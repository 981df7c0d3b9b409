"""The CUDA LSTM recurrence ops (torch.ops.ctxfast.lstm_recurrence_native and
lstm_recurrence_backward_native on CUDA tensors, csrc/cuda/lstm.cu through ctxfast._cuda)
against ctxfast.reference.lstm_recurrence in float64: forward and every gradient, on every
path (the persistent cooperative kernels on the CUDA cores and on the tensor cores, and the
per-step kernels, chosen with CTXFAST_LSTM_CUDA_KERNEL), float32 and bfloat16, with and
without projection, mask, clips, reverse. Skipped where no CUDA device is present.

Tolerance: the FlashAttention rule of tests/test_attention.py — the error of the kernel
against float64 is at most twice the error of the eager reference run in the same dtype on
the same GPU, plus a small floor."""
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import ctxfast  # noqa: E402,F401  (fakes and autograd of the native ops)
from ctxfast import reference  # noqa: E402
from test_lstm_native import make_inputs, reference_all  # noqa: E402
from utils import load_benchmark, rel_err  # noqa: E402

FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 1e-3}
PATHS = ["persistent", "persistent_mma", "per_step"]


@pytest.fixture(autouse=True)
def _needs_cuda_op():
    # On a GPU machine the CUDA kernels must be there: missing is a failure, not a skip.
    if not torch._C._dispatch_has_kernel_for_dispatch_key("ctxfast::lstm_recurrence_native",
                                                          "CUDA"):
        pytest.fail("ctxfast._cuda has no CUDA kernel for lstm_recurrence_native "
                    f"(build: {ctxfast._dispatch.build_info()})")


@pytest.fixture
def path(request, monkeypatch):
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", request.param)
    return request.param


def _eager_same_dtype(args, grad_out, grad_cells):
    """The eager reference in the kernels' dtype on the GPU, forward and gradients."""
    xw, h0, c0, w_hh, w_hr, mask, scale, cc, pc, reverse = args
    leaves = [t.detach().clone().requires_grad_() for t in (xw, h0, c0, w_hh)]
    w_hr_l = w_hr.detach().clone().requires_grad_() if w_hr is not None else None
    out, cells, gates = reference.lstm_recurrence(*leaves, w_hr_l, mask, scale, cc, pc, reverse)
    inputs = leaves + ([w_hr_l] if w_hr_l is not None else [])
    grads = list(torch.autograd.grad((out, cells), inputs, (grad_out, grad_cells)))
    if w_hr_l is None:
        grads.append(None)
    return (out.detach(), cells.detach(), gates.detach()), grads


def check_cuda(T, B, H, P, proj, use_mask, cc, pc, reverse, dtype, scale=1.0 / 0.7,
               triton=False):
    """The CUDA C++ ops (or, triton=True, kernels/lstm.py's lstm_forward / lstm_backward,
    which take the same arguments) against float64, within 2x eager's error."""
    if triton:
        from ctxfast.kernels import lstm as klstm
        forward, backward = klstm.lstm_forward, klstm.lstm_backward
    else:
        forward = torch.ops.ctxfast.lstm_recurrence_native
        backward = torch.ops.ctxfast.lstm_recurrence_backward_native
    cpu = make_inputs(T, B, H, P, proj, use_mask)
    args = tuple(None if t is None else t.to("cuda", dtype) for t in cpu) + (scale, cc, pc,
                                                                              reverse)
    out, cells, gates = forward(*args)
    grad_out = torch.randn(out.shape, device="cuda").to(dtype)
    grad_cells = torch.randn(cells.shape, device="cuda").to(dtype)
    grads = backward(grad_out, grad_cells, *args[1:], out, cells, gates)
    ref64, ref64_grads = reference_all(*(a.cpu() if isinstance(a, torch.Tensor) else a
                                         for a in args), grad_out.cpu(), grad_cells.cpu())
    eager, eager_grads = _eager_same_dtype(args, grad_out, grad_cells)
    names = ("out", "cells", "gates", "grad_xw", "grad_h0", "grad_c0", "grad_w_hh", "grad_w_hr")
    for name, ours, r64, e in zip(names, (*(out, cells, gates), *grads),
                                  (*ref64, *ref64_grads), (*eager, *eager_grads)):
        if r64 is None:
            assert ours.shape == (0,), f"{name}: expected an empty [0] tensor"
            continue
        assert ours.dtype == dtype and ours.is_cuda, name
        assert not torch.isnan(ours).any(), f"{name}: NaN"
        err, err_eager = rel_err(ours.cpu(), r64), rel_err(e.cpu(), r64)
        assert err <= 2 * err_eager + FLOOR[dtype], \
            f"{name}: error {err:.3e} > 2 x eager's {err_eager:.3e} + {FLOOR[dtype]:.0e}"
    return out, cells


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("proj, use_mask, cc, pc, reverse", [
    (False, False, math.inf, math.inf, False),
    (False, True, 0.9, math.inf, True),
    (True, True, 0.9, 0.35, False),
    (True, False, math.inf, math.inf, True),
], ids=["plain", "mask+cellclip+rev", "proj+mask+clips", "proj+rev"])
@pytest.mark.parametrize("T, B, H, P", [(1, 3, 13, 5), (9, 37, 61, 27)], ids=["T1", "odd"])
def test_against_reference(path, dtype, T, B, H, P, proj, use_mask, cc, pc, reverse):
    check_cuda(T, B, H, P, proj, use_mask, cc, pc, reverse, dtype)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_ulmfit_size_bf16(path):
    # ULMFiT's hidden size: the masked w_hh slices (4 x 1152 x 1152 bf16) fit on chip.
    check_cuda(6, 16, 1152, 0, False, True, math.inf, math.inf, False, torch.bfloat16)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_elmo_size_bf16(path):
    # ELMo's cell 4096 with projection 512 and clips 3.
    check_cuda(4, 8, 4096, 512, True, True, 3.0, 3.0, True, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("proj, use_mask, cc, pc, reverse", [
    (False, False, math.inf, math.inf, False),
    (False, True, 0.9, math.inf, True),
    (True, True, 0.9, 0.35, False),
], ids=["plain", "mask+cellclip+rev", "proj+mask+clips"])
@pytest.mark.parametrize("T, B, H, P", [(1, 3, 13, 5), (9, 37, 61, 27), (5, 64, 256, 64)],
                         ids=["T1", "odd", "tiles"])
def test_tensor_core_kernels_against_reference(monkeypatch, dtype, T, B, H, P, proj, use_mask,
                                                cc, pc, reverse):
    # The tensor-core persistent kernels: checked on the CPU under the emulator of
    # tests/test_lstm_cuda_emu.py; here on the hardware.
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "persistent_mma")
    check_cuda(T, B, H, P, proj, use_mask, cc, pc, reverse, dtype)


@pytest.mark.parametrize("reduce", ["blocks", "groups"])
@pytest.mark.parametrize("proj", [False, True], ids=["plain", "proj"])
def test_tensor_core_float32_follows_cudnn_tf32(monkeypatch, proj, reduce):
    """torch.backends.cudnn.allow_tf32 on (torch's default, which nn.LSTM reads; the suite
    turns it off, tests/conftest.py): the tensor-core kernels' float32 products are one
    TF32 product each (csrc/bindings/lstm_cuda.cpp rnn_tf32_allowed): forward and every
    gradient within 2x the error of eager with TF32 products (cuBLAS with
    torch.backends.cuda.matmul.allow_tf32) against float64; and further from float64 than
    with the setting off, so the setting reaches the kernels. No clips (TF32's rounding
    is larger than the margin the clip cases keep from their boundary)."""
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "persistent_mma")
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_BWD_REDUCE", reduce)
    T, B, H, P = 9, 37, 61, (27 if proj else 61)
    torch.manual_seed(3)
    exact, _ = check_cuda(T, B, H, P, proj, True, math.inf, math.inf, False, torch.float32)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    torch.manual_seed(3)
    one, _ = check_cuda(T, B, H, P, proj, True, math.inf, math.inf, False, torch.float32)
    torch.manual_seed(3)
    cpu = make_inputs(T, B, H, P, proj, True)                # the same inputs again
    ref64, _ = reference_all(*cpu, 1.0 / 0.7, math.inf, math.inf, False,
                             torch.zeros(T, B, P, dtype=torch.float64),
                             torch.zeros(T, B, H, dtype=torch.float64))
    assert rel_err(one.cpu(), ref64[0]) > 10 * rel_err(exact.cpu(), ref64[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("T, B, H, reverse, use_mask, cc", [
    (1, 3, 13, False, False, math.inf), (9, 37, 61, True, True, 0.9),
    (5, 64, 256, False, True, math.inf), (3, 64, 1152, False, True, math.inf)],
    ids=["T1", "odd", "tiles", "ulmfit"])
@pytest.mark.parametrize("reduce", ["groups", "blocks"])
def test_tensor_core_backward_reductions(monkeypatch, dtype, T, B, H, reverse, use_mask, cc,
                                         reduce):
    # CTXFAST_LSTM_CUDA_BWD_REDUCE=groups (the default): the backward's product on groups x
    # chunks of w_hh (lstm_bwd_mma_grouped_kernel; layers without a projection), checked on
    # the CPU under the emulator; here on the hardware; and "blocks", one partial per block.
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "persistent_mma")
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_BWD_REDUCE", reduce)
    check_cuda(T, B, H, 0, False, use_mask, cc, math.inf, reverse, dtype)


def test_grouped_backward_bad_setting(monkeypatch):
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_BWD_REDUCE", "tree")
    args = [t.to("cuda", torch.float32) for t in make_inputs(2, 2, 4, 0, False, False)[:4]]
    out, cells, gates = torch.ops.ctxfast.lstm_recurrence_native(
        *args, None, None, 1.0, math.inf, math.inf, False)
    with pytest.raises(ValueError, match="CTXFAST_LSTM_CUDA_BWD_REDUCE must be"):
        torch.ops.ctxfast.lstm_recurrence_backward_native(
            torch.ones_like(out), torch.ones_like(cells), args[1], args[2], args[3], None, None,
            1.0, math.inf, math.inf, False, out, cells, gates)


def test_tensor_core_kernels_ulmfit_size(monkeypatch):
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "persistent_mma")
    check_cuda(6, 64, 1152, 0, False, True, math.inf, math.inf, False, torch.bfloat16)
    check_cuda(3, 64, 1152, 0, False, True, math.inf, math.inf, False, torch.float32)


def test_tensor_core_kernels_elmo_size_bf16(monkeypatch):
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "persistent_mma")
    check_cuda(4, 32, 4096, 512, True, True, 3.0, 3.0, True, torch.bfloat16)


def test_tensor_core_kernels_refuse_what_does_not_fit(monkeypatch):
    # ELMo's cell in float32: 4 x 4096 x 512 x 4 B = 33.5 MB of w_hh, more than all SMs hold.
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "persistent_mma")
    args = [t.to("cuda", torch.float32) for t in make_inputs(2, 3, 4096, 512, True, False)[:5]]
    with pytest.raises(RuntimeError, match="persistent kernel cannot run"):
        torch.ops.ctxfast.lstm_recurrence_native(*args, None, 1.0, math.inf, math.inf, False)


def test_auto_falls_back_to_per_step_where_weights_do_not_fit(monkeypatch):
    # 4H x P float32 = 64 MiB: more than any GPU's shared memory in total, so "auto" must
    # take the per-step path (and "persistent" must refuse, never silently fall back).
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "auto")
    check_cuda(3, 4, 2048, 0, False, True, math.inf, math.inf, False, torch.float32)
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "persistent")
    args = [t.to("cuda", torch.float32) for t in make_inputs(3, 4, 2048, 0, False, False)[:4]]
    with pytest.raises(RuntimeError, match="persistent kernel cannot run"):
        torch.ops.ctxfast.lstm_recurrence_native(*args, None, None, 1.0, math.inf, math.inf,
                                                 False)


def test_paths_agree_float32(monkeypatch):
    args = [t.to("cuda", torch.float32) for t in make_inputs(7, 19, 150, 40, True, True)]
    res = {}
    for p in PATHS:
        monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", p)
        res[p] = torch.ops.ctxfast.lstm_recurrence_native(*args, 1.25, 2.0, 1.0, False)
    for p in ("persistent", "persistent_mma"):      # tf32x3: float32-level error
        for a, b in zip(res[p], res["per_step"]):
            assert rel_err(a.cpu(), b.cpu()) < 1e-5, p


def test_bad_inputs_cuda(monkeypatch):
    args = [t.to("cuda") for t in make_inputs(2, 2, 4, 0, False, False)[:4]]  # float64
    with pytest.raises(TypeError, match="float64 runs on the cpu or eager backend"):
        torch.ops.ctxfast.lstm_recurrence_native(*args, None, None, 1.0, math.inf, math.inf,
                                                 False)
    args = [a.float() for a in args]
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "fastest")
    with pytest.raises(ValueError, match="CTXFAST_LSTM_CUDA_KERNEL must be"):
        torch.ops.ctxfast.lstm_recurrence_native(*args, None, None, 1.0, math.inf, math.inf,
                                                 False)
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "auto")
    with pytest.raises(ValueError, match="h0 must be on xw's device"):
        torch.ops.ctxfast.lstm_recurrence_native(args[0], args[1].cpu(), *args[2:], None, None,
                                                 1.0, math.inf, math.inf, False)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_opcheck_cuda(path):
    xw, h0, c0, w_hh, w_hr, mask = (t.to("cuda", torch.float32)
                                    for t in make_inputs(3, 2, 5, 3, True, True))
    torch.library.opcheck(torch.ops.ctxfast.lstm_recurrence_native.default,
                          (xw.requires_grad_(), h0, c0, w_hh.requires_grad_(), w_hr, mask, 1.5,
                           0.9, 0.4, False))
    out, cells, gates = (t.detach() for t in torch.ops.ctxfast.lstm_recurrence_native(
        xw, h0, c0, w_hh, w_hr, mask, 1.5, 0.9, 0.4, False))
    torch.library.opcheck(torch.ops.ctxfast.lstm_recurrence_backward_native.default,
                          (torch.randn_like(out), torch.randn_like(cells), h0, c0,
                           w_hh.detach(), w_hr, mask, 1.5, 0.9, 0.4, False, out, cells, gates))


def test_float64_default_runs_off_the_fp32_cuda_kernel():
    """ctxfast.lstm on float64 CUDA tensors with the default backend runs (Triton), equal to
    the float64 reference; backend="cuda" refuses float64 before launching."""
    T, B, I, H = 5, 3, 7, 11
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float64, generator=g)  # noqa: E731
    args = (mk(T, B, I), None, mk(4 * H, I), mk(4 * H, H), mk(4 * H), mk(4 * H), None)
    out, _ = ctxfast.lstm(*args)
    ref, _ = reference.lstm(*args)
    assert rel_err(out, ref) < 1e-10
    with pytest.raises(ctxfast.BackendUnavailable, match="float64"):
        ctxfast.lstm(*args, backend="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_runs_the_tensor_core_kernels_where_they_fit(monkeypatch, dtype):
    """auto = the tensor-core persistent kernels first (faster than the CUDA-core ones at
    every size the H200 measured): its outputs and gradients are bit for bit those of
    persistent_mma at a size both persistent kernels fit."""
    xw, h0, c0, w_hh, _, mask = make_inputs(6, 5, 48, 0, False, True)   # no projection
    args = [t.to("cuda", dtype) for t in (xw, h0, c0, w_hh, None, mask) if t is not None]
    args.insert(4, None)
    res = {}
    for p in ("auto", "persistent_mma"):
        monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", p)
        out, cells, gates = torch.ops.ctxfast.lstm_recurrence_native(
            *args[:4], None, args[5], 1.25, math.inf, math.inf, False)
        go, gc = torch.ones_like(out), torch.full_like(cells, 0.5)
        grads = torch.ops.ctxfast.lstm_recurrence_backward_native(
            go, gc, args[1], args[2], args[3], None, args[5], 1.25, math.inf, math.inf, False,
            out, cells, gates)
        res[p] = (out, cells, gates, *grads[:4])
    for a, b in zip(res["auto"], res["persistent_mma"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reduce, proj", [("groups", False), ("blocks", False), ("blocks", True)])
def test_phase_clock(monkeypatch, reduce, proj):
    """ctxfast::lstm_cuda_phase_clock (profiling): the clocked call gives the same bits as an
    unclocked one, one clock per tensor-core launch (forward, then the backward that ran),
    and benchmarks/lstm_phase_clock.py reads each: every step's phases in order, adding up
    to the kernel's time."""
    mod = load_benchmark("lstm_phase_clock.py")
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "persistent_mma")
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_BWD_REDUCE", reduce)
    T, B, H, P = 6, 17, 96, (40 if proj else 96)
    cpu = make_inputs(T, B, H, P, proj, True)
    args = tuple(None if t is None else t.to("cuda", torch.bfloat16) for t in cpu) + (
        1.25, math.inf, math.inf, False)
    op = torch.ops.ctxfast

    def call():
        out, cells, gates = op.lstm_recurrence_native(*args)
        g = op.lstm_recurrence_backward_native(
            torch.ones_like(out), torch.ones_like(cells), args[1], args[2], args[3], args[4],
            args[5], 1.25, math.inf, math.inf, False, out, cells, gates)
        return (out, cells, gates) + tuple(g)

    plain = call()
    assert op.lstm_cuda_phase_clock(True) == ([], [])
    try:
        clocked = call()
        torch.cuda.synchronize()
    finally:
        clocks, kinds = op.lstm_cuda_phase_clock(False)
    for a, b in zip(plain, clocked):
        assert torch.equal(a, b)
    assert list(kinds) == [1, 3 if reduce == "groups" and not proj else 2]
    for clock, kind in zip(clocks, kinds):
        assert clock.dtype == torch.int64 and clock.shape[1:] == (T + 1, 6)
        t = mod.phase_table(clock, int(kind))
        assert t["steps"] == T and t["step_us"] > 0
        whole = t["prologue_us"] + T * t["step_us"] + t["tail_us"]
        assert math.isclose(whole, t["total_us"], rel_tol=0.05), t
    call()
    assert op.lstm_cuda_phase_clock(False) == ([], [])   # off: nothing recorded


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tensor_core_forward_ring(monkeypatch, dtype):
    """CTXFAST_LSTM_CUDA_RING (the tensor-core forward's h tiles in flight): 8 (the 16-bit
    default) and 4 (float32's) load the same tiles and add the same products in the same
    order, so their outputs are the same bits, the default's too; anything else is refused
    by name before a launch."""
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_KERNEL", "persistent_mma")
    cpu = make_inputs(5, 40, 160, 160, False, True)
    args = tuple(None if t is None else t.to("cuda", dtype) for t in cpu) + (
        1.25, math.inf, math.inf, False)
    got = {}
    for ring in ("", "8", "4"):
        monkeypatch.setenv("CTXFAST_LSTM_CUDA_RING", ring)
        got[ring] = torch.ops.ctxfast.lstm_recurrence_native(*args)
    for ring in ("8", "4"):
        for a, b in zip(got[""], got[ring]):
            assert torch.equal(a, b), ring
    monkeypatch.setenv("CTXFAST_LSTM_CUDA_RING", "6")
    with pytest.raises(ValueError, match="CTXFAST_LSTM_CUDA_RING"):
        torch.ops.ctxfast.lstm_recurrence_native(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_default_runs_the_triton_forward_and_the_cuda_backward(monkeypatch, dtype):
    """ctxfast.lstm on CUDA tensors with no backend asked for (ctxfast.ops.lstm's
    CUDA_DEFAULT "split"): the Triton forward, then the CUDA C++ backward (the Triton
    backward never runs); its outputs and gradients within 2x eager's error against float64.
    backend="cuda" runs the CUDA forward (the Triton one is not called)."""
    from ctxfast.kernels import lstm as klstm
    calls = []
    real_forward = klstm.lstm_forward
    monkeypatch.setattr(klstm, "lstm_forward",
                        lambda *a, **k: calls.append("triton forward") or real_forward(*a, **k))
    monkeypatch.setattr(klstm, "lstm_backward", lambda *a, **k: calls.append("triton backward"))
    T, B, I, H = 9, 37, 24, 61
    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    base = [mk(T, B, I), mk(B, H), mk(B, H), mk(4 * H, I) * 0.3, mk(4 * H, H) * 0.3,
            mk(4 * H), mk(4 * H)]
    mask = (torch.rand(4 * H, H, device="cuda", generator=g) > 0.2).float()
    kw = dict(weight_mask=mask, weight_dropout=0.2, cell_clip=0.6)
    res = {}
    for name, dt in (("ours", dtype), ("same", dtype), ("ref", torch.float64)):
        leaves = [t.detach().to(dt).requires_grad_() for t in base]
        x, h0, c0, w_ih, w_hh, b_ih, b_hh = leaves
        fn = ctxfast.lstm if name == "ours" else reference.lstm
        out, (h, c) = fn(x, (h0, c0), w_ih, w_hh, b_ih, b_hh, None,
                         **{**kw, "weight_mask": mask.to(dt)})
        grads = torch.autograd.grad((out * out).sum() + c.sum(), leaves)
        res[name] = [out, c, *grads]
    assert calls == ["triton forward"], calls
    for i, (ours, same, ref) in enumerate(zip(res["ours"], res["same"], res["ref"])):
        ref = ref.float()
        err, eager = rel_err(ours.float(), ref), rel_err(same.float(), ref)
        assert err <= 2 * eager + FLOOR[dtype], (i, err, eager)
    calls.clear()
    x = base[0].to(dtype)
    ctxfast.lstm(x, None, *[t.to(dtype) for t in base[3:]], backend="cuda")
    assert calls == []


def test_float32_projection_takes_tf32_as_nn_lstm(monkeypatch):
    """torch's defaults (TF32 for cuDNN's RNNs, not for cuBLAS; the suite turns the first
    off, tests/conftest.py): ctxfast.lstm's float32 input projection and its gradients run
    on the TF32 kernel (kernels/linear.py), as nn.LSTM's GEMMs do: three products, and the
    outputs and gradients within 2x the error of eager with TF32 GEMMs against float64."""
    from ctxfast.kernels import linear as klinear
    calls = []
    real = klinear.matmul
    monkeypatch.setattr(klinear, "matmul",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    T, B, I, H = 7, 33, 200, 96
    g = torch.Generator(device="cuda").manual_seed(2)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    base = [mk(T, B, I), mk(4 * H, I) * I ** -0.5, mk(4 * H, H) * H ** -0.5, mk(4 * H)]
    res = {}
    for name in ("ours", "same", "ref"):
        leaves = [t.detach().to(torch.float64 if name == "ref" else torch.float32)
                  .requires_grad_() for t in base]
        x, w_ih, w_hh, b = leaves
        if name == "same":
            monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
        fn = ctxfast.lstm if name == "ours" else reference.lstm
        out, _ = fn(x, None, w_ih, w_hh, b, None, None)
        res[name] = [out, *torch.autograd.grad((out * out).sum(), leaves)]
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert len(calls) == 3, calls
    for i, (ours, same, ref) in enumerate(zip(res["ours"], res["same"], res["ref"])):
        err, eager = rel_err(ours, ref.float()), rel_err(same, ref.float())
        assert err <= 2 * eager + FLOOR[torch.float32], (i, err, eager)


@pytest.mark.parametrize("proj", [False, True], ids=["plain", "proj"])
def test_float32_weight_gradients_take_tf32_where_nn_lstm_would(monkeypatch, proj):
    """The CUDA backward's float32 weight gradients (grad_w_hh = Σ dzᵀ h_{t-1} · mask ·
    scale, grad_w_hr): TF32 products where torch allows TF32 for cuDNN's RNNs, as nn.LSTM's
    GEMMs (csrc/bindings/lstm_cuda.cpp tf32_gemm, cuBLAS found at run time), exact float32
    where it does not. Against the same sums in float64 from the op's own dz and saved
    tensors: TF32's error with the setting on (and 10x more than with it off, so the
    setting reaches the product), float32's with it off."""
    assert torch.ops.ctxfast.lstm_cuda_tf32_gemm_available(), "cublasGemmEx not found"
    T, B, H, P = 6, 40, 96, (48 if proj else 96)
    xw, h0, c0, w_hh, w_hr, mask = (None if t is None else t.to("cuda", torch.float32)
                                    for t in make_inputs(T, B, H, P, proj, True))
    args = (h0, c0, w_hh, w_hr, mask, 1.25, math.inf, math.inf, False)
    out, cells, gates = torch.ops.ctxfast.lstm_recurrence_native(xw, *args)
    go, gc = torch.randn_like(out), torch.randn_like(cells)
    errs = {}
    for tf32 in (False, True):
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
        gxw, _, _, gw, gw_hr = torch.ops.ctxfast.lstm_recurrence_backward_native(
            go, gc, *args, out, cells, gates)
        h_prev = torch.cat([h0[None], out[:-1]]).double().reshape(T * B, -1)   # [T B, P]
        want = (gxw.double().reshape(T * B, 4 * H).t() @ h_prev) * mask.double() * 1.25
        errs[tf32] = rel_err(gw, want)
        if proj:                             # (its values: the module tests' 2x-eager rule)
            assert gw_hr.shape == (P, H) and torch.isfinite(gw_hr).all()
    assert errs[False] < 1e-5, errs
    assert 1e-5 < errs[True] < 5e-3 and errs[True] > 10 * errs[False], errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("size", ["ulmfit", "elmo"])
def test_triton_backward_split_over_gate_columns(monkeypatch, dtype, size):
    """kernels.lstm.BWD_SPLIT_K at the model sizes (checked on the CPU at small ones under
    the interpreter): ULMFiT's 1152 units (126 product tiles of 64 x 64 outputs x 7 slices
    on an H100/H200) and ELMo's 4096 / 512 with both clips (the reduction phase): forward
    and every gradient within 2x eager's error against float64; the split was taken."""
    from ctxfast.kernels import lstm as klstm
    monkeypatch.setattr(klstm, "BWD_SPLIT_K", True)
    took = []
    real = klstm._bwd_split_config
    monkeypatch.setattr(klstm, "_bwd_split_config",
                        lambda *a: took.append(real(*a)["KSPLIT"]) or real(*a))
    if size == "ulmfit":
        check_cuda(5, 64, 1152, 0, False, True, math.inf, math.inf, False, dtype, triton=True)
    else:
        check_cuda(3, 32, 4096, 512, True, True, 3.0, 3.0, True, dtype, triton=True)
    assert took and all(k > 1 for k in took), took


@pytest.mark.parametrize("size", ["ulmfit", "elmo"])
def test_triton_float32_forward_on_fp16_operands(monkeypatch, size):
    """kernels.lstm.F16_OPERANDS where torch allows TF32 for cuDNN's RNNs: float32 at the
    model sizes, the forward's products on fp16 operands (wgmma at ULMFiT's 64-row batch
    blocks), against eager float32 with TF32 products (cuBLAS's TF32 on: the eager of the
    same precision) and float64, forward and every gradient; further from float64 than with
    TF32 off, so the setting reached the kernel. ELMo's proj clip (50) never bites: TF32's
    rounding would move values across a clip that does."""
    from ctxfast.kernels import lstm as klstm
    monkeypatch.setattr(klstm, "F16_OPERANDS", True)
    took = []
    real = klstm._f16_operands
    monkeypatch.setattr(klstm, "_f16_operands", lambda *a: took.append(real(*a)) or took[-1])
    dims = (5, 64, 1152, 0, False) if size == "ulmfit" else (3, 32, 4096, 512, True)
    pc = math.inf if size == "ulmfit" else 50.0
    torch.manual_seed(4)
    exact, _ = check_cuda(*dims, True, math.inf, pc, False, torch.float32, triton=True)
    assert took and not any(took), took                      # TF32 off (tests/conftest.py)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    torch.manual_seed(4)
    f16, _ = check_cuda(*dims, True, math.inf, pc, False, torch.float32, triton=True)
    assert took[-1], took
    torch.manual_seed(4)
    cpu = make_inputs(dims[0], dims[1], dims[2], dims[3], dims[4], True)
    ref64, _ = reference_all(*cpu, 1.0 / 0.7, math.inf, pc, False,
                             torch.zeros(exact.shape, dtype=torch.float64),
                             torch.zeros(dims[0], dims[1], dims[2], dtype=torch.float64))
    assert rel_err(f16.cpu(), ref64[0]) > 10 * rel_err(exact.cpu(), ref64[0])
