"""Fused scaled-dot-product attention (FlashAttention-2 style), Triton, forward and backward,
with the masks computed in the kernel from O(T) data.

Shapes: ``q [B, H, Tq, D]``, ``k, v [B, H, Tk, D]`` (keys are ``[memory; current]``,
``mem_len = Tk - Tq``), ``out [B, H, Tq, D]``, ``lse [B, H, Tq]`` (fp32, base 2).

Visibility of key ``j`` to query ``i`` (all that apply):
  causal ``j <= i + mem_len``; padding ``kpm[b, j] == 0``; permutation: ``j < mem_len`` or
  ``rank[b, j - mem_len] <= rank[b, i]`` (``<`` for XLNet's query stream).
No ``[Tq, Tk]`` mask or score tensor is stored. Key blocks past the causal diagonal or
past the last unpadded key (``kv_end[b]``) are not visited.

Interior and boundary tiles: each loop over tiles runs twice, first over the interior tiles
(which neither the causal diagonal nor a sequence end can cut: loaded without masks, no
element test), then over the few boundary tiles (the full ``_visible`` test). For a query
block starting at row ``m0`` the keys ``j <= m0 + mem_len`` are causally visible to every row;
for a key block ending at ``n1`` every query ``i >= n1 - 1 - mem_len`` sees all of it. With a
padding or permutation mask an interior tile is first classed from bounds: one with no
padded key and largest rank below the query block's smallest (``<`` for the query stream) is
all visible (no element mask); the rest take an element mask. No tile inside the loop
bounds is skipped: a loop whose body branches around its loads is not software-pipelined
by Triton (its loads are not multi-buffered: shared memory the same at 1, 2 or 3 stages on
sm_90, measured), and the loop bounds already leave out the key blocks past the last
unpadded key and, in rank order, above the staircase. Causal grids hand the last query
blocks (the longest rows) to the first programs.

Warp specialisation (:func:`_attn_fwd_ws_kernel`, :func:`_attn_bwd_dkdv_ws_kernel`,
:func:`_attn_bwd_dq_ws_kernel`; the tuner's ``"<kernel>:ws"`` rows, not yet a table's
choice): a second forward, dK/dV and dQ for dense 16-bit calls without padding,
permutation mask or dropout, whose one loop Triton's sm_90 pipeline splits into a producer
warp (TMA loads) and two consumer warpgroups (products and softmax), FlashAttention-3's
schedule. What the split needs (descriptors built on the device, one loop, no branch in
it; in dQ lse and delta by TMA too) costs them the interior / boundary split above: a
causal call masks every tile.

Permutation masks in rank order (``SORTED``: a permutation mask without causal): the
launchers sort each batch's current tokens by rank once per call, ``order = argsort(rank[b])``
(stable) and ``rank_sorted = rank[b, order]`` (non-decreasing), and the kernels solve the
sorted problem by indexing rows, not by copying tensors: row ``i`` of the sorted problem is
query ``order[i]`` (every load and store of q, out, lse, dO, dQ and ``Δ``), current key ``t`` is
key ``mem_len + order[t]`` (k, v, dK, dV; memory keys keep their index), and the padding mask
is permuted the same way on the host (O(Tk) data). Visibility depends on the ranks only, so
in sorted order current key ``t`` is visible to row ``i`` iff ``rank_sorted[t] <= rank_sorted[i]``
(``<``): for a true permutation exactly causal (``t <= i``, ``t < i``), with ties and gaps a
staircase that is still non-decreasing. The loops stop at that diagonal (``SPAN``, from the
sorted ranks on the host: per row the number of current keys it sees, a prefix; per key
the first row that sees it) and the tile bounds above leave the element mask to the tiles
on it. Softmax does not depend on the
order of the keys and the rows are independent: the results are the unsorted ones up to the
order of summation. Dropout draws with the original indices (the mask does not move).
With causal the diagonal lives in the original order, and permutation masks keep it.

Forward, per query row (scores in base 2, ``s_ij = q_i·k_j · scale · log2 e``), online:
  ``m_i = max_j s_ij``, ``l_i = Σ_j 2^(s_ij − m_i)``, ``o_i = Σ_j 2^(s_ij − m_i) v_j / l_i``,
  ``lse_i = m_i + log2 l_i``. A row that sees no key has ``l_i = 0``: ``o_i = 0`` and
  ``lse_i = +inf`` so that the backward's probabilities are exactly 0 there.

Backward, with ``P_ij = 2^(s_ij − lse_i)`` recomputed tile by tile:
  ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``Δ_i = Σ_d dO_id O_id (= Σ_j P_ij dP_ij)``,
  ``dS = P ∘ (dP − Δ)``, ``dQ = scale · dS K``, ``dK = scale · dSᵀ Q``.
FlashAttention-2's schedule: ``Δ`` is computed before the kernels; one kernel owns a key
block and loops over query blocks (dK, dV), working on transposed tiles (``Sᵀ = K Qᵀ``,
``dPᵀ = V dOᵀ``) so that every dot has the key block's rows as its M dimension; another owns a
query block and loops over key blocks (dQ): no atomics (by default; :data:`DQ_MODE`
"atomic" drops the dQ kernel for atomic adds from the dK/dV kernel, "bulk" for TMA bulk
reductions of whole tiles). fp16/bf16 operands go
to ``tl.dot`` as they are (``UPCAST`` only for bf16 under the interpreter, whose bf16 dot
is wrong).
"""
import functools
import os

import torch
import triton
import triton.language as tl

from ._common import (LOG2E, _auto_splits, _bwd_delta, _combine_splits, _dot, _exp2_tile,
                      _fold_scale, _has_tma, _interpreting, _keep, _keep_t, _key_range,
                      _load_rows, _mask_args, _new_output, _online_softmax_step, _precision,
                      _query_block, _seed_arg, _seq_bounds, _split_targets, _tile_rows,
                      _visible, bh_chunks, bulk_add_args, cdiv, check_deterministic,
                      check_tma_mode, descriptor_scratch, flag_setting, int32_addressable,
                      next_pow2, tma_addressable, tma_args)
from . import _tune
from ._launch import fast


# --------------------------------------------------------------------------- tile-level pieces
#
# Every key loop is split in two: interior tiles, which the causal diagonal, the sequence
# ends (Tq, Tk) and the last unpadded key (KV_END) cannot cut, are loaded without masks and
# scored without an element mask; boundary tiles (the few on the diagonal or at an end) take
# the full `_visible` test. With a padding or permutation mask an interior tile is classed
# from its block bounds first (`_interior_keys`): all visible -> no element mask, else the
# element mask of that kind only. No branch around a tile's loads (Triton pipelines only
# loops without one: the module docstring).


@triton.jit
def _query_rows(offs_m, b, Tq, ORDER, SORTED: tl.constexpr):
    """Row of q, out, lse, dO, dQ and delta that holds row offs_m of the problem:
    ``order[b, offs_m]`` when SORTED (rank order), else offs_m. Rows past Tq give 0 (their
    loads and stores are masked on offs_m)."""
    rows = offs_m
    if SORTED:
        rows = tl.load(ORDER + b * Tq + offs_m, mask=offs_m < Tq, other=0)
    return rows


@triton.jit
def _key_rows(offs_n, b, Tq, Tk, mem_len, ORDER, SORTED: tl.constexpr):
    """Row of k, v, dK and dV that holds key offs_n of the problem: memory keys keep their
    index, current key t = offs_n - mem_len is ``mem_len + order[b, t]`` when SORTED. Keys
    past Tk give mem_len (their loads and stores are masked on offs_n)."""
    rows = offs_n
    if SORTED:
        t = offs_n - mem_len
        cur = tl.load(ORDER + b * Tq + t, mask=(t >= 0) & (offs_n < Tk), other=0)
        rows = tl.where(t >= 0, mem_len + cur, offs_n)
    return rows


