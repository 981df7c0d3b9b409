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
kernel multiplies the queries by the band on the tensor cores and picks column ``jj +
BLOCK_M − 1 − ii`` of row ii by rotating each row of the product within a warp
(:func:`_rotate`, :func:`_skewed`): the skew the original code does with pad-and-view on
a whole ``[Tq, R]`` tensor.

One query operand where the query block is held through the loop (forward, dQ):
``(q + w)·r_m = (q + u)·r_m + (w − u)·r_m``, so those kernels hold only ``q + u`` (for the
content and the position term) and add the per-row vector ``(w − u)·r_m`` of the r tile to
the ``(q + u)·rᵀ`` product (:func:`_rb_rows`, read from a ``[H, R]`` table the launcher
computes once, :func:`row_bias_table`): one ``[BLOCK_M, BLOCK_D]`` operand less in
registers for the whole loop. Where the forward reads TMA tiles (16-bit, 64 x 64), the
vector can come as a product instead (:data:`RB_MMA`, opt-in until a GPU times it),
``ones [BLOCK_M, 16]`` times a ``[BLOCK_N, 16]`` bf16 tile (transposed) holding its two
halves (:func:`_rb_tile`, :func:`_rb_add`), so the loop's pipeline loads it with k, v and
r rather than in the iteration that needs it.
The dK/dV and dR kernels, which recompute P, form the position term the same way, ``(q +
u)·r_m`` plus the row bias (:func:`_rb_band`), and not as ``(q + w)·r_m``: at 16 bits ``q +
u`` and ``q + w`` round differently, and a P recomputed from the other rounding does not
match the forward's lse (rows of P summing to 1 ± 1%, dV and dK off by that at fp16). dR's
product takes ``q + w`` itself (the derivative). They load a new query block per tile and
read those operands ready-made, ``[B, H, Tq, D]`` in k's dtype, from
:func:`_rel_bwd_prep_kernel`, which forms them once per call in the launch that computes Δ,
instead of loading q and forming them at every tile.

Two chunks. Where the query block is fixed and the loop walks the key blocks (forward,
dQ), the band of key block ``n`` is two chunks of BLOCK_N rows of r, ``row0 + n + [0,
BLOCK_N)`` and the next, and the second is the next key block's first: each tile multiplies
one new chunk (``[BLOCK_M, BLOCK_N]``, as the content term) and keeps the product for the
next (:func:`_rel_scores_chunked`; pair (ii, jj) reads a column of one of the two,
:func:`_skewed`), instead of a band twice as wide per tile. The forward costs three
``[BLOCK_M, BLOCK_N] x [BLOCK_N, BLOCK_D]`` products per tile (content, position, PV) instead
of four. The dK/dV and dR kernels fix a key block or a set of diagonals and walk the query
blocks, whose queries change from tile to tile: they multiply the whole band.

