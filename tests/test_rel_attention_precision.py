"""fp32 ctxfast.rel_attention on the tensor cores: the launcher's choice of ``tl.dot``
input precision, and the error of that precision against the 2x-eager rule.

The Triton interpreter computes every fp32 ``tl.dot`` exactly, whatever its
``input_precision``, so the kernels' CPU tests cannot see TF32 rounding. The error claim is
therefore checked on an emulation: the reference's matmuls (forward and backward) replaced
by TF32 products as the GPU does them — operands rounded to TF32 (10 mantissa bits, round to
nearest, ties away: ``cvt.rna.tf32.f32``), exact products, fp32 accumulation; ``tf32x3``
splits each operand into a TF32 head and a TF32 tail and adds three such products."""
import pytest
import torch

import ctxfast
from ctxfast import reference
from test_attention import FLOOR, needs_triton
from test_rel_attention import NAMES, _inputs
from utils import spy_launches

_matmul = torch.matmul


def _tf32(x):
    """x (fp32) rounded to TF32, ties away from zero, as fp32."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def _emulated_matmul(a, b, mode):
    if mode == "tf32":
        return _matmul(_tf32(a), _tf32(b))
    a_hi, b_hi = _tf32(a), _tf32(b)
    a_lo, b_lo = _tf32(a - a_hi), _tf32(b - b_hi)
    return _matmul(a_hi, b_lo) + _matmul(a_lo, b_hi) + _matmul(a_hi, b_hi)


@pytest.fixture
def tf32_flag():
    """set(allowed): torch's allow_tf32 for the test, restored after (cuBLASModule's
    attributes are not plain, monkeypatch cannot save them)."""
    old = torch.backends.cuda.matmul.allow_tf32

    def set_(allowed):
        torch.backends.cuda.matmul.allow_tf32 = allowed
    yield set_
    torch.backends.cuda.matmul.allow_tf32 = old


class _TensorCoreMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, mode):
        ctx.save_for_backward(a, b)
        ctx.mode = mode
        return _emulated_matmul(a, b, mode)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        da = _emulated_matmul(g, b.transpose(-1, -2), ctx.mode).sum_to_size(a.shape)
        db = _emulated_matmul(a.transpose(-1, -2), g, ctx.mode).sum_to_size(b.shape)
        return da, db, None


@needs_triton
@pytest.mark.parametrize("allow_tf32, dtype, want", [
    (False, torch.float32, "tf32x3"), (True, torch.float32, "tf32"),
    (False, torch.float64, "ieee"), (True, torch.float64, "ieee"),
    (False, torch.float16, "tf32"), (False, torch.bfloat16, "tf32")])
def test_dot_precision(tf32_flag, allow_tf32, dtype, want):
    from ctxfast.kernels.rel_attention import dot_precision
    tf32_flag(allow_tf32)
    assert dot_precision(dtype) == want


@needs_triton
@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="torch without the fp32_precision API")
def test_dot_precision_follows_the_new_tf32_api():
    """torch >= 2.9's ``fp32_precision``: after it is set, reading ``allow_tf32`` raises in
    torch 2.13; the choice still follows it."""
    from ctxfast.kernels.rel_attention import dot_precision
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert dot_precision(torch.float32) == "tf32"
        matmul.fp32_precision = "ieee"
        assert dot_precision(torch.float32) == "tf32x3"
    finally:
        matmul.fp32_precision = old


@needs_triton
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_every_kernel_gets_the_precision(monkeypatch, tf32_flag, allow_tf32):
    """The launchers pass the decided precision to all of their kernels (a constexpr)."""
    from ctxfast.kernels import rel_attention as kr
    tf32_flag(allow_tf32)
    names = ["_rel_attn_fwd_kernel", "_rel_attn_bwd_dkdv_kernel", "_rel_attn_bwd_dq_kernel",
             "_rel_attn_bwd_dr_kernel"]
    seen = spy_launches(monkeypatch, kr, names, lambda args, kwargs: kwargs["PRECISION"])
    ts = [t.requires_grad_(True) for t in _inputs(1, 2, 9, 14, 16, 14)]
    ctxfast.rel_attention(*ts, backend="triton").sum().backward()
    assert dict(seen) == {name: "tf32" if allow_tf32 else "tf32x3" for name in names}


@pytest.mark.parametrize("mode, within", [("tf32x3", True), ("tf32", False)])
def test_tf32x3_error_is_within_twice_eager(monkeypatch, mode, within):
    """The reference with its matmuls done as tf32x3 products meets the 2x-eager rule (the
    bound the fp32 kernel tests use) for the output and every gradient; single TF32
    products do not (~1e-3 relative): why fp32 without allow_tf32 takes tf32x3."""
    torch.manual_seed(0)
    B, H, Tq, Tk, D = 2, 2, 24, 40, 32
    ts = [t.cpu() for t in _inputs(B, H, Tq, Tk, D, Tk, seg=True)]
    seg = dict(seg_q=torch.randint(0, 2, (B, Tq)), seg_k=torch.randint(0, 2, (B, Tk)))

    def run(tensors, emulate=None):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        if emulate:
            monkeypatch.setattr(torch, "matmul",
                                lambda a, b: _TensorCoreMatmul.apply(a, b, emulate))
        try:
            out = reference.rel_attention(*leaves[:6], seg_embed=leaves[6], r_s_bias=leaves[7],
                                          window=30, **seg)
        finally:
            monkeypatch.setattr(torch, "matmul", _matmul)
        do = torch.ones_like(out) + 0.5 * torch.sin(torch.arange(out.numel())).view(out.shape)
        return [out] + list(torch.autograd.grad(out, leaves, do.to(out.dtype)))

    emulated, eager, exact = run(ts, mode), run(ts), run([t.double() for t in ts])
    ok = []
    for name, a, e, ref in zip(["out"] + NAMES, emulated, eager, exact):
        err, err_eager = (a.double() - ref).norm().item(), (e.double() - ref).norm().item()
        ok.append(err <= 2 * err_eager + FLOOR[torch.float32] * max(ref.norm().item(), 1.0))
    assert all(ok) if within else not any(ok)


def test_attention_precision_reads_the_new_tf32_api():
    """kernels/_common._precision (the attention kernels' choice) reads torch's TF32 setting
    through fp32_precision where it exists: reading allow_tf32 raises on torch 2.13 once
    the new API has set it."""
    from ctxfast.kernels._common import _precision
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    old = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert _precision(torch.float32) == "tf32"
        matmul.fp32_precision = "ieee"
        assert _precision(torch.float32) == "ieee"
        assert _precision(torch.float64) == "ieee"
    finally:
        matmul.fp32_precision = old
