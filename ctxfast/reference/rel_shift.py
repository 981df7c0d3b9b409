"""Transformer-XL relative shift, eager PyTorch (the specification).

For ``x`` of shape ``[..., Tq, Tk]`` with ``Tk >= Tq``::

    out[..., i, j] = x[..., i, j + Tq - 1 - i]   where j + Tq - 1 - i < Tk
                   = 0                            elsewhere

Row ``i`` moves left by ``Tq - 1 - i`` columns: with keys ``[memory; current]`` and
``x[i, m]`` the score of query ``i`` against the relative encoding in row ``m`` of
``r`` (row ``m`` = distance ``Tk - 1 - m``), ``out[i, j]`` is the score for distance
``mem_len + i - j`` — the layout of the attention scores.
"""
import torch
from torch import Tensor


def _source_index(Tq: int, Tk: int, device: torch.device, inverse: bool):
    """(src [Tq, Tk] long, valid [Tq, Tk] bool): out[i, j] = x[i, src[i, j]] if valid."""
    i = torch.arange(Tq, device=device).unsqueeze(1)   # [Tq, 1]
    j = torch.arange(Tk, device=device).unsqueeze(0)   # [1, Tk]
    shift = Tq - 1 - i                                  # [Tq, 1]
    src = j - shift if inverse else j + shift           # [Tq, Tk]
    valid = (src >= 0) & (src < Tk)
    return src.clamp(0, max(Tk - 1, 0)), valid


def rel_shift(x: Tensor) -> Tensor:
    """The shift, defined by index arithmetic (gather), with zeros outside the row.

    x: [..., Tq, Tk], Tk >= Tq.  Returns a new contiguous tensor of x's shape.
    Differentiable (its backward is :func:`rel_unshift`).
    """
    Tq, Tk = x.shape[-2], x.shape[-1]
    src, valid = _source_index(Tq, Tk, x.device, inverse=False)
    out = torch.gather(x, -1, src.expand(x.shape))      # [..., Tq, Tk]
    return out.masked_fill(~valid, 0).contiguous()


def rel_unshift(g: Tensor) -> Tensor:
    """The inverse shift (adjoint of :func:`rel_shift`, i.e. its backward).

    out[..., i, j] = g[..., i, j - (Tq - 1 - i)] where that index is >= 0, else 0.
    """
    Tq, Tk = g.shape[-2], g.shape[-1]
    src, valid = _source_index(Tq, Tk, g.device, inverse=True)
    out = torch.gather(g, -1, src.expand(g.shape))      # [..., Tq, Tk]
    return out.masked_fill(~valid, 0).contiguous()


def rel_shift_pad_view(x: Tensor) -> Tensor:
    """The original Transformer-XL pad-and-view trick, in the ``[..., Tq, Tk]`` layout.

    Pad one zero column on the left, view the rows as ``[Tk + 1, Tq]``, drop the first
    row and view back. It agrees with :func:`rel_shift` where ``j <= i + Tk - Tq`` (the
    causal region) and leaves other rows' values (junk) elsewhere. Kept as the eager
    baseline of the benchmarks and as a cross-check of the definition.
    """
    *lead, Tq, Tk = x.shape
    zero_pad = x.new_zeros(*lead, Tq, 1)
    padded = torch.cat([zero_pad, x], dim=-1)            # [..., Tq, Tk + 1]
    padded = padded.view(*lead, Tk + 1, Tq)              # same memory, rows re-cut
    return padded[..., 1:, :].reshape(*lead, Tq, Tk)     # drop first row: [..., Tq, Tk]
