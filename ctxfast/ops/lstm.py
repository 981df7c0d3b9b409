"""``ctxfast.lstm``: one LSTM layer and direction over all time steps, with DropConnect on
the recurrent weights (AWD-LSTM), projection and clipping (ELMo), as a drop-in autograd op.

The input projection ``xw = x @ w_ihᵀ + b_ih + b_hh`` of all steps is one GEMM here, in
PyTorch (ordinary autograd); the recurrence runs in one call of a fused op (math in
``ctxfast/reference/lstm.py``).

Registered ops (under ``torch.ops.ctxfast``; fakes and autograd here):

* ``lstm_recurrence_triton(xw, h0, c0, w_hh, w_hr, mask, scale, cell_clip, proj_clip,
  reverse) -> (out [T, B, P], cells [T, B, H], gates [T, B, 4H])`` and
  ``lstm_recurrence_backward_triton(grad_out, grad_cells, h0, c0, w_hh, w_hr, mask, scale,
  cell_clip, proj_clip, reverse, out, cells, gates) -> (grad_xw, grad_h0, grad_c0,
  grad_w_hh, grad_w_hr)``: ``kernels/lstm.py``.
* ``lstm_recurrence_native`` / ``lstm_recurrence_backward_native``: the same schemas in C++
  (``csrc/cpu`` through ``ctxfast._C``, ``csrc/cuda`` through ``ctxfast._cuda``), where the
  extension was built with them.
* ``lstm_recurrence_split``: the Triton forward's schema, with ``lstm_recurrence_backward_native``
  as its backward (both save the same ``out``, ``cells`` and ``gates``): what CUDA tensors
  run when no backend is asked for (:data:`CUDA_DEFAULT`).

``grad_w_hh`` is the gradient w.r.t. the *unmasked* ``w_hh`` (``dW * mask * scale``);
``grad_w_hr`` is an empty ``[0]`` tensor when there is no projection. ``gates`` (the
post-activation gates, saved for the backward) is not differentiable.

The ``eager`` backend is ``ctxfast.reference.lstm`` (a per-step PyTorch loop).
"""
import math
from numbers import Integral, Real
from typing import Optional, Sequence, Tuple

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.nn.functional as F
from torch import Tensor

from .. import _dispatch
from .. import reference as _ref
from ._common import FLOAT_DTYPES as _FLOAT_DTYPES
from ._common import autocast as _autocast
from ._common import call_in_backward as _call_in_backward
from ._common import _refuse_forward_ad, _refuse_jvp
from ._common import first_order_only as _first_order_only
from ._common import on_tensor_device as _on_device
from ._common import register_autograd as _register_autograd
from . import linear as _linear_ops  # ctxfast::linear: the projection (linear_op)


# The C++ recurrence exists only once csrc/ has it and the extension was rebuilt.
_NATIVE = _dispatch.c_available() and hasattr(torch.ops.ctxfast, "lstm_recurrence_native")

# Defaults: on CPU the C++ kernel where built, else the eager loop (Triton runs on CPU only
# in the interpreter, for tests); on CUDA the CUDA C++ kernel, then Triton ("cuda" with
# both able to run: the Triton forward, the CUDA backward, CUDA_DEFAULT below).
_dispatch.register_op(
    "lstm",
    supported=("triton", "cuda", "cpu", "eager") if _NATIVE
    else ("triton", "cpu", "eager") if not _dispatch.c_available() else ("triton", "eager"),
    cpu_default=("cpu", "eager") if _NATIVE else ("eager",),
    cuda_default=("cuda", "triton", "eager") if _NATIVE else ("triton", "eager"),
)


def _fp64_route(name: str, asked: Optional[str], source: str, x: Tensor) -> str:
    """The CUDA C++ recurrence computes in fp32 and refuses float64: by default float64 on
    CUDA goes to Triton (else eager); asking for ``cuda`` with float64 is an error, said
    here before anything runs."""
    if name != "cuda" or x.dtype != torch.float64:
        return name
    if asked is not None:
        raise _dispatch.BackendUnavailable(
            f"ctxfast.lstm: backend 'cuda' (from {source}) cannot run float64 inputs (its "
            "kernels compute in float32); use backend='triton' or 'eager' for float64")
    return "triton" if _dispatch.why_unavailable("triton", x.device) is None else "eager"


