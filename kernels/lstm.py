"""LSTM recurrence with DropConnect on ``w_hh``, projection and clipping, Triton, forward
and backward through time (one layer, one direction, all time steps per call).

Shapes: ``xw [T, B, 4H]`` (the input projection of all steps, ``x @ w_ihᵀ + b_ih + b_hh``,
computed outside), ``h0 [B, P]``, ``c0 [B, H]``, ``w_hh [4H, P]``, ``mask [4H, P]`` (0/1)
or None, ``w_hr [P, H]`` or None (then ``P = H``). Outputs ``out [T, B, P]``,
``cells [T, B, H]`` (post-clip) and ``gates [T, B, 4H]`` (post-activation i, f, g, o), in
xw's dtype; arithmetic in fp32 (fp64 for fp64 inputs).

Forward, per step ``t`` (``t_prev`` the step consumed before; ``reverse`` walks T-1 .. 0)::

    W   = w_hh * mask * scale
    z   = xw_t + h_{t-1} @ Wᵀ;  i, f, o = σ(z_i, z_f, z_o);  g = tanh(z_g)
    c_t = clamp(f c_{t-1} + i g, ±cell_clip);  hp_t = o tanh(c_t)
    h_t = clamp(hp_t @ w_hrᵀ, ±proj_clip)   (h_t = hp_t without w_hr)

One fused kernel per step (:func:`_lstm_fwd_kernel`): a program owns a block of batch rows
and a block of hidden units ``j``; it loads the rows ``j, H+j, 2H+j, 3H+j`` of ``w_hh`` (the
four gates of its units) as one ``[4·BLOCK_H, BLOCK_K]`` tile per step of ``P``, multiplies
the mask into the tile as it is loaded (no masked weight is ever written) and accumulates
``h_{t-1} @ Wᵀ`` with one dot; then it applies the gates, the cell update and the clip and
writes ``gates_t``, ``c_t`` and ``hp_t``. With a projection a second kernel
(:func:`_lstm_gemm_kernel`) computes ``h_t = clamp(hp_t @ w_hrᵀ)``.

``scale`` and the clips are read from a small tensor in the accumulation dtype (scalar
arguments are fp32 on a GPU but fp64 in the interpreter), so every path clamps to the same
value and the backward's "inside the clip" test (``|stored| < clip`` rounded to the storage
dtype) agrees with the forward's clamp.

Backward through time, carrying ``dh`` (w.r.t. ``h_t``) and ``dc`` (w.r.t. the post-clip
``c_t``); ``1[·]`` is 1 where the clip did not bite (the stored value is inside the clip)::

    dh̃_t  = (grad_out_t + dz_{t+1} @ W) · 1[|h_t| < proj_clip]     (w.r.t. the pre-clip h_t)
    dhp_t = dh̃_t @ w_hr                                             (dh̃_t without w_hr)
    dc̃    = (grad_cells_t + dc_{t+1}·f_{t+1} + dhp_t · o (1 − tanh² c_t)) · 1[|c_t| < cell_clip]
    dz_o = dhp_t tanh(c_t) · o(1−o);  dz_i = dc̃ g · i(1−i);  dz_f = dc̃ c_{t-1} · f(1−f)
    dz_g = dc̃ i · (1−g²);  dc passed back = dc̃ · f;  grad_xw_t = dz_t
    grad_h0 = dz_first @ W;  grad_c0 = dc̃_first · f_first

Per step: :func:`_lstm_bwd_kernel` (the cell backward, elementwise, with ``dh̃_t @ w_hr``
fused in) and :func:`_lstm_gemm_kernel` for ``dz_t @ W`` with the mask applied in-kernel and
the next ``dh̃`` (``+ grad_out``, proj-clip gate) as its epilogue. The weight gradients are
one GEMM each over all steps at the end::

    grad_w_hh = (Σ_t dz_tᵀ h_{t-1}) · mask · scale      grad_w_hr = Σ_t dh̃_tᵀ hp_t,
    hp_t = o_t tanh(c_t) recomputed from the saved gates and cells.

Not yet tuned on a GPU; a persistent kernel that keeps ``W`` on chip is the CUDA C++ path.
"""
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import _dot, _interpreting, _precision


