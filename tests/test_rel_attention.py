"""ctxfast.rel_attention (Triton, shift inside the kernel) against
ctxfast.reference.rel_attention (direct indexing by distance), forward and the gradient of
every tensor input; the flash-attention rule for tolerances (<= 2x the eager error at the
same dtype against float64, plus a small floor)."""
import pytest
import torch

import ctxfast
from ctxfast import reference
from test_attention import DEVICE, FLOOR, needs_triton
from utils import (ATTN_BACKENDS, assert_within_2x_eager, rel_err, rel_exponent_floor,
                   rel_grad_terms)

NAMES = ["q", "k", "v", "r", "r_w_bias", "r_r_bias", "seg_embed", "r_s_bias"]


def _inputs(B, H, Tq, Tk, D, R, dtype=torch.float32, seg=False, mag=1.0):
    """q, k, v, r, r_w_bias, r_r_bias (and seg_embed, r_s_bias): normal, q, k and r times
    mag (rounded to dtype after scaling)."""
    mk = lambda *s, m=1.0: (torch.randn(*s, device=DEVICE) * m).to(dtype)  # noqa: E731
    ts = [mk(B, H, Tq, D, m=mag), mk(B, H, Tk, D, m=mag), mk(B, H, Tk, D),
          mk(H, R, D, m=mag), mk(H, D), mk(H, D)]
    if seg:
        ts += [mk(2, H, D), mk(H, D)]
    return ts


def check(B, H, Tq, Tk, D, R=None, dtype=torch.float32, seg=False, mag=1.0, **kw):
    R = R or Tk
    ts = _inputs(B, H, Tq, Tk, D, R, dtype, seg, mag)
    extra = {}
    if seg:
        extra = dict(seg_q=torch.randint(0, 2, (B, Tq), device=DEVICE),
                     seg_k=torch.randint(0, 2, (B, Tk), device=DEVICE))

    def call(fn, tensors, **more):
        a = dict(extra, **kw, **more)
        if seg:
            a.update(seg_embed=tensors[6], r_s_bias=tensors[7])
        return fn(*tensors[:6], **a)

    leaves = [t.clone().requires_grad_(True) for t in ts]
    same = [t.clone().requires_grad_(True) for t in ts]
    l64 = [t.double().requires_grad_(True) for t in ts]
    out = call(ctxfast.rel_attention, leaves, backend="triton")
    out_same = call(reference.rel_attention, same)
    out64 = call(reference.rel_attention, l64)
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, leaves, do)
    g_same = torch.autograd.grad(out_same, same, do)
    g64 = torch.autograd.grad(out64, l64, do.double())
    # the floor of each gradient scales with the terms the softmax cancels in it, and is at
    # least what the exponent's float32 rounding gives large scores (a large scale)
    terms = [1.0] + rel_grad_terms(ts, do, **extra, **kw)
    floor = max(FLOOR[dtype], rel_exponent_floor(ts, **extra, **kw))
    for (name, ours, s, ref), t in zip([("out", out, out_same, out64)] + list(
            zip(NAMES, g, g_same, g64)), terms):
        assert_within_2x_eager(ours, s, ref, floor, name=name, min_scale=max(1.0, t))
    return out, g


@needs_triton
@pytest.mark.parametrize("Tq, mem", [(17, 0), (17, 5), (17, 17), (9, 40), (1, 9), (33, 31)])
def test_transformer_xl_memory(Tq, mem):
    """Memory of 0, shorter, equal and longer than Tq; Tq = 1; odd sizes."""
    check(2, 2, Tq, Tq + mem, 32)


@needs_triton
@pytest.mark.parametrize("D", [16, 32, 64, 96, 128])
def test_head_dims(D):
    check(1, 2, 19, 27, D)


