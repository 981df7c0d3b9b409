"""Pieces shared by the Triton kernel files (``attention.py``, ``rel_attention.py``,
``lstm.py``): the dot with the interpreter's bf16 workaround, the dropout mask, the
online-softmax step, the visibility test of a tile and the key range of a query block, the
split-K (flash-decoding) combine kernel and its buffers, and the host-side helpers
(interpreter check, tl.dot precision, mask and seed arguments, split count).

Shapes and the visibility rules are those of ``kernels/attention.py``'s docstring.
"""
import contextlib
import dataclasses
import functools
import math
import os
import warnings

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _interpreter

LOG2E = 1.4426950408889634


def _fold_scale(scale: float) -> bool:
    """Whether a forward may apply its softmax scale inside the exponent's FMA (the kernels'
    ``FOLD``, :func:`_online_softmax_step`): the row max of unscaled scores is the scaled
    max's only for a positive, finite scale (a 0 or negative one, which torch's SDPA
    accepts too, keeps the scaled tile)."""
    return 0.0 < scale < math.inf


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # UPCAST: the Triton interpreter multiplies bf16 bit patterns (docs/ARCHITECTURE.md, measured facts); fp32 is exact.
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _query_block(pid, CAUSAL: tl.constexpr):
    """Program pid's query block (grid axis 0): causal grids run the last (longest) rows
    first, so that the short ones fill the last wave (attention's forward and dQ kernels,
    rel_attention's forward: its dQ kernel spilled 28 B more per thread with it, sm_90)."""
    if CAUSAL:
        pid = tl.num_programs(0) - 1 - pid
    return pid


@triton.jit
def _keep(seed, bh, offs_m, offs_n, Tq, Tk, p_drop):
    """[BLOCK_M, BLOCK_N] bool: dropout keeps (b, h, i, j). Philox counter =
    (bh * Tq + i) * Tk + j (int64), so the forward and both backward kernels (and
    :func:`dropout_keep_mask`) draw the same numbers."""
    offs = (bh.to(tl.int64) * Tq + offs_m[:, None]) * Tk + offs_n[None, :]
    return tl.rand(seed, offs) >= p_drop


@triton.jit
def _keep_t(seed, bh, offs_m, offs_n, Tq, Tk, p_drop):
    """[BLOCK_N, BLOCK_M]: :func:`_keep` transposed (the same numbers), for kernels that
    work on transposed score tiles."""
    offs = (bh.to(tl.int64) * Tq + offs_m[None, :]) * Tk + offs_n[:, None]
    return tl.rand(seed, offs) >= p_drop


#: 2^f on [0, 1) as a degree-4 polynomial (coefficients fitted here for the least maximum
#: relative error, 2.6e-6: a hundredth of fp16's half ulp), for :func:`_exp2_fma`.
_EXP2_C0 = tl.constexpr(1.0000025931840015)
_EXP2_C1 = tl.constexpr(0.6930038368739864)
_EXP2_C2 = tl.constexpr(0.24144274941496735)
_EXP2_C3 = tl.constexpr(0.0520114681855324)
_EXP2_C4 = tl.constexpr(0.013534165872927939)


@triton.jit
def _exp2_fma(x):
    """2^x for x <= 0 (scores minus their row max) without the MUFU unit: 2^x = 2^n · 2^f
    (n = floor(x), f in [0, 1)), 2^f a polynomial on the FMA pipe and n added to its
    exponent bits. Relative error <= 2.6e-6 for x >= -126; below, 0 (-inf included: a
    masked score's weight is exactly 0, as tl.exp2's)."""
    xc = tl.maximum(x, -126.0)
    n = tl.floor(xc)
    f = xc - n
    p = _EXP2_C4 * f + _EXP2_C3
    p = p * f + _EXP2_C2
    p = p * f + _EXP2_C1
    p = p * f + _EXP2_C0
    bits = p.to(tl.int32, bitcast=True) + (n.to(tl.int32) << 23)
    return tl.where(x >= -126.0, bits.to(tl.float32, bitcast=True), 0.0)


