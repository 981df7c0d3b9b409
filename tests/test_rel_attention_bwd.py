"""The backward of ctxfast.rel_attention (Triton): dr from its own kernel (a program per
block of r rows walking down the score matrix's diagonals, no atomics) or by atomic adds
from the dQ kernel, against the float64 reference, and the whole backward deterministic
where it should be (two runs, bitwise-equal gradients)."""
import inspect
import os

import pytest
import torch

import ctxfast
from test_attention import DEVICE, needs_triton
from test_rel_attention import _inputs, check
from utils import needs_interpreter, spy_launches


@needs_triton
@pytest.mark.parametrize("B, H, Tq, mem, R, pos_start, window, causal", [
    (3, 3, 19, 14, 38, None, None, True),   # odd lengths, R = Tk + 5 (not a block multiple)
    (2, 3, 21, 0, 23, 22, 7, True),         # no memory, a window, R past the keys
    (3, 2, 7, 33, 45, 41, 19, True),        # long memory, pos_start inside a longer r
    (2, 2, 17, 17, 54, 35, None, False),    # both directions, spare rows at both ends
    # Tq and the window 47 (15 mod 16: the tiles' diagonal bounds, off by one in the dR
    # kernel's or the dr GEMM's, passed the rows above), memory 15
    (1, 2, 47, 15, 62, None, 47, True),
])
def test_dr_against_float64(B, H, Tq, mem, R, pos_start, window, causal):
    """Every gradient (dr among them) within 2x eager's error against float64."""
    check(B, H, Tq, Tq + mem, 16, R=R, pos_start=pos_start, window=window, causal=causal)


@needs_triton
def test_dr_bidirectional_with_every_mask():
    """XLNet's form (not causal, R = Tk + Tq, pos_start = Tk): padding, permutation,
    segments and a window; dr of diagonals on both sides of the main one."""
    B, Tq, Tk = 2, 13, 29
    kpm = torch.rand(B, Tk, device=DEVICE) < 0.2
    rank = torch.stack([torch.randperm(Tq) for _ in range(B)]).to(DEVICE)
    check(B, 3, Tq, Tk, 16, R=Tk + Tq, seg=True, causal=False, pos_start=Tk, window=9,
          key_padding_mask=kpm, perm_rank=rank)


@needs_triton
@pytest.mark.parametrize("causal, window", [(False, 35), (False, 51), (True, 52)])
def test_interior_tiles_at_the_window_edge(causal, window):
    """Tiles that every pair of sees skip the mask work (kernels/rel_attention.py:
    _interior_keys, _interior_queries). Long windows over several blocks, both directions,
    with windows that put the edge of the interior exactly on a block boundary (the CPU
    tests run 16-row blocks): forward and every gradient against float64."""
    Tq, mem = 64, 20
    kw = dict(causal=False, R=2 * Tq + mem, pos_start=Tq + mem) if not causal else {}
    check(1, 2, Tq, Tq + mem, 16, window=window, **kw)


@needs_triton
@pytest.mark.parametrize("how", ["fp32", "fp16-deterministic-algorithms", "fp16-gemm-dr",
                                 "fp16-stored-dr"])
def test_backward_is_bitwise_deterministic(monkeypatch, how):
    """Two backward runs on the same inputs (dropout with the same seed, segments, padding,
    window): every gradient bitwise equal, in fp32 (the dR kernel by default) and in fp16
    under torch.use_deterministic_algorithms (which turns the default atomic dr of 16-bit
    D <= 64 calls on a GPU off); DR_MODE "gemm" (no atomics) is allowed under them, not
    warn-only, and is deterministic too, as is "stored"."""
    B, H, Tq, Tk, D = 3, 2, 13, 30, 16
    dtype = torch.float32 if how == "fp32" else torch.float16
    ts = _inputs(B, H, Tq, Tk, D, Tk + 3, dtype, seg=True)
    kpm = torch.zeros(B, Tk, dtype=torch.bool, device=DEVICE)
    kpm[1, 26:] = True
    kw = dict(seg_q=torch.randint(0, 2, (B, Tq), device=DEVICE),
              seg_k=torch.randint(0, 2, (B, Tk), device=DEVICE), key_padding_mask=kpm,
              window=11, dropout_p=0.2, backend="triton")
    do = torch.randn(B, H, Tq, D, dtype=dtype, device=DEVICE)

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in ts]
        out = ctxfast.rel_attention(*leaves[:6], seg_embed=leaves[6], r_s_bias=leaves[7],
                                    generator=torch.Generator(DEVICE).manual_seed(3), **kw)
        return torch.autograd.grad(out, leaves, do)

    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    if how in ("fp16-gemm-dr", "fp16-stored-dr"):
        import ctxfast.kernels.rel_attention as krel
        monkeypatch.setattr(krel, "DR_MODE", how.split("-")[1])
    try:
        if how != "fp32":
            torch.use_deterministic_algorithms(True, warn_only=how == "fp16-deterministic-"
                                                              "algorithms")
        first, second = grads(), grads()
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    for a, b in zip(first, second):
        assert a.abs().sum() > 0
        assert torch.equal(a, b)


