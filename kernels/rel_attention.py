"""Transformer-XL / XLNet relative attention, Triton: the position term computed tile by
tile with the relative shift done by index arithmetic — no ``[Tq, Tk]`` tensor is stored.

Shapes: ``q [B, H, Tq, D]``, ``k, v [B, H, Tk, D]`` (``[memory; current]``,
``mem_len = Tk - Tq``), ``r [H, R, D]``, ``u = r_w_bias, w = r_r_bias [H, D]``.
Pair (i, j) uses ``r[m]`` with ``m = pos_start - (mem_len + i - j) = c - i + j``,
``c = pos_start - mem_len``.

Scores (base 2 inside the kernel): ``s_ij = scale·log2(e)·((q_i+u)·k_j + (q_i+w)·r[c−i+j]
[+ (q_i + r_s_bias)·seg_embed[seg_q[i] != seg_k[j]]])``, then the same masks, online
softmax, dropout and lse as ``kernels/attention.py``.

The shift. In a tile of queries ``i = m0 + ii`` (ii < BLOCK_M) and keys ``j = n0 + jj``
(jj < BLOCK_N), ``m = base + jj + (BLOCK_M − 1 − ii)`` with ``base = c − m0 − BLOCK_M + 1
+ n0``: every pair reads one band of ``BLOCK_M + BLOCK_N − 1`` consecutive rows of r. The
kernel multiplies ``(q + w)`` by the band on the tensor cores (``[BLOCK_M, BAND]``, BAND =
BLOCK_M + BLOCK_N) and picks column ``jj + BLOCK_M − 1 − ii`` of row ii with ``tl.gather``:
the skew the original code does with pad-and-view on a whole ``[Tq, R]`` tensor.

Backward, with ``P`` recomputed and ``dS = P ∘ (dP − Δ)`` as in ``kernels/attention.py``:
``dK = scale · dSᵀ (q + u)``, ``dV = Pᵀ dO``; ``d(q + u) = scale · dS K``;
``d(q + v) = scale · dS_band r_band`` and ``dr_band = scale · dS_bandᵀ (q + v)`` where
``dS_band[ii, jj + BLOCK_M − 1 − ii] = dS[ii, jj]`` (the skew undone with ``tl.gather``);
``dr`` sums over batches and query blocks with fp32 atomics. The segment term gives per-row
sums ``A_same, A_diff = Σ_j dS_ij [same], Σ_j dS_ij [diff]``, from which the launcher forms
the gradients of q, seg_embed and r_s_bias.

Sliding window (``WINDOW``; Transformer-XL's ``same_length``): pair (i, j) is visible only
if its distance ``mem_len + i − j < window``. The forward and dQ loops start at the first
key block a query block can see (``m0 + mem_len − window + 1``), the dK/dV loop stops after
the last query block a key block is seen by (``n0 + BLOCK_N − 1 − mem_len + window``), so a
window of W keys costs O(Tq·W), not O(Tq·Tk).

Decoding (a few queries, long memory): the ``B·H·⌈Tq/BLOCK_M⌉`` programs of the forward
cannot fill a GPU, so the keys are split over a third grid axis (flash-decoding, as
``kernels/attention.py``): split ``s`` runs the same loop over its own range of key blocks,
BD still computed from the band of r rows of each tile, and writes a normalised partial
output and its lse (``-inf`` where it saw no key); ``kernels.attention``'s combine kernel
merges them into ``out`` and the final lse. The backward is the regular one, driven by the
combined lse. :func:`decode_splits` picks the split count (CUDA only).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (LOG2E, _attn_combine_kernel, _auto_splits, _dot, _interpreting, _keep,
                      _key_range, _mask_args, _online_softmax_step, _precision, _seed_arg,
                      _visible)


@triton.jit
def _rel_attn_fwd_kernel(
    Q, K, V,        # q [B, H, Tq, D]; k, v [B, H, Tk, D]; any strides
    R,              # r [H, R, D], any strides
    U, W,           # r_w_bias, r_r_bias [H, D] contiguous
    SEG_Q, SEG_K,   # segment ids [B, Tq], [B, Tk] int32; unused unless HAS_SEG
    SEG_E, RSB,     # seg_embed [2, H, D], r_s_bias [H, D], contiguous; unused unless HAS_SEG
    O,              # out [B, H, Tq, D] (SPLIT_K: partials [B, H, S, Tq, D] fp32), written
    LSE,            # [B, H, Tq] fp32 (SPLIT_K: [B, H, S, Tq]), written (base 2; +inf for
                    # empty rows, -inf for a split that saw no key)
    KPM, RANK, KV_END, SEED,   # masks and dropout seed as in kernels/attention.py
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_rh, stride_rm, stride_rd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh,   # of lse: element (b, h, i) at b*stride_lb + h*stride_lh + i
    stride_os, stride_ls,   # SPLIT_K: split s of out / lse at + s*stride_os / + s*stride_ls
    keys_per_split,         # SPLIT_K: keys per split (a multiple of BLOCK_N)
    stride_kpm_b, stride_kpm_n, stride_rank_b, stride_rank_t,
    stride_sq_b, stride_sk_b,
    H, Tq, Tk, mem_len, D, R_len, pos_start,
    window,         # WINDOW: pairs at distance >= window are masked
    qk_scale, p_drop,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    WINDOW: tl.constexpr,
    SPLIT_K: tl.constexpr,  # decoding: program_id(2) owns one range of keys; partial out
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BAND: tl.constexpr,     # power of two >= BLOCK_M + BLOCK_N - 1
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=(offs_m[:, None] < Tq) & d_ok, other=0.0)
    q = q.to(tl.float32)
    u = tl.load(U + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    w = tl.load(W + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    qu = (q + u[None, :]).to(K.dtype.element_ty)     # (q + u): content term
    qw = (q + w[None, :]).to(K.dtype.element_ty)     # (q + v): position term
    if HAS_SEG:
        rsb = tl.load(RSB + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        se0 = tl.load(SEG_E + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        se1 = tl.load(SEG_E + (H + h) * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        qs = q + rsb[None, :]
        ef_same = tl.sum(qs * se0[None, :], 1)        # [BLOCK_M]: segment term, same segment
        ef_diff = tl.sum(qs * se1[None, :], 1)        # different segments
        seg_q = tl.load(SEG_Q + b * stride_sq_b + offs_m, mask=offs_m < Tq, other=-1)
    rank_q = offs_m
    if HAS_PERM:
        rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t, mask=offs_m < Tq, other=0)

    lo, hi = _key_range(b, m0, Tk, mem_len, KV_END, keys_per_split,
                        CAUSAL, HAS_KPM, SPLIT_K, BLOCK_M)
    if WINDOW:      # first key block within the window of the block's first query
        lo = tl.maximum(lo, tl.maximum(m0 + mem_len - window + 1, 0) // BLOCK_N * BLOCK_N)
    if SPLIT_K:
        O += tl.program_id(2) * stride_os
        LSE += tl.program_id(2) * stride_ls
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)

    ii = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, BLOCK_N)
    band = tl.arange(0, BAND)
    band_ok = band < BLOCK_M + BLOCK_N - 1            # rows the skew reads (BAND is wider)
    skew = jj[None, :] + (BLOCK_M - 1 - ii[:, None])  # [BLOCK_M, BLOCK_N]: column in the band
    c = pos_start - mem_len

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    r_base = R + h * stride_rh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + jj
        kv_mask = (offs_n[:, None] < Tk) & d_ok
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        rows = c - m0 - BLOCK_M + 1 + start_n + band                      # [BAND] rows of r
        r_ok = band_ok & (rows >= 0) & (rows < R_len)
        r = tl.load(r_base + rows[:, None] * stride_rm + offs_d[None, :] * stride_rd,
                    mask=r_ok[:, None] & d_ok, other=0.0)
        ac = _dot(qu, tl.trans(k), UPCAST, PRECISION)                     # [BLOCK_M, BLOCK_N]
        qr = _dot(qw, tl.trans(r), UPCAST, PRECISION)                     # [BLOCK_M, BAND]
        bd = tl.gather(qr, skew, 1)                                       # the shift
        s = ac + bd
        if HAS_SEG:
            seg_k = tl.load(SEG_K + b * stride_sk_b + offs_n, mask=offs_n < Tk, other=-2)
            same = seg_q[:, None] == seg_k[None, :]
            s += tl.where(same, ef_same[:, None], ef_diff[:, None])
        s = s * qk_scale
        vis = _visible(offs_m, offs_n, b, Tq, Tk, mem_len, KPM, stride_kpm_b, stride_kpm_n,
                       RANK, stride_rank_b, stride_rank_t, rank_q,
                       CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT)
        if WINDOW:
            vis = vis & ((mem_len + offs_m[:, None] - offs_n[None, :]) < window)
        s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, seed, bh, offs_m, offs_n,
                                             Tq, Tk, p_drop, DROPOUT, UPCAST, PRECISION)

    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    # Empty row: +inf makes the backward's probabilities 0; a split's partial uses -inf
    # (weight 0 in the combine).
    empty_lse = float("-inf") if SPLIT_K else float("inf")
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), empty_lse)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om
             + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < Tq) & d_ok)
    tl.store(LSE + b * stride_lb + h * stride_lh + offs_m, lse, mask=offs_m < Tq)


@triton.jit
def _rel_attn_bwd_dkdv_kernel(
    Q, K, V, DO,    # q, do [B, H, Tq, D]; k, v [B, H, Tk, D]; any strides
    R, U, W,        # r [H, R, D]; r_w_bias, r_r_bias [H, D] contiguous
    SEG_Q, SEG_K, SEG_E, RSB,   # as in the forward
    LSE, DELTA,     # [B, H, Tq] fp32 contiguous
    DK, DV,         # [B, H, Tk, D] contiguous, written
    KPM, RANK, KV_END, SEED,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_rh, stride_rm, stride_rd,
    stride_kpm_b, stride_kpm_n, stride_rank_b, stride_rank_t,
    stride_sq_b, stride_sk_b,
    H, Tq, Tk, mem_len, D, R_len, pos_start,
    window,         # WINDOW: pairs at distance >= window are masked
    qk_scale, sm_scale, p_drop,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BAND: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    kv_mask = (offs_n[:, None] < Tk) & d_ok
    k = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn
                + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    u = tl.load(U + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    w = tl.load(W + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    if HAS_SEG:
        rsb = tl.load(RSB + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        se0 = tl.load(SEG_E + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        se1 = tl.load(SEG_E + (H + h) * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        seg_k = tl.load(SEG_K + b * stride_sk_b + offs_n, mask=offs_n < Tk, other=-2)

    lo = 0
    if CAUSAL:
        lo = tl.maximum(n0 - mem_len, 0) // BLOCK_M * BLOCK_M
    hi = Tq
    if HAS_KPM:
        hi = tl.where(n0 < tl.load(KV_END + b), Tq, 0)
    if WINDOW:      # queries i < j - mem_len + window see key j
        hi = tl.minimum(hi, tl.maximum(n0 + BLOCK_N - 1 - mem_len + window, 0))
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    ii = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, BLOCK_N)
    band = tl.arange(0, BAND)
    skew = jj[None, :] + (BLOCK_M - 1 - ii[:, None])
    c = pos_start - mem_len
    r_base = R + h * stride_rh

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + ii
        q_mask = (offs_m[:, None] < Tq) & d_ok
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                    + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
        do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                     + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
        lse = tl.load(LSE + bh * Tq + offs_m, mask=offs_m < Tq, other=float("inf"))
        delta = tl.load(DELTA + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)
        rank_q = offs_m
        if HAS_PERM:
            rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t,
                             mask=offs_m < Tq, other=0)
        qu = (q + u[None, :]).to(K.dtype.element_ty)
        qw = (q + w[None, :]).to(K.dtype.element_ty)
        rows = c - m0 - BLOCK_M + 1 + n0 + band
        r = tl.load(r_base + rows[:, None] * stride_rm + offs_d[None, :] * stride_rd,
                    mask=(rows[:, None] >= 0) & (rows[:, None] < R_len) & d_ok, other=0.0)
        s = _dot(qu, tl.trans(k), UPCAST, PRECISION)
        s += tl.gather(_dot(qw, tl.trans(r), UPCAST, PRECISION), skew, 1)
        if HAS_SEG:
            qs = q + rsb[None, :]
            seg_q = tl.load(SEG_Q + b * stride_sq_b + offs_m, mask=offs_m < Tq, other=-1)
            same = seg_q[:, None] == seg_k[None, :]
            s += tl.where(same, tl.sum(qs * se0[None, :], 1)[:, None],
                          tl.sum(qs * se1[None, :], 1)[:, None])
        vis = _visible(offs_m, offs_n, b, Tq, Tk, mem_len, KPM, stride_kpm_b, stride_kpm_n,
                       RANK, stride_rank_b, stride_rank_t, rank_q,
                       CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT)
        if WINDOW:
            vis = vis & ((mem_len + offs_m[:, None] - offs_n[None, :]) < window)
        p = tl.where(vis, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), UPCAST, PRECISION)
        if DROPOUT:
            keep = _keep(seed, bh, offs_m, offs_n, Tq, Tk, p_drop)
            dv += _dot(tl.trans(tl.where(keep, p / (1.0 - p_drop), 0.0)).to(do.dtype), do,
                       UPCAST, PRECISION)
            dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
        else:
            dv += _dot(tl.trans(p).to(do.dtype), do, UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds).to(qu.dtype), qu, UPCAST, PRECISION)

    out_off = (bh * Tk + offs_n[:, None]) * D + offs_d[None, :]
    tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _rel_attn_bwd_dq_kernel(
    Q, K, V, DO, R, U, W, SEG_Q, SEG_K, SEG_E, RSB, LSE, DELTA,   # as in the dK/dV kernel
    DQU,            # [B, H, Tq, D] fp32: d(q + u) (content term), written
    DQW,            # [B, H, Tq, D] fp32: d(q + v) (position term), written
    DR,             # [H, R, D] fp32, zeroed: dr, accumulated with atomics
    SEG_A,          # [B, H, Tq, 2] fp32: Σ_j dS_ij over same / different segments (HAS_SEG)
    KPM, RANK, KV_END, SEED,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_rh, stride_rm, stride_rd,
    stride_kpm_b, stride_kpm_n, stride_rank_b, stride_rank_t,
    stride_sq_b, stride_sk_b,
    H, Tq, Tk, mem_len, D, R_len, pos_start,
    window,         # WINDOW: pairs at distance >= window are masked
    qk_scale, sm_scale, p_drop,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BAND: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    q_mask = (offs_m[:, None] < Tq) & d_ok
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh * Tq + offs_m, mask=offs_m < Tq, other=float("inf"))
    delta = tl.load(DELTA + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)
    u = tl.load(U + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    w = tl.load(W + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    qu = (q + u[None, :]).to(K.dtype.element_ty)
    qw = (q + w[None, :]).to(K.dtype.element_ty)
    if HAS_SEG:
        rsb = tl.load(RSB + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        se0 = tl.load(SEG_E + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        se1 = tl.load(SEG_E + (H + h) * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        qs = q + rsb[None, :]
        ef_same = tl.sum(qs * se0[None, :], 1)
        ef_diff = tl.sum(qs * se1[None, :], 1)
        seg_q = tl.load(SEG_Q + b * stride_sq_b + offs_m, mask=offs_m < Tq, other=-1)
        a_same = tl.zeros([BLOCK_M], dtype=tl.float32)
        a_diff = tl.zeros([BLOCK_M], dtype=tl.float32)
    rank_q = offs_m
    if HAS_PERM:
        rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t, mask=offs_m < Tq, other=0)

    lo, hi = _key_range(b, m0, Tk, mem_len, KV_END, 0, CAUSAL, HAS_KPM, False, BLOCK_M)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    ii = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, BLOCK_N)
    band = tl.arange(0, BAND)
    skew = jj[None, :] + (BLOCK_M - 1 - ii[:, None])             # [BLOCK_M, BLOCK_N]
    unskew = band[None, :] - (BLOCK_M - 1 - ii[:, None])         # [BLOCK_M, BAND]: column jj
    unskew_ok = (unskew >= 0) & (unskew < BLOCK_N)
    unskew = tl.minimum(tl.maximum(unskew, 0), BLOCK_N - 1)
    c = pos_start - mem_len
    r_base = R + h * stride_rh

    dqu = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dqw = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WINDOW:      # first key block within the window of the block's first query
        lo = tl.maximum(lo, tl.maximum(m0 + mem_len - window + 1, 0) // BLOCK_N * BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + jj
        kv_mask = (offs_n[:, None] < Tk) & d_ok
        k = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn
                    + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn
                    + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        rows = c - m0 - BLOCK_M + 1 + n0 + band
        rows_ok = (rows >= 0) & (rows < R_len)
        r = tl.load(r_base + rows[:, None] * stride_rm + offs_d[None, :] * stride_rd,
                    mask=rows_ok[:, None] & d_ok, other=0.0)
        s = _dot(qu, tl.trans(k), UPCAST, PRECISION)
        s += tl.gather(_dot(qw, tl.trans(r), UPCAST, PRECISION), skew, 1)
        if HAS_SEG:
            seg_k = tl.load(SEG_K + b * stride_sk_b + offs_n, mask=offs_n < Tk, other=-2)
            same = seg_q[:, None] == seg_k[None, :]
            s += tl.where(same, ef_same[:, None], ef_diff[:, None])
        vis = _visible(offs_m, offs_n, b, Tq, Tk, mem_len, KPM, stride_kpm_b, stride_kpm_n,
                       RANK, stride_rank_b, stride_rank_t, rank_q,
                       CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT)
        if WINDOW:
            vis = vis & ((mem_len + offs_m[:, None] - offs_n[None, :]) < window)
        p = tl.where(vis, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), UPCAST, PRECISION)
        if DROPOUT:
            keep = _keep(seed, bh, offs_m, offs_n, Tq, Tk, p_drop)
            dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
        ds = p * (dp - delta[:, None])                                # [BLOCK_M, BLOCK_N]
        dqu += _dot(ds.to(k.dtype), k, UPCAST, PRECISION)
        ds_band = tl.where(unskew_ok, tl.gather(ds, unskew, 1), 0.0)  # [BLOCK_M, BAND]
        dqw += _dot(ds_band.to(r.dtype), r, UPCAST, PRECISION)
        dr = _dot(tl.trans(ds_band).to(qw.dtype), qw, UPCAST, PRECISION)   # [BAND, BLOCK_D]
        tl.atomic_add(DR + (h * R_len + rows[:, None]) * D + offs_d[None, :], dr * sm_scale,
                      mask=rows_ok[:, None] & d_ok)
        if HAS_SEG:
            a_same += tl.sum(tl.where(same, ds, 0.0), 1)
            a_diff += tl.sum(tl.where(same, 0.0, ds), 1)

    out_off = (bh * Tq + offs_m[:, None]) * D + offs_d[None, :]
    tl.store(DQU + out_off, dqu * sm_scale, mask=q_mask)
    tl.store(DQW + out_off, dqw * sm_scale, mask=q_mask)
    if HAS_SEG:
        tl.store(SEG_A + (bh * Tq + offs_m) * 2, a_same * sm_scale, mask=offs_m < Tq)
        tl.store(SEG_A + (bh * Tq + offs_m) * 2 + 1, a_diff * sm_scale, mask=offs_m < Tq)


def _config(D: int, Tq: Optional[int] = None, dtype: torch.dtype = torch.float16):
    """(BLOCK_M, BLOCK_N, BLOCK_D, BAND, num_warps, num_stages). Square tiles keep the band
    (BLOCK_M + BLOCK_N - 1 rows of r) a power of two wide. The tile shrinks with the head
    dim and the element size so that every kernel fits in an A100's shared memory (166912
    bytes per block; H100/H200: 232448), measured by compiling for sm_80 and sm_90
    (tests/test_triton_compile.py) with every flag on:

    =========  ==========  ===================  ==================================
    dtype      D           tile (M = N, band)   largest kernel (dQ), sm_90 / sm_80
    =========  ==========  ===================  ==================================
    16-bit     <= 64       64, 128              132 / 91 KB (D 64)
    16-bit     <= 256      32, 64               197 / 148 KB (D 256)
    fp32       <= 32       64, 128              115 / 123 KB (D 32)
    fp32       <= 128      32, 64               148 / 148 KB (D 128, tf32)
    fp32       <= 256      16, 32               164 / 164 KB (D 256, tf32)
    =========  ==========  ===================  ==================================

    (64-row tiles at fp32 D 64 need 181 KB on sm_80; at 16-bit D 128, 263 KB on sm_90.)
    With a few queries (``Tq <= DECODE_MAX_Q``, forward only) a 16-row query block and
    key blocks of 64 (16-bit D <= 128, fp32 D <= 64), 32 (16-bit D 256, fp32 D <= 128) or
    16: a 64-row query block would be mostly padding. Not yet tuned on a GPU."""
    block_d = max(16, triton.next_power_of_2(D))
    if _interpreting():
        return 16, 16, block_d, 32, 1, 1
    warps = 4 if block_d <= 64 else 8
    wide = torch.empty((), dtype=dtype).element_size() >= 4
    if Tq is not None and Tq <= DECODE_MAX_Q:
        bn = 64 if block_d <= (64 if wide else 128) else 32 if block_d <= (128 if wide else 256) else 16
        return 16, bn, block_d, max(32, 2 * bn), warps, 2
    bm = 64 if block_d <= (32 if wide else 64) else 32 if block_d <= 128 or not wide else 16
    return bm, bm, block_d, 2 * bm, warps, 2


#: Queries up to which the forward takes the decoding tile shape (see :func:`_config`).
DECODE_MAX_Q = 16


def decode_splits(B: int, H: int, Tq: int, Tk: int, D: int, device,
                  dtype: torch.dtype = torch.float16) -> int:
    """The number of key splits the forward picks when none is given: more than 1 only on
    CUDA (never on CPU or in the interpreter), when the ``B·H·⌈Tq/BLOCK_M⌉`` programs cannot
    fill the GPU and the keys are long (``kernels.attention._auto_splits``)."""
    bm, bn = _config(D, Tq, dtype)[:2]
    return _auto_splits(B, H, Tq, Tk, bm, bn, torch.device(device))


def rel_attention_forward(q, k, v, r, r_w_bias, r_r_bias, *, causal=True, pos_start=None,
                          window=None, key_padding_mask=None, perm_rank=None, perm_strict=False,
                          seg_q=None, seg_k=None, seg_embed=None, r_s_bias=None,
                          scale=None, dropout_p=0.0, seed=None, num_splits=None):
    """-> (out [B, H, Tq, D] contiguous, lse [B, H, Tq] fp32, base 2). See the module docstring.

    window: None, or the sliding window (pairs at distance ``>= window`` masked).

    num_splits: key splits (flash-decoding: each split's partial output and lse, then
    ``kernels.attention``'s combine kernel); None picks them with :func:`decode_splits`
    (1 except on CUDA with few queries and long keys). Any value gives the same result
    within fp32 rounding, and the same dropout mask (the counter is a function of
    (b, h, i, j)); the backward is the same for every split count.
    """
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    pos_start = Tk - 1 if pos_start is None else pos_start
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, Tq), float("inf"), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or Tk == 0:
        return out.zero_(), lse
    kpm, rank, kv_end, mstrides = _mask_args(q, key_padding_mask, perm_rank)
    has_seg = seg_embed is not None
    if has_seg:
        sq, sk = seg_q.to(torch.int32), seg_k.to(torch.int32)
        se, rsb = seg_embed.contiguous(), r_s_bias.contiguous()
    else:
        sq = sk = se = rsb = kv_end
    bm, bn, bd, band, warps, stages = _config(D, Tq, q.dtype)
    if num_splits is None:
        num_splits = decode_splits(B, H, Tq, Tk, D, q.device, q.dtype)
    if num_splits < 1:
        raise ValueError(f"rel_attention_forward: num_splits must be >= 1, got {num_splits}")
    split = num_splits > 1
    if split:   # whole key blocks per split; a count above the key blocks gives one block each
        keys_per_split = triton.cdiv(triton.cdiv(Tk, num_splits), bn) * bn
        num_splits = triton.cdiv(Tk, keys_per_split)
        o_target = torch.empty((B, H, num_splits, Tq, D), dtype=torch.float32, device=q.device)
        l_target = torch.empty((B, H, num_splits, Tq), dtype=torch.float32, device=q.device)
        o_strides = (o_target.stride(0), o_target.stride(1), o_target.stride(3),
                     o_target.stride(4))
        l_strides = (l_target.stride(0), l_target.stride(1))
        split_strides = (o_target.stride(2), l_target.stride(2))
    else:
        keys_per_split = 0
        o_target, l_target = out, lse
        o_strides, l_strides, split_strides = out.stride(), (H * Tq, Tq), (0, 0)
    _rel_attn_fwd_kernel[(triton.cdiv(Tq, bm), B * H, num_splits)](
        q, k, v, r, r_w_bias.contiguous(), r_r_bias.contiguous(), sq, sk, se, rsb,
        o_target, l_target, kpm, rank, kv_end, _seed_arg(q, dropout_p, seed),
        *q.stride(), *k.stride(), *v.stride(), *r.stride(), *o_strides, *l_strides,
        *split_strides, keys_per_split, *mstrides,
        sq.stride(0) if has_seg else 0, sk.stride(0) if has_seg else 0,
        H, Tq, Tk, Tk - Tq, D, r.shape[1], pos_start, window or 0, scale * LOG2E,
        float(dropout_p),
        CAUSAL=causal, HAS_KPM=key_padding_mask is not None, HAS_PERM=perm_rank is not None,
        PERM_STRICT=perm_strict, HAS_SEG=has_seg, DROPOUT=dropout_p > 0,
        WINDOW=window is not None, SPLIT_K=split,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, BAND=band,
        UPCAST=_interpreting() and q.dtype == torch.bfloat16, PRECISION=_precision(q.dtype),
        num_warps=warps, num_stages=stages,
    )
    if split:
        _attn_combine_kernel[(Tq, B * H)](
            o_target, l_target, out, lse, num_splits, Tq, D,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=bd, num_warps=4)
    return out, lse


def rel_attention_backward(do, q, k, v, r, r_w_bias, r_r_bias, out, lse, *, causal=True,
                           pos_start=None, window=None, key_padding_mask=None, perm_rank=None,
                           perm_strict=False, seg_q=None, seg_k=None, seg_embed=None,
                           r_s_bias=None, scale=None, dropout_p=0.0, seed=None):
    """Gradients of :func:`rel_attention_forward`'s ``out``: (dq, dk, dv, dr, d_r_w_bias,
    d_r_r_bias, d_seg_embed, d_r_s_bias); the last two are None without segments."""
    B, H, Tq, D = q.shape
    Tk, R = k.shape[2], r.shape[1]
    pos_start = Tk - 1 if pos_start is None else pos_start
    scale = D ** -0.5 if scale is None else scale
    has_seg = seg_embed is not None
    dk = torch.zeros((B, H, Tk, D), dtype=k.dtype, device=k.device)
    dv = torch.zeros((B, H, Tk, D), dtype=v.dtype, device=v.device)
    dqu = torch.zeros((B, H, Tq, D), dtype=torch.float32, device=q.device)
    dqw = torch.zeros_like(dqu)
    dr = torch.zeros((H, R, D), dtype=torch.float32, device=q.device)
    seg_a = torch.zeros((B, H, Tq, 2), dtype=torch.float32, device=q.device)
    if q.numel() and Tk:
        delta = (do.float() * out.float()).sum(-1).contiguous()            # [B, H, Tq]
        kpm, rank, kv_end, mstrides = _mask_args(q, key_padding_mask, perm_rank)
        if has_seg:
            sq, sk = seg_q.to(torch.int32), seg_k.to(torch.int32)
            se, rsb = seg_embed.contiguous(), r_s_bias.contiguous()
        else:
            sq = sk = se = rsb = kv_end
        bm, bn, bd, band, warps, stages = _config(D, None, q.dtype)
        common = (
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *r.stride(), *mstrides,
            sq.stride(0) if has_seg else 0, sk.stride(0) if has_seg else 0,
            H, Tq, Tk, Tk - Tq, D, R, pos_start, window or 0, scale * LOG2E, scale,
            float(dropout_p))
        flags = dict(
            CAUSAL=causal, HAS_KPM=key_padding_mask is not None, HAS_PERM=perm_rank is not None,
            PERM_STRICT=perm_strict, HAS_SEG=has_seg, DROPOUT=dropout_p > 0,
            WINDOW=window is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, BAND=band,
            UPCAST=_interpreting() and q.dtype == torch.bfloat16, PRECISION=_precision(q.dtype),
            num_warps=warps, num_stages=stages)
        u, w = r_w_bias.contiguous(), r_r_bias.contiguous()
        seed_arg = _seed_arg(q, dropout_p, seed)
        _rel_attn_bwd_dkdv_kernel[(triton.cdiv(Tk, bn), B * H)](
            q, k, v, do, r, u, w, sq, sk, se, rsb, lse, delta, dk, dv,
            kpm, rank, kv_end, seed_arg, *common, **flags)
        _rel_attn_bwd_dq_kernel[(triton.cdiv(Tq, bm), B * H)](
            q, k, v, do, r, u, w, sq, sk, se, rsb, lse, delta, dqu, dqw, dr, seg_a,
            kpm, rank, kv_end, seed_arg, *common, **flags)
    dq = dqu + dqw                                                        # [B, H, Tq, D]
    d_seg_embed = d_r_s_bias = None
    if has_seg:
        se = seg_embed.float()                                            # [2, H, D]
        qs = q.float() + r_s_bias.float()[None, :, None]                  # [B, H, Tq, D]
        d_qs = seg_a[..., 0:1] * se[0][None, :, None] + seg_a[..., 1:2] * se[1][None, :, None]
        dq = dq + d_qs
        d_seg_embed = torch.einsum("bhis,bhid->shd", seg_a, qs).to(seg_embed.dtype)
        d_r_s_bias = d_qs.sum((0, 2)).to(r_s_bias.dtype)
    return (dq.to(q.dtype), dk, dv, dr.to(r.dtype), dqu.sum((0, 2)).to(r_w_bias.dtype),
            dqw.sum((0, 2)).to(r_r_bias.dtype), d_seg_embed, d_r_s_bias)
