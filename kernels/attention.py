"""Fused scaled-dot-product attention (FlashAttention-2 style), Triton, forward and backward,
with the masks computed in the kernel from O(T) data.

Shapes: ``q [B, H, Tq, D]``, ``k, v [B, H, Tk, D]`` (keys are ``[memory; current]``,
``mem_len = Tk - Tq``), ``out [B, H, Tq, D]``, ``lse [B, H, Tq]`` (fp32, base 2).

Visibility of key ``j`` to query ``i`` (all that apply):
  causal ``j <= i + mem_len``; padding ``kpm[b, j] == 0``; permutation: ``j < mem_len`` or
  ``rank[b, j - mem_len] <= rank[b, i]`` (``<`` for XLNet's query stream).
No ``[Tq, Tk]`` mask or score tensor is stored. Key blocks past the causal diagonal or
past the last unpadded key (``kv_end[b]``) are not visited.

Forward, per query row (scores in base 2, ``s_ij = q_i·k_j · scale · log2 e``), online:
  ``m_i = max_j s_ij``, ``l_i = Σ_j 2^(s_ij − m_i)``, ``o_i = Σ_j 2^(s_ij − m_i) v_j / l_i``,
  ``lse_i = m_i + log2 l_i``. A row that sees no key has ``l_i = 0``: ``o_i = 0`` and
  ``lse_i = +inf`` so that the backward's probabilities are exactly 0 there.

Backward, with ``P_ij = 2^(s_ij − lse_i)`` recomputed tile by tile:
  ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``Δ_i = Σ_d dO_id O_id (= Σ_j P_ij dP_ij)``,
  ``dS = P ∘ (dP − Δ)``, ``dQ = scale · dS K``, ``dK = scale · dSᵀ Q``.
One kernel owns a key block and loops over query blocks (dK, dV); another owns a query
block and loops over key blocks (dQ): no atomics.
"""
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # UPCAST: the Triton interpreter multiplies bf16 bit patterns (docs/ARCHITECTURE.md,
    # measured facts); fp32 is exact.
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _keep(seed, bh, offs_m, offs_n, Tq, Tk, p_drop):
    """[BLOCK_M, BLOCK_N] bool: dropout keeps (b, h, i, j). Philox counter =
    (bh * Tq + i) * Tk + j (int64), so the forward and both backward kernels (and
    :func:`dropout_keep_mask`) draw the same numbers."""
    offs = (bh.to(tl.int64) * Tq + offs_m[:, None]) * Tk + offs_n[None, :]
    return tl.rand(seed, offs) >= p_drop


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, seed, bh, offs_m, offs_n, max_q, max_k, p_drop,
                         DROPOUT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores s [BLOCK_M, BLOCK_N] (-inf where masked) and its values
    v [BLOCK_N, BLOCK_D] into the running max m_i, normaliser l_i (before dropout) and output
    acc. Returns (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)           # row with nothing yet
    p = tl.exp2(s - m_safe[:, None])                                 # 0 where masked
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)                                 # normaliser: before dropout
    if DROPOUT:
        keep = _keep(seed, bh, offs_m, offs_n, max_q, max_k, p_drop)
        p = tl.where(keep, p / (1.0 - p_drop), 0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PRECISION)
    return m_new, l_i, acc


@triton.jit
def _seq_bounds(CU_Q, CU_K, b, Tq, Tk, mem_len, VARLEN: tl.constexpr):
    """(q_start, k_start, Tq, Tk, mem_len) of sequence b: the whole dims, or, for packed
    (varlen) inputs, the slice ``cu_seqlens[b] : cu_seqlens[b + 1]``."""
    q_start = 0
    k_start = 0
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        k_start = tl.load(CU_K + b)
        Tq = tl.load(CU_Q + b + 1) - q_start
        Tk = tl.load(CU_K + b + 1) - k_start
        mem_len = Tk - Tq
    return q_start, k_start, Tq, Tk, mem_len


