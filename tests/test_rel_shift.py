"""ctxfast.rel_shift: every backend that runs on CPU against ctxfast.reference.

The shift only moves data, so every backend must match the reference bit for bit in
every dtype (forward and backward).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ctxfast
from ctxfast import reference
from utils import CPU_BACKENDS, assert_close, assert_equal, needs_interpreter

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# [..., Tq, Tk]: Tq = Tk = 1; one row; Tq not a multiple of any block; Tk over one
# Triton block (1024); several leading dims.
SHAPES = [(1, 1), (3, 5), (1, 7), (4, 4), (2, 3, 17, 33), (97, 1025), (2, 2, 3, 9, 11)]


def _loop_shift(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The definition, element by element (slow; tiny shapes only)."""
    Tq, Tk = x.shape[-2:]
    out = torch.zeros_like(x)
    for i in range(Tq):
        s = Tq - 1 - i
        for j in range(Tk):
            src = j - s if inverse else j + s
            if 0 <= src < Tk:
                out[..., i, j] = x[..., i, src]
    return out


# --------------------------------------------------------------------------- reference

@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (2, 4, 4), (2, 5, 9)])
def test_reference_matches_definition(shape):
    x = torch.randn(shape, dtype=torch.float64)
    assert_equal(reference.rel_shift(x), _loop_shift(x), "rel_shift")
    assert_equal(reference.rel_unshift(x), _loop_shift(x, inverse=True), "rel_unshift")


@pytest.mark.parametrize("shape", [(1, 1), (4, 4), (3, 8), (2, 3, 6, 10)])
def test_reference_matches_pad_view_trick_on_causal_region(shape):
    """The original code's pad-and-view agrees where j <= i + mem_len (junk elsewhere)."""
    x = torch.randn(shape, dtype=torch.float64)
    Tq, Tk = shape[-2:]
    causal = torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + (Tk - Tq)
    ours, orig = reference.rel_shift(x), reference.rel_shift_pad_view(x)
    assert_equal(ours[..., causal], orig[..., causal], "causal region")
    assert (ours[..., ~causal] == 0).all()