@triton.jit
def _sorted_key_end(b, m0, Tq, hi, mem_len, SPAN, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """hi cut, in rank order, at the end of the key tile holding the last current key that
    the query block starting at row m0 sees: its last row has the largest rank, and
    ``SPAN[b, 0, i]`` counts the current keys row i sees (a prefix of the sorted keys).
    Whole tiles, so that the diagonal tile stays interior (classed from its bounds)."""
    last = tl.minimum(m0 + BLOCK_M, Tq) - 1
    end = mem_len + tl.load(SPAN + b * 2 * Tq + last)
    return tl.minimum(hi, tl.cdiv(end, BLOCK_N) * BLOCK_N)


@triton.jit
def _rank_bounds(rank_q, offs_m, Tq):
    """(min, max) permutation rank of a query block's valid rows."""
    qmin = tl.min(tl.where(offs_m < Tq, rank_q, 2147483647), 0)
    qmax = tl.max(tl.where(offs_m < Tq, rank_q, -2147483648), 0)
    return qmin, qmax


@triton.jit
def _key_ranks(offs_n, b, mem_len, RANK, stride_rank_b, stride_rank_t):
    """[BLOCK_N] rank of each key (interior tile: offs_n < Tk); memory keys, which every
    query sees, get the smallest int32 (their visibility is also tested apart)."""
    t = offs_n - mem_len
    return tl.load(RANK + b * stride_rank_b + t * stride_rank_t, mask=t >= 0,
                   other=-2147483648)


@triton.jit
def _interior_keys(offs_n, b, mem_len, qmin,
                   KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t,
                   HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr, PERM_STRICT: tl.constexpr):
    """An interior key tile's masks for a query block whose smallest rank is qmin: (key_ok
    [BLOCK_N] (unpadded), rank_k [BLOCK_N], all_visible), all_visible from block bounds (no
    padded key; permutation: max rank_k < qmin, <= without PERM_STRICT). Called only with a
    padding or permutation mask."""
    key_ok = offs_n >= 0
    rank_k = offs_n
    if HAS_KPM:
        pad = tl.load(KPM + b * stride_kpm_b + offs_n * stride_kpm_n)
        key_ok = pad == 0
        all_vis = tl.sum(key_ok.to(tl.int32), 0) == offs_n.shape[0]
    if HAS_PERM:
        rank_k = _key_ranks(offs_n, b, mem_len, RANK, stride_rank_b, stride_rank_t)
        if PERM_STRICT:
            below = tl.max(rank_k, 0) < qmin
        else:
            below = tl.max(rank_k, 0) <= qmin
        if HAS_KPM:
            all_vis = all_vis & below
        else:
            all_vis = below
    return key_ok, rank_k, all_vis


@triton.jit
def _interior_mask(key_ok, rank_k, rank_q, offs_n, mem_len, HAS_KPM: tl.constexpr,
                   HAS_PERM: tl.constexpr, PERM_STRICT: tl.constexpr):
    """[BLOCK_M, BLOCK_N] element visibility of an interior tile (padding / permutation only:
    the tile is inside the causal diagonal and the sequence ends)."""
    vis = key_ok[None, :] & (rank_q[:, None] == rank_q[:, None])
    if HAS_PERM:
        if PERM_STRICT:
            sees = rank_k[None, :] < rank_q[:, None]
        else:
            sees = rank_k[None, :] <= rank_q[:, None]
        vis = vis & (sees | (offs_n < mem_len)[None, :])
    return vis


@triton.jit
def _scores(q, k, qk_scale, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """[BLOCK_M, BLOCK_N] base-2 scores q kᵀ · scale · log2 e of a tile."""
    return _dot(q, tl.trans(k), UPCAST, PRECISION) * qk_scale


@triton.jit
def _fwd_scores(q, k, qk_scale, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                FOLD: tl.constexpr):
    """The forward's scores of a tile: q kᵀ, scaled by the softmax step where FOLD, else
    in base 2 (:func:`_scores`)."""
    if FOLD:
        return _dot(q, tl.trans(k), UPCAST, PRECISION)
    else:
        return _scores(q, k, qk_scale, UPCAST, PRECISION)


@triton.jit
def _interior_end(lo, hi, full_end, BLOCK: tl.constexpr):
    """End of the interior tiles [lo, mid) of a loop over [lo, hi): whole tiles below
    full_end (the first position a tile may not pass without a mask)."""
    return lo + tl.maximum(tl.minimum(hi, full_end) - lo, 0) // BLOCK * BLOCK


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, rank_q, qmin, qmax, offs_m, rows_m, offs_d, d_ok,
               k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               lo, hi, b, bh, Tq, Tk, mem_len, max_q, max_k, qk_scale, seed, p_drop,
               KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, ORDER,
               KD, VD, h,
               BOUNDARY: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
               HAS_PERM: tl.constexpr, PERM_STRICT: tl.constexpr, SORTED: tl.constexpr,
               DROPOUT: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
               TMA: tl.constexpr, EXP_EMU: tl.constexpr, FOLD: tl.constexpr):
    """Fold the key tiles [lo, hi) into (acc, l_i, m_i): boundary tiles with the full
    visibility test, interior ones classed from block bounds. offs_m / offs_n index the
    problem (masks), rows_m / rows_n the tensors (loads, dropout counters). TMA: k and v
    tiles through the descriptors KD, VD (never with SORTED: their rows are gathered).
    FOLD: qk_scale (> 0) applied in the softmax step, not to the tile (_online_softmax_step)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        rows_n = _key_rows(offs_n, b, Tq, Tk, mem_len, ORDER, SORTED)
        k_ptrs = k_base + rows_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + rows_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if BOUNDARY:
            k = _tile_rows(KD, k_ptrs, b, h, start_n, offs_n, Tk, d_ok, True, EVEN_D,
                           BLOCK_N, BLOCK_D, TMA)
            v = _tile_rows(VD, v_ptrs, b, h, start_n, offs_n, Tk, d_ok, True, EVEN_D,
                           BLOCK_N, BLOCK_D, TMA)
            s = _fwd_scores(q, k, qk_scale, UPCAST, PRECISION, FOLD)
            vis = _visible(offs_m, offs_n, b, Tq, Tk, mem_len, KPM, stride_kpm_b, stride_kpm_n,
                           RANK, stride_rank_b, stride_rank_t, rank_q,
                           CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT)
            s = tl.where(vis, s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, seed, bh, rows_m, rows_n,
                                                 max_q, max_k, p_drop, qk_scale, DROPOUT,
                                                 UPCAST, PRECISION, EXP_EMU, FOLD)
        else:               # interior: no row mask; an element mask only where a mask kind needs it
            k = _tile_rows(KD, k_ptrs, b, h, start_n, offs_n, Tk, d_ok, False, EVEN_D,
                           BLOCK_N, BLOCK_D, TMA)
            v = _tile_rows(VD, v_ptrs, b, h, start_n, offs_n, Tk, d_ok, False, EVEN_D,
                           BLOCK_N, BLOCK_D, TMA)
            s = _fwd_scores(q, k, qk_scale, UPCAST, PRECISION, FOLD)
            if HAS_KPM or HAS_PERM:
                key_ok, rank_k, all_vis = _interior_keys(
                    offs_n, b, mem_len, qmin, KPM, stride_kpm_b, stride_kpm_n,
                    RANK, stride_rank_b, stride_rank_t, HAS_KPM, HAS_PERM, PERM_STRICT)
                if all_vis == 0:
                    vis = _interior_mask(key_ok, rank_k, rank_q, offs_n, mem_len, HAS_KPM,
                                         HAS_PERM, PERM_STRICT)
                    s = tl.where(vis, s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, seed, bh, rows_m, rows_n,
                                                 max_q, max_k, p_drop, qk_scale, DROPOUT,
                                                 UPCAST, PRECISION, EXP_EMU, FOLD)
    return acc, l_i, m_i


@triton.jit
def _fwd_epilogue(acc, l_i, m_i, o_ptrs, lse_ptrs, offs_m, Tq, d_ok, SPLIT_K: tl.constexpr):
    """out = acc / l and lse = m + log2 l of a query block. Empty row: out 0 and lse +inf
    (the backward's probabilities are 0), or -inf for a split's partial (weight 0 in the
    combine)."""
    has_key = l_i != 0      # 0: no key seen; NaN (from the inputs) goes on into out and lse
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    empty_lse = float("-inf") if SPLIT_K else float("inf")
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), empty_lse)
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=(offs_m[:, None] < Tq) & d_ok)
    tl.store(lse_ptrs, lse, mask=offs_m < Tq)


@triton.jit
def _attn_fwd_kernel(
    Q, K, V,        # q [B, H, Tq, D], k, v [B, H, Tk, D]; any strides
    O,              # out [B, H, Tq, D], written
    LSE,            # lse [B, H, Tq] fp32 contiguous, written (base 2; +inf for empty rows)
    KPM,            # key padding [B, Tk] uint8 (1 = padding); unused unless HAS_KPM
    RANK,           # permutation ranks [B, Tq] int32 (SORTED: sorted); unused unless HAS_PERM
    ORDER,          # [B, Tq] int32 contiguous: row i of the sorted problem is query order[i],
                    # current key t is key mem_len + order[t]; unused unless SORTED
    SPAN,           # [B, 2, Tq] int32 contiguous, rank order: [b, 0, i] current keys row i
                    # sees (a prefix), [b, 1, t] first row that sees current key t; unused
                    # unless SORTED
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
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr,
    SORTED: tl.constexpr,   # permutation mask in rank order (ORDER); KPM and RANK are permuted
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    SPLIT_K: tl.constexpr,  # flash-decoding: program_id(2) owns one range of keys; partial out
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,   # BLOCK_D == D: no column masks
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    KD=None, VD=None,       # TMA: RowTiles of k, v ([1, 1, BLOCK_N, BLOCK_D] tiles)
    TMA: tl.constexpr = False,  # key tiles through KD, VD (not with SORTED or VARLEN)
    EXP_EMU: tl.constexpr = False,  # half of each tile's exponentials on the FMA pipe (16-bit)
    FOLD: tl.constexpr = False,     # qk_scale > 0, applied in the softmax step's FMA
):
    pid_m = _query_block(tl.program_id(0), CAUSAL)
    bh = tl.program_id(1) + BH0
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
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D

    rows_m = _query_rows(offs_m, b, Tq, ORDER, SORTED)
    q = _load_rows(Q + b * stride_qb + h * stride_qh + rows_m[:, None] * stride_qm
                   + offs_d[None, :] * stride_qd, offs_m, Tq, d_ok, True, EVEN_D)
    rank_q = offs_m
    qmin = 0
    qmax = 0
    if HAS_PERM:
        rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t, mask=offs_m < Tq, other=0)
        qmin, qmax = _rank_bounds(rank_q, offs_m, Tq)

    lo, hi = _key_range(b, m0, Tk, mem_len, KV_END, keys_per_split,
                        CAUSAL, HAS_KPM, SPLIT_K, BLOCK_M)
    if SORTED:
        hi = _sorted_key_end(b, m0, Tq, hi, mem_len, SPAN, BLOCK_M, BLOCK_N)
    full_end = Tk                   # interior keys: before the diagonal of the block's first row
    if CAUSAL:
        full_end = m0 + mem_len + 1
    mid = _interior_end(lo, hi, full_end, BLOCK_N)
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
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, rank_q, qmin, qmax, offs_m, rows_m, offs_d,
                               d_ok, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               lo, mid, b, bh, Tq, Tk, mem_len, max_q, max_k, qk_scale, seed,
                               p_drop, KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b,
                               stride_rank_t, ORDER, KD, VD, h, False, CAUSAL, HAS_KPM, HAS_PERM,
                               PERM_STRICT, SORTED, DROPOUT, EVEN_D, BLOCK_N, BLOCK_D, UPCAST,
                               PRECISION, TMA, EXP_EMU, FOLD)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, rank_q, qmin, qmax, offs_m, rows_m, offs_d,
                               d_ok, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               mid, hi, b, bh, Tq, Tk, mem_len, max_q, max_k, qk_scale, seed,
                               p_drop, KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b,
                               stride_rank_t, ORDER, KD, VD, h, True, CAUSAL, HAS_KPM, HAS_PERM,
                               PERM_STRICT, SORTED, DROPOUT, EVEN_D, BLOCK_N, BLOCK_D, UPCAST,
                               PRECISION, TMA, EXP_EMU, FOLD)
    _fwd_epilogue(acc, l_i, m_i, O + b * stride_ob + h * stride_oh + rows_m[:, None] * stride_om
                  + offs_d[None, :] * stride_od, LSE + rows_m, offs_m, Tq, d_ok, SPLIT_K)


@triton.jit
def _rows_desc(X, b, h, stride_b, stride_h, stride_r, T, D, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """A descriptor built on the device for sequence (b, h) of X ``[B, H, T, D]`` (last dim
    contiguous, 16-byte rows) in ``[BLOCK_R, BLOCK_D]`` tiles: rows past T and columns
    past D read as 0 (the warp-specialised kernels)."""
    return tl.make_tensor_descriptor(X + b * stride_b + h * stride_h, shape=[T, D],
                                     strides=[stride_r, 1], block_shape=[BLOCK_R, BLOCK_D])


@triton.jit
def _attn_fwd_ws_kernel(
    Q, K, V,        # q [B, H, Tq, D], k, v [B, H, Tk, D]; 16-bit, TMA-addressable
                    # (_common.tma_addressable): last dim contiguous, 16-byte rows and bases
    O,              # out [B, H, Tq, D], written
    LSE,            # lse [B, H, Tq] fp32, written (base 2)
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh,   # of lse: element (b, h, i) at b*stride_lb + h*stride_lh + i
    H, Tq, Tk, mem_len, D,
    qk_scale,       # scale * log2(e)
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr,
    MASK_KEYS: tl.constexpr,    # not CAUSAL, Tk not a multiple of BLOCK_N: keys past Tk masked
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    FOLD: tl.constexpr,         # qk_scale > 0, applied in the softmax step's FMA
):
    """The forward of a dense call without padding, permutation mask or dropout (causal or
    not, with memory keys), warp-specialised: one loop over the key tiles, marked
    ``warp_specialize``, that Triton's sm_90 pipeline splits into a producer warp issuing
    the TMA loads of k and v and two consumer warpgroups, each with half of the query block,
    doing the products and the softmax (FlashAttention-3's schedule), with registers moved
    from the producer to the consumers (``setmaxnreg``). Launched with 4 warps; the split
    runs 12. What the split needs, found by compiling for sm_90 (Triton 3.6 and 3.9): the
    descriptors built on the device (``tl.make_tensor_descriptor``; with the launcher's
    host descriptors or a pointer load of q the pass fails), one loop (the interior /
    boundary pair of :func:`_fwd_tiles` fails the pass; a branch around the mask inside the
    loop turns the split off), so the causal diagonal and the key end are an element
    mask on every tile of a causal call. Per (b, h) descriptors: rows past Tq and Tk read
    as 0 (no row masks). Elsewhere (the interpreter, other GPUs) the same loop runs as an
    ordinary one."""
    pid_m = _query_block(tl.program_id(0), CAUSAL)
    bh = tl.program_id(1) + BH0
    b = bh // H
    h = bh % H
    m0 = pid_m * BLOCK_M
    qd = _rows_desc(Q, b, h, stride_qb, stride_qh, stride_qm, Tq, D, BLOCK_M, BLOCK_D)
    kd = _rows_desc(K, b, h, stride_kb, stride_kh, stride_kn, Tk, D, BLOCK_N, BLOCK_D)
    vd = _rows_desc(V, b, h, stride_vb, stride_vh, stride_vn, Tk, D, BLOCK_N, BLOCK_D)
    q = qd.load([m0, 0])
    offs_m = m0 + tl.arange(0, BLOCK_M)
    hi = Tk
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M + mem_len)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
        k = kd.load([start_n, 0])
        v = vd.load([start_n, 0])
        s = _fwd_scores(q, k, qk_scale, UPCAST, PRECISION, FOLD)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if CAUSAL:      # keys past Tk are past every stored row's diagonal too
            s = tl.where(offs_n[None, :] <= offs_m[:, None] + mem_len, s, float("-inf"))
        elif MASK_KEYS:
            s = tl.where(offs_n[None, :] < Tk, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, 0, bh, offs_m, offs_n, Tq, Tk,
                                             0.0, qk_scale, False, UPCAST, PRECISION, False,
                                             FOLD)
    offs_d = tl.arange(0, BLOCK_D)
    _fwd_epilogue(acc, l_i, m_i, O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om
                  + offs_d[None, :] * stride_od, LSE + b * stride_lb + h * stride_lh + offs_m,
                  offs_m, Tq, offs_d[None, :] < D, False)


@triton.jit
def _bwd_descs(Q, K, V, DO, b, h, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
               stride_kn, stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
               Tq, Tk, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """(q, dO in [BLOCK_M, BLOCK_D] tiles, k, v in [BLOCK_N, BLOCK_D]): the descriptors of
    sequence (b, h) that the warp-specialised backward kernels read (:func:`_rows_desc`)."""
    return (_rows_desc(Q, b, h, stride_qb, stride_qh, stride_qm, Tq, D, BLOCK_M, BLOCK_D),
            _rows_desc(DO, b, h, stride_dob, stride_doh, stride_dom, Tq, D, BLOCK_M, BLOCK_D),
            _rows_desc(K, b, h, stride_kb, stride_kh, stride_kn, Tk, D, BLOCK_N, BLOCK_D),
            _rows_desc(V, b, h, stride_vb, stride_vh, stride_vn, Tk, D, BLOCK_N, BLOCK_D))


@triton.jit
def _attn_bwd_dkdv_ws_kernel(
    Q, K, V, DO,    # q, do [B, H, Tq, D], k, v [B, H, Tk, D]; 16-bit, TMA-addressable
    LSE, DELTA,     # [B, H, Tq] fp32: forward's lse (base 2), rowsum(dO * O)
    DK, DV,         # dk, dv [B, H, Tk, D], written (same layout)
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_lb, stride_lh,   # of lse and delta
    H, Tq, Tk, mem_len, D,
    qk_scale, sm_scale,     # scale * log2(e), scale
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """:func:`_attn_bwd_dkdv_kernel` for the calls :func:`_attn_fwd_ws_kernel` serves,
    warp-specialised the same way (4 warps launched, 12 run: a producer warp loading the q
    and dO tiles by TMA, two consumer warpgroups with half of the key block each; BLOCK_N
    128). One loop over the query tiles; a causal call masks every tile. Rows past Tq read
    as 0 and their lse as +inf (probability 0): no other mask."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1) + BH0
    b = bh // H
    h = bh % H
    n0 = pid_n * BLOCK_N
    qd, dod, kd, vd = _bwd_descs(Q, K, V, DO, b, h, stride_qb, stride_qh, stride_qm,
                                 stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                                 stride_vn, stride_dob, stride_doh, stride_dom, Tq, Tk, D,
                                 BLOCK_M, BLOCK_N, BLOCK_D)
    k = kd.load([n0, 0])
    v = vd.load([n0, 0])
    LSE += b * stride_lb + h * stride_lh
    DELTA += b * stride_lb + h * stride_lh
    offs_n = n0 + tl.arange(0, BLOCK_N)
    lo = 0
    if CAUSAL:      # queries i >= j - mem_len see key j: start at the block of the first one
        lo = tl.maximum(n0 - mem_len, 0) // BLOCK_M * BLOCK_M
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for start_m in tl.range(lo, Tq, BLOCK_M, warp_specialize=True):
        q = qd.load([start_m, 0])
        do = dod.load([start_m, 0])
        offs_m = start_m + tl.arange(0, BLOCK_M)
        lse = tl.load(LSE + offs_m, mask=offs_m < Tq, other=float("inf"))
        delta = tl.load(DELTA + offs_m, mask=offs_m < Tq, other=0.0)
        p_t = tl.exp2(_scores(k, q, qk_scale, UPCAST, PRECISION) - lse[None, :])   # [N, M]
        if CAUSAL:
            p_t = tl.where(offs_m[None, :] + mem_len >= offs_n[:, None], p_t, 0.0)
        dp_t = _dot(v, tl.trans(do), UPCAST, PRECISION)                  # (dO Vᵀ)ᵀ
        dv += _dot(p_t.to(do.dtype), do, UPCAST, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, UPCAST, PRECISION)
    offs_d = tl.arange(0, BLOCK_D)
    out_off = (b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dkn
               + offs_d[None, :] * stride_dkd)
    kv_mask = (offs_n[:, None] < Tk) & (offs_d[None, :] < D)
    tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_ws_kernel(
    Q, K, V, DO,    # as in _attn_bwd_dkdv_ws_kernel
    LSE, DELTA,     # [B, H, Tq] fp32, rows of (b, h) on 16 bytes
    DQ,             # dq [B, H, Tq, D], written
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_lb, stride_lh,   # of lse and delta
    H, Tq, Tk, mem_len, D,
    qk_scale, sm_scale,
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr,
    MASK_KEYS: tl.constexpr,    # not CAUSAL, Tk not a multiple of BLOCK_N: keys past Tk masked
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """:func:`_attn_bwd_dq_kernel` for the calls :func:`_attn_fwd_ws_kernel` serves,
    warp-specialised the same way (a producer warp loading the k and v tiles, two consumer
    warpgroups with half of the query block each). One loop over the key tiles. lse and
    delta through 1-D descriptors: their rows (b, h) must start on 16 bytes (Tq a multiple
    of 4 for the launchers' [B, H, Tq] buffers)."""
    pid_m = _query_block(tl.program_id(0), CAUSAL)
    bh = tl.program_id(1) + BH0
    b = bh // H
    h = bh % H
    m0 = pid_m * BLOCK_M
    qd, dod, kd, vd = _bwd_descs(Q, K, V, DO, b, h, stride_qb, stride_qh, stride_qm,
                                 stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                                 stride_vn, stride_dob, stride_doh, stride_dom, Tq, Tk, D,
                                 BLOCK_M, BLOCK_N, BLOCK_D)
    # lse and delta by TMA too: with pointer loads Triton's split fails ("unsupported load
    # type for producer commit"). Rows past Tq read 0 (their q and dO rows too: p = 1,
    # ds = 0, and their dq is not stored)
    ld = tl.make_tensor_descriptor(LSE + b * stride_lb + h * stride_lh, shape=[Tq],
                                   strides=[1], block_shape=[BLOCK_M])
    dd = tl.make_tensor_descriptor(DELTA + b * stride_lb + h * stride_lh, shape=[Tq],
                                   strides=[1], block_shape=[BLOCK_M])
    q = qd.load([m0, 0])
    do = dod.load([m0, 0])
    lse = ld.load([m0])
    delta = dd.load([m0])
    offs_m = m0 + tl.arange(0, BLOCK_M)
    hi = Tk
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M + mem_len)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
        k = kd.load([start_n, 0])
        v = vd.load([start_n, 0])
        offs_n = start_n + tl.arange(0, BLOCK_N)
        p = tl.exp2(_scores(q, k, qk_scale, UPCAST, PRECISION) - lse[:, None])   # [M, N]
        if CAUSAL:      # keys past Tk are past every stored row's diagonal too
            p = tl.where(offs_n[None, :] <= offs_m[:, None] + mem_len, p, 0.0)
        elif MASK_KEYS:
            p = tl.where(offs_n[None, :] < Tk, p, 0.0)
        dp = _dot(do, tl.trans(v), UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST, PRECISION)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm
             + offs_d[None, :] * stride_dqd, (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < Tq) & (offs_d[None, :] < D))


@triton.jit
def _bwd_bases(Q, K, V, DO, LSE, DELTA, b, h, q_start, k_start,
               stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
               stride_lb, stride_lh):
    """Pointers to row 0 of sequence (b, h) in q, k, v, do, lse and delta (both backward
    kernels)."""
    return (Q + b * stride_qb + h * stride_qh + q_start * stride_qm,
            K + b * stride_kb + h * stride_kh + k_start * stride_kn,
            V + b * stride_vb + h * stride_vh + k_start * stride_vn,
            DO + b * stride_dob + h * stride_doh + q_start * stride_dom,
            LSE + b * stride_lb + h * stride_lh + q_start,
            DELTA + b * stride_lb + h * stride_lh + q_start)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, offs_n, rows_n, key_ok, rank_k, kmax, n_ok, offs_d, d_ok,
                q_base, do_base, stride_qm, stride_qd, stride_dom, stride_dod, LSE, DELTA,
                lo, hi, b, bh, Tq, Tk, mem_len, max_q, max_k, qk_scale, seed, p_drop,
                KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, ORDER,
                dqa_base, dq_scale, D, QD, DOD, DQAD, h,
                BOUNDARY: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
                HAS_PERM: tl.constexpr, PERM_STRICT: tl.constexpr, SORTED: tl.constexpr,
                DROPOUT: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
                PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, TMA: tl.constexpr,
                EXP_EMU: tl.constexpr, DQ_BULK: tl.constexpr):
    """Accumulate the query tiles [lo, hi) into one key block's (dk, dv) [BLOCK_N, BLOCK_D],
    transposed (``sᵀ = k qᵀ``: every dot has the key block's BLOCK_N rows). offs index the
    problem (masks), rows the tensors (loads, dropout counters). ATOMIC_DQ: also add each
    tile's ``dq_scale · dS K`` into the fp32 accumulator rows at dqa_base (row stride D):
    element by element (relaxed reductions), or, DQ_BULK, the whole tile in one TMA bulk
    reduction through the accumulator's descriptor DQAD (dense, not SORTED).
    TMA: q and dO tiles through the descriptors QD, DOD (not with SORTED)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows_m = _query_rows(offs_m, b, Tq, ORDER, SORTED)
        q = _tile_rows(QD, q_base + rows_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                       b, h, start_m, offs_m, Tq, d_ok, BOUNDARY, EVEN_D, BLOCK_M, BLOCK_D, TMA)
        rank_q = offs_m
        if HAS_PERM:
            rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t,
                             mask=offs_m < Tq, other=0)
        all_vis = True              # constexpr unless a mask classes the tile
        if not BOUNDARY:
            if HAS_KPM or HAS_PERM:
                all_vis = _query_tile_all_visible(rank_q, offs_m, Tq, n_ok, kmax,
                                                  HAS_KPM, HAS_PERM, PERM_STRICT, BLOCK_N)
        do = _tile_rows(DOD, do_base + rows_m[:, None] * stride_dom
                        + offs_d[None, :] * stride_dod, b, h, start_m, offs_m, Tq, d_ok,
                        BOUNDARY, EVEN_D, BLOCK_M, BLOCK_D, TMA)
        if BOUNDARY:
            lse = tl.load(LSE + rows_m, mask=offs_m < Tq, other=float("inf"))
            delta = tl.load(DELTA + rows_m, mask=offs_m < Tq, other=0.0)
        else:
            lse = tl.load(LSE + rows_m)
            delta = tl.load(DELTA + rows_m)
        p_t = _exp2_tile(_scores(k, q, qk_scale, UPCAST, PRECISION) - lse[None, :],
                         EXP_EMU)                                           # [N, M]
        if BOUNDARY:
            vis = _visible(offs_m, offs_n, b, Tq, Tk, mem_len, KPM, stride_kpm_b,
                           stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q,
                           CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT)
            p_t = tl.where(tl.trans(vis), p_t, 0.0)
        elif HAS_KPM or HAS_PERM:
            if all_vis == 0:
                vis_t = _interior_mask(key_ok, rank_k, rank_q, offs_n, mem_len, HAS_KPM,
                                       HAS_PERM, PERM_STRICT)
                p_t = tl.where(tl.trans(vis_t), p_t, 0.0)
        dp_t = _dot(v, tl.trans(do), UPCAST, PRECISION)                  # (dO Vᵀ)ᵀ
        if DROPOUT:   # out used P_d = P * keep / (1 - p): dV = P_dᵀ dO, dP = dP_d * keep / (1 - p)
            keep_t = _keep_t(seed, bh, rows_m, rows_n, max_q, max_k, p_drop)
            dv += _dot(tl.where(keep_t, p_t / (1.0 - p_drop), 0.0).to(do.dtype), do,
                       UPCAST, PRECISION)
            dp_t = tl.where(keep_t, dp_t / (1.0 - p_drop), 0.0)
        else:
            dv += _dot(p_t.to(do.dtype), do, UPCAST, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, UPCAST, PRECISION)
        if ATOMIC_DQ:                                   # dQ_tile = dS K, [BLOCK_M, BLOCK_D]
            dq_part = _dot(tl.trans(ds_t).to(k.dtype), k, UPCAST, PRECISION) * dq_scale
            if DQ_BULK:     # the tile staged in shared memory, added by the TMA unit
                DQAD.atomic_add([b, h, start_m, 0], dq_part.reshape(1, 1, BLOCK_M, BLOCK_D))
            else:
                # relaxed: nothing reads dQ before the kernel ends (the default, acq_rel,
                # orders every add against the thread's other memory operations)
                tl.atomic_add(dqa_base + rows_m[:, None].to(tl.int64) * D + offs_d[None, :],
                              dq_part, mask=(offs_m[:, None] < Tq) & d_ok, sem="relaxed")
    return dk, dv


@triton.jit
def _query_tile_all_visible(rank_q, offs_m, Tq, n_ok, kmax, HAS_KPM: tl.constexpr,
                            HAS_PERM: tl.constexpr, PERM_STRICT: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """Whether an interior query tile sees all of a key block with n_ok unpadded keys
    (HAS_KPM) and largest rank kmax (HAS_PERM): dK/dV's counterpart of
    :func:`_interior_keys` (called only with a padding or permutation mask)."""
    if HAS_PERM:
        qmin, _ = _rank_bounds(rank_q, offs_m, Tq)
        if PERM_STRICT:
            all_vis = kmax < qmin
        else:
            all_vis = kmax <= qmin
        if HAS_KPM:
            all_vis = all_vis & (n_ok == BLOCK_N)
    else:
        all_vis = n_ok == BLOCK_N
    return all_vis


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO,    # q, do [B, H, Tq, D]; k, v [B, H, Tk, D]; any strides
    LSE, DELTA,     # [B, H, Tq] fp32 contiguous: forward's lse (base 2), rowsum(dO * O)
    DK, DV,         # dk, dv [B, H, Tk, D] contiguous, written
    DQ_ACC,         # ATOMIC_DQ: dq accumulator [B, H, Tq, D] fp32 contiguous, zeroed; gets dq
    KPM, RANK, ORDER, SPAN, KV_END, SEED, CU_Q, CU_K,   # as in the forward
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
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, SORTED: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr = False,
    QD=None, DOD=None,      # TMA: RowTiles of q, do ([1, 1, BLOCK_M, BLOCK_D] tiles)
    TMA: tl.constexpr = False,  # query tiles through QD, DOD (not with SORTED or VARLEN)
    EXP_EMU: tl.constexpr = False,  # half of each tile's exponentials on the FMA pipe (16-bit)
    DQAD=None,      # DQ_BULK: RowTiles of DQ_ACC ([1, 1, BLOCK_M, BLOCK_D] fp32 tiles)
    DQ_BULK: tl.constexpr = False,  # ATOMIC_DQ by TMA bulk reductions of whole tiles
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1) + BH0
    b = bh // H
    h = bh % H
    q_start, k_start, Tq, Tk, mem_len = _seq_bounds(CU_Q, CU_K, b, Tq, Tk, mem_len, VARLEN)
    if pid_n * BLOCK_N >= Tk:       # varlen: past the end of a shorter sequence
        return
    dqa_base = DQ_ACC + bh.to(tl.int64) * Tq * D     # dense only (the launcher's rule)
    q_base, k_base, v_base, do_base, LSE, DELTA = _bwd_bases(
        Q, K, V, DO, LSE, DELTA, b, h, q_start, k_start, stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom, stride_lb, stride_lh)
    DK += b * stride_dkb + h * stride_dkh + k_start * stride_dkn
    DV += b * stride_dkb + h * stride_dkh + k_start * stride_dkn
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    rows_n = _key_rows(offs_n, b, Tq, Tk, mem_len, ORDER, SORTED)
    k = _load_rows(k_base + rows_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                   offs_n, Tk, d_ok, True, EVEN_D)
    v = _load_rows(v_base + rows_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                   offs_n, Tk, d_ok, True, EVEN_D)
    # The key block's bounds for classing interior query tiles (keys past Tk: their rows of
    # dk/dv are not stored, so they count as visible).
    key_ok = offs_n >= 0
    n_ok = BLOCK_N
    if HAS_KPM:
        pad = tl.load(KPM + b * stride_kpm_b + offs_n * stride_kpm_n, mask=offs_n < Tk, other=0)
        key_ok = pad == 0
        n_ok = tl.sum(key_ok.to(tl.int32), 0)
    rank_k = offs_n
    kmax = 0
    if HAS_PERM:
        t = offs_n - mem_len
        rank_k = tl.load(RANK + b * stride_rank_b + t * stride_rank_t,
                         mask=(t >= 0) & (offs_n < Tk), other=-2147483648)
        kmax = tl.max(rank_k, 0)

    lo = 0
    q_int = 0       # first query block that the causal diagonal does not cut
    if CAUSAL:      # queries i >= j - mem_len see key j: start at the block of the first one
        lo = tl.maximum(n0 - mem_len, 0) // BLOCK_M * BLOCK_M
        q_int = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - mem_len, 0), BLOCK_M) * BLOCK_M
    hi = Tq
    if HAS_KPM:     # a key block wholly past the last unpadded key gets zero gradient
        hi = tl.where(n0 < tl.load(KV_END + b), Tq, 0)
    if SORTED:      # rank order: start at the block of the first row that sees key n0
        t0 = n0 - mem_len
        first = tl.load(SPAN + b * 2 * Tq + Tq + tl.maximum(t0, 0))
        lo = tl.where(t0 >= 0, first // BLOCK_M * BLOCK_M, 0)
    q_int = tl.minimum(tl.maximum(q_int, lo), hi)
    a_end = tl.maximum(tl.minimum(Tq // BLOCK_M * BLOCK_M, hi), q_int)

    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # diagonal tiles, interior tiles, the last partial query block
    dk, dv = _dkdv_tiles(dk, dv, k, v, offs_n, rows_n, key_ok, rank_k, kmax, n_ok,
                         offs_d, d_ok, q_base, do_base, stride_qm, stride_qd, stride_dom,
                         stride_dod, LSE, DELTA, lo, q_int, b, bh, Tq, Tk, mem_len, max_q, max_k,
                         qk_scale, seed, p_drop, KPM, stride_kpm_b, stride_kpm_n, RANK,
                         stride_rank_b, stride_rank_t, ORDER, dqa_base, sm_scale, D, QD, DOD,
                         DQAD, h, True,
                         CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, SORTED, DROPOUT, EVEN_D,
                         BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, PRECISION, ATOMIC_DQ, TMA,
                         EXP_EMU, DQ_BULK)
    dk, dv = _dkdv_tiles(dk, dv, k, v, offs_n, rows_n, key_ok, rank_k, kmax, n_ok,
                         offs_d, d_ok, q_base, do_base, stride_qm, stride_qd, stride_dom,
                         stride_dod, LSE, DELTA, q_int, a_end, b, bh, Tq, Tk, mem_len, max_q, max_k,
                         qk_scale, seed, p_drop, KPM, stride_kpm_b, stride_kpm_n, RANK,
                         stride_rank_b, stride_rank_t, ORDER, dqa_base, sm_scale, D, QD, DOD,
                         DQAD, h, False,
                         CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, SORTED, DROPOUT, EVEN_D,
                         BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, PRECISION, ATOMIC_DQ, TMA,
                         EXP_EMU, DQ_BULK)
    dk, dv = _dkdv_tiles(dk, dv, k, v, offs_n, rows_n, key_ok, rank_k, kmax, n_ok,
                         offs_d, d_ok, q_base, do_base, stride_qm, stride_qd, stride_dom,
                         stride_dod, LSE, DELTA, a_end, hi, b, bh, Tq, Tk, mem_len, max_q, max_k,
                         qk_scale, seed, p_drop, KPM, stride_kpm_b, stride_kpm_n, RANK,
                         stride_rank_b, stride_rank_t, ORDER, dqa_base, sm_scale, D, QD, DOD,
                         DQAD, h, True,
                         CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, SORTED, DROPOUT, EVEN_D,
                         BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, PRECISION, ATOMIC_DQ, TMA,
                         EXP_EMU, DQ_BULK)

    out_off = rows_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    kv_mask = (offs_n[:, None] < Tk) & d_ok
    tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, rank_q, qmin, qmax, offs_m, rows_m, offs_d, d_ok,
              k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
              lo, hi, b, bh, Tq, Tk, mem_len, max_q, max_k, qk_scale, seed, p_drop,
              KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, ORDER,
              KD, VD, h,
              BOUNDARY: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
              HAS_PERM: tl.constexpr, PERM_STRICT: tl.constexpr, SORTED: tl.constexpr,
              DROPOUT: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              TMA: tl.constexpr, EXP_EMU: tl.constexpr):
    """Accumulate the key tiles [lo, hi) into a query block's dq [BLOCK_M, BLOCK_D]. offs
    index the problem (masks), rows the tensors (loads, dropout counters). TMA: k and v
    tiles through the descriptors KD, VD (not with SORTED)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        all_vis = True              # constexpr unless a mask classes the tile
        key_ok = offs_n >= 0
        rank_k = offs_n
        if not BOUNDARY:
            if HAS_KPM or HAS_PERM:
                key_ok, rank_k, all_vis = _interior_keys(
                    offs_n, b, mem_len, qmin, KPM, stride_kpm_b, stride_kpm_n,
                    RANK, stride_rank_b, stride_rank_t, HAS_KPM, HAS_PERM, PERM_STRICT)
        rows_n = _key_rows(offs_n, b, Tq, Tk, mem_len, ORDER, SORTED)
        k = _tile_rows(KD, k_base + rows_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                       b, h, start_n, offs_n, Tk, d_ok, BOUNDARY, EVEN_D, BLOCK_N, BLOCK_D,
                       TMA)
        v = _tile_rows(VD, v_base + rows_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                       b, h, start_n, offs_n, Tk, d_ok, BOUNDARY, EVEN_D, BLOCK_N, BLOCK_D,
                       TMA)
        p = _exp2_tile(_scores(q, k, qk_scale, UPCAST, PRECISION) - lse[:, None], EXP_EMU)
        if BOUNDARY:
            vis = _visible(offs_m, offs_n, b, Tq, Tk, mem_len, KPM, stride_kpm_b,
                           stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q,
                           CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT)
            p = tl.where(vis, p, 0.0)
        elif HAS_KPM or HAS_PERM:
            if all_vis == 0:
                vis = _interior_mask(key_ok, rank_k, rank_q, offs_n, mem_len, HAS_KPM, HAS_PERM,
                                     PERM_STRICT)
                p = tl.where(vis, p, 0.0)
        dp = _dot(do, tl.trans(v), UPCAST, PRECISION)
        if DROPOUT:
            keep = _keep(seed, bh, rows_m, rows_n, max_q, max_k, p_drop)
            dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST, PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO,    # as in _attn_bwd_dkdv_kernel
    LSE, DELTA,
    DQ,             # dq [B, H, Tq, D] contiguous, written
    KPM, RANK, ORDER, SPAN, KV_END, SEED, CU_Q, CU_K,   # as in the forward
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
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, SORTED: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    KD=None, VD=None,       # TMA: RowTiles of k, v ([1, 1, BLOCK_N, BLOCK_D] tiles)
    TMA: tl.constexpr = False,  # key tiles through KD, VD (not with SORTED or VARLEN)
    EXP_EMU: tl.constexpr = False,  # half of each tile's exponentials on the FMA pipe (16-bit)
):
    pid_m = _query_block(tl.program_id(0), CAUSAL)
    bh = tl.program_id(1) + BH0
    b = bh // H
    h = bh % H
    q_start, k_start, Tq, Tk, mem_len = _seq_bounds(CU_Q, CU_K, b, Tq, Tk, mem_len, VARLEN)
    if pid_m * BLOCK_M >= Tq:       # varlen: past the end of a shorter sequence
        return
    q_base, k_base, v_base, do_base, LSE, DELTA = _bwd_bases(
        Q, K, V, DO, LSE, DELTA, b, h, q_start, k_start, stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom, stride_lb, stride_lh)
    DQ += b * stride_dqb + h * stride_dqh + q_start * stride_dqm
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    rows_m = _query_rows(offs_m, b, Tq, ORDER, SORTED)
    q = _load_rows(q_base + rows_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, Tq, d_ok, True, EVEN_D)
    do = _load_rows(do_base + rows_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                    offs_m, Tq, d_ok, True, EVEN_D)
    lse = tl.load(LSE + rows_m, mask=offs_m < Tq, other=float("inf"))
    delta = tl.load(DELTA + rows_m, mask=offs_m < Tq, other=0.0)
    rank_q = offs_m
    qmin = 0
    qmax = 0
    if HAS_PERM:
        rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t, mask=offs_m < Tq, other=0)
        qmin, qmax = _rank_bounds(rank_q, offs_m, Tq)

    _, hi = _key_range(b, m0, Tk, mem_len, KV_END, 0, CAUSAL, HAS_KPM, False, BLOCK_M)
    if SORTED:
        hi = _sorted_key_end(b, m0, Tq, hi, mem_len, SPAN, BLOCK_M, BLOCK_N)
    full_end = Tk
    if CAUSAL:
        full_end = m0 + mem_len + 1
    mid = _interior_end(0, hi, full_end, BLOCK_N)

    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_tiles(dq, q, do, lse, delta, rank_q, qmin, qmax, offs_m, rows_m, offs_d, d_ok,
                   k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, 0, mid,
                   b, bh, Tq, Tk, mem_len, max_q, max_k, qk_scale, seed, p_drop,
                   KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, ORDER,
                   KD, VD, h, False, CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, SORTED, DROPOUT,
                   EVEN_D, BLOCK_N, BLOCK_D, UPCAST, PRECISION, TMA, EXP_EMU)
    dq = _dq_tiles(dq, q, do, lse, delta, rank_q, qmin, qmax, offs_m, rows_m, offs_d, d_ok,
                   k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, mid, hi,
                   b, bh, Tq, Tk, mem_len, max_q, max_k, qk_scale, seed, p_drop,
                   KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, ORDER,
                   KD, VD, h, True, CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, SORTED, DROPOUT,
                   EVEN_D, BLOCK_N, BLOCK_D, UPCAST, PRECISION, TMA, EXP_EMU)
    tl.store(DQ + rows_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < Tq) & d_ok)


