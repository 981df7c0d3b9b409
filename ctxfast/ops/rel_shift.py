"""``ctxfast.rel_shift``: the Transformer-XL relative shift as a drop-in autograd op.

Registered ops (all under ``torch.ops.ctxfast``; each has a fake for torch.compile and an
autograd formula — the shift's gradient is the inverse shift, and vice versa, so higher
derivatives work too):

* ``rel_shift_native(Tensor x, bool inverse=False) -> Tensor``: C++; ``csrc/cpu`` on CPU
  tensors (``ctxfast._C``), ``csrc/cuda`` on CUDA tensors (``ctxfast._cuda``). Also an
  ``.out`` overload writing into a given contiguous tensor.
* ``rel_shift_triton(Tensor x, bool inverse=False) -> Tensor``: ``kernels/rel_shift.py``.

The ``eager`` backend is ``ctxfast.reference.rel_shift`` (plain PyTorch autograd).
"""
from typing import Optional

import torch
from torch import Tensor

from .. import _dispatch
from .. import reference as _ref
from ._common import check_float_tensor as _check_float_tensor
from ._common import on_tensor_device as _on_device
from ._common import register_autograd as _register_autograd


# Default backends. CPU: the C++ kernel. Measured 2026-11-21 on the 2-core dev machine
# (AMD EPYC, torch 2.13; benchmarks/results/amd-epyc-2-threads/2026-11-21*.md, two runs,
# x [8, 8, 256, 512] fp32): fwd 11.1-13.4 ms against 38.3-42.1 ms for the eager backend
# (3.1-3.5x) and 20.4-22.0 ms for the original pad-and-view trick (1.6-1.8x, which leaves
# junk); fwd+bwd 31.1 ms against 73.7-91.1 ms (eager) and 34.3-43.9 ms (pad-and-view).
# CUDA: the CUDA C++ kernel, then Triton. NOT yet measured on a GPU (the GPU round,
# benchmarks/gpu_round.sh, decides the order).
_dispatch.register_op(
    "rel_shift",
    supported=("triton", "cuda", "cpu", "eager"),
    cpu_default=("cpu", "eager"),
    cuda_default=("cuda", "triton", "eager"),
)


# --------------------------------------------------------------------------- registration

if _dispatch.c_available():
    @torch.library.register_fake("ctxfast::rel_shift_native")
    def _rel_shift_native_fake(x: Tensor, inverse: bool = False) -> Tensor:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    def _native_setup_context(ctx, inputs, output):
        ctx.inverse = inputs[1] if len(inputs) > 1 else False

    def _native_backward(ctx, grad):
        # through the GradCall (not torch.ops directly): differentiable, and under
        # functorch transforms a Function they accept (the custom op's own autograd kernel
        # has no setup_context)
        return _native(grad, not ctx.inverse), None

    _native = _register_autograd("ctxfast::rel_shift_native", _native_backward,
                                 _native_setup_context)


@torch.library.custom_op("ctxfast::rel_shift_triton", mutates_args=())
@_on_device
def _rel_shift_triton(x: Tensor, inverse: bool = False) -> Tensor:
    from ctxfast.kernels.rel_shift import rel_shift_backward, rel_shift_forward  # imports triton
    return rel_shift_backward(x) if inverse else rel_shift_forward(x)


@_rel_shift_triton.register_fake
def _rel_shift_triton_fake(x: Tensor, inverse: bool = False) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _triton_setup_context(ctx, inputs, output):
    ctx.inverse = inputs[1]


def _triton_backward(ctx, grad):
    return _triton(grad, not ctx.inverse), None          # (as _native_backward)


_triton = _register_autograd(_rel_shift_triton, _triton_backward, _triton_setup_context)


# --------------------------------------------------------------------------- public op

def _check(x: object) -> None:
    _check_float_tensor("rel_shift", "x", x)
    if x.dim() < 2:
        raise ValueError(f"rel_shift: x must have shape [..., Tq, Tk] (rank >= 2), got shape "
                         f"{tuple(x.shape)}")
    if x.shape[-1] < x.shape[-2]:
        raise ValueError(f"rel_shift: x must have shape [..., Tq, Tk] with Tk >= Tq, got shape "
                         f"{tuple(x.shape)} (Tq={x.shape[-2]}, Tk={x.shape[-1]})")


def rel_shift(x: Tensor, *, backend: Optional[str] = None) -> Tensor:
    """Transformer-XL relative shift, with zeros where the original leaves junk.

    Args:
        x: ``[..., Tq, Tk]`` with ``Tk >= Tq``; float16, bfloat16, float32 or float64; any
            strides. Typically the position scores ``(q + v) · rᵀ`` of shape
            ``[B, H, Tq, Tk]`` with ``r``'s rows in the original code's order (row ``m`` =
            distance ``Tk - 1 - m``).
        backend: ``"triton" | "cuda" | "cpu" | "eager"`` or None (see
            ``ctxfast.backend``). An explicit backend that cannot run raises
            :class:`ctxfast.BackendUnavailable`.

    Returns:
        ``out`` of x's shape, contiguous: ``out[..., i, j] = x[..., i, j + Tq - 1 - i]``
        where ``j + Tq - 1 - i < Tk``, else 0. Differentiable; the gradient is the inverse
        shift.

    Raises:
        TypeError: x is not a floating-point tensor.
        ValueError: x has rank < 2 or ``Tk < Tq``.
    """
    _check(x)
    name = _dispatch.resolve("rel_shift", x.device, backend)
    if name == "eager":
        return _ref.rel_shift(x)
    if name == "triton":
        return _triton(x, False)
    return _native(x, False)