@triton.jit
def _visible(offs_m, offs_n, b, Tq, Tk, mem_len,
             kpm_ptr, stride_kpm_b, stride_kpm_n,
             rank_ptr, stride_rank_b, stride_rank_t, rank_q,
             CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
             PERM_STRICT: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: query offs_m may see key offs_n."""
    vis = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
    if CAUSAL:
        vis = vis & (offs_n[None, :] <= offs_m[:, None] + mem_len)
    if HAS_KPM:
        pad = tl.load(kpm_ptr + b * stride_kpm_b + offs_n * stride_kpm_n, mask=offs_n < Tk, other=1)
        vis = vis & (pad == 0)[None, :]
    if HAS_PERM:
        t = offs_n - mem_len                      # current-token index of key j (< 0: memory)
        rank_k = tl.load(rank_ptr + b * stride_rank_b + t * stride_rank_t,
                         mask=(t >= 0) & (offs_n < Tk), other=0)
        if PERM_STRICT:
            sees = rank_k[None, :] < rank_q[:, None]
        else:
            sees = rank_k[None, :] <= rank_q[:, None]
        vis = vis & ((t[None, :] < 0) | sees)
    return vis


@triton.jit
def _key_range(b, m0, Tk, mem_len, KV_END, keys_per_split,
               CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, SPLIT_K: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """[lo, hi): the keys that the query block starting at row m0 of batch b may see —
    below the causal diagonal (bottom-right aligned), before the first padded key
    (KV_END[b]), and, with SPLIT_K, inside this program's split (program_id(2))."""
    hi = Tk
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M + mem_len)
    if HAS_KPM:
        hi = tl.minimum(hi, tl.load(KV_END + b))
    lo = 0
    if SPLIT_K:
        lo = tl.program_id(2) * keys_per_split
        hi = tl.minimum(hi, lo + keys_per_split)
    return lo, hi


@triton.jit
def _attn_fwd_kernel(
    Q, K, V,        # q [B, H, Tq, D], k, v [B, H, Tk, D]; any strides
    O,              # out [B, H, Tq, D], written
    LSE,            # lse [B, H, Tq] fp32 contiguous, written (base 2; +inf for empty rows)
    KPM,            # key padding [B, Tk] uint8 (1 = padding); unused unless HAS_KPM
    RANK,           # permutation ranks [B, Tq] int32; unused unless HAS_PERM
    KV_END,         # [B] int32: index of the last unpadded key + 1; unused unless HAS_KPM
    SEED,           # [1] int64: Philox seed of the dropout mask; unused unless DROPOUT
    CU_Q, CU_K,     # [B + 1] int32 cumulative lengths of packed sequences; unused unless VARLEN
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_kpm_b, stride_kpm_n, stride_rank_b, stride_rank_t,
    stride_lb, stride_lh,   # of lse (and delta): element (b, h, i) at b*stride_lb + h*stride_lh + i
    stride_os, stride_ls,   # SPLIT_K: split s of out / lse at + s*stride_os / + s*stride_ls
    keys_per_split,         # SPLIT_K: keys per split (a multiple of BLOCK_N)
    H, Tq, Tk, mem_len, D,
    max_q, max_k,   # longest sequences (dropout counters), = Tq, Tk unless VARLEN
    qk_scale,       # scale * log2(e)
    p_drop,         # dropout probability (DROPOUT only)
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    SPLIT_K: tl.constexpr,  # flash-decoding: program_id(2) owns one range of keys; partial out
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_start, k_start, Tq, Tk, mem_len = _seq_bounds(CU_Q, CU_K, b, Tq, Tk, mem_len, VARLEN)
    if pid_m * BLOCK_M >= Tq:       # varlen: past the end of a shorter sequence
        return
    Q += q_start * stride_qm
    O += q_start * stride_om
    K += k_start * stride_kn
    V += k_start * stride_vn
    LSE += b * stride_lb + h * stride_lh + q_start
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=(offs_m[:, None] < Tq) & d_ok, other=0.0)
    rank_q = offs_m
    if HAS_PERM:
        rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t, mask=offs_m < Tq, other=0)

    lo, hi = _key_range(b, pid_m * BLOCK_M, Tk, mem_len, KV_END, keys_per_split,
                        CAUSAL, HAS_KPM, SPLIT_K, BLOCK_M)
    if SPLIT_K:
        O += tl.program_id(2) * stride_os
        LSE += tl.program_id(2) * stride_ls

    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < Tk) & d_ok
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), UPCAST, PRECISION) * qk_scale          # [BLOCK_M, BLOCK_N]
        vis = _visible(offs_m, offs_n, b, Tq, Tk, mem_len, KPM, stride_kpm_b, stride_kpm_n,
                       RANK, stride_rank_b, stride_rank_t, rank_q,
                       CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT)
        s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, seed, bh, offs_m, offs_n,
                                             max_q, max_k, p_drop, DROPOUT, UPCAST, PRECISION)

    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    # Empty row: +inf makes the backward's probabilities 0; a split's partial uses -inf
    # (weight 0 in the combine).
    empty_lse = float("-inf") if SPLIT_K else float("inf")
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), empty_lse)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om
             + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < Tq) & d_ok)
    tl.store(LSE + offs_m, lse, mask=offs_m < Tq)


