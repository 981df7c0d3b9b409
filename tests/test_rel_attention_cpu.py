"""The ``cpu`` backend of ctxfast.rel_attention (csrc/cpu/attention.cpp: the position term
from the band of r each query block needs) against ctxfast.reference.rel_attention, forward
and the gradient of q, k, v, r, both biases and, with XLNet's segment term, seg_embed and
r_s_bias; tolerance: <= 2x the eager error at the same dtype against float64, plus a small
floor. Tiles are 64 queries x 128 keys, so T = 70, 137, 200 cross their edges. Dropout draws
the Triton kernels' Philox mask for the same seed."""
import os
import subprocess
import sys

import pytest
import torch

import ctxfast
from ctxfast import reference
from ctxfast.ops.attention import draw_seed, dropout_keep_mask
from utils import (CPU_BACKENDS, DEVICE, TRITON_ON_CPU, assert_within_2x_eager, rel_err,
                   rel_grad_terms)

pytestmark = pytest.mark.skipif("cpu" not in CPU_BACKENDS or not hasattr(
    torch.ops.ctxfast, "rel_attention_fwd_cpu"), reason="ctxfast._C built without rel_attention")

FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NAMES = ["q", "k", "v", "r", "r_w_bias", "r_r_bias", "seg_embed", "r_s_bias"]


def check(B, H, Tq, Tk, D, R=None, dtype=torch.float32, layout="bhtd", seg=False,
          ours_kw=None, ref_kw=None, **kw):
    """seg: XLNet's segment term with random segment ids; ours_kw / ref_kw: extra arguments
    of ctxfast.rel_attention / of the references (dropout)."""
    R = R or Tk
    mk = lambda *s: torch.randn(*s, dtype=dtype)  # noqa: E731
    if layout == "bthd":
        qkv = [mk(B, T, H, D).transpose(1, 2) for T in (Tq, Tk, Tk)]
    else:
        qkv = [mk(B, H, T, D) for T in (Tq, Tk, Tk)]
    ts = qkv + [mk(H, R, D), mk(H, D), mk(H, D)] + ([mk(2, H, D), mk(H, D)] if seg else [])
    ids = dict(seg_q=torch.randint(0, 2, (B, Tq)), seg_k=torch.randint(0, 2, (B, Tk))) \
        if seg else {}

    def call(fn, tensors, **more):
        a = dict(ids, **kw, **more)
        if seg:
            a.update(seg_embed=tensors[6], r_s_bias=tensors[7])
        return fn(*tensors[:6], **a)

    leaves = [t.detach().clone().requires_grad_(True) for t in ts]
    same = [t.detach().clone().requires_grad_(True) for t in ts]
    l64 = [t.detach().double().requires_grad_(True) for t in ts]
    out = call(ctxfast.rel_attention, leaves, backend="cpu", **(ours_kw or {}))
    out_same = call(reference.rel_attention, same, **(ref_kw or {}))
    out64 = call(reference.rel_attention, l64, **(ref_kw or {}))
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, leaves, do)
    g_same = torch.autograd.grad(out_same, same, do)
    g64 = torch.autograd.grad(out64, l64, do.double())
    # the floor of each gradient scales with the terms the softmax cancels in it
    terms = [1.0] + rel_grad_terms(ts, do, **ids, **kw, **(ref_kw or {}))
    for (name, ours, s, ref), t in zip([("out", out, out_same, out64)] + list(
            zip(NAMES, g, g_same, g64)), terms):
        assert ours.dtype == dtype, name
        assert_within_2x_eager(ours, s, ref, FLOOR[dtype], name=name, min_scale=max(1.0, t))
    return out, g


@pytest.mark.parametrize("Tq, mem", [(17, 0), (70, 5), (70, 67), (9, 140), (1, 9), (200, 0)])
def test_transformer_xl_memory(Tq, mem):
    check(2, 2, Tq, Tq + mem, 32)


@pytest.mark.parametrize("mem, D", [(3, 75), (37, 75), (202, 41)])
def test_decoding_one_query(mem, D):
    # one query: the band and score products as matrix-vector loops (gemv_rm). (mem 0, a
    # single key, makes every gradient but dv exactly 0, which eager matches exactly and a
    # flash backward only to the rounding of dP - Delta: the floor for that is in
    # test_attention_cpu.check_cpu, whose Tk = 1 case runs the same loops.)
    check(2, 3, 1, 1 + mem, D)


@pytest.mark.parametrize("D", [16, 64, 96])
def test_head_dims(D):
    check(1, 2, 19, 140, D)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_dtypes(dtype):
    check(2, 2, 21, 150, 64, dtype=dtype)


