"""ctxfast.attention against ctxfast.reference.attention.

Tolerance as flash-attention's tests: the kernel's error against the float64 reference must
be at most twice the error of the eager reference run in the same dtype (plus a small
floor), forward and every gradient. On CPU the Triton kernels run in the interpreter, so
shapes stay small; the block size there is 16, so T = 17, 33, 97 cross block edges.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import ctxfast
from ctxfast import reference
from utils import (ATTN_BACKENDS, CPU_BACKENDS, DEVICE, TRITON_ON_CPU, assert_within_2x_eager,
                   exponent_floor, needs_interpreter, rel_err, softmax_grad_terms,
                   spy_launches)

needs_triton = pytest.mark.skipif(not TRITON_ON_CPU and not torch.cuda.is_available(),
                                  reason="Triton on CPU needs TRITON_INTERPRET=1")
FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _inputs(B, H, Tq, Tk, D, dtype=torch.float32, layout="bhtd"):
    def make(T):
        if layout == "bthd":   # [B, T, H, D] storage, viewed as [B, H, T, D]: non-contiguous
            return torch.randn(B, T, H, D, dtype=dtype, device=DEVICE).transpose(1, 2)
        return torch.randn(B, H, T, D, dtype=dtype, device=DEVICE)
    return make(Tq), make(Tk), make(Tk)


def _masks(kind, B, Tq, Tk, gen=None):
    """Keyword arguments for one mask kind."""
    kw = {}
    if "causal" in kind:
        kw["causal"] = True
    if "pad" in kind:
        kpm = torch.rand(B, Tk, device=DEVICE) < 0.3
        kpm[:, 0] = False                                    # at least one key per row
        if B > 1:
            kpm[-1, Tk // 2:] = True                         # a trailing run: block skipping
        kw["key_padding_mask"] = kpm
    if "perm" in kind:
        kw["perm_rank"] = torch.stack([torch.randperm(Tq) for _ in range(B)]).to(DEVICE)
        kw["perm_stream"] = "query" if "query" in kind else "content"
    if "ties" in kind:                                       # XLNet: non-targets share rank 0
        r = torch.randint(0, 3, (B, Tq), device=DEVICE)
        kw["perm_rank"], kw["perm_stream"] = r, "query" if "query" in kind else "content"
    return kw


def check_against_reference(q, k, v, **kw):
    """Run the Triton kernel, the eager reference in q's dtype and the float64 reference,
    forward and backward; assert the kernel's error <= 2x eager's + floor."""
    dtype = q.dtype
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    leaves_same = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    leaves64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out = ctxfast.attention(*leaves, backend="triton", **kw)
    out_same = reference.attention(*leaves_same, **kw)
    out64 = reference.attention(*leaves64, **kw)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, do)
    grads_same = torch.autograd.grad(out_same, leaves_same, do)
    grads64 = torch.autograd.grad(out64, leaves64, do.double())
    # dq and dk: the floor scales with the terms the softmax cancels (a query that sees one
    # key has dq = 0 exactly, and a flash kernel keeps the rounding of dP − Δ: with
    # CTXFAST_TEST_SEED=4 the TMA run of Tq = Tk = 1 read 2.03e-6 against a floor of 2e-6)
    B, _, Tq, D = q.shape
    visible = reference.attention_mask(
        B, Tq, k.shape[2], causal=kw.get("causal", False),
        key_padding_mask=kw.get("key_padding_mask"), perm_rank=kw.get("perm_rank"),
        perm_stream=kw.get("perm_stream", "content"), device=q.device)
    scale = D ** -0.5 if kw.get("scale") is None else kw["scale"]
    terms = dict(zip(("dq", "dk"), softmax_grad_terms(q, k, v, do, visible, scale)))
    # at least what the exponent's float32 rounding gives large scores (a large scale)
    s64 = (leaves64[0].detach() @ leaves64[1].detach().transpose(-1, -2)) * scale
    floor = max(FLOOR[dtype], exponent_floor(
        s64.masked_fill(~visible.unsqueeze(1), float("-inf"))))
    for name, ours, same, ref in [("out", out, out_same, out64)] + list(
            zip(("dq", "dk", "dv"), grads, grads_same, grads64)):
        assert_within_2x_eager(ours, same, ref, floor, name=name,
                               min_scale=max(terms.get(name, 0.0), 1.0))
    return out, grads


# --------------------------------------------------------------------------- reference

def test_reference_matches_sdpa_causal_and_padding():
    q, k, v = (torch.randn(2, 3, 9, 16, dtype=torch.float64) for _ in range(3))
    assert torch.allclose(reference.attention(q, k, v, causal=True),
                          F.scaled_dot_product_attention(q, k, v, is_causal=True))
    kpm = torch.rand(2, 9) < 0.3
    kpm[:, 0] = False
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=~kpm[:, None, None, :])
    assert torch.allclose(reference.attention(q, k, v, key_padding_mask=kpm), ref)


def test_reference_value_width_may_differ_and_scale_is_from_the_query():
    """v ``[B, H, Tk, Dv]`` with Dv != D, keys with memory: the default scale is
    ``D ** -0.5`` (q's width), as torch's attention."""
    q = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    k = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    v = torch.randn(2, 3, 7, 4, dtype=torch.float64)
    causal = torch.ones(5, 7, dtype=torch.bool).tril(2)          # j <= i + mem_len (2)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    assert torch.allclose(reference.attention(q, k, v, causal=True), ref)


def test_reference_mask_matches_definition():
    B, Tq, Tk = 2, 5, 8
    mem = Tk - Tq
    rank = torch.randint(0, 3, (B, Tq))
    kpm = torch.rand(B, Tk) < 0.3
    for stream in ("content", "query"):
        m = reference.attention_mask(B, Tq, Tk, causal=True, key_padding_mask=kpm,
                                     perm_rank=rank, perm_stream=stream)
        for b in range(B):
            for i in range(Tq):
                for j in range(Tk):
                    sees = j <= i + mem and not kpm[b, j]
                    if j >= mem:
                        r_t, r_i = rank[b, j - mem], rank[b, i]
                        sees = sees and (r_t < r_i if stream == "query" else r_t <= r_i)
                    assert bool(m[b, i, j]) == sees, (stream, b, i, j)


def test_reference_empty_rows_are_zero_with_zero_grad():
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kpm = torch.ones(1, 4, dtype=torch.bool)
    out = reference.attention(q, k, v, key_padding_mask=kpm)
    assert (out == 0).all()
    out.sum().backward()
    assert all((t.grad == 0).all() for t in (q, k, v))


@pytest.mark.parametrize("Tq, Tk", [(0, 0), (3, 0), (0, 3)])
def test_empty_sequences_every_backend(Tq, Tk):
    """Tq = 0 or Tk = 0: an empty output, or zeros (no key to see) with zero gradients."""
    for name in [b for b in CPU_BACKENDS if b in ("triton", "eager")]:
        q = torch.randn(1, 2, Tq, 8, requires_grad=True)
        k, v = (torch.randn(1, 2, Tk, 8, requires_grad=True) for _ in range(2))
        out = ctxfast.attention(q, k, v, backend=name)
        assert out.shape == (1, 2, Tq, 8) and (out == 0).all(), name
        out.sum().backward()
        assert q.grad.shape == q.shape and (q.grad == 0).all(), name


def test_reference_gradcheck():
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    rank = torch.randint(0, 2, (1, 5))
    assert torch.autograd.gradcheck(
        lambda a, b, c: reference.attention(a, b, c, perm_rank=rank, perm_stream="query"),
        (q, k, v))


# --------------------------------------------------------------------------- Triton kernel

MASK_KINDS = ["none", "causal", "pad", "perm", "perm-query", "ties-query", "causal-pad",
              "perm-pad", "causal-perm"]


@needs_triton
@pytest.mark.parametrize("mem", [0, 7])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masks_with_memory(kind, mem):
    B, H, Tq, D = 2, 2, 17, 32
    q, k, v = _inputs(B, H, Tq, Tq + mem, D)
    check_against_reference(q, k, v, **_masks(kind, B, Tq, Tq + mem))


@needs_triton
@pytest.mark.parametrize("D", [16, 32, 64, 96, 128, 256])
def test_head_dims(D):
    q, k, v = _inputs(1, 2, 19, 23, D)
    check_against_reference(q, k, v, causal=True)


@needs_triton
@pytest.mark.parametrize("Tq, Tk, kind", [(1, 1, "none"), (1, 1, "causal"), (1, 40, "causal"),
                                          (97, 97, "causal"), (17, 5, "none"),
                                          (33, 64, "causal-pad"), (3, 50, "perm-query")])
def test_odd_lengths(Tq, Tk, kind):
    q, k, v = _inputs(1, 2, Tq, Tk, 32)
    check_against_reference(q, k, v, **_masks(kind, 1, Tq, Tk))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_dtypes(dtype):
    q, k, v = _inputs(2, 2, 21, 30, 64, dtype=dtype)
    out, grads = check_against_reference(q, k, v, **_masks("causal-pad", 2, 21, 30))
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)


@needs_triton
def test_non_contiguous_bthd_layout():
    q, k, v = _inputs(2, 3, 18, 25, 32, layout="bthd")
    assert not q.is_contiguous()
    check_against_reference(q, k, v, causal=True, scale=0.3)


def test_numpy_scale():
    """A NumPy scalar scale (np.float32 too, which is not a Python float) is a scale."""
    import numpy as np
    q, k, v = _inputs(1, 2, 9, 9, 16)
    want = reference.attention(q, k, v, causal=True, scale=0.5)
    for scale in (np.float32(0.5), np.float64(0.5)):
        assert rel_err(ctxfast.attention(q, k, v, causal=True, scale=scale), want) < 1e-5


@needs_triton
@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.5])
def test_any_scale(scale):
    """The forward applies a positive scale inside the exponent's FMA, to the row max of the
    unscaled scores (kernels._common._fold_scale); a zero or negative scale (SDPA takes
    them) must keep the scaled tile: with the fold, -inf masks times 0 are NaN and a
    negative scale turns the row max into the row min."""
    q, k, v = _inputs(2, 2, 21, 30, 16)
    check_against_reference(q, k, v, **_masks("causal-pad", 2, 21, 30), scale=scale)


@needs_interpreter    # spies on the launch: the same kernels run on a GPU in test_any_scale
@pytest.mark.parametrize("op", ["attention", "rel_attention"])
def test_fold_follows_the_scale_and_the_override(monkeypatch, op):
    """FOLD (the scale in the exponent's FMA) is on for a positive scale, off for 0 and for
    the override the tuner compares it with ("fwd:fold" / "fold" False), and both forms
    agree."""
    from ctxfast.kernels import attention as kattn
    from ctxfast.kernels import rel_attention as krel
    module, kernel, key = ((kattn, "_attn_fwd_kernel", "fwd:fold") if op == "attention"
                           else (krel, "_rel_attn_fwd_kernel", "fold"))
    seen = spy_launches(monkeypatch, module, (kernel,), lambda a, kw: kw["FOLD"],
                        with_name=False)
    q, k, v = _inputs(1, 2, 21, 30, 16)
    r, u, w = torch.randn(2, 30, 16), torch.randn(2, 16), torch.randn(2, 16)

    def run(scale):
        if op == "attention":
            return ctxfast.attention(q, k, v, causal=True, scale=scale, backend="triton")
        return ctxfast.rel_attention(q, k, v, r, u, w, scale=scale, backend="triton")

    folded = run(0.3)
    run(0.0)
    monkeypatch.setitem(module.LAUNCH_OVERRIDE, key, False)
    scaled = run(0.3)
    assert seen == [True, False, False], seen
    assert rel_err(folded, scaled) < 1e-6


@needs_triton
@pytest.mark.parametrize("how", ["all-padding", "query-stream-lowest-rank"])
def test_rows_that_see_no_key(how):
    """Zeros out, zero gradient through them, never NaN."""
    B, H, T, D = 2, 2, 20, 16
    q, k, v = _inputs(B, H, T, T, D)
    if how == "all-padding":
        kpm = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
        kpm[0] = True                                   # batch 0: every key is padding
        kw, empty = {"key_padding_mask": kpm}, (0, slice(None), slice(None))
    else:
        rank = torch.stack([torch.randperm(T) for _ in range(B)]).to(DEVICE)
        kw = {"perm_rank": rank, "perm_stream": "query"}   # rank 0 sees no current key
        first = (rank == 0).nonzero()
        empty = (first[0, 0].item(), slice(None), first[0, 1].item())
    out, (dq, dk, dv) = check_against_reference(q, k, v, **kw)
    assert (out[empty] == 0).all()
    assert (dq[empty] == 0).all()
    if how == "all-padding":
        assert (dk[0] == 0).all() and (dv[0] == 0).all()


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("how", ["all-padding", "query-stream-lowest-rank"])
def test_lse_of_rows_that_see_no_key_is_plus_inf(how, num_splits):
    """The forward's lse (an output of the op, saved for the backward) is +inf on a row that
    sees no key, so that the backward's probabilities 2^(s - lse) are exactly 0 there, and
    finite and equal to the reference's log2-sum-exp on every other row; unsplit and split
    (flash-decoding's partials are -inf, the combined lse +inf)."""
    from ctxfast.kernels.attention import attention_forward
    B, H, T, D = 2, 2, 20, 16
    q, k, v = _inputs(B, H, T, T, D)
    if how == "all-padding":
        kpm = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
        kpm[0] = True                                   # batch 0: every key is padding
        kw, strict = {"key_padding_mask": kpm}, False
        visible = ~kpm[:, None, None, :].expand(B, H, T, T)
    else:
        rank = torch.stack([torch.randperm(T) for _ in range(B)]).to(DEVICE)
        kw, strict = {"perm_rank": rank}, True          # rank 0 sees no current key
        visible = (rank[:, None, :] < rank[:, :, None])[:, None].expand(B, H, T, T)
    _, lse = attention_forward(q, k, v, perm_strict=strict, num_splits=num_splits, **kw)
    s = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5
    want = torch.logsumexp(s.masked_fill(~visible, float("-inf")), -1) / math.log(2)
    empty = ~visible.any(-1)
    assert empty.any() and (~empty).any()
    assert (lse[empty] == float("inf")).all(), f"lse of empty rows: {lse[empty]}"
    assert torch.allclose(lse[~empty].double(), want[~empty], rtol=0, atol=1e-5), \
        (lse[~empty] - want[~empty]).abs().max()


@needs_triton
def test_kernel_writes_every_output():
    """Poisoned buffers: the launchers allocate with torch.empty; fill the allocator's
    memory with NaN first is not possible on CPU, so check the outputs are finite at every
    position including rows past the last full block."""
    q, k, v = _inputs(1, 1, 33, 33, 16)
    out = ctxfast.attention(q, k, v, backend="triton", causal=True)
    assert torch.isfinite(out).all()


@needs_triton
def test_opcheck():
    q, k, v = _inputs(1, 2, 9, 12, 16)
    kpm = torch.zeros(1, 12, dtype=torch.bool, device=DEVICE)
    kpm[0, -3:] = True
    rank = torch.randperm(9).view(1, 9).to(DEVICE)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), kpm, rank, True, False,
            0.25, 0.0, None)
    torch.library.opcheck(torch.ops.ctxfast.attention_fwd_triton.default, args)
    out, lse = torch.ops.ctxfast.attention_fwd_triton(*args)
    torch.library.opcheck(torch.ops.ctxfast.attention_bwd_triton.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(),
                           out.detach(), lse, kpm, rank, True, False, 0.25, 0.0, None))
    seed = torch.tensor([123], dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(torch.ops.ctxfast.attention_fwd_triton.default,
                          args[:-2] + (0.2, seed))
    # without causal the permutation runs in rank order (order computed inside the ops)
    args = args[:5] + (False, True) + args[7:]
    torch.library.opcheck(torch.ops.ctxfast.attention_fwd_triton.default, args)
    out, lse = torch.ops.ctxfast.attention_fwd_triton(*args)
    torch.library.opcheck(torch.ops.ctxfast.attention_bwd_triton.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(),
                           out.detach(), lse, kpm, rank, False, True, 0.25, 0.0, None))