@triton.jit
def _attn_combine_kernel(
    O_PART,      # [B, H, S, Tq, D] fp32: each split's normalised partial output
    LSE_PART,    # [B, H, S, Tq] fp32: each split's lse (base 2; -inf where it saw no key)
    O,           # out [B, H, Tq, D] contiguous, written
    LSE,         # lse [B, H, Tq] fp32 contiguous, written (+inf for empty rows)
    S, Tq, D,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out_i = Σ_s 2^(lse_si − m) · out_si / Σ_s 2^(lse_si − m), m = max_s lse_si."""
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse_s = tl.load(LSE_PART + (bh * S + offs_s) * Tq + i, mask=offs_s < S, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse_s - m_safe)                                   # 0 for empty splits
    o_s = tl.load(O_PART + ((bh * S + offs_s[:, None]) * Tq + i) * D + offs_d[None, :],
                  mask=(offs_s[:, None] < S) & (offs_d[None, :] < D), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o_s, 0) / tl.where(total > 0, total, 1.0)
    tl.store(O + (bh * Tq + i) * D + offs_d, out.to(O.dtype.element_ty), mask=offs_d < D)
    lse = m_safe + tl.log2(tl.where(total > 0, total, 1.0))
    tl.store(LSE + bh * Tq + i, tl.where(total > 0, lse, float("inf")))


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO,    # q, do [B, H, Tq, D]; k, v [B, H, Tk, D]; any strides
    LSE, DELTA,     # [B, H, Tq] fp32 contiguous: forward's lse (base 2), rowsum(dO * O)
    DK, DV,         # dk, dv [B, H, Tk, D] contiguous, written
    KPM, RANK, KV_END, SEED, CU_Q, CU_K,   # as in the forward
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,   # of dk and dv (same layout)
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_kpm_b, stride_kpm_n, stride_rank_b, stride_rank_t,
    stride_lb, stride_lh,   # of lse (and delta): element (b, h, i) at b*stride_lb + h*stride_lh + i
    H, Tq, Tk, mem_len, D,
    max_q, max_k,   # longest sequences (dropout counters), = Tq, Tk unless VARLEN
    qk_scale, sm_scale,   # scale * log2(e), scale
    p_drop,               # dropout probability (DROPOUT only)
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_start, k_start, Tq, Tk, mem_len = _seq_bounds(CU_Q, CU_K, b, Tq, Tk, mem_len, VARLEN)
    if pid_n * BLOCK_N >= Tk:       # varlen: past the end of a shorter sequence
        return
    Q += q_start * stride_qm
    DO += q_start * stride_dom
    K += k_start * stride_kn
    V += k_start * stride_vn
    DK += b * stride_dkb + h * stride_dkh + k_start * stride_dkn
    DV += b * stride_dkb + h * stride_dkh + k_start * stride_dkn
    LSE += b * stride_lb + h * stride_lh + q_start
    DELTA += b * stride_lb + h * stride_lh + q_start
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    kv_mask = (offs_n[:, None] < Tk) & d_ok
    k = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn
                + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)

    lo = 0
    if CAUSAL:   # queries i >= j - mem_len see key j: start at the block of the first one
        lo = tl.maximum(pid_n * BLOCK_N - mem_len, 0) // BLOCK_M * BLOCK_M
    hi = Tq
    if HAS_KPM:  # a key block wholly past the last unpadded key gets zero gradient
        hi = tl.where(pid_n * BLOCK_N < tl.load(KV_END + b), Tq, 0)

    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_mask = (offs_m[:, None] < Tq) & d_ok
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=q_mask, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                     mask=q_mask, other=0.0)
        lse = tl.load(LSE + offs_m, mask=offs_m < Tq, other=float("inf"))
        delta = tl.load(DELTA + offs_m, mask=offs_m < Tq, other=0.0)
        rank_q = offs_m
        if HAS_PERM:
            rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t,
                             mask=offs_m < Tq, other=0)
        s = _dot(q, tl.trans(k), UPCAST, PRECISION) * qk_scale          # [BLOCK_M, BLOCK_N]
        vis = _visible(offs_m, offs_n, b, Tq, Tk, mem_len, KPM, stride_kpm_b, stride_kpm_n,
                       RANK, stride_rank_b, stride_rank_t, rank_q,
                       CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT)
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), UPCAST, PRECISION)                    # dO Vᵀ
        if DROPOUT:   # out used P_d = P * keep / (1 - p): dV = P_dᵀ dO, dP = dP_d * keep / (1 - p)
            keep = _keep(seed, bh, offs_m, offs_n, max_q, max_k, p_drop)
            dv += _dot(tl.trans(tl.where(keep, p / (1.0 - p_drop), 0.0)).to(do.dtype), do,
                       UPCAST, PRECISION)
            dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
        else:
            dv += _dot(tl.trans(p).to(do.dtype), do, UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds).to(q.dtype), q, UPCAST, PRECISION)

    out_off = offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO,    # as in _attn_bwd_dkdv_kernel
    LSE, DELTA,
    DQ,             # dq [B, H, Tq, D] contiguous, written
    KPM, RANK, KV_END, SEED, CU_Q, CU_K,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_kpm_b, stride_kpm_n, stride_rank_b, stride_rank_t,
    stride_lb, stride_lh,   # of lse (and delta): element (b, h, i) at b*stride_lb + h*stride_lh + i
    H, Tq, Tk, mem_len, D,
    max_q, max_k,   # longest sequences (dropout counters), = Tq, Tk unless VARLEN
    qk_scale, sm_scale, p_drop,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_start, k_start, Tq, Tk, mem_len = _seq_bounds(CU_Q, CU_K, b, Tq, Tk, mem_len, VARLEN)
    if pid_m * BLOCK_M >= Tq:       # varlen: past the end of a shorter sequence
        return
    Q += q_start * stride_qm
    DO += q_start * stride_dom
    K += k_start * stride_kn
    V += k_start * stride_vn
    DQ += b * stride_dqb + h * stride_dqh + q_start * stride_dqm
    LSE += b * stride_lb + h * stride_lh + q_start
    DELTA += b * stride_lb + h * stride_lh + q_start
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    q_mask = (offs_m[:, None] < Tq) & d_ok
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
    lse = tl.load(LSE + offs_m, mask=offs_m < Tq, other=float("inf"))
    delta = tl.load(DELTA + offs_m, mask=offs_m < Tq, other=0.0)
    rank_q = offs_m
    if HAS_PERM:
        rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t, mask=offs_m < Tq, other=0)

    _, hi = _key_range(b, pid_m * BLOCK_M, Tk, mem_len, KV_END, 0,
                       CAUSAL, HAS_KPM, False, BLOCK_M)

    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < Tk) & d_ok
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), UPCAST, PRECISION) * qk_scale
        vis = _visible(offs_m, offs_n, b, Tq, Tk, mem_len, KPM, stride_kpm_b, stride_kpm_n,
                       RANK, stride_rank_b, stride_rank_t, rank_q,
                       CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT)
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), UPCAST, PRECISION)
        if DROPOUT:
            keep = _keep(seed, bh, offs_m, offs_n, max_q, max_k, p_drop)
            dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST, PRECISION)

    tl.store(DQ + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


# --------------------------------------------------------------------------- launchers

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _config(D: int, dtype: torch.dtype, backward: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages). Not yet tuned on a GPU."""
    block_d = max(16, triton.next_power_of_2(D))
    if _interpreting():
        return 16, 16, block_d, 1, 1           # small blocks: multi-block logic at tiny T
    wide = dtype in (torch.float32, torch.float64)
    if backward:
        bm, bn = (64, 64) if block_d <= 64 else (32, 64) if block_d <= 128 else (32, 32)
    else:
        bm, bn = (128, 64) if block_d <= 128 else (64, 32)
    if wide:
        bm = max(16, bm // 2)
    warps = 4 if block_d <= 64 else 8
    return bm, bn, block_d, warps, (3 if block_d <= 64 else 2)


def _mask_args(q, key_padding_mask, perm_rank):
    """(kpm uint8 [B, Tk] | dummy, rank int32 [B, Tq] | dummy, kv_end int32 [B] | dummy, strides)."""
    dummy = torch.empty(1, dtype=torch.int32, device=q.device)
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(torch.uint8)
        Tk = kpm.shape[1]
        pos = torch.arange(1, Tk + 1, device=q.device, dtype=torch.int32)
        kv_end = torch.where(kpm == 0, pos, torch.zeros_like(pos)).amax(1).to(torch.int32)
        kpm_strides = (kpm.stride(0), kpm.stride(1))
    else:
        kpm, kv_end, kpm_strides = dummy, dummy, (0, 0)
    if perm_rank is not None:
        rank = perm_rank.to(torch.int32)
        rank_strides = (rank.stride(0), rank.stride(1))
    else:
        rank, rank_strides = dummy, (0, 0)
    return kpm, rank, kv_end, (*kpm_strides, *rank_strides)


def _seed_arg(q, dropout_p, seed):
    if dropout_p <= 0:
        return q                                   # never read (DROPOUT is False)
    if seed is None or seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != q.device:
        raise ValueError("dropout needs seed: an int64 tensor of one element on q's device")
    return seed


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: exact fp32 products unless torch allows tf32 for fp32
    matmuls (as a PyTorch user expects); fp16/bf16 operands keep Triton's default."""
    if dtype == torch.float64 or (dtype == torch.float32
                                  and not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


def _auto_splits(B, H, Tq, Tk, bm, bn, device) -> int:
    """Flash-decoding: split the keys when the (b, h, query-block) programs cannot fill the
    GPU (few queries, long keys). Heuristic, not yet tuned on a GPU."""
    if device.type != "cuda" or _interpreting():
        return 1
    programs = B * H * triton.cdiv(Tq, bm)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms or Tk < 4 * bn:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(Tk, 4 * bn), 64))


def _launch_forward(q, k, v, out, lse, lse_strides, dims, *, causal, key_padding_mask,
                    perm_rank, perm_strict, scale, dropout_p, seed, cu=None, num_splits=1):
    """Shared by the dense and the packed entry points. q, k, v, out: 4-D views
    [B|1, H, T, D]; dims = (B, H, Tq, Tk, D, max_q, max_k); cu = (cu_q, cu_k) or None.
    num_splits > 1 (dense only): flash-decoding, keys split over programs, then combined."""
    B, H, Tq, Tk, D, max_q, max_k = dims
    kpm, rank, kv_end, mstrides = _mask_args(q, key_padding_mask, perm_rank)
    cu_q, cu_k = cu if cu is not None else (kv_end, kv_end)
    bm, bn, bd, warps, stages = _config(D, q.dtype, backward=False)
    split = num_splits > 1
    if split:
        assert cu is None, "split-K is for the dense path"
        keys_per_split = triton.cdiv(triton.cdiv(Tk, num_splits), bn) * bn
        num_splits = triton.cdiv(Tk, keys_per_split)
        o_part = torch.empty((B, H, num_splits, Tq, D), dtype=torch.float32, device=q.device)
        l_part = torch.empty((B, H, num_splits, Tq), dtype=torch.float32, device=q.device)
        o_target, l_target = o_part, l_part
        o_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(3), o_part.stride(4))
        l_strides = (l_part.stride(0), l_part.stride(1))
        split_strides = (o_part.stride(2), l_part.stride(2))
    else:
        keys_per_split = 0
        o_target, l_target, o_strides, l_strides = out, lse, out.stride(), lse_strides
        split_strides = (0, 0)
    _attn_fwd_kernel[(triton.cdiv(max_q, bm), B * H, num_splits)](
        q, k, v, o_target, l_target, kpm, rank, kv_end, _seed_arg(q, dropout_p, seed),
        cu_q, cu_k,
        *q.stride(), *k.stride(), *v.stride(), *o_strides, *mstrides, *l_strides,
        *split_strides, keys_per_split,
        H, Tq, Tk, Tk - Tq, D, max_q, max_k, scale * LOG2E, float(dropout_p),
        CAUSAL=causal, HAS_KPM=key_padding_mask is not None, HAS_PERM=perm_rank is not None,
        PERM_STRICT=perm_strict, DROPOUT=dropout_p > 0, VARLEN=cu is not None, SPLIT_K=split,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
        UPCAST=_interpreting() and q.dtype == torch.bfloat16, PRECISION=_precision(q.dtype),
        num_warps=warps, num_stages=stages,
    )
    if split:
        _attn_combine_kernel[(Tq, B * H)](
            o_part, l_part, out, lse, num_splits, Tq, D,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=bd, num_warps=4)