@triton.jit
def _tanh(x):
    """tanh without cancellation: odd Taylor series (to x^13, truncation < 4e-16 relative)
    for |x| < 1/8, else (1 - e) / (1 + e) with e = exp(-2|x|) (the numerator is >= 0.22,
    so a few ulps). `2 * sigmoid(2x) - 1` loses ~eps/|x| relative accuracy near 0: 5e-4 at
    x = 1e-4 in fp32, which showed in the gradients of layers with small cells."""
    ax = tl.abs(x)
    x2 = x * x
    p = 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    small = x + x * x2 * p
    e = tl.exp(-2.0 * ax)
    t = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0, -t, t)
    return tl.where(ax < 0.125, small, big)


@triton.jit
def _clamp_store(x, clip, below, ty: tl.constexpr):
    """clamp(x, ±clip) in dtype ty, for storing. `clip` is already a value of ty; an
    unclipped x (|x| < clip) that would round onto ±clip is stored as ±below (the value of
    ty one ulp inside) so that a stored ±clip always means "clipped": the backward's
    |stored| < clip test is then exact (fp16/bf16; fp32/fp64 never round onto it)."""
    x_st = tl.minimum(tl.maximum(x, -clip), clip).to(ty)
    onto = (tl.abs(x) < clip) & (tl.abs(x_st.to(x.dtype)) >= clip)
    return tl.where(onto, tl.where(x < 0, -below, below).to(ty), x_st)