@needs_triton
def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 17, 20, 16))

    def f(q, k, v):
        return ctxfast.attention(q * 1.5, k, v, causal=True, backend="triton").sum()

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    out.backward()
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q2 * 1.5, k2, v2, causal=True).sum()
    ref.backward()
    assert abs(out.item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item()))
    assert rel_err(q.grad, q2.grad) < 1e-5


@needs_triton
def test_torch_compile_fullgraph_permutation():
    """A permutation mask (rank order: argsort inside the op) traces without graph breaks."""
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 17, 24, 16))
    rank = torch.randint(0, 6, (1, 17), device=DEVICE)

    def f(q, k, v, rank):
        return ctxfast.attention(q, k, v, perm_rank=rank, perm_stream="query",
                                 backend="triton").sum()

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, rank)
    out.backward()
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q2, k2, v2, perm_rank=rank, perm_stream="query").sum()
    ref.backward()
    assert abs(out.item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item()))
    assert rel_err(q.grad, q2.grad) < 1e-5 and rel_err(k.grad, k2.grad) < 1e-5


@needs_triton
def test_gradcheck_fast_mode():
    q, k, v = (torch.randn(1, 1, 5, 16, dtype=torch.float64, device=DEVICE, requires_grad=True)
               for _ in range(3))
    f = lambda a, b, c: ctxfast.attention(a, b, c, causal=True, backend="triton")  # noqa: E731
    if DEVICE == "cuda":      # float64 runs in the interpreter only; on a GPU it is refused
        with pytest.raises(ctxfast.BackendUnavailable, match="float64"):
            f(q, k, v)
        return
    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@needs_triton
