"""ctxfast.rel_shift on a GPU: the CUDA C++ and Triton backends against the reference.
Skipped (with the reason) where no CUDA device is present."""
import pytest
import torch

import ctxfast
from ctxfast import _dispatch, reference
from utils import assert_equal

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

GPU_BACKENDS = ["cuda", "triton"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(1, 1), (3, 5), (2, 3, 17, 33), (97, 1025), (4, 8, 512, 1024), (2, 2, 3, 9, 11)]


@pytest.fixture(params=GPU_BACKENDS)
def backend(request):
    reason = ctxfast.why_unavailable(request.param, "cuda")
    if reason is not None:
        # On a GPU machine both must be there: a missing backend is a failure, not a skip.
        pytest.fail(f"backend {request.param} cannot run on this GPU machine: {reason}")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(backend, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
    out = ctxfast.rel_shift(x, backend=backend)
    assert out.is_cuda and out.is_contiguous()
    assert_equal(out, reference.rel_shift(x.detach()), "forward")
    g = torch.randn(shape, dtype=dtype, device="cuda")
    (dx,) = torch.autograd.grad(out, x, g)
    assert_equal(dx, reference.rel_unshift(g), "grad x")


def test_many_rows_grid_stride(backend):
    """More rows than the CUDA launch's 65536 blocks x 8 warps: the grid-stride loop."""
    x = torch.randn(70000, 8, 9, device="cuda", dtype=torch.float16)
    assert_equal(ctxfast.rel_shift(x, backend=backend), reference.rel_shift(x))


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 2, 11, 6, device="cuda").transpose(-1, -2),
    lambda: torch.randn(4, 13, 22, device="cuda")[::2, 1::2, ::2],
    lambda: torch.randn(1, 5, 8, device="cuda").expand(3, 5, 8),
], ids=["transposed", "sliced", "expanded"])
def test_non_contiguous(backend, make):
    x = make()
    assert_equal(ctxfast.rel_shift(x, backend=backend), reference.rel_shift(x.contiguous()))


@pytest.mark.parametrize("shape", [(0, 3, 5), (2, 0, 4), (0, 0)], ids=str)
def test_empty(backend, shape):
    x = torch.randn(shape, device="cuda", requires_grad=True)
    out = ctxfast.rel_shift(x, backend=backend)
    out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape


@pytest.mark.parametrize("inverse", [False, True])
def test_kernels_write_every_element(inverse):
    from ctxfast.kernels.rel_shift import rel_shift_backward, rel_shift_forward
    x = torch.randn(3, 7, 1030, device="cuda")
    ref = reference.rel_unshift(x) if inverse else reference.rel_shift(x)
    out = torch.full_like(x, float("nan"))
    torch.ops.ctxfast.rel_shift_native.out(x, inverse, out=out)
    assert_equal(out, ref, "cuda")
    out = torch.full_like(x, float("nan"))
    (rel_shift_backward if inverse else rel_shift_forward)(x, out=out)
    assert_equal(out, ref, "triton")


def test_gradcheck(backend):
    x = torch.randn(2, 3, 5, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ctxfast.rel_shift(t, backend=backend), (x,))


def test_opcheck():
    for x in (torch.randn(2, 3, 5, device="cuda"),
              torch.randn(2, 3, 5, device="cuda", requires_grad=True)):
        for inverse in (False, True):
            torch.library.opcheck(torch.ops.ctxfast.rel_shift_native.default, (x, inverse))
            torch.library.opcheck(torch.ops.ctxfast.rel_shift_triton.default, (x, inverse))


def test_default_on_cuda_is_the_cuda_kernel():
    assert _dispatch.resolve("rel_shift", torch.device("cuda")) == "cuda"


def test_torch_compile_inductor(backend):
    torch._dynamo.reset()
    f = torch.compile(lambda x: ctxfast.rel_shift(x * 2, backend=backend) + 1, fullgraph=True)
    x = torch.randn(2, 4, 16, 40, device="cuda", requires_grad=True)
    out = f(x)
    ref = reference.rel_shift(x.detach() * 2) + 1
    assert_equal(out, ref)
    out.sum().backward()
    assert_equal(x.grad, reference.rel_unshift(torch.full_like(out, 2.0)), "grad x")