# --------------------------------------------------------------------------- launchers

#: (kernel, head-dim bucket, 16-bit?) -> (BLOCK_M, BLOCK_N, num_warps, num_stages) on sm_90.
#: "fwd" D 128 16-bit is the best of the H100 sweep of the previous forward
#: (gpu-runs/2026-11-22-h100/attention_config_sweep.txt: 418 TFLOP/s, causal T 8k). 16-bit
#: D 64 "fwd" and "dkdv" and D 128 "dq" are the tuner's choices on the H200 (bf16 causal,
#: benchmarks/results/nvidia-h200/2026-11-27-round4: fwd 64 x 64 x 4 x 3 92 us against the
#: previous 128 x 64 x 8 x 3's 102 at GPT-2 size, 682 against 713 at T 4096; dK/dV
#: 64 x 64 x 4 x 3 faster in all three cases, 1.11-1.13x the backward; dQ D 128 3 stages
#: 2012 against 2227 us; dK/dV D 128 32 x 128 x 8 x 3, round 5: 1919 against the two-stage
#: row's 2013 us, T 4096). The other 16-bit backward rows follow the FA2 schedule (dK/dV: the
#: key block is the MMA's 128 rows; dQ: the query block is). Every 16-bit dot is a wgmma and
#: nothing spills (tests/test_triton_compile.py, benchmarks/NOTES.md). fp32 (tf32) rows are
#: sized to fit in registers without spills. Every loop of a row with 2+ stages is
#: software-pipelined (tests/test_triton_compile.py). Loads are pointer tiles unless
#: :data:`TMA_MODE` (its default "auto": :data:`_TMA_ROWS`) or the tuner asks for descriptors.
_CONFIGS = {
    ("fwd", 64, True): (64, 64, 4, 3), ("fwd", 128, True): (64, 64, 4, 3),
    ("fwd", 256, True): (64, 32, 8, 2),
    ("fwd", 64, False): (64, 64, 4, 2), ("fwd", 128, False): (32, 32, 4, 2),
    ("fwd", 256, False): (32, 32, 8, 2),
    ("dkdv", 64, True): (64, 64, 4, 3), ("dkdv", 128, True): (32, 128, 8, 3),
    ("dkdv", 256, True): (32, 64, 8, 2),
    ("dkdv", 64, False): (32, 64, 4, 2), ("dkdv", 128, False): (16, 64, 8, 2),
    ("dkdv", 256, False): (16, 32, 8, 2),
    ("dq", 64, True): (128, 64, 8, 3), ("dq", 128, True): (128, 64, 8, 3),
    ("dq", 256, True): (64, 32, 8, 2),
    ("dq", 64, False): (64, 32, 4, 2), ("dq", 128, False): (64, 32, 4, 2),
    ("dq", 256, False): (32, 16, 8, 2),
}