def test_atomics_only_in_the_dr_branch():
    """The interpreter's atomics are sequential: the bitwise test above cannot catch a GPU
    race. The atomic adds are the DR_MODE "atomic" and "bulk" branches (in _rel_dr_atomic,
    called only under ``if ATOMIC_DR:``), which "auto" (the default) takes on 16-bit 64 x 64
    tiles unless deterministic algorithms are asked for (the next test)."""
    pytest.importorskip("triton")
    from ctxfast.kernels import rel_attention
    lines = inspect.getsource(rel_attention).splitlines()
    helper = inspect.getsource(rel_attention._rel_dr_atomic.fn)
    hits = [line.strip() for line in lines if "atomic_add" in line]
    assert len(hits) == 2 and all(hit in helper for hit in hits), hits
    calls = [n for n, line in enumerate(lines) if "_rel_dr_atomic(" in line
             and "def _rel_dr_atomic(" not in line]
    assert calls and all("if ATOMIC_DR:" in lines[n - 1] for n in calls), calls
    if "CTXFAST_REL_BWD_DR" not in os.environ:
        assert rel_attention.DR_MODE == "auto"


@needs_triton
def test_dr_mode_auto_and_deterministic_algorithms(monkeypatch):
    """DR_MODE "auto": dr by atomic adds on 16-bit 64 x 64 tiles (the H200 timed it faster),
    the dR kernel on other tiles, in fp32, and whenever torch's deterministic algorithms are
    on; "atomic" asked for under them is refused (warn-only lets it run). Right against
    float64 both ways at 64-row tiles (the "tile" override); a spy sees which path ran."""
    import test_rel_attention as rel_tests
    import ctxfast.kernels.rel_attention as krel
    monkeypatch.setattr(krel, "DR_MODE", "auto")
    f16 = torch.float16
    assert krel._dr_mode(64, f16) == ("atomic" if krel._config(64, None, f16)[0] == 64
                                      else "kernel")
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "tile", 64)
    assert krel._dr_mode(64, f16) == "atomic" and krel._dr_mode(64, torch.float32) == "kernel"
    seen = spy_launches(monkeypatch, krel,
                        ("_rel_attn_bwd_dq_kernel", "_rel_attn_bwd_dr_kernel"),
                        lambda args, kwargs: kwargs.get("ATOMIC_DR"))
    rel_tests.test_half_dtypes(f16)                               # D 64 fp16, 64 x 64 tiles
    assert seen == [("_rel_attn_bwd_dq_kernel", True)], seen
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert krel._dr_mode(64, f16) == "kernel"
        seen.clear()
        rel_tests.test_half_dtypes(f16)
        assert seen == [("_rel_attn_bwd_dq_kernel", False),
                        ("_rel_attn_bwd_dr_kernel", None)], seen          # (no such flag)
        monkeypatch.setattr(krel, "DR_MODE", "atomic")
        with pytest.warns(UserWarning, match="CTXFAST_REL_BWD_DR=atomic"):
            assert krel._dr_mode(64, f16) == "atomic"             # warn-only: warned, run
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="CTXFAST_REL_BWD_DR=atomic"):
            krel._dr_mode(64, f16)
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


@needs_triton
@pytest.mark.parametrize("mode", ["kernel", "atomic", "gemm", "stored"])
def test_every_tensor_in_its_own_layout(monkeypatch, mode):
    """Each tensor is read through its own strides, in every dr mode: q, k, v, r and the
    upstream gradient each in another layout, the padding mask and the ranks transposed.
    Read with another tensor's strides (v with k's in the forward) or as contiguous (the
    stored mode's dO, the ranks, the mask), each passed every other test of the op, whose
    tensors shared one layout. One batch is all
    padding: its rows see no key."""
    import ctxfast.kernels.rel_attention as krel
    from ctxfast import reference
    from test_attention import FLOOR
    from test_rel_attention import NAMES
    from utils import assert_within_2x_eager, rel_exponent_floor, rel_grad_terms
    monkeypatch.setattr(krel, "DR_MODE", mode)
    B, H, Tq, Tk, D = 2, 2, 19, 33, 16
    q = torch.randn(Tq, B, H, D, device=DEVICE).permute(1, 2, 0, 3)   # [T, B, H, D] storage
    k = torch.randn(B, H, Tk, D, device=DEVICE)
    v = torch.randn(B, Tk, H, D, device=DEVICE).transpose(1, 2)       # [B, T, H, D] storage
    r = torch.randn(Tk, H, D, device=DEVICE).transpose(0, 1)          # [R, H, D] storage
    u, w = torch.randn(H, D, device=DEVICE), torch.randn(H, D, device=DEVICE)
    do = torch.randn(B, Tq, H, D, device=DEVICE).transpose(1, 2)
    kpm = (torch.rand(Tk, B, device=DEVICE) < 0.2).t()
    kpm[0, 0] = False
    kpm[1] = True                                  # the second batch's rows see no key
    rank = torch.stack([torch.randperm(Tq) for _ in range(B)], 1).to(DEVICE).t()
    assert len({t.stride() for t in (q, k, v)}) == 3
    assert not (r.is_contiguous() or do.is_contiguous() or kpm.is_contiguous()
                or rank.is_contiguous())
    for kw in (dict(causal=True, key_padding_mask=kpm),
               dict(causal=True, perm_rank=rank)):     # causal: ranks in the caller's layout
        inputs = (q, k, v, r, u, w)
        ts, same = ([t.clone().requires_grad_() for t in inputs] for _ in range(2))
        t64 = [t.detach().double().requires_grad_() for t in inputs]
        out = ctxfast.rel_attention(*ts, backend="triton", **kw)
        out_same, out64 = reference.rel_attention(*same, **kw), reference.rel_attention(*t64, **kw)
        got = [out] + list(torch.autograd.grad(out, ts, do))
        eager = [out_same] + list(torch.autograd.grad(out_same, same, do))
        want = [out64] + list(torch.autograd.grad(out64, t64, do.double()))
        # (check()'s rule: 2x eager against float64, the floors of the softmax's terms)
        terms = [1.0] + rel_grad_terms(inputs, do, **kw)
        floor = max(FLOOR[torch.float32], rel_exponent_floor(inputs, **kw))
        for name, a, e, b, t in zip(["out"] + NAMES, got, eager, want, terms):
            assert_within_2x_eager(a, e, b, floor, name=f"{mode} {sorted(kw)} {name}",
                                   min_scale=max(1.0, t))