@pytest.mark.parametrize("kind", ["none", "causal-pad", "perm-query", "ties-pad"])
def test_dropout_matches_reference_with_the_same_mask(kind):
    """The kernel's mask is reproducible from the seed, forward and backward agree with the
    reference given that mask, and about p of the entries are dropped."""
    from ctxfast.ops.attention import draw_seed, dropout_keep_mask
    B, H, Tq, Tk, D, p = 2, 2, 19, 26, 32, 0.3
    q, k, v = (t.requires_grad_() for t in _inputs(B, H, Tq, Tk, D))
    kw = _masks(kind, B, Tq, Tk)
    out = ctxfast.attention(q, k, v, dropout_p=p, backend="triton",
                            generator=torch.Generator(DEVICE).manual_seed(7), **kw)
    seed = draw_seed(DEVICE, torch.Generator(DEVICE).manual_seed(7))
    keep = dropout_keep_mask(seed, B, H, Tq, Tk, p)
    assert abs((~keep).float().mean().item() - p) < 0.05
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q2, k2, v2, dropout_mask=keep, dropout_p=p, **kw)
    assert rel_err(out, ref) < 1e-5
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q2, k2, v2), do.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert rel_err(g, r) < 1e-5, (name, rel_err(g, r))
    other = ctxfast.attention(q, k, v, dropout_p=p, backend="triton",
                              generator=torch.Generator(DEVICE).manual_seed(8), **kw)
    assert not torch.equal(out, other)


# --------------------------------------------------------------------------- eager backend, dispatch

def test_eager_dropout_reproducible_from_generator():
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    a = ctxfast.attention(q, k, v, dropout_p=0.5, generator=torch.Generator().manual_seed(3),
                          backend="eager")
    b = ctxfast.attention(q, k, v, dropout_p=0.5, generator=torch.Generator().manual_seed(3),
                          backend="eager")
    c = ctxfast.attention(q, k, v, backend="eager")
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_default_on_cpu_is_the_cpu_kernel():
    """The C++ kernel is the CPU default (tests/test_attention_cpu.py checks it)."""
    assert ctxfast._dispatch.resolve("attention", torch.device("cpu")) == "cpu"


# --------------------------------------------------------------------------- bad input