#: dK/dV rows when the kernel also adds dS K into dQ (``DQ_MODE == "atomic"``): its dQ
#: product needs BLOCK_M >= 64 to be a wgmma, and a [BLOCK_M, BLOCK_D] fp32 partial more in
#: registers. Chosen by sm_90 compiles (benchmarks/NOTES.md), timed only with the adds as
#: acq_rel atomics (2.1-2.2x slower than the dQ kernel; relaxed reductions since, untimed).
#: 16-bit D 128's 64 x 64 x 8 x 2 spilled ~330 B per thread then, none since (Triton 3.9,
#: 255 registers); with dropout the 32-row rows stay (no spill; dQ's product on mma.sync).
_CONFIGS.update({
    ("dkdv_atomic", 64, True): (64, 128, 8, 3), ("dkdv_atomic", 128, True): (64, 64, 8, 2),
    ("dkdv_atomic", 256, True): (64, 32, 8, 2),
    ("dkdv_atomic", 64, False): (32, 64, 4, 2), ("dkdv_atomic", 128, False): (16, 64, 8, 2),
    ("dkdv_atomic", 256, False): (16, 32, 8, 2),
})

#: Rows replacing :data:`_CONFIGS`' with dropout: the in-kernel Philox draw needs registers
#: (with the rows above the dropout variants spilled).
_DROPOUT_CONFIGS = {
    ("fwd", 128, True): (64, 32, 4, 3), ("dq", 128, True): (64, 32, 4, 2),
    ("dkdv", 128, True): (16, 128, 8, 2), ("dkdv", 128, False): (16, 32, 4, 2),
    ("dkdv", 64, True): (32, 128, 8, 2),
    ("dkdv_atomic", 64, True): (32, 128, 8, 2), ("dkdv_atomic", 128, True): (16, 128, 8, 2),
    ("dkdv_atomic", 128, False): (16, 32, 4, 2),
    # fp32 (tf32) dQ at D 128 with every mask: 64 x 32 spilled 48 B per thread once
    # pipelined (8 B at one stage); 64 x 16 (2 stages, wgmma) none
    ("dq", 128, False): (64, 16, 4, 2),
}