@triton.jit
def _exp2_half_fma(x):
    """tl.exp2 of a [M, N] tile with the odd columns' on the FMA pipe (:func:`_exp2_fma`)
    and the even columns' on the MUFU unit, whose 16 exponentials a clock per SM are as
    many as the tensor cores' products need at D 64 (FlashAttention-4's observation, on
    Blackwell): the two pipes then share the work. A thread of a wgmma accumulator holds
    column pairs, so the split and the join stay in its registers."""
    a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    return tl.reshape(tl.join(tl.exp2(a), _exp2_fma(b)), [x.shape[0], x.shape[1]])


@triton.jit
def _exp2_tile(x, EXP_EMU: tl.constexpr):
    """tl.exp2 of a tile, or with EXP_EMU half of it on the FMA pipe (:func:`_exp2_half_fma`)."""
    if EXP_EMU:
        return _exp2_half_fma(x)
    else:
        return tl.exp2(x)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, seed, bh, offs_m, offs_n, max_q, max_k, p_drop,
                         qk_scale, DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
                         PRECISION: tl.constexpr, EXP_EMU: tl.constexpr, FOLD: tl.constexpr):
    """Fold one tile of scores s [BLOCK_M, BLOCK_N] (-inf where masked) and its values
    v [BLOCK_N, BLOCK_D] into the running max m_i, normaliser l_i (before dropout) and output
    acc (m_i, l_i in base 2). FOLD: s is not yet scaled, and qk_scale (> 0) is applied to
    each row's max and inside the exponent's FMA, ``exp2(s · qk_scale − m)``, as the
    fused-attention tutorial does: one multiply per element less than scaling the tile
    first (whose products the row max needs). Without FOLD, s is in base 2 already
    (qk_scale unused). EXP_EMU: half the tile's exponentials on the FMA pipe
    (:func:`_exp2_half_fma`). Returns (m_i, l_i, acc)."""
    if FOLD:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # row with nothing yet
        p = _exp2_tile(tl.fma(s, qk_scale, -m_safe[:, None]), EXP_EMU)   # 0 where masked
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # row with nothing yet
        p = _exp2_tile(s - m_safe[:, None], EXP_EMU)                 # 0 where masked
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)                                 # normaliser: before dropout
    if DROPOUT:
        keep = _keep(seed, bh, offs_m, offs_n, max_q, max_k, p_drop)
        p = tl.where(keep, p / (1.0 - p_drop), 0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_rows(ptrs, offs_r, lim_r, d_ok, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, BLOCK_D] tile; rows offs_r >= lim_r read as 0 when ROW_MASK, columns past D
    as 0 unless EVEN_D (BLOCK_D == D)."""
    if ROW_MASK:
        x = tl.load(ptrs, mask=(offs_r[:, None] < lim_r) & d_ok, other=0.0)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=d_ok, other=0.0)
    return x


@triton.jit
def _tile_rows(desc, ptrs, b, h, r0, offs_r, lim_r, d_ok, ROW_MASK: tl.constexpr,
               EVEN_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
               TMA: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_R of sequence (b, h), a [BLOCK_R, BLOCK_D] tile: through the
    tensor descriptor ``desc`` (:class:`RowTiles`, a TMA load on sm_90+: rows past the
    sequence and columns past D read as 0, no masks) when TMA, else from the pointer tile
    ``ptrs`` (:func:`_load_rows`; ``offs_r`` = r0 + arange(BLOCK_R) there)."""
    if TMA:
        x = desc.load([b, h, r0, 0]).reshape(BLOCK_R, BLOCK_D)
    else:
        x = _load_rows(ptrs, offs_r, lim_r, d_ok, ROW_MASK, EVEN_D)
    return x


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
def _attn_combine_kernel(
    O_PART,      # [B, H, S, Tq, D] fp32: each split's normalised partial output
    LSE_PART,    # [B, H, S, Tq] fp32: each split's lse (base 2; -inf where it saw no key)
    O,           # out [B, H, Tq, D] contiguous, written
    LSE,         # lse [B, H, Tq] fp32 contiguous, written (+inf for empty rows)
    S, Tq, D,
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out_i = Σ_s 2^(lse_si − m) · out_si / Σ_s 2^(lse_si − m), m = max_s lse_si."""
    i = tl.program_id(0)
    bh = (tl.program_id(1) + BH0).to(tl.int64)
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
def _bwd_delta_kernel(
    DO,          # dout [B, H, Tq, D], any strides (stride_do*)
    O,           # out [B, H, Tq, D], any strides (stride_o*)
    DELTA,       # delta [B, H, Tq] fp32 contiguous, written: Δ_i = Σ_d dO_id · O_id
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_ob, stride_oh, stride_om, stride_od,
    H, Tq, D,
    BH0,            # first (batch, head) of this launch (_common.bh_chunks)
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The backward's row term Δ (``rowsum(dO ∘ O)``, fp32) in one pass: what
    ``(do.float() * out.float()).sum(-1)`` did in four launches and two fp32 copies."""
    bh = tl.program_id(1) + BH0
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < D)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om
                + offs_d[None, :] * stride_od, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * Tq + offs_m, tl.sum(do * o, 1), mask=offs_m < Tq)