@needs_triton
@pytest.mark.parametrize("mode", ["atomic", "bulk", "gemm", "stored"])
def test_atomic_dr_against_reference(monkeypatch, mode):
    """kernels.rel_attention.DR_MODE = "atomic" (the dQ kernel adds each tile's
    dS_bandᵀ (q + v) into an fp32 dr accumulator; no dR kernel), "bulk" (the same, a tile
    at a time by TMA bulk reductions: rows before 0 and past R dropped, which the
    interpreter runs through ctxfast's shim) or "gemm" (the dQ kernel stores dS and the
    key range of each query block; two GEMMs read dS along its diagonals, for dq's position
    term and for dr) or "stored" (the same with P stored too, and dK, dV by a GEMM over
    the two, no dK/dV kernel): the module's own
    reference checks run in that mode, forward and every gradient against float64 within
    2x eager: odd lengths and memory, a longer r, XLNet's order with segments and padding,
    a window, rows that see no key, dropout."""
    import test_rel_attention as rel_tests
    import ctxfast.kernels.rel_attention as krel
    monkeypatch.setattr(krel, "DR_MODE", mode)
    seen = spy_launches(monkeypatch, krel, ("_rel_attn_bwd_dq_kernel",),
                        lambda args, kwargs: (kwargs.get("ATOMIC_DR"), kwargs.get("DR_BULK"),
                                              kwargs.get("DR_GEMM")))
    gemms = spy_launches(monkeypatch, krel, ("_rel_dr_gemm_kernel",), lambda a, kw: None)
    dkdv = spy_launches(monkeypatch, krel, ("_rel_attn_bwd_dkdv_kernel",
                                            "_rel_dkdv_gemm_kernel"), lambda a, kw: None)
    test_dr_against_float64(3, 3, 19, 14, 38, None, None, True)
    test_dr_against_float64(2, 2, 17, 17, 54, 35, None, False)
    test_dr_against_float64(1, 2, 47, 15, 62, None, 47, True)
    test_dr_bidirectional_with_every_mask()
    rel_tests.test_xlnet_bidirectional_perm_segments_padding("query")
    rel_tests.test_window_rows_that_see_no_key()
    rel_tests.test_rows_that_see_no_key()
    rel_tests.check_dropout(2, 2, 13, 21, 16, 0.25, seed=5)
    # at the 64 x 64 tiles where "auto" takes this path on a GPU (the interpreter's are 16)
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "tile", 64)
    test_dr_against_float64(2, 2, 67, 30, 100, None, None, True)
    rel_tests.test_rows_that_see_no_key()
    rel_tests.test_window_rows_that_see_no_key()
    monkeypatch.delitem(krel.LAUNCH_OVERRIDE, "tile")
    assert seen and all(flags[0] for _, flags in seen), seen
    assert any(flags[1] for _, flags in seen) == (mode == "bulk"), seen
    stored = mode in ("gemm", "stored")
    assert all(bool(flags[2]) == stored for _, flags in seen), seen
    assert (len(gemms) == len(seen)) if stored else not gemms, (gemms, seen)
    names = {name for name, _ in dkdv}
    assert names == {"_rel_dkdv_gemm_kernel" if mode == "stored"
                     else "_rel_attn_bwd_dkdv_kernel"}, names
    monkeypatch.setattr(krel, "DR_MODE", "fast")
    with pytest.raises(ValueError, match="CTXFAST_REL_BWD_DR"):
        test_dr_against_float64(1, 1, 5, 0, 5, None, None, True)
    # refused at the forward, before its first launch (not only at the backward)
    fwd = spy_launches(monkeypatch, krel, ("_row_bias_kernel", "_rel_attn_fwd_kernel"),
                       lambda a, kw: None)
    q, k, v = (torch.randn(1, 1, 5, 16) for _ in range(3))
    r, u, w = torch.randn(1, 5, 16), torch.randn(1, 16), torch.randn(1, 16)
    with pytest.raises(ValueError, match="CTXFAST_REL_BWD_DR"):
        ctxfast.rel_attention(q, k, v, r, u, w, backend="triton")
    assert not fwd


def _variant_reference_checks():
    """The reference checks a kernel variant runs (set by the caller's monkeypatch): dr and
    every gradient against float64 within 2x eager with memory, a window, a longer r and
    causal off, XLNet's bidirectional order with every mask, rows that see no key, and
    dropout."""
    import test_rel_attention as rel_tests
    test_dr_against_float64(3, 3, 19, 14, 38, None, None, True)
    test_dr_against_float64(2, 3, 21, 0, 23, 22, 7, True)
    test_dr_against_float64(2, 2, 17, 17, 54, 35, None, False)
    test_dr_bidirectional_with_every_mask()
    rel_tests.test_rows_that_see_no_key()
    rel_tests.check_dropout(2, 2, 13, 21, 16, 0.25, seed=5)