@needs_triton
@pytest.mark.parametrize("D", [48, 96])
def test_columns_past_the_head_dim_are_never_read(D):
    """q, k, v and r as views of NaN-padded tensors ([..., :D] of a last dim of D + 16, a
    head dim below the kernels' power-of-two BLOCK_D): a load that reaches a column >= D
    reads NaN and poisons the output or a gradient (r's loads were unmasked in D, reading
    past the end of r at its last row: a run-to-run flake of D 96 under the interpreter)."""
    B, H, Tq, Tk = 2, 2, 19, 33

    def padded(*shape):
        base = torch.full((*shape[:-1], shape[-1] + 16), float("nan"), device=DEVICE)
        base[..., :shape[-1]] = torch.randn(*shape, device=DEVICE)
        return base[..., :shape[-1]]
    views = [padded(B, H, Tq, D), padded(B, H, Tk, D), padded(B, H, Tk, D), padded(H, Tk, D)]
    u, w = torch.randn(H, D, device=DEVICE), torch.randn(H, D, device=DEVICE)
    leaves = [t.requires_grad_(True) for t in views] + [u.requires_grad_(True),
                                                         w.requires_grad_(True)]
    out = ctxfast.rel_attention(*leaves, backend="triton")
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, do)
    l64 = [t.detach().double().contiguous().requires_grad_(True) for t in leaves]
    out64 = reference.rel_attention(*l64)
    g64 = torch.autograd.grad(out64, l64, do.double())
    for name, ours, ref in [("out", out, out64)] + list(zip(NAMES, grads, g64)):
        assert torch.isfinite(ours).all(), f"{name}: NaN from a column past D"
        assert rel_err(ours, ref) < 1e-4, (name, rel_err(ours, ref))


@needs_triton
@pytest.mark.parametrize("stream", ["content", "query"])
def test_xlnet_bidirectional_perm_segments_padding(stream):
    B, Tq, Tk = 2, 19, 30
    kpm = torch.rand(B, Tk, device=DEVICE) < 0.2
    rank = torch.stack([torch.randperm(Tq) for _ in range(B)]).to(DEVICE)
    check(B, 2, Tq, Tk, 32, R=Tk + Tq, seg=True, causal=False, pos_start=Tk,
          key_padding_mask=kpm, perm_rank=rank, perm_stream=stream)


@needs_triton
@pytest.mark.parametrize("Tq, mem, window", [(17, 23, 23), (40, 10, 12), (17, 5, 2), (9, 40, 3),
                                             (33, 31, 200)])
def test_sliding_window(Tq, mem, window):
    """Transformer-XL's same_length mask (window = its mem_len): distance < window. Every
    gradient; windows shorter than a key block, one longer than the keys (no effect)."""
    out, _ = check(2, 2, Tq, Tq + mem, 16, window=window)
    if window >= Tq + mem:
        ts = _inputs(2, 2, Tq, Tq + mem, 16, Tq + mem)
        torch.testing.assert_close(
            ctxfast.rel_attention(*ts, window=window, backend="triton"),
            ctxfast.rel_attention(*ts, backend="triton"), rtol=0, atol=0)


@needs_triton
def test_window_rows_that_see_no_key():
    """Window + padding: rows 0-4 of batch 0 have every key of their window padded. They
    return zeros and pass no gradient (no NaN); every gradient against the reference."""
    Tq, mem = 9, 20
    kpm = torch.zeros(2, Tq + mem, dtype=torch.bool, device=DEVICE)
    kpm[0, 17:25] = True
    out, _ = check(2, 2, Tq, Tq + mem, 16, window=4, key_padding_mask=kpm)
    assert torch.all(out[0, :, :5] == 0) and out[0, :, 5:].abs().sum() > 0


@needs_triton
def test_window_of_one_sees_only_its_own_position():
    # each query's only key is j = mem_len + i: the output is that v row (the gradient of
    # q is 0 up to rounding: a softmax over one key; checked in value, not relative error)
    B, H, Tq, Tk, D = 2, 2, 9, 20, 16
    q, k, v, r, u, w = (t.requires_grad_(True) for t in _inputs(B, H, Tq, Tk, D, Tk))
    out = ctxfast.rel_attention(q, k, v, r, u, w, window=1, backend="triton")
    torch.testing.assert_close(out, v[:, :, Tk - Tq:], rtol=1e-6, atol=1e-6)
    dq, dv = torch.autograd.grad(out, (q, v), torch.randn_like(out))
    assert dq.abs().max() < 1e-5 * v.abs().max() * k.abs().max()
    assert torch.all(dv[:, :, :Tk - Tq] == 0)


@needs_triton
def test_sliding_window_with_padding_segments_and_xlnet_order():
    """The window combined with the other masks (bidirectional XLNet form: it only limits
    the keys before the query) and the segment term."""
    kpm = torch.zeros(2, 30, dtype=torch.bool, device=DEVICE)
    kpm[1, 25:] = True                                                   # padded keys
    check(2, 2, 13, 30, 16, R=43, causal=False, pos_start=30, window=8, seg=True,
          key_padding_mask=kpm, perm_rank=torch.randperm(13, device=DEVICE).expand(2, 13))