def test_unshift_is_the_adjoint():
    x, g = torch.randn(2, 5, 9, dtype=torch.float64), torch.randn(2, 5, 9, dtype=torch.float64)
    lhs = (reference.rel_shift(x) * g).sum()
    rhs = (x * reference.rel_unshift(g)).sum()
    assert torch.allclose(lhs, rhs, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- backends

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(backend, dtype, shape):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    out = ctxfast.rel_shift(x, backend=backend)
    assert out.is_contiguous()
    assert_equal(out, reference.rel_shift(x.detach()), "forward")
    g = torch.randn(shape, dtype=dtype)
    (dx,) = torch.autograd.grad(out, x, g)
    assert_equal(dx, reference.rel_unshift(g), "grad x")


def _non_contiguous_inputs():
    base = torch.randn(3, 2, 11, 6)
    yield "transposed", base.transpose(-1, -2)             # [3, 2, 6, 11], stride_k = 11
    yield "sliced", torch.randn(4, 13, 22)[::2, 1::2, ::2]  # [2, 6, 11], every stride odd
    yield "expanded", torch.randn(1, 5, 8).expand(3, 5, 8)  # batch stride 0
    yield "batch-transposed", torch.randn(5, 4, 3, 7).transpose(0, 1)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", list(_non_contiguous_inputs()), ids=lambda c: c[0])
def test_non_contiguous(backend, case):
    _, x = case
    assert not x.is_contiguous()
    x = x.clone().requires_grad_(True) if case[0] != "expanded" else x.requires_grad_(True)
    out = ctxfast.rel_shift(x, backend=backend)
    assert_equal(out, reference.rel_shift(x.detach().contiguous()))
    g = torch.randn(out.shape).transpose(-1, -2).contiguous().transpose(-1, -2)  # strided grad
    (dx,) = torch.autograd.grad(out, x, g)
    assert_equal(dx, reference.rel_unshift(g.contiguous()), "grad x")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", [(0, 3, 5), (2, 0, 4), (0, 0), (3, 0, 0)], ids=str)
def test_empty(backend, shape):
    x = torch.randn(shape, requires_grad=True)
    out = ctxfast.rel_shift(x, backend=backend)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_native_kernel_writes_every_element():
    """Poison the output: the C++ kernel must write zeros, not leave memory alone."""
    for inverse in (False, True):
        x = torch.randn(3, 7, 12)
        out = torch.full_like(x, float("nan"))
        torch.ops.ctxfast.rel_shift_native.out(x, inverse, out=out)
        ref = reference.rel_unshift(x) if inverse else reference.rel_shift(x)
        assert_equal(out, ref, f"inverse={inverse}")


def test_native_out_must_not_overlap_x():
    # the kernels read x while they write out: out = x (or a view overlapping it) raced
    # on the GPU and was an overlapping memcpy on the CPU; refused, x left as it was
    x = torch.randn(2, 5, 9)
    keep = x.clone()
    buf = torch.randn(2 * 5 * 9 + 3)
    for out in (x, buf[:90].view(2, 5, 9)):
        src = x if out is x else buf[3:].view(2, 5, 9)
        before = src.clone()
        with pytest.raises(RuntimeError, match="out must not overlap x"):
            torch.ops.ctxfast.rel_shift_native.out(src, False, out=out)
        assert torch.equal(src, before)
    assert torch.equal(x, keep)
    buf = torch.arange(1.0, 65.0)       # a strided x whose overlap torch cannot tell
    with pytest.raises(RuntimeError, match="out must not overlap x"):
        torch.ops.ctxfast.rel_shift_native.out(buf.as_strided((4, 4), (1, 5)), False,
                                               out=buf[:16].view(4, 4))
    out = torch.empty_like(x)           # apart: still fine
    torch.ops.ctxfast.rel_shift_native.out(x, False, out=out)
    assert_equal(out, reference.rel_shift(x))


def test_native_op_refuses_bad_shapes_itself():
    # the C++ entry point checks its own input (not only ctxfast.rel_shift's Python checks):
    # Tk < Tq, rank < 2 and an out of another shape are refused, for both directions
    for inverse in (False, True):
        for x in (torch.randn(2, 6, 4), torch.randn(5)):
            with pytest.raises(RuntimeError, match="Tk >= Tq|rank >= 2"):
                torch.ops.ctxfast.rel_shift_native(x, inverse)
            with pytest.raises(RuntimeError, match="Tk >= Tq|rank >= 2"):
                torch.ops.ctxfast.rel_shift_native.out(x, inverse, out=torch.empty_like(x))
        with pytest.raises(RuntimeError, match="out must have x's shape"):
            torch.ops.ctxfast.rel_shift_native.out(torch.randn(2, 4, 6), inverse,
                                                   out=torch.empty(2, 4, 7))


@needs_interpreter
def test_triton_kernel_writes_every_element():
    from ctxfast.kernels.rel_shift import rel_shift_backward, rel_shift_forward
    x = torch.randn(3, 7, 1030)  # two column blocks, the second one partial
    for launch, ref in ((rel_shift_forward, reference.rel_shift),
                        (rel_shift_backward, reference.rel_unshift)):
        out = torch.full_like(x, float("nan"))
        launch(x, out=out)
        assert_equal(out, ref(x), launch.__name__)


# --------------------------------------------------------------------------- autograd, registration

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradcheck(backend):
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    f = lambda t: ctxfast.rel_shift(t, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


def test_opcheck_native():
    for inverse in (False, True):
        for x in (torch.randn(2, 3, 5), torch.randn(2, 3, 5, requires_grad=True),
                  torch.randn(6, 4).t()):
            torch.library.opcheck(torch.ops.ctxfast.rel_shift_native.default, (x, inverse))


@needs_interpreter
def test_opcheck_triton():
    for inverse in (False, True):
        for x in (torch.randn(2, 3, 5), torch.randn(2, 3, 5, requires_grad=True)):
            torch.library.opcheck(torch.ops.ctxfast.rel_shift_triton.default, (x, inverse))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()

    def f(x):
        return ctxfast.rel_shift(x * 2, backend=backend).sum(-1)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 4, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = compiled(x)
    ref = reference.rel_shift(x_ref * 2).sum(-1)
    assert_equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert_equal(x.grad, x_ref.grad, "grad x")


def test_torch_compile_inductor_default_backend():
    """The default path (C++ op on CPU) inside an inductor-compiled function."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: ctxfast.rel_shift(x.sin()) + 1, fullgraph=True)
    x = torch.randn(3, 5, 8)
    # inductor's vectorised sin may differ from eager's in the last bit: fp32 tolerance
    assert_close(compiled(x), reference.rel_shift(x.sin()) + 1)


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("x, exc, words", [
    (torch.randn(5), ValueError, ["rank >= 2", "(5,)"]),
    (torch.randn(()), ValueError, ["rank >= 2", "()"]),
    (torch.randn(2, 6, 4), ValueError, ["Tk >= Tq", "(2, 6, 4)", "Tq=6", "Tk=4"]),
    (torch.ones(3, 4, dtype=torch.int64), TypeError, ["float", "torch.int64"]),
    ([[1.0, 2.0]], TypeError, ["torch.Tensor", "list"]),
])
def test_bad_input_raises_before_dispatch(no_dispatch, x, exc, words):
    with pytest.raises(exc) as info:
        ctxfast.rel_shift(x)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


# --------------------------------------------------------------------------- properties

@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=2), tq=st.integers(1, 9),
       extra=st.integers(0, 9), seed=st.integers(0, 2**31 - 1))
def test_property_shift_unshift(lead, tq, extra, seed):
    """unshift(shift(x)) keeps exactly x[i, j] for j >= Tq-1-i; shift(unshift(x)) keeps
    j < Tk-(Tq-1-i); the C++ kernel equals the reference on any shape."""
    tk = tq + extra
    x = torch.randn(*lead, tq, tk, generator=torch.Generator().manual_seed(seed))
    i = torch.arange(tq)[:, None]
    j = torch.arange(tk)[None, :]
    s = tq - 1 - i
    y = ctxfast.rel_shift(x, backend="cpu")
    assert_equal(y, reference.rel_shift(x))
    back = torch.ops.ctxfast.rel_shift_native(y, True)
    assert_equal(back, torch.where(j >= s, x, torch.zeros_like(x)), "unshift(shift(x))")
    fwd = ctxfast.rel_shift(torch.ops.ctxfast.rel_shift_native(x, True), backend="cpu")
    assert_equal(fwd, torch.where(j < tk - s, x, torch.zeros_like(x)), "shift(unshift(x))")
