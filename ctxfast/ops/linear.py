"""``ctxfast.linear``: ``y = x @ weightᵀ + bias``, as ``F.linear``, with float32 products on
the tensor cores at float32's accuracy: a float32 language model's decoder.

Why: where torch does not allow TF32 for float32 matmuls (its default), ``F.linear`` runs
cuBLAS's float32 GEMMs on the CUDA cores. A language model's decoder is the largest GEMM of
its training step (ULMFiT: 4,480 rows x 400 -> 60,000 words, 215 GFLOP forward and twice
that backward): in the first H100 round's profile of the AWD-LSTM train step
(``benchmarks/results/nvidia-h100-80gb-hbm3/2026-11-22-profile_awd_lstm.txt``) cuBLAS's
float32 GEMMs took 16.8 ms of the step's 57.7 ms of GPU time, the decoder's three about 11
of them by their share of the FLOPs (arithmetic, not measured). ``fastai``'s AWD-LSTM, the
baseline its users run, has the same decoder: no LSTM alone makes that train step 1.3x
faster. The ``triton`` backend runs float32 as ``tf32x3`` (``kernels/linear.py``: three
TF32 products a multiply, float32-level error, ~2.5x float32's peak on an H100 by the
datasheet) where torch does not allow TF32, and one TF32 product where it does.

Registered ops (under ``torch.ops.ctxfast``, each with a fake for torch.compile):

* ``linear(Tensor x2, Tensor w, Tensor? b, str mode) -> Tensor``: ``x2 [M, I] @ w [N, I]ᵀ
  + b [N]`` -> ``[M, N]`` in x2's dtype, with an autograd formula;
* ``linear_backward(Tensor g, Tensor x2, Tensor w, bool need_x, bool need_w, str mode)
  -> (Tensor, Tensor, Tensor)``: ``(g @ w, gᵀ @ x2, g.sum(0))``, a gradient not needed
  an empty ``[0]`` (not computed).

``mode`` decides the products at each call (torch's settings are read then, never cached):

* ``"triton"`` (``ctxfast.linear``'s triton backend): the Triton GEMM, its float32
  products TF32 where torch allows TF32 for float32 matmuls (``torch.backends.cuda.matmul``),
  else tf32x3; other dtypes as Triton's dot takes them (16-bit on the tensor cores, float64
  exact);
* ``"rnn"`` (the LSTM's input projection and its gradients, ``ctxfast.ops.lstm``): one
  TF32 product where torch allows TF32 for cuDNN's RNNs but not for cuBLAS (both defaults),
  as ``nn.LSTM`` runs every float32 GEMM of the layer; where it allows TF32 for neither,
  float32's accuracy: tf32x3 if :data:`CUDA_DEFAULT` is ``"triton"`` (the decision for
  ``ctxfast.linear``'s own float32 calls), else cuBLAS; otherwise ``F.linear`` /
  ``torch.mm``, which follow cuBLAS's setting.

The ``eager`` backend is ``ctxfast.reference.linear`` (``F.linear``). ctxfast has no C++
GEMM of its own: ``cpu`` and ``cuda`` are ATen's (MKL / oneDNN on CPU tensors, cuBLAS on
CUDA tensors), the GEMMs the C++ LSTM ops call for their projections too, so that a model
run under ``with ctxfast.backend("cpu"):`` (or ``"cuda"``) has its decoder on them.
Default: ``eager`` on every device, and on CUDA :data:`CUDA_DEFAULT` for float32: the
Triton GEMM is not yet timed on a GPU (``benchmarks/linear_compare.py`` times both and
checks the error; the GPU round runs it).
"""
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _dispatch
from .. import reference as _ref
from ._common import autocast as _autocast
from ._common import check_float_tensor as _check_float_tensor
from ._common import call_in_backward as _call_in_backward
from ._common import on_tensor_device as _on_device
from ._common import register_autograd as _register_autograd

_dispatch.register_op("linear", supported=("triton", "cuda", "cpu", "eager"),
                      cpu_default=("eager",), cuda_default=("eager",))