def _launch_backward(do, q, k, v, lse, delta, dq, dk, dv, lse_strides, dims, *, causal,
                     key_padding_mask, perm_rank, perm_strict, scale, dropout_p, seed, cu=None):
    """Backward counterpart of :func:`_launch_forward` (dk and dv share one layout)."""
    B, H, Tq, Tk, D, max_q, max_k = dims
    kpm, rank, kv_end, mstrides = _mask_args(q, key_padding_mask, perm_rank)
    cu_q, cu_k = cu if cu is not None else (kv_end, kv_end)
    seed_arg = _seed_arg(q, dropout_p, seed)
    bm, bn, bd, warps, stages = _config(D, q.dtype, backward=True)
    flags = dict(
        CAUSAL=causal, HAS_KPM=key_padding_mask is not None, HAS_PERM=perm_rank is not None,
        PERM_STRICT=perm_strict, DROPOUT=dropout_p > 0, VARLEN=cu is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
        UPCAST=_interpreting() and q.dtype == torch.bfloat16, PRECISION=_precision(q.dtype),
        num_warps=warps, num_stages=stages,
    )
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *mstrides, *lse_strides)
    scalars = (H, Tq, Tk, Tk - Tq, D, max_q, max_k, scale * LOG2E, scale, float(dropout_p))
    _attn_bwd_dkdv_kernel[(triton.cdiv(max_k, bn), B * H)](
        q, k, v, do, lse, delta, dk, dv, kpm, rank, kv_end, seed_arg, cu_q, cu_k,
        *dk.stride(), *strides, *scalars, **flags)
    _attn_bwd_dq_kernel[(triton.cdiv(max_q, bm), B * H)](
        q, k, v, do, lse, delta, dq, kpm, rank, kv_end, seed_arg, cu_q, cu_k,
        *dq.stride(), *strides, *scalars, **flags)