@triton.jit
def _split4(x, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """[BLOCK_B, 4·BLOCK_H] laid out gate-major (column q·BLOCK_H + j) -> 4 x [BLOCK_B, BLOCK_H]."""
    x = tl.permute(tl.reshape(x, (BLOCK_B, 4, BLOCK_H)), (0, 2, 1))   # [BB, BH, 4]
    x02, x13 = tl.split(tl.reshape(x, (BLOCK_B, BLOCK_H, 2, 2)))    # gates {0, 2}, {1, 3}
    x0, x2 = tl.split(x02)
    x1, x3 = tl.split(x13)
    return x0, x1, x2, x3


@triton.jit
def _lstm_fwd_kernel(
    xw_ptr,      # [B, 4H] xw_t
    h_ptr,       # [B, P]  h_{t-1}
    c_ptr,       # [B, H]  c_{t-1}
    w_ptr,       # [4H, P] w_hh
    m_ptr,       # [4H, P] DropConnect mask (read only if HAS_MASK)
    gates_ptr,   # [B, 4H] out: post-activation i, f, g, o
    cells_ptr,   # [B, H]  out: c_t (post-clip)
    hp_ptr,      # [B, H]  out: o * tanh(c_t) (= h_t without projection)
    prm_ptr,     # [3] ACC dtype: scale, cell_clip (as stored), the stored value just below it
    B, H, P,
    HAS_MASK: tl.constexpr, CELL_CLIP: tl.constexpr, ACC: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    scale = tl.load(prm_ptr)
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b_in = offs_b < B
    h_in = offs_h < H
    # the program's 4·BLOCK_H rows of W, gate-major: r = q·BLOCK_H + jj -> row q·H + j
    r = tl.arange(0, 4 * BLOCK_H)
    j = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    rows = (r // BLOCK_H) * H + j                                       # [4·BLOCK_H]
    rows_in = j < H
    acc = tl.zeros((BLOCK_B, 4 * BLOCK_H), dtype=ACC)
    for k0 in range(0, P, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < P
        h = tl.load(h_ptr + offs_b[:, None] * P + offs_k[None, :],
                    mask=b_in[:, None] & k_in[None, :], other=0.0)    # [BLOCK_B, BLOCK_K]
        w_offs = rows[:, None] * P + offs_k[None, :]                   # [4·BLOCK_H, BLOCK_K]
        w_mask = rows_in[:, None] & k_in[None, :]
        w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)
        if HAS_MASK:                                                   # DropConnect, in-tile
            w = w * tl.load(m_ptr + w_offs, mask=w_mask, other=0.0)
        acc += _dot(h, tl.trans(w), UPCAST, PRECISION)
    z = acc * scale + tl.load(xw_ptr + offs_b[:, None] * (4 * H) + rows[None, :],
                              mask=b_in[:, None] & rows_in[None, :], other=0.0).to(ACC)
    z_i, z_f, z_g, z_o = _split4(z, BLOCK_B, BLOCK_H)                  # 4 x [BLOCK_B, BLOCK_H]
    i = tl.sigmoid(z_i)
    f = tl.sigmoid(z_f)
    g = _tanh(z_g)
    o = tl.sigmoid(z_o)
    io = b_in[:, None] & h_in[None, :]
    row4 = offs_b[:, None] * (4 * H) + offs_h[None, :]                 # gate i's column in [B, 4H]
    rowh = offs_b[:, None] * H + offs_h[None, :]
    c = f * tl.load(c_ptr + rowh, mask=io, other=0.0).to(ACC) + i * g
    ty = gates_ptr.dtype.element_ty
    c_st = c.to(ty)
    if CELL_CLIP:
        cell_clip = tl.load(prm_ptr + 1)
        c_st = _clamp_store(c, cell_clip, tl.load(prm_ptr + 2), ty)
        c = tl.minimum(tl.maximum(c, -cell_clip), cell_clip)
    hp = o * _tanh(c)
    tl.store(gates_ptr + row4, i.to(ty), mask=io)
    tl.store(gates_ptr + row4 + H, f.to(ty), mask=io)
    tl.store(gates_ptr + row4 + 2 * H, g.to(ty), mask=io)
    tl.store(gates_ptr + row4 + 3 * H, o.to(ty), mask=io)
    tl.store(cells_ptr + rowh, c_st, mask=io)
    tl.store(hp_ptr + rowh, hp.to(hp_ptr.dtype.element_ty), mask=io)


@triton.jit
def _lstm_gemm_kernel(
    a_ptr,       # [M, K] rows contiguous in K
    w_ptr,       # weight: element (k, n) at k * stride_wk + n * stride_wn
    m_ptr,       # mask in w's layout (read only if HAS_MASK)
    add_ptr,     # [M, N] added to the result (read only if HAS_ADD)
    ref_ptr,     # [M, N] stored clipped values (read only if CLIP == 2)
    y_ptr,       # [M, N] out
    prm_ptr,     # [3] ACC dtype: scale, clip (as stored), the stored value just below it
    M, N, K, stride_wk, stride_wn,
    HAS_MASK: tl.constexpr, HAS_ADD: tl.constexpr,
    CLIP: tl.constexpr,      # 0: none; 1: y = clamp(y, ±clip); 2: y = y · 1[|ref| < clip]
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y = (a @ (w * mask)) * scale (+ add), then the clip epilogue. Forward projection:
    a = hp_t, w = w_hrᵀ, CLIP = 1. Backward recurrence: a = dz_t, w = w_hh with the mask,
    add = grad_out_{t_prev}, CLIP = 2 with ref = out_{t_prev}."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in = offs_m < M
    n_in = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :],
                    mask=m_in[:, None] & k_in[None, :], other=0.0)    # [BLOCK_M, BLOCK_K]
        w_offs = offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        w_mask = k_in[:, None] & n_in[None, :]
        w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)          # [BLOCK_K, BLOCK_N]
        if HAS_MASK:
            w = w * tl.load(m_ptr + w_offs, mask=w_mask, other=0.0)
        acc += _dot(a.to(w.dtype), w, UPCAST, PRECISION)
    io = m_in[:, None] & n_in[None, :]
    offs = offs_m[:, None] * N + offs_n[None, :]
    y = acc * tl.load(prm_ptr)
    if HAS_ADD:
        y += tl.load(add_ptr + offs, mask=io, other=0.0).to(ACC)
    clip = tl.load(prm_ptr + 1)
    y_st = y.to(y_ptr.dtype.element_ty)
    if CLIP == 1:
        y_st = _clamp_store(y, clip, tl.load(prm_ptr + 2), y_ptr.dtype.element_ty)
    if CLIP == 2:
        ref = tl.load(ref_ptr + offs, mask=io, other=0.0).to(ACC)
        y_st = tl.where(tl.abs(ref) < clip, y, 0.0).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y_st, mask=io)


