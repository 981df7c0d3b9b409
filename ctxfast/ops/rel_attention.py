"""``ctxfast.rel_attention``: Transformer-XL / XLNet relative-position attention with the
relative shift done inside the kernel (no ``[Tq, Tk]`` position-score tensor, forward or
backward), as a drop-in autograd op.

Registered ops (under ``torch.ops.ctxfast``, with fakes and autograd):

* ``rel_attention_fwd_triton(...) -> (out, lse)``
* ``rel_attention_bwd_triton(...) -> (dq, dk, dv, dr, d_r_w_bias, d_r_r_bias, d_seg_embed,
  d_r_s_bias)`` (the last two are zeros when there are no segments)

The ``eager`` backend is ``ctxfast.reference.rel_attention`` (direct indexing by distance).

Decoding (a few queries, long memory): on CUDA the Triton forward splits the keys over
programs and combines the partial outputs (``kernels.rel_attention.decode_splits`` picks
the count: 1 on CPU and in the interpreter). The split count is not an argument of the op
(as for ``ctxfast.attention``): ``kernels.rel_attention.rel_attention_forward(...,
num_splits=n)`` forces it, and tests force it through the op by patching
``decode_splits``. The backward is the same for every split count.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _dispatch
from .. import reference as _ref
from ._common import autocast as _autocast
from ._common import softmax_scale as _softmax_scale
from ._common import call_in_backward as _call_in_backward
from ._common import on_tensor_device as _on_device
from ._common import check_attention as _check_attention
from ._common import check_int32_extent as _check_int32_extent
from ._common import check_int32_ids as _check_int32_ids
from ._common import register_autograd as _register_autograd
from ._common import resolve as _resolve
from ._common import shape as _shape
from ._common import uniform as _uniform
from .attention import draw_seed

# The C++ CPU kernels (csrc/cpu/attention.cpp) exist only once the extension was rebuilt
# with them.
_CPU = _dispatch.c_available() and hasattr(torch.ops.ctxfast, "rel_attention_fwd_cpu")

# Defaults: Triton on CUDA (not yet measured on a GPU); on CPU the C++ kernel
# (csrc/cpu/attention.cpp; segments and dropout included), which the CPU records measure
# (benchmarks/results/amd-epyc-2-threads/2026-11-26.md, 2 threads, fp32, H 8, D 64, Tq
# 128-1024 with memory Tq): 2.7-5.2x the original einsum + pad-and-view formulation forward,
# 1.95-2.85x forward+backward, 1.44-1.63x the time of the cpu attention kernel on the same
# q, k, v.
_dispatch.register_op("rel_attention",
                      # (cpu listed when ctxfast._C failed to import: asked for, it says so)
                      supported=("triton", "cpu", "eager")
                      if _CPU or not _dispatch.c_available() else ("triton", "eager"),
                      cpu_default=("cpu", "eager") if _CPU else ("eager",),
                      cuda_default=("triton", "eager"))


@torch.library.custom_op("ctxfast::rel_attention_fwd_triton", mutates_args=())
@_on_device
def _rel_fwd(q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor, r_r_bias: Tensor,
             key_padding_mask: Optional[Tensor], perm_rank: Optional[Tensor],
             seg_q: Optional[Tensor], seg_k: Optional[Tensor], seg_embed: Optional[Tensor],
             r_s_bias: Optional[Tensor], causal: bool, pos_start: int, window: int,
             perm_strict: bool, scale: float, dropout_p: float,
             seed: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    from ctxfast.kernels.rel_attention import rel_attention_forward  # imports triton
    return rel_attention_forward(
        q, k, v, r, r_w_bias, r_r_bias, causal=causal, pos_start=pos_start,
        window=window or None, key_padding_mask=key_padding_mask, perm_rank=perm_rank,
        perm_strict=perm_strict, seg_q=seg_q, seg_k=seg_k, seg_embed=seg_embed,
        r_s_bias=r_s_bias, scale=scale, dropout_p=dropout_p, seed=seed)


@_rel_fwd.register_fake
def _(q, k, v, r, r_w_bias, r_r_bias, key_padding_mask, perm_rank, seg_q, seg_k, seg_embed,
      r_s_bias, causal, pos_start, window, perm_strict, scale, dropout_p, seed):
    B, H, Tq, D = q.shape
    return q.new_empty((B, H, Tq, D)), q.new_empty((B, H, Tq), dtype=torch.float32)


@torch.library.custom_op("ctxfast::rel_attention_bwd_triton", mutates_args=())
@_on_device
def _rel_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor,
             r_r_bias: Tensor, out: Tensor, lse: Tensor, key_padding_mask: Optional[Tensor],
             perm_rank: Optional[Tensor], seg_q: Optional[Tensor], seg_k: Optional[Tensor],
             seg_embed: Optional[Tensor], r_s_bias: Optional[Tensor], causal: bool,
             pos_start: int, window: int, perm_strict: bool, scale: float, dropout_p: float,
             seed: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                              Tensor, Tensor]:
    from ctxfast.kernels.rel_attention import rel_attention_backward  # imports triton
    grads = rel_attention_backward(
        do, q, k, v, r, r_w_bias, r_r_bias, out, lse, causal=causal, pos_start=pos_start,
        window=window or None, key_padding_mask=key_padding_mask, perm_rank=perm_rank,
        perm_strict=perm_strict, seg_q=seg_q, seg_k=seg_k, seg_embed=seg_embed,
        r_s_bias=r_s_bias, scale=scale, dropout_p=dropout_p, seed=seed)
    H, D = r_w_bias.shape
    d_se = grads[6] if grads[6] is not None else q.new_zeros((2, H, D))
    d_rsb = grads[7] if grads[7] is not None else q.new_zeros((H, D))
    return (*grads[:6], d_se, d_rsb)


@_rel_bwd.register_fake
def _(do, q, k, v, r, r_w_bias, r_r_bias, out, lse, key_padding_mask, perm_rank, seg_q, seg_k,
      seg_embed, r_s_bias, causal, pos_start, window, perm_strict, scale, dropout_p, seed):
    H, D = r_w_bias.shape
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            r.new_empty(r.shape), r_w_bias.new_empty((H, D)), r_r_bias.new_empty((H, D)),
            q.new_empty((2, H, D)), q.new_empty((H, D)))


def _setup_context(ctx, inputs, output):
    (q, k, v, r, u, w, kpm, rank, seg_q, seg_k, seg_embed, r_s_bias,
     causal, pos_start, window, perm_strict, scale, dropout_p, seed) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, r, u, w, out, lse, kpm, rank, seg_q, seg_k, seg_embed,
                          r_s_bias, seed)
    ctx.args = (causal, pos_start, window, perm_strict, scale, dropout_p)
    ctx.has_seg = seg_embed is not None


def _backward(ctx, grad_out, grad_lse):
    q, k, v, r, u, w, out, lse, kpm, rank, seg_q, seg_k, se, rsb, seed = ctx.saved_tensors
    causal, pos_start, window, perm_strict, scale, dropout_p = ctx.args
    dq, dk, dv, dr, du, dw, dse, drsb = _call_in_backward(
        torch.ops.ctxfast.rel_attention_bwd_triton,
        grad_out, q, k, v, r, u, w, out, lse, kpm, rank, seg_q, seg_k, se, rsb, causal,
        pos_start, window, perm_strict, scale, dropout_p, seed, name="rel_attention")
    if not ctx.has_seg:
        dse = drsb = None
    return (dq, dk, dv, dr, du, dw, None, None, None, None, dse, drsb,
            None, None, None, None, None, None, None)


_fwd_triton = _register_autograd(_rel_fwd, _backward, _setup_context,
                                 first_order="rel_attention")


# C++ CPU ops (schemas in csrc/bindings/module_cpu.cpp): ``rel_attention_fwd_cpu(q, k, v, r,
# r_w_bias, r_r_bias, key_padding_mask, perm_rank, seg_q, seg_k, seg_embed, r_s_bias, causal,
# pos_start, window, perm_strict, scale, dropout_p, seed) -> (out, lse)`` and
# ``rel_attention_bwd_cpu(do, q, k, v, r, r_w_bias, r_r_bias, out, lse, <the same masks,
# segments and arguments>) -> (dq, dk, dv, dr, d_r_w_bias, d_r_r_bias, d_seg_embed,
# d_r_s_bias)`` (the last two empty without segments). Window 0 = none. Dropout: the Triton
# kernels' Philox mask for the same seed.

def _cpu_fwd_fake(q, k, v, r, u, w, kpm, rank, seg_q, seg_k, seg_embed, r_s_bias, causal,
                  pos_start, window, perm_strict, scale, dropout_p, seed):
    B, H, Tq, D = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((B, H, Tq, D)), q.new_empty((B, H, Tq), dtype=lse_dtype)


def _cpu_bwd_fake(do, q, k, v, r, u, w, out, lse, kpm, rank, seg_q, seg_k, seg_embed,
                  r_s_bias, causal, pos_start, window, perm_strict, scale, dropout_p, seed):
    has_seg = seg_embed is not None
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            r.new_empty(r.shape), u.new_empty(u.shape), w.new_empty(w.shape),
            q.new_empty(seg_embed.shape if has_seg else (0,)),
            q.new_empty(r_s_bias.shape if has_seg else (0,)))


def _cpu_setup_context(ctx, inputs, output):
    (q, k, v, r, u, w, kpm, rank, seg_q, seg_k, seg_embed, r_s_bias, causal, pos_start, window,
     perm_strict, scale, dropout_p, seed) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, r, u, w, out, lse, kpm, rank, seg_q, seg_k, seg_embed,
                          r_s_bias, seed)
    ctx.args = (causal, pos_start, window, perm_strict, scale, dropout_p)


# The same formula runs in C++ for eager code (RelAttentionCpuGrad in
# csrc/bindings/rel_attention_cpu.cpp): keep the two in step; tests/test_grad_call.py checks
# that they agree.
def _cpu_backward(ctx, grad_out, grad_lse):
    q, k, v, r, u, w, out, lse, kpm, rank, seg_q, seg_k, seg_embed, r_s_bias, seed = \
        ctx.saved_tensors
    causal, pos_start, window, perm_strict, scale, dropout_p = ctx.args
    dq, dk, dv, dr, du, dw, dse, drsb = _call_in_backward(
        torch.ops.ctxfast.rel_attention_bwd_cpu,
        grad_out, q, k, v, r, u, w, out, lse, kpm, rank, seg_q, seg_k, seg_embed, r_s_bias,
        causal, pos_start, window, perm_strict, scale, dropout_p, seed, name="rel_attention")
    if seg_embed is None:
        dse = drsb = None
    return (dq, dk, dv, dr, du, dw, None, None, None, None, dse, drsb,
            None, None, None, None, None, None, None)


if _CPU:
    torch.library.register_fake("ctxfast::rel_attention_fwd_cpu")(_cpu_fwd_fake)
    torch.library.register_fake("ctxfast::rel_attention_bwd_cpu")(_cpu_bwd_fake)
    # rel_attention_cpu_grad: the same two ops and formula as a C++ autograd Function
    # (csrc/bindings/rel_attention_cpu.cpp): the Python Function and its backward cost ~0.2
    # ms of a forward+backward at B2 H8 T128 (benchmarks/NOTES.md)
    _fwd_cpu = _register_autograd(
        "ctxfast::rel_attention_fwd_cpu", _cpu_backward, _cpu_setup_context,
        fast=(torch.ops.ctxfast.rel_attention_cpu_grad.default
              if hasattr(torch.ops.ctxfast, "rel_attention_cpu_grad") else None),
        first_order="rel_attention")


def _check(q, k, v, r, r_w_bias, r_r_bias, causal, pos_start, key_padding_mask, perm_rank,
           perm_stream, seg_q, seg_k, seg_embed, r_s_bias, dropout_p, scale, window):
    _check_attention(q, k, v, causal, key_padding_mask, perm_rank, perm_stream, dropout_p,
                     scale, op="rel_attention")
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if Tk < Tq:     # causal or not: the distances count from [memory; current]
        raise ValueError(f"rel_attention: the keys are [memory; current] (mem_len = Tk - Tq), "
                         f"so Tk >= Tq is needed; got q {_shape(q)}, k {_shape(k)}")
    for name, t, shape in (("r_w_bias", r_w_bias, (H, D)), ("r_r_bias", r_r_bias, (H, D))):
        if not isinstance(t, Tensor) or _shape(t) != shape:
            raise ValueError(f"rel_attention: {name} must have shape [H, D] = [{H}, {D}], got "
                             f"{_shape(t) if isinstance(t, Tensor) else type(t).__name__}")
    if not isinstance(r, Tensor) or r.dim() != 3 or r.shape[0] != H or r.shape[2] != D:
        raise ValueError(f"rel_attention: r must have shape [H, R, D] = [{H}, R, {D}], got "
                         f"{_shape(r) if isinstance(r, Tensor) else type(r).__name__}")
    for name, t in (("r", r), ("r_w_bias", r_w_bias), ("r_r_bias", r_r_bias)):
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"rel_attention: {name} must have q's dtype and device "
                            f"({q.dtype}, {q.device}), got {t.dtype}, {t.device}")
    # (a SymInt too: a length traced by torch.compile(dynamic=True) or torch.export)
    if not isinstance(pos_start, (int, torch.SymInt)) or isinstance(pos_start, bool):
        raise TypeError(f"rel_attention: pos_start must be an int, got {type(pos_start).__name__}")
    if window is not None and (isinstance(window, bool)
                               or not isinstance(window, (int, torch.SymInt)) or window < 1):
        raise ValueError(f"rel_attention: window must be None or an int >= 1 (the most keys a "
                         f"query sees: distance < window), got {window!r}")
    R = r.shape[1]
    lowest = pos_start - (Tk - 1)                     # row of the largest distance, Tk - 1
    highest = pos_start if causal else pos_start + Tq - 1   # distance 0, or 1 - Tq
    if Tq > 0 and (lowest < 0 or highest >= R):      # (no query: no distance is needed)
        raise ValueError(
            f"rel_attention: r too short for the distances: rows {lowest}..{highest} of r are "
            f"needed (pos_start={pos_start}, Tq={Tq}, Tk={Tk}, causal={causal}), r has R={R} "
            f"rows; Transformer-XL uses pos_start=Tk-1, R=Tk; XLNet pos_start=Tk, R=Tk+Tq")
    seg = (seg_q, seg_k, seg_embed, r_s_bias)
    if any(t is not None for t in seg):
        if any(t is None for t in seg):
            raise ValueError("rel_attention: seg_q, seg_k, seg_embed and r_s_bias go together")
        for name, t, shape in (("seg_q", seg_q, (B, Tq)), ("seg_k", seg_k, (B, Tk))):
            if not isinstance(t, Tensor) or t.dtype.is_floating_point or _shape(t) != shape:
                raise ValueError(f"rel_attention: {name} must be an integer tensor of shape "
                                 f"{list(shape)}, got {getattr(t, 'dtype', type(t).__name__)} "
                                 f"{_shape(t) if isinstance(t, Tensor) else ''}")
            if t.device != q.device:
                raise ValueError(f"rel_attention: {name} must be on {q.device}, got {t.device}")
        if (not isinstance(seg_embed, Tensor) or not isinstance(r_s_bias, Tensor)
                or _shape(seg_embed) != (2, H, D) or _shape(r_s_bias) != (H, D)):
            got = [_shape(t) if isinstance(t, Tensor) else type(t).__name__
                   for t in (seg_embed, r_s_bias)]
            raise ValueError(f"rel_attention: seg_embed must be a tensor [2, H, D] = "
                             f"[2, {H}, {D}] and r_s_bias [H, D]; got {got[0]}, {got[1]}")
        for name, t in (("seg_embed", seg_embed), ("r_s_bias", r_s_bias)):
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(f"rel_attention: {name} must have q's dtype and device "
                                f"({q.dtype}, {q.device}), got {t.dtype}, {t.device}")


def rel_attention(q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor,
                  r_r_bias: Tensor, *, causal: bool = True, pos_start: Optional[int] = None,
                  key_padding_mask: Optional[Tensor] = None, perm_rank: Optional[Tensor] = None,
                  perm_stream: str = "content", seg_q: Optional[Tensor] = None,
                  seg_k: Optional[Tensor] = None, seg_embed: Optional[Tensor] = None,
                  r_s_bias: Optional[Tensor] = None, dropout_p: float = 0.0,
                  scale: Optional[float] = None, window: Optional[int] = None,
                  generator: Optional[torch.Generator] = None,
                  backend: Optional[str] = None) -> Tensor:
    """Relative-position attention ``A = (q + u)·k + (q + v)·r_dist [+ segment term]``.

    Args:
        q: ``[B, H, Tq, D]``; k, v: ``[B, H, Tk, D]`` = ``[memory; current]``,
            ``mem_len = Tk - Tq >= 0``.
        r: ``[H, R, D]``, relative encodings projected per head; row ``m`` encodes distance
            ``pos_start - m``; the distance of query i to key j is ``mem_len + i - j``.
        r_w_bias, r_r_bias: ``[H, D]`` (u and v of the paper).
        causal: Transformer-XL's mask (``j <= i + mem_len``); XLNet uses ``False`` with
            ``perm_rank``.
        pos_start: default ``Tk - 1`` (``R = Tk``, the original code's order); XLNet's
            bidirectional form is ``pos_start = Tk``, ``R = Tk + Tq``.
        key_padding_mask, perm_rank, perm_stream, dropout_p, scale, generator, backend: as
            :func:`ctxfast.attention`.
        seg_q ``[B, Tq]``, seg_k ``[B, Tk]`` (integer segment ids), seg_embed ``[2, H, D]``,
            r_s_bias ``[H, D]``: XLNet's segment term ``(q + r_s_bias)·seg_embed[s]``,
            ``s = 0`` for the same segment, 1 otherwise. The triton backend reads ranks and
            segment ids as int32 (as ``ctxfast.attention``'s perm_rank).
        window: None, or an int >= 1: a sliding window, query i sees key j only if their
            distance ``mem_len + i - j < window`` (with ``causal``: at most ``window`` keys,
            its own position and the ones before). Transformer-XL's ``same_length`` mask
            is ``window = mem_len`` of its config. The kernels skip the key blocks outside.

    Under ``torch.autocast`` every fp32, fp16 or bf16 input (the biases and ``seg_embed``
    included) is cast to the autocast dtype, as :func:`ctxfast.attention` and
    ``F.scaled_dot_product_attention`` do (float64 is left alone, as autocast leaves it);
    otherwise all must have q's dtype.

    Returns:
        ``[B, H, Tq, D]``; gradients flow to q, k, v, r, both biases, seg_embed, r_s_bias.
    """
    q, k, v, r, r_w_bias, r_r_bias, seg_embed, r_s_bias = _autocast(
        q, k, v, r, r_w_bias, r_r_bias, seg_embed, r_s_bias)
    Tk = k.shape[2] if isinstance(k, Tensor) and k.dim() == 4 else 0
    pos_start = Tk - 1 if pos_start is None else pos_start
    _check(q, k, v, r, r_w_bias, r_r_bias, causal, pos_start, key_padding_mask, perm_rank,
           perm_stream, seg_q, seg_k, seg_embed, r_s_bias, dropout_p, scale, window)
    name = _resolve("rel_attention", q, backend)
    sm_scale = _softmax_scale(q.shape[-1], scale)
    seg = dict(seg_q=seg_q, seg_k=seg_k, seg_embed=seg_embed, r_s_bias=r_s_bias)
    if name == "cpu":
        seed = draw_seed(q.device, generator) if dropout_p > 0 else None
        out, _ = _fwd_cpu(
            q, k, v, r, r_w_bias, r_r_bias, key_padding_mask, perm_rank, seg_q, seg_k,
            seg_embed, r_s_bias, causal, pos_start, window or 0, perm_stream == "query",
            sm_scale, float(dropout_p), seed)
        return out
    if name == "eager":
        mask = None
        if dropout_p > 0:
            B, H, Tq, _ = q.shape
            mask = _uniform((B, H, Tq, Tk), generator, q.device) >= dropout_p
        return _ref.rel_attention(q, k, v, r, r_w_bias, r_r_bias, causal=causal,
                                  pos_start=pos_start, key_padding_mask=key_padding_mask,
                                  perm_rank=perm_rank, perm_stream=perm_stream, dropout_mask=mask,
                                  dropout_p=dropout_p, scale=sm_scale, window=window, **seg)
    _check_int32_ids("rel_attention", perm_rank=perm_rank, seg_q=seg_q, seg_k=seg_k)
    _check_int32_extent("rel_attention", q=q, k=k, v=v, r=r)
    seed = draw_seed(q.device, generator) if dropout_p > 0 else None
    out, _ = _fwd_triton(
        q, k, v, r, r_w_bias, r_r_bias, key_padding_mask, perm_rank, seg_q, seg_k, seg_embed,
        r_s_bias, causal, pos_start, window or 0, perm_stream == "query", sm_scale,
        float(dropout_p), seed)
    return out