def attention_forward(q, k, v, *, causal=False, key_padding_mask=None, perm_rank=None,
                      perm_strict=False, scale=None, dropout_p=0.0, seed=None, num_splits=None):
    """q [B, H, Tq, D], k, v [B, H, Tk, D] -> (out [B, H, Tq, D] contiguous, lse [B, H, Tq] fp32).

    key_padding_mask: bool [B, Tk] (True = padding) or None; perm_rank: int [B, Tq] or None;
    perm_strict: True for XLNet's query stream (rank[t] < rank[i]); dropout_p > 0 needs
    seed (int64 tensor [1] on q's device): the mask is :func:`dropout_keep_mask` (seed).
    num_splits: key splits (flash-decoding); None picks them for few queries and long keys.
    """
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("inf"))
    if Tk == 0:
        return out.zero_(), lse.fill_(float("inf"))
    if num_splits is None:
        bm, bn = _config(D, q.dtype, backward=False)[:2]
        num_splits = _auto_splits(B, H, Tq, Tk, bm, bn, q.device)
    _launch_forward(q, k, v, out, lse, (H * Tq, Tq), (B, H, Tq, Tk, D, Tq, Tk), causal=causal,
                    key_padding_mask=key_padding_mask, perm_rank=perm_rank,
                    perm_strict=perm_strict, scale=scale, dropout_p=dropout_p, seed=seed,
                    num_splits=num_splits)
    return out, lse


