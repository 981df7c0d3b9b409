"""AWD-LSTM's structured dropouts: ``ctxfast.locked_dropout`` (variational dropout, one
mask per sequence shared by every time step) and ``ctxfast.embedding_dropout`` (whole
words dropped from the embedding matrix).

Both are memory-bound elementwise work, so they are plain PyTorch (one broadcast
multiply, one gather) with ordinary autograd; there is no kernel and no ``backend=``. The
keep-mask is an input: give ``mask=`` and the result is deterministic (tests, or reusing
one mask over several calls); leave it out and one is sampled with ``torch.bernoulli``
(``generator=`` picks the random stream). Specification: ``ctxfast.reference.dropout``.

Semantics of ``p``, ``training`` and ``mask`` (both ops):

* ``training=False``: no dropout at all (a given ``mask`` is ignored), like ``F.dropout``.
* ``training=True``: keep-mask ``mask`` (sampled with keep probability ``1 - p`` when
  None), kept values scaled by ``1 / (1 - p)``; ``p = 1`` gives zeros. ``p = 0`` and no
  mask: the input unchanged.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _dispatch
from ._common import values_checked
from .attention import draw_seed

_CPU_MASK = _dispatch.c_available() and hasattr(torch.ops.ctxfast, "keep_mask_cpu")


def _check_p(p: object, op: str) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{op}: p must be a float in [0, 1], got {type(p).__name__}")
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"{op}: p must be in [0, 1], got {p}")
    return float(p)


def _scale(p: float) -> float:
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)


def _check_mask(mask: object, name: str, shape, device: torch.device, op: str) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor of 0/1 (bool or float), got "
                        f"{type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(mask.shape)}")
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise TypeError(f"{op}: {name} must be bool or floating point (0/1 values), got "
                        f"{mask.dtype}")
    if mask.device != device:
        raise ValueError(f"{op}: {name} is on {mask.device} but the input is on {device}")
    return mask


def locked_dropout(x: Tensor, p: float, *, batch_first: bool = False, training: bool = True,
                   mask: Optional[Tensor] = None,
                   generator: Optional[torch.Generator] = None) -> Tensor:
    """Locked (variational) dropout: the same mask at every time step of a sequence.

    Args:
        x: ``[T, B, *F]`` time-major (``[B, T, *F]`` with ``batch_first``); rank >= 2
            (an unbatched ``[T, F]`` works too: the mask is then ``[F]``). Floating point.
        p: drop probability in [0, 1].
        batch_first: x is ``[B, T, *F]``.
        training: False: return ``x`` unchanged (and ignore ``mask``).
        mask: keep-mask of x's shape without the time dimension (``[B, *F]``), 0/1,
            bool or floating point; None: sampled (keep probability ``1 - p``).
        generator: the random stream used when the mask is sampled.

    Returns:
        ``x * mask * (1 / (1 - p))`` with the mask broadcast over time; x's shape and
        dtype. Differentiable in x.

    Raises:
        TypeError: x is not a floating-point tensor, p is not a number, or the mask has
            the wrong type.
        ValueError: p outside [0, 1], x of rank < 2, or a mask of the wrong shape/device.
    """
    op = "locked_dropout"
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{op}: x must be a floating-point torch.Tensor, got "
                        f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{op}: x must have shape [T, B, *F] (or [B, T, *F] with "
                         f"batch_first; rank >= 2), got {list(x.shape)}")
    p = _check_p(p, op)
    if not training or (p == 0.0 and mask is None):
        return x
    tdim = 1 if batch_first else 0                          # the time dimension
    mshape = x.shape[:tdim] + x.shape[tdim + 1:]            # [B, *F]
    if mask is None:
        keep = torch.full(mshape, 1.0 - p, dtype=x.dtype, device=x.device)
        mask = torch.bernoulli(keep, generator=generator)
    else:
        _check_mask(mask, "mask", mshape, x.device, op)
    m = (mask.to(x.dtype) * _scale(p)).unsqueeze(tdim)     # [1, B, *F] (or [B, 1, *F])
    return x * m


def check_ids_in_vocab(op: str, name: str, ids: Tensor, V: int) -> None:
    """ids out of ``[0, V)`` raise a ValueError naming the argument and the vocabulary size
    (F.embedding says only "index out of range in self"). Checked where it costs no device
    sync and no graph break (``ops._common.values_checked``: on CPU, outside torch.compile;
    on CUDA an id out of range is a device-side assert)."""
    if not isinstance(ids, Tensor) or not values_checked(ids):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= V:
        raise ValueError(f"{op}: {name} must be in [0, V) with V = {V} (the vocabulary size: "
                         f"rows of the embedding weight), got id {lo if lo < 0 else hi}")


def embedding_dropout(weight: Tensor, input_ids: Tensor, p: float, *,
                      scale: Optional[float] = None, padding_idx: Optional[int] = None,
                      training: bool = True, mask: Optional[Tensor] = None,
                      generator: Optional[torch.Generator] = None,
                      scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    """Embedding lookup with whole words dropped (AWD-LSTM's embedding dropout).

    Row ``v`` of ``weight`` is kept with probability ``1 - p`` (one draw per word per call,
    so every occurrence of a dropped word in the batch is zero) and kept rows are scaled
    by ``1 / (1 - p)``. Computed on the looked-up rows only (``emb[ids] * mask[ids]``),
    never on a dropped copy of the whole ``[V, E]`` matrix; the same values and
    gradients as masking the matrix first (``ctxfast.reference.embedding_dropout``).

    Args:
        weight: ``[V, E]`` embedding matrix, floating point.
        input_ids: integer tensor of any shape ``[*S]`` (any integer dtype; other than
            int32/int64 it is converted to int64), values in ``[0, V)``, on weight's device.
        p: drop probability of a word, in [0, 1].
        scale: optional extra factor on the whole output (fastai's ``scale``).
        padding_idx: as in ``F.embedding`` (an int in ``[-V, V)``): that row gets no
            gradient.
        training: False: no word is dropped (``mask`` ignored); ``scale`` still applies.
        mask: keep-mask ``[V]`` (0/1, bool or floating point); None: sampled.
        generator: the random stream used when the mask is sampled.
        scale_grad_by_freq, sparse: as in ``F.embedding``.

    Returns:
        ``[*S, E]`` in weight's dtype; differentiable in weight.

    Raises:
        TypeError: bad dtypes (weight not floating point, input_ids not integer, mask),
            padding_idx not an int.
        ValueError: weight not 2-D, p outside [0, 1], a mask of the wrong shape/device,
            input_ids on another device than weight, padding_idx outside ``[-V, V)``, an
            id of input_ids outside ``[0, V)`` (checked on CPU).
    """
    op = "embedding_dropout"
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        raise TypeError(f"{op}: weight must be a floating-point torch.Tensor [V, E]")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must have shape [V, E], got {list(weight.shape)}")
    if (not isinstance(input_ids, Tensor) or input_ids.is_floating_point()
            or input_ids.is_complex() or input_ids.dtype == torch.bool):
        got = input_ids.dtype if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise TypeError(f"{op}: input_ids must be an integer torch.Tensor, got {got}")
    if input_ids.device != weight.device:
        raise ValueError(f"{op}: input_ids is on {input_ids.device} but weight is on "
                         f"{weight.device}")
    p = _check_p(p, op)
    V = weight.shape[0]
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
            raise TypeError(f"{op}: padding_idx must be None or an int, got "
                            f"{type(padding_idx).__name__}")
        if not -V <= padding_idx < V:
            raise ValueError(f"{op}: padding_idx must be in [-V, V) with V = {V} (rows of "
                             f"weight), got {padding_idx}")
    check_ids_in_vocab(op, "input_ids", input_ids, V)
    if input_ids.dtype not in (torch.int32, torch.int64):
        input_ids = input_ids.long()           # F.embedding and indexing take int32/int64
    out = F.embedding(input_ids, weight, padding_idx, None, 2.0, scale_grad_by_freq,
                      sparse)                                               # [*S, E]
    factor: Optional[Tensor] = None
    if training and (p > 0.0 or mask is not None):
        if mask is None:
            keep = torch.full((V,), 1.0 - p, dtype=weight.dtype, device=weight.device)
            mask = torch.bernoulli(keep, generator=generator)
        else:
            _check_mask(mask, "mask", (V,), weight.device, op)
        factor = (mask.to(weight.dtype) * _scale(p))[input_ids]             # [*S]
    if scale is not None:
        factor = scale if factor is None else factor * scale
    if factor is None:
        return out
    if isinstance(factor, Tensor):
        return out * factor.unsqueeze(-1)                                   # [*S, E]
    return out * factor


# --------------------------------------------------------------------------- DropConnect masks

def keep_mask(like: Tensor, p: float, generator: Optional[torch.Generator] = None) -> Tensor:
    """A 0/1 keep-mask of `like`'s shape, dtype and device: keep probability ``1 - p``
    (``0 <= p < 1``). What ``WeightDropLSTM`` draws per layer and direction (a mask as large
    as ``W_hh``: ``[4H, H]``, 5.3M values at ULMFiT's H 1152).

    On CPU (with the C++ extension): one int64 seed is drawn from `generator` by
    :func:`ctxfast.ops.attention.draw_seed` (torch's global RNG when None, so
    ``torch.manual_seed`` makes it reproducible), and ``ctxfast::keep_mask_cpu`` fills the
    mask from Philox-4x32-10 keyed by it, all four output words used: value ``e = 32 b +
    8 w + l`` (row-major) is word ``w`` of counter ``8 b + l``, kept iff its uniform is
    ``>= p`` (csrc/cpu/attention.h). ~4 ms for 5.3M values on 2 cores, where
    ``torch.bernoulli`` takes ~80 ms (a third of an ULMFiT forward). Elsewhere (CUDA, or no
    extension): ``torch.bernoulli`` with the same generator."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"keep_mask: p must be in [0, 1), got {p}")
    if like.device.type == "cpu" and _CPU_MASK and like.is_floating_point():
        return torch.ops.ctxfast.keep_mask_cpu(like, draw_seed("cpu", generator), float(p))
    return torch.bernoulli(torch.full_like(like, 1.0 - p), generator=generator)


if _CPU_MASK:
    @torch.library.register_fake("ctxfast::keep_mask_cpu")
    def _keep_mask_cpu_fake(like, seed, p):
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