@triton.jit
def _lstm_bwd_kernel(
    dh_ptr,      # [B, P]  dh̃_t (w.r.t. the pre-clip h_t), ACC dtype
    wr_ptr,      # [P, H]  w_hr (read only if HAS_PROJ)
    gates_ptr,   # [B, 4H] post-activation i, f, g, o of step t
    cells_ptr,   # [B, H]  c_t
    cprev_ptr,   # [B, H]  c_{t-1}
    gc_ptr,      # [B, H]  grad_cells_t
    dc_ptr,      # [B, H]  in: dc_{t+1}·f_{t+1} (w.r.t. c_t); out: dc̃ · f (w.r.t. c_{t-1}); ACC
    dz_ptr,      # [B, 4H] out: dz_t = grad_xw_t
    prm_ptr,     # [1] ACC dtype: cell_clip as stored in the cells' dtype
    B, H, P,
    HAS_PROJ: tl.constexpr, CELL_CLIP: tl.constexpr, ACC: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b_in = offs_b < B
    h_in = offs_h < H
    io = b_in[:, None] & h_in[None, :]
    if HAS_PROJ:                                                       # dhp = dh̃ @ w_hr
        dhp = tl.zeros((BLOCK_B, BLOCK_H), dtype=ACC)
        for k0 in range(0, P, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_in = offs_k < P
            dh = tl.load(dh_ptr + offs_b[:, None] * P + offs_k[None, :],
                         mask=b_in[:, None] & k_in[None, :], other=0.0)   # [BLOCK_B, BLOCK_K]
            wr = tl.load(wr_ptr + offs_k[:, None] * H + offs_h[None, :],
                         mask=k_in[:, None] & h_in[None, :], other=0.0)   # [BLOCK_K, BLOCK_H]
            dhp += _dot(dh.to(wr.dtype), wr, UPCAST, PRECISION)
    else:
        dhp = tl.load(dh_ptr + offs_b[:, None] * P + offs_h[None, :], mask=io, other=0.0).to(ACC)
    row4 = offs_b[:, None] * (4 * H) + offs_h[None, :]
    rowh = offs_b[:, None] * H + offs_h[None, :]
    i = tl.load(gates_ptr + row4, mask=io, other=0.0).to(ACC)
    f = tl.load(gates_ptr + row4 + H, mask=io, other=0.0).to(ACC)
    g = tl.load(gates_ptr + row4 + 2 * H, mask=io, other=0.0).to(ACC)
    o = tl.load(gates_ptr + row4 + 3 * H, mask=io, other=0.0).to(ACC)
    c = tl.load(cells_ptr + rowh, mask=io, other=0.0).to(ACC)
    tc = _tanh(c)
    dc = (tl.load(dc_ptr + rowh, mask=io, other=0.0).to(ACC)
          + tl.load(gc_ptr + rowh, mask=io, other=0.0).to(ACC)
          + dhp * o * (1.0 - tc * tc))
    if CELL_CLIP:
        dc = tl.where(tl.abs(c) < tl.load(prm_ptr), dc, 0.0)
    c_prev = tl.load(cprev_ptr + rowh, mask=io, other=0.0).to(ACC)
    dz_i = dc * g * i * (1.0 - i)
    dz_f = dc * c_prev * f * (1.0 - f)
    dz_g = dc * i * (1.0 - g * g)
    dz_o = dhp * tc * o * (1.0 - o)
    ty = dz_ptr.dtype.element_ty
    tl.store(dz_ptr + row4, dz_i.to(ty), mask=io)
    tl.store(dz_ptr + row4 + H, dz_f.to(ty), mask=io)
    tl.store(dz_ptr + row4 + 2 * H, dz_g.to(ty), mask=io)
    tl.store(dz_ptr + row4 + 3 * H, dz_o.to(ty), mask=io)
    tl.store(dc_ptr + rowh, (dc * f).to(dc_ptr.dtype.element_ty), mask=io)


# --------------------------------------------------------------------------- launchers

def _acc_dtype(dtype: torch.dtype):
    return (tl.float64, torch.float64) if dtype == torch.float64 else (tl.float32, torch.float32)


def _config(B: int):
    """(BLOCK_B, BLOCK_H, BLOCK_K, num_warps). Not yet tuned on a GPU."""
    if _interpreting():
        return 16, 16, 16, 1                 # small blocks: multi-block logic at tiny sizes
    return min(64, max(16, triton.next_power_of_2(B))), 32, 32, 4


def _below(clip_s: float, dtype: torch.dtype) -> float:
    """The largest value of `dtype` below the stored clip (fp16/bf16; else clip_s)."""
    if math.isinf(clip_s) or dtype not in (torch.float16, torch.bfloat16):
        return clip_s
    bits = torch.tensor(clip_s, dtype=dtype).view(torch.int16) - 1     # positive: one ulp down
    return float(bits.view(dtype))


def _params(device, dtype: torch.dtype, *values: float) -> torch.Tensor:
    """The kernels' float parameters (scale, clips) as a tensor in the accumulation dtype.
    Scalar kernel arguments would be fp32 on a GPU but fp64 in the interpreter; loading
    them from memory gives both (and fp64 inputs) the same, exact values. inf -> 0 (unused)."""
    _, acc = _acc_dtype(dtype)
    return torch.tensor([0.0 if math.isinf(v) else v for v in values], dtype=acc, device=device)


def _stored_clip(clip: float, dtype: torch.dtype) -> float:
    """The value a clamp to ±clip (in the accumulation dtype) leaves in a tensor of `dtype`:
    the backward compares the stored values with this."""
    if math.isinf(clip):
        return clip
    _, acc = _acc_dtype(dtype)
    return float(torch.tensor(clip, dtype=acc).to(dtype))


def _common(dtype: torch.dtype) -> dict:
    acc, _ = _acc_dtype(dtype)
    return dict(ACC=acc, UPCAST=_interpreting() and dtype == torch.bfloat16,
                PRECISION=_precision(dtype))


def _steps(T: int, reverse: bool):
    return list(range(T - 1, -1, -1)) if reverse else list(range(T))


def _clip_params(device, dtype: torch.dtype, scale: float, clip: float) -> torch.Tensor:
    """[scale, clip as stored in `dtype`, the stored value just below it]."""
    clip_s = _stored_clip(clip, dtype)
    return _params(device, dtype, scale, clip_s, _below(clip_s, dtype))


def _gemm(a, w, stride_wk, stride_wn, N, y, prm, *, mask=None, add=None, ref=None,
          clip_mode=0, dtype):
    """y [M, N] = epilogue((a [M, K] @ W) * scale) with W[k, n] = w[k*stride_wk + n*stride_wn];
    prm = :func:`_clip_params` (scale, clip)."""
    M, K = a.shape
    bm, _, bk, warps = _config(M)
    bn = 16 if _interpreting() else 64
    _lstm_gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        a, w, mask if mask is not None else w, add if add is not None else y,
        ref if ref is not None else y, y, prm, M, N, K, stride_wk, stride_wn,
        HAS_MASK=mask is not None, HAS_ADD=add is not None, CLIP=clip_mode,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **_common(dtype))


def lstm_forward(xw: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_hh: torch.Tensor,
                 w_hr: Optional[torch.Tensor], mask: Optional[torch.Tensor], scale: float,
                 cell_clip: float, proj_clip: float,
                 reverse: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence over all T steps: ``(out [T, B, P], cells [T, B, H], gates [T, B, 4H])``
    in xw's dtype (see the module docstring). Inputs may have any strides."""
    T, B, G = xw.shape
    H, P = G // 4, w_hh.shape[1]
    dtype = xw.dtype
    out = xw.new_empty((T, B, P))
    cells = xw.new_empty((T, B, H))
    gates = xw.new_empty((T, B, G))
    if T == 0 or B == 0:
        return out, cells, gates
    xw = xw.contiguous()
    h0, c0 = h0.to(dtype).contiguous(), c0.to(dtype).contiguous()
    w_hh = w_hh.to(dtype).contiguous()
    mask = mask.to(dtype).contiguous() if mask is not None else None
    w_hr = w_hr.to(dtype).contiguous() if w_hr is not None else None
    hp = xw.new_empty((B, H)) if w_hr is not None else None
    bb, bh, bk, warps = _config(B)
    grid = (triton.cdiv(B, bb), triton.cdiv(H, bh))
    prm = _clip_params(xw.device, dtype, scale, cell_clip)
    prm_proj = _clip_params(xw.device, dtype, 1.0, proj_clip)
    steps = _steps(T, reverse)
    for n, t in enumerate(steps):
        h_prev = h0 if n == 0 else out[steps[n - 1]]
        c_prev = c0 if n == 0 else cells[steps[n - 1]]
        _lstm_fwd_kernel[grid](
            xw[t], h_prev, c_prev, w_hh, mask if mask is not None else w_hh,
            gates[t], cells[t], hp if hp is not None else out[t], prm, B, H, P,
            HAS_MASK=mask is not None, CELL_CLIP=not math.isinf(cell_clip),
            BLOCK_B=bb, BLOCK_H=bh, BLOCK_K=bk, num_warps=warps, **_common(dtype))
        if w_hr is not None:     # out_t = clamp(hp_t @ w_hrᵀ): W[k=h, n=p] = w_hr[p, h]
            _gemm(hp, w_hr, 1, H, P, out[t], prm_proj,
                  clip_mode=0 if math.isinf(proj_clip) else 1, dtype=dtype)
    return out, cells, gates


def lstm_backward(grad_out: torch.Tensor, grad_cells: torch.Tensor, h0: torch.Tensor,
                  c0: torch.Tensor, w_hh: torch.Tensor, w_hr: Optional[torch.Tensor],
                  mask: Optional[torch.Tensor], scale: float, cell_clip: float,
                  proj_clip: float, reverse: bool, out: torch.Tensor, cells: torch.Tensor,
                  gates: torch.Tensor):
    """Backward through time of :func:`lstm_forward`: ``(grad_xw [T, B, 4H], grad_h0 [B, P],
    grad_c0 [B, H], grad_w_hh [4H, P], grad_w_hr [P, H] or [0])``. ``grad_w_hh`` is w.r.t.
    the unmasked ``w_hh`` (``dW * mask * scale``)."""
    T, B, G = gates.shape
    H, P = G // 4, w_hh.shape[1]
    dtype = gates.dtype
    _, acc = _acc_dtype(dtype)
    grad_xw = gates.new_empty((T, B, G))
    if T == 0 or B == 0:
        gw_hr = torch.zeros_like(w_hr) if w_hr is not None else grad_out.new_empty((0,))
        return (grad_xw.zero_(), torch.zeros_like(h0), torch.zeros_like(c0),
                torch.zeros_like(w_hh), gw_hr)
    grad_out = grad_out.to(dtype).contiguous()
    grad_cells = grad_cells.to(dtype).contiguous()
    out, cells, gates = out.contiguous(), cells.contiguous(), gates.contiguous()
    h0, c0 = h0.to(dtype).contiguous(), c0.to(dtype).contiguous()
    w_hh_c = w_hh.to(dtype).contiguous()
    mask_c = mask.to(dtype).contiguous() if mask is not None else None
    w_hr_c = w_hr.to(dtype).contiguous() if w_hr is not None else None
    has_proj = w_hr is not None
    pc = _stored_clip(proj_clip, dtype)
    cc = _stored_clip(cell_clip, dtype)
    proj_gate = has_proj and not math.isinf(proj_clip)

    dh_all = torch.empty((T, B, P), dtype=acc, device=gates.device)   # dh̃_t for every t
    dc = torch.zeros((B, H), dtype=acc, device=gates.device)
    grad_h0 = torch.empty((B, P), dtype=acc, device=gates.device)
    bb, bh, bk, warps = _config(B)
    grid = (triton.cdiv(B, bb), triton.cdiv(H, bh))
    prm = _params(gates.device, dtype, cc)
    prm_rec = _clip_params(gates.device, dtype, scale, proj_clip)
    steps = _steps(T, reverse)[::-1]                                   # backward order
    first = steps[0]
    dh_all[first] = grad_out[first].to(acc)
    if proj_gate:
        dh_all[first] *= out[first].abs() < pc
    for n, t in enumerate(steps):
        prev = steps[n + 1] if n + 1 < T else None                     # step consumed before t
        _lstm_bwd_kernel[grid](
            dh_all[t], w_hr_c if has_proj else gates, gates[t], cells[t],
            cells[prev] if prev is not None else c0, grad_cells[t], dc, grad_xw[t], prm,
            B, H, P,
            HAS_PROJ=has_proj, CELL_CLIP=not math.isinf(cell_clip),
            BLOCK_B=bb, BLOCK_H=bh, BLOCK_K=bk, num_warps=warps, **_common(dtype))
        # dh for the step before: dz_t @ (w_hh * mask * scale); W[k=r, n=p] = w_hh[r, p]
        if prev is not None:
            _gemm(grad_xw[t], w_hh_c, P, 1, P, dh_all[prev], prm_rec, mask=mask_c,
                  add=grad_out[prev], ref=out[prev] if proj_gate else None,
                  clip_mode=2 if proj_gate else 0, dtype=dtype)
        else:
            _gemm(grad_xw[t], w_hh_c, P, 1, P, grad_h0, prm_rec, mask=mask_c, dtype=dtype)

    # weight gradients: one GEMM each over all T·B rows
    if reverse:
        h_prev = torch.cat([out[1:], h0[None]])                         # [T, B, P]
    else:
        h_prev = torch.cat([h0[None], out[:-1]])                        # [T, B, P]
    grad_w_hh = grad_xw.reshape(T * B, G).to(acc).t() @ h_prev.reshape(T * B, P).to(acc)  # [4H, P]
    if mask is not None:
        grad_w_hh = grad_w_hh * mask_c.to(acc) * scale
    if has_proj:
        hp = gates[..., 3 * H:].to(acc) * torch.tanh(cells.to(acc))     # [T, B, H]
        grad_w_hr = (dh_all.reshape(T * B, P).t() @ hp.reshape(T * B, H)).to(w_hr.dtype)  # [P, H]
    else:
        grad_w_hr = grad_out.new_empty((0,))
    return (grad_xw, grad_h0.to(h0.dtype), dc.to(c0.dtype), grad_w_hh.to(w_hh.dtype),
            grad_w_hr)