@needs_triton
def test_band_in_two_halves_against_reference(monkeypatch):
    """The dK/dV and dR kernels with HALVES (the band of r rows / of keys in two halves of
    BLOCK_N, as on a GPU's 64 x 64 tiles; kernels.rel_attention.HALVES_MIN_BLOCK lowered to
    the interpreter's 16): the module's reference checks, every gradient against float64
    within 2x eager, and a spy that both kernels ran in halves."""
    import ctxfast.kernels.rel_attention as krel
    monkeypatch.setattr(krel, "HALVES_MIN_BLOCK", 16)
    seen = spy_launches(monkeypatch, krel,
                        ("_rel_attn_bwd_dkdv_kernel", "_rel_attn_bwd_dr_kernel"),
                        lambda args, kwargs: kwargs["HALVES"])
    _variant_reference_checks()
    assert {name for name, _ in seen} == {"_rel_attn_bwd_dkdv_kernel", "_rel_attn_bwd_dr_kernel"}
    assert all(halves for _, halves in seen), seen


@needs_triton
def test_carried_gather_against_reference(monkeypatch):
    """LAUNCH_OVERRIDE {"carry": True} (the forward and dQ kernels carry the previous tile's
    gathered position product; kernels.rel_attention._rel_scores_chunked): the module's
    reference checks, forward and every gradient against float64 within 2x eager: memory,
    a longer r, XLNet's order with segments and padding, a window, rows that see no key,
    dropout, split decoding, and at 64 x 64 tiles; a spy that both kernels ran with CARRY."""
    import ctxfast.kernels.rel_attention as krel
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "carry", True)
    seen = spy_launches(monkeypatch, krel,
                        ("_rel_attn_fwd_kernel", "_rel_attn_bwd_dq_kernel"),
                        lambda args, kwargs: kwargs["CARRY"])
    _variant_reference_checks()
    from ctxfast.kernels.rel_attention import rel_attention_forward
    ts = _inputs(2, 2, 3, 70, 16, 70)
    out3, lse3 = rel_attention_forward(*ts, num_splits=3)
    out1, lse1 = rel_attention_forward(*ts, num_splits=1)
    assert torch.allclose(out3, out1, rtol=1e-5, atol=1e-6)
    # at the 64 x 64 tiles where a GPU carries it (the rotation's even / odd halves)
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "tile", 64)
    test_dr_against_float64(2, 2, 67, 30, 100, None, None, True)
    import test_rel_attention as rel_tests
    rel_tests.test_rows_that_see_no_key()
    monkeypatch.delitem(krel.LAUNCH_OVERRIDE, "tile")
    assert {name for name, _ in seen} == {"_rel_attn_fwd_kernel", "_rel_attn_bwd_dq_kernel"}
    assert all(carry for _, carry in seen), seen


@needs_triton
def test_launch_override_picks_the_dr_mode(monkeypatch):
    """LAUNCH_OVERRIDE {"dr_mode": "atomic"} (the config sweep's variant) runs the atomic dr
    path (the dQ kernel with ATOMIC_DR, no dR kernel) with the right gradients, and a bad
    mode is refused before any launch."""
    import ctxfast.kernels.rel_attention as krel
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "dr_mode", "atomic")
    seen = spy_launches(monkeypatch, krel,
                        ("_rel_attn_bwd_dq_kernel", "_rel_attn_bwd_dr_kernel"),
                        lambda args, kwargs: kwargs.get("ATOMIC_DR"))
    test_dr_against_float64(2, 2, 17, 17, 54, 35, None, True)
    assert seen and seen == [("_rel_attn_bwd_dq_kernel", True)] * len(seen), seen
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "dr_mode", "fast")
    with pytest.raises(ValueError, match="CTXFAST_REL_BWD_DR"):
        test_dr_against_float64(1, 1, 5, 0, 5, None, None, True)


@needs_triton
def test_tma_auto_reads_descriptors_in_the_forward_at_64_tiles(monkeypatch):
    """TMA_MODE "auto" (the default): the forward with 64 x 64 tiles reads descriptors (the
    H200 timed it faster with them), dQ keeps pointer tiles; with other tiles (the
    interpreter's 16, decoding's 16-row query block) it does not, nor with "off". Right
    against float64 with 64-row tiles forced (the "tile" override); a spy sees the flags."""
    import ctxfast.kernels.rel_attention as krel
    import test_rel_attention as rel_tests
    monkeypatch.setattr(krel, "TMA_MODE", "auto")
    seen = spy_launches(monkeypatch, krel, ("_rel_attn_fwd_kernel", "_rel_attn_bwd_dq_kernel"),
                        lambda args, kwargs: kwargs.get("TMA", False))
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "tile", 64)
    rel_tests.test_half_dtypes(torch.float16)
    assert seen == [("_rel_attn_fwd_kernel", True), ("_rel_attn_bwd_dq_kernel", False)], seen
    monkeypatch.delitem(krel.LAUNCH_OVERRIDE, "tile")
    if DEVICE == "cpu":
        seen.clear()
        rel_tests.test_half_dtypes(torch.float16)                 # the interpreter's 16 x 16
        assert seen and not any(tma for _, tma in seen), seen
    k = torch.randn(1, 1, 70, 16, dtype=torch.float16, device=DEVICE)
    assert not krel._tma_args("fwd", ("KD",), (k,), 16, 64, 16)    # decoding's tiles
    monkeypatch.setattr(krel, "TMA_MODE", "off")
    assert not krel._tma_args("fwd", ("KD",), (k,), 64, 64, 16)
    monkeypatch.setattr(krel, "TMA_MODE", "auto")
    assert krel._tma_args("fwd", ("KD",), (k,), 64, 64, 16)