# --------------------------------------------------------------------------- host helpers

# Read once: Triton decides at decoration time (import) whether a kernel is interpreted,
# so TRITON_INTERPRET must be set before ctxfast is imported; the launchers ask per call.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_deterministic(op: str, setting: str) -> None:
    """Under ``torch.use_deterministic_algorithms(True)`` a backward that sums with atomic
    adds (``setting``, e.g. "CTXFAST_ATTN_BWD_DQ=atomic") is refused, as torch refuses its
    own nondeterministic ops; with ``warn_only=True`` it warns and runs, as torch's do."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    msg = (f"{op} backward: {setting} sums with atomic adds, in no fixed order, but "
           "torch.use_deterministic_algorithms(True) is in force")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(msg + " (warn_only=True: running it)", UserWarning, stacklevel=3)
        return
    raise RuntimeError(msg + "; use 'kernel'")


def _interpreting() -> bool:
    return _INTERPRET


def cdiv(a: int, b: int) -> int:
    """Host-side ``ceil(a / b)``. ``triton.cdiv`` is a ``ConstexprFunction`` in Triton 3.6
    and later: ~4 µs a call from host code (it unwraps its arguments for the compiler), and
    the launchers call it several times per op call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side ``triton.next_power_of_2`` (0 -> 0; same reason as :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


#: The most programs a CUDA grid may have along y or z (along x: 2^31 - 1). The launchers put
#: the (batch, head) pairs on y (on z for the dropout mask): B * H above it (BERT inference
#: at B 5,462, H 12) failed on a GPU with CUDA's "invalid argument" where SDPA runs.
MAX_GRID_YZ = 65535


def bh_chunks(n: int) -> list:
    """``[(first, count)]``: the ``n`` (batch, head) pairs of a launch in launches of at most
    :data:`MAX_GRID_YZ`, each kernel told its first pair (``BH0``; its programs' pair is
    ``program_id + BH0``, so they compute what one launch would, dropout's counters
    included). Every ``first`` a multiple of 16, so Triton specialises ``BH0`` alike for all
    of them (one compile). One launch, ``[(0, n)]``, below the limit; none for ``n = 0``."""
    step = max(16, MAX_GRID_YZ // 16 * 16)
    return [(s, min(step, n - s)) for s in range(0, n, step)]


def int32_addressable(t):
    """``t``, or a contiguous copy of it where its last element lies 2**31 or more elements
    past its first: the kernels address it with 32-bit offsets (``b * stride_b`` in int32).
    For the upstream gradient of an output, which the ops do not check as they check their
    inputs: autograd may hand a view of a larger tensor (``torch.cat([out, x], -1)``'s
    gradient), whose copy has the output's size, within the limit. (The span is
    ``ctxfast.ops._common.check_int32_extent``'s formula: kernels/ imports nothing of the
    package above it.)"""
    if t.numel() and 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) >= 2**31:
        return t.contiguous()
    return t


def _new_output(shape, dtype, device):
    """``torch.empty`` for a tensor whose every element a kernel writes. Under the
    interpreter (the test suite) it is filled with NaN first, so an element that no program
    writes fails a test instead of reading whatever the allocator left there."""
    if _interpreting():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


_DUMMY = {}


def _mask_args(q, key_padding_mask, perm_rank):
    """(kpm uint8 [B, Tk] | dummy, rank int32 [B, Tq] | dummy, kv_end int32 [B] | dummy, strides).
    The dummy (never read: its flag is off) is one int32 per device, made once."""
    dummy = _DUMMY.get(q.device)
    if dummy is None:
        dummy = _DUMMY[q.device] = torch.empty(1, dtype=torch.int32, device=q.device)
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


class RowTiles(TensorDescriptor):
    """A host-side tensor descriptor (TMA on sm_90+) of a ``[B, H, T, D]`` tensor read in
    ``[1, 1, rows, BLOCK_D]`` tiles (:func:`_tile_rows`).

    Equal and hashed as Triton specialises a descriptor argument (its dtype and block
    shape: ``tensordesc<bf16[1, 1, 64, 128]>``), not by value, so that the fast launch path
    (``_launch.py``) can key a call that passes one exactly as Triton would: two of these
    with the same dtype and block are the same compiled kernel. Nothing else compares
    them."""

    def _spec(self):
        return self.base.dtype, tuple(self.block_shape)

    def __eq__(self, other):
        return type(other) is type(self) and self._spec() == other._spec()

    def __hash__(self):
        return hash(self._spec())


#: TensorDescriptor's fields that have defaults (``padding`` and others, by Triton release):
#: :func:`row_tiles` sets them without running the dataclass's own checks. None where
#: TensorDescriptor is not a dataclass (then only the checked constructor is used).
_DESC_DEFAULTS = ({f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                   if f.default is not dataclasses.MISSING}
                  if dataclasses.is_dataclass(TensorDescriptor) else None)


def row_tiles(x, rows: int, block_d: int):
    """:class:`RowTiles` of x ``[B, H, T, D]`` in ``[1, 1, rows, block_d]`` tiles, or None
    where TMA cannot address x: the last dim not contiguous, a base or stride that is not a
    multiple of 16 bytes, a zero stride (a broadcast dim) or an empty dim. (Rows past T and
    columns past D need nothing: TMA reads them as 0.)

    Built without ``TensorDescriptor.__post_init__``: these checks are the ones it makes
    for such a tensor (rank, 16-byte base and strides, unit last stride, positive sizes;
    the block is a power of two in each dim, <= 256, by the launchers' tiles), and they ran
    at every launch of every call (~2.7 us a descriptor on the CPU, ~1.7 this way)."""
    if not tma_addressable(x):
        return None
    shape, st = list(x.shape), list(x.stride())
    if not _unchecked_desc_ok():
        return RowTiles(x, shape, st, [1, 1, rows, block_d])
    return _unchecked_desc(x, shape, st, [1, 1, rows, block_d])


def tma_addressable(x) -> bool:
    """TMA can read x ``[B, H, T, D]`` by rows of any (b, h): the last dim contiguous, the
    base and the other strides positive multiples of 16 bytes, no empty dim (the checks of
    :func:`row_tiles`; a kernel that builds its descriptors on the device, per (b, h), needs
    the same)."""
    st = x.stride()
    if len(st) != 4 or st[3] != 1:
        return False
    es = x.element_size()
    b0, b1, b2 = st[0] * es, st[1] * es, st[2] * es
    if b0 <= 0 or b1 <= 0 or b2 <= 0 or (b0 | b1 | b2) & 15 or x.data_ptr() & 15:
        return False
    return 0 not in x.shape


@contextlib.contextmanager
def descriptor_scratch(device: torch.device):
    """Global memory for the launches in the body that build tensor descriptors on the
    device (``tl.make_tensor_descriptor``: 128 B a descriptor and program, which Triton's
    launcher asks of the allocator in ``triton.set_allocator``'s context variable). Set for
    the body only, from torch's caching allocator on ``device`` (stream-ordered: the buffer
    is reused only after the launch that holds it), and the caller's allocator, if any, put
    back after. Nothing is needed under the interpreter."""
    if _interpreting() or device.type != "cuda":
        yield
        return
    from triton.runtime import _allocation

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)
    token = _allocation._allocator.set(alloc)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def _unchecked_desc(x, shape, strides, block):
    d = object.__new__(RowTiles)
    d.__dict__.update(_DESC_DEFAULTS)
    d.base, d.shape, d.strides, d.block_shape = x, shape, strides, block
    return d