@needs_triton
def test_sliding_window_matches_the_original_same_length_mask():
    """window = mem_len is exactly the original code's same_length mask
    (triu(1 + mlen) + tril(-(qlen - (klen - mem_len))))."""
    B, H, Tq, mlen, D, mem_len = 1, 2, 11, 14, 16, 14
    Tk = mlen + Tq
    q, k, v, r, u, w = _inputs(B, H, Tq, Tk, D, Tk)
    ones = torch.ones(Tq, Tk, device=DEVICE)
    masked = (ones.triu(1 + mlen) + ones.tril(-(Tq - (Tk - mem_len)))).bool()
    s = (torch.einsum("bhid,bhjd->bhij", q + u[:, None], k)
         + torch.gather(torch.einsum("bhid,hrd->bhir", q + w[:, None], r), -1,
                        (Tk - 1 - (mlen + torch.arange(Tq, device=DEVICE)[:, None]
                                   - torch.arange(Tk, device=DEVICE))).clamp(0, Tk - 1)
                        .expand(B, H, Tq, Tk))) * D ** -0.5
    want = torch.softmax(s.masked_fill(masked, float("-inf")), -1) @ v
    got = ctxfast.rel_attention(q, k, v, r, u, w, window=mem_len, backend="triton")
    assert rel_err(got, want) < 1e-5


@needs_triton
def test_transformer_xl_with_a_longer_r():
    """pos_start inside a longer table (clamp_len-style callers): r has spare rows."""
    check(1, 2, 12, 20, 16, R=31, pos_start=25)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_dtypes(dtype):
    check(1, 2, 17, 40, 64, dtype=dtype)


@needs_triton
@pytest.mark.parametrize("mem", [0, 23])
def test_half_backward_recomputes_the_forwards_scores(mem):
    """fp16 with large scores (q, k, r of scale 4, the biases 1): the backward's P, recomputed
    in the dK/dV and dR kernels, must be the forward's (whose lse it divides by): the
    forward forms the position term as (q + u)·r plus the row bias (w − u)·r, and q + u and
    q + w round differently at 16 bits. With P recomputed from q + w the rows of P did not
    sum to 1: with dO all ones, Σ_j dV[j] = Σ_i Σ_j P_ij = Tq was off by ~1%. Also every
    gradient within 2x eager of float64."""
    torch.manual_seed(3)
    Tq = 33
    check(1, 2, Tq, Tq + mem, 64, dtype=torch.float16, mag=4.0)
    q, k, v, r, u, w = _inputs(1, 2, Tq, Tq + mem, 64, Tq + mem, torch.float16, mag=4.0)
    v.requires_grad_(True)
    out = ctxfast.rel_attention(q, k, v, r, u, w, backend="triton")
    (dv,) = torch.autograd.grad(out, v, torch.ones_like(out))
    total = dv.double().sum(2)                                # [B, H, D]: Tq each
    assert (total - Tq).abs().max() < Tq * 2e-3, total[0, :, :4]


@needs_triton
@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.5])
def test_any_scale(scale):
    """A zero or negative scale keeps the scaled tile in the forward (see
    test_attention.test_any_scale); a positive one is applied in the exponent's FMA."""
    check(2, 2, 17, 22, 16, scale=scale)


@needs_triton
def test_rows_that_see_no_key():
    kpm = torch.zeros(2, 12, dtype=torch.bool, device=DEVICE)
    kpm[0] = True
    out, grads = check(2, 2, 12, 12, 16, key_padding_mask=kpm)
    assert (out[0] == 0).all() and (grads[0][0] == 0).all()


@needs_triton
def test_lse_of_rows_that_see_no_key_is_plus_inf():
    """The forward's lse is +inf on a row that sees no key (the backward's probabilities
    2^(s - lse) are then exactly 0 there; the empty-input path returns +inf too) and
    finite elsewhere: padding, and XLNet's query stream whose lowest rank sees no key."""
    from ctxfast.kernels.rel_attention import rel_attention_forward
    B, H, T, D = 2, 2, 12, 16
    ts = _inputs(B, H, T, T, D, 2 * T)
    kpm = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
    kpm[0] = True                                       # batch 0: every key is padding
    _, lse = rel_attention_forward(*ts, causal=False, pos_start=T, key_padding_mask=kpm)
    assert (lse[0] == float("inf")).all(), lse[0]
    assert torch.isfinite(lse[1]).all(), lse[1]
    rank = torch.stack([torch.randperm(T) for _ in range(B)]).to(DEVICE)
    _, lse = rel_attention_forward(*ts, causal=False, pos_start=T, perm_rank=rank,
                                   perm_strict=True)
    empty = (rank == 0)[:, None, :].expand(B, H, T)
    assert (lse[empty] == float("inf")).all(), lse[empty]
    assert torch.isfinite(lse[~empty]).all(), lse[~empty]