@needs_triton
@pytest.mark.parametrize("halves", [False, True])
def test_tma_tiles_against_reference(monkeypatch, halves):
    """kernels.rel_attention.TMA_MODE = "on" (``CTXFAST_ATTN_TMA``): the forward and dQ
    kernels read k, v and r's chunks through tensor descriptors, which the interpreter
    emulates as TMA does (rows outside the tensor, negative ones included, read as 0). The
    module's reference checks in that mode (with and without the dK/dV band in halves),
    with the carried gather too and split decoding, forward and every gradient against
    float64 within 2x eager; a spy sees every launch of the two kernels take the
    descriptors. fp32 is let in here (GPUs take TMA for 16-bit calls only): the addressing
    does not depend on the dtype."""
    import ctxfast.kernels.rel_attention as krel
    if "CTXFAST_ATTN_TMA" not in os.environ:
        assert krel.TMA_MODE == "auto"            # the forward at 64 x 64 (test below)
    monkeypatch.setattr(krel, "TMA_MODE", "on")
    monkeypatch.setattr(krel, "TMA_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    if halves:
        monkeypatch.setattr(krel, "HALVES_MIN_BLOCK", 16)
    seen = spy_launches(monkeypatch, krel, ("_rel_attn_fwd_kernel", "_rel_attn_bwd_dq_kernel"),
                        lambda args, kwargs: kwargs.get("TMA", False))
    _variant_reference_checks()
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "carry", True)
    test_dr_against_float64(2, 3, 21, 0, 23, 22, 7, True)
    monkeypatch.delitem(krel.LAUNCH_OVERRIDE, "carry")
    import test_rel_attention as rel_tests
    rel_tests.test_half_dtypes(torch.float16)
    from ctxfast import reference
    from ctxfast.kernels.rel_attention import rel_attention_forward
    ts = _inputs(2, 2, 3, 70, 16, 70)
    out3, _ = rel_attention_forward(*ts, num_splits=3)
    ref = reference.rel_attention(*(t.double() for t in ts))
    assert (out3.double() - ref).abs().max() < 1e-5
    kernels = {name for name, _ in seen}
    assert kernels == {"_rel_attn_fwd_kernel", "_rel_attn_bwd_dq_kernel"}, kernels
    assert all(tma for _, tma in seen), seen
    monkeypatch.setattr(krel, "TMA_MODE", "yes")
    with pytest.raises(ValueError, match="CTXFAST_ATTN_TMA"):
        test_dr_against_float64(1, 1, 5, 0, 5, None, None, True)
    # the backward refuses it before its first launch (the row term's and operands' kernel)
    monkeypatch.setattr(krel, "TMA_MODE", "on")
    ts = _inputs(1, 1, 5, 5, 16, 5)
    out, lse = rel_attention_forward(*ts)
    monkeypatch.setattr(krel, "TMA_MODE", "yes")
    monkeypatch.setattr(krel, "_rel_bwd_prep_kernel", None)   # any launch would fail here
    with pytest.raises(ValueError, match="CTXFAST_ATTN_TMA"):
        krel.rel_attention_backward(torch.randn_like(out), *ts, out, lse)