#: Rows replacing :data:`_CONFIGS`' with a key padding mask (no dropout, no permutation), timed
#: on the H200 (bf16 BERT-base B32 H12 T512 D64, round 4): there the forward's 128-row query
#: block stays faster (109 us against 64 x 64's 122) and dQ's 64 x 64 x 4 x 2 is (264 against
#: the 128-row block's 328).
_KPM_CONFIGS = {("fwd", 64, True): (128, 64, 8, 3), ("dq", 64, True): (64, 64, 4, 2)}


#: Rows replacing :data:`_CONFIGS`' for a permutation mask without dropout: dK/dV unpipelined
#: (one stage). Pipelined (the loop's q and dO loads multi-buffered, as every other row is
#: since the loops lost their branch on tiles no mask classes) the rank tiles beside them
#: spilled on sm_90: 16-bit D 64 kpm+perm_strict 12 B per thread (2 stages: 76 B), D 128
#: perm 44 B; at one stage 0 (the loop as it ran before, when none was pipelined).
_PERM_CONFIGS = {
    ("dkdv", 64, True): (64, 128, 8, 1), ("dkdv", 128, True): (32, 128, 8, 1),
}

#: Rows replacing :data:`_DROPOUT_CONFIGS`' for a permutation mask with causal (the
#: original order: a rank tile per query and key block beside the padding and the Philox
#: draw): at 128 x 64 the 16-bit D 64 forward spilled 40 B per thread on sm_90 and dQ 8 B
#: (tests/test_triton_compile.py's "causal+kpm+perm+dropout" case); 128 x 32 spills none.
_PERM_CAUSAL_DROPOUT_CONFIGS = {
    ("fwd", 64, True): (128, 32, 8, 3), ("dq", 64, True): (128, 32, 8, 3),
}


def _config(kernel: str, D: int, dtype: torch.dtype, causal: bool = False, mask: str = "none",
            dropout: bool = False):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) of kernel "fwd", "dkdv" or "dq".

    Keyed on head dim and dtype from :data:`_CONFIGS`; ``causal`` and ``mask`` (the mask
    kind: "none", "kpm", "perm") are part of the key: a padding mask takes the rows the H200
    timed for it (:data:`_KPM_CONFIGS`), a permutation mask its spill-free ones
    (:data:`_PERM_CONFIGS`), and dropout with a permutation mask and causal its own
    (:data:`_PERM_CAUSAL_DROPOUT_CONFIGS`, for spills). A table
    rather than ``triton.autotune``: one compile per kernel on a first call, and the
    launchers stay plain ``kernel[grid]`` calls (the compile test records them). Cached
    (a dict lookup a call: the launchers ask up to four times per op call).
    The rows tuned for the call in progress (``kernels._tune``, ``CTXFAST_AUTOTUNE=on``),
    then :data:`LAUNCH_OVERRIDE` (benchmarks/config_sweep.py), replace a kernel's row."""
    row = _override(kernel)
    if row is not None:
        bm, bn, warps, stages = row
        return bm, bn, max(16, next_pow2(D)), warps, stages
    return _config_of(kernel, D, dtype, causal, mask, dropout, _interpreting())


#: ``{"fwd" | "dkdv" | "dkdv_atomic" | "dq": (BLOCK_M, BLOCK_N, num_warps, num_stages),
#: "<kernel>:tma": bool, "dq_mode": "kernel" | "atomic" | "bulk", "fwd:fold": bool,
#: "<kernel>:maxnreg": int}``: launch
#: rows that replace :func:`_config`'s (and :data:`TMA_MODE` for that kernel, :data:`DQ_MODE`,
#: the forward's scale in the exponent's FMA, :func:`_fold`, a register cap per thread,
#: :func:`_reg_cap`) for every call
#: while set. Empty in normal use; the GPU config sweep (benchmarks/config_sweep.py) sets it
#: to time candidates on the same inputs. The tuner's rows (``kernels/_tune.py``) use the
#: same names and come first.
LAUNCH_OVERRIDE: dict = {}


def _override(name):
    """The value the tuned call in progress or :data:`LAUNCH_OVERRIDE` gives ``name``, or None."""
    return _tune.override(LAUNCH_OVERRIDE, name)


@functools.lru_cache(maxsize=None)
def _config_of(kernel, D, dtype, causal, mask, dropout, interpreting):
    block_d = max(16, next_pow2(D))
    if interpreting:
        return 16, 16, block_d, 1, 1           # small blocks: multi-block logic at tiny T
    bucket = 64 if block_d <= 64 else 128 if block_d <= 128 else 256
    narrow = dtype in (torch.float16, torch.bfloat16)
    key = (kernel, bucket, narrow)
    row = None
    if dropout:
        if causal and mask == "perm":
            row = _PERM_CAUSAL_DROPOUT_CONFIGS.get(key)
        row = row or _DROPOUT_CONFIGS.get(key)
    elif mask == "perm":
        row = _PERM_CONFIGS.get(key)
    elif mask == "kpm":
        row = _KPM_CONFIGS.get(key)
    bm, bn, warps, stages = row or _CONFIGS[key]
    return bm, bn, block_d, warps, stages


#: What the tuner (``CTXFAST_AUTOTUNE=on``, kernels/_tune.py) times per kernel of a 16-bit call
#: besides the table row: ``(row, tma)``, row ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` or
#: None (the table's), tma whether the kernel's loop tiles come through TMA descriptors (taken
#: only where the call can: :func:`_tma_possible`). Keyed (kernel, head-dim bucket). Every row
#: compiles for sm_90 without spills and with every dot a wgmma (bf16, causal:
#: tests/test_triton_compile.py's "tuning candidates" cases; registers in benchmarks/NOTES.md):
#: the rows of the H100 and H200 sweeps and Triton's fused-attention tutorial that do, and
#: (after the H200's round 4 made its winners the table) spill-free neighbours of the new
#: rows: more stages, the other block shape; at D 128 32 x 128 and 16 x 128 dK/dV with 3
#: stages (64-row dK/dV blocks spill 24-220 B there, except 64 x 64 at 8 warps, 2 stages),
#: dQ 128 x 32 and 64 x 128; forward rows of 128 x 128 (3 stages, TMA; shared memory
#: 230,400 B at D 128, under sm_90's 232,448) as FlashAttention-3 tiles it. fp32
#: and D > 128 keep their rows; with dropout or a permutation mask (more tiles live: these
#: rows spill there) only the table row and its TMA twin are timed.
_TUNE_CANDIDATES = {
    ("fwd", 64): [(None, True), ((128, 64, 8, 3), False), ((128, 64, 4, 3), False),
                  ((128, 128, 8, 2), False), ((64, 64, 4, 3), False), ((128, 128, 8, 2), True),
                  ((64, 64, 4, 4), False), ((64, 128, 4, 3), False), ((64, 64, 4, 5), False),
                  ((128, 128, 8, 3), True)],
    ("fwd", 128): [(None, True), (None, False), ((128, 64, 8, 3), False),
                   ((128, 128, 8, 2), False), ((128, 64, 8, 3), True), ((128, 128, 8, 2), True),
                   ((64, 64, 4, 4), True), ((64, 128, 8, 3), True), ((128, 128, 8, 3), True),
                   ((128, 64, 8, 4), True), ((64, 128, 4, 3), True)],
    ("dkdv", 64): [(None, True), ((64, 128, 8, 3), False), ((32, 128, 8, 3), False),
                   ((64, 64, 4, 3), False), ((64, 64, 8, 3), False), ((32, 128, 8, 3), True),
                   ((64, 64, 4, 4), False), ((32, 64, 4, 3), False)],
    ("dkdv", 128): [(None, True), ((32, 64, 8, 2), False), ((32, 64, 8, 3), False),
                    ((32, 128, 8, 2), False), ((32, 128, 8, 3), True), ((16, 128, 8, 3), False),
                    ((64, 64, 8, 2), False)],
    ("dq", 64): [(None, True), ((128, 64, 8, 3), False), ((64, 64, 4, 2), False),
                 ((128, 128, 8, 2), False), ((128, 32, 4, 3), False), ((128, 128, 8, 2), True),
                 ((128, 64, 8, 4), False)],
    ("dq", 128): [(None, True), ((128, 64, 8, 2), False), ((64, 64, 4, 2), False),
                  ((64, 64, 8, 2), False), ((128, 64, 8, 3), False), ((128, 128, 8, 2), True),
                  ((64, 64, 4, 2), True), ((128, 32, 8, 3), False), ((64, 128, 8, 2), False),
                  ((64, 128, 8, 3), False), ((64, 64, 4, 3), False)],
}

#: Register caps the tuner tries on the table rows of 16-bit D 64 calls without dropout or
#: a mask (padding takes other rows) (``"<kernel>:maxnreg"``, :func:`_reg_cap`): one more
#: CTA an SM where the registers, not the shared memory, set the count (sm_90, Triton 3.9, bf16 causal;
#: not timed). dQ (128 x 64, 8 warps): 140 registers fit one CTA, 128 fit two, and ptxas
#: then spills nothing (its loop 276 -> 295 instructions a tile). dK/dV (64 x 64, 4 warps,
#: 67 KB): 238 registers fit two, 168 three, with 28 spill reloads a tile in its main loop
#: (339 -> 381 instructions). The forward at D 64 (64 KB at 3 stages) is held to three by
#: its shared memory; the D 128 rows by theirs or by spills a cap would need.
_TUNE_REG_CAPS = {("dkdv", 64): 168, ("dq", 64): 128}