def test_non_contiguous_layout():
    check(2, 3, 70, 90, 32, layout="bthd", scale=0.3)


@pytest.mark.parametrize("stream", ["content", "query"])
def test_xlnet_bidirectional_perm_padding(stream):
    B, Tq, Tk = 2, 70, 137
    kpm = torch.rand(B, Tk) < 0.2
    rank = torch.stack([torch.randperm(Tq) for _ in range(B)])
    out, g = check(B, 2, Tq, Tk, 32, R=Tk + Tq, causal=False, pos_start=Tk,
                   key_padding_mask=kpm, perm_rank=rank, perm_stream=stream)


@pytest.mark.parametrize("stream", ["content", "query"])
@pytest.mark.parametrize("ties", [False, True])
def test_xlnet_sorted_ranks_after_another_call(stream, ties):
    """A non-decreasing rank (the identity order, or ties) without causal: the backward's
    diagonal key tiles skip the rows that see none of their keys, and those rows' columns of
    the position band's gradient were left unwritten, read back from the thread's scratch
    (the previous block's or call's): dq, dr and d(r_r_bias) wrong by O(1) (0.78, 0.68,
    1.5 at T 128), after a call of another shape even at T 33. Rows past the diagonal split
    (T > 64) and a dirty scratch first."""
    check(1, 2, 68, 85, 16, R=85 + 68, causal=False, pos_start=85)    # dirties the scratch
    for T in (33, 128):
        rank = torch.arange(T) // (3 if ties else 1)
        check(1, 2, T, T, 16, R=2 * T, causal=False, pos_start=T,
              perm_rank=rank.expand(1, T), perm_stream=stream)


@pytest.mark.parametrize("Tq, mem, window", [(70, 100, 100), (40, 10, 12), (17, 5, 2),
                                             (130, 140, 3)])
def test_window(Tq, mem, window):
    check(2, 2, Tq, Tq + mem, 16, window=window)


def test_rows_that_see_no_key():
    B, T = 2, 20
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[0] = True
    out, g = check(B, 2, T, T, 16, key_padding_mask=kpm)
    assert (out[0] == 0).all() and (g[0][0] == 0).all()


def test_gradcheck_float64():
    ts = [torch.randn(*s, dtype=torch.float64, requires_grad=True)
          for s in ((1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8), (2, 7, 8), (2, 8), (2, 8))]
    f = lambda *a: ctxfast.rel_attention(*a, window=4, backend="cpu")  # noqa: E731
    assert torch.autograd.gradcheck(f, ts)


def test_opcheck_and_compile():
    q, k, v = (torch.randn(1, 2, T, 16, requires_grad=True) for T in (9, 12, 12))
    r, u, w = torch.randn(2, 12, 16), torch.randn(2, 16), torch.randn(2, 16)
    kpm = torch.zeros(1, 12, dtype=torch.bool)
    kpm[0, 3] = True
    args = (q, k, v, r.requires_grad_(), u.requires_grad_(), w.requires_grad_(), kpm, None,
            None, None, None, None, True, 11, 0, False, 0.25, 0.0, None)
    torch.library.opcheck(torch.ops.ctxfast.rel_attention_fwd_cpu.default, args)
    rb = torch.randn(2, 21, 16, requires_grad=True)
    seg = (torch.randint(0, 2, (1, 9)), torch.randint(0, 2, (1, 12)),
           torch.randn(2, 2, 16, requires_grad=True), torch.randn(2, 16, requires_grad=True))
    args = (q, k, v, rb, u, w, None, torch.randperm(9).view(1, 9)) + seg + (
        False, 12, 0, True, 0.25, 0.2, torch.tensor([77]))
    torch.library.opcheck(torch.ops.ctxfast.rel_attention_fwd_cpu.default, args)
    torch._dynamo.reset()

    def fn(q, k, v, r, u, w):
        return ctxfast.rel_attention(q, k, v, r, u, w).sum()   # default on CPU: cpu

    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, r, u, w)
    ref = reference.rel_attention(*(t.detach().double() for t in (q, k, v, r, u, w))).sum()
    assert abs(out.item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item()))


@pytest.mark.parametrize("stream", ["content", "query"])
def test_xlnet_segments_perm_padding_memory(stream):
    """XLNet's attention as the model runs it: bidirectional positions, memory, permutation,
    padding and the segment term (seg_embed and r_s_bias gradients included)."""
    B, Tq, Tk = 2, 70, 137
    kpm = torch.rand(B, Tk) < 0.2
    rank = torch.stack([torch.randperm(Tq) for _ in range(B)])
    check(B, 2, Tq, Tk, 32, R=Tk + Tq, seg=True, causal=False, pos_start=Tk,
          key_padding_mask=kpm, perm_rank=rank, perm_stream=stream)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_segments_dtypes_and_window(dtype):
    check(1, 2, 21, 150, 16, R=171, dtype=dtype, seg=True, causal=False, pos_start=150,
          window=40)


