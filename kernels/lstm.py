"""LSTM recurrence with DropConnect on ``w_hh``, projection and clipping, Triton, forward
and backward through time (one layer, one direction, all time steps per call).

Shapes: ``xw [T, B, 4H]`` (the input projection of all steps, ``x @ w_ihᵀ + b_ih + b_hh``,
computed outside), ``h0 [B, P]``, ``c0 [B, H]``, ``w_hh [4H, P]``, ``mask [4H, P]`` (0/1)
or None, ``w_hr [P, H]`` or None (then ``P = H``). Outputs ``out [T, B, P]``,
``cells [T, B, H]`` (post-clip) and ``gates [T, B, 4H]`` (post-activation i, f, g, o), in
xw's dtype; arithmetic in fp32 (fp64 for fp64 inputs). The cell state is carried from
step to step in that accumulation dtype (a ``[B, H]`` workspace), so fp16/bf16 runs keep an
fp32 ``c``; ``cells`` holds its rounded copies for the backward. ``h`` is re-read from
``out`` (it enters the next step's dot in the weight's dtype either way).

Forward, per step ``t`` (``t_prev`` the step consumed before; ``reverse`` walks T-1 .. 0)::

    W   = w_hh * mask * scale
    z   = xw_t + h_{t-1} @ Wᵀ;  i, f, o = σ(z_i, z_f, z_o);  g = tanh(z_g)
    c_t = clamp(f c_{t-1} + i g, ±cell_clip);  hp_t = o tanh(c_t)
    h_t = clamp(hp_t @ w_hrᵀ, ±proj_clip)   (h_t = hp_t without w_hr)

Tiles. A *cell tile* is a block of batch rows and a block of hidden units ``j``: it loads
the rows ``j, H+j, 2H+j, 3H+j`` of ``w_hh`` (the four gates of its units) as one
``[4·BLOCK_H, BLOCK_K]`` tile per step of ``P``, multiplies the mask into the tile as it is
loaded (or, from :data:`PREMASK_MIN_T` steps on, reads a per-call copy ``w_hh · mask`` made
once; the module's weight is never written) and accumulates ``h_{t-1} @ Wᵀ`` with one dot; then
it applies the gates, the cell update and the clip and writes ``gates_t``, ``c_t`` and
``hp_t`` (:func:`_cell_fwd_tile`). With a projection a *projection tile* (batch rows x a
block of ``P``) computes ``h_t = clamp(hp_t @ w_hrᵀ)`` (:func:`_proj_fwd_tile`).

One launch for all T steps (:func:`_lstm_fwd_kernel`, persistent). The grid is at most one
program per SM, launched cooperatively (``launch_cooperative_grid``: the driver refuses a
grid that cannot be resident at once, so the barrier below cannot deadlock). Program ``p``
owns the tiles ``p, p + nprog, ...`` of each phase, the same ones every step, so the cell
state of a tile is only ever read by the program that wrote it. Per step::

    cell tiles (h_{t-1} -> gates_t, c_t, hp_t)   [grid barrier   proj tiles (hp_t -> h_t)]
    grid barrier

The barrier (:func:`_grid_sync`) is a monotonic counter: each program adds 1 (release) and
spins until it reads ``k · nprog`` (acquire) at its ``k``-th barrier; values written by other
programs (``h_{t-1}``, ``hp_t``) are loaded with ``.cg`` (L2, never a stale L1 line). The
recurrent weight is re-read from L2 every step (fp32 ULMFiT ``w_hh`` is 21 MB; the H100's L2
is 50 MB): no launch, no host round trip and no HBM pass per step.

The same kernel also runs *stepwise*: launched once per step and phase (``n0 .. n1`` one
step, ``RUN_*`` one phase, no barrier) where a cooperative launch is not possible (no
support in Triton, or the driver refused one on that device: :func:`_cooperative`), and
in Triton's interpreter, which runs the programs of a grid one after another (a barrier
across programs would wait forever there). The interpreter runs the persistent form with a
single program (which then owns every tile, and passes each barrier alone), so the CPU tests
run both forms.

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

The backward is persistent the same way (:func:`_lstm_bwd_kernel`). Per step, last first::

    cell tiles (dh̃_t -> dz_t = grad_xw_t, dc)    grid barrier
    dh tiles (batch rows x a block of P: dh̃ of the step before = epilogue(dz_t @ W))
    grid barrier

A cell tile runs the cell backward of its units (with ``dh̃_t @ w_hr`` fused in,
:func:`_cell_bwd_tile`); a dh tile computes ``dz_t @ (w_hh · mask) · scale`` over all ``4H``
with the mask applied in-tile and the next ``dh̃`` (``+ grad_out``, proj-clip gate) as its
epilogue, or ``grad_h0`` after the first step (:func:`_dh_bwd_tile`). The weight gradients
are one GEMM each over all steps at the end::

    grad_w_hh = (Σ_t dz_tᵀ h_{t-1}) · mask · scale      grad_w_hr = Σ_t dh̃_tᵀ hp_t,
    hp_t = o_t tanh(c_t) recomputed from the saved gates and cells

Split-K (:data:`BWD_SPLIT_K`): the dh product is split over the ``4H`` gate columns
instead, ``S_k`` the k-th slice of them::

    part_k = dz_t[:, S_k] @ (w_hh · mask)[S_k, :] · scale        (product tiles, fp32)
    grid barrier
    dh̃ of the step before = grad_out + Σ_k part_k               (in that step's cell tiles;
                                  with a projection in reduction tiles, gated, then a barrier)

so a product tile reads 1/KSPLIT of dz_t instead of all of it, and the sum costs the cell
tile KSPLIT loads of its own units; ``grad_h0 = Σ_k part_k`` of the last step walked.

(fp16/bf16: GEMMs in that dtype, float32 accumulation; fp32 and fp64 in their own).

Not yet measured on a GPU (written without one): the tile sizes and the program count are
first guesses, and the dots are plain ``tl.dot`` on the tensor cores (fp16/bf16; fp32 as
tf32x3 by default, :data:`FP32_PRECISION`; fp64 as FMA).
"""
import functools
import math
import warnings
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import _tune
from ._common import _dot, _interpreting, _precision, _rnn_tf32_allowed, cdiv, next_pow2
from ._launch import fast


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
def _apply_mask(w, m):
    """``w · m`` for a 0/1 DropConnect mask tile; at 16 bits formed in fp32 and rounded
    back: exact (so bitwise the host's ``w_hh · mask``, NaN kept as there), and right under
    the interpreter, whose bf16 arithmetic works on the raw 16-bit patterns. fp32 and fp64
    in their own dtype (through fp32, fp64 weights lost their low bits: gradcheck failed)."""
    if w.dtype.is_fp16() or w.dtype.is_bf16():
        return (w.to(tl.float32) * m.to(tl.float32)).to(w.dtype)
    return w * m.to(w.dtype)


@triton.jit
def _clamp(x, clip):
    """clamp(x, ±clip) with NaN kept, as torch.clamp (the default min / max return the
    other operand: NaN became -clip, a finite value, and a diverged run went unseen)."""
    nan: tl.constexpr = tl.PropagateNan.ALL
    return tl.minimum(tl.maximum(x, -clip, propagate_nan=nan), clip, propagate_nan=nan)