@functools.lru_cache(maxsize=None)
def _unchecked_desc_ok() -> bool:
    """A descriptor built by :func:`_unchecked_desc` holds exactly what the dataclass's own
    constructor makes (checked once, on a small CPU tensor): else (a Triton release whose
    ``__post_init__`` sets more) :func:`row_tiles` takes the checked constructor."""
    if _DESC_DEFAULTS is None:
        return False
    x = torch.zeros(1, 1, 16, 16)
    args = (x, [1, 1, 16, 16], list(x.stride()), [1, 1, 16, 16])
    return vars(_unchecked_desc(*args)) == vars(RowTiles(*args))


def tma_args(names, tensors, rows: int, block_d: int):
    """Keyword arguments that turn a launch's TMA loads on: ``{name: RowTiles, ...,
    "TMA": True}`` for ``tensors`` (each ``[B, H, T, D]``) read in ``[rows, block_d]``
    tiles, or ``{}`` (pointer tiles) if :func:`row_tiles` cannot address one of them."""
    descs = {"TMA": True}
    for name, x in zip(names, tensors):
        descs[name] = row_tiles(x, rows, block_d)
        if descs[name] is None:
            return {}
    return descs


def flag_setting(var: str, value) -> bool:
    """A "0" / "1" setting `var` read at import (or a bool a test or the tuner put there) as
    a bool; any other value refused by name (ValueError)."""
    if value not in ("0", "1", False, True):
        raise ValueError(f"{var} must be '0' or '1', got {value!r}")
    return value in ("1", True)


