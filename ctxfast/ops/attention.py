"""``ctxfast.attention``: fused scaled-dot-product attention with causal, padding and XLNet
permutation masks and Transformer-XL memory, as a drop-in autograd op.

Registered ops (under ``torch.ops.ctxfast``, with fakes and autograd):

* ``attention_fwd_triton(q, k, v, key_padding_mask, perm_rank, causal, perm_strict, scale,
  dropout_p, seed) -> (out, lse)``
* ``attention_bwd_triton(do, q, k, v, out, lse, key_padding_mask, perm_rank, causal,
  perm_strict, scale, dropout_p, seed) -> (dq, dk, dv)``

Permutation masks without causal: both Triton ops sort the ranks once per call
(:func:`_rank_order`, a stable argsort of ``[B, Tq]``) and the kernels work in rank order,
where the mask is causal-like (``kernels/attention.py``'s docstring).

Dropout: ``seed`` (int64 ``[1]`` on q's device) keys a Philox stream; the kernels draw the
number of element ``(b, h, i, j)`` at counter ``(bh·Tq + i)·Tk + j``, so the backward
regenerates the forward's mask and ``dropout_keep_mask(seed, ...)`` reproduces it.

``attention_fwd_cpu`` / ``attention_bwd_cpu`` (and the varlen pair): the ``cpu`` backend,
C++ in ``csrc/cpu/attention.cpp`` (flash-style key tiles with an online softmax, BLAS GEMMs
on the tiles, masks from the O(T) inputs, backward from the saved log-sum-exp; dropout
with the same Philox counter as the Triton kernels, so one seed gives one mask on both;
XLNet permutation masks processed in rank order).

The ``eager`` backend is ``ctxfast.reference.attention`` (a materialised mask + softmax).
``attention_varlen`` (packed sequences) has its own pair of ops below. On CUDA the Triton
forward splits the keys over programs for decoding (few queries, long memory); the Hugging
Face attention interface is ``ctxfast.integrations.hf``.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .. import _dispatch
from .. import reference as _ref
from ._common import autocast as _autocast
from ._common import softmax_scale as _softmax_scale
from ._common import call_in_backward as _call_in_backward
from ._common import on_tensor_device as _on_device
from ._common import check_attention as _check
from ._common import check_dropout_scale as _check_dropout_scale
from ._common import check_int32_extent as _check_int32_extent
from ._common import check_int32_ids as _check_int32_ids
from ._common import check_qkv as _check_qkv
from ._common import register_autograd as _register_autograd
from ._common import resolve as _resolve
from ._common import shape as _shape
from ._common import uniform as _uniform
from ._common import values_checked as _values_checked
from ._common import MAX_HEAD_DIM  # noqa: F401  (re-exported: the Triton kernels' limit)

# The C++ CPU kernels exist only once csrc/ has them and the extension was rebuilt.
_CPU = _dispatch.c_available() and hasattr(torch.ops.ctxfast, "attention_fwd_cpu")
# cpu stays listed when ctxfast._C failed to import: asking for it then names that failure
_BACKENDS = ("triton", "cpu", "eager") if _CPU or not _dispatch.c_available() \
    else ("triton", "eager")

# Defaults: on CUDA the Triton kernel (not yet measured on a GPU: the GPU round decides); on CPU
# the C++ kernel (csrc/cpu/attention.cpp), which the CPU records measure
# (benchmarks/results/amd-epyc-2-threads/2026-11-26.md, 2 threads, fp32, D 64, T 128-2048
# and decoding steps): 1.39-2.40x F.scaled_dot_product_attention given the same mask on all
# 27 cases it can express, forward and forward+backward; 3.2-4.2x eager on XLNet
# permutation masks (eager materialises the mask and the scores). The Triton kernel runs on
# CPU only in the interpreter, for tests.
_dispatch.register_op("attention", supported=_BACKENDS,
                      cpu_default=("cpu", "eager") if _CPU else ("eager",),
                      cuda_default=("triton", "eager"))


# --------------------------------------------------------------------------- registration

def _rank_order(perm_rank: Optional[Tensor], causal: bool):
    """The Triton kernels solve a permutation mask without causal in rank order: (order,
    rank_sorted), int32 ``[B, Tq]`` (stable argsort of each row, O(B·Tq) data), computed once
    per op call (forward, and again in the backward op), or None when no order is used."""
    if perm_rank is None or causal:
        return None
    from ctxfast.kernels.attention import rank_order  # imports triton
    return rank_order(perm_rank)


@torch.library.custom_op("ctxfast::attention_fwd_triton", mutates_args=())
@_on_device
def _attention_fwd_triton(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                          perm_rank: Optional[Tensor], causal: bool, perm_strict: bool,
                          scale: float, dropout_p: float,
                          seed: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    from ctxfast.kernels.attention import attention_forward  # imports triton
    return attention_forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                             perm_rank=perm_rank, perm_strict=perm_strict, scale=scale,
                             dropout_p=dropout_p, seed=seed,
                             perm_order=_rank_order(perm_rank, causal))


@_attention_fwd_triton.register_fake
def _(q, k, v, key_padding_mask, perm_rank, causal, perm_strict, scale, dropout_p, seed):
    B, H, Tq, D = q.shape
    return q.new_empty((B, H, Tq, D)), q.new_empty((B, H, Tq), dtype=torch.float32)


@torch.library.custom_op("ctxfast::attention_bwd_triton", mutates_args=())
@_on_device
def _attention_bwd_triton(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                          lse: Tensor, key_padding_mask: Optional[Tensor],
                          perm_rank: Optional[Tensor], causal: bool, perm_strict: bool,
                          scale: float, dropout_p: float,
                          seed: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    from ctxfast.kernels.attention import attention_backward  # imports triton
    return attention_backward(do, q, k, v, out, lse, causal=causal,
                              key_padding_mask=key_padding_mask, perm_rank=perm_rank,
                              perm_strict=perm_strict, scale=scale, dropout_p=dropout_p,
                              seed=seed, perm_order=_rank_order(perm_rank, causal))


@_attention_bwd_triton.register_fake
def _(do, q, k, v, out, lse, key_padding_mask, perm_rank, causal, perm_strict, scale,
      dropout_p, seed):
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    return q.new_empty((B, H, Tq, D)), k.new_empty((B, H, Tk, D)), v.new_empty((B, H, Tk, D))


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, kpm, rank, causal, perm_strict, scale, dropout_p, seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, kpm, rank, seed)
    ctx.causal, ctx.perm_strict, ctx.scale, ctx.dropout_p = causal, perm_strict, scale, dropout_p


def _fwd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, kpm, rank, seed = ctx.saved_tensors
    dq, dk, dv = _call_in_backward(
        torch.ops.ctxfast.attention_bwd_triton,
        grad_out, q, k, v, out, lse, kpm, rank, ctx.causal, ctx.perm_strict, ctx.scale,
        ctx.dropout_p, seed, name="attention")
    return dq, dk, dv, None, None, None, None, None, None, None


_fwd_triton = _register_autograd(_attention_fwd_triton, _fwd_backward, _fwd_setup_context,
                                 first_order="attention")


# C++ CPU ops (schemas in csrc/bindings/module_cpu.cpp): ``attention_fwd_cpu(q, k, v,
# key_padding_mask, perm_rank, causal, perm_strict, scale, dropout_p, seed) -> (out, lse)``
# and ``attention_bwd_cpu(do, q, k, v, out, lse, key_padding_mask, perm_rank, causal,
# perm_strict, scale, dropout_p, seed) -> (dq, dk, dv)``; lse (natural log, +inf on rows
# that see no key) is float64 for float64 inputs, else float32. Dropout: the Triton
# kernels' Philox mask for the same seed (int64 [1] on the CPU).

def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _cpu_fwd_fake(q, k, v, key_padding_mask, perm_rank, causal, perm_strict, scale, dropout_p,
                  seed):
    B, H, Tq, D = q.shape
    return q.new_empty((B, H, Tq, D)), q.new_empty((B, H, Tq), dtype=_lse_dtype(q))


def _cpu_bwd_fake(do, q, k, v, out, lse, key_padding_mask, perm_rank, causal, perm_strict,
                  scale, dropout_p, seed):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _cpu_setup_context(ctx, inputs, output):
    q, k, v, kpm, rank, causal, perm_strict, scale, dropout_p, seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, kpm, rank, seed)
    ctx.causal, ctx.perm_strict, ctx.scale, ctx.dropout_p = causal, perm_strict, scale, dropout_p


def _cpu_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, kpm, rank, seed = ctx.saved_tensors
    dq, dk, dv = _call_in_backward(
        torch.ops.ctxfast.attention_bwd_cpu,
        grad_out, q, k, v, out, lse, kpm, rank, ctx.causal, ctx.perm_strict, ctx.scale,
        ctx.dropout_p, seed, name="attention")
    return dq, dk, dv, None, None, None, None, None, None, None


if _CPU:
    torch.library.register_fake("ctxfast::attention_fwd_cpu")(_cpu_fwd_fake)
    torch.library.register_fake("ctxfast::attention_bwd_cpu")(_cpu_bwd_fake)
    _fwd_cpu = _register_autograd("ctxfast::attention_fwd_cpu", _cpu_backward,
                                  _cpu_setup_context, first_order="attention")


# --------------------------------------------------------------------------- public op

def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              key_padding_mask: Optional[Tensor] = None, perm_rank: Optional[Tensor] = None,
              perm_stream: str = "content", dropout_p: float = 0.0,
              scale: Optional[float] = None, generator: Optional[torch.Generator] = None,
              backend: Optional[str] = None) -> Tensor:
    """Fused scaled-dot-product attention.

    Args:
        q: ``[B, H, Tq, D]``. k, v: ``[B, H, Tk, D]`` — keys are ``[memory; current]``
            and ``mem_len = Tk - Tq`` (0 for plain self-attention). fp16, bf16, fp32
            (fp64 too, for tests); any strides. The triton backend takes ``D <= 256``
            (``MAX_HEAD_DIM``; by default larger heads run on eager, asking for triton raises).
        causal: query ``i`` sees key ``j`` iff ``j <= i + mem_len`` (bottom-right aligned).
        key_padding_mask: bool ``[B, Tk]``, True = padding (``nn.MultiheadAttention``'s
            convention).
        perm_rank: integer ``[B, Tq]``: the place of each current token in XLNet's
            factorisation order (ties allowed). Memory keys are always visible; current
            key ``t`` is visible iff ``rank[t] <= rank[i]`` (``perm_stream="content"``) or
            ``rank[t] < rank[i]`` (``"query"``). The triton backend reads ranks as int32
            (values outside int32's range are refused on CPU, not checked on a GPU).
        dropout_p: attention dropout on the probabilities (after the softmax, scaled by
            ``1 / (1 - p)``). Triton: Philox keyed by a seed drawn from `generator` (see
            :func:`draw_seed`, :func:`dropout_keep_mask`), regenerated in the backward;
            cpu: the same Philox mask for the same seed (one int64 drawn a call). Eager:
            ``torch.rand`` with `generator`, ``B*H*Tq*Tk`` numbers a call: another mask,
            and every later draw from that RNG (a model's other dropouts) shifts too.
        scale: softmax scale, default ``D ** -0.5``.
        generator: RNG for the dropout seed or mask (default: torch's global RNG). Under
            ``torch.utils.checkpoint``, which restores only torch's default generators, a
            generator of your own gives the recomputation another mask (wrong gradients,
            as for torch's own ops given one): leave it None there.
        backend: ``"triton" | "cpu" | "eager"`` or None (see ``ctxfast.backend``; on CPU
            tensors the default is ``cpu``).

    Returns:
        ``[B, H, Tq, D]``. A query that sees no key gets zeros (and passes zero gradient).
    """
    q, k, v = _autocast(q, k, v)
    _check(q, k, v, causal, key_padding_mask, perm_rank, perm_stream, dropout_p, scale)
    name = _resolve("attention", q, backend)
    sm_scale = _softmax_scale(q.shape[-1], scale)
    if name == "cpu":
        seed = draw_seed(q.device, generator) if dropout_p > 0 else None
        out, _ = _fwd_cpu(
            q, k, v, key_padding_mask, perm_rank, causal, perm_stream == "query", sm_scale,
            float(dropout_p), seed)
        return out
    if name == "eager":
        mask = None
        if dropout_p > 0:
            B, H, Tq, _ = q.shape
            keep = _uniform((B, H, Tq, k.shape[2]), generator, q.device) >= dropout_p
            mask = keep
        return _ref.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                              perm_rank=perm_rank, perm_stream=perm_stream,
                              dropout_mask=mask, dropout_p=dropout_p, scale=sm_scale)
    _check_int32_ids("attention", perm_rank=perm_rank)
    _check_int32_extent("attention", q=q, k=k, v=v)
    seed = draw_seed(q.device, generator) if dropout_p > 0 else None
    out, _ = _fwd_triton(
        q, k, v, key_padding_mask, perm_rank, causal, perm_stream == "query", sm_scale,
        float(dropout_p), seed)
    return out


def draw_seed(device, generator: Optional[torch.Generator] = None) -> Tensor:
    """The dropout seed the Triton backend draws for one call: int64 ``[1]`` on `device`,
    from `generator` (or torch's global RNG). Call it with an identically seeded generator
    to get the seed again and :func:`dropout_keep_mask` to get the mask."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError("generator (the dropout mask's) must be a torch.Generator or None, "
                        f"got {type(generator).__name__}")
    gen_device = generator.device if generator is not None else torch.device(device)
    seed = torch.randint(0, 2**62, (1,), generator=generator, device=gen_device,
                         dtype=torch.int64)
    return seed.to(device)


@_on_device
def dropout_keep_mask(seed: Tensor, B: int, H: int, Tq: int, Tk: int, dropout_p: float) -> Tensor:
    """Bool ``[B, H, Tq, Tk]``, True = kept: the mask the Triton kernels apply for `seed`.
    Materialises O(Tq·Tk): for tests and debugging."""
    from ctxfast.kernels.attention import dropout_keep_mask as _keep_mask  # imports triton
    return _keep_mask(seed, B, H, Tq, Tk, dropout_p)


# --------------------------------------------------------------------------- packed (varlen)

_dispatch.register_op("attention_varlen", supported=_BACKENDS,
                      cpu_default=("cpu", "eager") if _CPU else ("eager",),
                      cuda_default=("triton", "eager"))


@torch.library.custom_op("ctxfast::attention_varlen_fwd_triton", mutates_args=())
@_on_device
def _attention_varlen_fwd_triton(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                 cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                 causal: bool, scale: float, dropout_p: float,
                                 seed: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    from ctxfast.kernels.attention import attention_varlen_forward  # imports triton
    return attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal=causal, scale=scale,
                                    dropout_p=dropout_p, seed=seed)


@_attention_varlen_fwd_triton.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
      dropout_p, seed):
    total_q, H, D = q.shape
    return q.new_empty((total_q, H, D)), q.new_empty((H, total_q), dtype=torch.float32)


@torch.library.custom_op("ctxfast::attention_varlen_bwd_triton", mutates_args=())
@_on_device
def _attention_varlen_bwd_triton(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                 lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                 max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                                 scale: float, dropout_p: float,
                                 seed: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    from ctxfast.kernels.attention import attention_varlen_backward  # imports triton
    return attention_varlen_backward(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, causal=causal, scale=scale,
                                     dropout_p=dropout_p, seed=seed)


@_attention_varlen_bwd_triton.register_fake
def _(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      scale, dropout_p, seed):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed)
    ctx.args = (max_q, max_k, causal, scale, dropout_p)


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k, seed = ctx.saved_tensors
    max_q, max_k, causal, scale, dropout_p = ctx.args
    dq, dk, dv = _call_in_backward(
        torch.ops.ctxfast.attention_varlen_bwd_triton,
        grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed,
        name="attention_varlen")
    return (dq, dk, dv) + (None,) * 8


_varlen_fwd_triton = _register_autograd(_attention_varlen_fwd_triton, _varlen_backward,
                                        _varlen_setup_context, first_order="attention_varlen")


# C++ CPU ops: ``attention_varlen_fwd_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, causal,
# scale, max_seqlen_q, max_seqlen_k, dropout_p, seed) -> (out, lse [H, total_q])`` and
# ``attention_varlen_bwd_cpu(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale,
# max_seqlen_q, max_seqlen_k, dropout_p, seed) -> (dq, dk, dv)``. Dropout: the Triton varlen
# kernels' mask for the same seed (counters laid out by max_seqlen_q / _k).

def _cpu_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, max_seqlen_q,
                         max_seqlen_k, dropout_p, seed):
    total_q, H, D = q.shape
    return q.new_empty((total_q, H, D)), q.new_empty((H, total_q), dtype=_lse_dtype(q))


def _cpu_varlen_bwd_fake(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale,
                         max_seqlen_q, max_seqlen_k, dropout_p, seed):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _cpu_varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, causal, scale, max_q, max_k, dropout_p, seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed)
    ctx.args = (causal, scale, max_q, max_k, dropout_p)


def _cpu_varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k, seed = ctx.saved_tensors
    dq, dk, dv = _call_in_backward(
        torch.ops.ctxfast.attention_varlen_bwd_cpu,
        grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.args, seed, name="attention_varlen")
    return dq, dk, dv, None, None, None, None, None, None, None, None


if _CPU:
    torch.library.register_fake("ctxfast::attention_varlen_fwd_cpu")(_cpu_varlen_fwd_fake)
    torch.library.register_fake("ctxfast::attention_varlen_bwd_cpu")(_cpu_varlen_bwd_fake)
    _varlen_fwd_cpu = _register_autograd("ctxfast::attention_varlen_fwd_cpu",
                                         _cpu_varlen_backward, _cpu_varlen_setup_context,
                                         first_order="attention_varlen")


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                  scale):
    _check_qkv("attention_varlen", q, k, v, "[total, H, D]")
    if k.shape[1:] != q.shape[1:] or v.shape != k.shape:
        raise ValueError(f"attention_varlen: k, v must have shape [total_k, H, D] = "
                         f"[total_k, {q.shape[1]}, {q.shape[2]}], got k {_shape(k)}, v {_shape(v)}")
    if (isinstance(cu_seqlens_q, Tensor) and isinstance(cu_seqlens_k, Tensor)
            and cu_seqlens_q.numel() != cu_seqlens_k.numel()):
        raise ValueError("attention_varlen: cu_seqlens_q and cu_seqlens_k must have the same "
                         f"length B + 1, got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    for name, cu, total, mx in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
        if (not isinstance(cu, Tensor) or cu.dtype not in (torch.int32, torch.int64)
                or cu.dim() != 1 or cu.numel() < 1):
            raise TypeError(f"attention_varlen: {name} must be an int32 or int64 tensor "
                            f"[B + 1], got {getattr(cu, 'dtype', type(cu).__name__)}")
        if cu.device != q.device:
            raise ValueError(f"attention_varlen: {name} must be on {q.device}, got {cu.device}")
        # guard_or_false: a max_seqlen traced from data (torch.compile) is not guarded on
        if not isinstance(mx, (int, torch.SymInt)) or isinstance(mx, bool):
            raise TypeError(f"attention_varlen: max_seqlen for {name} must be an int, got "
                            f"{type(mx).__name__}")
        if guard_or_false(mx < 0):
            raise ValueError(f"attention_varlen: max_seqlen for {name} must be >= 0, got {mx}")
        if _values_checked(cu):   # on CPU: on CUDA a host sync per call (not checked there)
            vals = cu.tolist()
            lens = [b - a for a, b in zip(vals, vals[1:])]
            if vals[0] != 0 or any(n < 0 for n in lens) or vals[-1] > total:
                raise ValueError(f"attention_varlen: {name} must start at 0, not decrease and "
                                 f"end at most at {total}, got {vals}")
            if lens and max(lens) > mx:
                raise ValueError(f"attention_varlen: a sequence of {name} has length "
                                 f"{max(lens)} > max_seqlen {mx}")
    _check_dropout_scale("attention_varlen", dropout_p, scale)


def _varlen_rows(cu: Tensor, total) -> Tuple[Tensor, Tensor, Tensor]:
    """Of each of ``total`` packed rows: its sequence (``B`` = outside every sequence) and
    its place in that sequence, each ``[total]``; and the sequences' lengths ``[B + 1]``
    (the last 0: outside)."""
    cu = cu.long()
    lens = F.pad(cu[1:] - cu[:-1], (0, 1))                              # [B + 1]
    start = F.pad(cu[:-1], (0, 1))                                      # [B + 1]
    row = torch.arange(total, device=cu.device)                         # [total]
    seq = torch.searchsorted(cu[1:].contiguous(), row, right=True)      # [total], in [0, B]
    return seq, row - start[seq], lens


def _varlen_eager_traced(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, dropout_p, sm_scale,
                         generator):
    """The eager backend's attention_varlen as torch.compile traces it: one masked attention
    over all packed rows (``[H, total_q, total_k]`` scores) instead of a loop over sequences
    sliced at their values, which dynamo cannot trace without a graph break. The same
    visibility and zeros as the loop; dropout draws its own mask."""
    seq_q, pos_q, lens_q = _varlen_rows(cu_seqlens_q, q.shape[0])
    seq_k, pos_k, lens_k = _varlen_rows(cu_seqlens_k, k.shape[0])
    inside = seq_q < cu_seqlens_q.numel() - 1                           # [total_q]
    visible = (seq_q[:, None] == seq_k[None, :]) & inside[:, None]      # [total_q, total_k]
    if causal:   # bottom-right aligned per sequence: key j <= i + (len_k - len_q)
        last = pos_q + lens_k[seq_q] - lens_q[seq_q]                    # [total_q]
        visible = visible & (pos_k[None, :] <= last[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale              # [H, total_q, total_k]
    p = _ref.masked_softmax(scores.masked_fill(~visible, float("-inf")))  # empty rows: 0
    if dropout_p > 0:
        keep = _uniform(p.shape, generator, q.device) >= dropout_p
        p = p * keep / (1.0 - dropout_p)
    return torch.einsum("hqk,khd->qhd", p.to(v.dtype), v)               # [total_q, H, D]


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, dropout_p: float = 0.0,
                     scale: Optional[float] = None, generator: Optional[torch.Generator] = None,
                     backend: Optional[str] = None) -> Tensor:
    """Attention over packed sequences (FlashAttention's varlen layout): no padding waste.

    Args:
        q: ``[total_q, H, D]``; k, v: ``[total_k, H, D]``. Sequence ``b`` is rows
            ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of q and the same of
            ``cu_seqlens_k`` for k, v (int32 ``[B + 1]``, starting at 0). Their values
            (non-decreasing, within the totals and the max lengths) are checked on CPU
            tensors only: on a GPU that check would synchronise the device at every call,
            so there, as in FlashAttention, they are the caller's to get right.
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (ints; under
            torch.compile they may be traced from data, e.g. ``int(lens.max())``).
        causal: per sequence, bottom-right aligned: query i sees key j iff
            ``j <= i + (len_k - len_q)``.
        dropout_p, scale, generator, backend: as :func:`attention`.

    Returns:
        ``[total_q, H, D]``; rows outside every sequence, and queries that see no key, are 0.
    """
    q, k, v = _autocast(q, k, v)
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                  scale)
    name = _resolve("attention_varlen", q, backend)
    sm_scale = _softmax_scale(q.shape[-1], scale)
    if name == "cpu":
        seed = draw_seed(q.device, generator) if dropout_p > 0 else None
        out, _ = _varlen_fwd_cpu(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal, sm_scale, int(max_seqlen_q),
            int(max_seqlen_k), float(dropout_p), seed)
        return out
    if name == "eager" and torch.compiler.is_compiling():
        return _varlen_eager_traced(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, dropout_p,
                                    sm_scale, generator)
    if name == "eager":
        # zeros for rows no sequence covers, in q's graph (zero gradient) even with no
        # sequence at all (cu_seqlens [0]), as the cpu and triton ops
        out = torch.where(torch.zeros((), dtype=torch.bool, device=q.device), q, 0.0)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            # [T, H, D] -> [1, H, T, D]
            qb, kb, vb = (t[s:e].transpose(0, 1).unsqueeze(0) for t, s, e in
                          ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]), (v, ck[b], ck[b + 1])))
            mask = None
            if dropout_p > 0:
                mask = _uniform((1, q.shape[1], qb.shape[2], kb.shape[2]), generator,
                                q.device) >= dropout_p
            ob = _ref.attention(qb, kb, vb, causal=causal, dropout_mask=mask,
                                dropout_p=dropout_p, scale=sm_scale)
            out = out.index_copy(0, torch.arange(cq[b], cq[b + 1], device=q.device),
                                 ob.squeeze(0).transpose(0, 1))
        return out
    _check_int32_extent("attention_varlen", q=q, k=k, v=v)
    seed = draw_seed(q.device, generator) if dropout_p > 0 else None
    # int32 with a unit stride: the kernels read cu[b] as element b
    cu_q, cu_k = (cu.to(torch.int32).contiguous() for cu in (cu_seqlens_q, cu_seqlens_k))
    out, _ = _varlen_fwd_triton(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal,
                                sm_scale, float(dropout_p), seed)
    return out