def check_dropout(B, H, Tq, Tk, D, p, seed):
    """Triton with dropout against the float64 reference given the same keep-mask
    (``dropout_keep_mask`` regenerates it from the seed), forward and every gradient."""
    from ctxfast.ops.attention import draw_seed, dropout_keep_mask
    ts = [t.requires_grad_(True) for t in _inputs(B, H, Tq, Tk, D, Tk)]
    out = ctxfast.rel_attention(*ts, dropout_p=p, backend="triton",
                                generator=torch.Generator(DEVICE).manual_seed(seed))
    keep = dropout_keep_mask(draw_seed(DEVICE, torch.Generator(DEVICE).manual_seed(seed)),
                             B, H, Tq, Tk, p)
    assert 0 < keep.float().mean() < 1
    l64 = [t.detach().double().requires_grad_(True) for t in ts]
    ref = reference.rel_attention(*l64, dropout_mask=keep, dropout_p=p)
    assert rel_err(out, ref) < 1e-5
    do = torch.randn_like(out)
    for name, a, b in zip(NAMES, torch.autograd.grad(out, ts, do),
                          torch.autograd.grad(ref, l64, do.double())):
        assert rel_err(a, b) < 1e-5, name


@needs_triton
def test_dropout_matches_reference_with_the_same_mask():
    check_dropout(2, 2, 13, 21, 16, 0.25, seed=5)


@needs_triton
def test_opcheck_and_compile():
    B, H, Tq, Tk, D = 1, 2, 9, 14, 16
    q, k, v, r, u, w = (t.requires_grad_(True) for t in _inputs(B, H, Tq, Tk, D, Tk))
    args = (q, k, v, r, u, w, None, None, None, None, None, None, True, Tk - 1, 0, False, 0.25,
            0.0, None)
    torch.library.opcheck(torch.ops.ctxfast.rel_attention_fwd_triton.default, args)
    torch._dynamo.reset()
    f = torch.compile(lambda *a: ctxfast.rel_attention(*a, backend="triton").sum(),
                      fullgraph=True, backend="aot_eager")
    f(q, k, v, r, u, w).backward()
    l64 = [t.detach().double().requires_grad_(True) for t in (q, k, v, r, u, w)]
    reference.rel_attention(*l64).sum().backward()
    assert rel_err(r.grad, l64[3].grad) < 1e-5


@pytest.mark.parametrize("backend", ATTN_BACKENDS)
def test_autocast_casts_every_float_input(backend):
    """Under autocast, fp32 biases, r and seg_embed meet bf16 queries (what a model's
    parameters and autocast's matmul outputs are): the op runs in bf16, as
    ctxfast.attention and SDPA do, and the fp32 leaves get fp32 gradients. Forward and
    backward both inside the autocast region (the C++ cpu op's own ATen calls, the segment
    term's einsums, must not be recast: they were, and it failed with "expected scalar type
    Float but found BFloat16")."""
    B, H, Tq, Tk, D = 2, 2, 9, 14, 16
    ts = _inputs(B, H, Tq, Tk, D, Tk + Tq, seg=True)
    ts[0] = ts[0].bfloat16()                       # q as autocast's matmul returns it
    leaves = [t.clone().requires_grad_(True) for t in ts]
    seg = dict(seg_q=torch.randint(0, 2, (B, Tq), device=DEVICE),
               seg_k=torch.randint(0, 2, (B, Tk), device=DEVICE), causal=False, pos_start=Tk)

    def call(fn, t, **kw):
        return fn(*t[:6], seg_embed=t[6], r_s_bias=t[7], **seg, **kw)

    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = call(ctxfast.rel_attention, leaves, backend=backend)
        assert out.dtype == torch.bfloat16
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, do)
    assert [g.dtype for g in grads] == [t.dtype for t in ts]
    l64 = [t.bfloat16().double().requires_grad_(True) for t in ts]   # what the op saw
    same = [t.bfloat16().requires_grad_(True) for t in ts]           # reference in bf16
    out64, out_same = call(reference.rel_attention, l64), call(reference.rel_attention, same)
    g64 = torch.autograd.grad(out64, l64, do.double())
    g_same = torch.autograd.grad(out_same, same, do)
    for name, ours, s, ref in [("out", out, out_same, out64)] + list(zip(NAMES, grads, g_same, g64)):
        assert_within_2x_eager(ours, s, ref, FLOOR[torch.bfloat16], name=name)