#: What :func:`linear` runs for float32 CUDA tensors when no backend is asked for (argument,
#: ``ctxfast.backend``, ``CTXFAST_BACKEND``): ``"eager"`` (cuBLAS) or ``"triton"`` (the
#: tf32x3 GEMM). From ``CTXFAST_LINEAR_CUDA`` at import; ``"eager"`` until a GPU times the
#: Triton GEMM faster at the decoders' sizes.
CUDA_DEFAULT = os.environ.get("CTXFAST_LINEAR_CUDA", "eager")

MODES = ("triton", "rnn")


def _precision(mode: str, x2: Tensor) -> Optional[str]:
    """The Triton GEMM's products for this call of the ``linear`` ops, or None where the
    call runs ``F.linear`` / ``torch.mm`` (see the module docstring's modes)."""
    if mode not in MODES:
        raise ValueError(f"ctxfast::linear: mode must be one of {MODES}, got {mode!r}")
    from ctxfast.kernels._common import _rnn_tf32_allowed, _tf32_allowed  # imports triton
    if mode == "triton":
        return "tf32" if _tf32_allowed() else "tf32x3"
    if not (x2.is_cuda and x2.dtype == torch.float32) or _tf32_allowed():
        return None                          # F.linear: 16-bit, CPU, or TF32 in cuBLAS too
    if _rnn_tf32_allowed():
        return "tf32"                        # nn.LSTM's GEMMs are TF32: so are ours
    return "tf32x3" if CUDA_DEFAULT == "triton" else None   # exact float32: as linear's


@torch.library.custom_op("ctxfast::linear", mutates_args=())
@_on_device
def _linear(x2: Tensor, w: Tensor, b: Optional[Tensor], mode: str) -> Tensor:
    """``x2 [M, I] @ w [N, I]ᵀ + b [N]`` -> ``[M, N]`` (see the module docstring)."""
    precision = _precision(mode, x2)
    if precision is None:
        return F.linear(x2, w, b)
    from ctxfast.kernels.linear import linear_forward
    return linear_forward(x2, w, b, precision=precision)


@_linear.register_fake
def _(x2, w, b, mode):
    return x2.new_empty((x2.shape[0], w.shape[0]))


@torch.library.custom_op("ctxfast::linear_backward", mutates_args=())
@_on_device
def _linear_backward(g: Tensor, x2: Tensor, w: Tensor, need_x: bool, need_w: bool,
                     mode: str) -> Tuple[Tensor, Tensor, Tensor]:
    """``(g @ w [M, I], gᵀ @ x2 [N, I], g.sum(0) [N])`` for ``g [M, N]``, the products as
    :func:`_linear`'s; a gradient not needed is an empty ``[0]`` (not computed)."""
    precision = _precision(mode, x2)
    if precision is None:
        mm = torch.mm
    else:
        from ctxfast.kernels.linear import matmul

        def mm(a, b):
            return matmul(a, b, precision=precision)
    gx = mm(g, w) if need_x else x2.new_empty((0,))
    gw = mm(g.t(), x2) if need_w else w.new_empty((0,))
    return gx, gw, g.sum(0)


@_linear_backward.register_fake
def _(g, x2, w, need_x, need_w, mode):
    return (x2.new_empty(x2.shape if need_x else (0,)), w.new_empty(w.shape if need_w else (0,)),
            g.new_empty((g.shape[1],)))


def _setup(ctx, inputs, output):
    x2, w, b, mode = inputs
    ctx.save_for_backward(x2, w)
    ctx.has_bias, ctx.mode = b is not None, mode


def _grad(ctx, g):
    x2, w = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gx, gw, gb = _call_in_backward(torch.ops.ctxfast.linear_backward, g, x2, w, need_x, need_w,
                                   ctx.mode, name="linear")
    return (gx if need_x else None, gw if need_w else None,
            gb if ctx.has_bias and ctx.needs_input_grad[2] else None, None)