def _bad_cases():
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    yield "rank", dict(q=q[0], k=k, v=v), ValueError, ["q must have shape [B, H, T, D]", "(2, 5, 8)"]
    yield "head-dim", dict(q=q, k=torch.randn(2, 2, 5, 4), v=v), ValueError, ["k must have shape", "(2, 2, 5, 4)"]
    yield "v-len", dict(q=q, k=k, v=torch.randn(2, 2, 6, 8)), ValueError, ["v must have shape"]
    yield "dtype-mix", dict(q=q, k=k.double(), v=v), TypeError, ["one dtype"]
    yield "int", dict(q=q.long(), k=k, v=v), TypeError, ["q must be float16"]
    yield "kpm-len", dict(q=q, k=k, v=v, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), \
        ValueError, ["key_padding_mask must have shape [B, Tk] = [2, 5]", "(2, 4)"]
    yield "kpm-float", dict(q=q, k=k, v=v, key_padding_mask=torch.zeros(2, 5)), TypeError, ["key_padding_mask must be a bool"]
    yield "rank-float", dict(q=q, k=k, v=v, perm_rank=torch.zeros(2, 5)), TypeError, ["perm_rank must be an integer"]
    yield "rank-shape", dict(q=q, k=k, v=v, perm_rank=torch.zeros(2, 4, dtype=torch.long)), \
        ValueError, ["perm_rank must have shape [B, Tq] = [2, 5]"]
    yield "stream", dict(q=q, k=k, v=v, perm_stream="both"), ValueError, ["perm_stream"]
    yield "causal-short-keys", dict(q=q, k=k[:, :, :3], v=v[:, :, :3], causal=True), ValueError, ["Tk >= Tq"]
    yield "dropout", dict(q=q, k=k, v=v, dropout_p=1.0), ValueError, ["dropout_p"]
    yield "scale-str", dict(q=q, k=k, v=v, scale="0.5"), TypeError, ["scale must be a float"]
    yield "scale-bool", dict(q=q, k=k, v=v, scale=True), TypeError, ["scale must be a float"]


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
def test_bad_input_raises_before_dispatch(no_dispatch, case):
    _, kw, exc, words = case
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    with pytest.raises(exc) as info:
        ctxfast.attention(q, k, v, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


# --------------------------------------------------------------------------- interior / boundary tiles
# The kernels split each key loop into interior tiles (no mask work; for padding and
# permutation masks classed all / none / partly visible from the tile's bounds) and
# boundary tiles (full element test). The interpreter's tiles are 16 x 16: these cases put
# the causal diagonal, the sequence ends and the padding end mid-tile and on tile edges,
# and make permutation tiles wholly visible, wholly hidden and mixed.

def _block_ranks(Tq, order):
    """[1, Tq] ranks in 16-row blocks: query block i gets the ranks of block order[i]
    (increasing inside), so whole interpreter tiles are all / none visible."""
    return torch.cat([torch.arange(16 * o, 16 * o + min(16, Tq - 16 * i))
                      for i, o in enumerate(order)])[None].to(DEVICE)


@needs_triton
@pytest.mark.parametrize("Tq, Tk, kind", [
    (20, 45, "causal"), (33, 40, "causal"), (32, 32, "causal"), (48, 80, "causal"),
    (40, 40, "pad-end-21"), (48, 48, "pad-block"), (32, 32, "pad-none"),
    (48, 48, "perm-blocks-content"), (48, 48, "perm-blocks-query"),
    (48, 55, "perm-blocks-query-causal"), (47, 47, "perm-blocks-pad"), (1, 1, "perm-blocks")])
def test_interior_and_boundary_tiles(Tq, Tk, kind):
    B = 1
    q, k, v = _inputs(B, 2, Tq, Tk, 16)
    kw = {"causal": True} if "causal" in kind else {}
    if "pad" in kind:
        kpm = torch.zeros(B, Tk, dtype=torch.bool, device=DEVICE)
        if kind == "pad-end-21":
            kpm[:, 21:] = True                   # padding ends mid-tile
        elif "block" in kind:
            kpm[:, 16:32] = True                 # one whole tile padded: skipped
            kpm[:, 40] = True                    # and one tile partly padded
        kw["key_padding_mask"] = kpm
    if "perm" in kind:
        order = [2, 0, 1] if Tq > 32 else [0]
        kw["perm_rank"] = _block_ranks(Tq, order)
        kw["perm_stream"] = "query" if "query" in kind else "content"
    check_against_reference(q, k, v, **kw)


@needs_triton
@pytest.mark.parametrize("mem", range(16))
def test_causal_diagonal_at_every_memory_length_mod_the_tile(mem):
    """Where the diagonal of a causal mask with memory crosses the tiles depends on mem_len
    mod the tile (16 under the interpreter): the forward's and the dK/dV kernel's first
    interior block off by one each passed every other test, whose memories never had
    mem_len + 2 a multiple of 16."""
    q, k, v = _inputs(1, 2, 33, 33 + mem, 16)
    check_against_reference(q, k, v, causal=True)


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_q_k_and_v_each_in_their_own_layout(causal):
    """Strides are per tensor: v read with k's strides passed every test whose q, k and v
    shared one layout."""
    B, H, Tq, Tk, D = 2, 2, 17, 24, 16
    q = torch.randn(Tq, B, H, D, device=DEVICE).permute(1, 2, 0, 3)    # [T, B, H, D] storage
    k = torch.randn(B, H, Tk, D, device=DEVICE)
    v = torch.randn(B, Tk, H, D, device=DEVICE).transpose(1, 2)        # [B, T, H, D] storage
    assert len({t.stride() for t in (q, k, v)}) == 3
    check_against_reference(q, k, v, causal=causal)


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_mask_tensors_that_are_not_contiguous(causal):
    """key_padding_mask and perm_rank read through their strides: a transposed mask (as a
    [Tk, B] mask's .t()) and transposed ranks. Read as contiguous, each passed every test
    (all built [B, T] contiguous); causal keeps the ranks in the caller's layout. One batch
    is all padding: its rows see no key (0, and no NaN)."""
    B, H, Tq, Tk, D = 2, 2, 33, 40, 16
    q, k, v = _inputs(B, H, Tq, Tk, D)
    kpm = (torch.rand(Tk, B, device=DEVICE) < 0.3).t()
    kpm[0, 0] = False
    kpm[1] = True                                  # the second batch's rows see no key
    assert not kpm.is_contiguous()
    check_against_reference(q, k, v, causal=causal, key_padding_mask=kpm)
    rank = torch.stack([torch.randperm(Tq) for _ in range(B)], 1).to(DEVICE).t()
    assert not rank.is_contiguous()
    qq, kk, vv = _inputs(B, H, Tq, Tq, D)
    check_against_reference(qq, kk, vv, causal=causal, perm_rank=rank)
    check_against_reference(qq, kk, vv, causal=causal, perm_rank=rank.int())


# --------------------------------------------------------------------------- rank order
# A permutation mask without causal runs in rank order: the kernels read and write the rows
# of queries and current keys through order = argsort(rank), so the mask becomes causal-like
# and the tile bounds skip the tiles past the diagonal.

def _gappy_ranks(B, Tq):
    """Ranks with ties and gaps (not a permutation): multiples of 5, about 3 per value, and
    two queries of each row (two random places) at the row's lowest rank: a tie there is
    made, not left to the draw (a lone lowest rank came up at CTXFAST_TEST_SEED=17)."""
    rank = torch.randint(0, max(2, Tq // 3), (B, Tq), device=DEVICE) * 5
    if Tq >= 2:
        two = torch.rand(B, Tq, device=DEVICE).argsort(1)[:, :2]          # [B, 2]
        rank.scatter_(1, two, rank.min(1, keepdim=True).values.expand(B, 2))
    return rank


@needs_triton
@pytest.mark.parametrize("stream", ["content", "query"])
@pytest.mark.parametrize("Tq, mem, pad", [(37, 0, False), (37, 11, False), (30, 19, True),
                                          (5, 0, False)])
def test_rank_order_with_ties_and_gaps(Tq, mem, pad, stream):
    """Forward and every gradient against the float64 reference for ranks that repeat and
    skip values, both streams, with and without memory (and with padding). Without memory
    the query stream's lowest-ranked queries (a tie) see no key: zeros, zero dq."""
    B, H, D = 2, 2, 32
    Tk = Tq + mem
    q, k, v = _inputs(B, H, Tq, Tk, D)
    rank = _gappy_ranks(B, Tq)
    assert ((rank == rank.min(1, keepdim=True).values).sum(1) > 1).all()  # ties at the lowest
    kw = {"perm_rank": rank, "perm_stream": stream}
    if pad:
        kpm = torch.rand(B, Tk, device=DEVICE) < 0.3
        kpm[:, 0] = False
        kw["key_padding_mask"] = kpm
    out, (dq, dk, dv) = check_against_reference(q, k, v, **kw)
    if stream == "query" and mem == 0:
        empty = rank == rank.min(1, keepdim=True).values          # [B, Tq]: sees no key
        assert (out.transpose(1, 2)[empty] == 0).all()
        assert (dq.transpose(1, 2)[empty] == 0).all()


@needs_interpreter    # counts calls of the jitted helpers: only the interpreter runs them as Python
@pytest.mark.parametrize("stream", ["content", "query"])
def test_rank_order_visits_fewer_tiles(monkeypatch, stream):
    """With a random permutation the kernels visit only the tiles on and below the diagonal
    of the rank-sorted problem (their loops end there), and element-mask only the diagonal
    ones. Counted in the interpreter (16 x 16 tiles) through the score, mask and tile-class
    helpers, forward and both backward kernels, against the same kernels made to run in the
    original order."""
    from ctxfast.kernels import attention as kernels
    B, H, Tq, mem, D = 1, 1, 64, 16, 16
    nq, nk = Tq // 16, (Tq + mem) // 16
    q, k, v = (t.requires_grad_() for t in _inputs(B, H, Tq, Tq + mem, D))
    rank = torch.randperm(Tq, device=DEVICE)[None]
    counts = {"_fwd_scores": 0, "_scores": 0, "_interior_mask": 0, "_interior_keys": 0}
    for name in counts:
        def counted(*args, _fn=getattr(kernels, name), _name=name):
            counts[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(kernels, name, counted)

    def run():
        for name in counts:
            counts[name] = 0
        out = ctxfast.attention(q, k, v, perm_rank=rank, perm_stream=stream, backend="triton")
        out.backward(torch.randn_like(out))
        return dict(counts)

    sorted_counts = run()
    monkeypatch.setattr(kernels, "_rank_ordered",            # the masks as given, no order
                        lambda kpm, rank, causal, strict, order: (kpm, rank, None))
    original = run()
    # per kernel: the memory tile for every query block, the lower triangle of the current
    # ones; forward and dQ loops end at the diagonal (_interior_keys: a step of their loops)
    visited = nq + nq * (nq + 1) // 2
    # (the forward's scores through _fwd_scores, the backward kernels' through _scores)
    assert sorted_counts == {"_fwd_scores": visited, "_scores": 2 * visited,
                             "_interior_mask": 3 * nq, "_interior_keys": 2 * visited}, \
        sorted_counts
    assert original["_fwd_scores"] + original["_scores"] == 3 * nq * nk, original  # all
    assert original["_interior_keys"] == 2 * nq * nk, original
    assert original["_interior_mask"] > sorted_counts["_interior_mask"], original


# --------------------------------------------------------------------------- decoding (split-K)

@needs_triton
@pytest.mark.parametrize("Tq, Tk, kind", [(1, 100, "causal"), (3, 77, "none"), (4, 90, "pad"),
                                          (2, 70, "perm-query"), (1, 40, "all-pad"),
                                          (2, 12, "pad")])
def test_split_k_decoding_matches_reference(Tq, Tk, kind):
    """Flash-decoding (keys split over programs, partials combined): same out and lse as the
    unsplit kernel, and the combined lse drives a correct backward. Tk 12 asks for three
    splits of keys that fit one block (the GPU's 64-key blocks made Tk 40 such a case): one
    split, out written directly."""
    from ctxfast.kernels.attention import attention_backward, attention_forward
    B, H, D = 2, 2, 32
    q, k, v = _inputs(B, H, Tq, Tk, D)
    if kind == "all-pad":
        kw = {"key_padding_mask": torch.ones(B, Tk, dtype=torch.bool, device=DEVICE)}
        kw["key_padding_mask"][1, :5] = False
    else:
        kw = _masks(kind, B, Tq, Tk)
    stream = kw.pop("perm_stream", "content")
    out1, lse1 = attention_forward(q, k, v, num_splits=1, perm_strict=stream == "query", **kw)
    out3, lse3 = attention_forward(q, k, v, num_splits=3, perm_strict=stream == "query", **kw)
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    ref = reference.attention(q64, k64, v64, perm_stream=stream, **kw)
    assert rel_err(out3, ref) < 1e-5 and not torch.isnan(out3).any()
    finite = torch.isfinite(lse1)
    assert torch.equal(finite, torch.isfinite(lse3))
    assert torch.allclose(lse3[finite], lse1[finite], rtol=0, atol=1e-5)
    do = torch.randn_like(out3)
    grads = attention_backward(do, q, k, v, out3, lse3, perm_strict=stream == "query", **kw)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert (g - r).norm() <= 1e-5 * max(r.norm().item(), 1.0), name


@pytest.mark.parametrize("backend", ["eager"] + (["triton"] if TRITON_ON_CPU else []))
def test_autocast_runs_in_the_autocast_dtype(backend):
    """As F.scaled_dot_product_attention: under autocast the op runs in the lower precision,
    even for inputs of mixed dtypes."""
    q, k, v = _inputs(1, 2, 9, 9, 16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = ctxfast.attention(q, k.bfloat16(), v, causal=True, backend=backend)
    assert out.dtype == torch.bfloat16
    ref = reference.attention(q.double(), k.bfloat16().double(), v.double(), causal=True)
    assert rel_err(out, ref) < 1e-2


@needs_triton
def test_backward_row_term_matches_torch():
    # kernels._common._bwd_delta: Δ = rowsum(dO ∘ O) in fp32 from any strides (an expanded
    # dO from out.sum(), a transposed view) and any head dim, as the four torch ops gave it.
    from ctxfast.kernels._common import _bwd_delta
    for dtype in (torch.float32, torch.float16):
        for B, H, Tq, D in ((2, 3, 17, 40), (1, 1, 1, 16), (1, 2, 33, 128)):
            out = torch.randn(B, Tq, H, D, dtype=dtype, device=DEVICE).transpose(1, 2)
            for do in (torch.randn(B, H, Tq, D, dtype=dtype, device=DEVICE),
                       torch.ones((), dtype=dtype, device=DEVICE).expand(B, H, Tq, D)):
                want = (do.float() * out.float()).sum(-1)
                got = _bwd_delta(do, out)
                assert got.dtype == torch.float32 and got.is_contiguous()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("mode", ["atomic", "bulk"])
@pytest.mark.parametrize("check", ["odd_lengths", "rows_that_see_no_key", "dropout"])
def test_atomic_dq_backward_against_reference(monkeypatch, check, mode):
    """kernels.attention.DQ_MODE = "atomic" (the dK/dV kernel adds each tile's dS K into an
    fp32 dQ accumulator; no dQ kernel) or "bulk" (the same, a tile at a time by TMA bulk
    reductions, which the interpreter runs through ctxfast's shim): the module's own
    reference checks run in that mode, forward and every gradient against float64 within
    2x eager, on odd lengths with every mask kind, rows that see no key (zero output and
    gradient), and dropout. Bulk takes the element-wise adds only where TMA cannot address
    the rows (rank order: a permutation mask without causal)."""
    import ctxfast.kernels.attention as kattn
    if "CTXFAST_ATTN_BWD_DQ" not in os.environ:
        assert kattn.DQ_MODE == "kernel"          # opt-in only: not bitwise reproducible
    monkeypatch.setattr(kattn, "DQ_MODE", mode)
    bulk = []
    real = kattn._dq_bulk_args
    monkeypatch.setattr(kattn, "_dq_bulk_args", lambda *a: bulk.append(real(*a)) or bulk[-1])
    if check == "odd_lengths":
        for Tq, Tk, kind in ((37, 53, "causal-pad"), (17, 33, "perm-query"),
                             (33, 33, "ties-pad"), (1, 97, "pad")):
            test_odd_lengths(Tq, Tk, kind)
    elif check == "rows_that_see_no_key":
        for how in ("all-padding", "query-stream-lowest-rank"):
            test_rows_that_see_no_key(how)
    else:
        for kind in ("causal-pad", "perm-query"):
            test_dropout_matches_reference_with_the_same_mask(kind)
    assert (mode == "bulk") == any(bulk), bulk    # bulk: descriptors where rows allow
    monkeypatch.setattr(kattn, "DQ_MODE", "fast")
    q, k, v = (t.requires_grad_() for t in _inputs(1, 1, 5, 5, 16))
    seen = spy_launches(monkeypatch, kattn, ("_attn_fwd_kernel",), lambda a, kw: None)
    with pytest.raises(ValueError, match="CTXFAST_ATTN_BWD_DQ"):   # at the forward already
        ctxfast.attention(q, k, v, backend="triton")
    assert not seen


@needs_triton
def test_atomic_dq_and_deterministic_algorithms(monkeypatch):
    """dQ by atomic adds sums in no fixed order: asked for while
    torch.use_deterministic_algorithms(True) is in force it is refused by name before any
    kernel runs (warn-only warns and runs it), as torch does with its own nondeterministic
    ops."""
    import ctxfast.kernels.attention as kattn
    monkeypatch.setattr(kattn, "DQ_MODE", "atomic")
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 9, 9, 16))
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="CTXFAST_ATTN_BWD_DQ=atomic"):   # as torch's
            ctxfast.attention(q, k, v, backend="triton").sum().backward()  # allowed
        assert q.grad is not None
        torch.use_deterministic_algorithms(True)
        out = ctxfast.attention(q, k, v, backend="triton")
        seen = spy_launches(monkeypatch, kattn, ("_attn_bwd_dkdv_kernel",), lambda a, kw: None)
        with pytest.raises(RuntimeError, match="CTXFAST_ATTN_BWD_DQ=atomic"):
            out.sum().backward()
        assert seen == []
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


try:
    import triton
    import triton.language as tl
    from ctxfast.kernels._common import _exp2_fma, _exp2_half_fma

    @triton.jit
    def _exp2_probe(X, Y, Z, E, N: tl.constexpr):
        """Y = _exp2_fma(X), Z = _exp2_half_fma(X as [N / 64, 64]), E = tl.exp2(X)."""
        o = tl.arange(0, N)
        x = tl.load(X + o)
        tl.store(Y + o, _exp2_fma(x))
        rows = tl.reshape(o, [N // 64, 64])
        tl.store(Z + rows, _exp2_half_fma(tl.reshape(x, [N // 64, 64])))
        tl.store(E + o, tl.exp2(x))

    @triton.jit
    def _bulk_add_probe(ACC_D, X, r0, R: tl.constexpr, BD: tl.constexpr):
        """Program p adds X's [R, BD] tile into head p of ACC_D at rows r0 + 5p.."""
        p = tl.program_id(0)
        x = tl.load(X + tl.arange(0, R)[:, None] * BD + tl.arange(0, BD)[None, :])
        ACC_D.atomic_add([0, p, r0 + 5 * p, 0], x.reshape(1, 1, R, BD))
except ImportError:                     # no Triton: the tests that need it are skipped
    _exp2_probe = _bulk_add_probe = None


@needs_triton
def test_bulk_add_drops_what_lies_outside():
    """kernels._common.bulk_add_args and the TMA bulk reduction it sets up (the
    interpreter's through ctxfast's shim; on an sm_90+ GPU the hardware's): a [16, 8] tile
    added at rows -4.. and 1.. of a [1, 2, 15, 6] fp32 accumulator view (rows 8 floats
    apart) adds what lies inside and nothing before row 0, past row 14 or in the two
    columns past D. Where TMA cannot address the accumulator (rows 18 floats apart, not a
    multiple of 16 bytes) the launch arguments are {} (the element-wise adds);
    attention's rank order takes them too."""
    from ctxfast.kernels import _common
    from ctxfast.kernels import attention as kattn
    device = torch.device(DEVICE)
    if not _common._has_tma(device):
        pytest.skip("TMA needs compute capability 9 or later")
    full = torch.randn(1, 2, 15, 8, device=device)
    before = full.clone()
    acc = full[..., :6]
    x = torch.randn(16, 8, device=device)
    args = _common.bulk_add_args(acc, 16, 8, "ACC_D", "FLAG")
    assert args["FLAG"] is True
    _bulk_add_probe[(2,)](args["ACC_D"], x, -4, R=16, BD=8)
    want = before.clone()
    for p, r0 in ((0, -4), (1, 1)):
        for i in range(16):
            if 0 <= r0 + i < 15:
                want[0, p, r0 + i, :6] += x[i, :6]
    torch.testing.assert_close(full, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(full[..., 6:], before[..., 6:])
    assert _common.bulk_add_args(torch.zeros(1, 1, 5, 18, device=device), 16, 32, "A", "F") == {}
    order = torch.zeros(1, 5, dtype=torch.int32, device=device)
    assert kattn._dq_bulk_args(torch.zeros(1, 1, 5, 16, device=device), 16, 16, order) == {}


@needs_triton
def test_exp2_on_the_fma_pipe():
    """kernels._common._exp2_fma (2^x as a polynomial and an exponent add, for x <= 0):
    relative error <= 3e-6 against float64 down to 2^-126, exactly 0 below it and at -inf
    (a masked score); _exp2_half_fma takes the even columns from tl.exp2 and the odd ones
    from _exp2_fma."""
    N = 4096
    x = torch.cat([-torch.rand(N - 8) * 140,
                   torch.tensor([0.0, -0.0, -1.0, -126.0, -126.5, -127.0, -200.0, -math.inf])])
    x = x.to(DEVICE)
    y, z, e = (torch.empty_like(x) for _ in range(3))
    _exp2_probe[(1,)](x, y, z, e, N)
    ref = torch.exp2(x.double())
    normal = x >= -126
    assert ((y.double() - ref).abs() / ref)[normal].max() <= 3e-6
    assert (y[~normal] == 0).all() and y[-1] == 0
    odd = torch.arange(N, device=DEVICE) % 2 == 1
    assert torch.equal(z, torch.where(odd, y, e))


@needs_triton
def test_register_caps_reach_their_launches_only(monkeypatch):
    """The overrides "<kernel>:maxnreg" (the tuner's register-capped rows, kernels/attention
    ._TUNE_REG_CAPS) reach that kernel's launch as Triton's ``maxnreg`` and no other;
    without them no launch caps registers. The interpreter ignores the cap: the same bits."""
    import ctxfast.kernels.attention as kattn
    seen = spy_launches(monkeypatch, kattn,
                        ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"),
                        lambda a, kw: kw.get("maxnreg"))
    q, k, v = _inputs(2, 2, 21, 30, 32)

    def run():
        ts = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = ctxfast.attention(*ts, causal=True, backend="triton")
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in ts]
    plain = run()
    assert seen and all(cap is None for _, cap in seen), seen
    seen.clear()
    monkeypatch.setitem(kattn.LAUNCH_OVERRIDE, "dq:maxnreg", 128)
    capped = run()
    assert dict(seen) == {"_attn_fwd_kernel": None, "_attn_bwd_dkdv_kernel": None,
                          "_attn_bwd_dq_kernel": 128}, seen
    seen.clear()                                 # a different cap per kernel
    monkeypatch.setitem(kattn.LAUNCH_OVERRIDE, "fwd:maxnreg", 152)
    monkeypatch.setitem(kattn.LAUNCH_OVERRIDE, "dkdv:maxnreg", 168)
    run()
    assert dict(seen) == {"_attn_fwd_kernel": 152, "_attn_bwd_dkdv_kernel": 168,
                          "_attn_bwd_dq_kernel": 128}, seen
    assert all(torch.equal(a, b) for a, b in zip(plain, capped))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_warp_specialised_kernels(monkeypatch, dtype):
    """The warp-specialised forward, dK/dV and dQ kernels (kernels/attention.
    _attn_fwd_ws_kernel and its backward twins: the tuner's ``"<kernel>:ws"`` rows) serve
    the dense 16-bit calls without padding, permutation mask or dropout, and are within 2x
    eager of float64, forward and every gradient: causal with memory keys and without,
    more queries than keys, key counts that are and are not a multiple of their tiles
    (MASK_KEYS), a head dim that is not a power of two (the descriptors' columns past D
    read as 0), one query. Calls they cannot serve take the other kernels (dQ's also where
    Tq is not a multiple of 4)."""
    import ctxfast.kernels.attention as kattn
    for kernel in ("fwd", "dkdv", "dq"):
        monkeypatch.setitem(kattn.LAUNCH_OVERRIDE, kernel + ":ws", True)
    names = ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel",
             "_attn_fwd_ws_kernel", "_attn_bwd_dkdv_ws_kernel", "_attn_bwd_dq_ws_kernel")
    seen = spy_launches(monkeypatch, kattn, names, lambda a, kw: kw.get("MASK_KEYS"))
    cases = ((True, 36, 37, 64), (True, 20, 45, 32), (False, 33, 32, 64),
             (False, 20, 50, 24), (True, 1, 17, 16), (False, 40, 7, 32))
    for causal, Tq, Tk, D in cases:
        seen.clear()
        q, k, v = _inputs(2, 2, Tq, Tk, D, dtype=dtype)
        check_against_reference(q, k, v, causal=causal)
        mask_keys = not causal and Tk % 16 != 0
        # dQ's reads lse and delta by TMA: their rows must start on 16 bytes (Tq % 4 == 0)
        dq = ("_attn_bwd_dq_ws_kernel", mask_keys) if Tq % 4 == 0 else \
            ("_attn_bwd_dq_kernel", None)
        assert set(seen) == {("_attn_fwd_ws_kernel", mask_keys),
                             ("_attn_bwd_dkdv_ws_kernel", None), dq}, (causal, Tq, Tk, D, seen)
    # what they cannot serve: padding, a permutation mask, dropout, float32, rows TMA cannot
    # address (D 20 in 16 bits: 40-byte rows)
    for kind, dt, D, kw in (("pad", dtype, 32, {}), ("perm", dtype, 32, {}),
                            ("", dtype, 32, {"dropout_p": 0.2}), ("causal", torch.float32, 32, {}),
                            ("causal", dtype, 20, {})):
        seen.clear()
        q, k, v = (t.requires_grad_() for t in _inputs(2, 2, 17, 21, D, dtype=dt))
        out = ctxfast.attention(q, k, v, backend="triton", **_masks(kind, 2, 17, 21), **kw)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert [n for n, _ in seen] == list(names[:3]), (kind, dt, D, seen)


def test_descriptor_scratch_is_set_for_its_body_only(monkeypatch):
    """kernels._common.descriptor_scratch (the global memory of descriptors built on the
    device): on a CUDA device the body runs with its allocator in Triton's context
    variable, and the caller's is back after, also when the body raises; nothing is set
    under the interpreter or for a CPU tensor."""
    from triton.runtime import _allocation

    from ctxfast.kernels import _common
    mine = _allocation._allocator.set(lambda size, alignment, stream: None)  # a caller's
    try:
        callers = _allocation._allocator.get()
        with _common.descriptor_scratch(torch.device("cpu")):
            assert _allocation._allocator.get() is callers
        monkeypatch.setattr(_common, "_interpreting", lambda: False)
        with pytest.raises(KeyError):
            with _common.descriptor_scratch(torch.device("cuda")):
                assert _allocation._allocator.get() is not callers
                raise KeyError("body")
        assert _allocation._allocator.get() is callers
    finally:
        _allocation._allocator.reset(mine)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_the_exponentials_on_the_fma_pipe(monkeypatch, dtype):
    """EXP_EMU in the forward, dK/dV and dQ kernels (the tuner's ``"<kernel>:exp_emu"``
    candidates): a 16-bit call with it on launches it in all three and stays within 2x
    eager of float64 (forward and every gradient) on odd lengths with a causal padding
    mask and with a permutation mask, with dropout, and on rows that see no key (zero, no
    NaN); a float32 call never takes it."""
    import ctxfast.kernels.attention as kattn
    for kernel in ("fwd", "dkdv", "dq"):
        monkeypatch.setitem(kattn.LAUNCH_OVERRIDE, kernel + ":exp_emu", True)
    seen = spy_launches(monkeypatch, kattn,
                        ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"),
                        lambda a, kw: kw.get("EXP_EMU"), with_name=False)
    for Tq, Tk, kind in ((21, 30, "causal-pad"), (37, 53, "perm-query")):
        q, k, v = _inputs(2, 2, Tq, Tk, 64, dtype=dtype)
        check_against_reference(q, k, v, **_masks(kind, 2, Tq, Tk))
    q, k, v = (t.requires_grad_() for t in _inputs(2, 2, 20, 20, 16, dtype=dtype))
    kpm = torch.zeros(2, 20, dtype=torch.bool, device=DEVICE)
    kpm[0] = True                                       # batch 0 sees no key
    out = ctxfast.attention(q, k, v, key_padding_mask=kpm, backend="triton")
    out.float().square().sum().backward()
    assert (out[0] == 0).all() and torch.isfinite(out).all()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all() and (g[0] == 0).all()
    assert len(seen) == 9 and all(seen), seen   # 3 x (fwd, dK/dV, dQ)
    seen.clear()
    q, k, v = (t.requires_grad_() for t in _inputs(1, 1, 9, 9, 16))
    ctxfast.attention(q, k, v, backend="triton").sum().backward()
    assert seen == [False] * 3, seen
    seen.clear()                                        # with dropout (the keep mask after P)
    from ctxfast.ops.attention import draw_seed, dropout_keep_mask
    B, H, Tq, Tk, p = 2, 2, 19, 26, 0.3
    kw = _masks("causal-pad", B, Tq, Tk)
    q, k, v = _inputs(B, H, Tq, Tk, 32, dtype=dtype)
    ours = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = ctxfast.attention(*ours, dropout_p=p, backend="triton",
                            generator=torch.Generator(DEVICE).manual_seed(7), **kw)
    keep = dropout_keep_mask(draw_seed(DEVICE, torch.Generator(DEVICE).manual_seed(7)),
                             B, H, Tq, Tk, p)
    out_same = reference.attention(*same, dropout_mask=keep, dropout_p=p, **kw)
    out64 = reference.attention(*wide, dropout_mask=keep, dropout_p=p, **kw)
    do = torch.randn_like(out)
    results = zip(("out", "dq", "dk", "dv"),
                  [out, *torch.autograd.grad(out, ours, do)],
                  [out_same, *torch.autograd.grad(out_same, same, do)],
                  [out64, *torch.autograd.grad(out64, wide, do.double())])
    for name, a, b, c in results:
        assert_within_2x_eager(a, b, c, FLOOR[dtype], name=f"dropout {name}")
    assert seen == [True] * 3, seen


# --------------------------------------------------------------------------- TMA tiles

def spy_tma(monkeypatch, module):
    """Record, per launch, whether ``module._tma_args`` turned TMA tiles on (a list of
    bools, filled as launches happen); the launches run as before."""
    used = []
    real = module._tma_args

    def spy(*args, **kwargs):
        got = real(*args, **kwargs)
        used.append(bool(got))
        return got
    monkeypatch.setattr(module, "_tma_args", spy)
    return used


@needs_triton
@pytest.mark.parametrize("check", ["odd_lengths", "tiles", "head_dims_and_dtypes", "layout",
                                   "rows_that_see_no_key", "dropout", "split_k", "atomic_dq",
                                   "bulk_dq"])
def test_tma_tiles_against_reference(monkeypatch, check):
    """kernels.attention.TMA_MODE = "on": the loops read their tiles (forward and dQ: k, v;
    dK/dV: q, dO) through tensor descriptors, which the interpreter emulates as TMA does
    (rows past a sequence and columns past D read as 0). The module's own checks run in
    that mode, forward and every gradient against float64 within 2x eager, and every launch
    of them took the descriptors (none fell back to pointer tiles)."""
    import ctxfast.kernels.attention as kattn
    if "CTXFAST_ATTN_TMA" not in os.environ:
        assert kattn.TMA_MODE == "auto"           # the table's kernels (test below)
    monkeypatch.setattr(kattn, "TMA_MODE", "on")
    # GPUs take TMA for 16-bit calls only (fp32 spilled there); the addressing does not
    # depend on the dtype, and the interpreter's exact fp32 lets these checks run as they are
    monkeypatch.setattr(kattn, "TMA_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    used = spy_tma(monkeypatch, kattn)
    if check == "odd_lengths":
        for Tq, Tk, kind in ((37, 53, "causal-pad"), (1, 1, "causal"), (97, 97, "causal"),
                             (17, 5, "none"), (1, 40, "causal"), (33, 64, "causal-pad")):
            test_odd_lengths(Tq, Tk, kind)
    elif check == "tiles":
        for Tq, Tk, kind in ((20, 45, "causal"), (48, 80, "causal"), (40, 40, "pad-end-21"),
                             (48, 48, "pad-block"), (48, 55, "perm-blocks-query-causal")):
            test_interior_and_boundary_tiles(Tq, Tk, kind)
    elif check == "head_dims_and_dtypes":
        for D in (16, 40, 96, 256):               # 40, 96: BLOCK_D past D (zero columns)
            test_head_dims(D)
        for dtype in (torch.float16, torch.bfloat16):
            test_dtypes(dtype)
    elif check == "layout":
        test_non_contiguous_bthd_layout()         # [B, T, H, D] storage: 4-D strides
    elif check == "rows_that_see_no_key":
        test_rows_that_see_no_key("all-padding")
    elif check == "dropout":
        for kind in ("none", "causal-pad"):
            test_dropout_matches_reference_with_the_same_mask(kind)
    elif check == "split_k":
        for Tq, Tk, kind in ((1, 100, "causal"), (4, 90, "pad"), (2, 12, "pad")):
            test_split_k_decoding_matches_reference(Tq, Tk, kind)
    else:
        monkeypatch.setattr(kattn, "DQ_MODE", check.split("_")[0])
        for Tq, Tk, kind in ((37, 53, "causal-pad"), (1, 97, "pad")):
            test_odd_lengths(Tq, Tk, kind)
    assert used and all(used), used


@needs_triton
def test_tma_auto_follows_the_table(monkeypatch):
    """TMA_MODE "auto" (the default): descriptors in the kernels of the table's
    ``_TMA_ROWS`` only (the 16-bit D 128 forward, which the H200 timed faster with them),
    not with dropout (other rows) nor split-K, not at D 64; "off" nowhere (nor "auto" with
    the table emptied). Every call right against float64; a spy says which launches took
    descriptors (forward, dK/dV, dQ in order)."""
    import ctxfast.kernels.attention as kattn
    monkeypatch.setattr(kattn, "TMA_MODE", "auto")
    used = spy_tma(monkeypatch, kattn)
    q, k, v = _inputs(1, 2, 21, 37, 128, dtype=torch.float16)
    check_against_reference(q, k, v, causal=True)
    assert used == [True, False, False], used
    used.clear()
    q, k, v = _inputs(1, 2, 21, 37, 64, dtype=torch.float16)
    check_against_reference(q, k, v, causal=True)
    assert used and not any(used), used
    assert kattn._tma_args("fwd", ("KD", "VD"), (k, v), 16, 128, k.device, None, None,
                           False)                                  # D 128: the table's
    assert not kattn._tma_args("fwd", ("KD", "VD"), (k, v), 16, 128, k.device, None, None,
                               True)                               # with dropout: not
    assert not kattn._tma_args("fwd", ("KD", "VD"), (k, v), 16, 128, k.device, None, None,
                               False, True)                        # split-K: not
    for mode, rows in (("off", kattn._TMA_ROWS), ("auto", set())):
        monkeypatch.setattr(kattn, "TMA_MODE", mode)
        monkeypatch.setattr(kattn, "_TMA_ROWS", rows)
        used.clear()
        q, k, v = _inputs(1, 1, 9, 9, 128, dtype=torch.float16)
        check_against_reference(q, k, v)
        assert used == [False] * 3, (mode, used)


@needs_triton
def test_tma_falls_back_where_tma_cannot_read(monkeypatch):
    """With TMA_MODE "on", calls that TMA cannot serve load pointer tiles and are still
    right: rows of 24 bytes (fp16 D 12: a stride that is not a multiple of 16 bytes), a
    permutation without causal (rank order: gathered rows), fp32 (not in TMA_DTYPES) and
    packed (varlen) sequences, while the same fp16 call with 16 columns takes it. Any other
    setting is refused by name."""
    import ctxfast.kernels.attention as kattn
    from ctxfast.kernels._common import row_tiles
    monkeypatch.setattr(kattn, "TMA_MODE", "on")
    used = spy_tma(monkeypatch, kattn)
    q, k, v = _inputs(1, 2, 21, 30, 12, dtype=torch.float16)
    assert row_tiles(q, 16, 16) is None
    check_against_reference(q, k, v, causal=True)
    q, k, v = _inputs(2, 2, 33, 33, 16, dtype=torch.float16)
    check_against_reference(q, k, v, **_masks("perm-query", 2, 33, 33))
    q, k, v = _inputs(1, 2, 21, 30, 16)                         # fp32: not in TMA_DTYPES
    check_against_reference(q, k, v, causal=True)
    assert used == [False] * 9, used
    check_against_reference(*(t.half() for t in (q, k, v)), causal=True)
    assert used[9:] == [True] * 3, used
    used.clear()
    from test_attention_varlen import test_varlen_matches_per_sequence_reference as varlen
    varlen(True, [3, 20], [9, 31])
    assert used and not any(used), used
    monkeypatch.setattr(kattn, "TMA_MODE", "yes")
    q, k, v = (t.requires_grad_() for t in _inputs(1, 1, 5, 5, 16))
    with pytest.raises(ValueError, match="CTXFAST_ATTN_TMA"):
        ctxfast.attention(q, k, v, backend="triton")
    # the backward refuses it before its first launch (the row term's kernel)
    monkeypatch.setattr(kattn, "TMA_MODE", "on")
    out, lse = kattn.attention_forward(q.detach(), k.detach(), v.detach())
    monkeypatch.setattr(kattn, "TMA_MODE", "yes")
    import ctxfast.kernels._common as kcommon
    monkeypatch.setattr(kcommon, "_bwd_delta_kernel", None)   # any launch would fail here
    with pytest.raises(ValueError, match="CTXFAST_ATTN_TMA"):
        kattn.attention_backward(torch.randn_like(out), q.detach(), k.detach(), v.detach(),
                                 out, lse)


def test_row_tiles_rules_and_launch_key():
    """kernels._common.row_tiles: a descriptor for a [B, H, T, D] tensor that TMA can
    address, None otherwise; two descriptors of the same dtype and block are one launch
    key (as Triton specialises them: ``tensordesc<fp16[1, 1, 16, 32]>``), another dtype
    or block another key."""
    from ctxfast.kernels._common import RowTiles, row_tiles
    from ctxfast.kernels._launch import args_key
    x = torch.randn(2, 3, 10, 32, dtype=torch.float16)
    d = row_tiles(x, 16, 32)
    assert isinstance(d, RowTiles) and list(d.shape) == [2, 3, 10, 32]
    assert list(d.block_shape) == [1, 1, 16, 32] and list(d.strides) == list(x.stride())
    assert row_tiles(x.transpose(1, 2), 16, 32) is not None         # [B, T, H, D] storage
    assert row_tiles(x[..., 1:], 16, 32) is None                     # base 2 bytes off
    assert row_tiles(x.transpose(2, 3), 16, 32) is None              # last dim strided
    assert row_tiles(torch.randn(2, 3, 10, 12, dtype=torch.float16), 16, 16) is None
    assert row_tiles(x[:1].expand(2, -1, -1, -1), 16, 32) is None    # stride 0
    assert row_tiles(x[:, :, :0], 16, 32) is None                    # empty
    same = row_tiles(torch.randn(1, 1, 99, 32, dtype=torch.float16), 16, 32)
    assert args_key((d,)) == args_key((same,)) and hash(d) == hash(same)
    assert args_key((d,)) != args_key((row_tiles(x, 32, 32),))
    assert args_key((d,)) != args_key((row_tiles(x.float(), 16, 32),))
    import triton.runtime.jit as triton_jit
    if hasattr(triton_jit, "mangle_type"):               # Triton's own name for the type
        assert triton_jit.mangle_type(d) == "tensordesc<fp16[1, 1, 16, 32]>"
    # built without TensorDescriptor's checks: the same object its constructor makes
    from ctxfast.kernels._common import _unchecked_desc_ok
    assert _unchecked_desc_ok()
    full = RowTiles(x, list(x.shape), list(x.stride()), [1, 1, 16, 32])
    assert vars(d).keys() == vars(full).keys() and d.base is full.base
    assert all(vars(d)[k] == vars(full)[k] for k in vars(d) if k != "base")


@pytest.mark.parametrize("backend", ATTN_BACKENDS)
@pytest.mark.parametrize("op", ["attention", "rel_attention"])
def test_head_dim_zero_with_the_default_scale(backend, op):
    """D = 0: an empty [B, H, Tq, 0] output (the default scale D ** -0.5 raised
    ZeroDivisionError before any check)."""
    q, k, v = (torch.randn(1, 2, T, 0, device=DEVICE, requires_grad=True) for T in (3, 5, 5))
    if op == "attention":
        out = ctxfast.attention(q, k, v, causal=True, backend=backend)
    else:
        r, u, w = (torch.randn(*s, device=DEVICE) for s in ((2, 5, 0), (2, 0), (2, 0)))
        out = ctxfast.rel_attention(q, k, v, r, u, w, backend=backend)
    assert out.shape == (1, 2, 3, 0)
    out.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.skipif(DEVICE != "cpu", reason="rank values are checked on CPU tensors only")
@pytest.mark.parametrize("op", ["attention", "rel_attention"])
def test_ranks_beyond_int32(op):
    """The triton backend reads ranks (and segment ids) as int32: int64 values beyond its
    range are refused there (they were cut to int32 silently: wrong output); the cpu and
    eager backends take them exactly."""
    q, k, v = (torch.randn(1, 1, 5, 8) for _ in range(3))
    rank = torch.tensor([[2**32 + 1, 2, 3, 4, 0]])
    small = torch.tensor([[4, 1, 2, 3, 0]])            # the same order in small numbers
    r, u, w = torch.randn(1, 10, 8), torch.randn(1, 8), torch.randn(1, 8)

    def run(ranks, backend):
        if op == "attention":
            return ctxfast.attention(q, k, v, perm_rank=ranks, backend=backend)
        return ctxfast.rel_attention(q, k, v, r, u, w, causal=False, pos_start=5,
                                     perm_rank=ranks, backend=backend)

    want = run(small, "eager")
    for backend in ("eager", "cpu"):
        if backend in ATTN_BACKENDS:
            assert rel_err(run(rank, backend), want) < 1e-5, backend
    if "triton" in ATTN_BACKENDS:
        with pytest.raises(ValueError, match="reads perm_rank as int32"):
            run(rank, "triton")
        assert rel_err(run(small, "triton"), want) < 1e-5


def test_int32_id_check_at_the_ends_of_the_range():
    """ops._common.check_int32_ids: int32's own extremes pass, one past either end is
    refused (2**31 read as int32 is -2**31: another order), naming the argument."""
    from ctxfast.ops._common import check_int32_ids
    for lo, hi in ((-2**31, 2**31 - 1), (0, 5)):
        check_int32_ids("attention", perm_rank=torch.tensor([[lo, 3, hi]]), seg_q=None)
    for bad in (2**31, -2**31 - 1):
        with pytest.raises(ValueError, match=rf"reads perm_rank as int32.*got .*{bad}"):
            check_int32_ids("attention", perm_rank=torch.tensor([[0, bad, 1]]))


@pytest.mark.skipif("triton" not in ATTN_BACKENDS, reason="a check of the triton backend")
@pytest.mark.parametrize("op", ["attention", "attention_varlen", "rel_attention"])
def test_tensors_beyond_int32_offsets(op):
    """The Triton kernels address q, k, v (and r) with 32-bit offsets and write gradients of
    their sizes contiguously: a tensor of 2**31 elements is refused, naming it, before
    anything is allocated or launched (expanded inputs here: a few bytes of storage)."""
    T, D = 2**25, 64                                          # T·D = 2**31
    big = torch.randn(1, 1, 1, D, device=DEVICE).expand(1, 1, T, D)
    small = torch.randn(1, 1, 8, D, device=DEVICE)
    with pytest.raises(ValueError, match=r"addresses k with 32-bit offsets.*2147483648"):
        if op == "attention":
            ctxfast.attention(small, big, big, backend="triton")
        elif op == "attention_varlen":                        # [total, H, D]
            q, k = small[0].transpose(0, 1), big[0].transpose(0, 1)
            cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
                          for n in (8, T))
            ctxfast.attention_varlen(q, k, k, cu_q, cu_k, 8, T, backend="triton")
        else:
            r = torch.randn(1, 1, D, device=DEVICE).expand(1, T + 8, D)
            u = torch.randn(1, D, device=DEVICE)
            ctxfast.rel_attention(small, big, big, r, u, u, backend="triton")


def test_eager_fp16_scores_past_the_fp16_range_before_scaling():
    """fp16 q·k of 65,536 (rows of ±32, D 64) overflows fp16 before the scale of 1/8 brings
    it to 8,192: the eager backend, the eager rel_attention and nn.MultiheadAttention's
    returned weights scale q first (as torch's own attention) and stay finite, equal to
    float64's within fp16's error. (They gave NaN, where SDPA and the kernels are finite.)"""
    sign = torch.where(torch.rand(1, 1, 4, 64, device=DEVICE) < 0.5, -1.0, 1.0)
    q = (32 * sign).half()
    k = q.clone()
    k[:, :, 1:3] = -k[:, :, 1:3]                              # keys 0 and 3 match each query
    v = torch.randn(1, 1, 4, 64, device=DEVICE).half()
    out = ctxfast.attention(q, k, v, backend="eager")
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert out.isfinite().all() and (out.double() - ref).abs().max() < 1e-2
    r = torch.zeros(1, 4, 64, device=DEVICE).half()
    bias = torch.zeros(1, 64, device=DEVICE).half()
    out = reference.rel_attention(q, k, v, r, bias, bias, causal=False)
    assert out.isfinite().all() and (out.double() - ref).abs().max() < 1e-2
    mha = ctxfast.nn.MultiheadAttention(64, 1, bias=False).to(DEVICE).half()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(64).repeat(3, 1))
    x = q[0, 0][:, None]                                     # [T, B, E]
    _, weights = mha(x, x, x)                                # each row sees itself
    want = torch.eye(4, device=DEVICE, dtype=weights.dtype)
    assert weights.isfinite().all() and torch.allclose(weights[0], want, atol=1e-3), weights
