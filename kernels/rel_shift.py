"""Transformer-XL relative shift, Triton kernel.

For ``x [N, Tq, Tk]`` (any strides) and ``s_i = Tq - 1 - i``::

    forward:  out[n, i, j] = x[n, i, j + s_i]    (0 where j + s_i >= Tk)
    backward: out[n, i, j] = g[n, i, j - s_i]    (0 where j - s_i <  0)

The backward is the forward's adjoint (the inverse shift), so both are one kernel with
``SIGN = +1 / -1``. One program writes ``BLOCK_K`` columns of one output row; the op only
moves data (2 · N · Tq · Tk · elem_size bytes through memory).
"""
import torch
import triton
import triton.language as tl

from ._common import cdiv, next_pow2
from ._launch import fast


@triton.jit
def _rel_shift_kernel(
    x_ptr,       # input  [N, Tq, Tk], element (n, i, k) at n*stride_xn + i*stride_xq + k*stride_xk
    out_ptr,     # output [N, Tq, Tk], contiguous
    Tq, Tk,      # the two last dims
    stride_xn, stride_xq, stride_xk,
    SIGN: tl.constexpr,      # +1: forward shift; -1: inverse (backward)
    BLOCK_K: tl.constexpr,   # columns per program
):
    row = tl.program_id(0).to(tl.int64)          # flat row n * Tq + i
    n = row // Tq
    i = row - n * Tq
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    src = cols + SIGN * (Tq - 1 - i)
    in_row = cols < Tk
    valid = in_row & (src >= 0) & (src < Tk)
    vals = tl.load(x_ptr + n * stride_xn + i * stride_xq + src * stride_xk, mask=valid, other=0)
    tl.store(out_ptr + row * Tk + cols, vals, mask=in_row)


def _launch(x: torch.Tensor, sign: int, out: torch.Tensor = None) -> torch.Tensor:
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    Tq, Tk = x.shape[-2], x.shape[-1]
    x3 = x.reshape(-1, Tq, Tk)                   # [N, Tq, Tk], a view when strides allow
    block_k = min(1024, next_pow2(Tk))
    grid = (x3.shape[0] * Tq, cdiv(Tk, block_k))
    fast(_rel_shift_kernel)[grid](
        x3, out, Tq, Tk, x3.stride(0), x3.stride(1), x3.stride(2),
        SIGN=sign, BLOCK_K=block_k, num_warps=4 if block_k >= 512 else 1,
    )
    return out


def rel_shift_forward(x: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    """x [..., Tq, Tk] (Tk >= Tq, any strides) -> shifted, contiguous, x's shape.
    `out` (contiguous, x's shape and dtype) is written in place when given."""
    return _launch(x, 1, out)


def rel_shift_backward(grad: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    """The inverse shift of `grad [..., Tq, Tk]`: the gradient of :func:`rel_shift_forward`."""
    return _launch(grad, -1, out)