def _reg_cap(kernel: str) -> dict:
    """``{"maxnreg": n}`` where the override ``"<kernel>:maxnreg"`` (:func:`_override`; the
    tuner's rows) caps that kernel's registers per thread, else ``{}``."""
    cap = _override(kernel + ":maxnreg")
    return {"maxnreg": int(cap)} if cap else {}


#: With a permutation mask (no dropout) dK/dV's table row runs one stage (pipelined, its rank
#: tiles spilled: :data:`_PERM_CONFIGS`); these rows are pipelined without spilling (sm_90,
#: bf16 perm and kpm+perm_strict: 195-218 registers).
_TUNE_PERM_CANDIDATES = {("dkdv", 64): [((32, 128, 8, 3), False)],
                         ("dkdv", 128): [((32, 64, 8, 3), False)]}

#: dK/dV rows with dQ by atomic adds besides the table's (``"dkdv_atomic"``), spill-free on
#: sm_90 (Triton 3.9, bf16 causal: 242 and 246 registers; the table's 64 x 128 x 8 x 3 244).
_TUNE_ATOMIC_ROWS = {64: [(64, 64, 8, 3), (64, 128, 8, 2)]}

#: Whether the tuner also tries dQ by atomic adds (dK/dV) and the table rows with half the
#: exponentials on the FMA pipe (every 16-bit kernel). Off: the H200 (round 5, bf16 causal,
#: Triton 3.6) timed both slower in every case it reached. Atomic dQ, now relaxed reductions:
#: the backward 334 against 271 us (GPT-2 size), 3576 against 2013 (T 4096 D 128), 134
#: against 112 (T 512); FMA exponentials: forward 113 / 707 / 44.8 against 92.7 / 557 / 35.5,
#: dK/dV 289 / 2238 / 119 against 271 / 2013 / 112, dQ 323 / 2127 / 131 against 271 / 1917 /
#: 112 us. Both paths stay reachable (CTXFAST_ATTN_BWD_DQ, :data:`LAUNCH_OVERRIDE`) and tested;
#: True puts them back among the candidates (the interpreter's tests of the tuner do).
TUNE_ATOMIC_DQ = False
TUNE_EXP_EMU = False
#: Whether the tuner also times the 16-bit forward's table row with the scale applied to the
#: tile (``"fwd:fold": False``, the form before :func:`_fold`; sm_90 SASS: 30 more FMUL per
#: thread and key tile): the same-run measure of the fold, not yet timed on a GPU.
TUNE_FOLD_OFF = True
#: Whether the tuner tries dQ by TMA bulk reductions (:data:`DQ_MODE` "bulk"; the atomic
#: rows, where the descriptors can be used): not yet timed on a GPU.
TUNE_BULK_DQ = True

#: The same under the interpreter (tests: every dtype, rows of its small tiles).
_TUNE_INTERPRETED = [(None, True), ((32, 16, 1, 1), False), ((16, 32, 1, 1), False)]


def _candidates(kernel, D, dtype, mask, dropout, dense, tma_ok, ws_ok=False):
    """The tuner's candidates for one kernel of a call: dicts of override names
    (:data:`LAUNCH_OVERRIDE`'s), ``{}`` (the table row) first. With :data:`TUNE_ATOMIC_DQ`
    (:data:`TUNE_BULK_DQ`: where the call can use descriptors and D is a multiple of 4)
    dK/dV also tries dQ by atomic adds (bulk) (:data:`DQ_MODE`; dense 16-bit calls at D <= 128
    without dropout or a permutation mask: elsewhere its rows spill; never under torch's
    deterministic algorithms), which launches no dQ kernel: dQ's list is then a function of
    the rows chosen before it (``{}`` alone after atomic adds). With :data:`TUNE_EXP_EMU`
    each 16-bit kernel also tries its table row with half of each tile's exponentials on the
    FMA pipe (``"<kernel>:exp_emu"``, :func:`_exp_emu`). With ws_ok (:func:`_ws_possible`
    and :data:`TUNE_WS`: :func:`_tuned`) each kernel also tries its warp-specialised twin
    (``"<kernel>:ws"``) at the rows of :data:`_WS_CANDIDATES`."""
    block_d = max(16, next_pow2(D))
    if _interpreting():
        listing = _TUNE_INTERPRETED
    elif dtype in TMA_DTYPES and block_d <= 128:
        bucket = 64 if block_d <= 64 else 128
        listing = _TUNE_CANDIDATES[(kernel, bucket)]
        if dropout or mask == "perm":
            listing = [c for c in listing if c[0] is None]
            if not dropout:
                listing = listing + _TUNE_PERM_CANDIDATES.get((kernel, bucket), [])
    else:
        listing = []
    table_tma = check_tma_mode(TMA_MODE, _table_tma(kernel, block_d, dtype, dropout)) and tma_ok
    table_row = None
    if listing and not _interpreting():
        bm, bn, _, warps, stages = _config_of(kernel, D, dtype, False, mask, dropout, False)
        table_row = (bm, bn, warps, stages)
    seen = {(table_row, table_tma)}           # a launch is timed once (the table's first)
    out = [{}]
    for row, tma in listing:
        launch = (table_row if row is None else row, tma)
        if (tma and not tma_ok) or launch in seen:
            continue
        seen.add(launch)
        out.append({kernel + ":tma": tma, **({kernel: row} if row is not None else {})})
    adds = kernel == "dkdv" and dense and not dropout and mask != "perm" \
        and not torch.are_deterministic_algorithms_enabled() \
        and (_interpreting() or (dtype in TMA_DTYPES and block_d <= 128))
    modes = [m for m, on in (("atomic", TUNE_ATOMIC_DQ), ("bulk", TUNE_BULK_DQ and tma_ok
                                                          and D % 4 == 0))
             if adds and on and DQ_MODE != m]
    for mode in modes:
        out.append({"dq_mode": mode})
        if not _interpreting():
            out += [{"dq_mode": mode, "dkdv_atomic": row}
                    for row in _TUNE_ATOMIC_ROWS.get(64 if block_d <= 64 else 128, ())]
    if TUNE_EXP_EMU and dtype in TMA_DTYPES and not _interpreting():
        out.append({kernel + ":exp_emu": True})   # the table's row, half its exp2 on FMAs
    cap = _TUNE_REG_CAPS.get((kernel, block_d)) if listing and mask == "none" and not dropout \
        else None
    if cap and not _interpreting():
        out.append({kernel + ":maxnreg": cap})    # the table's row, more CTAs an SM
    if TUNE_FOLD_OFF and kernel == "fwd" and (dtype in TMA_DTYPES or _interpreting()):
        out.append({"fwd:fold": False})           # the table's row, the tile scaled first
    if ws_ok:
        if _interpreting():
            out.append({kernel + ":ws": True})    # its interpreter row (_WS_ROW's docs)
        else:
            out += [{kernel + ":ws": True, kernel: row}
                    for row in _WS_CANDIDATES[(kernel, 64 if block_d <= 64 else 128)]]
    if kernel == "dq":
        return lambda chosen: [{}] if chosen.get("dq_mode") in ("atomic", "bulk") else out
    return out


def _tuned(kernels, q, dims, causal, mask, dropout, cu, order, run, outputs, ws=None):
    """``run()`` (a launcher call writing ``outputs``), through the tuner where it is on for
    q's device (kernels/_tune.py): the first call of each kind times :func:`_candidates`
    for ``kernels`` in order and keeps the fastest whose outputs agree with the table's.
    ws: None, or a function giving the kernels whose warp-specialised twins can serve the
    call (:func:`_ws_possible`, :func:`_ws_bwd_kernels`; asked only when tuning)."""
    if not _tune.wanted(q.device):
        return run()
    tune_ws = _tune_ws()                # a bad CTXFAST_TUNE_WS: refused by every tuned call
    ws_ok = tuple(ws()) if ws is not None and tune_ws else ()
    B, H, Tq, Tk, D, max_q, max_k = dims
    tma_ok = _tma_possible(q.dtype, q.device, cu, order)
    size = _tune.size_class
    kind = ("attention", kernels, D, q.dtype, _precision(q.dtype), causal, mask, dropout,
            cu is not None, order is not None, tma_ok, TMA_MODE, DQ_MODE,
            torch.are_deterministic_algorithms_enabled(), size(B * H), size(max_q),
            size(max_k), ws_ok)
    stages = [(name, _candidates(name, D, q.dtype, mask, dropout, cu is None, tma_ok,
                                 name in ws_ok)) for name in kernels]
    return _tune.call(kind, stages, run, outputs, q.device, q.dtype)


def _mask_kind(key_padding_mask, perm_rank) -> str:
    return "perm" if perm_rank is not None else "kpm" if key_padding_mask is not None else "none"


def rank_order(perm_rank):
    """(order, rank_sorted), int32 ``[B, Tq]`` contiguous: the stable argsort of each row of
    perm_rank and the ranks in that order (non-decreasing). O(B·Tq) data; the kernels solve
    a permutation mask in this order (module docstring)."""
    rank = perm_rank.to(torch.int32)
    order = torch.argsort(rank, dim=1, stable=True)
    return order.to(torch.int32).contiguous(), torch.gather(rank, 1, order).contiguous()


def _rank_ordered(key_padding_mask, perm_rank, causal, perm_strict, perm_order):
    """(key_padding_mask, perm_rank, order) as the kernels take them. A permutation mask
    without causal runs in rank order: ranks sorted, the padding mask's current keys
    permuted like the keys, and order = (order, span), int32 [B, Tq] and [B, 2, Tq]: the
    rows, and per row the count of current keys it sees / per key the first row that sees
    it (the loop bounds). perm_order is :func:`rank_order`'s result when the caller has it,
    else it is computed here. Otherwise (no permutation, or causal, whose diagonal lives
    in the original order) the masks as given and order None."""
    if perm_rank is None or causal:
        return key_padding_mask, perm_rank, None
    order, rank_sorted = rank_order(perm_rank) if perm_order is None else perm_order
    # row i sees the keys of rank <= its own (<, strict): a prefix of the sorted keys;
    # key t is seen from the first row of rank >= its own (>, strict) on
    span = torch.stack([torch.searchsorted(rank_sorted, rank_sorted, right=not perm_strict),
                        torch.searchsorted(rank_sorted, rank_sorted, right=perm_strict)], 1)
    if key_padding_mask is not None:
        mem_len = key_padding_mask.shape[1] - perm_rank.shape[1]
        key_padding_mask = torch.cat([key_padding_mask[:, :mem_len],
                                      key_padding_mask[:, mem_len:].gather(1, order.long())], 1)
    return key_padding_mask, rank_sorted, (order, span.to(torch.int32).contiguous())


#: "auto" (default), "on" or "off": whether the kernels' main loops read their tiles (the
#: forward's and dQ's k and v, dK/dV's q and dO) through host-side tensor descriptors, i.e.
#: TMA loads on sm_90+ (Hopper): no address tiles in registers, no masks (rows past a
#: sequence and columns past D read as 0). Where the device has TMA (compute capability
#: >= 9; the interpreter emulates it), the dtype is in :data:`TMA_DTYPES`, the call is dense
#: (not varlen) and not in rank order, and every such tensor is addressable
#: (:func:`_common.row_tiles`), "on" loads descriptors in every kernel and "auto" in the
#: kernels of :data:`_TMA_ROWS`; other calls load pointer tiles as with "off". From
#: ``CTXFAST_ATTN_TMA`` at import.
TMA_MODE = os.environ.get("CTXFAST_ATTN_TMA", "auto")

#: (kernel, head-dim bucket) whose table rows (:data:`_CONFIGS`, 16-bit, no dropout) read
#: through TMA descriptors under :data:`TMA_MODE` "auto": where the H200 timed them faster
#: (benchmarks/results/nvidia-h200/2026-11-27-round4, bf16 causal T 4096): the D 128 forward
#: (552 us against 596 with pointer tiles). At D 64 descriptors tied in the forward (102
#: against 102) and lost in dK/dV (324 against 305) and dQ (305 against 273).
_TMA_ROWS = {("fwd", 128)}


def _table_tma(kernel, D, dtype, dropout, split=False) -> bool:
    """The launch table's TMA choice for ``kernel`` (:data:`_TMA_ROWS`): not where the tuner
    or :data:`LAUNCH_OVERRIDE` replaces the kernel's row, nor with dropout (other rows), nor
    for split-K decoding (not timed)."""
    bucket = 64 if D <= 64 else 128 if D <= 128 else 256
    return (not dropout and not split and dtype in TMA_DTYPES and (kernel, bucket) in _TMA_ROWS
            and _override(kernel) is None)

#: Dtypes whose calls TMA_MODE "on" serves: 16-bit only. fp32's tf32 dots run on mma.sync
#: tiles of 16-64 rows, and with TMA the dK/dV and dQ kernels spilled 116 and 48 B per
#: thread on sm_90 where the pointer tiles spill none (benchmarks/NOTES.md).
TMA_DTYPES = (torch.float16, torch.bfloat16)