@needs_interpreter    # records the jitted helper's calls: only the interpreter runs them as Python
def test_row_bias_reads_stay_in_the_padded_table(monkeypatch):
    """The forward and dQ kernels read the position term's row bias (row_bias_table) without
    a mask: every read ``row_start + [0, BLOCK)`` must fall within the table's zero pad
    (BLOCK_M + 2·BLOCK_N rows on either side of r's R rows). Recorded through _rb_rows for
    Transformer-XL's and XLNet's layouts, odd lengths, a window, decoding and a longer r,
    forward and backward, at the interpreter's 16-row tiles and at 64 x 64 ones."""
    from ctxfast.kernels import rel_attention as krel
    reads = []

    def recorded(rb_base, row_start, BLOCK_R, _fn=krel._rb_rows):
        reads.append((int(row_start), int(BLOCK_R)))
        return _fn(rb_base, row_start, BLOCK_R)
    monkeypatch.setattr(krel, "_rb_rows", recorded)
    cases = [dict(Tq=17, mem=0), dict(Tq=33, mem=31), dict(Tq=1, mem=40), dict(Tq=5, mem=70),
             dict(Tq=29, mem=20, window=9), dict(Tq=19, mem=14, R_extra=23),
             dict(Tq=21, mem=12, causal=False, xlnet=True)]
    for tile in (None, 64):
        if tile is not None:
            monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "tile", tile)
        for case in cases:
            Tq, mem = case["Tq"], case["mem"]
            Tk = Tq + mem
            R = Tk + Tq if case.get("xlnet") else Tk + case.get("R_extra", 0)
            ts = [t.requires_grad_(True) for t in _inputs(2, 2, Tq, Tk, 16, R, torch.float32)]
            kw = dict(causal=case.get("causal", True), window=case.get("window"))
            if case.get("xlnet"):
                kw["pos_start"] = Tk
            reads.clear()
            out = ctxfast.rel_attention(*ts, backend="triton", **kw)
            out.sum().backward()
            bm, bn = krel._config(16, Tq, torch.float32)[:2]
            bm_b, bn_b = krel._config(16, None, torch.float32)[:2]
            pad = min(bm + 2 * bn, bm_b + 2 * bn_b)
            assert reads, case
            lo = min(s for s, _ in reads)
            hi = max(s + n for s, n in reads)
            assert -pad <= lo and hi <= R + pad, (case, tile, lo, hi, R, pad)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_row_bias_table(dtype):
    """row_bias_table: (r_r_bias − r_w_bias)·r_m in fp32 for every row of r (a strided r as
    the models pass it: [R, H, D] storage), zeros in the pad on either side."""
    from ctxfast.kernels import rel_attention as krel
    H, R, D, pad = 3, 37, 40, 19
    r = torch.randn(R, H, D, device=DEVICE).to(dtype).transpose(0, 1)      # [H, R, D]
    u, w = (torch.randn(H, D, device=DEVICE).to(dtype) for _ in range(2))
    table = krel.row_bias_table(r, u, w, pad)
    want = torch.einsum("hrd,hd->hr", r.double(), w.double() - u.double())
    assert table.shape == (H, R) and table.dtype == torch.float32
    assert (table.double() - want).abs().max() <= 1e-5 * want.abs().max()
    whole = table.as_strided((H, R + 2 * pad), (table.stride(0), 1),
                             table.storage_offset() - pad)
    assert (whole[:, :pad] == 0).all() and (whole[:, pad + R:] == 0).all()
    # split: [H, R, 16] bf16, columns 0 and 1 the value's two halves, the rest 0, a TMA view
    split = krel.row_bias_table(r, u, w, pad, split=True)
    assert split.shape == (H, R, 16) and split.dtype == torch.bfloat16
    halves = split[..., 0].double() + split[..., 1].double()
    assert (halves - table.double()).abs().max() <= 2 ** -15 * table.abs().max()
    assert (split[..., 1] != 0).any() and (split[..., 2:] == 0).all()
    whole = split.as_strided((H, R + 2 * pad, 16), (split.stride(0), 16, 1),
                             split.storage_offset() - 16 * pad)
    assert (whole[:, :pad] == 0).all() and (whole[:, pad + R:] == 0).all()
    assert krel.row_tiles(split.unsqueeze(0), 64, 16) is not None


@needs_triton
def test_register_caps_reach_their_launches_only(monkeypatch):
    """The overrides "<kernel>_maxnreg" (the tuner's register-capped rows: the forward at
    three CTAs an SM, the dQ kernel at two, kernels/rel_attention._reg_cap) reach their
    kernel's launch as Triton's ``maxnreg`` and no other; without them no launch caps
    registers. The interpreter ignores the cap: the outputs and gradients are the same
    bits either way."""
    import ctxfast.kernels.rel_attention as krel
    names = ("_rel_attn_fwd_kernel", "_rel_attn_bwd_dkdv_kernel", "_rel_attn_bwd_dq_kernel",
             "_rel_attn_bwd_dr_kernel")
    seen = spy_launches(monkeypatch, krel, names,
                        lambda args, kwargs: (kwargs.get("maxnreg"), kwargs.get("num_stages")))
    q, k, v, r, u, w = _inputs(2, 2, 19, 31, 16, 31, torch.float32)

    def run():
        out, lse = krel.rel_attention_forward(q, k, v, r, u, w)
        grads = krel.rel_attention_backward(torch.ones_like(out), q, k, v, r, u, w, out, lse)
        return [out, lse, *grads]
    plain = run()
    assert seen and all(cap is None for _, (cap, _s) in seen), seen
    seen.clear()
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "fwd", (4, 2))
    # a different cap per kernel, so that one reaching another's launch shows
    want = {"fwd": 168, "dkdv": 160, "dq": 128, "dr": 152}
    for kernel, cap in want.items():
        monkeypatch.setitem(krel.LAUNCH_OVERRIDE, kernel + "_maxnreg", cap)
    capped = run()
    caps = {n: cap for n, (cap, _s) in seen}          # (the interpreter's rows: one stage)
    assert caps == {f"_rel_attn_{'fwd' if k == 'fwd' else 'bwd_' + k}_kernel": c
                    for k, c in want.items()}, seen
    seen.clear()
    monkeypatch.delitem(krel.LAUNCH_OVERRIDE, "dkdv_maxnreg")      # one alone: the others
    run()
    assert {n: cap for n, (cap, _s) in seen}["_rel_attn_bwd_dkdv_kernel"] is None, seen
    for a, b in zip(plain, capped):
        assert a is None and b is None or torch.equal(a, b)