def attention_backward(do, q, k, v, out, lse, *, causal=False, key_padding_mask=None,
                       perm_rank=None, perm_strict=False, scale=None, dropout_p=0.0, seed=None):
    """Gradients (dq, dk, dv) of :func:`attention_forward`'s ``out`` for upstream ``do``."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    dq = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, H, Tk, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, H, Tk, D), dtype=v.dtype, device=v.device)
    if q.numel() == 0 or Tk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = (do.float() * out.float()).sum(-1).contiguous()     # [B, H, Tq]
    _launch_backward(do, q, k, v, lse, delta, dq, dk, dv, (H * Tq, Tq),
                     (B, H, Tq, Tk, D, Tq, Tk), causal=causal,
                     key_padding_mask=key_padding_mask, perm_rank=perm_rank,
                     perm_strict=perm_strict, scale=scale, dropout_p=dropout_p, seed=seed)
    return dq, dk, dv


def _packed_view(x, B):
    """[total, H, D] -> a [B, H, total, D] view with batch stride 0 (no copy): the kernels
    add ``b * stride_b``, and sequence b's rows come from cu_seqlens instead."""
    return x.unsqueeze(0).transpose(1, 2).expand(B, -1, -1, -1)


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             *, causal=False, scale=None, dropout_p=0.0, seed=None):
    """Packed sequences: q [total_q, H, D], k, v [total_k, H, D]; sequence b is rows
    ``cu_seqlens[b] : cu_seqlens[b + 1]`` (int32 [B + 1]). Causal is bottom-right aligned
    per sequence. Returns (out [total_q, H, D], lse [H, total_q] fp32)."""
    total_q, H, D = q.shape
    B = cu_seqlens_q.shape[0] - 1
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((H, total_q), float("inf"), dtype=torch.float32, device=q.device)
    if total_q == 0 or B == 0 or max_seqlen_q == 0:
        return out.zero_(), lse
    if k.shape[0] == 0 or max_seqlen_k == 0:
        return out.zero_(), lse
    out.zero_()   # rows of sequences that have no keys are not visited
    q4, k4, v4, out4 = (_packed_view(t, B) for t in (q, k, v, out))
    _launch_forward(q4, k4, v4, out4, lse, (0, total_q),
                    (B, H, 0, 0, D, max_seqlen_q, max_seqlen_k), causal=causal,
                    key_padding_mask=None, perm_rank=None, perm_strict=False, scale=scale,
                    dropout_p=dropout_p, seed=seed, cu=(cu_seqlens_q, cu_seqlens_k))
    return out, lse