@triton.jit
def _clamp_store(x, clip, below, ty: tl.constexpr):
    """clamp(x, ±clip) in dtype ty, for storing. `clip` is already a value of ty; an
    unclipped x (|x| < clip) that would round onto ±clip is stored as ±below (the value of
    ty one ulp inside) so that a stored ±clip always means "clipped": the backward's
    |stored| < clip test is then exact (fp16/bf16; fp32/fp64 never round onto it)."""
    x_st = _clamp(x, clip).to(ty)
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
def _grid_sync(sync_ptr, target):
    """Grid-wide barrier of a cooperative launch: count this program's arrival at
    ``sync_ptr`` (int32, zero at launch) and wait until ``target`` arrivals are counted
    (``k · nprog`` at a program's k-th barrier; the counter never resets). The CTA barrier
    first makes every warp's stores part of the release; the acquire orders the reads after."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _cell_fwd_tile(
    xw_ptr,      # [B, 4H] xw_t
    h_ptr,       # [B, P]  h_{t-1} (written by other programs: loaded through L2)
    c_ptr,       # [B, H]  ACC: in c_{t-1}, out c_t (post-clip): the cell state carried in
                 #         the accumulation dtype (fp32 for fp16/bf16), never re-read rounded
    w_ptr,       # [4H, P] w_hh
    m_ptr,       # [4H, P] DropConnect mask (read only if HAS_MASK)
    gates_ptr,   # [B, 4H] out: post-activation i, f, g, o
    cells_ptr,   # [B, H]  out: c_t (post-clip)
    hp_ptr,      # [B, H]  out: o * tanh(c_t) (= h_t without projection)
    prm_ptr,     # [3] ACC dtype: scale, cell_clip (as stored), the stored value just below it
    bb, hb,      # the tile: batch block, hidden-unit block
    B, H, P,
    HAS_MASK: tl.constexpr, CELL_CLIP: tl.constexpr, ACC: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    STORE_HP: tl.constexpr,
    hs_ptr,      # [B, H]  out (STORE_H16): hp_t · h16_scale as fp16, the next step's operand
    h16_scale,   # 2^15 (|hp| <= 1)
    STORE_H16: tl.constexpr,
):
    """One cell tile of a step (see the module docstring); returns hp [BLOCK_B, BLOCK_H]
    in the accumulation dtype (0 for units past H), stored to hp_ptr if STORE_HP (and as
    fp16 to hs_ptr if STORE_H16)."""
    scale = tl.load(prm_ptr)
    offs_b = bb * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    b_in = offs_b < B
    h_in = offs_h < H
    # the tile's 4·BLOCK_H rows of W, gate-major: r = q·BLOCK_H + jj -> row q·H + j
    r = tl.arange(0, 4 * BLOCK_H)
    j = hb * BLOCK_H + r % BLOCK_H
    rows = (r // BLOCK_H) * H + j                                       # [4·BLOCK_H]
    rows_in = j < H
    io = b_in[:, None] & h_in[None, :]
    rowh = offs_b[:, None] * H + offs_h[None, :]
    # The step's input projection and c_{t-1}, loaded before the product loop: they do not
    # depend on h, so their latency passes under the loop instead of after it (the loop's
    # pipeline stages only the loads that feed its product).
    xw = tl.load(xw_ptr + offs_b[:, None] * (4 * H) + rows[None, :],
                 mask=b_in[:, None] & rows_in[None, :], other=0.0)
    c_prev = tl.load(c_ptr + rowh, mask=io, other=0.0)
    acc = tl.zeros((BLOCK_B, 4 * BLOCK_H), dtype=ACC)
    for k0 in range(0, P, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < P
        h = tl.load(h_ptr + offs_b[:, None] * P + offs_k[None, :],
                    mask=b_in[:, None] & k_in[None, :], other=0.0,
                    cache_modifier=".cg")                              # [BLOCK_B, BLOCK_K]
        w_offs = rows[:, None] * P + offs_k[None, :]                   # [4·BLOCK_H, BLOCK_K]
        w_mask = rows_in[:, None] & k_in[None, :]
        w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)
        if HAS_MASK:                                                   # DropConnect, in-tile
            w = _apply_mask(w, tl.load(m_ptr + w_offs, mask=w_mask, other=0.0))
        acc += _dot(h, tl.trans(w), UPCAST, PRECISION)
    z = acc * scale + xw.to(ACC)
    z_i, z_f, z_g, z_o = _split4(z, BLOCK_B, BLOCK_H)                  # 4 x [BLOCK_B, BLOCK_H]
    i = tl.sigmoid(z_i)
    f = tl.sigmoid(z_f)
    g = _tanh(z_g)
    o = tl.sigmoid(z_o)
    row4 = offs_b[:, None] * (4 * H) + offs_h[None, :]                 # gate i's column in [B, 4H]
    c = f * c_prev + i * g
    ty = gates_ptr.dtype.element_ty
    c_st = c.to(ty)
    if CELL_CLIP:
        cell_clip = tl.load(prm_ptr + 1)
        c_st = _clamp_store(c, cell_clip, tl.load(prm_ptr + 2), ty)
        c = _clamp(c, cell_clip)
    hp = o * _tanh(c)
    tl.store(gates_ptr + row4, i.to(ty), mask=io)
    tl.store(gates_ptr + row4 + H, f.to(ty), mask=io)
    tl.store(gates_ptr + row4 + 2 * H, g.to(ty), mask=io)
    tl.store(gates_ptr + row4 + 3 * H, o.to(ty), mask=io)
    tl.store(cells_ptr + rowh, c_st, mask=io)
    tl.store(c_ptr + rowh, c, mask=io)                                 # the carry
    if STORE_HP:
        tl.store(hp_ptr + rowh, hp.to(hp_ptr.dtype.element_ty), mask=io)
    if STORE_H16:               # |hp| <= 1: x 2^15 keeps 10 bits down to |hp| = 2^-29
        tl.store(hs_ptr + rowh, (hp * h16_scale).to(tl.float16), mask=io)
    return hp


@triton.jit
def _proj_fwd_tile(
    hp_ptr,      # [B, H] hp_t (written by other programs: loaded through L2)
    wr_ptr,      # [P, H] w_hr
    out_ptr,     # [B, P] out: h_t = clamp(hp_t @ w_hrᵀ, ±proj_clip)
    prm_ptr,     # [2] ACC dtype: proj_clip (as stored), the stored value just below it
    bb, pb,      # the tile: batch block, block of P
    B, H, P,
    PROJ_CLIP: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    hs_ptr,      # [B, P] out (STORE_H16): h_t · h16_scale as fp16, the next step's operand
    h16_scale,   # a power of two with proj_clip · h16_scale <= 2^15
    STORE_H16: tl.constexpr,
):
    offs_b = bb * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    b_in = offs_b < B
    p_in = offs_p < P
    acc = tl.zeros((BLOCK_B, BLOCK_P), dtype=ACC)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < H
        hp = tl.load(hp_ptr + offs_b[:, None] * H + offs_k[None, :],
                     mask=b_in[:, None] & k_in[None, :], other=0.0,
                     cache_modifier=".cg")                             # [BLOCK_B, BLOCK_K]
        wr = tl.load(wr_ptr + offs_p[None, :] * H + offs_k[:, None],
                     mask=k_in[:, None] & p_in[None, :], other=0.0)    # [BLOCK_K, BLOCK_P]
        acc += _dot(hp.to(wr.dtype), wr, UPCAST, PRECISION)
    ty = out_ptr.dtype.element_ty
    y = acc.to(ty)
    if PROJ_CLIP:
        y = _clamp_store(acc, tl.load(prm_ptr), tl.load(prm_ptr + 1), ty)
    tl.store(out_ptr + offs_b[:, None] * P + offs_p[None, :], y,
             mask=b_in[:, None] & p_in[None, :])
    if STORE_H16:
        tl.store(hs_ptr + offs_b[:, None] * P + offs_p[None, :],
                 (y.to(tl.float32) * h16_scale).to(tl.float16), mask=b_in[:, None] & p_in[None, :])


@triton.jit
def _proj_partial_tile(
    hp,          # [BLOCK_B, BLOCK_H] ACC: this cell tile's hp_t (0 past H)
    wr_ptr,      # [P, H] w_hr
    part_ptr,    # [n_hb, B, P] ACC out: this unit block's share of hp_t @ w_hrᵀ
    bb, hb,      # the cell tile: batch block, hidden-unit block
    B, H, P,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_PP: tl.constexpr,
):
    """PROJ_SPLIT: the projection's product split over the unit blocks, each cell tile
    multiplying the hp it just computed by its units' columns of w_hr (no hp round trip
    through memory, every program busy); :func:`_proj_reduce_tile` sums the blocks."""
    offs_b = bb * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    b_in = offs_b < B
    h_in = offs_h < H
    hp_op = hp.to(wr_ptr.dtype.element_ty)           # the operand the unsplit path stores
    base = part_ptr + hb.to(tl.int64) * B * P
    for p0 in range(0, P, BLOCK_PP):
        offs_p = p0 + tl.arange(0, BLOCK_PP)
        p_in = offs_p < P
        wr = tl.load(wr_ptr + offs_p[None, :] * H + offs_h[:, None],
                     mask=h_in[:, None] & p_in[None, :], other=0.0)    # [BLOCK_H, BLOCK_PP]
        part = _dot(hp_op, wr, UPCAST, PRECISION)                      # [BLOCK_B, BLOCK_PP]
        tl.store(base + offs_b[:, None] * P + offs_p[None, :], part,
                 mask=b_in[:, None] & p_in[None, :])


@triton.jit
def _proj_reduce_tile(
    part_ptr,    # [n_hb, B, P] ACC: the unit blocks' partial products (other programs')
    out_ptr,     # [B, P] out: h_t = clamp(Σ_hb part[hb], ±proj_clip)
    prm_ptr,     # [2] ACC dtype: proj_clip (as stored), the stored value just below it
    bb, rb,      # the tile: batch block, block of BLOCK_R columns of P
    B, P, n_hb,
    PROJ_CLIP: tl.constexpr, ACC: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, HB_CHUNK: tl.constexpr,
    hs_ptr,      # [B, P] out (STORE_H16): h_t · h16_scale as fp16, the next step's operand
    h16_scale,   # a power of two with proj_clip · h16_scale <= 2^15
    STORE_H16: tl.constexpr,
):
    """Sums the unit blocks' partials of a [BLOCK_B, BLOCK_R] tile of h_t, HB_CHUNK blocks
    a load (a fixed order: deterministic), then the proj clip."""
    e = tl.arange(0, BLOCK_B * BLOCK_R)
    b = bb * BLOCK_B + e // BLOCK_R
    p = rb * BLOCK_R + e % BLOCK_R
    e_in = (b < B) & (p < P)
    off = b.to(tl.int64) * P + p
    acc = tl.zeros((BLOCK_B * BLOCK_R,), dtype=ACC)
    for h0 in range(0, n_hb, HB_CHUNK):
        hbs = h0 + tl.arange(0, HB_CHUNK)
        v = tl.load(part_ptr + hbs[:, None].to(tl.int64) * B * P + off[None, :],
                    mask=(hbs < n_hb)[:, None] & e_in[None, :], other=0.0,
                    cache_modifier=".cg")                              # [HB_CHUNK, B_R]
        acc += tl.sum(v, axis=0)
    ty = out_ptr.dtype.element_ty
    y = acc.to(ty)
    if PROJ_CLIP:
        y = _clamp_store(acc, tl.load(prm_ptr), tl.load(prm_ptr + 1), ty)
    tl.store(out_ptr + off, y, mask=e_in)
    if STORE_H16:
        tl.store(hs_ptr + off, (y.to(tl.float32) * h16_scale).to(tl.float16), mask=e_in)


@triton.jit(do_not_specialize=["n0", "n1"])
def _lstm_fwd_kernel(
    xw_ptr,      # [T, B, 4H] x_t @ w_ihᵀ + biases, every step
    h0_ptr,      # [B, P]     h before the first step
    c_ptr,       # [B, H]     ACC: the carried cell state, c0 at launch (own tiles only)
    w_ptr,       # [4H, P]    w_hh
    m_ptr,       # [4H, P]    DropConnect mask (read only if HAS_MASK)
    wr_ptr,      # [P, H]     w_hr (read only if HAS_PROJ)
    gates_ptr,   # [T, B, 4H] out: post-activation i, f, g, o
    cells_ptr,   # [T, B, H]  out: c_t (post-clip)
    out_ptr,     # [T, B, P]  out: h_t
    hp_ptr,      # [B, H]     scratch (HAS_PROJ, not PROJ_SPLIT): hp_t of the step in flight
    part_ptr,    # [n_hb, B, P] ACC scratch (PROJ_SPLIT): the unit blocks' partial h_t
    prm_ptr,     # [5] ACC dtype: scale, cell clip (stored), below it, proj clip (stored), below it
    sync_ptr,    # [1] int32 barrier counter, zero at launch (used only if SYNC)
    w16_ptr,     # [4H, P] fp16 (H16): w_hh · mask · 2^e, the product operand after step 0
    hs_ptr,      # [2, B, P] fp16 scratch (H16): h · h16_scale of the last two steps
    prm16_ptr,   # [5] (H16): prm with scale / (2^e · h16_scale) in place of scale
    h16_scale,   # (H16) h's scale in hs: 2^15, or with a projection 2^k, proj_clip · 2^k <= 2^15
    T, B, H, P,
    n0, n1,      # this launch runs steps n0 .. n1-1 of the walk (t = n, or T-1-n if REVERSE)
    REVERSE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PROJ: tl.constexpr,
    CELL_CLIP: tl.constexpr, PROJ_CLIP: tl.constexpr,
    RUN_CELL: tl.constexpr, RUN_PROJ: tl.constexpr, SYNC: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, PROJ_SPLIT: tl.constexpr, BLOCK_PP: tl.constexpr,
    BLOCK_R: tl.constexpr, HB_CHUNK: tl.constexpr,
    H16: tl.constexpr, UPCAST16: tl.constexpr, BLOCK_K16: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_bb = tl.cdiv(B, BLOCK_B)
    n_cell = n_bb * tl.cdiv(H, BLOCK_H)
    n_hb = tl.cdiv(H, BLOCK_H)
    if PROJ_SPLIT:
        n_proj = n_bb * tl.cdiv(P, BLOCK_R)                            # reduction tiles
    else:
        n_proj = n_bb * tl.cdiv(P, BLOCK_P)
    s_g = tl.cast(B, tl.int64) * (4 * H)                               # step strides (int64)
    s_h = tl.cast(B, tl.int64) * H
    s_p = tl.cast(B, tl.int64) * P
    syncs = 0
    for n in range(n0, n1):
        if REVERSE:
            t = T - 1 - n
            tp = t + 1                                                 # the step before, in the walk
        else:
            t = n
            tp = t - 1
        if RUN_CELL:
            if n == 0:
                h_prev = h0_ptr
            else:
                h_prev = out_ptr + tp * s_p
            if HAS_PROJ:
                hp_dst = hp_ptr
            else:
                hp_dst = out_ptr + t * s_p
            for tile in range(pid, n_cell, nprog):
                if H16:                     # float32's products on fp16 operands
                    # the next step's h operand: written here (h = hp) or by the projection
                    hs_dst = hs_ptr + (n % 2) * s_p
                    if n == 0:              # h0 as given (any range): the float32 dots
                        hp = _cell_fwd_tile(xw_ptr + t * s_g, h0_ptr, c_ptr, w_ptr, m_ptr,
                                            gates_ptr + t * s_g, cells_ptr + t * s_h, hp_dst,
                                            prm_ptr, tile % n_bb, tile // n_bb, B, H, P,
                                            HAS_MASK, CELL_CLIP, ACC, UPCAST, PRECISION,
                                            BLOCK_B, BLOCK_H, BLOCK_K, not PROJ_SPLIT,
                                            hs_dst, h16_scale, not HAS_PROJ)
                    else:                   # |h| · h16_scale <= 2^15 from here on
                        hp = _cell_fwd_tile(xw_ptr + t * s_g, hs_ptr + ((n + 1) % 2) * s_p,
                                            c_ptr, w16_ptr, w16_ptr,
                                            gates_ptr + t * s_g, cells_ptr + t * s_h, hp_dst,
                                            prm16_ptr, tile % n_bb, tile // n_bb, B, H, P,
                                            False, CELL_CLIP, ACC, UPCAST16, "tf32",
                                            BLOCK_B, BLOCK_H, BLOCK_K16, not PROJ_SPLIT,
                                            hs_dst, h16_scale, not HAS_PROJ)
                else:
                    hp = _cell_fwd_tile(xw_ptr + t * s_g, h_prev, c_ptr, w_ptr, m_ptr,
                                        gates_ptr + t * s_g, cells_ptr + t * s_h, hp_dst,
                                        prm_ptr, tile % n_bb, tile // n_bb, B, H, P,
                                        HAS_MASK, CELL_CLIP, ACC, UPCAST, PRECISION,
                                        BLOCK_B, BLOCK_H, BLOCK_K, not PROJ_SPLIT,
                                        hp_dst, h16_scale, False)
                if PROJ_SPLIT:
                    _proj_partial_tile(hp, wr_ptr, part_ptr, tile % n_bb, tile // n_bb,
                                       B, H, P, UPCAST, PRECISION, BLOCK_B, BLOCK_H, BLOCK_PP)
        if HAS_PROJ:
            if SYNC:                                                   # hp_t complete
                syncs += 1
                _grid_sync(sync_ptr, syncs * nprog)
            if RUN_PROJ:
                for tile in range(pid, n_proj, nprog):
                    if PROJ_SPLIT:
                        _proj_reduce_tile(part_ptr, out_ptr + t * s_p, prm_ptr + 3,
                                          tile % n_bb, tile // n_bb, B, P, n_hb,
                                          PROJ_CLIP, ACC, BLOCK_B, BLOCK_R, HB_CHUNK,
                                          hs_ptr + (n % 2) * s_p, h16_scale, H16)
                    else:
                        _proj_fwd_tile(hp_ptr, wr_ptr, out_ptr + t * s_p, prm_ptr + 3,
                                       tile % n_bb, tile // n_bb, B, H, P, PROJ_CLIP, ACC,
                                       UPCAST, PRECISION, BLOCK_B, BLOCK_P, BLOCK_K,
                                       hs_ptr + (n % 2) * s_p, h16_scale, H16)
        if SYNC:                                                       # h_t complete
            syncs += 1
            _grid_sync(sync_ptr, syncs * nprog)


@triton.jit
def _cell_bwd_tile(
    dh_ptr,      # [B, P]  dh̃_t (w.r.t. the pre-clip h_t), ACC dtype (other programs wrote it)
    wr_ptr,      # [P, H]  w_hr (read only if HAS_PROJ)
    gates_ptr,   # [B, 4H] post-activation i, f, g, o of step t
    cells_ptr,   # [B, H]  c_t
    cprev_ptr,   # [B, H]  c_{t-1}
    gc_ptr,      # [B, H]  grad_cells_t
    dc_ptr,      # [B, H]  in: dc_{t+1}·f_{t+1} (w.r.t. c_t); out: dc̃ · f (w.r.t. c_{t-1}); ACC
    dz_ptr,      # [B, 4H] out: dz_t = grad_xw_t
    prm_ptr,     # [1] ACC dtype: cell_clip as stored in the cells' dtype
    bb, hb,      # the tile: batch block, hidden-unit block
    B, H, P,
    HAS_PROJ: tl.constexpr, CELL_CLIP: tl.constexpr, ACC: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    part_ptr,    # [KSPLIT, B, P] ACC: split-K partials of dz_{step walked before} @ W · scale
    go_ptr,      # [B, P]  grad_out_t (read with the partials)
    from_parts,  # KSPLIT > 0: dh̃_t = grad_out_t + Σ partials (else dh_ptr's, the first step)
    KSPLIT: tl.constexpr,   # > 0: the split-K backward; without projection dh̃_t comes from
                            # the partials here, with one from dh_ptr (the reduce phase's)
):
    offs_b = bb * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    b_in = offs_b < B
    h_in = offs_h < H
    io = b_in[:, None] & h_in[None, :]
    # the step's saved values and carried dc, loaded before dhp: none depends on it, so
    # their latency passes under the projection's product loop (HAS_PROJ) and the partials'
    # loads instead of after them
    row4 = offs_b[:, None] * (4 * H) + offs_h[None, :]
    rowh = offs_b[:, None] * H + offs_h[None, :]
    i = tl.load(gates_ptr + row4, mask=io, other=0.0).to(ACC)
    f = tl.load(gates_ptr + row4 + H, mask=io, other=0.0).to(ACC)
    g = tl.load(gates_ptr + row4 + 2 * H, mask=io, other=0.0).to(ACC)
    o = tl.load(gates_ptr + row4 + 3 * H, mask=io, other=0.0).to(ACC)
    c = tl.load(cells_ptr + rowh, mask=io, other=0.0).to(ACC)
    dc_in = (tl.load(dc_ptr + rowh, mask=io, other=0.0).to(ACC)
             + tl.load(gc_ptr + rowh, mask=io, other=0.0).to(ACC))
    c_prev = tl.load(cprev_ptr + rowh, mask=io, other=0.0).to(ACC)
    if (KSPLIT > 0) and (not HAS_PROJ):             # no projection: P = H, dhp = dh̃_t
        rowp = offs_b[:, None] * P + offs_h[None, :]
        if from_parts:
            dhp = tl.load(go_ptr + rowp, mask=io, other=0.0).to(ACC)
            for s in tl.static_range(KSPLIT):        # a fixed order: deterministic
                dhp += tl.load(part_ptr + tl.cast(B, tl.int64) * P * s + rowp, mask=io,
                               other=0.0, cache_modifier=".cg")
        else:
            dhp = tl.load(dh_ptr + rowp, mask=io, other=0.0, cache_modifier=".cg").to(ACC)
    elif HAS_PROJ:                                                     # dhp = dh̃ @ w_hr
        dhp = tl.zeros((BLOCK_B, BLOCK_H), dtype=ACC)
        for k0 in range(0, P, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_in = offs_k < P
            dh = tl.load(dh_ptr + offs_b[:, None] * P + offs_k[None, :],
                         mask=b_in[:, None] & k_in[None, :], other=0.0,
                         cache_modifier=".cg")                         # [BLOCK_B, BLOCK_K]
            wr = tl.load(wr_ptr + offs_k[:, None] * H + offs_h[None, :],
                         mask=k_in[:, None] & h_in[None, :], other=0.0)   # [BLOCK_K, BLOCK_H]
            dhp += _dot(dh.to(wr.dtype), wr, UPCAST, PRECISION)
    else:
        dhp = tl.load(dh_ptr + offs_b[:, None] * P + offs_h[None, :], mask=io, other=0.0,
                      cache_modifier=".cg").to(ACC)
    tc = _tanh(c)
    dc = dc_in + dhp * o * (1.0 - tc * tc)
    if CELL_CLIP:
        dc = tl.where(tl.abs(c) < tl.load(prm_ptr), dc, 0.0)
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


@triton.jit
def _dz_w_product(
    dz_ptr,      # [B, 4H] dz_t (other programs wrote it: loaded through L2)
    w_ptr,       # [4H, P] w_hh
    m_ptr,       # [4H, P] DropConnect mask (read only if HAS_MASK)
    offs_b, offs_p, b_in, p_in,     # the tile's batch rows and columns of P
    k_lo, k_len,  # the gate columns summed: k_lo + [0, k_len) (those past 4H are masked)
    H, P,
    HAS_MASK: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``dz_t[:, K] @ (w_hh · mask)[K, p-block]`` [BLOCK_B, BLOCK_N], ACC, over the gate
    columns K = k_lo + [0, k_len) (a constexpr k_len: a constant trip count)."""
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=ACC)
    for kk in range(0, k_len, BLOCK_K):
        offs_k = k_lo + kk + tl.arange(0, BLOCK_K)
        k_in = offs_k < 4 * H
        a = tl.load(dz_ptr + offs_b[:, None] * (4 * H) + offs_k[None, :],
                    mask=b_in[:, None] & k_in[None, :], other=0.0,
                    cache_modifier=".cg")                              # [BLOCK_B, BLOCK_K]
        w_offs = offs_k[:, None] * P + offs_p[None, :]                 # [BLOCK_K, BLOCK_N]
        w_mask = k_in[:, None] & p_in[None, :]
        w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)
        if HAS_MASK:
            w = _apply_mask(w, tl.load(m_ptr + w_offs, mask=w_mask, other=0.0))
        acc += _dot(a.to(w.dtype), w, UPCAST, PRECISION)
    return acc