def _tma_args(kernel, names, tensors, rows, block_d, device, cu, order, dropout, split=False):
    """Keyword arguments that turn kernel's TMA loads on (:func:`_common.tma_args`) for
    the tensors read in ``[rows, block_d]`` tiles, or ``{}`` (pointer tiles) where
    :data:`TMA_MODE` (or the override ``"<kernel>:tma"``) is off for it or the call cannot
    use TMA."""
    on = check_tma_mode(TMA_MODE, _table_tma(kernel, block_d, tensors[0].dtype, dropout, split))
    want = _override(kernel + ":tma")
    if (not (on if want is None else want) or not _tma_possible(tensors[0].dtype, device, cu,
                                                                   order)):
        return {}
    return tma_args(names, tensors, rows, block_d)


def _tma_possible(dtype, device, cu, order) -> bool:
    """A call of this dtype, device and kind can read its tiles through descriptors."""
    return cu is None and order is None and dtype in TMA_DTYPES and _has_tma(device)


def _launch_forward(q, k, v, out, lse, lse_strides, dims, *, causal, key_padding_mask,
                    perm_rank, perm_strict, scale, dropout_p, seed, cu=None, num_splits=1,
                    order=None):
    """Shared by the dense and the packed entry points. q, k, v, out: 4-D views
    [B|1, H, T, D]; dims = (B, H, Tq, Tk, D, max_q, max_k); cu = (cu_q, cu_k) or None.
    num_splits > 1 (dense only): flash-decoding, keys split over programs, then combined.
    order: None, or (order, span) of :func:`_rank_ordered`, with the masks already permuted."""
    if _override("fwd:ws") and _ws_possible(q, k, v, key_padding_mask, perm_rank, dropout_p,
                                            cu, order, num_splits > 1):
        return _launch_forward_ws(q, k, v, out, lse, lse_strides, dims, causal=causal,
                                  scale=scale)
    B, H, Tq, Tk, D, max_q, max_k = dims
    kpm, rank, kv_end, mstrides = _mask_args(q, key_padding_mask, perm_rank)
    cu_q, cu_k = cu if cu is not None else (kv_end, kv_end)
    bm, bn, bd, warps, stages = _config("fwd", D, q.dtype, causal,
                                        _mask_kind(key_padding_mask, perm_rank), dropout_p > 0)
    assert cu is None or num_splits == 1, "split-K is for the dense path"
    num_splits, keys_per_split, o_target, l_target, o_strides, l_strides, split_strides = \
        _split_targets(out, lse, B, H, Tq, Tk, D, bn, num_splits)
    if num_splits == 1:
        l_strides = lse_strides
    split = num_splits > 1
    tma = _tma_args("fwd", ("KD", "VD"), (k, v), bn, bd, q.device, cu, order, dropout_p > 0,
                    split)
    seed_arg = _seed_arg(q, dropout_p, seed)
    for bh0, n in bh_chunks(B * H):
        fast(_attn_fwd_kernel)[(cdiv(max_q, bm), n, num_splits)](
            q, k, v, o_target, l_target, kpm, rank,
            *(order if order is not None else (kv_end,) * 2), kv_end, seed_arg, cu_q, cu_k,
            *q.stride(), *k.stride(), *v.stride(), *o_strides, *mstrides, *l_strides,
            *split_strides, keys_per_split,
            H, Tq, Tk, Tk - Tq, D, max_q, max_k, scale * LOG2E, float(dropout_p),
            bh0, CAUSAL=causal, HAS_KPM=key_padding_mask is not None,
            HAS_PERM=perm_rank is not None,
            PERM_STRICT=perm_strict, SORTED=order is not None, DROPOUT=dropout_p > 0,
            VARLEN=cu is not None, SPLIT_K=split,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, EVEN_D=bd == D,
            UPCAST=_interpreting() and q.dtype == torch.bfloat16, PRECISION=_precision(q.dtype),
            num_warps=warps, num_stages=stages, EXP_EMU=_exp_emu(q.dtype, "fwd"),
            FOLD=_fold(scale), **tma, **_reg_cap("fwd"),
        )
    if split:
        _combine_splits(o_target, l_target, out, lse)


#: The warp-specialised kernels' launch rows (BLOCK_M, BLOCK_N, num_warps, num_stages) where
#: the override ``"<kernel>:ws"`` asks for one without a ``"<kernel>"`` row of its own. 4
#: warps: Triton splits them into a producer warp and two consumer warpgroups (12 warps
#: run); at 8 it does not split. The consumers split the program's own block: the
#: forward's and dQ's query block (BLOCK_M), dK/dV's key block (BLOCK_N).
_WS_ROW = {"fwd": (128, 128, 4, 2), "dkdv": (32, 128, 4, 2), "dq": (128, 64, 4, 2)}

#: The rows the tuner times the warp-specialised kernels with (:data:`TUNE_WS`), per kernel
#: and head-dim bucket. Each compiles for sm_90 with the split (``setmaxnreg``), every dot a
#: wgmma and no spill (Triton 3.9; bf16, causal and not; shared memory in
#: benchmarks/NOTES.md; tests/test_triton_compile.py's "warp-specialised" cases).
_WS_CANDIDATES = {
    ("fwd", 64): [(128, 128, 4, 2), (128, 64, 4, 3), (128, 128, 4, 3)],
    ("fwd", 128): [(128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 4, 3)],
    ("dkdv", 64): [(64, 128, 4, 2), (64, 128, 4, 3), (32, 128, 4, 2)],
    ("dkdv", 128): [(32, 128, 4, 2), (32, 128, 4, 3), (16, 128, 4, 2)],
    ("dq", 64): [(128, 64, 4, 2), (128, 128, 4, 2), (128, 64, 4, 3)],
    ("dq", 128): [(128, 64, 4, 2), (128, 32, 4, 2), (128, 64, 4, 3)],
}

#: Whether the tuner also times the warp-specialised kernels (:func:`_attn_fwd_ws_kernel`,
#: :func:`_attn_bwd_dkdv_ws_kernel`, :func:`_attn_bwd_dq_ws_kernel`) on the calls they can
#: serve (:func:`_ws_possible`): not yet timed on a GPU, so never the table's choice.
#: ``CTXFAST_TUNE_WS=0`` (read at import; "1" the default, anything else refused by the
#: first tuned call) leaves them out: e.g. on a Triton release whose split of them fails
#: or hangs on the GPU (benchmarks/gpu_round.sh sets it when its one launch of each fails).
TUNE_WS = os.environ.get("CTXFAST_TUNE_WS", "1")


def _tune_ws() -> bool:
    """:data:`TUNE_WS` as a bool; any other value than "0" / "1" (or a bool) refused by name."""
    return flag_setting("CTXFAST_TUNE_WS", TUNE_WS)


def _ws_possible(q, k, v, key_padding_mask, perm_rank, dropout_p, cu, order,
                 split=False) -> bool:
    """The warp-specialised forward can serve this call: dense (not varlen, not in rank
    order, not split-K), no padding or permutation mask, no dropout, 16-bit, D <= 128, a
    device with TMA (or the interpreter) and q, k, v addressable by TMA row by row."""
    return (cu is None and order is None and not split and key_padding_mask is None
            and perm_rank is None and dropout_p == 0 and q.dtype in TMA_DTYPES
            and q.shape[-1] <= 128 and _has_tma(q.device)
            and all(tma_addressable(t) for t in (q, k, v)))


def _ws_bwd_kernels(q, k, v, do, lse, delta, lse_strides, key_padding_mask, perm_rank,
                    dropout_p, cu, order) -> tuple:
    """Which warp-specialised backward kernels can serve the call: none unless
    :func:`_ws_possible` and dO addressable by TMA; then dK/dV, and dQ where the rows of lse
    and delta start on 16 bytes (it reads them by TMA)."""
    if not (_ws_possible(q, k, v, key_padding_mask, perm_rank, dropout_p, cu, order)
            and tma_addressable(do)):
        return ()
    rows_ok = all(t.data_ptr() % 16 == 0 for t in (lse, delta)) and all(
        s * 4 % 16 == 0 for s in lse_strides)
    return ("dkdv", "dq") if rows_ok else ("dkdv",)


def _launch_bwd_ws(kernel, name, do, q, k, v, lse, delta, outs, lse_strides, dims, *, causal,
                   scale):
    """A warp-specialised backward kernel (`name` "dkdv": :func:`_attn_bwd_dkdv_ws_kernel`
    writing outs = (dk, dv); "dq": :func:`_attn_bwd_dq_ws_kernel` writing (dq,)) on a call
    :func:`_ws_possible` accepts (and dO addressable by TMA), with the override `name`'s
    row, else :data:`_WS_ROW`'s (16 x 16 x 1 x 1 under the interpreter)."""
    B, H, Tq, Tk, D = dims[:5]
    row = _override(name) or ((16, 16, 1, 1) if _interpreting() else _WS_ROW[name])
    bm, bn, warps, stages = row
    grid = (cdiv(Tk, bn) if name == "dkdv" else cdiv(Tq, bm), B * H)
    keys = {} if name == "dkdv" else {"MASK_KEYS": not causal and Tk % bn != 0}
    with descriptor_scratch(q.device):
        for bh0, n in bh_chunks(B * H):
            fast(kernel)[(grid[0], n)](
                q, k, v, do, lse, delta, *outs, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                *do.stride()[:3], *outs[0].stride(), *lse_strides, H, Tq, Tk, Tk - Tq, D,
                scale * LOG2E, scale, bh0, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_D=max(16, next_pow2(D)),
                UPCAST=_interpreting() and q.dtype == torch.bfloat16, PRECISION=_precision(q.dtype),
                num_warps=warps, num_stages=stages, **keys)


def _launch_forward_ws(q, k, v, out, lse, lse_strides, dims, *, causal, scale):
    """:func:`_attn_fwd_ws_kernel` on a call :func:`_ws_possible` accepts, with the
    override ``"fwd"``'s row, else :data:`_WS_ROW`'s (16 x 16 x 1 x 1 under the interpreter:
    several blocks at the tests' lengths)."""
    B, H, Tq, Tk, D = dims[:5]
    row = _override("fwd") or ((16, 16, 1, 1) if _interpreting() else _WS_ROW["fwd"])
    bm, bn, warps, stages = row
    with descriptor_scratch(q.device):
        for bh0, n in bh_chunks(B * H):
            fast(_attn_fwd_ws_kernel)[(cdiv(Tq, bm), n)](
                q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                *out.stride(), *lse_strides, H, Tq, Tk, Tk - Tq, D, scale * LOG2E,
                bh0, CAUSAL=causal, MASK_KEYS=not causal and Tk % bn != 0, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_D=max(16, next_pow2(D)),
                UPCAST=_interpreting() and q.dtype == torch.bfloat16, PRECISION=_precision(q.dtype),
                FOLD=_fold(scale), num_warps=warps, num_stages=stages)


#: How the backward computes dQ: "kernel" (a second kernel over key blocks per query block,
#: recomputing the scores; deterministic) or "atomic" (the dK/dV kernel adds each tile's
#: dS K into an fp32 accumulator with atomic adds, as FlashAttention-2 does: no second
#: recompute, sums in no fixed order) or "bulk" (the same sums, each tile's added in one
#: TMA bulk reduction, ``cp.reduce.async.bulk.tensor``, as FlashAttention-3 adds its dQ
#: tiles: one instruction a tile where "atomic" issues a reduction per 4 elements of every
#: thread; a GPU of compute capability 9+ or the interpreter, 4-byte-aligned rows (D a
#: multiple of 4) and no rank order, else the element-wise adds of "atomic"). From
#: ``CTXFAST_ATTN_BWD_DQ`` at import; dense calls only (varlen always takes the kernel). The
#: H200 timed "atomic" 1.2-1.8x slower (:data:`TUNE_ATOMIC_DQ`); "bulk" is not yet timed.
#: "atomic" or "bulk" while torch's deterministic algorithms are on is refused (as torch
#: refuses its own nondeterministic ops), and the tuner does not offer them then.
DQ_MODE = os.environ.get("CTXFAST_ATTN_BWD_DQ", "kernel")


def _fold(scale: float) -> bool:
    """Whether the forward applies the scale in the exponent's FMA (the kernel's FOLD):
    where ``kernels._common._fold_scale`` allows it, unless the override ``"fwd:fold"`` is
    False (the tuner's comparison, :data:`TUNE_FOLD_OFF`)."""
    return _fold_scale(scale) and _override("fwd:fold") is not False


def _exp_emu(dtype, kernel: str) -> bool:
    """Whether kernel ("fwd", "dkdv" or "dq") computes half of each tile's exponentials on
    the FMA pipe (``kernels._common._exp2_half_fma``): 16-bit calls whose launch rows say
    so, i.e. the override ``"<kernel>:exp_emu"`` (never the table's: the H200 timed it
    slower in every kernel, :data:`TUNE_EXP_EMU`). Its relative error, 2.6e-6, is a hundredth of fp16's half ulp;
    float32 never takes it."""
    return bool(_override(kernel + ":exp_emu")) and dtype in (torch.float16, torch.bfloat16)