def _bad():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    r, u, w = torch.randn(2, 6, 8), torch.randn(2, 8), torch.randn(2, 8)
    base = dict(q=q, k=k, v=v, r=r, r_w_bias=u, r_r_bias=w)
    yield "r-too-short", dict(base, r=torch.randn(2, 5, 8)), ValueError, ["r too short", "R=5"]
    yield "xlnet-r-too-short", dict(base, causal=False, pos_start=6), ValueError, ["r too short"]
    yield "heads", dict(base, r=torch.randn(3, 6, 8)), ValueError, ["r must have shape [H, R, D]"]
    yield "bias", dict(base, r_w_bias=torch.randn(2, 4)), ValueError, ["r_w_bias must have shape"]
    yield "keys-shorter", dict(base, k=k[:, :, :3], v=v[:, :, :3]), ValueError, ["Tk >= Tq"]
    yield "seg-partial", dict(base, seg_q=torch.zeros(1, 4, dtype=torch.long)), ValueError, ["go together"]
    yield "r-dtype", dict(base, r=r.double()), TypeError, ["r must have q's dtype"]
    for bad in (0, -3, 2.5, True):
        yield f"window-{bad}", dict(base, window=bad), ValueError, ["window must be None or an int >= 1"]
    seg = dict(base, seg_q=torch.zeros(1, 4, dtype=torch.long),
               seg_k=torch.zeros(1, 6, dtype=torch.long), seg_embed=torch.randn(2, 2, 8),
               r_s_bias=torch.randn(2, 8))
    yield "seg-embed-dtype", dict(seg, seg_embed=torch.randn(2, 2, 8, dtype=torch.float64)), \
        TypeError, ["seg_embed must have q's dtype"]
    yield "seg-q-device", dict(seg, seg_q=torch.zeros(1, 4, dtype=torch.long, device="meta")), \
        ValueError, ["seg_q must be on"]
    yield "seg-k-device", dict(seg, seg_k=torch.zeros(1, 6, dtype=torch.long, device="meta")), \
        ValueError, ["seg_k must be on"]
    yield "keys-shorter-not-causal", dict(base, causal=False, k=k[:, :, :3], v=v[:, :, :3]), \
        ValueError, ["rel_attention: the keys are [memory; current]", "Tk >= Tq"]
    yield "seg-embed-not-a-tensor", dict(seg, seg_embed=[1.0]), ValueError, \
        ["seg_embed must be a tensor [2, H, D]", "got list"]
    yield "pos-start-bool", dict(base, pos_start=True), TypeError, ["pos_start must be an int"]
    yield "q-rank", dict(base, q=q[0]), ValueError, ["rel_attention: q must have shape"]
    yield "dropout-str", dict(base, dropout_p="0.1"), TypeError, \
        ["rel_attention: dropout_p must be a float"]


@pytest.mark.parametrize("case", list(_bad()), ids=lambda c: c[0])
def test_bad_input(no_dispatch, case):
    _, kw, exc, words = case
    with pytest.raises(exc) as info:
        ctxfast.rel_attention(**kw)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


@pytest.mark.parametrize("backend", ATTN_BACKENDS)
def test_strided_int32_segments(backend):
    """Segment ids given as strided int32 views (XLNet's time-major [T, B] transposed) are
    read as their values on every backend, forward and gradients: the triton kernels read
    row b's ids with a unit stride and took the view as it was (wrong output, no error)."""
    B, H, Tq, Tk, D = 2, 2, 5, 9, 16
    ts = [t.requires_grad_(True) for t in _inputs(B, H, Tq, Tk, D, Tk + Tq)]
    seg = dict(seg_embed=torch.randn(2, H, D, device=DEVICE),
               r_s_bias=torch.randn(H, D, device=DEVICE), causal=False, pos_start=Tk)
    time_major = [torch.randint(0, 2, (T, B), dtype=torch.int32, device=DEVICE) for T in (Tq, Tk)]
    runs = []
    for seg_q, seg_k in ([s.t() for s in time_major], [s.t().contiguous() for s in time_major]):
        out = ctxfast.rel_attention(*ts, seg_q=seg_q, seg_k=seg_k, backend=backend, **seg)
        runs.append([out] + list(torch.autograd.grad(out.square().sum(), ts)))
    assert time_major[0].t().stride() == (1, B)
    for name, a, b in zip(["out"] + NAMES, *runs):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", ATTN_BACKENDS)