@pytest.mark.parametrize("seg", [False, True])
def test_dropout_is_the_triton_mask(seg):
    """Dropout draws the Triton kernels' Philox numbers for the same seed (the counter of
    element (b, h, i, j) is (bh Tq + i) Tk + j): forward and every gradient match the
    float64 reference given that mask."""
    if DEVICE == "cpu" and not TRITON_ON_CPU:
        pytest.skip("the Triton keep mask needs a GPU or TRITON_INTERPRET=1")
    B, H, Tq, mem, p = 2, 2, 70, 67, 0.25
    seed = draw_seed("cpu", torch.Generator().manual_seed(5))
    keep = dropout_keep_mask(seed.to(DEVICE), B, H, Tq, Tq + mem, p).cpu()
    extra = dict(R=2 * Tq + mem, causal=False, pos_start=Tq + mem) if seg else {}
    check(B, H, Tq, Tq + mem, 16, seg=seg,
          ours_kw=dict(dropout_p=p, generator=torch.Generator().manual_seed(5)),
          ref_kw=dict(dropout_p=p, dropout_mask=keep), **extra)


@pytest.mark.parametrize("Tq, mem", [(137, 45), (100, 31), (64, 0)])
def test_causal_diagonal_tiles_segments_dropout(Tq, mem):
    """Causal with memory: the diagonal's key tiles run only for the rows that see one of
    their keys, and the band's last bq - 1 columns are not computed. Every per-row term (the
    band's diagonal walk, segments, the dropout counter, dS into the band gradient) must
    use the right rows; mem 45 and 31 put the diagonal off the tile edges."""
    if DEVICE == "cpu" and not TRITON_ON_CPU:
        pytest.skip("the Triton keep mask needs a GPU or TRITON_INTERPRET=1")
    B, H, p = 1, 2, 0.2
    seed = draw_seed("cpu", torch.Generator().manual_seed(7))
    keep = dropout_keep_mask(seed.to(DEVICE), B, H, Tq, Tq + mem, p).cpu()
    check(B, H, Tq, Tq + mem, 16, seg=True,
          ours_kw=dict(dropout_p=p, generator=torch.Generator().manual_seed(7)),
          ref_kw=dict(dropout_p=p, dropout_mask=keep))


@pytest.mark.parametrize("case", ["causal", "bidirectional-padding", "window"])
def test_long_band_window_slides(case):
    """A query block's band (bq + Tk - 1 columns) is held in a window of bq + 2 key tiles
    (320 columns) that slides along it: over 333 keys and more, g and dg slide several times
    per block, keeping what the rows still read, and dg's columns are flushed into dqw and
    dr before they leave the window."""
    if case == "causal":
        check(1, 2, 130, 130 + 333, 16)
    elif case == "bidirectional-padding":
        B, Tq, Tk = 3, 70, 400
        kpm = torch.rand(B, Tk) < 0.2
        kpm[1] = True  # a sequence whose rows see no key: out and its gradients 0
        out, g = check(B, 2, Tq, Tk, 16, R=Tk + Tq, causal=False, pos_start=Tk,
                       key_padding_mask=kpm)
        assert (out[1] == 0).all() and (g[0][1] == 0).all() and (g[1][1] == 0).all()
    else:
        check(1, 2, 100, 100 + 350, 16, window=300)


def test_band_windows_under_small_tiles():
    """With 16 x 16 tiles (CTXFAST_ATTN_CPU_TILE, read once per process) the band's window
    is 48 columns and slides on every other key tile: every mask, memory, window, segment
    and dtype case of this file runs so in a fresh process."""
    here = os.path.abspath(__file__)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", here,
           "-k", "not small_tiles and not opcheck and not gradcheck"]
    env = dict(os.environ, CTXFAST_ATTN_CPU_TILE="16,16")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert "passed" in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize("threads, H", [(1, 2), (2, 4), (2, 1)])
