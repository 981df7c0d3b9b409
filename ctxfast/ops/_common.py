"""Helpers shared by the ops in ``ctxfast.ops``: the float dtypes the ops accept, the
argument checks of attention (which rel_attention extends), backend resolution with the
float64-on-CUDA rule, and autocast casting. One definition each, imported by the op files.
"""
from typing import Optional

import torch
from torch import Tensor

from .. import _dispatch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def check_qkv(op: str, q, k, v, layout: str) -> None:
    """Types, rank (that of `layout`, e.g. "[B, H, T, D]"), dtype and device of q, k, v."""
    rank = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{op}: {name} must have shape {layout} (rank {rank}), got "
                             f"shape {shape(t)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float16, bfloat16, float32 or float64, "
                            f"got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v must be on one device, got {q.device}, "
                         f"{k.device}, {v.device}")


def check_attention(q, k, v, causal, key_padding_mask, perm_rank, perm_stream, dropout_p, scale):
    check_qkv("attention", q, k, v, "[B, H, T, D]")
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if k.shape[:2] != q.shape[:2] or k.shape[3] != D:
        raise ValueError(f"attention: k must have shape [B, H, Tk, D] = [{B}, {H}, Tk, {D}] "
                         f"to match q {shape(q)}, got {shape(k)}")
    if v.shape[:3] != k.shape[:3] or v.shape[3] != D:
        raise ValueError(f"attention: v must have shape [B, H, Tk, D] = {list(k.shape)} to "
                         f"match k (head dims of q, k, v must agree), got {shape(v)}")
    if (causal or perm_rank is not None) and Tk < Tq:
        raise ValueError(f"attention: with causal or perm_rank the keys are [memory; current], "
                         f"so Tk >= Tq is needed; got q {shape(q)}, k {shape(k)}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("attention: key_padding_mask must be a bool tensor [B, Tk] "
                            "(True = padding)")
        if shape(key_padding_mask) != (B, Tk):
            raise ValueError(f"attention: key_padding_mask must have shape [B, Tk] = "
                             f"[{B}, {Tk}], got {shape(key_padding_mask)}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"attention: key_padding_mask must be on {q.device}, got "
                             f"{key_padding_mask.device}")
    if perm_rank is not None:
        if (not isinstance(perm_rank, Tensor) or perm_rank.dtype.is_floating_point
                or perm_rank.dtype.is_complex or perm_rank.dtype == torch.bool):
            raise TypeError("attention: perm_rank must be an integer tensor [B, Tq], got "
                            f"{getattr(perm_rank, 'dtype', type(perm_rank).__name__)}")
        if shape(perm_rank) != (B, Tq):
            raise ValueError(f"attention: perm_rank must have shape [B, Tq] = [{B}, {Tq}], "
                             f"got {shape(perm_rank)}")
        if perm_rank.device != q.device:
            raise ValueError(f"attention: perm_rank must be on {q.device}, got {perm_rank.device}")
    if perm_stream not in ("content", "query"):
        raise ValueError(f"attention: perm_stream must be 'content' or 'query', got "
                         f"{perm_stream!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1), got {dropout_p}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"attention: scale must be a float or None, got {type(scale).__name__}")


# The Triton kernels keep a whole head-dim row of q, k, v and the output accumulator in one
# program (BLOCK_D = next power of two >= D): beyond 256 they exceed a GPU's registers and
# shared memory. The eager backend has no such limit.
MAX_HEAD_DIM = 256


def resolve(op: str, q: Tensor, backend: Optional[str]) -> str:
    """``_dispatch.resolve``, except where the Triton kernels cannot run what was asked:

    * float64 on CUDA (the kernels keep fp32 softmax statistics and do not compile for
      float64 on a GPU; the interpreter runs them, for the CPU tests);
    * a head dim ``D = q.shape[-1]`` above ``MAX_HEAD_DIM``.

    By default these run on eager; asking for triton explicitly is an error, raised before
    anything runs. Shared by attention, attention_varlen and rel_attention."""
    name = _dispatch.resolve(op, q.device, backend)
    if name != "triton":
        return name
    shape_ = getattr(q, "shape", None)
    D = shape_[-1] if shape_ is not None and len(shape_) else None
    if q.dtype == torch.float64 and q.device.type == "cuda":
        why = ("cannot run float64 on CUDA (the kernels keep float32 statistics and are not "
               "compiled for float64); use backend='eager' for float64")
    elif D is not None and D > MAX_HEAD_DIM:
        why = (f"supports head dims D <= {MAX_HEAD_DIM} (a whole row of q, k, v is held per "
               f"program), got D = {D}; use backend='eager' for larger heads")
    else:
        return name
    asked, source = _dispatch.requested_backend(backend)
    if asked is not None:
        raise _dispatch.BackendUnavailable(f"ctxfast.{op}: backend 'triton' (from {source}) {why}")
    return "eager"


def autocast(*tensors):
    """Under torch.autocast, run in the autocast dtype, as F.scaled_dot_product_attention
    does (it is on autocast's lower-precision list): every floating-point tensor among
    `tensors` (the first one's device decides; None and non-tensors pass through) is cast
    to the autocast dtype, so fp32 parameters (e.g. rel_attention's biases) meet
    lower-precision activations."""
    first = tensors[0] if tensors else None
    if not isinstance(first, Tensor):
        return tensors
    dev = first.device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return tensors
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if isinstance(t, Tensor) and t.is_floating_point() else t
                 for t in tensors)