@triton.jit
def _dh_epilogue(y, add_ptr, ref_ptr, prm_ptr, offs, io, has_prev,
                 PROJ_GATE: tl.constexpr, ACC: tl.constexpr):
    """dh̃ of the step before from its product ``y``: + grad_out (add_ptr) and the
    proj-clip gate of its out (ref_ptr, prm_ptr[2] the stored clip); nothing after the
    first step (``grad_h0``)."""
    if has_prev:
        y += tl.load(add_ptr + offs, mask=io, other=0.0).to(ACC)
        if PROJ_GATE:
            ref = tl.load(ref_ptr + offs, mask=io, other=0.0).to(ACC)
            y = tl.where(tl.abs(ref) < tl.load(prm_ptr + 2), y, 0.0)
    return y


@triton.jit
def _dh_bwd_tile(
    dz_ptr,      # [B, 4H] dz_t (other programs wrote it: loaded through L2)
    w_ptr,       # [4H, P] w_hh
    m_ptr,       # [4H, P] DropConnect mask (read only if HAS_MASK)
    add_ptr,     # [B, P]  grad_out of the step before (read only if has_prev)
    ref_ptr,     # [B, P]  out of the step before (read only if has_prev and PROJ_GATE)
    y_ptr,       # [B, P]  out, ACC dtype: dh̃ of the step before, or grad_h0
    prm_ptr,     # [3] ACC dtype: scale, cell clip, proj clip (as stored)
    bb, pb,      # the tile: batch block, block of P
    B, H, P, has_prev,
    HAS_MASK: tl.constexpr, PROJ_GATE: tl.constexpr, ACC: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y = (dz_t @ (w_hh · mask)) · scale, then + grad_out and the proj-clip gate of the
    step before (``dh̃``), or nothing more after the first step (``grad_h0``)."""
    offs_b = bb * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    b_in = offs_b < B
    p_in = offs_p < P
    acc = _dz_w_product(dz_ptr, w_ptr, m_ptr, offs_b, offs_p, b_in, p_in, 0, 4 * H, H, P,
                        HAS_MASK, ACC, UPCAST, PRECISION, BLOCK_B, BLOCK_P, BLOCK_K)
    io = b_in[:, None] & p_in[None, :]
    offs = offs_b[:, None] * P + offs_p[None, :]
    y = _dh_epilogue(acc * tl.load(prm_ptr), add_ptr, ref_ptr, prm_ptr, offs, io, has_prev,
                     PROJ_GATE, ACC)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=io)


@triton.jit
def _dh_part_tile(
    dz_ptr,      # [B, 4H] dz_t (other programs wrote it: loaded through L2)
    w_ptr,       # [4H, P] w_hh
    m_ptr,       # [4H, P] DropConnect mask (read only if HAS_MASK)
    part_ptr,    # [KSPLIT, B, P] ACC out: slice ks's share of dz_t @ (w_hh · mask) · scale
    prm_ptr,     # [1] ACC dtype: scale
    bb, pb, ks,  # the tile: batch block, block of P, slice of the 4H gate columns
    B, H, P,
    HAS_MASK: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_PS: tl.constexpr, BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr,
):
    """The split-K backward's product: ``part[ks] = dz_t[:, K_ks] @ W[K_ks, p-block] · scale``
    over the ks-th chunk of K_CHUNK of the 4H gate columns (the last chunk's columns past 4H
    are masked)."""
    offs_b = bb * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_p = pb * BLOCK_PS + tl.arange(0, BLOCK_PS)
    b_in = offs_b < B
    p_in = offs_p < P
    k_lo = ks * K_CHUNK
    acc = _dz_w_product(dz_ptr, w_ptr, m_ptr, offs_b, offs_p, b_in, p_in, k_lo, K_CHUNK,
                        H, P, HAS_MASK, ACC, UPCAST, PRECISION, BLOCK_B, BLOCK_PS, BLOCK_K)
    tl.store(part_ptr + ks.to(tl.int64) * B * P + offs_b[:, None] * P + offs_p[None, :],
             acc * tl.load(prm_ptr), mask=b_in[:, None] & p_in[None, :])


@triton.jit
def _dh_reduce_tile(
    part_ptr,    # [KSPLIT, B, P] ACC: the partials of the step just walked (other programs')
    add_ptr,     # [B, P]  grad_out of the step before (read only if has_prev)
    ref_ptr,     # [B, P]  out of the step before (read only if has_prev and PROJ_GATE)
    y_ptr,       # [B, P]  ACC out: dh̃ of the step before, or grad_h0
    prm_ptr,     # [3] ACC dtype: scale, cell clip, proj clip (as stored)
    bb, pb,      # the tile: batch block, block of P
    B, P, has_prev,
    PROJ_GATE: tl.constexpr, ACC: tl.constexpr, KSPLIT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_PS: tl.constexpr,
):
    """The split-K partials summed (a fixed order), then what :func:`_dh_bwd_tile`'s
    epilogue adds: + grad_out and the proj-clip gate of the step before (``dh̃``), or
    nothing after the first step (``grad_h0``)."""
    offs_b = bb * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_p = pb * BLOCK_PS + tl.arange(0, BLOCK_PS)
    io = (offs_b < B)[:, None] & (offs_p < P)[None, :]
    offs = offs_b[:, None] * P + offs_p[None, :]
    y = tl.zeros((BLOCK_B, BLOCK_PS), dtype=ACC)
    for s in tl.static_range(KSPLIT):
        y += tl.load(part_ptr + tl.cast(B, tl.int64) * P * s + offs, mask=io, other=0.0,
                     cache_modifier=".cg")
    y = _dh_epilogue(y, add_ptr, ref_ptr, prm_ptr, offs, io, has_prev, PROJ_GATE, ACC)
    tl.store(y_ptr + offs, y, mask=io)


@triton.jit
def _dh_dests(dh_ptr, grad_out_ptr, out_ptr, gh0_ptr, off, has_prev):
    """(destination of dh̃ of the step before, its grad_out, its out) at offset ``off`` of
    the step before, or (grad_h0, unused, unused) after the first step."""
    if has_prev:
        y_dst = dh_ptr + off
        add = grad_out_ptr + off
        ref = out_ptr + off
    else:
        y_dst = gh0_ptr
        add = grad_out_ptr
        ref = out_ptr
    return y_dst, add, ref


@triton.jit(do_not_specialize=["n0", "n1"])
def _lstm_bwd_kernel(
    grad_out_ptr,    # [T, B, P]  dL/dh_t from above
    grad_cells_ptr,  # [T, B, H]  dL/dc_t from above
    out_ptr,         # [T, B, P]  forward h_t (proj-clip gate)
    cells_ptr,       # [T, B, H]  forward c_t
    gates_ptr,       # [T, B, 4H] forward gates
    c0_ptr,          # [B, H]     c before the first step
    w_ptr,           # [4H, P]    w_hh
    m_ptr,           # [4H, P]    DropConnect mask (read only if HAS_MASK)
    wr_ptr,          # [P, H]     w_hr (read only if HAS_PROJ)
    dh_ptr,          # [T, B, P]  ACC: in: dh̃ of the first backward step; out: every dh̃_t
                     #            (KSPLIT without projection: the first step's only)
    dc_ptr,          # [B, H]     ACC: the carried dc, zero at launch; out: grad_c0
    dz_ptr,          # [T, B, 4H] out: grad_xw
    gh0_ptr,         # [B, P]     ACC out: grad_h0
    part_ptr,        # [KSPLIT, B, P] ACC scratch (KSPLIT > 0): the split-K partials of dh̃
    prm_ptr,         # [3] ACC dtype: scale, cell clip (stored), proj clip (stored)
    sync_ptr,        # [1] int32 barrier counter, zero at launch (used only if SYNC)
    T, B, H, P,
    n0, n1,          # this launch runs backward steps n0 .. n1-1 (walk index T-1-n)
    REVERSE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PROJ: tl.constexpr,
    CELL_CLIP: tl.constexpr, PROJ_GATE: tl.constexpr,
    RUN_CELL: tl.constexpr, RUN_DH: tl.constexpr, RUN_REDUCE: tl.constexpr,
    SYNC: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, KSPLIT: tl.constexpr, K_CHUNK: tl.constexpr,
    BLOCK_PS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_bb = tl.cdiv(B, BLOCK_B)
    n_cell = n_bb * tl.cdiv(H, BLOCK_H)
    if KSPLIT > 0:
        n_ps = n_bb * tl.cdiv(P, BLOCK_PS)                             # output tiles of dh̃
        n_dh = n_ps * KSPLIT                                           # x slices of 4H
    else:
        n_ps = 0
        n_dh = n_bb * tl.cdiv(P, BLOCK_P)
    s_g = tl.cast(B, tl.int64) * (4 * H)                               # step strides (int64)
    s_h = tl.cast(B, tl.int64) * H
    s_p = tl.cast(B, tl.int64) * P
    syncs = 0
    for n in range(n0, n1):
        wi = T - 1 - n                                                 # index in the walk
        if REVERSE:
            t = T - 1 - wi
            tp = t + 1                                                 # the step before t
        else:
            t = wi
            tp = t - 1
        has_prev = wi > 0
        if RUN_CELL:
            if has_prev:
                c_prev = cells_ptr + tp * s_h
            else:
                c_prev = c0_ptr
            for tile in range(pid, n_cell, nprog):
                _cell_bwd_tile(dh_ptr + t * s_p, wr_ptr, gates_ptr + t * s_g,
                               cells_ptr + t * s_h, c_prev, grad_cells_ptr + t * s_h, dc_ptr,
                               dz_ptr + t * s_g, prm_ptr + 1, tile % n_bb, tile // n_bb,
                               B, H, P, HAS_PROJ, CELL_CLIP, ACC, UPCAST, PRECISION,
                               BLOCK_B, BLOCK_H, BLOCK_K,
                               part_ptr, grad_out_ptr + t * s_p, n > 0, KSPLIT)
        if SYNC:                                                       # dz_t complete
            syncs += 1
            _grid_sync(sync_ptr, syncs * nprog)
        if RUN_DH:
            if KSPLIT > 0:        # partials; summed by the next cell phase, or (projection)
                for tile in range(pid, n_dh, nprog):                   # by the reduce phase
                    ps = tile % n_ps
                    _dh_part_tile(dz_ptr + t * s_g, w_ptr, m_ptr, part_ptr, prm_ptr,
                                  ps % n_bb, ps // n_bb, tile // n_ps, B, H, P,
                                  HAS_MASK, ACC, UPCAST, PRECISION,
                                  BLOCK_B, BLOCK_PS, BLOCK_K, K_CHUNK)
            else:
                y_dst, add, ref = _dh_dests(dh_ptr, grad_out_ptr, out_ptr, gh0_ptr, tp * s_p,
                                            has_prev)
                for tile in range(pid, n_dh, nprog):
                    _dh_bwd_tile(dz_ptr + t * s_g, w_ptr, m_ptr, add, ref, y_dst, prm_ptr,
                                 tile % n_bb, tile // n_bb, B, H, P, has_prev,
                                 HAS_MASK, PROJ_GATE, ACC, UPCAST, PRECISION,
                                 BLOCK_B, BLOCK_P, BLOCK_K)
        if SYNC:                                                       # dh̃ complete
            syncs += 1
            _grid_sync(sync_ptr, syncs * nprog)
        if KSPLIT > 0:
            if HAS_PROJ:          # the cell tiles need all of dh̃ (dh̃ @ w_hr): its own phase
                if RUN_REDUCE:
                    y_dst, add, ref = _dh_dests(dh_ptr, grad_out_ptr, out_ptr, gh0_ptr,
                                                tp * s_p, has_prev)
                    for tile in range(pid, n_ps, nprog):
                        _dh_reduce_tile(part_ptr, add, ref, y_dst, prm_ptr, tile % n_bb,
                                        tile // n_bb, B, P, has_prev, PROJ_GATE, ACC, KSPLIT,
                                        BLOCK_B, BLOCK_PS)
                if SYNC:                                               # dh̃ complete
                    syncs += 1
                    _grid_sync(sync_ptr, syncs * nprog)
    if KSPLIT > 0:
        if not HAS_PROJ:
            if RUN_REDUCE:                               # grad_h0: the last step's partials
                for tile in range(pid, n_ps, nprog):
                    _dh_reduce_tile(part_ptr, grad_out_ptr, out_ptr, gh0_ptr, prm_ptr,
                                    tile % n_bb, tile // n_bb, B, P, False, False, ACC,
                                    KSPLIT, BLOCK_B, BLOCK_PS)


# --------------------------------------------------------------------------- launchers

#: How the launchers run the recurrence: None picks (persistent where a cooperative launch
#: can run it: on a GPU, or with one program in the interpreter), "persistent" or
#: "stepwise" force one (tests; "persistent" on a GPU without cooperative launches raises).
LAUNCH: Optional[str] = None


def _cooperative_supported() -> bool:
    """Triton's NVIDIA backend has the ``launch_cooperative_grid`` option (Triton >= 3.2)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


_COOPERATIVE = _cooperative_supported()


#: ``tl.dot``'s input precision for fp32 inputs when torch does not allow TF32 for cuDNN's
#: RNNs (``torch.backends.cudnn.allow_tf32 = False`` or ``cudnn.rnn.fp32_precision = "ieee"``):
#: ``"tf32x3"`` (each operand split into a TF32 head and tail, three tensor-core products,
#: ~fp32 error; the rel_attention kernels' choice) or ``"ieee"`` (exact products, an FMA loop
#: on the CUDA cores). Compiled for sm_90, tf32x3 puts the ULMFiT-size step on wgmma with no
#: spills (benchmarks/NOTES.md). Not yet run on a GPU: the GPU tests' 2x-eager rule decides.
FP32_PRECISION: str = "tf32x3"


def lstm_precision(dtype: torch.dtype) -> str:
    """The recurrence dots' input precision: fp64 exact, fp32 ``"tf32"`` where torch allows
    TF32 for cuDNN's RNNs (what nn.LSTM and the CUDA kernels follow; torch's default), else
    :data:`FP32_PRECISION`; 16-bit operands as Triton does. The interpreter computes every
    fp32 dot exactly, whatever the string."""
    if dtype == torch.float64:
        return "ieee"
    if dtype == torch.float32:
        return "tf32" if _rnn_tf32_allowed() else _setting("FP32_PRECISION")
    return _precision(dtype)


def _acc_dtype(dtype: torch.dtype):
    return (tl.float64, torch.float64) if dtype == torch.float64 else (tl.float32, torch.float32)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132                                            # compile-only runs: an H100


def _config(B: int, H: int, P: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile sizes and warps. GPU: a batch block of up to 64 rows (the whole batch of the
    benchmark's models: W is then read once per step), and the smallest unit / P blocks
    whose tile count fits one program per SM. fp32 and fp64: BLOCK_K 16 and 8 warps for
    tiles of 64 x 64 and up: no spills on sm_90 with exact (FMA) or tf32x3 dots (``ptxas
    -v``: exact fp32 at BLOCK_K 32 with 4 warps spills; the per-step kernel this replaced
    spilled 12 KB per thread at BLOCK_B 64, benchmarks/NOTES.md). Not yet timed."""
    if _interpreting():                   # small blocks: multi-tile logic at tiny sizes
        return dict(BLOCK_B=16, BLOCK_H=16, BLOCK_K=16, BLOCK_P=16, num_warps=1)
    bb = min(64, max(16, next_pow2(B)))
    n_bb, sms = cdiv(B, bb), _sm_count(device)
    bh = next((b for b in (8, 16, 32) if n_bb * cdiv(H, b) <= sms), 32)
    bp = next((b for b in (16, 32, 64) if n_bb * cdiv(P, b) <= sms), 64)
    if dtype in (torch.float32, torch.float64):  # 8 warps for tiles of 64 x 64 and up
        return dict(BLOCK_B=bb, BLOCK_H=bh, BLOCK_K=16, BLOCK_P=bp,
                    num_warps=8 if bb * 4 * bh >= 4096 else 4)
    return dict(BLOCK_B=bb, BLOCK_H=bh, BLOCK_K=32, BLOCK_P=bp, num_warps=4)


#: The forward's projection ``h_t = hp_t @ w_hrᵀ`` (layers with w_hr) split over the unit
#: blocks (``_proj_partial_tile``: each cell tile multiplies the hp it computed by its
#: units' columns of w_hr into a partial, fp32) and summed by every program
#: (``_proj_reduce_tile``), instead of BLOCK_P-wide tiles that each read all of hp_t: at
#: ELMo's size (H 4096, P 512, B 32) those are 32 tiles of 384 KB a step on 32 of the 132
#: SMs. Off by default until a GPU times it (``lstm_launch_compare.py``'s
#: "triton persistent split-proj"); the outputs agree with the unsplit path to rounding
#: (another summation order; tests).
PROJ_SPLIT: bool = False


def _proj_split(cfg: dict, has_proj: bool) -> bool:
    """Whether this launch takes PROJ_SPLIT (its partial products need a unit block of at
    least 16, a tl.dot's K)."""
    return _setting("PROJ_SPLIT") and has_proj and cfg["BLOCK_H"] >= 16


def _proj_split_config(cfg: dict, B: int, P: int, n_hb: int, programs: int) -> dict:
    """PROJ_SPLIT's tiles: BLOCK_PP columns of P a partial product, reduction tiles of
    BLOCK_B rows x BLOCK_R columns (as many as there are programs, about), HB_CHUNK unit
    blocks summed a load (at most 8,192 values a load)."""
    n_bb = cdiv(B, cfg["BLOCK_B"])
    per = max(1, (P * n_bb) // max(1, programs))
    block_r = 1
    while block_r * 2 <= min(per, 64):
        block_r *= 2
    chunk = min(32, next_pow2(n_hb), max(1, 8192 // (cfg["BLOCK_B"] * block_r)))
    return dict(BLOCK_PP=min(64, max(16, next_pow2(P))), BLOCK_R=block_r,
                HB_CHUNK=max(1, chunk))


#: Keys of :func:`_config`'s dict (and ``num_stages``, Triton's default 3 when absent) that
#: replace its choice in every launch, forward and backward, e.g. ``{"BLOCK_K": 64,
#: "num_warps": 8}``, and the split-K backward's ``KSPLIT`` / ``BLOCK_PS``
#: (:func:`_bwd_split_config`; a KSPLIT turns the split on): what
#: ``benchmarks/lstm_triton_sweep.py`` times on a GPU. None: the table.
CONFIG_OVERRIDE: Optional[dict] = None


def _setting(name: str):
    """Module setting ``name`` (:data:`LAUNCH`, :data:`FP32_PRECISION`, :data:`PROJ_SPLIT`,
    :data:`BWD_SPLIT_K`, :data:`F16_OPERANDS`) in force: on a thread compiling a launch
    comparison's forms side by side, its rows' ``"lstm:<name>"`` (``kernels/_tune.py``
    ``compile_ahead``; thread-local, where the module's value would be shared), else the
    module's."""
    rows = _tune.current()
    key = "lstm:" + name
    return rows[key] if key in rows else globals()[name]


def _config_override() -> Optional[dict]:
    """The launch override in force: on a thread compiling a sweep's candidates side by
    side, its rows' ``"lstm_config"`` (``kernels/_tune.py`` ``compile_ahead``; thread-local,
    where :data:`CONFIG_OVERRIDE` would be shared), else :data:`CONFIG_OVERRIDE`."""
    rows = _tune.current()
    return rows["lstm_config"] if "lstm_config" in rows else CONFIG_OVERRIDE

_CONFIG_KEYS = ("BLOCK_B", "BLOCK_H", "BLOCK_K", "BLOCK_P", "num_warps", "num_stages",
                "BLOCK_PS", "KSPLIT")
_SPLIT_K_KEYS = ("BLOCK_PS", "KSPLIT")           # read by _bwd_split_config, not _config's


#: The backward's product ``dh̃_t ← dz_{t+1} @ (w_hh · mask) · scale`` split over the 4H gate
#: columns: product tiles of BLOCK_B x BLOCK_PS outputs x one of KSPLIT slices of 4H
#: (``_dh_part_tile``) write fp32 partials, and the next step's cell tiles sum their units'
#: KSPLIT partials with grad_out (``_cell_bwd_tile``); grad_h0 is the last step's partials
#: summed after the loop (``_dh_reduce_tile``). With a projection the cell tiles need all of
#: dh̃ (for dh̃ @ w_hr): reduction tiles form it (grad_out, the proj-clip gate) in a phase
#: and grid barrier of their own (ELMo: 16 output tiles of 32 x 32 x 8 slices of 16,384
#: gate columns read 256 KB a step each in bf16, against 1.5 MB for each of the 32 unsplit
#: tiles). The unsplit dh tiles (BLOCK_P = 16 outputs each at ULMFiT's size: 72 tiles) each
#: read all of dz_t [B, 4H]
#: (590 KB in bf16 at B 64, H 1152) and 147 KB of w_hh a step, 2.5x the bytes of a forward
#: cell tile; split, a tile reads ~170 KB (64 x 64 outputs x 1/7 of 4H, 126 tiles on 132
#: SMs). Same two grid barriers a step (three with a projection); another summation order
#: (tests: 2x eager's error).
#: Off by default until a GPU times it (``lstm_launch_compare.py``'s "triton persistent
#: split-k").
BWD_SPLIT_K: bool = False


def _bwd_split_config(cfg: dict, B: int, H: int, P: int, device: torch.device) -> dict:
    """The split-K backward's constants: KSPLIT slices (0: the unsplit dh tiles) of K_CHUNK
    gate columns each (a multiple of BLOCK_K; the last slice may be shorter), BLOCK_PS
    columns of P a tile. Enough slices that the product tiles about fill the SMs;
    CONFIG_OVERRIDE's BLOCK_PS / KSPLIT replace the choice. Interpreter: 3 slices of
    16-wide tiles, so the CPU tests cross slice and tile edges. A KSPLIT in CONFIG_OVERRIDE
    turns the split on whatever BWD_SPLIT_K says (the launch sweep's rows; 0: with this
    function's slice count)."""
    over = _config_override() or {}
    if not (_setting("BWD_SPLIT_K") or "KSPLIT" in over):
        return dict(KSPLIT=0, K_CHUNK=cfg["BLOCK_K"], BLOCK_PS=16)
    k_steps = cdiv(4 * H, cfg["BLOCK_K"])
    if _interpreting():
        bps, ks = 16, 3
    else:
        # 64 output columns a tile with 64-row batch blocks (wgmma), 32 with smaller ones
        # (mma.sync; ELMo's B 32: 64 spilled 4 B on sm_90 with Triton 3.9)
        bps = min(64 if cfg["BLOCK_B"] >= 64 else 32, max(16, next_pow2(P)))
        ks = _sm_count(device) // (cdiv(B, cfg["BLOCK_B"]) * cdiv(P, over.get("BLOCK_PS", bps)))
    bps, ks = over.get("BLOCK_PS", bps), over.get("KSPLIT") or ks     # KSPLIT 0: the choice
    chunk = cdiv(k_steps, max(1, min(ks, k_steps)))              # BLOCK_K steps a slice
    return dict(KSPLIT=cdiv(k_steps, chunk), K_CHUNK=chunk * cfg["BLOCK_K"], BLOCK_PS=bps)


#: Devices whose driver refused the persistent form's cooperative launch: the grid (one
#: program per SM torch reports) was more than the device could hold at once, as under
#: MPS with an active-thread percentage. With :data:`LAUNCH` None they run the stepwise
#: form from then on (the README promises per-step launches where the persistent one
#: cannot run); "persistent" asked for raises.
_REFUSED: set = set()


class _CooperativeRefused(Exception):
    """A persistent launch the driver refused (:func:`_cooperative`); the caller reruns."""


def _device_key(device: torch.device):
    return device.type, device.index


def _cooperative(launch, device: torch.device) -> None:
    """``launch()``, the persistent form's one cooperative launch. Where the driver refuses it
    as larger than the device holds at once ("too many blocks in cooperative launch", which
    launches nothing) and no form was asked for, the device is marked to run the stepwise
    form, with a warning, and :class:`_CooperativeRefused` raised for the caller to rerun."""
    try:
        launch()
    except RuntimeError as e:
        if "cooperative launch" not in str(e) or _setting("LAUNCH") == "persistent":
            raise
        _REFUSED.add(_device_key(device))
        warnings.warn(f"ctxfast.lstm: the driver refused the persistent kernel's cooperative "
                      f"launch on {device} ({e}); running the per-step launches on it from "
                      "now on", RuntimeWarning, stacklevel=3)
        raise _CooperativeRefused from e


def _rerun_if_refused(fn):
    """``fn`` once more, in the stepwise form, if its persistent launch was refused."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _CooperativeRefused:
            return fn(*args, **kwargs)          # _plan: stepwise on this device now
    return run


def _plan(B: int, H: int, P: int, dtype: torch.dtype,
          device: torch.device) -> Tuple[dict, Optional[int], dict]:
    """(tile config, persistent grid or None for stepwise, launch options)."""
    cfg = _config(B, H, P, dtype, device)
    override = _config_override()
    if override:
        bad = sorted(set(override) - set(_CONFIG_KEYS))
        if bad:
            raise ValueError(f"kernels.lstm.CONFIG_OVERRIDE: unknown keys {bad}; expected "
                             f"some of {list(_CONFIG_KEYS)}")
        for key, v in override.items():
            # tile sides: powers of two, >= 16 (a tl.dot's least side) but BLOCK_H (x 4
            # gates); warps a power of two up to 16; stages >= 1
            least = {"BLOCK_H": 4, "num_warps": 1, "num_stages": 1, "KSPLIT": 0}.get(key, 16)
            pow2 = key not in ("num_stages", "KSPLIT")
            if (not isinstance(v, int) or isinstance(v, bool) or v < least
                    or (pow2 and v & (v - 1)) or (key == "num_warps" and v > 16)):
                raise ValueError(f"kernels.lstm.CONFIG_OVERRIDE[{key!r}] must be an int >= "
                                 f"{least}{', a power of two' if pow2 else ''}"
                                 f"{' (at most 16)' if key == 'num_warps' else ''}, got {v!r}")
        cfg = {**cfg, **{k: v for k, v in override.items() if k not in _SPLIT_K_KEYS}}
    mode = _setting("LAUNCH")
    if mode not in (None, "persistent", "stepwise"):
        raise ValueError(f"kernels.lstm.LAUNCH must be None, 'persistent' or 'stepwise', got {mode!r}")
    refused = mode is None and _device_key(device) in _REFUSED
    if _interpreting():                   # programs run one after another: one program
        return cfg, (None if mode == "stepwise" or refused else 1), {}
    if mode == "stepwise" or (mode is None and (not _COOPERATIVE or refused)):
        return cfg, None, {}
    if not _COOPERATIVE:
        raise RuntimeError("the persistent LSTM needs Triton's launch_cooperative_grid "
                           f"(Triton >= 3.2); this is Triton {triton.__version__}")
    n_bb = cdiv(B, cfg["BLOCK_B"])
    tiles = max(n_bb * cdiv(H, cfg["BLOCK_H"]), n_bb * cdiv(P, cfg["BLOCK_P"]))
    return cfg, min(tiles, _sm_count(device)), {"launch_cooperative_grid": True}


#: float32 layers without projection or with a finite proj clip (h bounded), where torch
#: allows TF32 for cuDNN's RNNs (nn.LSTM's products are then TF32: 10-bit significands,
#: rounded): the forward's recurrence products ``h_{t-1} @ (w_hh · mask)ᵀ``
#: from step 1 on take fp16 operands, which have the same 10-bit significand and are
#: rounded to nearest as well, at half the bytes and twice the tensor-core rate of TF32's
#: fp32 ones (the float32 forward streamed 2x bf16's bytes a step and took 2.9x its time,
#: 2.29 against 0.79 ms at ULMFiT's size, round 5). ``w_hh · mask`` is scaled by a power of
#: two 2^e (exact) so that its largest value is 2^13-2^14 (fp16's range ends at 65,504;
#: 2^e is computed on the device from the weight's max: no sync), h_t = o tanh(c), inside
#: [-1, 1], by 2^15 (with a projection: h_t inside ±proj_clip, by the power of two that
#: puts the clip at 2^14-2^15), and the accumulator by scale / (2^e · h's scale). fp16 then
#: keeps 10 bits for |h| >= 2^-29 (no projection) and weights >= 2^-28 of the largest;
#: below that the absolute error (at most 2^-40 for h, 2^-39 of the weight's max) is far
#: under the rounding of the largest terms (tests: h0 x 1e5, w_hh x 1e5, activations near
#: 1e-6 each fail without). The projection's own product stays TF32. Step 0 reads
#: the given h0 (any range) with the float32 dots. The cell state, gates and outputs stay
#: float32. Off by default until a GPU times it (``lstm_launch_compare.py``'s
#: "triton persistent f16-operands").
F16_OPERANDS: bool = False


def _f16_operands(dtype: torch.dtype, has_proj: bool, T: int,
                  proj_clip: float = math.inf) -> bool:
    """Whether this forward takes F16_OPERANDS: more than one step (step 0 never does), and
    h bounded: no projection (|h| <= 1) or a finite proj_clip."""
    return (_setting("F16_OPERANDS") and dtype == torch.float32 and T > 1
            and (not has_proj or not math.isinf(proj_clip))
            and lstm_precision(dtype) == "tf32")


def _h16_scale(has_proj: bool, proj_clip: float, dtype: torch.dtype) -> float:
    """h's scale in the fp16 operand: 2^15 for |h| <= 1, else the power of two that puts the
    stored proj clip at 2^14-2^15."""
    if not has_proj:
        return 32768.0
    return math.ldexp(1.0, math.floor(math.log2(32768.0 / _stored_clip(proj_clip, dtype))))


def _f16_weight(w_hh: torch.Tensor, mask: Optional[torch.Tensor], prm: torch.Tensor,
                h16_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``w_hh · mask · 2^e`` in fp16 [4H, P], prm with ``scale / (2^e · h16_scale)`` first,
    h16_scale h's scale in the fp16 operand): 2^e puts the weight's largest magnitude in
    [2^13, 2^14), from device values (no host sync)."""
    amax = w_hh.abs().amax()                 # a 0/1 mask only lowers the masked weight's max
    e = torch.floor(torch.log2(16384.0 / amax.clamp_min(1e-30))).clamp(-100.0, 100.0)
    two_e = torch.exp2(e)
    w = w_hh * two_e if mask is None else w_hh * mask * two_e            # exact in fp32
    prm16 = prm.clone()
    prm16[0] = prm[0] / (two_e * h16_scale)
    return w.to(torch.float16), prm16


#: Steps from which the launchers multiply the mask into a per-call copy of ``w_hh`` once
#: (one elementwise pass) instead of loading the mask with every weight tile at every step.
#: Every step streams the weight from L2: ULMFiT's fp32 ``w_hh`` is 21 MB, with its mask
#: 42 MB, close to the H100's 50 MB L2. The module's weight is never written; ``w · mask``
#: is exact for a 0/1 mask, so both forms give the same bits (the scale stays a separate
#: factor). None: never (the in-tile mask only).
PREMASK_MIN_T: Optional[int] = 4


def _premask(w: torch.Tensor, mask: Optional[torch.Tensor], T: int):
    """(weight, mask) for the kernel: ``(w · mask, None)`` from PREMASK_MIN_T steps on."""
    if mask is None or PREMASK_MIN_T is None or T < PREMASK_MIN_T:
        return w, mask
    return w * mask, None


@functools.lru_cache(maxsize=256)
def _below(clip_s: float, dtype: torch.dtype) -> float:
    """The largest value of `dtype` below the stored clip (fp16/bf16; else clip_s)."""
    if math.isinf(clip_s) or dtype not in (torch.float16, torch.bfloat16):
        return clip_s
    bits = torch.tensor(clip_s, dtype=dtype).view(torch.int16) - 1     # positive: one ulp down
    return float(bits.view(dtype))


#: _params' tensors by (device, accumulation dtype, values).
_PARAMS: dict = {}


def _params(device, dtype: torch.dtype, *values: float) -> torch.Tensor:
    """The kernels' float parameters (scale, clips) as a tensor in the accumulation dtype.
    Scalar kernel arguments would be fp32 on a GPU but fp64 in the interpreter; loading
    them from memory gives both (and fp64 inputs) the same, exact values. inf -> 0 (unused).

    Kept per (device, dtype, values), read-only: made from Python floats, the tensor is a
    copy from pageable host memory, which synchronises a GPU's stream (the host waits for
    every queued kernel); a model passes the same values at every step, so only its first
    call pays that (and a CUDA graph can capture the later ones)."""
    _, acc = _acc_dtype(dtype)
    key = (device, acc, values)
    prm = _PARAMS.get(key)
    if prm is None:
        if len(_PARAMS) >= 256:
            _PARAMS.clear()
        prm = _PARAMS[key] = torch.tensor([0.0 if math.isinf(v) else v for v in values],
                                          dtype=acc, device=device)
    return prm


@functools.lru_cache(maxsize=256)
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
                PRECISION=lstm_precision(dtype))


@_rerun_if_refused
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
    h16 = _f16_operands(dtype, w_hr is not None, T, proj_clip)
    h16_scale = _h16_scale(w_hr is not None, proj_clip, dtype) if h16 else 1.0
    if not h16:                              # (F16_OPERANDS: step 0 reads w_hh and mask)
        w_hh, mask = _premask(w_hh, mask, T)
    w_hr = w_hr.to(dtype).contiguous() if w_hr is not None else None
    hp = xw.new_empty((B, H)) if w_hr is not None else out
    prm = _params(xw.device, dtype, *_clip_values(dtype, scale, cell_clip),
                  *_clip_values(dtype, 1.0, proj_clip)[1:])
    # F16_OPERANDS: the 16-bit table's tiles; step 0's float32 dots 16 deep
    cfg, grid, options = _plan(B, H, P, torch.float16 if h16 else dtype, xw.device)
    block_k16 = cfg["BLOCK_K"]
    if h16:
        cfg = {**cfg, "BLOCK_K": 16}
        w16, prm16 = _f16_weight(w_hh, mask, prm, h16_scale)
        hs = torch.empty((2, B, P), dtype=torch.float16, device=xw.device)  # h_{t-1}, h_t
    else:
        w16, prm16, hs = w_hh, prm, out                                # unused
    sync = torch.zeros(1, dtype=torch.int32, device=xw.device)
    c_carry = c0.to(_acc_dtype(dtype)[1]).clone()                       # [B, H] fp32 (fp64)
    n_bb, n_hb = cdiv(B, cfg["BLOCK_B"]), cdiv(H, cfg["BLOCK_H"])
    split = _proj_split(cfg, w_hr is not None)
    split_cfg = _proj_split_config(cfg, B, P, n_hb, grid or n_bb * n_hb)
    part = (torch.empty((n_hb, B, P), dtype=_acc_dtype(dtype)[1], device=xw.device)
            if split else c_carry)                                   # [n_hb, B, P] partials
    args = (xw, h0, c_carry, w_hh, mask if mask is not None else w_hh,
            w_hr if w_hr is not None else w_hh, gates, cells, out, hp, part, prm, sync,
            w16, hs, prm16, h16_scale, T, B, H, P)
    kw = dict(REVERSE=reverse, HAS_MASK=mask is not None, HAS_PROJ=w_hr is not None,
              CELL_CLIP=not math.isinf(cell_clip), PROJ_CLIP=not math.isinf(proj_clip),
              PROJ_SPLIT=split, **split_cfg, **cfg, **_common(dtype),
              H16=h16, UPCAST16=_interpreting(), BLOCK_K16=block_k16)
    if grid is not None:                                     # one launch, every step
        _cooperative(lambda: fast(_lstm_fwd_kernel)[(grid,)](
            *args, 0, T, RUN_CELL=True, RUN_PROJ=True, SYNC=True, **kw, **options), xw.device)
        return out, cells, gates
    n_cell = n_bb * n_hb
    n_proj = n_bb * cdiv(P, split_cfg["BLOCK_R"] if split else cfg["BLOCK_P"])
    for n in range(T):                                       # stepwise: a launch per phase
        fast(_lstm_fwd_kernel)[(n_cell,)](*args, n, n + 1, RUN_CELL=True, RUN_PROJ=False,
                                    SYNC=False, **kw)
        if w_hr is not None:
            fast(_lstm_fwd_kernel)[(n_proj,)](*args, n, n + 1, RUN_CELL=False, RUN_PROJ=True,
                                        SYNC=False, **kw)
    return out, cells, gates


def _clip_values(dtype: torch.dtype, scale: float, clip: float) -> Tuple[float, float, float]:
    """(scale, clip as stored in `dtype`, the stored value just below it)."""
    clip_s = _stored_clip(clip, dtype)
    return scale, clip_s, _below(clip_s, dtype)


@_rerun_if_refused
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
    first = 0 if reverse else T - 1                                    # the last step walked
    dh_all[first] = grad_out[first].to(acc)
    if proj_gate:
        dh_all[first] *= out[first].abs() < pc
    prm = _params(gates.device, dtype, scale, cc, pc)
    cfg, grid, options = _plan(B, H, P, dtype, gates.device)
    split = _bwd_split_config(cfg, B, H, P, gates.device)
    n_bb = cdiv(B, cfg["BLOCK_B"])
    n_ps = n_bb * cdiv(P, split["BLOCK_PS"])
    n_dh = n_ps * split["KSPLIT"] if split["KSPLIT"] else n_bb * cdiv(P, cfg["BLOCK_P"])
    if grid is not None and not _interpreting():             # a GPU: the product tiles too
        grid = min(max(grid, n_dh), _sm_count(gates.device))
    part = (torch.empty((split["KSPLIT"], B, P), dtype=acc, device=gates.device)
            if split["KSPLIT"] else dc)                      # [KSPLIT, B, P] partials of dh̃
    sync = torch.zeros(1, dtype=torch.int32, device=gates.device)
    w_k, mask_k = _premask(w_hh_c, mask_c, T)                          # what the kernel reads
    args = (grad_out, grad_cells, out, cells, gates, c0, w_k,
            mask_k if mask_k is not None else w_k, w_hr_c if has_proj else w_hh_c,
            dh_all, dc, grad_xw, grad_h0, part, prm, sync, T, B, H, P)
    kw = dict(REVERSE=reverse, HAS_MASK=mask_k is not None, HAS_PROJ=has_proj,
              CELL_CLIP=not math.isinf(cell_clip), PROJ_GATE=proj_gate, **cfg, **split,
              **_common(dtype))
    if grid is not None:                                     # one launch, every step
        _cooperative(lambda: fast(_lstm_bwd_kernel)[(grid,)](
            *args, 0, T, RUN_CELL=True, RUN_DH=True, RUN_REDUCE=True, SYNC=True, **kw,
            **options), gates.device)
    else:
        n_cell = n_bb * cdiv(H, cfg["BLOCK_H"])
        for n in range(T):                                   # stepwise: a launch per phase
            fast(_lstm_bwd_kernel)[(n_cell,)](*args, n, n + 1, RUN_CELL=True, RUN_DH=False,
                                        RUN_REDUCE=False, SYNC=False, **kw)
            fast(_lstm_bwd_kernel)[(n_dh,)](*args, n, n + 1, RUN_CELL=False, RUN_DH=True,
                                      RUN_REDUCE=False, SYNC=False, **kw)
            if split["KSPLIT"] and has_proj:             # dh̃ from the partials
                fast(_lstm_bwd_kernel)[(n_ps,)](*args, n, n + 1, RUN_CELL=False, RUN_DH=False,
                                          RUN_REDUCE=True, SYNC=False, **kw)
        if split["KSPLIT"] and not has_proj:             # grad_h0 from the partials
            fast(_lstm_bwd_kernel)[(n_ps,)](*args, T, T, RUN_CELL=False, RUN_DH=False,
                                      RUN_REDUCE=True, SYNC=False, **kw)

    # weight gradients: one GEMM each over all T·B rows, 16-bit ones in their dtype (tensor
    # cores, float32 accumulation, one rounding; eager rounds every step's product and sum)
    gd = dtype if dtype in (torch.float16, torch.bfloat16) else acc
    if reverse:
        h_prev = torch.cat([out[1:], h0[None]])                         # [T, B, P]
    else:
        h_prev = torch.cat([h0[None], out[:-1]])                        # [T, B, P]
    # float32 on a GPU where torch allows TF32 for cuDNN's RNNs: TF32 products, as nn.LSTM's
    # GEMMs (kernels/linear.py; torch.mm would follow cuBLAS's own setting)
    mm = torch.mm
    if gd == torch.float32 and gates.is_cuda and lstm_precision(dtype) == "tf32":
        from .linear import matmul

        def mm(a, b):
            return matmul(a, b, precision="tf32")
    grad_w_hh = mm(grad_xw.reshape(T * B, G).to(gd).t(), h_prev.reshape(T * B, P).to(gd))  # [4H, P]
    if mask is not None:
        grad_w_hh = grad_w_hh * mask_c.to(gd) * scale
    if has_proj:
        hp = (gates[..., 3 * H:].to(acc) * torch.tanh(cells.to(acc))).to(gd)   # [T, B, H]
        grad_w_hr = mm(dh_all.reshape(T * B, P).t().to(gd),
                       hp.reshape(T * B, H)).to(w_hr.dtype)                      # [P, H]
    else:
        grad_w_hr = grad_out.new_empty((0,))
    return (grad_xw, grad_h0.to(h0.dtype), dc.to(c0.dtype), grad_w_hh.to(w_hh.dtype),
            grad_w_hr)