def test_dr_summed_over_the_batch(threads, H):
    """dr is shared by the batch: with H >= 2 x threads one task takes a head's sequences in
    turn and accumulates into dr, otherwise each (b, h) has its own, summed afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(3, H, 37, 37 + 29, 16)
    finally:
        torch.set_num_threads(old)


def test_inputs_changed_in_place_between_calls():
    """A thread keeps its transposed copies of K and r from call to call (for tasks of one
    head in a row): a second call with the same tensors changed in place (a preallocated
    key buffer, an optimizer step on r) must see the new values, not the first call's copy.
    One thread and one head, so that the second call's first task meets the same address."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        B, H, Tq, mem, D = 1, 1, 40, 8, 16
        q, k, v = (torch.randn(B, H, T, D) for T in (Tq, Tq + mem, Tq + mem))
        r, u, w = torch.randn(H, Tq + mem, D), torch.randn(H, D), torch.randn(H, D)
        ctxfast.attention(q, k, v, causal=True, backend="cpu")
        ctxfast.rel_attention(q, k, v, r, u, w, backend="cpu")
        k.copy_(torch.randn_like(k))
        r.copy_(torch.randn_like(r))
        ts = [t.requires_grad_() for t in (q, k, v, r, u, w)]
        t64 = [t.detach().double().requires_grad_() for t in ts]
        for name, ours, ref in [
                ("attention", ctxfast.attention(*ts[:3], causal=True, backend="cpu"),
                 reference.attention(*t64[:3], causal=True)),
                ("rel_attention", ctxfast.rel_attention(*ts, backend="cpu"),
                 reference.rel_attention(*t64))]:
            do = torch.randn_like(ours)
            g = torch.autograd.grad(ours, ts[:3] if name == "attention" else ts, do)
            g64 = torch.autograd.grad(ref, t64[:3] if name == "attention" else t64, do.double())
            for what, a, b in [("out", ours, ref)] + list(zip(NAMES, g, g64)):
                assert rel_err(a, b) < 1e-4, (
                    f"{name} {what} after an in-place change: rel err {rel_err(a, b):.3e}")
    finally:
        torch.set_num_threads(old)


def test_default_and_refusals():
    assert ctxfast._dispatch.resolve("rel_attention", torch.device("cpu")) == "cpu"
    B, H, T, D = 1, 2, 6, 8
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    r, u, w = torch.randn(H, 2 * T, D), torch.randn(H, D), torch.randn(H, D)
    seg = dict(seg_q=torch.zeros(B, T, dtype=torch.long), seg_k=torch.ones(B, T, dtype=torch.long),
               seg_embed=torch.randn(2, H, D), r_s_bias=torch.randn(H, D))
    kw = dict(causal=False, pos_start=T, **seg)
    gen = lambda: torch.Generator().manual_seed(9)  # noqa: E731
    a = ctxfast.rel_attention(q, k, v, r, u, w, dropout_p=0.3, generator=gen(), **kw)
    b = ctxfast.rel_attention(q, k, v, r, u, w, dropout_p=0.3, generator=gen(), backend="cpu",
                              **kw)
    assert torch.equal(a, b)                    # segments and dropout: the cpu default
    with pytest.raises(ValueError, match="r too short"):   # the op's own checks
        torch.ops.ctxfast.rel_attention_fwd_cpu(q, k, v, r[:, :3], u, w, None, None, None, None,
                                                None, None, True, 5, 0, False, 1.0, 0.0, None)
    with pytest.raises(ValueError, match="go together"):
        torch.ops.ctxfast.rel_attention_fwd_cpu(q, k, v, r, u, w, None, None, seg["seg_q"],
                                                None, None, None, False, T, 0, False, 1.0, 0.0,
                                                None)
    with pytest.raises(ValueError, match="dropout needs seed"):
        torch.ops.ctxfast.rel_attention_fwd_cpu(q, k, v, r, u, w, None, None, None, None, None,
                                                None, False, T, 0, False, 1.0, 0.1, None)


@pytest.mark.parametrize("causal", [True, False])
def test_op_refuses_r_one_row_short(causal):
    """The op's own check of r's length is exact at both ends: r one row shorter than the
    distances need (the highest row missing, or the lowest row before 0) is refused by the
    forward and the backward, not computed with that row's position term taken as 0."""
    B, H, Tq, mem, D = 1, 2, 5, 3, 8
    Tk = Tq + mem
    q, k, v = torch.randn(B, H, Tq, D), torch.randn(B, H, Tk, D), torch.randn(B, H, Tk, D)
    u, w = torch.randn(H, D), torch.randn(H, D)
    pos_start = Tk - 1                  # rows pos_start - (Tk - 1) = 0 .. highest
    highest = pos_start if causal else pos_start + Tq - 1
    r = torch.randn(H, highest + 1, D)  # exactly long enough
    args = (None, None, None, None, None, None, causal)
    tail = (0, False, 1.0, 0.0, None)
    out, lse = torch.ops.ctxfast.rel_attention_fwd_cpu(q, k, v, r, u, w, *args, pos_start,
                                                       *tail)
    for rr, ps in [(r[:, :-1], pos_start), (r, pos_start - 1)]:   # top row, row -1 missing
        with pytest.raises(ValueError, match="r too short"):
            torch.ops.ctxfast.rel_attention_fwd_cpu(q, k, v, rr, u, w, *args, ps, *tail)
        with pytest.raises(ValueError, match="r too short"):
            torch.ops.ctxfast.rel_attention_bwd_cpu(out, q, k, v, rr, u, w, out, lse, *args,
                                                    ps, *tail)