Backward, with ``P`` recomputed and ``dS = P ∘ (dP − Δ)`` as in ``kernels/attention.py``:
``dK = scale · dSᵀ (q + u)``, ``dV = Pᵀ dO``; ``dq = d(q + u) + d(q + v) = scale · (dS K +
dS_band r_band)`` where ``dS_band[ii, jj + BLOCK_M − 1 − ii] = dS[ii, jj]`` (the skew undone
by the opposite rotation; in the dQ kernel chunk by chunk, one ``[BLOCK_M, BLOCK_N]`` product per
tile, :func:`_rel_bwd_dq_inner`). The dQ kernel stores dq once, in q's dtype, and the
column sums of its two accumulators, ``Σ_i d(q + u)_i`` and ``Σ_i d(q + v)_i``, as
``[BLOCK_D]`` partials per query block: the launcher's d(r_w_bias) and d(r_r_bias) (no
fp32 ``[B, H, Tq, D]`` pair of terms written, read back, added and summed). The segment
term gives per-row sums ``A_same, A_diff =
Σ_j dS_ij [same], Σ_j dS_ij [diff]``, from which the launcher forms the gradients of q,
seg_embed and r_s_bias. Each row of dS sums to 0, so they are taken as
``A_diff = Σ_diff dS − (Σ_diff P)(Σ_j dS)`` and ``A_same = −A_diff``: exact in exact
arithmetic, and free of the rounding of Δ (an error e in Δ moves dS_ij by −e·P_ij).
Three kernels without atomics: dK/dV (a program per key block), dQ (a program per query
block) and dR; or two, the dQ kernel adding dr with atomic adds (:data:`DR_MODE`: the
default for 16-bit calls at D <= 64 unless torch's deterministic algorithms are on); or
(DR_MODE "gemm") the dQ kernel storing dS itself and two GEMMs reading it along its
diagonals, ``_rel_dqw_gemm_kernel`` (dq's position term ``dS_band r_band``) and
``_rel_dr_gemm_kernel`` (dr, below): no atomics, no recompute.

dR. Row ``m`` of r is used by the pairs on one diagonal of the score matrix,
``j − i = m − c``, so

    ``dr[h, m] = scale · Σ_b Σ_i dS[b, h, i, i + m − c] · (q + v)[b, h, i]``,

a GEMM along diagonals. ``_rel_attn_bwd_dr_kernel`` gives a program BLOCK_N rows of r
(diagonals ``d0 + [0, BLOCK_N)``) of one (b, h) and walks down them a query block at a time:
the block's rows meet those diagonals at the keys ``m0 + d0 + [0, BAND)``, so it recomputes
``S`` and ``dP`` on that ``[BLOCK_M, BAND]`` band of keys (``(q + u) K_bandᵀ``,
``dO V_bandᵀ``; the position term of the owned pairs is the plain product
``(q + v) r_blockᵀ``, placed with a gather), keeps the owned pairs (``0 <= jj' − ii <
BLOCK_N``), gathers ``dS`` into diagonal order ``[BLOCK_M, BLOCK_N]`` and accumulates
``dS_diagᵀ (q + v)`` in registers; one store per program into ``[B, H, R, D]``, summed over
b by the launcher. Deterministic: every sum has a fixed order.

Why this and not per-program partials of the dQ kernel's ``dS_bandᵀ (q + v)`` plus a
reduction pass: those partials are ``B·H·⌈Tq/BLOCK_M⌉·(Tk + BLOCK_M)·D`` fp32, i.e.
``4·D/BLOCK_M`` bytes per score pair written and read again (8 bytes per pair at D 64,
BLOCK_M 64; at Tq 512, mem 3,072 that is ~7.5 MB per (b, h), close to the original code's
whole score memory). The H100 does ~330 bf16 FLOP per byte of HBM traffic (990 TFLOP/s
dense, 3 TB/s), so 8 bytes per pair cost what ~2,600 FLOP per pair cost, against the
~4·2·D = 512 FLOP per pair that the dR kernel adds (two band products of width 2·BLOCK_N
for one owned pair in two, the ``[BLOCK_M, BLOCK_N]`` position product and dr's own
product, minus dr's band product that leaves the dQ kernel). The recompute is the cheaper
of the two on an H100 and needs no memory beyond ``B·H·R·D`` (not measured on a GPU yet).
DR_MODE "gemm" stores dS itself instead of partials: 2 bytes a pair at 16 bits, written
once and read by two GEMMs, and it takes dq's position term out of the dQ loop too.

Sliding window (``WINDOW``; Transformer-XL's ``same_length``): pair (i, j) is visible only
if its distance ``mem_len + i − j < window``. The forward and dQ loops start at the first
key block a query block can see (``m0 + mem_len − window + 1``), the dK/dV loop stops after
the last query block a key block is seen by (``n0 + BLOCK_N − 1 − mem_len + window``), so a
window of W keys costs O(Tq·W), not O(Tq·Tk).

Tile pieces (written once, called by every kernel): :func:`_rel_scores` and
:func:`_rel_scores_chunked` (the scores of a tile, content term plus the shifted position
term, from the whole band or chunk by chunk), :func:`_seg_term`, :func:`_rel_visible`
(the masks and the window), ``kernels._common._online_softmax_step``. Interior and
boundary tiles: a tile whose every pair is visible (inside the keys, below the causal
diagonal, within the window; never with padding or a permutation, which are per element)
skips the visibility work. :func:`_interior_keys` gives the forward and dQ kernels the key
blocks ``[a, b)`` interior to their query block, :func:`_interior_queries` the dK/dV
kernel the query blocks interior to its key block; the loops test one scalar per tile.
The dR kernel's band tiles are never interior (half of each band is another program's).

Decoding (a few queries, long memory): the ``B·H·⌈Tq/BLOCK_M⌉`` programs of the forward
cannot fill a GPU, so the keys are split over a third grid axis (flash-decoding, as
``kernels/attention.py``): split ``s`` runs the same loop over its own range of key blocks,
BD still computed from the band of r rows of each tile, and writes a normalised partial
output and its lse (``-inf`` where it saw no key); ``kernels.attention``'s combine kernel
merges them into ``out`` and the final lse. The backward is the regular one, driven by the
combined lse. :func:`decode_splits` picks the split count (CUDA only) whenever the grid
is smaller than the GPU, for any number of queries (XL evaluation: 128 queries against
3,000+ keys in a few streams), with :func:`key_splits`.
"""
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (LOG2E, _bwd_delta_kernel, _combine_splits, _dot, _fold_scale, _has_tma,
                      _interpreting, _keep, _key_range, _mask_args, _new_output,
                      _online_softmax_step, _query_block, _seed_arg, _split_targets,
                      _tf32_allowed, _tile_rows, _visible, bh_chunks, bulk_add_args, cdiv,
                      check_deterministic, check_tma_mode, delta_blocks, flag_setting,
                      int32_addressable, next_pow2, row_tiles, tma_args)
from . import _tune
from ._launch import compiling_only, fast


@triton.jit
def _rel_scores(qu, rb, k, r, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] unscaled scores of a tile: ``(q + u)·kᵀ`` plus the position term
    over the band of r rows ``[2·BLOCK_N, BLOCK_D]``, ``(q + u)·rᵀ`` plus the band's row
    bias ``rb`` ``[2·BLOCK_N]`` (:func:`_rb_band`) as the forward forms it, shifted into
    place (:func:`_skewed`)."""
    ac = _dot(qu, tl.trans(k), UPCAST, PRECISION)
    qr = _dot(qu, tl.trans(r), UPCAST, PRECISION) + rb[None, :]       # [BLOCK_M, 2·BLOCK_N]
    lo, hi = _band_halves(qr, BLOCK_M, BLOCK_N)
    return ac + _skewed(lo, hi, _tile_skew(BLOCK_M, BLOCK_N), BLOCK_M, BLOCK_N)


@triton.jit
def _rb_rows(rb_base, row_start, BLOCK_R: tl.constexpr):
    """[BLOCK_R] fp32: ``(v − u)·r_m`` of rows ``m = row_start + [0, BLOCK_R)`` of r, from
    the launcher's table (:func:`row_bias_table`: zeros around r's rows, as far as a tile's
    band reaches past them, so no mask; those rows feed only masked pairs). As ``(q + v)·r_m = (q + u)·r_m + (v − u)·r_m``, the forward and dQ
    kernels hold one query operand, ``q + u``, for both terms and add this per-row vector
    to the ``(q + u)·rᵀ`` tile. Read from a table, not formed from the r tile in every
    program (sm_90 SASS of the bf16 D 64 forward's loop: 828 -> 648 instructions a tile,
    11 -> 8 barriers; the dQ kernel's 1,102 -> 996): the r tile stays in shared memory for
    its product alone."""
    return tl.load(rb_base + row_start + tl.arange(0, BLOCK_R))


@triton.jit
def _rb_band(rb_base, rows, R_len):
    """The row bias (:func:`_rb_rows`) of r's rows ``rows``, 0 outside ``[0, R_len)`` (a
    masked load: the backward kernels' bands need no pad of the table). The dK/dV and dR
    kernels recompute the position term as the forward formed it, ``(q + u)·r_m`` plus this,
    not as ``(q + v)·r_m``: at 16 bits ``q + u`` and ``q + v`` round differently, and P
    recomputed from the other rounding does not match the forward's lse (its rows do not
    sum to 1; dV and dK off by ~1e-2 relative at fp16)."""
    return tl.load(rb_base + rows, mask=(rows >= 0) & (rows < R_len), other=0.0)


@triton.jit
def _rb_tile(rb_base, RBD, h, row_start, BLOCK_R: tl.constexpr, RB_MMA: tl.constexpr):
    """The row bias of r's rows ``row_start + [0, BLOCK_R)``: the fp32 vector ``[BLOCK_R]``
    (:func:`_rb_rows`), or (RB_MMA) the ``[BLOCK_R, 16]`` bf16 tile of the launcher's split
    table that :func:`_rb_add` multiplies (:func:`row_bias_table`; column 0 the high half,
    column 1 the low, 2-15 zero: 16 more columns of r's rows, in effect), through the
    descriptor RBD of that table as ``[1, H, R, 16]`` (rows outside ``[0, R)`` read as 0, as
    the pad). The tile feeds a product, so the loop's TMA pipeline loads it stages ahead
    with k, v and r; the vector is loaded in the iteration that adds it, in the critical
    path of the position product."""
    if RB_MMA:
        x = RBD.load([0, h, row_start, 0]).reshape(BLOCK_R, 16)
    else:
        x = _rb_rows(rb_base, row_start, BLOCK_R)
    return x


@triton.jit
def _rb_add(qr, rb, UPCAST: tl.constexpr, PRECISION: tl.constexpr, RB_MMA: tl.constexpr,
            BLOCK_M: tl.constexpr):
    """``qr [BLOCK_M, BLOCK_R]`` plus the row bias ``rb`` of its columns (:func:`_rb_tile`):
    added as a vector, or (RB_MMA) as the product ``ones [BLOCK_M, 16] x rbᵀ [16, BLOCK_R]``
    with ones in columns 0 and 1 (its two halves summed in fp32 on the tensor cores: the row
    bias to ~2^-16 of its size, in bf16 whatever the call's dtype)."""
    if not RB_MMA:
        out = qr + rb[None, :]
    else:
        # (tl.where, not a bool's .to(bf16): Triton 3.9's interpreter makes that 0)
        ones = tl.where(tl.arange(0, 16) < 2, 1.0, 0.0).to(tl.bfloat16)
        ones = tl.broadcast_to(ones[None, :], [BLOCK_M, 16])
        out = qr + _dot(ones, tl.trans(rb), UPCAST, PRECISION)
    return out


@triton.jit
def _r_rows(r_base, rows, R_len, offs_d, d_ok, stride_rm, stride_rd):
    """Rows ``rows`` of r ``[len(rows), BLOCK_D]``, rows outside ``[0, R_len)`` clamped to
    it (they feed only pairs that are masked), columns from D on 0 (never read: past the
    last row they are past the tensor, and in a view they may be anything, NaN included)."""
    rows = tl.minimum(tl.maximum(rows, 0), R_len - 1)
    return tl.load(r_base + rows[:, None] * stride_rm + offs_d[None, :] * stride_rd,
                   mask=d_ok, other=0.0)


@triton.jit
def _r_tile(RD, r_base, h, row_start, R_len, offs_d, d_ok, stride_rm, stride_rd,
            BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """Rows ``row_start + [0, BLOCK_R)`` of r (head h), ``[BLOCK_R, BLOCK_D]``: through the
    descriptor RD of r as ``[1, H, R, D]`` when TMA (rows outside ``[0, R_len)`` read as
    0, as the clamped ones of :func:`_r_rows` they feed only masked pairs), else
    :func:`_r_rows`."""
    if TMA:
        x = RD.load([0, h, row_start, 0]).reshape(BLOCK_R, BLOCK_D)
    else:
        x = _r_rows(r_base, row_start + tl.arange(0, BLOCK_R), R_len, offs_d, d_ok,
                    stride_rm, stride_rd)
    return x


@triton.jit
def _key_tiles(KD, VD, RD, k_base, v_base, r_base, stride_kn, stride_kd, stride_vn, stride_vd,
               stride_rm, stride_rd, b, h, n0, offs_n, Tk, row0, R_len, offs_d, d_ok,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """(k, v, r) of the key tile at n0 in the forward's and dQ's loops: k and v rows
    ``offs_n`` (past Tk: 0), and the second chunk of its band of r, rows ``row0 + n0 +
    BLOCK_N + [0, BLOCK_N)`` (the first is the previous tile's second); through the
    descriptors when TMA."""
    k = _tile_rows(KD, k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                   b, h, n0, offs_n, Tk, d_ok, True, False, BLOCK_N, BLOCK_D, TMA)
    v = _tile_rows(VD, v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                   b, h, n0, offs_n, Tk, d_ok, True, False, BLOCK_N, BLOCK_D, TMA)
    r = _r_tile(RD, r_base, h, row0 + n0 + BLOCK_N, R_len, offs_d, d_ok, stride_rm, stride_rd,
                BLOCK_N, BLOCK_D, TMA)
    return k, v, r


@triton.jit
def _rotate(x, sig, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[ii, jj] = x[ii, (jj + sig[ii]) mod BLOCK_N]``: row ii of ``x [BLOCK_M, BLOCK_N]``
    rotated left by ``sig [BLOCK_M]`` (int32, >= 0). The skew of every rel_attention tile.

    Same as ``tl.gather(x, (jj + sig) mod BLOCK_N, 1)``, at half its cost in shuffles on a
    GPU. A gather gives each output element one shuffle per source column a lane holds
    (Triton lays the source out with a row across the 32 lanes of a warp): two shuffles and
    two selects an element for 64 columns. Here the even and odd columns are split apart
    first; output column 2t + p reads source column 2t + p + sig, whose parity is p's
    when sig is even and the other one when it is odd. So each output half gathers from one
    half, chosen per row, of BLOCK_N / 2 columns: one shuffle an element, no select (sm_90
    SASS of the bf16 D 64 forward's loop: 72 -> 40 shuffles a tile, 776 -> 684
    instructions)."""
    if BLOCK_N <= 32:   # a lane per column already
        jj = tl.arange(0, BLOCK_N)
        return tl.gather(x, (jj[None, :] + sig[:, None]) & (BLOCK_N - 1), 1)
    HALF: tl.constexpr = BLOCK_N // 2
    t = tl.arange(0, HALF)[None, :]
    a = (sig >> 1)[:, None]
    odd = (sig & 1)[:, None]
    even_cols, odd_cols = tl.split(tl.reshape(x, [BLOCK_M, HALF, 2]))   # [BLOCK_M, HALF]
    out_e = tl.gather(tl.where(odd == 1, odd_cols, even_cols), (t + a) & (HALF - 1), 1)
    out_o = tl.gather(tl.where(odd == 1, even_cols, odd_cols), (t + a + odd) & (HALF - 1), 1)
    return tl.reshape(tl.join(out_e, out_o), [BLOCK_M, BLOCK_N])


@triton.jit
def _tile_skew(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M] int32: the rotation (:func:`_rotate`) that puts a chunk of BLOCK_N band
    columns in place, ``(BLOCK_M − 1 − ii) mod BLOCK_N``: pair (ii, jj) reads band column
    ``jj + BLOCK_M − 1 − ii``, column ``(jj + BLOCK_M − 1 − ii) mod BLOCK_N`` of its chunk."""
    return (BLOCK_M - 1 - tl.arange(0, BLOCK_M)) & (BLOCK_N - 1)


@triton.jit
def _band_halves(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, hi) ``[BLOCK_M, BLOCK_N]`` each: columns ``[0, BLOCK_N)`` and ``[BLOCK_N,
    2·BLOCK_N)`` of a band ``x [BLOCK_M, 2·BLOCK_N]`` (a register relabelling on the MMA
    layout, where the top column bit is a register bit)."""
    return tl.split(tl.permute(tl.reshape(x, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))


@triton.jit
def _skewed(lo, hi, sig, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[ii, jj]`` = column ``jj + σ_ii`` of the two-chunk band ``[lo, hi]`` (each
    ``[BLOCK_M, BLOCK_N]``), ``σ = sig mod BLOCK_N`` (``sig`` may carry a multiple of
    2·BLOCK_N). Column ``c = (jj + σ) mod BLOCK_N`` of hi where ``jj + σ >= BLOCK_N``, which
    is where ``c < σ``, else of lo: so the chunk is chosen on the source side, and one
    rotation (:func:`_rotate`) places both. Needs BLOCK_M <= BLOCK_N (every tile of
    :func:`_config`): row ii's shift is BLOCK_M − 1 − ii (or ii) < BLOCK_N."""
    tl.static_assert(BLOCK_M <= BLOCK_N)
    jj = tl.arange(0, BLOCK_N)
    src = tl.where(jj[None, :] < (sig & (BLOCK_N - 1))[:, None], hi, lo)
    return _rotate(src, sig, BLOCK_M, BLOCK_N)


@triton.jit
def _rel_scores_chunked(qu, rb_new, k, r_new, prev, sig,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr, CARRY: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RB_MMA: tl.constexpr):
    """(scores [BLOCK_M, BLOCK_N], the value to carry to the next tile) of a tile of a loop
    over key blocks with the query block fixed (forward, dQ). Key block ``n`` reads the band
    of r rows ``row0 + n + [0, 2·BLOCK_N)``: chunks ``t = n / BLOCK_N`` and ``t + 1``; the
    next key block reads chunks ``t + 1`` and ``t + 2``. So each tile multiplies ``(q + v)``
    by one new chunk ``r_new`` (``[BLOCK_N, BLOCK_D]``, chunk t + 1; ``rb_new`` its rows'
    row bias, :func:`_rb_tile`) and keeps the product
    for the next: the position term costs one ``[BLOCK_M, BLOCK_N]`` product per tile, as
    the content term does, not a band twice as wide. Pair (ii, jj) reads band column
    ``jj + sig_ii`` (``sig``: :func:`_tile_skew`, plus any multiple of 2·BLOCK_N).

    CARRY False: ``prev`` is the previous chunk's product; the two are placed by one
    rotation (:func:`_skewed`). CARRY True: the skew is the same in every tile, so ``prev``
    is the previous tile's *rotated* product, and the tile rotates only the new chunk and
    takes each pair from one of the two. Both cost one rotation a tile; :func:`_carry`
    chooses (on for 16-bit 64 x 64 tiles on a GPU, where the H200 timed it right and
    faster when each tile gathered both chunks without it)."""
    ac = _dot(qu, tl.trans(k), UPCAST, PRECISION)
    qr_new = _rb_add(_dot(qu, tl.trans(r_new), UPCAST, PRECISION), rb_new, UPCAST, PRECISION,
                     RB_MMA, BLOCK_M)
    if CARRY:
        pos_new = _rotate(qr_new, sig, BLOCK_M, BLOCK_N)
        hi = ((tl.arange(0, BLOCK_N)[None, :] + sig[:, None]) & BLOCK_N) != 0
        return ac + tl.where(hi, pos_new, prev), pos_new
    return ac + _skewed(prev, qr_new, sig, BLOCK_M, BLOCK_N), qr_new


@triton.jit
def _first_chunk(qu, rb_first, r_first, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                 CARRY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 RB_MMA: tl.constexpr):
    """The carried value of a loop's first tile (see :func:`_rel_scores_chunked`): ``(q +
    v)·chunkᵀ`` of the first chunk of its band (row bias ``rb_first``), rotated with the
    tiles' skew if CARRY."""
    qr = _rb_add(_dot(qu, tl.trans(r_first), UPCAST, PRECISION), rb_first, UPCAST, PRECISION,
                 RB_MMA, BLOCK_M)
    if CARRY:
        return _rotate(qr, _tile_skew(BLOCK_M, BLOCK_N), BLOCK_M, BLOCK_N)
    return qr


@triton.jit
def _seg_term(seg_q, seg_k, ef_same, ef_diff):
    """(segment term [BLOCK_M, BLOCK_N], same [BLOCK_M, BLOCK_N] bool): XLNet's relative
    segment encoding, ``(q + r_s_bias)·seg_embed[same ? 0 : 1]`` from its per-row values."""
    same = seg_q[:, None] == seg_k[None, :]
    return tl.where(same, ef_same[:, None], ef_diff[:, None]), same


@triton.jit
def _seg_rows(q, RSB, SEG_E, h, H, D, offs_d):
    """(ef_same, ef_diff) [BLOCK_M] fp32: each query row's two segment terms
    ``(q + r_s_bias)·seg_embed[0 | 1]`` (q an fp32 ``[BLOCK_M, BLOCK_D]`` tile; RSB
    ``[H, D]``, SEG_E ``[2, H, D]`` contiguous), the values :func:`_seg_term` places."""
    d_ok = offs_d < D
    qs = q + tl.load(RSB + h * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    se0 = tl.load(SEG_E + h * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    se1 = tl.load(SEG_E + (H + h) * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    return tl.sum(qs * se0[None, :], 1), tl.sum(qs * se1[None, :], 1)


@triton.jit
def _rel_visible(offs_m, offs_n, b, Tq, Tk, mem_len, window,
                 KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q,
                 CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
                 PERM_STRICT: tl.constexpr, WINDOW: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: the visibility of a tile, ``kernels._common._visible``
    and the sliding window (distance ``mem_len + i − j < window``)."""
    vis = _visible(offs_m, offs_n, b, Tq, Tk, mem_len, KPM, stride_kpm_b, stride_kpm_n,
                   RANK, stride_rank_b, stride_rank_t, rank_q,
                   CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT)
    if WINDOW:
        vis = vis & ((mem_len + offs_m[:, None] - offs_n[None, :]) < window)
    return vis


@triton.jit
def _interior_keys(m0, Tk, mem_len, window, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
                   HAS_PERM: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """(a, b): the key blocks ``[a, b)`` that every query of the block at m0 sees, inside
    the keys (``n + BLOCK_N <= Tk``), below the causal diagonal of its first row
    (``n + BLOCK_N − 1 <= m0 + mem_len``) and within the window of its last row
    (``n >= mem_len + m0 + BLOCK_M − window``). Padding and permutations are per element:
    no interior then. Rows past Tq need no mask (never stored; lse +inf in the backward)."""
    a = 0
    b = Tk // BLOCK_N * BLOCK_N
    if CAUSAL:
        b = tl.minimum(b, tl.maximum(m0 + mem_len + 1, 0) // BLOCK_N * BLOCK_N)
    if WINDOW:
        a = tl.cdiv(tl.maximum(mem_len + m0 + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N
    if HAS_KPM or HAS_PERM:
        b = 0
    return a, b


@triton.jit
def _interior_queries(n0, Tq, mem_len, window, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
                      HAS_PERM: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """(a, b): the query blocks ``[a, b)`` that see every key of the block at n0: past the
    causal diagonal of its last key (``m >= n0 + BLOCK_N − 1 − mem_len``) and with its last
    row within the window of its first key (``m + BLOCK_M − 1 < n0 − mem_len + window``).
    Keys past Tk need no mask (their dK, dV rows are not stored; the dQ and dR kernels mask
    them themselves)."""
    a = 0
    b = Tq + BLOCK_M
    if CAUSAL:
        a = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - mem_len, 0), BLOCK_M) * BLOCK_M
    if WINDOW:
        b = tl.cdiv(tl.maximum(window + n0 - mem_len - BLOCK_M + 1, 0), BLOCK_M) * BLOCK_M
    if HAS_KPM or HAS_PERM:
        b = 0
    return a, b


@triton.jit
def _rel_fwd_inner(
    m_i, l_i, acc, start, end,      # running max, normaliser, output; key range [start, end)
    pos_prev,                       # (q + v)·(rows row0 + start + [0, BLOCK_N) of r)ᵀ
                                    # (gathered if CARRY: _rel_scores_chunked)
    qu, rb_base, RBD, seg_q, ef_same, ef_diff, offs_m, offs_d, d_ok,
    k_base, v_base, r_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_rm, stride_rd,
    row0, R_len, SEG_K, stride_sk_b, b, bh, Tq, Tk, mem_len, window,
    KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q,
    seed, qk_scale, p_drop,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    WINDOW: tl.constexpr,
    MASKED: tl.constexpr,           # False: interior tiles, every pair visible, no mask work
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BAND: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, CARRY: tl.constexpr,
    KD, VD, RD, h, BLOCK_D: tl.constexpr, TMA: tl.constexpr,    # TMA: tiles via KD, VD, RD
    FOLD: tl.constexpr,             # qk_scale > 0 applied in the softmax step's FMA
    RB_MMA: tl.constexpr,           # the row bias as a product (_rb_tile)
):
    """The forward's loop over the key blocks ``[start, end)`` of one query block (as the
    fused-attention tutorial's ``_attn_fwd_inner``): returns (m_i, l_i, acc, pos_prev),
    the last for the next loop over the following key blocks."""
    jj = tl.arange(0, BLOCK_N)
    sig = _tile_skew(BLOCK_M, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + jj
        k, v, r = _key_tiles(KD, VD, RD, k_base, v_base, r_base, stride_kn, stride_kd,
                             stride_vn, stride_vd, stride_rm, stride_rd, b, h, start_n, offs_n,
                             Tk, row0, R_len, offs_d, d_ok, BLOCK_N, BLOCK_D, TMA)
        rb = _rb_tile(rb_base, RBD, h, row0 + start_n + BLOCK_N, BLOCK_N,
                      RB_MMA)                                              # r's rows
        s, pos_prev = _rel_scores_chunked(qu, rb, k, r, pos_prev, sig,
                                          UPCAST, PRECISION, CARRY, BLOCK_M, BLOCK_N, RB_MMA)
        if HAS_SEG:
            seg_k = tl.load(SEG_K + b * stride_sk_b + offs_n, mask=offs_n < Tk, other=-2)
            s += _seg_term(seg_q, seg_k, ef_same, ef_diff)[0]
        if not FOLD:
            s = s * qk_scale
        if MASKED:
            s = tl.where(_rel_visible(offs_m, offs_n, b, Tq, Tk, mem_len, window,
                                      KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b,
                                      stride_rank_t, rank_q,
                                      CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, WINDOW),
                         s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, seed, bh, offs_m, offs_n,
                                             Tq, Tk, p_drop, qk_scale, DROPOUT, UPCAST,
                                             PRECISION, False, FOLD)
    return m_i, l_i, acc, pos_prev


@triton.jit
def _rel_attn_fwd_kernel(
    Q, K, V,        # q [B, H, Tq, D]; k, v [B, H, Tk, D]; any strides
    R,              # r [H, R, D], any strides
    U,              # r_w_bias [H, D] contiguous
    RB, stride_rbh,     # (r_r_bias − r_w_bias)·r_m [H, R] fp32, padded (row_bias_table)
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
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    WINDOW: tl.constexpr,
    SPLIT_K: tl.constexpr,  # decoding: program_id(2) owns one range of keys; partial out
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BAND: tl.constexpr,     # power of two >= BLOCK_M + BLOCK_N - 1
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    CARRY: tl.constexpr = False,    # the gathered first chunk carried (_rel_scores_chunked)
    KD=None, VD=None, RD=None,      # TMA: RowTiles of k, v ([1, 1, BLOCK_N, BLOCK_D] tiles)
                                    # and of r as [1, H, R, D]
    TMA: tl.constexpr = False,      # key and r tiles through KD, VD, RD
    FOLD: tl.constexpr = False,     # qk_scale > 0, applied in the softmax step's FMA
    RBD=None,                       # RB_MMA: RowTiles of the split table, [1, H, R, 16]
    RB_MMA: tl.constexpr = False,   # the row bias as a product from RBD (_rb_tile, _rb_add)
):
    pid_m = _query_block(tl.program_id(0), CAUSAL)
    bh = tl.program_id(1) + BH0
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
    qu = (q + u[None, :]).to(K.dtype.element_ty)     # (q + u): both terms (_rb_rows)
    rb_base = RB + h * stride_rbh
    seg_q = offs_m                                    # placeholders unless HAS_SEG
    ef_same = tl.zeros([BLOCK_M], dtype=tl.float32)
    ef_diff = ef_same
    if HAS_SEG:     # [BLOCK_M] each: the segment term, same / different segments
        ef_same, ef_diff = _seg_rows(q, RSB, SEG_E, h, H, D, offs_d)
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

    c = pos_start - mem_len
    in_lo, in_hi = _interior_keys(m0, Tk, mem_len, window, CAUSAL, HAS_KPM, HAS_PERM, WINDOW,
                                  BLOCK_M, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    r_base = R + h * stride_rh
    row0 = c - m0 - BLOCK_M + 1          # first row of r in the band of key block 0
    # the first chunk of the first tile's band (the loops carry it on)
    r_first = _r_tile(RD, r_base, h, row0 + lo, R_len, offs_d, d_ok, stride_rm, stride_rd,
                      BLOCK_N, BLOCK_D, TMA)
    pos_prev = _first_chunk(qu, _rb_tile(rb_base, RBD, h, row0 + lo, BLOCK_N,
                                         RB_MMA), r_first,
                            UPCAST, PRECISION, CARRY, BLOCK_M, BLOCK_N, RB_MMA)
    if HAS_KPM or HAS_PERM:              # per-element masks: every tile is a boundary tile
        m_i, l_i, acc, pos_prev = _rel_fwd_inner(
            m_i, l_i, acc, lo, hi, pos_prev, qu, rb_base, RBD, seg_q, ef_same,
            ef_diff, offs_m, offs_d, d_ok,
            k_base, v_base, r_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_rm,
            stride_rd, row0, R_len, SEG_K, stride_sk_b, b, bh, Tq, Tk, mem_len, window,
            KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q,
            seed, qk_scale, p_drop, CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, HAS_SEG, DROPOUT,
            WINDOW, True, BLOCK_M, BLOCK_N, BAND, UPCAST, PRECISION, CARRY, KD, VD, RD, h,
            BLOCK_D, TMA, FOLD, RB_MMA)
    else:   # boundary tiles before the interior, the interior (no mask work), the rest
        in_lo = tl.minimum(tl.maximum(in_lo, lo), hi)
        in_hi = tl.minimum(tl.maximum(in_hi, in_lo), hi)
        m_i, l_i, acc, pos_prev = _rel_fwd_inner(
            m_i, l_i, acc, lo, in_lo, pos_prev, qu, rb_base, RBD, seg_q, ef_same,
            ef_diff, offs_m, offs_d, d_ok,
            k_base, v_base, r_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_rm,
            stride_rd, row0, R_len, SEG_K, stride_sk_b, b, bh, Tq, Tk, mem_len, window,
            KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q,
            seed, qk_scale, p_drop, CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, HAS_SEG, DROPOUT,
            WINDOW, True, BLOCK_M, BLOCK_N, BAND, UPCAST, PRECISION, CARRY, KD, VD, RD, h,
            BLOCK_D, TMA, FOLD, RB_MMA)
        m_i, l_i, acc, pos_prev = _rel_fwd_inner(
            m_i, l_i, acc, in_lo, in_hi, pos_prev, qu, rb_base, RBD, seg_q, ef_same,
            ef_diff, offs_m, offs_d, d_ok,
            k_base, v_base, r_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_rm,
            stride_rd, row0, R_len, SEG_K, stride_sk_b, b, bh, Tq, Tk, mem_len, window,
            KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q,
            seed, qk_scale, p_drop, CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, HAS_SEG, DROPOUT,
            WINDOW, False, BLOCK_M, BLOCK_N, BAND, UPCAST, PRECISION, CARRY, KD, VD, RD, h,
            BLOCK_D, TMA, FOLD, RB_MMA)
        m_i, l_i, acc, pos_prev = _rel_fwd_inner(
            m_i, l_i, acc, in_hi, hi, pos_prev, qu, rb_base, RBD, seg_q, ef_same,
            ef_diff, offs_m, offs_d, d_ok,
            k_base, v_base, r_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_rm,
            stride_rd, row0, R_len, SEG_K, stride_sk_b, b, bh, Tq, Tk, mem_len, window,
            KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q,
            seed, qk_scale, p_drop, CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, HAS_SEG, DROPOUT,
            WINDOW, True, BLOCK_M, BLOCK_N, BAND, UPCAST, PRECISION, CARRY, KD, VD, RD, h,
            BLOCK_D, TMA, FOLD, RB_MMA)

    has_key = l_i != 0      # 0: no key seen; NaN (from the inputs) goes on into out and lse
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
def _query_range(b, n0, Tq, mem_len, window, KV_END, CAUSAL: tl.constexpr,
                 HAS_KPM: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """[lo, hi): the queries (lo a multiple of BLOCK_M) that may see a key of the block at
    n0 of batch b: from the causal diagonal's, none if the block is all padding (KV_END),
    before the window's end (the dK/dV kernel's and _rel_dkdv_gemm_kernel's loops)."""
    lo = 0
    if CAUSAL:
        lo = tl.maximum(n0 - mem_len, 0) // BLOCK_M * BLOCK_M
    hi = Tq
    if HAS_KPM:
        hi = tl.where(n0 < tl.load(KV_END + b), Tq, 0)
    if WINDOW:      # queries i < j - mem_len + window see key j
        hi = tl.minimum(hi, tl.maximum(n0 + BLOCK_N - 1 - mem_len + window, 0))
    return lo, hi


@triton.jit
def _rel_attn_bwd_dkdv_kernel(
    K, V, DO,       # k, v [B, H, Tk, D]; do [B, H, Tq, D]; any strides
    QU,             # q + r_w_bias [B, H, Tq, D] contiguous, in k's dtype
                    # (:func:`_rel_bwd_prep_kernel`; q itself is not read: its strides
                    # below are the launches' shared arguments)
    R,              # r [H, R, D], any strides
    RB, stride_rbh,     # (r_r_bias − r_w_bias)·r_m [H, R] fp32 (row_bias_table)
    SEG_Q, SEG_K,   # as in the forward
    EF,             # [B, H, Tq, 2] fp32 contiguous (HAS_SEG): each row's segment terms
                    # (q + r_s_bias)·seg_embed[0 | 1] (:func:`_rel_bwd_prep_kernel`)
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
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BAND: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    HALVES: tl.constexpr = False,   # the band of r in two chunks (see HALVES_MIN_BLOCK)
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1) + BH0
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
    if HAS_SEG:
        seg_k = tl.load(SEG_K + b * stride_sk_b + offs_n, mask=offs_n < Tk, other=-2)

    lo, hi = _query_range(b, n0, Tq, mem_len, window, KV_END, CAUSAL, HAS_KPM, WINDOW,
                          BLOCK_M, BLOCK_N)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    ii = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, BLOCK_N)
    band = tl.arange(0, BAND)
    c = pos_start - mem_len
    r_base = R + h * stride_rh
    rb_base = RB + h * stride_rbh

    in_lo, in_hi = _interior_queries(n0, Tq, mem_len, window, CAUSAL, HAS_KPM, HAS_PERM,
                                     WINDOW, BLOCK_M, BLOCK_N)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + ii
        q_mask = (offs_m[:, None] < Tq) & d_ok
        q_off = (bh * Tq + offs_m[:, None]) * D + offs_d[None, :]
        qu = tl.load(QU + q_off, mask=q_mask, other=0.0)
        do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                     + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
        lse = tl.load(LSE + bh * Tq + offs_m, mask=offs_m < Tq, other=float("inf"))
        delta = tl.load(DELTA + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)
        rank_q = offs_m
        if HAS_PERM:
            rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t,
                             mask=offs_m < Tq, other=0)
        row0 = c - m0 - BLOCK_M + 1 + n0                  # first row of the tile's band
        if HALVES:          # the band's two chunks one after the other
            # each pair's chunk chosen before one rotation places both (_skewed): sm_90
            # SASS, bf16 D 64, 128 -> 32 shuffles and 940 -> 782 instructions a tile
            r = _r_rows(r_base, row0 + jj, R_len, offs_d, d_ok, stride_rm, stride_rd)
            pos_lo = _dot(qu, tl.trans(r), UPCAST, PRECISION) \
                + _rb_band(rb_base, row0 + jj, R_len)[None, :]
            r = _r_rows(r_base, row0 + BLOCK_N + jj, R_len, offs_d, d_ok, stride_rm, stride_rd)
            pos_hi = _dot(qu, tl.trans(r), UPCAST, PRECISION) \
                + _rb_band(rb_base, row0 + BLOCK_N + jj, R_len)[None, :]
            pos = _skewed(pos_lo, pos_hi, _tile_skew(BLOCK_M, BLOCK_N), BLOCK_M, BLOCK_N)
            s = _dot(qu, tl.trans(k), UPCAST, PRECISION) + pos
        else:               # the whole band at once
            r = _r_rows(r_base, row0 + band, R_len, offs_d, d_ok, stride_rm, stride_rd)
            s = _rel_scores(qu, _rb_band(rb_base, row0 + band, R_len), k, r, UPCAST,
                            PRECISION, BLOCK_M, BLOCK_N)
        if HAS_SEG:
            seg_q = tl.load(SEG_Q + b * stride_sq_b + offs_m, mask=offs_m < Tq, other=-1)
            ef = EF + (bh * Tq + offs_m) * 2
            s += _seg_term(seg_q, seg_k, tl.load(ef, mask=offs_m < Tq, other=0.0),
                           tl.load(ef + 1, mask=offs_m < Tq, other=0.0))[0]
        p = tl.exp2(s * qk_scale - lse[:, None])
        if (m0 < in_lo) | (m0 >= in_hi):                                 # boundary tile
            p = tl.where(_rel_visible(offs_m, offs_n, b, Tq, Tk, mem_len, window,
                                      KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b,
                                      stride_rank_t, rank_q,
                                      CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, WINDOW),
                         p, 0.0)
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
def _rel_bwd_dq_inner(
    dqu, dqw, a_diff, p_diff, ds_all,   # running d(q + u), d(q + v) (unscaled), segment sums
    pos_prev, ds_prev, r_row,           # carried from tile to tile (see below)
    start, end,                         # key range [start, end)
    in_lo, in_hi,                       # the interior key blocks (MASKED == 2)
    qu, wu, rb_base, do, lse, delta, seg_q, ef_same, ef_diff, offs_m, offs_d, d_ok,
    k_base, v_base, r_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_rm, stride_rd,
    row0, R_len, SEG_K, stride_sk_b, b, bh, Tq, Tk, mem_len, window,
    KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q,
    seed, qk_scale, p_drop,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    WINDOW: tl.constexpr,
    MASKED: tl.constexpr,           # 0: interior tiles (no mask work); 1: every tile masked;
                                    # 2: masked where outside [in_lo, in_hi) (a runtime test)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    dr_base, D,                     # ATOMIC_DR: dr accumulator rows of this head, row stride D
                                    # (2: the accumulator's descriptor, bulk reductions; 3:
                                    # this (b, h)'s [Tq, Tk] plane of the dS buffer)
    ATOMIC_DR: tl.constexpr, CARRY: tl.constexpr,
    KD, VD, RD, h, BLOCK_D: tl.constexpr, TMA: tl.constexpr,    # TMA: tiles via KD, VD, RD
    p_off, STORE_P: tl.constexpr,   # ATOMIC_DR 3: also P (dropped out) at dr_base + p_off
):
    """The dQ kernel's loop over the key blocks ``[start, end)`` of one query block.
    Returns the two accumulators, the segment sums and the three carried values.

    Tile ``n`` reads the band of r rows ``row0 + n + [0, 2·BLOCK_N)``: two chunks, the
    second of which is the next tile's first. So the scores take one new chunk per tile
    (:func:`_rel_scores_chunked`, carrying ``pos_prev``). Its dS band ``dS_band[ii, jj +
    BLOCK_M − 1 − ii] = dS[ii, jj]`` splits the same way into ``dS_lo`` (on the first
    chunk) and ``dS_hi`` (on the second), so ``d(q + v) += (dS_lo + dS_hi of the previous
    tile) · chunk``: one ``[BLOCK_M, BLOCK_N] x [BLOCK_N, BLOCK_D]`` product per tile on
    the chunk both use (first row ``r_row`` = ``row0 + n``), ``ds_prev`` the previous
    tile's ``dS_hi``; the kernel adds the last one after its last loop. ATOMIC_DR: also
    adds the chunk's rows of dr (:func:`_rel_dr_atomic`; the dR kernel's work, from the dS
    this loop forms anyway). ATOMIC_DR 3 (DR_MODE "gemm"): stores dS at dr_base instead,
    and forms neither ``d(q + v)`` nor dr (the GEMMs over the stored dS do).

    The kernel runs this once, with the runtime boundary test (MASKED 2) or every tile
    masked (MASKED 1, padding or a permutation). Not as the forward's three loops (boundary,
    interior, boundary): carrying the chunk through three inlined loops spilled 120-1,200 B
    per thread on sm_90 at fp32 where one loop spills 0-520 (benchmarks/NOTES.md)."""
    ii = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + jj
        # The skew's index tensors, formed in every tile on purpose: hoisted out of the loop
        # (as the compiler does with loop-invariant ones) they stay live through it, and
        # the 64 x 64 bf16 tiles spilled 196 B per thread on sm_90 instead of 96 (with the
        # rotations, 472-580 B instead of 168-188 and 123 spill reloads a tile instead of
        # 34, for 1,413 instructions a tile instead of 1,600, Triton 3.6). `t2` (a multiple
        # of 2·BLOCK_N) only keeps them in the loop. Pair (ii, jj) reads column ``jj +
        # BLOCK_M − 1 − ii`` of the two-chunk band (sig); chunk column cc of row ii holds
        # pair ``cc − (BLOCK_M − 1 − ii)`` of the first chunk (dS_lo, where that is >= 0:
        # unskew_lo) or that plus BLOCK_N of the second (dS_hi): the rotation by
        # ``BLOCK_N − BLOCK_M + 1 + ii``.
        t2 = 2 * (n0 - start)
        sig = (BLOCK_M - 1 - ii) + t2                       # the skew, _rel_scores_chunked
        unskew = jj[None, :] - (BLOCK_M - 1 - ii[:, None]) + BLOCK_N + t2
        unskew_lo = (unskew & BLOCK_N) != 0
        k, v, r = _key_tiles(KD, VD, RD, k_base, v_base, r_base, stride_kn, stride_kd,
                             stride_vn, stride_vd, stride_rm, stride_rd, b, h, n0, offs_n,
                             Tk, row0, R_len, offs_d, d_ok, BLOCK_N, BLOCK_D, TMA)
        rb = _rb_rows(rb_base, row0 + n0 + BLOCK_N, BLOCK_N)             # r's rows
        s, pos_prev = _rel_scores_chunked(qu, rb, k, r, pos_prev, sig,
                                          UPCAST, PRECISION, CARRY, BLOCK_M, BLOCK_N, False)
        if HAS_SEG:
            seg_k = tl.load(SEG_K + b * stride_sk_b + offs_n, mask=offs_n < Tk, other=-2)
            seg_s, same = _seg_term(seg_q, seg_k, ef_same, ef_diff)
            s += seg_s
        p = tl.exp2(s * qk_scale - lse[:, None])
        if MASKED == 1:                                                # boundary tiles
            p = tl.where(_rel_visible(offs_m, offs_n, b, Tq, Tk, mem_len, window,
                                      KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b,
                                      stride_rank_t, rank_q,
                                      CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, WINDOW),
                         p, 0.0)
        elif MASKED == 2:                                              # decided per tile
            if (n0 < in_lo) | (n0 >= in_hi):
                p = tl.where(_rel_visible(offs_m, offs_n, b, Tq, Tk, mem_len, window,
                                          KPM, stride_kpm_b, stride_kpm_n, RANK,
                                          stride_rank_b, stride_rank_t, rank_q,
                                          CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, WINDOW),
                             p, 0.0)
        dp = _dot(do, tl.trans(v), UPCAST, PRECISION)
        if DROPOUT:
            keep = _keep(seed, bh, offs_m, offs_n, Tq, Tk, p_drop)
            dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
        ds = p * (dp - delta[:, None])                                # [BLOCK_M, BLOCK_N]
        if ATOMIC_DR == 3:      # DR_MODE "gemm": dS itself, [B, H, Tq, Tk] at dr_base's plane
            pair_off = offs_m[:, None].to(tl.int64) * Tk + offs_n[None, :]
            pair_ok = (offs_m < Tq)[:, None] & (offs_n < Tk)[None, :]
            tl.store(dr_base + pair_off, ds.to(dr_base.dtype.element_ty), mask=pair_ok)
            if STORE_P:         # "stored": and P as dV takes it (with dropout's keep)
                if DROPOUT:
                    p_v = tl.where(keep, p / (1.0 - p_drop), 0.0)
                else:
                    p_v = p
                tl.store(dr_base + p_off + pair_off, p_v.to(dr_base.dtype.element_ty),
                         mask=pair_ok)
        dqu += _dot(ds.to(k.dtype), k, UPCAST, PRECISION)
        if ATOMIC_DR != 3:      # (3: d(q + v) and dr by the GEMMs over the stored dS)
            ds_chunks = _rotate(ds, BLOCK_N - BLOCK_M + 1 + ii + t2, BLOCK_M, BLOCK_N)
            ds_first = tl.where(unskew_lo, ds_chunks, 0.0) + ds_prev  # dS on chunk r_row
            r_first = _r_tile(RD, r_base, h, r_row, R_len, offs_d, d_ok, stride_rm,
                              stride_rd, BLOCK_N, BLOCK_D, TMA)
            dqw += _dot(ds_first.to(r.dtype), r_first, UPCAST, PRECISION)
            if ATOMIC_DR:
                _rel_dr_atomic(dr_base, r_row, ds_first, qu, wu, R_len, D, offs_d, d_ok,
                               UPCAST, PRECISION, h, ATOMIC_DR)
            ds_prev = tl.where(unskew_lo, 0.0, ds_chunks)
            r_row = r_row + BLOCK_N
        if HAS_SEG:
            a_diff += tl.sum(tl.where(same, 0.0, ds), 1)
            p_diff += tl.sum(tl.where(same, 0.0, p), 1)
            ds_all += tl.sum(ds, 1)
    return dqu, dqw, a_diff, p_diff, ds_all, pos_prev, ds_prev, r_row


@triton.jit
def _rel_dr_atomic(dr_base, r_row, ds_chunk, qu, wu, R_len, D, offs_d, d_ok,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, h, ATOMIC_DR: tl.constexpr):
    """ATOMIC_DR: add ``ds_chunkᵀ (q + v)`` (``[BLOCK_N, BLOCK_D]``, unscaled; as ``ds_chunkᵀ
    (q + u)`` plus the column sums times ``v − u``) into rows
    ``r_row + [0, BLOCK_N)`` of head h's fp32 dr accumulator: ATOMIC_DR 1, element-wise at
    dr_base (that head's rows, row stride D); 2, the whole tile in one TMA bulk reduction
    through dr_base, the ``[1, H, R, D]`` accumulator's descriptor (rows outside [0, R) and
    columns past D are dropped by TMA)."""
    rows = r_row + tl.arange(0, ds_chunk.shape[1])
    diag = tl.sum(ds_chunk, 0)                               # [BLOCK_N]: Σ_i dS per row of r
    part = _dot(tl.trans(ds_chunk).to(qu.dtype), qu, UPCAST, PRECISION) \
        + diag[:, None] * wu[None, :]                        # dSᵀ (q + v)
    if ATOMIC_DR == 2:
        dr_base.atomic_add([0, h, r_row, 0], part.reshape(1, 1, part.shape[0], part.shape[1]))
    else:
        # relaxed: nothing reads dr before the kernel ends (acq_rel, the default, would order
        # each add against the thread's other memory operations: atom.acq_rel, not red)
        tl.atomic_add(dr_base + rows[:, None].to(tl.int64) * D + offs_d[None, :], part,
                      mask=((rows >= 0) & (rows < R_len))[:, None] & d_ok, sem="relaxed")


@triton.jit
def _rel_attn_bwd_dq_kernel(
    Q, K, V, DO,    # q, do [B, H, Tq, D]; k, v [B, H, Tk, D]; any strides
    R, U, W,        # r [H, R, D], any strides; r_w_bias, r_r_bias [H, D] contiguous
    SEG_Q, SEG_K, SEG_E, RSB, LSE, DELTA,   # as in the dK/dV kernel
    RB, stride_rbh,     # (r_r_bias − r_w_bias)·r_m [H, R] fp32, padded (row_bias_table)
    DQ,             # [B, H, Tq, D] contiguous: dq without the segment term, written (in
                    # q's dtype, or fp32 where the launcher adds the segment term)
    DBIAS,          # [B, H, 2, ⌈Tq / BLOCK_M⌉, D] fp32, written: the query block's shares of
                    # d(r_w_bias) = Σ_i d(q + u)_i and d(r_r_bias) = Σ_i d(q + v)_i
    SEG_A,          # [B, H, Tq, 2] fp32: Σ_j dS_ij over same / different segments (HAS_SEG)
    DR_ACC,         # ATOMIC_DR: dr accumulator [H, R, D] fp32 contiguous, zeroed, added to
                    # (DR_GEMM: the dS buffer [B, H, Tq, Tk] contiguous, in k's dtype)
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
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BAND: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ATOMIC_DR: tl.constexpr = False,
    CARRY: tl.constexpr = False,    # the gathered first chunk carried (_rel_scores_chunked)
    KD=None, VD=None, RD=None,      # TMA: RowTiles of k, v ([1, 1, BLOCK_N, BLOCK_D] tiles)
                                    # and of r as [1, H, R, D]
    TMA: tl.constexpr = False,      # key and r tiles through KD, VD, RD
    DRD=None,       # DR_BULK: RowTiles of DR_ACC as [1, H, R, D] ([1, 1, BLOCK_N, BLOCK_D])
    DR_BULK: tl.constexpr = False,  # ATOMIC_DR by TMA bulk reductions of whole tiles
    DR_GEMM: tl.constexpr = False,  # with ATOMIC_DR (DR_MODE "gemm"): dS stored in DR_ACC
                                    # and each query block's key range in DS_SPAN; dq gets
                                    # d(q + u) only (DQ fp32), its d(q + v) term, that
                                    # term's DBIAS share and dr come from the GEMMs over dS
    DS_SPAN=None,   # DR_GEMM: [B·H, ⌈Tq / BLOCK_M⌉, 2] int32, written: [lo, hi) of the keys
                    # whose dS the block stored (whole key tiles, so multiples of 16; kept
                    # in units of 16); the rest of its rows is never written
    P_OFF=0,        # STORE_P: elements from the dS buffer to the P buffer of the same shape
    STORE_P: tl.constexpr = False,  # DR_GEMM: P stored too (DR_MODE "stored")
):
    pid_m = tl.program_id(0)        # (longest first, _query_block, spilled 28 B more here)
    bh = tl.program_id(1) + BH0
    b = bh // H
    h = bh % H
    if DR_BULK:
        dr_base = DRD
    elif DR_GEMM:
        dr_base = DR_ACC + bh.to(tl.int64) * Tq * Tk
    else:
        dr_base = DR_ACC + h.to(tl.int64) * R_len * D
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
    wu = w - u
    if HAS_SEG:
        ef_same, ef_diff = _seg_rows(q, RSB, SEG_E, h, H, D, offs_d)
        seg_q = tl.load(SEG_Q + b * stride_sq_b + offs_m, mask=offs_m < Tq, other=-1)
        a_diff = tl.zeros([BLOCK_M], dtype=tl.float32)    # Σ dS over the other segment
        p_diff = tl.zeros([BLOCK_M], dtype=tl.float32)    # Σ P over the other segment
        ds_all = tl.zeros([BLOCK_M], dtype=tl.float32)    # Σ dS over every key
    rank_q = offs_m
    if HAS_PERM:
        rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t, mask=offs_m < Tq, other=0)

    lo, hi = _key_range(b, m0, Tk, mem_len, KV_END, 0, CAUSAL, HAS_KPM, False, BLOCK_M)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    c = pos_start - mem_len
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    r_base = R + h * stride_rh
    row0 = c - m0 - BLOCK_M + 1          # first row of r in the band of key block 0

    dqu = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dqw = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if not HAS_SEG:                      # the segment sums' loop-carried dummies
        seg_q = offs_m
        ef_same = tl.zeros([BLOCK_M], dtype=tl.float32)
        ef_diff = ef_same
        a_diff = ef_same
        p_diff = ef_same
        ds_all = ef_same
    if WINDOW:      # first key block within the window of the block's first query
        lo = tl.maximum(lo, tl.maximum(m0 + mem_len - window + 1, 0) // BLOCK_N * BLOCK_N)
    in_lo, in_hi = _interior_keys(m0, Tk, mem_len, window, CAUSAL, HAS_KPM, HAS_PERM, WINDOW,
                                  BLOCK_M, BLOCK_N)
    if DR_GEMM:
        span = DS_SPAN + (bh * tl.num_programs(0) + pid_m) * 2
        tl.store(span, lo // 16)                        # (lo: 0 or a key tile's start)
        tl.store(span + 1, (lo + tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N) * BLOCK_N) // 16)
    # the first chunk of the first tile's band, carried through the loops (_rel_bwd_dq_inner)
    r_row = row0 + lo
    r_first = _r_tile(RD, r_base, h, r_row, R_len, offs_d, d_ok, stride_rm, stride_rd,
                      BLOCK_N, BLOCK_D, TMA)
    rb_base = RB + h * stride_rbh
    pos_prev = _first_chunk(qu, _rb_rows(rb_base, r_row, BLOCK_N), r_first,
                            UPCAST, PRECISION, CARRY, BLOCK_M, BLOCK_N, False)
    ds_prev = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HAS_KPM or HAS_PERM:              # per-element masks: every tile is a boundary tile
        dqu, dqw, a_diff, p_diff, ds_all, pos_prev, ds_prev, r_row = _rel_bwd_dq_inner(
            dqu, dqw, a_diff, p_diff, ds_all, pos_prev, ds_prev, r_row,
            lo, hi, in_lo, in_hi, qu, wu, rb_base, do, lse, delta, seg_q,
            ef_same, ef_diff, offs_m, offs_d, d_ok, k_base, v_base, r_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_rm, stride_rd, row0, R_len,
            SEG_K, stride_sk_b, b, bh, Tq, Tk, mem_len, window, KPM, stride_kpm_b,
            stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q, seed, qk_scale, p_drop,
            CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, HAS_SEG, DROPOUT, WINDOW, 1,
            BLOCK_M, BLOCK_N, UPCAST, PRECISION, dr_base, D, ATOMIC_DR + DR_BULK + 2 * DR_GEMM,
            CARRY, KD,
            VD, RD, h, BLOCK_D, TMA, P_OFF, STORE_P)
    else:        # one loop, a runtime boundary test per tile
        dqu, dqw, a_diff, p_diff, ds_all, pos_prev, ds_prev, r_row = _rel_bwd_dq_inner(
            dqu, dqw, a_diff, p_diff, ds_all, pos_prev, ds_prev, r_row,
            lo, hi, in_lo, in_hi, qu, wu, rb_base, do, lse, delta, seg_q,
            ef_same, ef_diff, offs_m, offs_d, d_ok, k_base, v_base, r_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_rm, stride_rd, row0, R_len,
            SEG_K, stride_sk_b, b, bh, Tq, Tk, mem_len, window, KPM, stride_kpm_b,
            stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q, seed, qk_scale, p_drop,
            CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, HAS_SEG, DROPOUT, WINDOW, 2,
            BLOCK_M, BLOCK_N, UPCAST, PRECISION, dr_base, D, ATOMIC_DR + DR_BULK + 2 * DR_GEMM,
            CARRY, KD,
            VD, RD, h, BLOCK_D, TMA, P_OFF, STORE_P)
    if not DR_GEMM:     # the last tile's dS_hi, on the chunk after it
        r_last = _r_tile(RD, r_base, h, r_row, R_len, offs_d, d_ok, stride_rm, stride_rd,
                         BLOCK_N, BLOCK_D, TMA)
        dqw += _dot(ds_prev.to(r_last.dtype), r_last, UPCAST, PRECISION)
        if ATOMIC_DR:
            _rel_dr_atomic(dr_base, r_row, ds_prev, qu, wu, R_len, D, offs_d, d_ok, UPCAST,
                           PRECISION, h, ATOMIC_DR + DR_BULK)

    out_off = (bh * Tq + offs_m[:, None]) * D + offs_d[None, :]
    tl.store(DQ + out_off, ((dqu + dqw) * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
    # this query block's shares of d(r_w_bias) = Σ_i d(q + u)_i and d(r_r_bias) = Σ_i
    # d(q + v)_i (rows past Tq hold 0: their dS is 0)
    bias_off = (bh * 2 * tl.num_programs(0) + pid_m) * D + offs_d      # [b, h, 0, pid_m]
    tl.store(DBIAS + bias_off, tl.sum(dqu, 0) * sm_scale, mask=offs_d < D)
    if not DR_GEMM:     # (else _rel_dqw_gemm_kernel's)
        tl.store(DBIAS + tl.num_programs(0) * D + bias_off,             # [b, h, 1, pid_m]
                 tl.sum(dqw, 0) * sm_scale, mask=offs_d < D)
    if HAS_SEG:
        # Every row of dS sums to 0 (Σ_j P dP = Δ, Σ_j P = 1; with dropout too): the two
        # segment sums are small differences of large terms, and an error e in Δ moves each
        # dS_ij by -e·P_ij. a_diff - p_diff·ds_all and its negative are free of e and of the
        # rounding of the cancelling sum.
        a_diff = a_diff - p_diff * ds_all
        tl.store(SEG_A + (bh * Tq + offs_m) * 2, -a_diff * sm_scale, mask=offs_m < Tq)
        tl.store(SEG_A + (bh * Tq + offs_m) * 2 + 1, a_diff * sm_scale, mask=offs_m < Tq)



@triton.jit
def _rel_dr_ds(K0: tl.constexpr, WIDTH: tl.constexpr, pos, owned, qu, do, lse, delta,
               offs_m, j0, b, bh, Tq, Tk, mem_len, window, k_base, v_base, offs_d, d_ok,
               stride_kn, stride_kd, stride_vn, stride_vd, SEG_K, stride_sk_b, seg_q,
               ef_same, ef_diff, KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b,
               stride_rank_t, rank_q, seed, qk_scale, p_drop,
               CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
               PERM_STRICT: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
               WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """The dR kernel's dS ``[BLOCK_M, WIDTH]`` on keys ``j0 + K0 + [0, WIDTH)`` of a query
    block's band (``j0 = m0 + d0``; the whole band, K0 0 and WIDTH 2·BLOCK_N, or one half),
    0 outside the pairs on the program's diagonals: ``owned`` ``[BLOCK_M, WIDTH]`` (row ii
    owns keys ``j0 + ii + [0, BLOCK_N)``); pos ``[BLOCK_M, WIDTH]``: the position term of
    each owned pair, ``(q + v)`` times the owned rows of r gathered into the key order (the
    caller gathers once for both halves)."""
    offs_k = j0 + K0 + tl.arange(0, WIDTH)
    offs_k = tl.where(offs_k >= 0, offs_k, Tk)          # before the keys: invisible, not loaded
    kv_mask = (offs_k[:, None] < Tk) & d_ok
    k = tl.load(k_base + offs_k[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)                                    # [WIDTH, BLOCK_D]
    v = tl.load(v_base + offs_k[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    s = _dot(qu, tl.trans(k), UPCAST, PRECISION) + tl.where(owned, pos, 0.0)
    if HAS_SEG:
        seg_k = tl.load(SEG_K + b * stride_sk_b + offs_k, mask=offs_k < Tk, other=-2)
        s += _seg_term(seg_q, seg_k, ef_same, ef_diff)[0]
    vis = _rel_visible(offs_m, offs_k, b, Tq, Tk, mem_len, window,
                       KPM, stride_kpm_b, stride_kpm_n, RANK, stride_rank_b, stride_rank_t,
                       rank_q, CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, WINDOW) & owned
    p = tl.where(vis, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
    dp = _dot(do, tl.trans(v), UPCAST, PRECISION)                           # [BLOCK_M, WIDTH]
    if DROPOUT:
        keep = _keep(seed, bh, offs_m, offs_k, Tq, Tk, p_drop)
        dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
    return p * (dp - delta[:, None])


@triton.jit
def _rel_attn_bwd_dr_kernel(
    K, V, DO, QU,   # as in the dK/dV kernel
    QW,             # q + r_r_bias [B, H, Tq, D] contiguous, in k's dtype (dr's operand)
    R, RB, stride_rbh, SEG_Q, SEG_K, EF, LSE, DELTA,     # as in the dK/dV kernel
    DR,             # [B, H, R, D] fp32: batch b's dr, every element written (summed over b
                    # by the launcher, in a fixed order)
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
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_PERM: tl.constexpr,
    PERM_STRICT: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BAND: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    HALVES: tl.constexpr = False,   # the band of keys in two halves (see HALVES_MIN_BLOCK)
):
    """One program owns BLOCK_N rows of r (the diagonals j - i = m - c of the score matrix)
    of one (b, h) and walks down those diagonals, one query block at a time."""
    pid_r = tl.program_id(0)
    bh = tl.program_id(1) + BH0
    b = bh // H
    h = bh % H
    c = pos_start - mem_len
    mr0 = pid_r * BLOCK_N                     # first row of r owned
    d0 = mr0 - c                              # its diagonal j - i
    ii = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    offs_r = mr0 + jj
    r = tl.load(R + h * stride_rh + offs_r[:, None] * stride_rm + offs_d[None, :] * stride_rd,
                mask=(offs_r[:, None] < R_len) & d_ok, other=0.0)          # [BLOCK_N, BLOCK_D]
    rb = _rb_band(RB + h * stride_rbh, offs_r, R_len)                     # [BLOCK_N]
    # Query i meets the owned diagonals at keys j = i + d0 + [0, BLOCK_N): only queries with
    # -d0 - BLOCK_N < i < Tk - d0 (and, causal, only if d0 <= mem_len; window: only if the
    # last owned diagonal is within it).
    lo = tl.maximum(1 - d0 - BLOCK_N, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(Tq, Tk - d0)
    if CAUSAL:
        hi = tl.where(d0 <= mem_len, hi, 0)
    if WINDOW:
        hi = tl.where(d0 + BLOCK_N - 1 > mem_len - window, hi, 0)
    if HAS_KPM:
        hi = tl.minimum(hi, tl.load(KV_END + b) - d0)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    dr = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + ii
        q_mask = (offs_m[:, None] < Tq) & d_ok
        q_off = (bh * Tq + offs_m[:, None]) * D + offs_d[None, :]
        qu = tl.load(QU + q_off, mask=q_mask, other=0.0)
        qw = tl.load(QW + q_off, mask=q_mask, other=0.0)
        do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                     + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
        lse = tl.load(LSE + bh * Tq + offs_m, mask=offs_m < Tq, other=float("inf"))
        delta = tl.load(DELTA + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)
        rank_q = offs_m
        if HAS_PERM:
            rank_q = tl.load(RANK + b * stride_rank_b + offs_m * stride_rank_t,
                             mask=offs_m < Tq, other=0)
        seg_q = offs_m                                  # placeholders unless HAS_SEG
        ef_same = tl.zeros([BLOCK_M], dtype=tl.float32)
        ef_diff = ef_same
        if HAS_SEG:
            seg_q = tl.load(SEG_Q + b * stride_sq_b + offs_m, mask=offs_m < Tq, other=-1)
            ef = EF + (bh * Tq + offs_m) * 2
            ef_same = tl.load(ef, mask=offs_m < Tq, other=0.0)
            ef_diff = tl.load(ef + 1, mask=offs_m < Tq, other=0.0)
        # the band of keys the block's rows meet, j = m0 + d0 + [0, 2·BLOCK_N); the position
        # term as the forward formed it, (q + u)·r_m plus the row bias (_rb_band)
        qr = _dot(qu, tl.trans(r), UPCAST, PRECISION) + rb[None, :]         # [BLOCK_M, BLOCK_N]
        if HALVES:          # in two halves, each gathered into diagonal order before the next
            # The index tensors formed per tile on purpose (hoisted, they stay live through
            # the loop and spill): t2, a multiple of 2·BLOCK_N, only keeps them here. Pair
            # (ii, jj) of the diagonal order is band column ii + jj (_skewed by ii; square
            # tiles). Pair (ii, cc) of half h lies on diagonal cc + h·BLOCK_N − ii, owned
            # where in [0, BLOCK_N): from x = cc − ii + BLOCK_N + t2, its low bits (the
            # rotation by BLOCK_N − ii) and bit BLOCK_N.
            t2 = (m0 - lo) // BLOCK_M * (2 * BLOCK_N)
            x = jj[None, :] - ii[:, None] + BLOCK_N + t2
            first = (x & BLOCK_N) != 0
            # the same rotation serves both halves: pair (ii, cc) is on diagonal x mod BLOCK_N
            pos = _rotate(qr, BLOCK_N - ii + t2, BLOCK_M, BLOCK_N)
            ds_lo = _rel_dr_ds(0, BLOCK_N, pos, first, qu, do, lse, delta, offs_m, m0 + d0,
                               b, bh, Tq, Tk, mem_len, window, k_base, v_base, offs_d, d_ok,
                               stride_kn, stride_kd, stride_vn, stride_vd, SEG_K, stride_sk_b,
                               seg_q, ef_same, ef_diff, KPM, stride_kpm_b, stride_kpm_n, RANK,
                               stride_rank_b, stride_rank_t, rank_q, seed, qk_scale, p_drop,
                               CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, HAS_SEG, DROPOUT,
                               WINDOW, UPCAST, PRECISION)
            ds_hi = _rel_dr_ds(BLOCK_N, BLOCK_N, pos, ~first, qu, do, lse, delta, offs_m,
                               m0 + d0, b, bh, Tq, Tk, mem_len, window, k_base, v_base, offs_d,
                               d_ok, stride_kn, stride_kd, stride_vn, stride_vd, SEG_K,
                               stride_sk_b, seg_q, ef_same, ef_diff, KPM, stride_kpm_b,
                               stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q, seed,
                               qk_scale, p_drop, CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT,
                               HAS_SEG, DROPOUT, WINDOW, UPCAST, PRECISION)
            ds_diag = _skewed(ds_lo, ds_hi, ii + t2, BLOCK_M, BLOCK_N)   # dS on the diagonals
        else:               # the whole band at once
            own = tl.arange(0, 2 * BLOCK_N)[None, :] - ii[:, None]  # [BLOCK_M, BAND]: diagonal
            owned = (own >= 0) & (own < BLOCK_N)
            # pair (ii, cc) owned reads column cc − ii of qr (in either half of the band):
            # one rotation, the same for both halves
            pos = _rotate(qr, BLOCK_N - ii, BLOCK_M, BLOCK_N)
            pos = tl.reshape(tl.permute(tl.join(pos, pos), [0, 2, 1]), [BLOCK_M, 2 * BLOCK_N])
            ds = _rel_dr_ds(0, 2 * BLOCK_N, pos, owned, qu, do, lse, delta,
                            offs_m, m0 + d0, b, bh, Tq, Tk, mem_len, window, k_base, v_base, offs_d,
                            d_ok, stride_kn, stride_kd, stride_vn, stride_vd, SEG_K,
                            stride_sk_b, seg_q, ef_same, ef_diff, KPM, stride_kpm_b,
                            stride_kpm_n, RANK, stride_rank_b, stride_rank_t, rank_q, seed,
                            qk_scale, p_drop, CAUSAL, HAS_KPM, HAS_PERM, PERM_STRICT, HAS_SEG,
                            DROPOUT, WINDOW, UPCAST, PRECISION)
            ds_lo, ds_hi = _band_halves(ds, BLOCK_M, BLOCK_N)
            ds_diag = _skewed(ds_lo, ds_hi, ii, BLOCK_M, BLOCK_N)        # [BLOCK_M, BLOCK_N]
        dr += _dot(tl.trans(ds_diag).to(qw.dtype), qw, UPCAST, PRECISION)

    # int64: dr_b [B, H, R, D] may pass 2**31 elements where q, k, v and r do not (B * r's)
    tl.store(DR + (bh.to(tl.int64) * R_len + offs_r[:, None]) * D + offs_d[None, :], dr * sm_scale,
             mask=(offs_r[:, None] < R_len) & d_ok)


@triton.jit
def _rel_dkdv_gemm_kernel(
    DS, P,          # dS and P (dropout's keep applied, as dV takes it) [B, H, Tq, Tk], the
                    # dQ kernel's (DR_MODE "stored"); row i written at its block's span only
    DS_SPAN,        # [B·H, ⌈Tq / Q_BLOCK⌉, 2] int32: [lo, hi) / 16 of the keys stored per
                    # block (the dQ kernel's whole tiles; keys past Tk never stored)
    QU, DO,         # q + r_w_bias [B, H, Tq, D] contiguous; do [B, H, Tq, D], any strides
    DK, DV,         # [B, H, Tk, D] contiguous, written
    KV_END,         # [B] int32 (HAS_KPM): the first padded key
    stride_dob, stride_doh, stride_dom, stride_dod,
    H, Tq, Tk, mem_len, D, window, sm_scale,
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, WINDOW: tl.constexpr,
    Q_BLOCK: tl.constexpr,      # the dQ kernel's BLOCK_M (DS_SPAN's query blocks)
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """``dK = scale · dSᵀ (q + u)``, ``dV = Pᵀ dO`` of key block program_id 0 of (b, h) =
    program_id 1, from the stored dS and P: two GEMMs over the query blocks that can see
    the block (the dK/dV kernel's range), nothing recomputed (no scores, no exponentials,
    no skew). Entries a query block never stored read as 0."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1) + BH0
    b = bh // H
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    lo, hi = _query_range(b, n0, Tq, mem_len, window, KV_END, CAUSAL, HAS_KPM, WINDOW,
                          BLOCK_M, BLOCK_N)
    plane = bh.to(tl.int64) * Tq * Tk
    span_base = DS_SPAN + bh * tl.cdiv(Tq, Q_BLOCK) * 2
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + offs_i                                                # [BLOCK_M]
        row_ok = rows < Tq
        blk = tl.minimum(rows, Tq - 1) // Q_BLOCK
        k_lo = tl.load(span_base + blk * 2) * 16        # (multiples of 16: vector loads)
        k_hi = tl.load(span_base + blk * 2 + 1) * 16
        ok = row_ok[:, None] & (offs_n[None, :] >= k_lo[:, None]) \
            & (offs_n[None, :] < k_hi[:, None]) & (offs_n < Tk)[None, :]
        pair = plane + rows[:, None].to(tl.int64) * Tk + offs_n[None, :]
        ds = tl.load(DS + pair, mask=ok, other=0.0)                       # [BLOCK_M, BLOCK_N]
        p = tl.load(P + pair, mask=ok, other=0.0)
        qu = tl.load(QU + (bh * Tq + rows[:, None]) * D + offs_d[None, :],
                     mask=row_ok[:, None] & d_ok, other=0.0)
        do = tl.load(DO + (bh // H) * stride_dob + (bh % H) * stride_doh
                     + rows[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                     mask=row_ok[:, None] & d_ok, other=0.0)
        dk += _dot(tl.trans(ds), qu, UPCAST, PRECISION)
        dv += _dot(tl.trans(p).to(do.dtype), do, UPCAST, PRECISION)
    out_off = (bh * Tk + offs_n[:, None]) * D + offs_d[None, :]
    kv_mask = (offs_n[:, None] < Tk) & d_ok
    tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _rel_dqw_gemm_kernel(
    DS, DS_SPAN,    # as in _rel_dr_gemm_kernel (BLOCK_M's query blocks)
    R,              # r [H, R, D], any strides
    DQ,             # [B, H, Tq, D] fp32 contiguous: scale · d(q + u) (the dQ kernel's), added to
    DBIAS,          # [B, H, 2, ⌈Tq / BLOCK_M⌉, D] fp32: plane 1 written (as the dQ
                    # kernel does without DR_GEMM)
    H, Tq, Tk, R_len, D, c,     # c = pos_start − mem_len: pair (i, j) uses r row c + j − i
    sm_scale,
    stride_rh, stride_rm, stride_rd,
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    BLOCK_M: tl.constexpr,      # the dQ kernel's (its programs and DS_SPAN's blocks)
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """``d(q + v)[b, h, i] = Σ_j dS[i, j] · r[c + j − i] = Σ_m dS[i, i + m − c] · r[m]`` for
    the query block program_id 0 of (b, h) = program_id 1: a GEMM over the band of r rows
    that the block's stored keys reach, its A operand read along dS's diagonals as in
    :func:`_rel_dr_gemm_kernel`. Adds ``scale ·`` it to DQ and stores its column sum (the
    block's share of d(r_r_bias)). The dQ kernel then needs neither the rotation of dS onto
    r's rows nor the product with r (DR_MODE "gemm")."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1) + BH0
    h = bh % H
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_t = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    row_ok = offs_m < Tq
    span = DS_SPAN + (bh * tl.num_programs(0) + pid_m) * 2
    lo = tl.load(span) * 16
    hi = tl.minimum(tl.load(span + 1) * 16, Tk)
    ds_base = DS + bh.to(tl.int64) * Tq * Tk + offs_m[:, None].to(tl.int64) * Tk
    r_base = R + h * stride_rh
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # r rows c + j − i of the block's pairs: j in [lo, hi), i in [m0, m0 + BLOCK_M)
    for m1 in range(tl.maximum(c + lo - m0 - BLOCK_M + 1, 0), tl.minimum(c + hi - m0, R_len),
                    BLOCK_R):
        ms = m1 + offs_t                                                  # [BLOCK_R]
        keys = offs_m[:, None] + ms[None, :] - c                         # [BLOCK_M, BLOCK_R]
        x = tl.load(ds_base + keys, mask=row_ok[:, None] & (keys >= lo) & (keys < hi)
                    & (ms < R_len)[None, :], other=0.0)
        rt = tl.load(r_base + ms[:, None] * stride_rm + offs_d[None, :] * stride_rd,
                     mask=(ms < R_len)[:, None] & d_ok, other=0.0)
        acc += _dot(x, rt, UPCAST, PRECISION)
    acc = acc * sm_scale
    q_mask = row_ok[:, None] & d_ok
    dq_ptrs = DQ + (bh * Tq + offs_m[:, None]) * D + offs_d[None, :]
    tl.store(dq_ptrs, tl.load(dq_ptrs, mask=q_mask, other=0.0) + acc, mask=q_mask)
    tl.store(DBIAS + ((bh * 2 + 1) * tl.num_programs(0) + pid_m) * D + offs_d,  # [b, h, 1, m]
             tl.sum(acc, 0), mask=offs_d < D)


@triton.jit
def _rel_dr_gemm_kernel(
    DS,             # dS [B, H, Tq, Tk] contiguous (the dQ kernel's, DR_MODE "gemm"), unscaled;
                    # row i of a (b, h) written at the keys DS_SPAN gives its query block only
    DS_SPAN,        # [B·H, ⌈Tq / Q_BLOCK⌉, 2] int32: [lo, hi) / 16 of those keys per query
                    # block (whole key tiles; keys past Tk never stored)
    QW,             # q + v [B, H, Tq, D], any strides
    DR,             # dr [H, R, D] fp32 contiguous, written
    B, H, Tq, Tk, R_len, D, c,  # c = pos_start − mem_len: pair (i, j) uses r row c + j − i
    m_end,          # no visible pair uses r rows from m_end on (causal: c + mem_len + 1)
    sm_scale,
    stride_wb, stride_wh, stride_wm, stride_wd,
    Q_BLOCK: tl.constexpr,      # the dQ kernel's BLOCK_M (DS_SPAN's query blocks)
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """``dr[h, m] = scale · Σ_b Σ_i dS[b, h, i, i + m − c] · (q + v)[b, h, i]`` for BLOCK_R
    rows m of r (program_id 0) of head h (program_id 1): a GEMM whose A operand is dS read
    along its diagonals. The skew is in the addresses: tile ``X[i, t] = dS[i, i + m_t − c]``
    is row i's keys ``i + m_0 − c + [0, BLOCK_R)``, contiguous, so the load places it and no
    register moves; the keys a row's query block never stored (outside DS_SPAN) and those
    outside [0, Tk) read as 0. Sums in a fixed order (no atomics): deterministic."""
    pid_r = tl.program_id(0)
    h = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    n_blocks = tl.cdiv(Tq, Q_BLOCK)
    # the rows whose keys i + m − c meet [0, Tk) for some m of this program's
    i_lo = tl.maximum(c - pid_r * BLOCK_R - BLOCK_R + 1, 0) // BLOCK_K * BLOCK_K
    i_hi = tl.minimum(c - pid_r * BLOCK_R + Tk, Tq)
    if pid_r * BLOCK_R >= m_end:        # rows of r no visible pair uses: dr 0
        i_hi = i_lo
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for b in range(0, B):
        bh = b * H + h
        ds_base = DS + bh.to(tl.int64) * Tq * Tk
        span_base = DS_SPAN + bh * n_blocks * 2
        w_base = QW + b * stride_wb + h * stride_wh
        for i0 in range(i_lo, i_hi, BLOCK_K):
            rows = i0 + offs_k                                            # [BLOCK_K]
            row_ok = rows < Tq
            blk = tl.minimum(rows, Tq - 1) // Q_BLOCK
            lo = tl.load(span_base + blk * 2) * 16
            hi = tl.minimum(tl.load(span_base + blk * 2 + 1) * 16, Tk)
            keys = rows[:, None] + offs_r[None, :] - c                   # [BLOCK_K, BLOCK_R]
            x = tl.load(ds_base + rows[:, None].to(tl.int64) * Tk + keys,
                        mask=row_ok[:, None] & (keys >= lo[:, None]) & (keys < hi[:, None])
                        & (offs_r < R_len)[None, :], other=0.0)
            qw = tl.load(w_base + rows[:, None] * stride_wm + offs_d[None, :] * stride_wd,
                         mask=row_ok[:, None] & d_ok, other=0.0)
            acc += _dot(tl.trans(x), qw, UPCAST, PRECISION)
    tl.store(DR + (h * R_len + offs_r[:, None]) * D + offs_d[None, :], acc * sm_scale,
             mask=(offs_r[:, None] < R_len) & d_ok)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` (a constexpr), decided once per call by the launcher
    (inside the custom op, so torch.compile never traces it). fp32 runs on the tensor
    cores: ``"tf32"`` when torch allows TF32 for fp32 matmuls (:func:`_tf32_allowed`:
    ``allow_tf32``, ``set_float32_matmul_precision("high")`` or the ``fp32_precision``
    API), else ``"tf32x3"``: each operand split into a TF32 head and a TF32
    tail, three products (tail·tail dropped), ~fp32 error at a third of the TF32 rate —
    instead of exact fp32 products on the CUDA cores (``"ieee"``; H100 SXM datasheet, dense:
    67 TFLOP/s fp32 FMA against 495 TF32, so tf32x3 has ~2.5x ieee's peak; not measured).
    Both strings are accepted by Triton 3.6-3.9 on NVIDIA; the interpreter computes every
    fp32 dot exactly whatever the string. fp64 keeps ``"ieee"``; 16-bit operands ignore it."""
    if dtype == torch.float64:
        return "ieee"
    if dtype == torch.float32 and not _tf32_allowed():
        return "tf32x3"
    return "tf32"


def _config(D: int, Tq: Optional[int] = None, dtype: torch.dtype = torch.float16):
    """(BLOCK_M, BLOCK_N, BLOCK_D, BAND, num_warps, num_stages). Square tiles keep the band
    (BLOCK_M + BLOCK_N - 1 rows of r) a power of two wide. The tile shrinks with the head
    dim and the element size so that every kernel fits in an A100's shared memory (166912
    bytes per block; H100/H200: 232448), measured by compiling for sm_80 and sm_90
    (tests/test_triton_compile.py) with every flag on:

    =========  ==========  ===================  ==================================
    dtype      D           tile (M = N, band)   largest kernel, sm_90 / sm_80
    =========  ==========  ===================  ==================================
    16-bit     <= 64       64, 128              dQ 124 / 91 KB (D 64)
    16-bit     <= 256      32, 64               dQ 78 / 78 KB (D 128)
    fp32       <= 32       64, 128              (no compile case)
    fp32       <= 128      32, 64               dK/dV 103 / 103 KB (D 128, tf32)
    fp32       <= 256      16, 32               dK/dV 101 / 101 KB (D 256, tf32)
    =========  ==========  ===================  ==================================

    (Before the two-chunk rework 64-row tiles needed 181 KB on sm_80 at fp32 D 64 and
    263 KB on sm_90 at 16-bit D 128; the rework shrank the forward and dQ kernels' r tiles,
    and the fp32 D 64 forward at 64 x 64, 8 warps, 2 stages needs 115 KB: a candidate of
    benchmarks/config_sweep.py, not the default before a GPU times it.)

    With a few queries (``Tq <= DECODE_MAX_Q``, forward only) a 16-row query block and
    key blocks of 64 (16-bit D <= 128, fp32 D <= 64), 32 (16-bit D 256, fp32 D <= 128) or
    16: a 64-row query block would be mostly padding.

    The forward's (num_warps, num_stages): the fewest register spills on sm_90 (``ptxas -v``
    of Triton 3.9's PTX, causal, benchmarks/NOTES.md "rel_attention: one query operand,
    two chunks"): 16-bit 64 x 64 tiles (8, 3), 0 B (at 4 warps 12-24 B); 32 x 32 tiles
    (4, 3), 0 B, except fp32 D 128 (8, 1), 92 B (every other choice 116-580 B). Other
    sizes keep (4, 2) / (8, 2).

    Timed since, on the H200 for 16-bit 64 x 64 tiles (benchmarks/results/nvidia-h200/
    2026-11-26-round3/config_sweep.json, Triton 3.6, bf16 B4 H16 Tq512 mem1024 D64 causal,
    every candidate checked against float64): (4, 3) 150 us against the spill-chosen
    (8, 3)'s 237 (139 us with the carried gather, :func:`_carry`), so (4, 3) there."""
    block_d = max(16, next_pow2(D))
    if _interpreting():                      # small tiles, unless a test sets "tile"
        bm = _override("tile", 16)
        return bm, bm, block_d, 2 * bm, 1, 1
    warps = 4 if block_d <= 64 else 8
    wide = dtype.itemsize >= 4
    if Tq is not None and Tq <= DECODE_MAX_Q:
        bn = 64 if block_d <= (64 if wide else 128) else 32 if block_d <= (128 if wide else 256) else 16
        return 16, bn, block_d, max(32, 2 * bn), warps, 2
    bm = 64 if block_d <= (32 if wide else 64) else 32 if block_d <= 128 or not wide else 16
    stages = 2
    if bm == 64 and not wide:
        warps, stages = 4, 3       # measured, H200 (see the docstring)
    elif bm == 32 and block_d <= (64 if wide else 128):
        warps, stages = 4, 3
    elif bm == 32 and wide and block_d == 128:
        warps, stages = 8, 1
    bm = _override("tile", bm)               # the tuner's rows, benchmarks/config_sweep.py
    warps, stages = _override("fwd", (warps, stages))
    return bm, bm, block_d, 2 * bm, warps, stages


def _bwd_launch(D: int, dtype: torch.dtype, atomic: bool = False) -> dict:
    """(num_warps, num_stages) of each backward kernel, on :func:`_config`'s tiles. Chosen
    without a GPU by the fewest register spills on sm_90 (``ptxas -v`` on Triton 3.9's PTX,
    causal cases, benchmarks/NOTES.md "rel_attention: one query operand, two chunks"; checked
    with Triton 3.6's compiler too): 8 warps (at 4 every kernel spills 0.2-1.7 KB more per
    thread); one stage for the dR kernel and the 16-bit dK/dV kernel, two for the fp32 dK/dV
    kernel (0 B there); the fp32 dQ kernel one stage (0 B), the 16-bit one on 32 x 32
    tiles (D > 64) three.

    Except the 16-bit dQ kernel on 64 x 64 tiles (D <= 64): (4, 1), from the H200
    (benchmarks/results/nvidia-h200/2026-11-26-dq-sweep.json, Triton 3.6, bf16 B4 H16 Tq512
    mem1024): there it computes a wrong dq (25x the error bound, every element) at 8 warps
    with two or three stages, the spill-chosen (8, 3) included, and a right one at (4, 1) /
    (4, 2) / (4, 3) / (8, 1); (4, 1) was the fastest right one, 313 us against 377 at
    (8, 1), though it spills 432 B per thread on sm_90. The interpreter cannot see this
    (tests/gpu/test_rel_attention_gpu.py and benchmarks/config_sweep.py's check can).

    The 16-bit dK/dV and dR kernels on 64 x 64 tiles: (4, 1), from the round-3 H200 sweep
    (benchmarks/results/nvidia-h200/2026-11-26-round3/config_sweep.json, the same case):
    dK/dV 223 us against 318 at (8, 1), dR 403 against 517; every launch right there.
    With dr by atomic adds (``atomic``, :func:`_dr_mode`) that dQ kernel runs (8, 1): the
    round-4 tuner's choice there (benchmarks/results/nvidia-h200/2026-11-27-round4)."""
    if _interpreting():
        return {k: (1, 1) for k in ("dkdv", "dq", "dr")}
    wide = dtype.itemsize >= 4
    small = not wide and next_pow2(D) <= 64                  # 16-bit 64 x 64 tiles
    dq = (8, 1) if wide or (small and atomic) else (4, 1) if small else (8, 3)
    launch = {"dkdv": (4, 1) if small else (8, 2 if wide else 1), "dq": dq,
              "dr": (4, 1) if small else (8, 1)}
    return {k: _override(k, v) for k, v in launch.items()}


def _dr_gemm_launch() -> dict:
    """(num_warps, num_stages) of the GEMMs over the stored dS (:func:`_rel_dr_gemm_kernel`,
    :func:`_rel_dqw_gemm_kernel`, :func:`_rel_dkdv_gemm_kernel`): 4 warps and 3 stages on
    their 64 x 64 tiles (a plain GEMM's row; not tuned), or the override ``"dr_gemm"``."""
    w_, s_ = (1, 1) if _interpreting() else _override("dr_gemm", (4, 3))
    return dict(num_warps=w_, num_stages=s_)


#: ``{"tile": BLOCK_M (square tiles, band 2·BLOCK_M), "fwd" | "dkdv" | "dq" | "dr":
#: (num_warps, num_stages), "carry": bool, "dr_mode": str, "tma": str, "fold": bool,
#: "rb_mma": bool, "fwd_maxnreg" | "dkdv_maxnreg" | "dq_maxnreg" | "dr_maxnreg": int}``:
#: replaces :func:`_config`'s tile (not the decoding one) and :func:`_bwd_launch`'s rows for
#: every call while set; "carry" turns on the forward's and dQ kernel's carried gather
#: (:func:`_rel_scores_chunked`), "dr_mode" replaces :data:`DR_MODE`, "tma"
#: :data:`TMA_MODE`, "fold" False scales the forward's tile before the softmax step (the
#: form before its FOLD), "rb_mma" replaces :data:`RB_MMA` (the forward's row bias as a
#: product's operand, :func:`_rb_mma_args`), "<kernel>_maxnreg" caps a kernel's registers
#: per thread (:func:`_reg_cap`; Triton's ``maxnreg``). Empty in normal use; the
#: GPU config sweep (benchmarks/config_sweep.py) sets it to time (and check) candidates on
#: the same inputs.
#: The tuner's rows (kernels/_tune.py, ``CTXFAST_AUTOTUNE=on``) use the same names and come
#: first.
LAUNCH_OVERRIDE: dict = {}


def _override(name, default=None):
    """The value the tuned call in progress or :data:`LAUNCH_OVERRIDE` gives ``name``, else
    ``default``."""
    return _tune.override(LAUNCH_OVERRIDE, name, default)


def _carry(D: int, dtype: torch.dtype) -> bool:
    """Whether the forward and dQ kernels carry the gathered first chunk
    (:func:`_rel_scores_chunked`): on a GPU for 16-bit 64 x 64 tiles, where the H200 timed
    it right and faster (forward 139 us against 150, dQ 286 against 310; benchmarks/results/
    nvidia-h200/2026-11-26-round3/config_sweep.json); elsewhere off until a GPU times it.
    The override "carry" (:func:`_override`) replaces the choice."""
    carry = _override("carry")
    if carry is not None:
        return bool(carry)
    return not _interpreting() and dtype.itemsize == 2 and next_pow2(D) <= 64


#: The forward's register cap that fits three of its CTAs on an SM (sm_90: 65,536 registers
#: / (3 x 128 threads) = 170, allocated by 8) with two stages of 16-bit 64 x 64 tiles (smem
#: 72-75 KB a CTA against 228 KB an SM): a tuner candidate (the override "fwd_maxnreg"),
#: not a default. The table row (4 warps, 3 stages, 255 registers, 99 KB) fits two CTAs an
#: SM, and round 5's arithmetic puts the forward at ~5,000 cycles a tile for ~650 issued
#: (benchmarks/NOTES.md): latency, which more warps an SM hide. The cap costs spills: sm_90
#: SASS of the bf16 D 64 TMA forward's loop, Triton 3.9, 642 -> 719 instructions a tile
#: (63 LDL, 14 STL; 308 B stored); with the row bias as a product, 593 -> 648 (50 LDL, 14
#: STL; 320 B). Whether 12 warps an SM with those spills beat 8 without is a GPU's question.
FWD_MAXNREG_3CTA = 168
#: The same for the dK/dV kernel at 4 warps (three CTAs, 49 KB of shared memory each) and
#: for the dQ kernel of DR_MODE "gemm" at 8 warps (two CTAs, 41 KB each; 232 registers
#: without a cap, one CTA): tuner candidates.
DKDV_MAXNREG_3CTA, DQ_MAXNREG_2CTA = 168, 128
#: And for the D 128 dK/dV kernel (32 x 32 tiles, 8 warps, 144 registers: one CTA an SM):
#: capped at 128, two CTAs an SM (ptxas fitted it in 126 registers without a spill until
#: the kernel took the forward's row bias, 2026-11-29: 140 B of spill stores since).
DKDV128_MAXNREG_2CTA = 128


def _reg_cap(kernel: str) -> dict:
    """``{"maxnreg": n}`` where the override ``"<kernel>_maxnreg"`` (:func:`_override`; the
    tuner's rows) caps a kernel's registers per thread (fwd, dkdv, dq, dr), else ``{}``:
    more CTAs an SM for kernels that mostly wait, at the price of spills
    (:data:`FWD_MAXNREG_3CTA`)."""
    cap = _override(kernel + "_maxnreg")
    return {"maxnreg": int(cap)} if cap else {}


#: Whether the forward takes its row bias as a product's operand where it can
#: (:func:`_rb_mma_args`): off until a GPU has run and timed it (its descriptor, a
#: ``[64, 16]`` bf16 box at any row, is new to the hardware path); ``CTXFAST_REL_RB_MMA=1``
#: (read at import; "0" the default, anything else refused at the first forward) or
#: ``LAUNCH_OVERRIDE["rb_mma"]`` True turns it on, and the tuner offers it.
RB_MMA = os.environ.get("CTXFAST_REL_RB_MMA", "0")


def _rb_mma_on() -> bool:
    """:data:`RB_MMA` as a bool; any other value than "0" / "1" (or a bool) refused by name
    (the forward's launcher asks before its first launch)."""
    return flag_setting("CTXFAST_REL_RB_MMA", RB_MMA)


def _rb_mma_args(tma: dict, dtype: torch.dtype, bm: int, bn: int, split_table) -> dict:
    """The forward's RBD and RB_MMA (:func:`_rb_tile`) where :data:`RB_MMA` (or the
    override "rb_mma") asks for them and the launch reads its tiles through TMA descriptors
    (``tma``, :func:`_tma_args`), 16-bit, in 64 x 64 tiles: the row bias comes as a
    product's operand, the split table (``split_table()``, :func:`row_bias_table`), whose
    tiles ride the loop's TMA pipeline with k, v and r. sm_90 SASS of the bf16 D 64 TMA
    forward's loop: 642 -> 593 instructions a tile, its 16 loads gone, one 64 x 64 x 16
    product more, no spill; not timed on a GPU. Not offered elsewhere, by the same count:
    the dQ kernel (TMA 1,151 -> 1,163 instructions, 224 -> 244 B spilled), the D 128 TMA
    tiles (420 -> 421, 204 -> 242 registers), the same tile through pointers (cp.async;
    forward 684 -> 667 but 12 -> 56 B spilled), and float32 (a TF32 product would round
    it)."""
    on = _rb_mma_on()
    if not tma or dtype.itemsize != 2 or bm != 64 or bn != 64 or not _override("rb_mma", on):
        return {}
    rbd = row_tiles(split_table().unsqueeze(0), bn, 16)
    return dict(RBD=rbd, RB_MMA=True) if rbd is not None else {}


#: How the backward computes dr: "kernel" (the dR kernel along the score diagonals,
#: recomputing S and dP; deterministic), "atomic" (the dQ kernel adds each tile's
#: ``dS_bandᵀ (q + v)`` into an fp32 ``[H, R, D]`` accumulator with atomic adds: the dS band
#: it forms for d(q + v) anyway, no third recompute; sums in no fixed order), "bulk" (the
#: same sums, each tile's added in one TMA bulk reduction, ``cp.reduce.async.bulk.tensor``:
#: a GPU of compute capability 9+ or the interpreter, D a multiple of 4, else the
#: element-wise adds; not yet timed), "gemm" (the dQ kernel stores each tile's dS, the
#: ``[B, H, Tq, Tk]`` matrix in k's dtype, and two GEMMs read it along its diagonals:
#: ``_rel_dqw_gemm_kernel`` against r for dq's position term, ``_rel_dr_gemm_kernel``
#: against ``q + v`` for dr; so the dQ loop rotates no dS and multiplies nothing by r; no
#: recompute and no atomics, deterministic; costs that buffer, ~6 bytes a score pair
#: written and read twice at 16 bits; not yet timed), "stored" (the same with P stored
#: too, dropout's keep applied, and dK, dV by ``_rel_dkdv_gemm_kernel`` over the two: no
#: dK/dV kernel, so the backward forms the scores once; a second such buffer; not yet
#: timed) or "auto" (the
#: default): atomic on 16-bit 64 x 64 tiles, where the H200 timed it faster (with dQ at 8
#: warps, 1 stage: 900 us against 949 per backward, bf16 B4 H16 Tq512 mem1024 D64;
#: benchmarks/results/nvidia-h200/2026-11-27-round4), unless torch's deterministic
#: algorithms are on (``torch.use_deterministic_algorithms``), and the kernel elsewhere (not
#: timed). "atomic" asked for while deterministic algorithms are on is refused, as torch
#: refuses its own nondeterministic ops. From ``CTXFAST_REL_BWD_DR`` at import.
DR_MODE = os.environ.get("CTXFAST_REL_BWD_DR", "auto")


#: "auto" (default), "on" or "off": as ``kernels.attention.TMA_MODE`` (the same setting,
#: ``CTXFAST_ATTN_TMA``, read at import): the forward's and dQ's loops read k, v and r's
#: chunks through TMA descriptors on sm_90+ for fp16/bf16 calls, "on" in both kernels,
#: "auto" in the forward with 64-row tiles (:func:`_table_tma`). The dK/dV and dR kernels
#: keep pointer tiles: dK/dV's q and dO through descriptors spilled more on sm_90 (bf16
#: D 64 164 -> 236 B per thread, D 128 0 -> 80; benchmarks/NOTES.md).
#: ``LAUNCH_OVERRIDE["tma"]`` overrides it while the config sweep sets it.
TMA_MODE = os.environ.get("CTXFAST_ATTN_TMA", "auto")
TMA_DTYPES = (torch.float16, torch.bfloat16)


def _table_tma(kernel, bm, bn) -> bool:
    """Where :data:`TMA_MODE` "auto" reads descriptors: the forward with 64 x 64 tiles
    (16-bit D <= 64; not the decoding tiles), which the H200 timed faster with them (bf16
    B4 H16 Tq512 mem1024 D64 causal: 112 us against 139; benchmarks/results/nvidia-h200/
    2026-11-27-round4). dQ tied there (950 against 949 us) and keeps pointer tiles; 32-row
    tiles are not timed."""
    return kernel == "fwd" and bm == bn == 64


def _tma_args(kernel, names, tensors, bm, bn, block_d):
    """Keyword arguments turning the TMA tiles (``[bn, block_d]``) of ``kernel`` ("fwd" or
    "dq", query block bm) on (``_common.tma_args``), or ``{}`` where TMA_MODE is off for it
    or the call cannot use them (device, dtype, addressing)."""
    if (not check_tma_mode(_override("tma", TMA_MODE), _table_tma(kernel, bm, bn))
            or tensors[0].dtype not in TMA_DTYPES or not _has_tma(tensors[0].device)):
        return {}
    return tma_args(names, tensors, bn, block_d)


def _dr_bulk_args(dr_acc, bn: int, block_d: int) -> dict:
    """The dQ launch's keyword arguments for dr by TMA bulk reductions (DR_MODE "bulk"):
    the ``[H, R, D]`` accumulator's descriptor as ``[1, H, R, D]`` in ``[bn, block_d]``
    tiles, or ``{}`` (element-wise adds) where the device has no TMA or TMA cannot address
    the accumulator (D not a multiple of 4)."""
    return bulk_add_args(dr_acc.unsqueeze(0), bn, block_d, "DRD", "DR_BULK")


def _check_dr_mode_name(mode=None) -> None:
    """`mode` (default :data:`DR_MODE`) refused by name if it is not a mode (the forward
    asks too: refused before any kernel runs, not at the first backward)."""
    mode = DR_MODE if mode is None else mode
    if mode not in ("auto", "kernel", "atomic", "bulk", "gemm", "stored"):
        raise ValueError("CTXFAST_REL_BWD_DR must be 'auto', 'kernel', 'atomic', 'bulk', "
                         f"'gemm' or 'stored', got {mode!r}")


def _dr_mode(D: int = 64, dtype: torch.dtype = torch.float32) -> str:
    """"kernel", "atomic" or "bulk" for a backward of head dim D and dtype: DR_MODE, or the
    override "dr_mode" (the tuner's row, the config sweep's), with "auto" resolved (see
    DR_MODE). Refuses a bad setting, and "atomic" or "bulk" under torch's deterministic
    algorithms ("gemm" and "stored" add nothing: allowed)."""
    mode = _override("dr_mode", DR_MODE)
    _check_dr_mode_name(mode)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if mode == "auto":
        tile = _config(D, None, dtype)[0]
        return "atomic" if tile == 64 and dtype.itemsize == 2 and not deterministic \
            else "kernel"
    if mode in ("atomic", "bulk"):
        check_deterministic("rel_attention", f"CTXFAST_REL_BWD_DR={mode}")
    return mode


#: What the tuner (``CTXFAST_AUTOTUNE=on``, kernels/_tune.py) times per kernel besides the
#: table launch, keyed (kernel, tile, 16-bit?): override dicts (:data:`LAUNCH_OVERRIDE`'s
#: names: launches (num_warps, num_stages), the carried gather, TMA chunks, dr by atomic
#: adds). The tile is not tuned (a call's kernels share it). From the H200 sweeps
#: (benchmarks/results/nvidia-h200/2026-11-26-round3/config_sweep.json, bf16 D 64): the
#: launches within ~1.3x of the fastest right one there, each variant at its best launch;
#: at 32 x 32 tiles 4 warps ran 1.5-2x faster than 8 there. dQ at 8 warps with 2 or 3
#: stages is left out (wrong answers on the H200: the agreement check would turn it away,
#: after a compile). fp32 (XL evaluation's forward): its forward only.
_TUNE_CANDIDATES = {
    ("fwd", 64, True): [{"fwd": (4, 1)}, {"tma": "on"}, {"tma": "off"},
                        {"tma": "on", "fwd": (4, 1)}, {"carry": False},
                        {"fold": False},      # the tile scaled first: the FOLD's measure
                        {"rb_mma": True},     # the row bias as a product (_rb_mma_args)
                        # three CTAs an SM (FWD_MAXNREG_3CTA): 12 warps where 8 wait
                        {"fwd": (4, 2), "fwd_maxnreg": FWD_MAXNREG_3CTA},
                        {"fwd": (4, 2), "fwd_maxnreg": FWD_MAXNREG_3CTA, "rb_mma": True}],
    # (8 warps: no spill since the operands come ready-made, 2026-11-28; (8, 1) timed
    # slower in round 3, when q + u and q + w were formed per tile)
    ("dkdv", 64, True): [{"dkdv": (4, 2)}, {"dkdv": (8, 3)}, {"dkdv": (8, 2)}, {"dkdv": (8, 1)},
                         # three CTAs an SM (253 -> 168 registers; sm_90 SASS 782 -> 860
                         # instructions a tile, 92 LDL / 8 STL, 312 B stored)
                         {"dkdv": (4, 1), "dkdv_maxnreg": DKDV_MAXNREG_3CTA}],
    ("dq", 64, True): [{"carry": False}, {"tma": "on"}, {"dr_mode": "atomic", "dq": (8, 1)},
                       {"dr_mode": "kernel", "dq": (4, 1)}, {"dr_mode": "bulk", "dq": (8, 1)},
                       {"dr_mode": "gemm", "dq": (8, 1)}, {"dr_mode": "gemm", "dq": (4, 1)},
                       {"dr_mode": "stored", "dq": (8, 1)},
                       # 2 stages: k, v, r staged ahead (1 stage loads them in the loop);
                       # no spill there, 670 / 699 instructions a tile against 599 / 628
                       {"dr_mode": "gemm", "dq": (8, 2)}, {"dr_mode": "stored", "dq": (8, 2)},
                       # two CTAs of 8 warps an SM (232 -> 128 registers; sm_90 SASS 599 ->
                       # 736 instructions a tile, 94 LDL / 26 STL, 368 B stored)
                       {"dr_mode": "gemm", "dq": (8, 1), "dq_maxnreg": DQ_MAXNREG_2CTA}],
    ("dr", 64, True): [{"dr": (4, 3)}, {"dr": (8, 3)}],
    ("fwd", 32, True): [{"fwd": (4, 1)}, {"tma": "on"},
                        # three CTAs an SM (D 128: 204 registers, two; capped, 56 B spilled,
                        # 10 reloads a tile)
                        {"fwd_maxnreg": FWD_MAXNREG_3CTA}],
    ("dkdv", 32, True): [{"dkdv": (4, 2)}, {"dkdv": (4, 1)},
                         {"dkdv_maxnreg": DKDV128_MAXNREG_2CTA}],     # two CTAs, no spill
    ("dq", 32, True): [{"dq": (4, 3)}, {"dq": (4, 1)}, {"tma": "on"}, {"dr_mode": "gemm"},
                       {"dr_mode": "stored"}],
    ("dr", 32, True): [{"dr": (4, 3)}, {"dr": (4, 1)}],
    ("fwd", 32, False): [{"fwd": (4, 1)}, {"fwd": (8, 3)},
                         # three CTAs an SM (XL evaluation's forward: 244 registers with one
                         # TF32 product, 255 with tf32x3, two CTAs; capped, sm_90 SASS 429 ->
                         # 442 instructions a tile, 52 B spilled; tf32x3 910 -> 1,064, 696 B)
                         {"fwd_maxnreg": FWD_MAXNREG_3CTA}],
}

#: The same under the interpreter (tests): the variants' code paths.
#: (No "gemm" dr mode: "stored" runs the same two GEMMs and one more, and its reference
#: battery, test_rel_attention_bwd.py, checks "gemm"; each candidate here re-runs a whole
#: backward under the interpreter in every tuned test.)
_TUNE_INTERPRETED = {"fwd": [{"carry": True}, {"tma": "on"}, {"fold": False}],
                     "dkdv": [{"dkdv": (2, 1)}],
                     "dq": [{"carry": True}, {"tma": "on"}, {"dr_mode": "atomic"},
                            {"dr_mode": "bulk"}, {"dr_mode": "stored"}],
                     "dr": [{"dr": (2, 1)}]}


def _candidates(kernel, D, dtype, tma_ok):
    """The tuner's candidates for one kernel: ``{}`` (the table launch) first, then those of
    :data:`_TUNE_CANDIDATES` that can differ from it here (TMA where the call can take it,
    the carried gather where it is not the default, atomic dr where it is not the mode and
    torch's deterministic algorithms are off; its TMA bulk reductions where TMA is too).
    dR's list is a function of the rows chosen before it (nothing after atomic dr: no dR
    kernel runs)."""
    tile = _config(D, None, dtype)[0]
    if _interpreting():
        listing = _TUNE_INTERPRETED[kernel]
    else:
        listing = _TUNE_CANDIDATES.get((kernel, tile, dtype.itemsize == 2), [])
    carry = _carry(D, dtype)
    table = _table_tma(kernel, tile, tile)
    same_tma = (lambda c: c.keys() == {"tma"}        # TMA as the table has it: its launch
                and check_tma_mode(c["tma"], table) == check_tma_mode(TMA_MODE, table))
    # the row bias as a product: the table launch's own where that takes no TMA tiles
    # (and a candidate that adds it to another one of the list, likewise)
    rest = lambda c: {k: v for k, v in c.items() if k != "rb_mma"}     # noqa: E731
    same_rb = (lambda c: "rb_mma" in c and (not rest(c) or rest(c) in listing)
               and (c["rb_mma"] == _rb_mma_on()
                    or not (tma_ok and check_tma_mode(TMA_MODE, table))))
    dr = _dr_mode(D, dtype) if kernel in ("dq", "dr") else None   # the table's dr mode
    deterministic = torch.are_deterministic_algorithms_enabled()   # no atomic dr then
    adds = ("atomic", "bulk")
    no_dr_kernel = adds + ("gemm", "stored")
    out = [{}] + [c for c in listing
                  if (tma_ok or ("tma" not in c and c.get("dr_mode") != "bulk"))
                  and c.get("carry", not carry) != carry
                  and ("dr_mode" not in c or c["dr_mode"] != dr)
                  and not (deterministic and c.get("dr_mode") in adds) and not same_tma(c)
                  and not same_rb(c)]
    if kernel == "dr":
        return lambda chosen: [{}] if chosen.get("dr_mode", dr) in no_dr_kernel else out
    return out


#: Bytes of score-sized buffers (DR_MODE "gemm": dS; "stored": dS and P) up to which the
#: tuner tries those modes: beyond, a first call would allocate (and leave in torch's
#: cache) that much only to time a candidate. Asked for by name they run at any size.
STORED_TUNE_BYTES = 1 << 30


def _fitting(candidates, pairs: int, itemsize: int):
    """``candidates`` (a list, or a function of the rows chosen before) without the
    stored-dS modes whose buffers, ``pairs`` score pairs of ``itemsize`` bytes per plane,
    exceed :data:`STORED_TUNE_BYTES`."""
    planes = {"gemm": 1, "stored": 2}

    def keep(c):
        return pairs * itemsize * planes.get(c.get("dr_mode"), 0) <= STORED_TUNE_BYTES
    if callable(candidates):
        return lambda chosen: [c for c in candidates(chosen) if keep(c)]
    return [c for c in candidates if keep(c)]


def _tuned(kernels, q, dims, flags, run, outputs):
    """``run()`` (a launcher call writing ``outputs``, a list or a function returning it),
    through the tuner where it is on for q's device (kernels/_tune.py). flags: what else
    makes a call of another kind (mask and term flags, split-K)."""
    if not _tune.wanted(q.device):
        return run()
    B, H, Tq, Tk, D = dims
    tma_ok = q.dtype in TMA_DTYPES and _has_tma(q.device)
    size = _tune.size_class
    kind = ("rel_attention", kernels, D, q.dtype, dot_precision(q.dtype), *flags, tma_ok,
            TMA_MODE, DR_MODE, torch.are_deterministic_algorithms_enabled(),
            size(B * H), size(Tq), size(Tk))
    stages = [(name, _fitting(_candidates(name, D, q.dtype, tma_ok), B * H * Tq * Tk,
                              q.dtype.itemsize)) for name in kernels]
    return _tune.call(kind, stages, run, outputs, q.device, q.dtype)


#: Key blocks from which the dK/dV and dR kernels, which multiply a whole band per tile,
#: take it in two halves of BLOCK_N one after the other (dK/dV: the two chunks of r rows
#: of the position term; dR: the two halves of a query block's band of keys,
#: :func:`_rel_dr_ds` per half) instead of ``2·BLOCK_N`` at once: half the live band tile.
#: sm_90 spill stores per thread, causal, 64 x 64 bf16 tiles (D 64): dK/dV 40 B -> 0, dR
#: 472 -> 148 (60 with its index tensors formed per tile); with 32 x 32 tiles halves spill
#: more (bf16 D 128: dK/dV 0 -> 168, dR 16 -> 96; fp32 D 128: dK/dV 248 -> 1,816, dR 612 -> 5,612), so they keep the whole band. Tests
#: lower it to run halves in the interpreter.
HALVES_MIN_BLOCK = 64


#: Queries up to which the forward takes the decoding tile shape (see :func:`_config`).
DECODE_MAX_Q = 16


#: SM count the split decision assumes where no GPU is present (an H100 SXM).
DEFAULT_SMS = 132


def key_splits(programs: int, Tk: int, block_n: int, num_warps: int,
               sms: int = DEFAULT_SMS) -> int:
    """Key splits for a forward grid of ``programs`` (b, h, query block) programs, each
    walking ``Tk`` keys ``block_n`` at a time, on a GPU of ``sms`` SMs. Pure: the decision
    logic, testable anywhere.

    The GPU holds ``sms · max(1, 16 // num_warps)`` programs at once (16 resident warps
    per SM, a quarter of Hopper's 64: what two to four of these tiles leave room for in
    registers and shared memory; a guess, not measured). A grid at least that large is
    not split. A smaller one (XL evaluation: 8 streams × 8 heads × 4 blocks of 32 queries
    = 256 programs against 528 slots; decoding) is split into the smallest count whose
    last wave is within 85% of the best wave efficiency (``waves / ⌈waves⌉``) reachable
    with at most 64 splits of at least 4 key blocks each."""
    slots = sms * max(1, 16 // num_warps)
    most = min(Tk // (4 * block_n), 64)
    if programs >= slots or most < 2:
        return 1

    def efficiency(s):
        waves = programs * s / slots
        return waves / -(-waves // 1)
    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= 0.85 * best)


def decode_splits(B: int, H: int, Tq: int, Tk: int, D: int, device,
                  dtype: torch.dtype = torch.float16) -> int:
    """The number of key splits the forward picks when none is given: :func:`key_splits`
    with the device's SM count on CUDA; 1 on CPU and in the interpreter (a split costs
    time there and gains nothing)."""
    device = torch.device(device)
    if device.type != "cuda" or _interpreting():
        return 1
    bm, bn, _, _, warps, _ = _config(D, Tq, dtype)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return key_splits(B * H * cdiv(Tq, bm), Tk, bn, warps, sms)


@triton.jit
def _rel_bwd_prep_kernel(
    DO, O,          # dout, out [B, H, Tq, D], any strides
    DELTA,          # [B, H, Tq] fp32 contiguous, written: Δ_i = Σ_d dO_id · O_id
    Q,              # q [B, H, Tq, D], any strides
    U, W,           # r_w_bias, r_r_bias [H, D] contiguous
    QU, QW,         # [B, H, Tq, D] contiguous, written: q + u, q + w in QU's dtype
    SEG_E, RSB,     # HAS_SEG: seg_embed [2, H, D], r_s_bias [H, D] contiguous
    EF,             # HAS_SEG: [B, H, Tq, 2] fp32 contiguous, written: (q + r_s_bias)·
                    # seg_embed[0], (q + r_s_bias)·seg_embed[1]
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_qb, stride_qh, stride_qm, stride_qd,
    H, Tq, D,
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    HAS_SEG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """What the backward's dK/dV and dR kernels need per query row before their loops: Δ
    (``kernels._common._bwd_delta_kernel``, called here), their query operands ``q + u`` and
    ``q + w`` summed in fp32 and rounded once to QU's dtype, and with segments the row's two
    segment terms, summed in fp32 (those kernels loaded q and formed all of them at every
    tile before)."""
    _bwd_delta_kernel(DO, O, DELTA, stride_dob, stride_doh, stride_dom, stride_dod,
                      stride_ob, stride_oh, stride_om, stride_od, H, Tq, D, BH0, BLOCK_M,
                      BLOCK_D)
    bh = tl.program_id(1) + BH0
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    w = tl.load(W + h * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    out_off = (bh.to(tl.int64) * Tq + offs_m[:, None]) * D + offs_d[None, :]
    tl.store(QU + out_off, (q + u[None, :]).to(QU.dtype.element_ty), mask=mask)
    tl.store(QW + out_off, (q + w[None, :]).to(QW.dtype.element_ty), mask=mask)
    if HAS_SEG:
        ef_same, ef_diff = _seg_rows(q, RSB, SEG_E, h, H, D, offs_d)
        ef = EF + (bh.to(tl.int64) * Tq + offs_m) * 2
        tl.store(ef, ef_same, mask=offs_m < Tq)
        tl.store(ef + 1, ef_diff, mask=offs_m < Tq)


def _bwd_prep(do, out, q, u, w, dtype, seg_embed=None, r_s_bias=None):
    """(Δ fp32 ``[B, H, Tq]``, q + u, q + w ``[B, H, Tq, D]`` contiguous in ``dtype``, the
    segment terms fp32 ``[B, H, Tq, 2]`` or Δ where there are no segments): one launch of
    :func:`_rel_bwd_prep_kernel` (seg_embed, r_s_bias contiguous)."""
    B, H, Tq, D = q.shape
    has_seg = seg_embed is not None
    delta = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    qu = torch.empty((B, H, Tq, D), dtype=dtype, device=q.device)
    qw = torch.empty_like(qu)
    ef = torch.empty((B, H, Tq, 2), dtype=torch.float32, device=q.device) if has_seg else delta
    if delta.numel() == 0:
        return delta, qu, qw, ef
    block_m, block_d = delta_blocks(D)
    for bh0, n in bh_chunks(B * H):
        fast(_rel_bwd_prep_kernel)[(cdiv(Tq, block_m), n)](
            do, out, delta, q, u, w, qu, qw, seg_embed if has_seg else u,
            r_s_bias if has_seg else u, ef, *do.stride(), *out.stride(), *q.stride(), H, Tq,
            D, bh0, HAS_SEG=has_seg, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)
    return delta, qu, qw, ef


@triton.jit
def _row_bias_kernel(
    R, stride_rh, stride_rm, stride_rd,  # r [H, R, D], any strides
    U, W,                   # r_w_bias, r_r_bias [H, D] contiguous
    RB,                     # table [H, width] fp32 (SPLIT: [H, width, 16] bf16) contiguous,
                            # written (every entry)
    R_len, D, pad, width,   # width >= R_len + 2·pad
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,    # bf16 halves: column 0 the value rounded, 1 the rest, 2-15 zero
):
    """One block of table entries of one head: ``(w − u)·r_m`` for r's rows, 0 in the pad."""
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)        # table rows
    m = t - pad                                                   # r's rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    wu = (tl.load(W + h * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
          - tl.load(U + h * D + offs_d, mask=d_ok, other=0.0).to(tl.float32))
    in_r = (m >= 0) & (m < R_len)
    r = tl.load(R + h * stride_rh + m[:, None] * stride_rm + offs_d[None, :] * stride_rd,
                mask=in_r[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    val = tl.sum(r * wu[None, :], 1)
    if SPLIT:
        hi = val.to(tl.bfloat16)
        lo = (val - hi.to(tl.float32)).to(tl.bfloat16)
        k = tl.arange(0, 16)[None, :]
        tile = tl.where(k == 0, hi.to(tl.float32)[:, None],
                        tl.where(k == 1, lo.to(tl.float32)[:, None], 0.0))
        tl.store(RB + (h * width + t[:, None]) * 16 + k, tile.to(tl.bfloat16),
                 mask=(t < width)[:, None])
    else:
        tl.store(RB + h * width + t, val, mask=t < width)


def row_bias_table(r, r_w_bias, r_r_bias, pad: int, split: bool = False):
    """``(r_r_bias − r_w_bias)·r_m`` for every row m of r: fp32 ``[H, R]`` (r ``[H, R, D]``,
    the biases ``[H, D]`` contiguous), the row bias the forward and dQ kernels add to their
    ``(q + r_w_bias)·rᵀ`` tiles (:func:`_rb_rows`), products and sums in fp32 (as the
    kernels formed it from the r tile before). A view into zeros ``pad`` rows wide on either
    side: a tile's band reaches at most BLOCK_M rows before row 0 and 2·BLOCK_N past row
    R − 1 (the bounds of ``rel_attention``'s r check, the causal diagonal and the key range),
    so the kernels read it without a mask; pad = BLOCK_M + 2·BLOCK_N. One launch
    (:func:`_row_bias_kernel`), the pad written with the rest.

    ``split``: ``[H, R, 16]`` bf16 instead (a view of ``[H, width, 16]``: a TMA view), the
    tiles :func:`_rb_add` multiplies: column 0 each value rounded to bf16, column 1 the
    rest rounded, 2-15 zero (the two sum to the value within ~2^-16 of it)."""
    H, R, D = r.shape
    width = R + 2 * pad
    shape = (H, width, 16) if split else (H, width)
    table = torch.empty(shape, dtype=torch.bfloat16 if split else torch.float32,
                        device=r.device)
    if H > 0:
        block_r = 64 if D <= 128 else 32
        fast(_row_bias_kernel)[(cdiv(width, block_r), H)](
            r, *r.stride(), r_w_bias, r_r_bias, table, R, D, pad, width,
            BLOCK_R=block_r, BLOCK_D=max(16, next_pow2(D)), SPLIT=split, num_warps=4)
    return table[:, pad:pad + R]


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
    if B * H * Tq * D == 0 or Tk == 0:
        return (q.new_zeros((B, H, Tq, D)),
                torch.full((B, H, Tq), float("inf"), dtype=torch.float32, device=q.device))
    out = _new_output((B, H, Tq, D), q.dtype, q.device)
    lse = _new_output((B, H, Tq), torch.float32, q.device)      # every row written
    kpm, rank, kv_end, mstrides = _mask_args(q, key_padding_mask, perm_rank)
    has_seg = seg_embed is not None
    if has_seg:
        sq, sk = (s.to(torch.int32).contiguous() for s in (seg_q, seg_k))  # unit stride
        se, rsb = seg_embed.contiguous(), r_s_bias.contiguous()
    else:
        sq = sk = se = rsb = kv_end
    bm, bn, bd, band, warps, stages = _config(D, Tq, q.dtype)
    if num_splits is None:
        num_splits = decode_splits(B, H, Tq, Tk, D, q.device, q.dtype)
    if num_splits < 1:
        raise ValueError(f"rel_attention_forward: num_splits must be >= 1, got {num_splits}")
    num_splits, keys_per_split, o_target, l_target, o_strides, l_strides, split_strides = \
        _split_targets(out, lse, B, H, Tq, Tk, D, bn, num_splits)
    split = num_splits > 1
    _rb_mma_on()                        # a bad CTXFAST_REL_RB_MMA: refused before a launch
    _check_dr_mode_name()               # so is a bad CTXFAST_REL_BWD_DR (not at the backward)
    u, w = r_w_bias.contiguous(), r_r_bias.contiguous()
    rb = row_bias_table(r, u, w, bm + 2 * bn)
    tables = {}

    def split_table():  # made once, where a launch takes it (_rb_mma_args); never kept
        # from a run that compiles only (the tuner's candidates compiled ahead: its kernel
        # did not run, so the table holds nothing yet)
        if compiling_only():
            return row_bias_table(r, u, w, bm + 2 * bn, split=True)
        if not tables:
            tables["split"] = row_bias_table(r, u, w, bm + 2 * bn, split=True)
        return tables["split"]
    seed_arg = _seed_arg(q, dropout_p, seed)

    def run():          # the launch rows read here: the tuner's when it has chosen some
        warps, stages = _config(D, Tq, q.dtype)[4:]
        tma = _tma_args("fwd", ("KD", "VD", "RD"), (k, v, r.unsqueeze(0)), bm, bn, bd)
        rb_mma = _rb_mma_args(tma, q.dtype, bm, bn, split_table)
        for bh0, n in bh_chunks(B * H):
            fast(_rel_attn_fwd_kernel)[(cdiv(Tq, bm), n, num_splits)](
                q, k, v, r, u, rb, rb.stride(0), sq, sk, se, rsb, o_target, l_target, kpm, rank,
                kv_end, seed_arg,
                *q.stride(), *k.stride(), *v.stride(), *r.stride(), *o_strides, *l_strides,
                *split_strides, keys_per_split, *mstrides,
                sq.stride(0) if has_seg else 0, sk.stride(0) if has_seg else 0,
                H, Tq, Tk, Tk - Tq, D, r.shape[1], pos_start, window or 0, scale * LOG2E,
                float(dropout_p),
                bh0, CAUSAL=causal, HAS_KPM=key_padding_mask is not None,
                HAS_PERM=perm_rank is not None, PERM_STRICT=perm_strict, HAS_SEG=has_seg,
                DROPOUT=dropout_p > 0, WINDOW=window is not None, SPLIT_K=split,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, BAND=band,
                # (the interpreter gets bf16 dots wrong: fp32 products for bf16 calls, and for
                # fp16 ones with the bf16 row bias product; fp16's are exact in fp32 either way)
                UPCAST=_interpreting() and (q.dtype == torch.bfloat16 or bool(rb_mma)),
                PRECISION=dot_precision(q.dtype), CARRY=_carry(D, q.dtype),
                FOLD=_fold_scale(scale) and _override("fold") is not False,
                num_warps=warps, num_stages=stages, **tma, **rb_mma, **_reg_cap("fwd"),
            )
        if split:
            _combine_splits(o_target, l_target, out, lse)
    if Tq <= DECODE_MAX_Q:          # the decoding tile: one launch row, nothing to tune
        run()
    else:
        _tuned(("fwd",), q, (B, H, Tq, Tk, D), (causal, key_padding_mask is not None,
                                                perm_rank is not None, has_seg,
                                                dropout_p > 0, window is not None, split),
               run, (out, lse))
    return out, lse


def rel_attention_backward(do, q, k, v, r, r_w_bias, r_r_bias, out, lse, *, causal=True,
                           pos_start=None, window=None, key_padding_mask=None, perm_rank=None,
                           perm_strict=False, seg_q=None, seg_k=None, seg_embed=None,
                           r_s_bias=None, scale=None, dropout_p=0.0, seed=None):
    """Gradients of :func:`rel_attention_forward`'s ``out``: (dq, dk, dv, dr, d_r_w_bias,
    d_r_r_bias, d_seg_embed, d_r_s_bias); the last two are None without segments."""
    do = int32_addressable(do)
    B, H, Tq, D = q.shape
    Tk, R = k.shape[2], r.shape[1]
    pos_start = Tk - 1 if pos_start is None else pos_start
    scale = D ** -0.5 if scale is None else scale
    has_seg = seg_embed is not None
    _dr_mode(D, q.dtype)                            # refused before any launch
    check_tma_mode(_override("tma", TMA_MODE))               # so is this
    _tune.check_mode()                                       # and CTXFAST_AUTOTUNE
    # every element below is written by a kernel (the grids cover all rows; each program
    # stores unconditionally), so no zero fill, except when there is nothing to compute
    work = q.numel() > 0 and Tk > 0
    new = _new_output if work else (lambda shape, dtype, device:
                                    torch.zeros(shape, dtype=dtype, device=device))
    dk = new((B, H, Tk, D), k.dtype, k.device)
    dv = new((B, H, Tk, D), v.dtype, v.device)
    # dq in q's dtype, or fp32 when the launcher adds the segment term to it
    dq = new((B, H, Tq, D), torch.float32 if has_seg else q.dtype, q.device)
    dr = torch.zeros((H, R, D), dtype=torch.float32, device=q.device) if not work else None
    seg_a = new((B, H, Tq, 2), torch.float32, q.device) if has_seg else dq   # never read
    if not work:
        d_rw, d_rr = (torch.zeros((H, D), dtype=torch.float32, device=q.device) for _ in "rr")
    else:
        u, w = r_w_bias.contiguous(), r_r_bias.contiguous()
        kpm, rank, kv_end, mstrides = _mask_args(q, key_padding_mask, perm_rank)
        if has_seg:
            sq, sk = (s.to(torch.int32).contiguous() for s in (seg_q, seg_k))  # unit stride
            se, rsb = seg_embed.contiguous(), r_s_bias.contiguous()
        else:
            sq = sk = se = rsb = kv_end
        # Δ [B, H, Tq]; q + u, q + w [B, H, Tq, D]; the segment terms [B, H, Tq, 2] (or Δ)
        delta, qu, qw, ef = _bwd_prep(do, out, q, u, w, k.dtype, *((se, rsb) if has_seg else ()))
        bm, bn, bd, band, _, _ = _config(D, None, q.dtype)      # (tiles are not tuned)
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
            UPCAST=_interpreting() and q.dtype == torch.bfloat16, PRECISION=dot_precision(q.dtype))
        rb = row_bias_table(r, u, w, bm + 2 * bn)
        seed_arg = _seed_arg(q, dropout_p, seed)
        done = {}

        def run():      # the launch rows read here: the tuner's when it has chosen some
            mode = _dr_mode(D, q.dtype)
            atomic = mode != "kernel"
            launch = {k: dict(num_warps=w_, num_stages=s_, **_reg_cap(k))
                      for k, (w_, s_) in _bwd_launch(D, q.dtype, atomic).items()}
            stored = mode in ("gemm", "stored")     # dS (and P) stored, summed by GEMMs
            if mode != "stored":                     # ("stored": dK, dV by a GEMM below)
                for bh0, n in bh_chunks(B * H):
                    fast(_rel_attn_bwd_dkdv_kernel)[(cdiv(Tk, bn), n)](
                        k, v, do, qu, r, rb, rb.stride(0), sq, sk, ef, lse, delta, dk, dv,
                        kpm, rank, kv_end, seed_arg, *common, bh0, **flags, **launch["dkdv"],
                        HALVES=bn >= HALVES_MIN_BLOCK)
            d_bias = _new_output((B, H, 2, cdiv(Tq, bm), D), torch.float32, q.device)
            # stored: dq's two terms apart (fp32), dS (and P), the keys each block stored
            dq_out = torch.empty_like(dq, dtype=torch.float32) \
                if stored and dq.dtype != torch.float32 else dq
            if stored:
                planes = torch.empty((2 if mode == "stored" else 1, B, H, Tq, Tk),
                                     dtype=k.dtype, device=q.device)
                if _interpreting():     # tests: what no block stored must never be read
                    planes.fill_(float("nan"))
                dr_acc = planes[0]
                span = torch.empty((B * H, cdiv(Tq, bm), 2), dtype=torch.int32,
                                   device=q.device)
                bulk = dict(DR_GEMM=True, DS_SPAN=span, STORE_P=mode == "stored",
                            P_OFF=dr_acc.numel() if mode == "stored" else 0)
            else:
                dr_acc = torch.zeros((H, R, D), dtype=torch.float32, device=q.device) \
                    if atomic else dq
                bulk = _dr_bulk_args(dr_acc, bn, bd) if mode == "bulk" else {}
            tma = _tma_args("dq", ("KD", "VD", "RD"), (k, v, r.unsqueeze(0)), bm, bn, bd)
            for bh0, n in bh_chunks(B * H):
                fast(_rel_attn_bwd_dq_kernel)[(cdiv(Tq, bm), n)](
                    q, k, v, do, r, u, w, sq, sk, se, rsb, lse, delta, rb, rb.stride(0), dq_out,
                    d_bias, seg_a, dr_acc,
                    kpm, rank, kv_end, seed_arg, *common, bh0, **flags, **launch["dq"],
                    ATOMIC_DR=atomic, CARRY=_carry(D, q.dtype), **tma, **bulk)
            if stored:
                br = 16 if _interpreting() else 64 if k.dtype.itemsize == 2 else 32
                c = pos_start - (Tk - Tq)
                if mode == "stored":
                    for bh0, n in bh_chunks(B * H):
                        fast(_rel_dkdv_gemm_kernel)[(cdiv(Tk, br), n)](
                            dr_acc, planes[1], span, qu, do, dk, dv, kv_end, *do.stride(),
                            H, Tq, Tk, Tk - Tq, D, window or 0, scale, bh0, CAUSAL=causal,
                            HAS_KPM=key_padding_mask is not None, WINDOW=window is not None,
                            Q_BLOCK=bm, BLOCK_N=br, BLOCK_M=br, BLOCK_D=bd,
                            UPCAST=flags["UPCAST"], PRECISION=flags["PRECISION"],
                            **_dr_gemm_launch())
                for bh0, n in bh_chunks(B * H):
                    fast(_rel_dqw_gemm_kernel)[(cdiv(Tq, bm), n)](
                        dr_acc, span, r, dq_out, d_bias, H, Tq, Tk, R, D, c, scale, *r.stride(),
                        bh0, BLOCK_M=bm, BLOCK_R=br, BLOCK_D=bd, UPCAST=flags["UPCAST"],
                        PRECISION=flags["PRECISION"], **_dr_gemm_launch())
                if dq_out is not dq:
                    dq.copy_(dq_out)
                dr_out = _new_output((H, R, D), torch.float32, q.device)
                fast(_rel_dr_gemm_kernel)[(cdiv(R, br), H)](
                    dr_acc, span, qw, dr_out, B, H, Tq, Tk, R, D, c,
                    c + (Tk - Tq) + 1 if causal else R, scale, *qw.stride(),
                    Q_BLOCK=bm, BLOCK_R=br, BLOCK_K=br, BLOCK_D=bd,
                    UPCAST=flags["UPCAST"], PRECISION=flags["PRECISION"],
                    **_dr_gemm_launch())
                done["dr"] = dr_out
            elif atomic:
                done["dr"] = dr_acc.mul_(scale)
            else:
                dr_b = _new_output((B, H, R, D), torch.float32, q.device)
                for bh0, n in bh_chunks(B * H):
                    fast(_rel_attn_bwd_dr_kernel)[(cdiv(R, bn), n)](
                        k, v, do, qu, qw, r, rb, rb.stride(0), sq, sk, ef, lse, delta, dr_b,
                        kpm, rank, kv_end, seed_arg, *common, bh0, **flags, **launch["dr"],
                        HALVES=bn >= HALVES_MIN_BLOCK)
                done["dr"] = dr_b.sum(0) if B > 1 else dr_b[0]
            done["d_rw"], done["d_rr"] = (d_bias[:, :, i].sum((0, 2)) for i in (0, 1))  # [H, D]
        _tuned(("dkdv", "dq", "dr"), q, (B, H, Tq, Tk, D),
               (causal, key_padding_mask is not None, perm_rank is not None, has_seg,
                dropout_p > 0, window is not None, False), run,
               lambda: [dq, dk, dv, done["dr"], done["d_rw"], done["d_rr"]]
               + ([seg_a] if has_seg else []))
        d_rw, d_rr, dr = done["d_rw"], done["d_rr"], done["dr"]
    d_seg_embed = d_r_s_bias = None
    if has_seg:
        se = seg_embed.float()                                            # [2, H, D]
        qs = q.float() + r_s_bias.float()[None, :, None]                  # [B, H, Tq, D]
        d_qs = seg_a[..., 0:1] * se[0][None, :, None] + seg_a[..., 1:2] * se[1][None, :, None]
        dq = dq + d_qs
        # contiguous, as the op's fake declares it (einsum's strides are its own: under
        # torch.compile inductor checks them)
        d_seg_embed = torch.einsum("bhis,bhid->shd", seg_a, qs).to(seg_embed.dtype) \
            .contiguous()
        d_r_s_bias = d_qs.sum((0, 2)).to(r_s_bias.dtype)
    return (dq.to(q.dtype), dk, dv, dr.to(r.dtype), d_rw.to(r_w_bias.dtype),
            d_rr.to(r_r_bias.dtype), d_seg_embed, d_r_s_bias)