def check_tma_mode(mode: str, table: bool = False) -> bool:
    """Whether a kernel reads its tiles through TMA descriptors under ``CTXFAST_ATTN_TMA``'s
    value: "on" everywhere, "off" nowhere, "auto" where the launch table says (``table``:
    the kernels whose table rows a GPU timed faster with descriptors). Anything else is
    refused."""
    if mode not in ("auto", "off", "on"):
        raise ValueError(f"CTXFAST_ATTN_TMA must be 'auto', 'off' or 'on', got {mode!r}")
    return mode == "on" or (mode == "auto" and table)


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """The device can run TMA descriptor loads: a CUDA GPU of compute capability 9 or later
    (Hopper, Blackwell), or the interpreter (which emulates them)."""
    if _interpreting():
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def bulk_add_args(acc, rows: int, block_d: int, desc_name: str, flag_name: str) -> dict:
    """A launch's keyword arguments for adding tiles into the fp32 accumulator ``acc``
    (``[B, H, T, D]``) by TMA bulk reductions: ``{desc_name: RowTiles in [rows, block_d]
    tiles, flag_name: True}``, or ``{}`` (the element-wise adds) where acc's device has no
    TMA or TMA cannot address it (:func:`row_tiles`: D not a multiple of 4 in fp32). Under
    the interpreter it installs ``_interpreter.descriptor_reduce`` first."""
    desc = row_tiles(acc, rows, block_d) if _has_tma(acc.device) else None
    if desc is None:
        return {}
    if _interpreting():
        _interpreter.descriptor_reduce()
    return {desc_name: desc, flag_name: True}


def _seed_arg(q, dropout_p, seed):
    if dropout_p <= 0:
        return q                                   # never read (DROPOUT is False)
    if seed is None or seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != q.device:
        raise ValueError("dropout needs seed: an int64 tensor of one element on q's device")
    return seed


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: exact fp32 products unless torch allows tf32 for fp32
    matmuls (as a PyTorch user expects); fp16/bf16 operands keep Triton's default."""
    if dtype == torch.float64 or (dtype == torch.float32 and not _tf32_allowed()):
        return "ieee"
    return "tf32"