def _check_dq_mode_name() -> None:
    """:data:`DQ_MODE` refused by name if it is not a mode (the forward asks too: a bad
    setting is refused before any kernel runs, not at the first backward)."""
    if DQ_MODE not in ("kernel", "atomic", "bulk"):
        raise ValueError("CTXFAST_ATTN_BWD_DQ must be 'kernel', 'atomic' or 'bulk', "
                         f"got {DQ_MODE!r}")


def _dq_mode() -> str:
    """DQ_MODE (refused by name if not a mode), or the override ``"dq_mode"``; "atomic" and
    "bulk" refused under ``torch.use_deterministic_algorithms(True)`` (warned of with warn_only)."""
    _check_dq_mode_name()
    mode = _override("dq_mode") or DQ_MODE
    if mode != "kernel":
        check_deterministic("attention", f"CTXFAST_ATTN_BWD_DQ={mode}")
    return mode


def _dq_bulk_args(dq_acc, bm, bd, order) -> dict:
    """The dK/dV launch's keyword arguments for dQ by TMA bulk reductions (DQ_MODE "bulk"):
    the accumulator's descriptor in ``[bm, bd]`` tiles, or ``{}`` (element-wise adds) where
    the device has no TMA, the rows are in rank order or TMA cannot address the
    accumulator (D not a multiple of 4)."""
    if order is not None:
        return {}
    return bulk_add_args(dq_acc, bm, bd, "DQAD", "DQ_BULK")


def _launch_backward(do, q, k, v, lse, delta, dq, dk, dv, lse_strides, dims, *, causal,
                     key_padding_mask, perm_rank, perm_strict, scale, dropout_p, seed, cu=None,
                     order=None):
    """Backward counterpart of :func:`_launch_forward` (dk and dv share one layout)."""
    B, H, Tq, Tk, D, max_q, max_k = dims
    kpm, rank, kv_end, mstrides = _mask_args(q, key_padding_mask, perm_rank)
    cu_q, cu_k = cu if cu is not None else (kv_end, kv_end)
    order_args = order if order is not None else (kv_end, kv_end)
    seed_arg = _seed_arg(q, dropout_p, seed)
    flags = dict(
        CAUSAL=causal, HAS_KPM=key_padding_mask is not None, HAS_PERM=perm_rank is not None,
        PERM_STRICT=perm_strict, SORTED=order is not None, DROPOUT=dropout_p > 0,
        VARLEN=cu is not None,
        UPCAST=_interpreting() and q.dtype == torch.bfloat16, PRECISION=_precision(q.dtype),
    )
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *mstrides, *lse_strides)
    scalars = (H, Tq, Tk, Tk - Tq, D, max_q, max_k, scale * LOG2E, scale, float(dropout_p))
    kind = _mask_kind(key_padding_mask, perm_rank)
    mode = "kernel" if cu is not None else _dq_mode()
    atomic = mode != "kernel"
    ws = {name: bool(_override(name + ":ws")) for name in ("dkdv", "dq")}
    if any(ws.values()):                          # what the call lets them serve
        can = _ws_bwd_kernels(q, k, v, do, lse, delta, lse_strides, key_padding_mask,
                              perm_rank, dropout_p, cu, order)
        ws = {name: on and name in can for name, on in ws.items()}
    if ws["dkdv"] and not atomic:
        _launch_bwd_ws(_attn_bwd_dkdv_ws_kernel, "dkdv", do, q, k, v, lse, delta, (dk, dv),
                       lse_strides, dims, causal=causal, scale=scale)
    else:
        bm, bn, bd, warps, stages = _config("dkdv_atomic" if atomic else "dkdv", D, q.dtype,
                                            causal, kind, dropout_p > 0)
        dq_acc = (torch.zeros((B, H, Tq, D), dtype=torch.float32, device=q.device) if atomic
                  else dk)
        tma = _tma_args("dkdv", ("QD", "DOD"), (q, do), bm, bd, q.device, cu, order,
                        dropout_p > 0)
        if mode == "bulk":
            tma.update(_dq_bulk_args(dq_acc, bm, bd, order))
        for bh0, n in bh_chunks(B * H):
            fast(_attn_bwd_dkdv_kernel)[(cdiv(max_k, bn), n)](
                q, k, v, do, lse, delta, dk, dv, dq_acc, kpm, rank, *order_args, kv_end, seed_arg,
                cu_q, cu_k, *dk.stride(), *strides, *scalars, bh0, **flags, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_D=bd, EVEN_D=bd == D, ATOMIC_DQ=atomic, num_warps=warps, num_stages=stages,
                EXP_EMU=_exp_emu(q.dtype, "dkdv"), **tma, **_reg_cap("dkdv"))
        if atomic:
            dq.copy_(dq_acc)                        # scaled in the kernel: one pass here
            return
    if ws["dq"]:
        _launch_bwd_ws(_attn_bwd_dq_ws_kernel, "dq", do, q, k, v, lse, delta, (dq,),
                       lse_strides, dims, causal=causal, scale=scale)
        return
    bm, bn, bd, warps, stages = _config("dq", D, q.dtype, causal, kind, dropout_p > 0)
    tma = _tma_args("dq", ("KD", "VD"), (k, v), bn, bd, q.device, cu, order, dropout_p > 0)
    for bh0, n in bh_chunks(B * H):
        fast(_attn_bwd_dq_kernel)[(cdiv(max_q, bm), n)](
            q, k, v, do, lse, delta, dq, kpm, rank, *order_args, kv_end, seed_arg, cu_q, cu_k,
            *dq.stride(), *strides, *scalars, bh0, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
            EVEN_D=bd == D, num_warps=warps, num_stages=stages, EXP_EMU=_exp_emu(q.dtype, "dq"),
            **tma, **_reg_cap("dq"))


def attention_forward(q, k, v, *, causal=False, key_padding_mask=None, perm_rank=None,
                      perm_strict=False, scale=None, dropout_p=0.0, seed=None, num_splits=None,
                      perm_order=None):
    """q [B, H, Tq, D], k, v [B, H, Tk, D] -> (out [B, H, Tq, D] contiguous, lse [B, H, Tq] fp32).

    key_padding_mask: bool [B, Tk] (True = padding) or None; perm_rank: int [B, Tq] or None;
    perm_strict: True for XLNet's query stream (rank[t] < rank[i]); dropout_p > 0 needs
    seed (int64 tensor [1] on q's device): the mask is :func:`dropout_keep_mask` (seed).
    num_splits: key splits (flash-decoding); None picks them for few queries and long keys.
    perm_order: :func:`rank_order` (perm_rank) if the caller has it (else computed here when
    needed: a permutation mask without causal runs in rank order).
    """
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    out = _new_output((B, H, Tq, D), q.dtype, q.device)
    lse = _new_output((B, H, Tq), torch.float32, q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("inf"))
    if Tk == 0:
        return out.zero_(), lse.fill_(float("inf"))
    _check_dq_mode_name()               # a bad CTXFAST_ATTN_BWD_DQ: refused before a launch
    if num_splits is None:
        bm, bn = _config("fwd", D, q.dtype, causal, _mask_kind(key_padding_mask, perm_rank),
                         dropout_p > 0)[:2]
        num_splits = _auto_splits(B, H, Tq, Tk, bm, bn, q.device)
    kpm, rank, order = _rank_ordered(key_padding_mask, perm_rank, causal, perm_strict,
                                     perm_order)
    dims = (B, H, Tq, Tk, D, Tq, Tk)

    def run():
        _launch_forward(q, k, v, out, lse, (H * Tq, Tq), dims, causal=causal,
                        key_padding_mask=kpm, perm_rank=rank, perm_strict=perm_strict,
                        scale=scale, dropout_p=dropout_p, seed=seed, num_splits=num_splits,
                        order=order)
    if num_splits > 1:          # decoding: split by the table's key block (not tuned)
        run()
    else:
        _tuned(("fwd",), q, dims, causal, _mask_kind(kpm, rank), dropout_p > 0, None, order,
               run, (out, lse),
               lambda: ("fwd",) if _ws_possible(q, k, v, kpm, rank, dropout_p, None, order)
               else ())
    return out, lse


def attention_backward(do, q, k, v, out, lse, *, causal=False, key_padding_mask=None,
                       perm_rank=None, perm_strict=False, scale=None, dropout_p=0.0, seed=None,
                       perm_order=None):
    """Gradients (dq, dk, dv) of :func:`attention_forward`'s ``out`` for upstream ``do``."""
    do = int32_addressable(do)
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    dq = _new_output((B, H, Tq, D), q.dtype, q.device)
    dk = _new_output((B, H, Tk, D), k.dtype, k.device)
    dv = _new_output((B, H, Tk, D), v.dtype, v.device)
    if q.numel() == 0 or Tk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    check_tma_mode(TMA_MODE)                    # refused before the first launch (delta)
    _tune.check_mode()                          # so is CTXFAST_AUTOTUNE
    delta = _bwd_delta(do, out)                                 # [B, H, Tq] fp32
    kpm, rank, order = _rank_ordered(key_padding_mask, perm_rank, causal, perm_strict,
                                     perm_order)
    dims = (B, H, Tq, Tk, D, Tq, Tk)

    def run():
        _launch_backward(do, q, k, v, lse, delta, dq, dk, dv, (H * Tq, Tq), dims,
                         causal=causal, key_padding_mask=kpm, perm_rank=rank,
                         perm_strict=perm_strict, scale=scale, dropout_p=dropout_p, seed=seed,
                         order=order)
    _tuned(("dkdv", "dq"), q, dims, causal, _mask_kind(kpm, rank), dropout_p > 0, None, order,
           run, (dq, dk, dv),
           lambda: _ws_bwd_kernels(q, k, v, do, lse, delta, (H * Tq, Tq), kpm, rank,
                                   dropout_p, None, order))
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
    dims = (B, H, 0, 0, D, max_seqlen_q, max_seqlen_k)
    cu = (cu_seqlens_q, cu_seqlens_k)

    def run():
        _launch_forward(q4, k4, v4, out4, lse, (0, total_q), dims, causal=causal,
                        key_padding_mask=None, perm_rank=None, perm_strict=False, scale=scale,
                        dropout_p=dropout_p, seed=seed, cu=cu)
    _tuned(("fwd",), q, dims, causal, "none", dropout_p > 0, cu, None, run, (out, lse))
    return out, lse


def attention_varlen_backward(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, *, causal=False, scale=None, dropout_p=0.0, seed=None):
    """Gradients (dq, dk, dv) of :func:`attention_varlen_forward`'s ``out``."""
    do = int32_addressable(do)
    total_q, H, D = q.shape
    B = cu_seqlens_q.shape[0] - 1
    scale = D ** -0.5 if scale is None else scale
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if total_q == 0 or k.shape[0] == 0 or B == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return dq, dk, dv
    _tune.check_mode()                          # refused before any work
    delta = (do.float() * out.float()).sum(-1).t().contiguous()  # [H, total_q]
    do4, q4, k4, v4, dq4, dk4, dv4 = (_packed_view(t, B) for t in (do, q, k, v, dq, dk, dv))
    dims = (B, H, 0, 0, D, max_seqlen_q, max_seqlen_k)
    cu = (cu_seqlens_q, cu_seqlens_k)

    def run():
        _launch_backward(do4, q4, k4, v4, lse, delta, dq4, dk4, dv4, (0, total_q), dims,
                         causal=causal, key_padding_mask=None, perm_rank=None,
                         perm_strict=False, scale=scale, dropout_p=dropout_p, seed=seed, cu=cu)
    _tuned(("dkdv", "dq"), q, dims, causal, "none", dropout_p > 0, cu, None, run, (dq, dk, dv))
    return dq, dk, dv


@triton.jit
def _dropout_keep_kernel(
    SEED,        # [1] int64: the Philox seed
    KEEP,        # out: [B, H, Tq, Tk] uint8, contiguous (1 = kept)
    Tq, Tk, p_drop,
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh = tl.program_id(2) + BH0
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)    # keys on x: any Tk
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    keep = _keep(tl.load(SEED), bh, offs_m, offs_n, Tq, Tk, p_drop)
    ptrs = KEEP + (bh.to(tl.int64) * Tq + offs_m[:, None]) * Tk + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < Tq) & (offs_n[None, :] < Tk))


def dropout_keep_mask(seed, B, H, Tq, Tk, dropout_p):
    """The dropout mask the attention kernels use for `seed`: bool [B, H, Tq, Tk], True = kept.
    Materialises O(Tq·Tk) memory: for tests and debugging."""
    keep = torch.empty((B, H, Tq, Tk), dtype=torch.uint8, device=seed.device)
    if keep.numel():
        for bh0, n in bh_chunks(B * H):
            fast(_dropout_keep_kernel)[(cdiv(Tk, 16), cdiv(Tq, 16), n)](
                seed, keep, Tq, Tk, float(dropout_p), bh0, BLOCK_M=16, BLOCK_N=16)
    return keep.bool()