def test_op_refuses_bad_segment_and_mask_shapes():
    """The op's own checks of the tensors its kernel indexes per key or query (the Python
    layer checks first; these guard the C++ entry point): segment ids, seg_embed, r_s_bias,
    key_padding_mask and perm_rank of the wrong shape or kind are refused."""
    B, H, Tq, mem, D = 2, 2, 5, 3, 8
    Tk = Tq + mem
    q, k, v = torch.randn(B, H, Tq, D), torch.randn(B, H, Tk, D), torch.randn(B, H, Tk, D)
    r, u, w = torch.randn(H, Tk + Tq, D), torch.randn(H, D), torch.randn(H, D)
    good = dict(kpm=None, rank=None, seg_q=torch.zeros(B, Tq, dtype=torch.long),
                seg_k=torch.ones(B, Tk, dtype=torch.long), seg_embed=torch.randn(2, H, D),
                r_s_bias=torch.randn(H, D))

    def call(**change):
        a = dict(good, **change)
        return torch.ops.ctxfast.rel_attention_fwd_cpu(
            q, k, v, r, u, w, a["kpm"], a["rank"], a["seg_q"], a["seg_k"], a["seg_embed"],
            a["r_s_bias"], False, Tk - 1, 0, False, 1.0, 0.0, None)

    call()
    for change, words in [
            (dict(seg_q=torch.zeros(B, Tq - 1, dtype=torch.long)), "seg_q must be"),
            (dict(seg_q=torch.zeros(B, Tq)), "seg_q must be"),
            (dict(seg_k=torch.zeros(B, Tk - 1, dtype=torch.long)), "seg_k must be"),
            (dict(seg_k=torch.zeros(1, Tk, dtype=torch.long)), "seg_k must be"),
            (dict(seg_embed=torch.randn(2, H, D - 1)), "seg_embed must have shape"),
            (dict(r_s_bias=torch.randn(H - 1, D)), "r_s_bias must have shape"),
            (dict(kpm=torch.zeros(B, Tk - 1, dtype=torch.bool)), "key_padding_mask must be"),
            (dict(rank=torch.zeros(B, Tq - 1, dtype=torch.long)), "perm_rank must be")]:
        with pytest.raises(ValueError, match=words):
            call(**change)
    for change, words in [                  # a wrong dtype: TypeError, as the Python layer's
            (dict(kpm=torch.zeros(B, Tk)), "key_padding_mask must be bool"),
            (dict(rank=torch.zeros(B, Tq)), "perm_rank must be an integer tensor")]:
        with pytest.raises(TypeError, match=words):
            call(**change)


def test_one_query_whose_row_stride_is_arbitrary():
    """Tq = 1 from a layout whose size-1 query dimension has stride 1 (< D): the kernel's
    GEMMs must not pass BLAS a row stride shorter than a row (BLAS refuses such a call and
    computes nothing)."""
    B, H, D, mem = 2, 2, 16, 5
    q = torch.randn(B, H, D, 1).transpose(2, 3)          # [B, H, 1, D], stride(2) == 1
    assert q.stride(2) == 1
    k, v = torch.randn(B, H, 1 + mem, D), torch.randn(B, H, 1 + mem, D)
    r, u, w = torch.randn(H, 1 + mem, D), torch.randn(H, D), torch.randn(H, D)
    ts = [t.requires_grad_() for t in (q, k, v, r, u, w)]
    out = ctxfast.rel_attention(*ts, backend="cpu")
    g = torch.autograd.grad(out, ts, torch.ones_like(out))
    t64 = [t.detach().double().requires_grad_() for t in ts]
    out64 = reference.rel_attention(*t64)
    g64 = torch.autograd.grad(out64, t64, torch.ones_like(out64))
    for name, a, b in [("out", out, out64)] + list(zip(NAMES, g, g64)):
        assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-5), name