def _tf32_allowed() -> bool:
    """torch allows TF32 for fp32 matmuls. ``torch.backends.cuda.matmul.fp32_precision``
    (torch >= 2.9; reflects ``allow_tf32`` and ``set_float32_matmul_precision`` too) where it
    exists: reading ``allow_tf32`` raises a RuntimeError in torch 2.13 once the new API has
    set the precision. ``"none"`` defers to ``torch.backends.fp32_precision``."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:
        return bool(matmul.allow_tf32)
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"


def _rnn_tf32_allowed() -> bool:
    """torch allows TF32 in cuDNN's RNNs, the setting ``nn.LSTM`` reads for float32 (default:
    allowed): ``torch.backends.cudnn.rnn.fp32_precision`` where torch has it ("none" defers
    to cuDNN's, then to the global one), else ``torch.backends.cudnn.allow_tf32``. The CUDA
    LSTM's binding reads the same setting in C++ (``csrc/bindings/lstm_cuda.cpp``)."""
    cudnn = torch.backends.cudnn
    precision = getattr(getattr(cudnn, "rnn", None), "fp32_precision", None)
    if precision is None:
        return bool(cudnn.allow_tf32)
    if precision == "none":
        precision = getattr(cudnn, "fp32_precision", "none")
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"


def _auto_splits(B, H, Tq, Tk, bm, bn, device) -> int:
    """Flash-decoding: split the keys when the (b, h, query-block) programs cannot fill the
    GPU (few queries, long keys). Heuristic, not yet tuned on a GPU."""
    if device.type != "cuda" or _interpreting():
        return 1
    programs = B * H * cdiv(Tq, bm)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms or Tk < 4 * bn:
        return 1
    return max(1, min(cdiv(2 * sms, programs), cdiv(Tk, 4 * bn), 64))


def _split_targets(out, lse, B, H, Tq, Tk, D, bn, num_splits):
    """Where a forward writes (flash-decoding when num_splits > 1): (num_splits,
    keys_per_split, o_target, l_target, o_strides, l_strides, split_strides). With splits,
    o_target [B, H, S, Tq, D] and l_target [B, H, S, Tq] are fp32 partials for
    :func:`_combine_splits`, each split whole key blocks (a count above the key blocks
    gives one block each); without, out [B, H, Tq, D] and lse [B, H, Tq] themselves. A
    count that leaves one split (keys within one block) is no split: the caller launches
    one program per query block writing out and lse directly, and combines nothing."""
    if num_splits > 1:
        keys_per_split = cdiv(cdiv(Tk, num_splits), bn) * bn
        num_splits = cdiv(Tk, keys_per_split)
    if num_splits <= 1:
        return 1, 0, out, lse, out.stride(), (H * Tq, Tq), (0, 0)
    o_part = torch.empty((B, H, num_splits, Tq, D), dtype=torch.float32, device=out.device)
    l_part = torch.empty((B, H, num_splits, Tq), dtype=torch.float32, device=out.device)
    return (num_splits, keys_per_split, o_part, l_part,
            (o_part.stride(0), o_part.stride(1), o_part.stride(3), o_part.stride(4)),
            (l_part.stride(0), l_part.stride(1)), (o_part.stride(2), l_part.stride(2)))


def _combine_splits(o_part, l_part, out, lse):
    """out [B, H, Tq, D], lse [B, H, Tq] (contiguous) from :func:`_split_targets`' partials."""
    from ._launch import fast  # (here: _launch imports this module)
    B, H, S, Tq, D = o_part.shape
    for bh0, n in bh_chunks(B * H):
        fast(_attn_combine_kernel)[(Tq, n)](
            o_part, l_part, out, lse, S, Tq, D, bh0,
            BLOCK_S=max(2, next_pow2(S)), BLOCK_D=max(16, next_pow2(D)),
            num_warps=4)


def _bwd_delta(do, out):
    """Δ = rowsum(dO ∘ O) as fp32 ``[B, H, Tq]`` contiguous (:func:`_bwd_delta_kernel`)."""
    B, H, Tq, D = out.shape
    delta = torch.empty((B, H, Tq), dtype=torch.float32, device=out.device)
    if delta.numel() == 0:
        return delta
    block_m, block_d = delta_blocks(D)
    from ._launch import fast  # (here: _launch imports this module)
    for bh0, n in bh_chunks(B * H):
        fast(_bwd_delta_kernel)[(cdiv(Tq, block_m), n)](
            do, out, delta, *do.stride(), *out.stride(), H, Tq, D, bh0,
            BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)
    return delta


def delta_blocks(D: int) -> tuple:
    """(BLOCK_M, BLOCK_D) of the row-term launches (:func:`_bwd_delta_kernel` and the
    kernels that call it): up to 64 rows of 4,096 elements a program; 16 rows under the
    interpreter."""
    block_d = max(16, next_pow2(D))
    return (16 if _interpreting() else max(1, min(64, 4096 // block_d))), block_d