def test_no_query_in_xlnet_layout(backend):
    """Tq = 0 with XLNet's relative positions (pos_start = Tk, R = Tk + Tq = Tk), causal:
    no distance is needed, so r is not too short; an empty output on every backend (the
    check refused it)."""
    q = torch.randn(2, 2, 0, 8, device=DEVICE)
    k, v = (torch.randn(2, 2, 6, 8, device=DEVICE) for _ in range(2))
    r, u, w = (torch.randn(*s, device=DEVICE) for s in ((2, 6, 8), (2, 8), (2, 8)))
    out = ctxfast.rel_attention(q, k, v, r, u, w, causal=True, pos_start=6, backend=backend)
    assert out.shape == (2, 2, 0, 8)


@needs_triton
@pytest.mark.parametrize("B, Tq, mem", [(0, 5, 3), (2, 0, 4)])
def test_empty_inputs_through_the_dispatcher(B, Tq, mem):
    """An empty batch or query block: zeros of the right shapes, forward and every gradient,
    through the dispatcher (a TorchDispatchMode sends the ops through it, where the custom
    op refuses outputs that alias each other: the two bias gradients must be two tensors)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Through(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    H, D, Tk = 2, 16, Tq + mem
    ts = [t.requires_grad_(True) for t in _inputs(B, H, Tq, Tk, D, Tk)]
    with Through():
        out = ctxfast.rel_attention(*ts, backend="triton")
        grads = torch.autograd.grad(out.sum(), ts)
    assert tuple(out.shape) == (B, H, Tq, D)
    for t, g in zip(ts, grads):
        assert g.shape == t.shape and not g.any()


@pytest.mark.parametrize("Tk", [7, 40])
@pytest.mark.parametrize("op", ["attention", "rel_attention"])
@pytest.mark.parametrize("where", ["q", "k", "scale"])
@pytest.mark.parametrize("backend", ATTN_BACKENDS)
def test_nan_inputs_give_nan(backend, where, op, Tk):
    """A NaN in q, k or the scale gives NaN where eager's softmax gives it (the rows it
    reaches, and the gradients), never zeros: the cpu backend's row maxima skip NaN, and a
    row of NaN scores took the path of a row that sees no key (zeros, zero gradient),
    hiding a diverging run. Tk 40: the NaN key inside a full 16-lane vector of the cpu
    backend's AVX-512 exponential, whose ordered compare took NaN for -inf (probability
    0: no NaN out)."""
    B, H, Tq, D = 1, 2, 5, 8
    q, k, v = (torch.randn(B, H, T, D, device=DEVICE) for T in (Tq, Tk, Tk))
    r, u, w = (torch.randn(*s, device=DEVICE) for s in ((H, Tk, D), (H, D), (H, D)))
    scale = None
    if where == "q":
        q[0, 0, 1, 0] = float("nan")
    elif where == "k":
        k[0, 1, 2, 0] = float("nan")
    else:
        scale = float("nan")
    results = []
    for name in (backend, "eager"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        if op == "attention":
            out = ctxfast.attention(*leaves, causal=True, scale=scale, backend=name)
        else:
            out = ctxfast.rel_attention(*leaves, r, u, w, scale=scale, backend=name)
        out.sum().backward()
        results.append([out] + [t.grad for t in leaves])
    out, eager_out = results[0][0], results[1][0]
    assert torch.equal(out.isnan().any(-1), eager_out.isnan().any(-1)), (
        f"out: NaN in rows {out.isnan().any(-1).nonzero().tolist()}, eager in "
        f"{eager_out.isnan().any(-1).nonzero().tolist()}")
    # which gradient entries a NaN reaches depends on the order of the sums (a flash backward
    # spreads it over the rows whose lse it reached): each gradient has one where eager has
    for what, ours, eager in zip(("dq", "dk", "dv"), results[0][1:], results[1][1:]):
        assert ours.isnan().any() == eager.isnan().any(), what