def check_row_bias_product(monkeypatch, B, H, Tq, mem, D, dtype):
    """The forward's lse with the row bias as a product (the "rb_mma" override on) and as
    a vector (off) on the same inputs, r 9 rows longer than the keys:
    within 2^-13 of the largest row bias (in the kernel's base-2 units: 8x what rounding it
    to two bf16 halves can move; dropping the low half moves it ~30x the bound)."""
    import ctxfast.kernels.rel_attention as krel
    from ctxfast.kernels._common import LOG2E
    q, k, v, r, u, w = _inputs(B, H, Tq, Tq + mem, D, Tq + mem + 9, dtype)
    w = (w.float() * 3).to(dtype)                       # row biases well away from 0
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "rb_mma", True)
    _, lse = krel.rel_attention_forward(q, k, v, r, u, w)
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "rb_mma", False)
    _, lse_v = krel.rel_attention_forward(q, k, v, r, u, w)
    monkeypatch.delitem(krel.LAUNCH_OVERRIDE, "rb_mma")
    rb = krel.row_bias_table(r, u.contiguous(), w.contiguous(), 0)
    bound = 2 ** -13 * rb.abs().max().item() * D ** -0.5 * LOG2E
    worst = (lse - lse_v).abs().max().item()
    assert worst <= bound, f"lse moved {worst:.3e} > {bound:.3e}"