#: ``torch.ops.ctxfast.linear`` with its formula (ops._common.GradCall: forward mode and
#: torch.func.jvp refused by name, torch.func.grad / vjp accepted); what the public function
#: and the LSTM's input projection call
linear_op = _register_autograd(_linear, _grad, _setup, first_order="linear")


def _check(x: object, weight: object, bias: object) -> None:
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None or name != "bias":
            _check_float_tensor("linear", name, t)
    if x.dim() < 1:
        raise ValueError(f"linear: x must have shape [..., I] (rank >= 1), got shape "
                         f"{tuple(x.shape)}")
    I = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != I:
        raise ValueError(f"linear: weight must have shape [N, I] = [N, {I}] (I from x "
                         f"{tuple(x.shape)}), got {tuple(weight.shape)}")
    N = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"linear: bias must have shape [N] = [{N}], got {tuple(bias.shape)}")
    others = [t for t in (weight, bias) if t is not None]
    if any(t.dtype != x.dtype for t in others):
        raise TypeError(f"linear: x, weight and bias must have one dtype, got "
                        f"{', '.join(str(t.dtype) for t in (x, *others))}")
    if any(t.device != x.device for t in others):
        raise ValueError(f"linear: x, weight and bias must be on one device, got "
                         f"{', '.join(str(t.device) for t in (x, *others))}")


def _route(x: Tensor, backend: Optional[str]) -> str:
    """The backend this call runs (see :func:`linear`)."""
    if CUDA_DEFAULT not in ("eager", "triton"):
        raise ValueError("CTXFAST_LINEAR_CUDA (ctxfast.ops.linear.CUDA_DEFAULT) must be "
                         f"'eager' or 'triton', got {CUDA_DEFAULT!r}")
    asked, _ = _dispatch.requested_backend(backend)
    if asked is None:
        if (CUDA_DEFAULT == "triton" and x.is_cuda and x.dtype == torch.float32
                and _dispatch.why_unavailable("triton", x.device) is None):
            return "triton"
        return _dispatch.default_backend("linear", x.device)
    return _dispatch.resolve("linear", x.device, backend)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *,
           backend: Optional[str] = None) -> Tensor:
    """``F.linear``: ``y = x @ weightᵀ + bias``, a float32 path on the tensor cores.

    Args:
        x: ``[..., I]``; float16, bfloat16, float32 or float64; any strides.
        weight: ``[N, I]``, x's dtype and device; any strides (a tied embedding's weight is
            read where it is).
        bias: ``[N]`` or None.
        backend: ``"triton" | "cuda" | "cpu" | "eager"`` or None (see
            ``ctxfast.backend``; ``cuda`` and ``cpu`` are ATen's GEMMs). ``triton``
            runs float32 as three TF32 products a multiply (float32-level error) where torch
            does not allow TF32 for float32 matmuls, one where it does; 16-bit on the tensor
            cores with float32 accumulation; float64 exact. None: ``eager`` (cuBLAS, MKL),
            and on CUDA float32 :data:`CUDA_DEFAULT`.

    Returns:
        ``[..., N]`` in x's dtype, contiguous. Differentiable in x, weight and bias; a
        gradient nobody needs is not computed. Under autocast, computed in the autocast
        dtype, as ``F.linear``.

    Raises:
        TypeError: a non-tensor, a non-float dtype, or dtypes that differ.
        ValueError: shapes that do not match (the message names the argument and the
            shape expected), or tensors on different devices.
        ctxfast.BackendUnavailable: a backend asked for where it cannot run (``triton``
            with no GPU and no interpreter, ``cpu`` on CUDA tensors, ...).
    """
    x, weight, bias = _autocast(x, weight, bias)    # first: fp32 weights meet bf16 x there
    _check(x, weight, bias)
    name = _route(x, backend)
    if name != "triton":                        # eager, or ATen's GEMMs (cpu, cuda)
        return _ref.linear(x, weight, bias)
    lead = x.shape[:-1]
    y = linear_op(x.reshape(lead.numel(), x.shape[-1]), weight, bias, "triton")   # [M, N]
    return y.view(*lead, weight.shape[0])                                 # [..., N]