# --------------------------------------------------------------------------- autograd (shared)

def _recurrence_fake(xw, h0, c0, w_hh, w_hr, mask, scale, cell_clip, proj_clip, reverse):
    T, B, G = xw.shape
    return (xw.new_empty((T, B, h0.shape[1])), xw.new_empty((T, B, G // 4)),
            xw.new_empty((T, B, G)))


def _backward_fake(grad_out, grad_cells, h0, c0, w_hh, w_hr, mask, scale, cell_clip,
                   proj_clip, reverse, out, cells, gates):
    gw_hr = w_hr.new_empty(w_hr.shape) if w_hr is not None else grad_out.new_empty((0,))
    return (gates.new_empty(gates.shape), h0.new_empty(h0.shape), c0.new_empty(c0.shape),
            w_hh.new_empty(w_hh.shape), gw_hr)


def _setup_context(ctx, inputs, output):
    xw, h0, c0, w_hh, w_hr, mask, scale, cell_clip, proj_clip, reverse = inputs
    out, cells, gates = output
    ctx.mark_non_differentiable(gates)
    ctx.save_for_backward(h0, c0, w_hh, w_hr, mask, out, cells, gates)
    ctx.args = (scale, cell_clip, proj_clip, reverse)


def _make_backward(backward_op):
    def _backward(ctx, grad_out, grad_cells, grad_gates):
        h0, c0, w_hh, w_hr, mask, out, cells, gates = ctx.saved_tensors
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        grad_cells = torch.zeros_like(cells) if grad_cells is None else grad_cells
        gxw, gh0, gc0, gw_hh, gw_hr = backward_op(
            grad_out, grad_cells, h0, c0, w_hh, w_hr, mask, *ctx.args, out, cells, gates)
        return (gxw, gh0, gc0, gw_hh, gw_hr if w_hr is not None else None,
                None, None, None, None, None)
    return _backward


# --------------------------------------------------------------------------- Triton ops

@torch.library.custom_op("ctxfast::lstm_recurrence_triton", mutates_args=())
@_on_device
def _lstm_recurrence_triton(xw: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor,
                            w_hr: Optional[Tensor], mask: Optional[Tensor], scale: float,
                            cell_clip: float, proj_clip: float,
                            reverse: bool) -> Tuple[Tensor, Tensor, Tensor]:
    from ctxfast.kernels.lstm import lstm_forward  # imports triton
    return lstm_forward(xw, h0, c0, w_hh, w_hr, mask, scale, cell_clip, proj_clip, reverse)


_lstm_recurrence_triton.register_fake(_recurrence_fake)


@torch.library.custom_op("ctxfast::lstm_recurrence_backward_triton", mutates_args=())
@_on_device
def _lstm_recurrence_backward_triton(
        grad_out: Tensor, grad_cells: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor,
        w_hr: Optional[Tensor], mask: Optional[Tensor], scale: float, cell_clip: float,
        proj_clip: float, reverse: bool, out: Tensor, cells: Tensor,
        gates: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from ctxfast.kernels.lstm import lstm_backward  # imports triton
    return lstm_backward(grad_out, grad_cells, h0, c0, w_hh, w_hr, mask, scale, cell_clip,
                         proj_clip, reverse, out, cells, gates)


_lstm_recurrence_backward_triton.register_fake(_backward_fake)
_recurrence_triton = _register_autograd(
    _lstm_recurrence_triton,
    _make_backward(lambda *a: _call_in_backward(
        torch.ops.ctxfast.lstm_recurrence_backward_triton, *a, name="lstm")),
    _setup_context, first_order="lstm")


# --------------------------------------------------------------------------- C++ ops

if _NATIVE:
    torch.library.register_fake("ctxfast::lstm_recurrence_native")(_recurrence_fake)
    torch.library.register_fake("ctxfast::lstm_recurrence_backward_native")(_backward_fake)
    _recurrence_native = _register_autograd(
        "ctxfast::lstm_recurrence_native",
        _make_backward(lambda *a: _call_in_backward(
            torch.ops.ctxfast.lstm_recurrence_backward_native, *a, name="lstm")),
        _setup_context, first_order="lstm")


# ---------------------------------------- Triton forward, C++ backward (the CUDA default)

#: What :func:`lstm` runs on CUDA tensors when no backend is asked for (argument, context,
#: ``CTXFAST_BACKEND``) and both the CUDA C++ and the Triton backend can run: ``"split"``,
#: the Triton persistent forward and the CUDA C++ backward (one autograd op,
#: ``lstm_recurrence_split``), ``"cuda"``, both directions in CUDA C++, or ``"triton"``,
#: both in Triton (for when a GPU times the Triton backward faster). Asking for
#: ``backend="cuda"`` or ``"triton"`` runs both directions on that one. Why split: the H200
#: (round 5, benchmarks/results/nvidia-h200/2026-11-27-round5, one layer, DropConnect 0.2)
#: timed the Triton forward 2.4x the CUDA one at ULMFiT's size (H 1152, T 70, B 64; bf16
#: 0.79 against 1.88 ms, fp32 2.29 against 5.08) and level at ELMo's (4096 / 512, T 50,
#: B 32; bf16 1.55 against 1.57), and the CUDA backward (forward+backward less forward)
#: 3.0x the Triton one at ELMo's size (1.61 against 4.87 ms), 1.18x at ULMFiT's in fp32
#: (5.77 against 6.83), 0.94x in bf16 (2.45 against 2.31). The split itself is not timed yet.
CUDA_DEFAULT = "split"

if _NATIVE:
    @torch.library.custom_op("ctxfast::lstm_recurrence_split", mutates_args=())
    @_on_device
    def _lstm_recurrence_split(xw: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor,
                               w_hr: Optional[Tensor], mask: Optional[Tensor], scale: float,
                               cell_clip: float, proj_clip: float,
                               reverse: bool) -> Tuple[Tensor, Tensor, Tensor]:
        from ctxfast.kernels.lstm import lstm_forward  # imports triton
        return lstm_forward(xw, h0, c0, w_hh, w_hr, mask, scale, cell_clip, proj_clip,
                            reverse)

    _lstm_recurrence_split.register_fake(_recurrence_fake)
    _recurrence_split = _register_autograd(
        _lstm_recurrence_split,
        _make_backward(lambda *a: _call_in_backward(
            torch.ops.ctxfast.lstm_recurrence_backward_native, *a, name="lstm")),
        _setup_context, first_order="lstm")


def _default_route(name: str, asked: Optional[str], x: Tensor) -> str:
    """What this call runs: :data:`CUDA_DEFAULT` ("split" or "triton") for CUDA tensors with
    no backend asked for, the CUDA C++ backend picked and the Triton one able to run; else
    the backend ``name`` picked."""
    if CUDA_DEFAULT not in ("split", "cuda", "triton"):
        raise ValueError("ctxfast.ops.lstm.CUDA_DEFAULT must be 'split', 'cuda' or 'triton', "
                         f"got {CUDA_DEFAULT!r}")
    if (CUDA_DEFAULT != "cuda" and asked is None and name == "cuda" and x.is_cuda
            and _dispatch.why_unavailable("triton", x.device) is None):
        return CUDA_DEFAULT
    return name


def _split_by_default(name: str, asked: Optional[str], x: Tensor) -> bool:
    """Whether this call runs :data:`CUDA_DEFAULT`'s split (see :func:`_default_route`)."""
    return _default_route(name, asked, x) == "split"


# --------------------------------------------------------------------------- checks

def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def _check_tensor(name: str, t: object, rank: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"lstm: {name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"lstm: {name} must have shape {layout} (rank {rank}), got shape "
                         f"{_shape(t)}")


def _check_clip(name: str, clip: object) -> float:
    if clip is None:
        return math.inf
    if isinstance(clip, bool) or not isinstance(clip, Real):
        raise TypeError(f"lstm: {name} must be a float > 0 or None, got {type(clip).__name__}")
    if not clip > 0:
        raise ValueError(f"lstm: {name} must be > 0 (None: no clip), got {clip}")
    return float(clip)


def _check(x, hx, w_ih, w_hh, b_ih, b_hh, w_hr, weight_mask, weight_dropout, cell_clip,
           proj_clip, reverse) -> Tuple[float, float]:
    """Validate every argument (shapes, dtypes, devices, ranges); returns the clips as
    floats (``math.inf``: none)."""
    _check_tensor("x", x, 3, "[T, B, I]")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"lstm: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    T, B, I = x.shape
    _check_tensor("w_ih", w_ih, 2, "[4H, I]")
    if w_ih.shape[0] % 4 != 0 or w_ih.shape[0] == 0 or w_ih.shape[1] != I:
        raise ValueError(f"lstm: w_ih must have shape [4H, I] with I = {I} (x's last dim) and "
                         f"H >= 1, got {_shape(w_ih)}")
    H = w_ih.shape[0] // 4
    _check_tensor("w_hh", w_hh, 2, "[4H, P]")
    if w_hh.shape[0] != 4 * H or w_hh.shape[1] == 0:
        raise ValueError(f"lstm: w_hh must have shape [4H, P] = [{4 * H}, P] (4H from w_ih), "
                         f"got {_shape(w_hh)}")
    P = w_hh.shape[1]
    if w_hr is None:
        if P != H:
            raise ValueError(f"lstm: without w_hr, w_hh must have shape [4H, H] = [{4 * H}, "
                             f"{H}], got {_shape(w_hh)}")
    else:
        _check_tensor("w_hr", w_hr, 2, "[P, H]")
        if _shape(w_hr) != (P, H):
            raise ValueError(f"lstm: w_hr must have shape [P, H] = [{P}, {H}] (P from w_hh, "
                             f"H from w_ih), got {_shape(w_hr)}")
    for name, b in (("b_ih", b_ih), ("b_hh", b_hh)):
        if b is not None:
            _check_tensor(name, b, 1, f"[4H] = [{4 * H}]")
            if b.shape[0] != 4 * H:
                raise ValueError(f"lstm: {name} must have shape [4H] = [{4 * H}], got "
                                 f"{_shape(b)}")
    named = [("w_ih", w_ih), ("w_hh", w_hh), ("w_hr", w_hr), ("b_ih", b_ih), ("b_hh", b_hh)]
    if hx is not None:
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError(f"lstm: hx must be a pair (h0 [B, P], c0 [B, H]) or None, got "
                            f"{type(hx).__name__}")
        h0, c0 = hx
        _check_tensor("h0 (hx[0])", h0, 2, f"[B, P] = [{B}, {P}]")
        _check_tensor("c0 (hx[1])", c0, 2, f"[B, H] = [{B}, {H}]")
        if _shape(h0) != (B, P):
            raise ValueError(f"lstm: h0 (hx[0]) must have shape [B, P] = [{B}, {P}], got "
                             f"{_shape(h0)}")
        if _shape(c0) != (B, H):
            raise ValueError(f"lstm: c0 (hx[1]) must have shape [B, H] = [{B}, {H}], got "
                             f"{_shape(c0)}")
        named += [("h0 (hx[0])", h0), ("c0 (hx[1])", c0)]
    for name, t in named:
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise TypeError(f"lstm: {name} must have x's dtype {x.dtype}, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"lstm: {name} must be on x's device {x.device}, got {t.device}")
    if weight_mask is not None:
        _check_tensor("weight_mask", weight_mask, 2, f"[4H, P] = [{4 * H}, {P}]")
        if _shape(weight_mask) != (4 * H, P):
            raise ValueError(f"lstm: weight_mask must have shape [4H, P] = [{4 * H}, {P}] "
                             f"(w_hh's), got {_shape(weight_mask)}")
        if weight_mask.dtype not in (torch.bool, w_hh.dtype):
            raise TypeError(f"lstm: weight_mask must be bool or w_hh's dtype {w_hh.dtype}, "
                            f"got {weight_mask.dtype}")
        if weight_mask.device != x.device:
            raise ValueError(f"lstm: weight_mask must be on x's device {x.device}, got "
                             f"{weight_mask.device}")
    if isinstance(weight_dropout, bool) or not isinstance(weight_dropout, Real):
        raise TypeError(f"lstm: weight_dropout must be a float in [0, 1), got "
                        f"{type(weight_dropout).__name__}")
    if not 0.0 <= weight_dropout < 1.0:
        raise ValueError(f"lstm: weight_dropout must be in [0, 1), got {weight_dropout}")
    if weight_dropout > 0 and weight_mask is None:
        raise ValueError(f"lstm: weight_dropout={weight_dropout} without weight_mask would "
                         "drop nothing; pass weight_mask (a 0/1 [4H, P] tensor, e.g. "
                         "torch.rand_like(w_hh) >= weight_dropout) with it, use "
                         "ctxfast.nn.WeightDropLSTM (it draws the mask in training), or "
                         "pass weight_dropout=0 for evaluation")
    cc = _check_clip("cell_clip", cell_clip)
    pc = _check_clip("proj_clip", proj_clip)
    if proj_clip is not None and w_hr is None:
        raise ValueError("lstm: proj_clip clips the projection h_t = hp_t @ w_hrᵀ; it needs "
                         "w_hr [P, H] (got w_hr=None)")
    if not isinstance(reverse, bool):
        raise TypeError(f"lstm: reverse must be a bool, got {type(reverse).__name__}")
    return cc, pc


# --------------------------------------------------------------------------- public op

# Where the cpu backend's large fp32 products go (csrc/cpu/cpu_gemm.h, decided once): the
# input projection and its gradients below, and the recurrence's weight gradients in C++.
# "onednn" where MKL (ATen's BLAS) runs below the CPU (AVX2 code on an AMD CPU with
# AVX-512), "aten" otherwise, "bad: ..." for an unusable CTXFAST_CPU_LINEAR (refused).
_LINEAR = (torch.ops.ctxfast.cpu_linear_path() if _NATIVE
           and hasattr(torch.ops.ctxfast, "cpu_linear_path") else "aten")


class _OneDnnProjection(torch.autograd.Function):
    """``x2 [M, I] @ w [N, I]ᵀ + b [N]`` and its gradients on oneDNN's linear
    (``mkldnn::_linear_pointwise``, which takes the transposed operands of the backward
    as strided views, no copies)."""

    generate_vmap_rule = True   # torch.func.vmap: the ops below run per sample

    @staticmethod
    def forward(x2: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "")

    @staticmethod
    def setup_context(ctx, inputs, output):
        x2, w, b = inputs
        ctx.save_for_backward(x2, w)
        ctx.has_bias = b is not None

    @staticmethod
    def backward(ctx, g: Tensor):
        # first order, refused by the op's name where differentiated again (as the
        # recurrence's): once_differentiable's error node holds detached copies, so a
        # gradient of these gradients found no path to x or w_ih ("not used in the graph",
        # None with allow_unused) instead of an error naming lstm
        return _projection_backward(ctx, g)


def _projection_grads(ctx, g: Tensor):
    x2, w = ctx.saved_tensors
    lin = torch.ops.mkldnn._linear_pointwise
    gx = lin(g, w.t(), None, "none", [], "") if ctx.needs_input_grad[0] else None
    gw = lin(g.t(), x2.t(), None, "none", [], "") if ctx.needs_input_grad[1] else None
    gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return gx, gw, gb


_projection_backward = _first_order_only("lstm", _projection_grads)


#: float32 input projections on CUDA with one TF32 product per MMA where torch allows TF32
#: for cuDNN's RNNs but not for cuBLAS (both defaults): what nn.LSTM (cuDNN) does with every
#: float32 GEMM of the layer, on our Triton kernel (``kernels/linear.py``, the precision
#: taken per call: the ``linear`` op's mode "rnn", ``ctxfast.ops.linear``). False: F.linear,
#: which follows cuBLAS's setting.
RNN_TF32_PROJECTION = True


def _check_lengths(lengths: object, T: int, B: int) -> Optional[Tensor]:
    """``lengths`` refused by name unless None, a list of ints or a 1-D integer CPU tensor
    ``[B]`` with values in ``[1, T]``; returns it as int64, or None where every sequence
    has all T steps (the plain call)."""
    if lengths is None:
        return None
    if isinstance(lengths, (list, tuple)):
        if not all(isinstance(n, Integral) and not isinstance(n, bool) for n in lengths):
            raise TypeError("lstm: lengths must be a 1-D integer tensor [B] or a list of ints")
        lengths = torch.tensor([int(n) for n in lengths], dtype=torch.int64)
    elif not isinstance(lengths, Tensor) and hasattr(lengths, "__array__"):
        lengths = torch.as_tensor(lengths)                          # a NumPy array
    if not isinstance(lengths, Tensor) or lengths.dim() != 1 \
            or lengths.dtype.is_floating_point or lengths.dtype.is_complex \
            or lengths.dtype == torch.bool:
        got = (f"shape {_shape(lengths)}, dtype {lengths.dtype}"
               if isinstance(lengths, Tensor) else type(lengths).__name__)
        raise TypeError(f"lstm: lengths must be a 1-D integer tensor [B] or a list of ints, "
                        f"got {got}")
    if lengths.device.type != "cpu":
        raise ValueError(f"lstm: lengths must be on the CPU (as pack_padded_sequence's), got "
                         f"{lengths.device}")
    if lengths.shape[0] != B:
        raise ValueError(f"lstm: lengths must have shape [B] = [{B}], got {_shape(lengths)}")
    if B and (int(lengths.min()) < 1 or int(lengths.max()) > T):
        raise ValueError(f"lstm: lengths must be in [1, T] = [1, {T}], got values "
                         f"{int(lengths.min())}..{int(lengths.max())}")
    return None if bool((lengths == T).all()) else lengths.to(torch.int64)


def _projection(x: Tensor, w_ih: Tensor, bias: Optional[Tensor], name: str) -> Tensor:
    """``xw = x @ w_ihᵀ + bias`` [T, B, 4H]: F.linear; oneDNN for the cpu backend's fp32
    where _LINEAR says so (eager only: under torch.compile the compiler takes F.linear; a
    jvp or dual tensor through it is refused by the op's name, as the recurrence would);
    the ``linear`` op (mode "rnn") for CUDA float32: TF32 products as nn.LSTM's, where torch
    allows them for cuDNN's RNNs (RNN_TF32_PROJECTION)."""
    if name == "cpu" and _LINEAR.startswith("bad"):
        raise ValueError(f"ctxfast.lstm: {_LINEAR[5:]}")
    if x.is_cuda and x.dtype == torch.float32 and RNN_TF32_PROJECTION and x.numel() > 0:
        T, B, I = x.shape
        xw = _linear_ops.linear_op(x.reshape(T * B, I), w_ih, bias, "rnn")    # [T B, 4H]
        return xw.view(T, B, -1)                                                # [T, B, 4H]
    if (name != "cpu" or _LINEAR != "onednn" or x.dtype != torch.float32
            or x.numel() == 0 or torch.compiler.is_compiling()):
        return F.linear(x, w_ih, bias)
    # the Function has no jvp (torch's error names no op): refused as the recurrence would
    if _forward_ad._current_level >= 0:
        _refuse_forward_ad("lstm_recurrence_native", (x, w_ih, bias))
    if torch._C._are_functorch_transforms_active():
        _refuse_jvp("lstm_recurrence_native", (x, w_ih, bias))
    T, B, I = x.shape
    xw = _OneDnnProjection.apply(x.reshape(T * B, I), w_ih, bias)   # [T B, 4H]
    return xw.view(T, B, -1)                                       # [T, B, 4H]


def lstm(x: Tensor, hx: Optional[Sequence[Tensor]], w_ih: Tensor, w_hh: Tensor,
         b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None,
         w_hr: Optional[Tensor] = None, *, weight_mask: Optional[Tensor] = None,
         weight_dropout: float = 0.0, cell_clip: Optional[float] = None,
         proj_clip: Optional[float] = None, reverse: bool = False,
         lengths: Optional[Tensor] = None,
         backend: Optional[str] = None) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """One LSTM layer, one direction, all time steps in one fused call.

    Per step (gate order i, f, g, o as ``torch.nn.LSTM``)::

        W = w_hh * weight_mask / (1 - weight_dropout)        (w_hh without a mask)
        z = x_t @ w_ihᵀ + b_ih + b_hh + h_{t-1} @ Wᵀ
        c_t = clamp(f * c_{t-1} + i * g, ±cell_clip);  hp = o * tanh(c_t)
        h_t = clamp(hp @ w_hrᵀ, ±proj_clip)  (h_t = hp without w_hr)

    Precision: fp16/bf16 operands with fp32 arithmetic and state; under ``torch.autocast``
    the autocast dtype (as ``nn.LSTM``). fp32 on a GPU as
    ``nn.LSTM`` computes it: where torch allows TF32 for cuDNN's RNNs
    (``torch.backends.cudnn.allow_tf32`` / ``cudnn.rnn.fp32_precision``, allowed by default)
    the recurrent products are TF32 products, else float32-level (tf32x3 on the tensor
    cores); the input projection GEMM follows cuBLAS's own setting, as in PyTorch.

    Args:
        x: ``[T, B, I]``, time-major; any strides. fp16, bf16, fp32 (fp64 for tests).
        hx: ``(h0 [B, P], c0 [B, H])`` or None (zeros). One layer: no layer dimension.
        w_ih: ``[4H, I]``; w_hh: ``[4H, P]``; b_ih, b_hh: ``[4H]`` or None;
            w_hr: ``[P, H]`` or None (then ``P = H``) — ``nn.LSTM``'s parameters of one
            layer and direction. All of x's dtype and device.
        weight_mask: ``[4H, P]`` DropConnect mask of 0/1 (bool or w_hh's dtype), shared by
            all time steps, or None. The op is deterministic given the mask (the module
            samples it). ``weight_dropout > 0`` without a mask is refused (ValueError). A
            constant on every backend: no gradient flows to it, even if it requires one.
        weight_dropout: the drop probability p in ``[0, 1)`` the mask was drawn with; the
            kept weights are scaled by ``1 / (1 - p)``.
        cell_clip, proj_clip: AllenNLP's ``LstmCellWithProjection`` clips (> 0, None: no
            clip); ``proj_clip`` needs ``w_hr``. Clipped entries pass no gradient. The
            kernels keep only the clipped value and pass the gradient where it is strictly
            inside (``|c| < clip``): a value exactly at ±clip passes none, where
            ``torch.clamp`` (the eager backend) passes it.
        reverse: consume ``t = T-1 .. 0`` (the backward direction of a biLSTM); ``out``
            stays in time order.
        lengths: sequences of several lengths in one batch (``pack_padded_sequence``'s
            meaning): ``[B]`` integers in ``[1, T]`` on the CPU (a tensor or a list), or
            None (all T steps). Sequence b is ``x[:lengths[b], b]``, the rest padding it
            never sees: ``out`` is 0 there, ``h_n, c_n`` are its states after its own last
            step, and reversed it is consumed from ``lengths[b] - 1`` down (the padding is
            read as 0). The kernels run every sequence over all T steps (reversed ones
            gathered in place first): the cost of the padded batch. The values are checked
            on the host: torch.compile breaks the graph there.
        backend: ``"triton" | "cuda" | "cpu" | "eager"`` or None (see ``ctxfast.backend``).
            None on CUDA tensors: the Triton forward and the CUDA C++ backward where both
            can run (:data:`CUDA_DEFAULT`); a backend asked for runs both directions.

    Returns:
        ``(out [T, B, P], (h_n [B, P], c_n [B, H]))`` in x's dtype: ``h_n = out[T-1]``
        (``out[0]`` when reversed; with ``lengths``, each sequence's last step), ``c_n``
        likewise. For ``T = 0``: an empty ``out`` and
        copies of ``hx`` (zeros if None). Differentiable w.r.t. x, hx and every weight.
        ``h_n`` and ``c_n`` are copies; ``out`` is saved for the backward (on the kernel
        backends, as cuDNN's ``nn.LSTM`` saves it): changed in place before ``backward()``
        it raises torch's "modified by an inplace operation" (``nn.LSTM`` on a CPU and
        the eager backend do not save it).

    Raises:
        TypeError, ValueError: a wrong type, rank, shape, dtype or device (naming the
            argument and the expected shape), ``weight_dropout`` outside ``[0, 1)``, a clip
            <= 0 — before any kernel runs.
        ctxfast.BackendUnavailable: the backend asked for cannot run.
    """
    # under torch.autocast: the autocast dtype, as nn.LSTM (on autocast's lower-precision
    # list) runs (WeightDropLSTM casts before calling, with autocast off: nothing here then)
    # (a 0/1 weight_mask in a float dtype follows w_hh's: exact in any)
    if isinstance(hx, (tuple, list)) and len(hx) == 2:
        x, h0_, c0_, w_ih, w_hh, b_ih, b_hh, w_hr, weight_mask = _autocast(
            x, *hx, w_ih, w_hh, b_ih, b_hh, w_hr, weight_mask)
        hx = (h0_, c0_)
    else:
        x, w_ih, w_hh, b_ih, b_hh, w_hr, weight_mask = _autocast(
            x, w_ih, w_hh, b_ih, b_hh, w_hr, weight_mask)
    cc, pc = _check(x, hx, w_ih, w_hh, b_ih, b_hh, w_hr, weight_mask, weight_dropout,
                    cell_clip, proj_clip, reverse)
    lens = _check_lengths(lengths, x.shape[0], x.shape[1])         # [B] int64 (CPU) or None
    if lens is not None:    # the padding read as 0: NaN / inf there made every gradient NaN
        pad = torch.arange(x.shape[0])[:, None] >= lens            # [T, B] (CPU)
        x = x.masked_fill(pad.to(x.device)[..., None], 0)
    asked, source = _dispatch.requested_backend(backend)
    if asked in ("cpu", "cuda") and not _NATIVE:
        raise _dispatch.BackendUnavailable(
            f"ctxfast.lstm: backend {asked!r} (from {source}) cannot run: ctxfast._C has no "
            "lstm_recurrence_native op (rebuild the extension with the LSTM kernels: "
            "`pip install --no-build-isolation -e .`)")
    name = _fp64_route(_dispatch.resolve("lstm", x.device, backend), asked, source, x)
    if name == "eager":         # the mask a constant, as the kernels take it
        weight_mask = None if weight_mask is None else weight_mask.detach()
        return _ref.lstm(x, hx, w_ih, w_hh, b_ih, b_hh, w_hr, weight_mask=weight_mask,
                         weight_dropout=weight_dropout, cell_clip=cell_clip,
                         proj_clip=proj_clip, reverse=reverse, lengths=lens)
    T, B, _ = x.shape
    H, P = w_hh.shape[0] // 4, w_hh.shape[1]
    if hx is None:
        hx = (x.new_zeros((B, P)), x.new_zeros((B, H)))
    h0, c0 = hx
    if T == 0:                  # (copies, as for T > 0: never the caller's tensors)
        return x.new_empty((0, B, P)), (h0.clone(), c0.clone())
    mask, scale = None, 1.0
    if weight_mask is not None:
        mask = weight_mask.detach().to(w_hh.dtype)
        scale = 1.0 / (1.0 - float(weight_dropout))
    idx = None
    if lens is not None:
        lens = lens.to(x.device)                                   # [B]
        t = torch.arange(T, device=x.device)[:, None]              # [T, 1]
        valid = t < lens                                           # [T, B]: not padding
        if reverse:     # each sequence reversed within its length (its own inverse), run on
            idx = torch.where(valid, lens - 1 - t, t)[..., None]   # [T, B, 1]
            x = x.gather(0, idx.expand_as(x))                      # [T, B, I]
            reverse = False
    bias = b_ih if b_hh is None else b_hh if b_ih is None else b_ih + b_hh
    xw = _projection(x, w_ih, bias, name)                         # [T, B, 4H]
    route = _default_route(name, asked, x)
    if route == "split":
        op = _recurrence_split                  # Triton forward, CUDA C++ backward
    else:
        op = _recurrence_triton if route == "triton" else _recurrence_native
    out, cells, _ = op(xw, h0, c0, w_hh, w_hr, mask, scale, cc, pc, reverse)
    if lens is None:
        last = 0 if reverse else T - 1
        # copies, as nn.LSTM's: views would keep all T steps alive with a carried state
        return out, (out[last].clone(), cells[last].clone())
    rows = torch.arange(B, device=x.device)
    h_n, c_n = out[lens - 1, rows], cells[lens - 1, rows]          # [B, P], [B, H]
    if idx is not None:
        out = out.gather(0, idx.expand_as(out))                    # back in time order
    return torch.where(valid[..., None], out, 0), (h_n, c_n)       # [T, B, P]: 0 past ends