def attention_varlen_backward(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, *, causal=False, scale=None, dropout_p=0.0, seed=None):
    """Gradients (dq, dk, dv) of :func:`attention_varlen_forward`'s ``out``."""
    total_q, H, D = q.shape
    B = cu_seqlens_q.shape[0] - 1
    scale = D ** -0.5 if scale is None else scale
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if total_q == 0 or k.shape[0] == 0 or B == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return dq, dk, dv
    delta = (do.float() * out.float()).sum(-1).t().contiguous()  # [H, total_q]
    do4, q4, k4, v4, dq4, dk4, dv4 = (_packed_view(t, B) for t in (do, q, k, v, dq, dk, dv))
    _launch_backward(do4, q4, k4, v4, lse, delta, dq4, dk4, dv4, (0, total_q),
                     (B, H, 0, 0, D, max_seqlen_q, max_seqlen_k), causal=causal,
                     key_padding_mask=None, perm_rank=None, perm_strict=False, scale=scale,
                     dropout_p=dropout_p, seed=seed, cu=(cu_seqlens_q, cu_seqlens_k))
    return dq, dk, dv


@triton.jit
def _dropout_keep_kernel(
    SEED,        # [1] int64: the Philox seed
    KEEP,        # out: [B, H, Tq, Tk] uint8, contiguous (1 = kept)
    Tq, Tk, p_drop,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh = tl.program_id(2)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _keep(tl.load(SEED), bh, offs_m, offs_n, Tq, Tk, p_drop)
    ptrs = KEEP + (bh.to(tl.int64) * Tq + offs_m[:, None]) * Tk + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < Tq) & (offs_n[None, :] < Tk))


def dropout_keep_mask(seed, B, H, Tq, Tk, dropout_p):
    """The dropout mask the attention kernels use for `seed`: bool [B, H, Tq, Tk], True = kept.
    Materialises O(Tq·Tk) memory: for tests and debugging."""
    keep = torch.empty((B, H, Tq, Tk), dtype=torch.uint8, device=seed.device)
    if keep.numel():
        grid = (triton.cdiv(Tq, 16), triton.cdiv(Tk, 16), B * H)
        _dropout_keep_kernel[grid](seed, keep, Tq, Tk, float(dropout_p), BLOCK_M=16, BLOCK_N=16)
    return keep.bool()