@needs_triton
@pytest.mark.filterwarnings("ignore:All-NaN slice")     # the compile-only run's NaN table
def test_a_run_that_compiles_only_leaves_nothing_behind(monkeypatch):
    """The tuner compiles a kernel's candidates ahead by running the launcher with its
    launches compiling only (kernels/_tune.py, GPU calls), then runs them for real in the
    same call: nothing the first run makes may be kept for the others. rel_attention's
    forward makes the row bias's split table (RB_MMA) inside its launcher, once per call.
    Here that order (a compile-only run, then the real one), with the table of a
    compile-only run holding NaN, as a kernel that did not run would leave it: the output
    and lse must equal a plain call's, bit for bit (kept, the NaN table gives NaN)."""
    import ctxfast.kernels.rel_attention as krel
    from ctxfast.kernels import _launch
    if not krel._has_tma(torch.device(DEVICE)):
        pytest.skip("TMA descriptors need the interpreter or compute capability 9+")
    monkeypatch.setattr(krel, "TMA_MODE", "auto")
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "tile", 64)
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "rb_mma", True)
    q, k, v, r, u, w = _inputs(1, 1, 70, 103, 32, 112, torch.bfloat16)
    want = krel.rel_attention_forward(q, k, v, r, u, w)
    real_table = krel.row_bias_table

    def table(*args, **kwargs):
        t = real_table(*args, **kwargs)
        return t.fill_(float("nan")) if _launch.compiling_only() else t

    def tuned(kernels, q_, dims, flags, run, outputs):       # the tuner's order, in short
        with _launch.compile_only():
            run()
        return run()
    monkeypatch.setattr(krel, "row_bias_table", table)
    monkeypatch.setattr(krel, "_tuned", tuned)
    got = krel.rel_attention_forward(q, k, v, r, u, w)
    for name, a, b in zip(("out", "lse"), got, want):
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max()}"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_row_bias_as_a_product_on_tma_tiles(monkeypatch, dtype):
    """RB_MMA (opt-in; off by default): the forward on TMA tiles (64 x 64, 16-bit: TMA_MODE
    "auto"'s) adds the row bias as ``ones x`` the split table's tile (_rb_mma_args), and
    nowhere else (dQ, 16-row tiles, float32, the default): a spy sees the flag. Its lse
    agrees with the vector path's on the same inputs within what rounding the row bias to
    two bf16 halves can move (2^-13 of the largest row bias, in the kernel's base-2 units:
    dropping the low half moves it ~30x that), and the module's 16-bit reference check
    passes at these tiles. Odd lengths, memory, two query blocks, r longer than the keys."""
    import ctxfast.kernels.rel_attention as krel
    import test_rel_attention as rel_tests
    if not krel._has_tma(torch.device(DEVICE)):
        pytest.skip("TMA descriptors need the interpreter or compute capability 9+")
    monkeypatch.setattr(krel, "TMA_MODE", "auto")
    seen = spy_launches(monkeypatch, krel, ("_rel_attn_fwd_kernel", "_rel_attn_bwd_dq_kernel"),
                        lambda args, kwargs: kwargs.get("RB_MMA", False))
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "tile", 64)
    check_row_bias_product(monkeypatch, 2, 2, 70, 33, 32, dtype)
    assert seen == [("_rel_attn_fwd_kernel", True), ("_rel_attn_fwd_kernel", False)], seen
    if "CTXFAST_REL_RB_MMA" not in os.environ:
        seen.clear()
        rel_tests.test_half_dtypes(dtype)               # the default: the vector
        assert ("_rel_attn_fwd_kernel", False) in seen and not any(m for _, m in seen), seen
    monkeypatch.setattr(krel, "RB_MMA", "1")
    seen.clear()
    rel_tests.test_half_dtypes(dtype)                   # against float64, 2x eager, fwd + bwd
    assert ("_rel_attn_fwd_kernel", True) in seen
    assert ("_rel_attn_bwd_dq_kernel", True) not in seen, seen
    # rows that see no key (every key of sequence 0 padded): zeros, zero gradients, no NaN;
    # two query blocks, the second partial; every tile a masked one (the padding's loop)
    kpm = torch.zeros(2, 103, dtype=torch.bool, device=DEVICE)
    kpm[0] = True
    kpm[1, 90:] = True
    seen.clear()
    out, grads = rel_tests.check(2, 2, 70, 103, 32, dtype=dtype, key_padding_mask=kpm)
    assert ("_rel_attn_fwd_kernel", True) in seen, seen
    assert (out[0] == 0).all() and (grads[0][0] == 0).all()
    monkeypatch.delitem(krel.LAUNCH_OVERRIDE, "tile")
    seen.clear()
    rel_tests.test_half_dtypes(dtype)                   # 16-row tiles: the vector
    assert seen and not any(mma for _, mma in seen), seen
    assert not krel._rb_mma_args({"TMA": True}, torch.float32, 64, 64, lambda: None)
    monkeypatch.setattr(krel, "RB_MMA", "yes")          # a bad CTXFAST_REL_RB_MMA: refused
    launched = spy_launches(monkeypatch, krel, ("_row_bias_kernel",), lambda a, k: True)
    with pytest.raises(ValueError, match="CTXFAST_REL_RB_MMA"):
        krel.rel_attention_forward(*_inputs(1, 1, 5, 5, 16, 5, dtype))
    assert not launched                                 # before the forward's first launch


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("Tq", [1, 17])
@pytest.mark.parametrize("seg", [False, True])
def test_backward_prep(dtype, Tq, seg):
    """_bwd_prep (the backward's first launch): Δ = rowsum(dO ∘ O) in fp32, q + r_w_bias and
    q + r_r_bias as the dK/dV and dR kernels formed them (an fp32 sum rounded once to k's
    dtype: bitwise), and with segments each row's (q + r_s_bias)·seg_embed[0 | 1]; strided
    q, dO and out ([B, T, H, D] storage, as the models pass them), D 41."""
    from ctxfast.kernels import rel_attention as krel
    B, H, D = 2, 3, 41

    def strided():
        return torch.randn(B, Tq, H, D, device=DEVICE).to(dtype).transpose(1, 2)

    q, do, out = strided(), strided(), strided()
    u, w, rsb = (torch.randn(H, D, device=DEVICE).to(dtype) for _ in range(3))
    se = torch.randn(2, H, D, device=DEVICE).to(dtype)
    delta, qu, qw, ef = krel._bwd_prep(do, out, q, u, w, dtype,
                                       *((se, rsb) if seg else ()))
    want = (do.double() * out.double()).sum(-1)
    assert delta.dtype == torch.float32 and delta.shape == (B, H, Tq)
    assert (delta.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for got, bias in ((qu, u), (qw, w)):
        assert got.dtype == dtype and got.is_contiguous() and got.shape == q.shape
        x = (q.float() + bias.float()[None, :, None]).contiguous()
        assert torch.equal(got, x.to(dtype))    # rounded to nearest even, interpreter or GPU
    if seg:
        qs = q.double() + rsb.double()[None, :, None]
        want = torch.einsum("bhid,shd->bhis", qs, se.double())          # [B, H, Tq, 2]
        assert ef.shape == (B, H, Tq, 2) and ef.dtype == torch.float32
        assert (ef.double() - want).abs().max() <= 1e-5 * want.abs().max()


try:
    import triton
    import triton.language as tl
    from ctxfast.kernels.rel_attention import _rotate, _skewed

    @triton.jit
    def _skew_probe(X, SIG, ROT, SKEW, BM: tl.constexpr, BN: tl.constexpr):
        """ROT = _rotate(X[:, :BN], SIG), SKEW = _skewed(X[:, :BN], X[:, BN:], SIG)."""
        ii = tl.arange(0, BM)[:, None]
        jj = tl.arange(0, BN)[None, :]
        lo = tl.load(X + ii * 2 * BN + jj)
        hi = tl.load(X + ii * 2 * BN + BN + jj)
        sig = tl.load(SIG + tl.arange(0, BM))
        tl.store(ROT + ii * BN + jj, _rotate(lo, sig, BM, BN))
        tl.store(SKEW + ii * BN + jj, _skewed(lo, hi, sig, BM, BN))
except ImportError:                     # no Triton: the test that needs it is skipped
    _skew_probe = None


@needs_triton
@pytest.mark.parametrize("BLOCK_M, BLOCK_N", [(16, 16), (32, 32), (64, 64), (16, 64),
                                              (32, 128)])
def test_rotation_and_skew_are_gathers(BLOCK_M, BLOCK_N):
    """The skew every rel_attention tile applies (kernels.rel_attention._rotate: row ii
    rotated left by sig[ii], its even and odd columns apart from 64 columns up; _skewed:
    band column jj + sig[ii] of two chunks) element for element the torch.gather it stands
    for: any shift, multiples of 2·BLOCK_N added (the dQ and dR loops add them), narrow and
    wide tiles, NaN and inf carried through."""
    x = torch.randn(BLOCK_M, 2 * BLOCK_N, device=DEVICE)
    x[0, 3], x[BLOCK_M - 1, BLOCK_N + 1] = float("nan"), float("inf")
    shift = torch.randint(0, BLOCK_N, (BLOCK_M,), device=DEVICE)
    shift[:2] = torch.tensor([0, BLOCK_N - 1])
    sig = (shift + 2 * BLOCK_N * torch.randint(0, 4, (BLOCK_M,), device=DEVICE)).int()
    rot, skew = (torch.empty(BLOCK_M, BLOCK_N, device=DEVICE) for _ in range(2))
    _skew_probe[(1,)](x, sig, rot, skew, BLOCK_M, BLOCK_N)
    cols = torch.arange(BLOCK_N, device=DEVICE)[None, :] + shift[:, None]
    for got, want in ((rot, x[:, :BLOCK_N].gather(1, cols % BLOCK_N)), (skew, x.gather(1, cols))):
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.all(), f"differs at {same.logical_not().nonzero()[:8].tolist()}"
