"""Limits of a GPU that the interpreter does not have, so no small CPU test met them.

**Grids**: CUDA refuses more than 65535 programs along a grid's y or z. The Triton
launchers put the (batch, head) pairs on that axis, and B * H above it (BERT inference at
B 5,462, H 12) failed on a GPU with CUDA's "invalid argument" where SDPA runs. They now
launch in chunks (``kernels._common.bh_chunks``), each kernel told its first pair (``BH0``).
These tests lower the chunk size to 16 pairs and run B * H = 21 (two launches): every
kernel that takes ``BH0``, forward and backward, each backward mode, split-K decoding with
its combine, varlen, the warp-specialised kernels and dropout, must give what one launch
gives, bit for bit (the same programs compute the same tiles; a chunk that read or wrote
another chunk's rows, or drew another pair's dropout numbers, differs: the first run found
rel_attention's dQ kernel placing d(r_r_bias) by the grid's size).

**32-bit offsets**: the kernels address each tensor with int32 offsets; the ops refuse
inputs that span 2**31 elements, but the upstream gradient is autograd's: a view of a
larger tensor is copied first (``kernels._common.int32_addressable``)."""
import pytest
import torch

import ctxfast
from ctxfast import reference
from utils import DEVICE, TRITON_ON_CPU, assert_close

pytestmark = pytest.mark.skipif(not TRITON_ON_CPU and not torch.cuda.is_available(),
                                reason="runs the Triton kernels: needs CUDA or TRITON_INTERPRET=1")

B, H, Tq, Tk, D = 3, 7, 13, 19, 16


def _kernels():
    from ctxfast.kernels import _common, attention, rel_attention
    return _common, attention, rel_attention


def _both(monkeypatch, fn):
    """fn() in one launch per kernel, then in chunks of 16 pairs (B * H = 21: two)."""
    common = _kernels()[0]
    whole = fn()
    with monkeypatch.context() as m:
        m.setattr(common, "MAX_GRID_YZ", 16)
        assert common.bh_chunks(B * H) == [(0, 16), (16, 5)]
        parts = fn()
    return whole, parts


def _assert_same(whole, parts):
    for i, (a, b) in enumerate(zip(whole, parts)):
        assert torch.equal(a, b), f"result {i} differs when launched in chunks: " \
            f"max |diff| {(a.double() - b.double()).abs().max().item():.3g}"


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def test_chunks_cover_every_pair_once():
    common = _kernels()[0]
    assert common.bh_chunks(0) == []
    assert common.bh_chunks(65535) == [(0, 65520), (65520, 15)]
    chunks = common.bh_chunks(200_000)
    assert all(n <= common.MAX_GRID_YZ and s % 16 == 0 for s, n in chunks)
    assert [s for s, _ in chunks] == list(range(0, 200_000, 65520))
    assert sum(n for _, n in chunks) == 200_000


@pytest.mark.parametrize("mode", ["kernel", "atomic"])
@pytest.mark.parametrize("masks", ["causal+padding+dropout", "permutation"])
def test_attention_in_chunks(monkeypatch, masks, mode):
    attn = _kernels()[1]
    monkeypatch.setattr(attn, "DQ_MODE", mode)
    q, k, v = (_rand(B, H, T, D) for T in (Tq, Tk, Tk))
    kw = dict(seed=torch.tensor([11], dtype=torch.int64, device=DEVICE))
    if masks == "permutation":
        kw.update(perm_rank=torch.stack([torch.randperm(Tq, device=DEVICE)
                                         for _ in range(B)]).int(), perm_strict=True)
        k, v = k[:, :, :Tq], v[:, :, :Tq]
    else:
        pad = torch.zeros(B, Tk, dtype=torch.bool, device=DEVICE)
        pad[1, 15:] = True
        pad[2] = True                       # batch 2 (pairs 14-20, both chunks): no key
        kw.update(causal=True, key_padding_mask=pad, dropout_p=0.3)
    do = _rand(B, H, Tq, D)

    def run():
        out, lse = attn.attention_forward(q, k, v, **kw)
        return (out, lse, *attn.attention_backward(do, q, k, v, out, lse, **kw))
    whole, parts = _both(monkeypatch, run)
    _assert_same(whole, parts)
    out, _, dq, dk, dv = parts
    if masks == "permutation":              # the chunked results against float64
        ref_kw = {n: kw[n] for n in ("perm_rank", "perm_strict")}
        l64 = [t.double().requires_grad_() for t in (q, k, v)]
        ref = reference.attention(*l64, perm_rank=ref_kw["perm_rank"], perm_stream="query")
        grads = torch.autograd.grad(ref, l64, do.double())
        for name, ours, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv),
                                    (ref, *grads)):
            assert_close(ours, want, name=f"{name} in chunks")
    else:                                   # rows that see no key: 0, no NaN
        assert not any(t.isnan().any() for t in (out, dq, dk, dv))
        assert all((t[2] == 0).all() for t in (out, dq, dk, dv))


def test_attention_split_k_and_dropout_mask_in_chunks(monkeypatch):
    attn = _kernels()[1]
    q, k, v = _rand(B, H, 2, D), _rand(B, H, 40, D), _rand(B, H, 40, D)
    seed = torch.tensor([5], dtype=torch.int64, device=DEVICE)
    _assert_same(*_both(monkeypatch, lambda: (
        *attn.attention_forward(q, k, v, causal=True, num_splits=3),
        attn.dropout_keep_mask(seed, B, H, Tq, Tk, 0.4))))


def test_attention_varlen_in_chunks(monkeypatch):
    lens = [5, 13, 9]
    cu = torch.tensor([0, 5, 18, 27], dtype=torch.int32, device=DEVICE)
    q, k, v = (_rand(27, H, D).requires_grad_() for _ in range(3))

    def run():
        out = ctxfast.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                       backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    _assert_same(*_both(monkeypatch, run))


def test_warp_specialised_attention_in_chunks(monkeypatch):
    attn = _kernels()[1]
    for kernel in ("fwd", "dkdv", "dq"):
        monkeypatch.setitem(attn.LAUNCH_OVERRIDE, kernel + ":ws", True)
    q, k, v = (_rand(B, H, 16, D, dtype=torch.float16) for _ in range(3))
    do = _rand(B, H, 16, D, dtype=torch.float16)

    def run():
        out, lse = attn.attention_forward(q, k, v, causal=True)
        return (out, lse, *attn.attention_backward(do, q, k, v, out, lse, causal=True))
    _assert_same(*_both(monkeypatch, run))


@pytest.mark.parametrize("mode", ["kernel", "atomic", "gemm", "stored"])
def test_rel_attention_in_chunks(monkeypatch, mode):
    rel = _kernels()[2]
    monkeypatch.setattr(rel, "DR_MODE", mode)
    q, k, v = _rand(B, H, Tq, D), _rand(B, H, Tk, D), _rand(B, H, Tk, D)
    r, u, w = _rand(H, Tk, D), _rand(H, D), _rand(H, D)
    seg = dict(seg_q=torch.randint(0, 2, (B, Tq), device=DEVICE),
               seg_k=torch.randint(0, 2, (B, Tk), device=DEVICE),
               seg_embed=_rand(2, H, D), r_s_bias=_rand(H, D))
    kw = dict(causal=True, dropout_p=0.2, seed=torch.tensor([3], device=DEVICE), **seg)
    do = _rand(B, H, Tq, D)

    def run():
        out, lse = rel.rel_attention_forward(q, k, v, r, u, w, **kw)
        return (out, lse, *rel.rel_attention_backward(do, q, k, v, r, u, w, out, lse, **kw))
    _assert_same(*_both(monkeypatch, run))


def test_rel_attention_split_k_in_chunks(monkeypatch):
    rel = _kernels()[2]
    q, k, v = _rand(B, H, 2, D), _rand(B, H, 40, D), _rand(B, H, 40, D)
    r, u, w = _rand(H, 40, D), _rand(H, D), _rand(H, D)
    _assert_same(*_both(monkeypatch, lambda: rel.rel_attention_forward(
        q, k, v, r, u, w, causal=True, num_splits=3)))


def test_an_upstream_gradient_past_int32_is_copied():
    common = _kernels()[0]
    small = torch.randn(2, 3, 4, 5)[..., ::2]
    assert common.int32_addressable(small) is small
    # the gradient of out [8, 16, 4096, 64] taken from torch.cat([out, x], -1) with x 4096
    # wide: a view spanning 2.18e9 elements (on the meta device: no memory)
    do = torch.empty(8, 16, 4096, 64 + 4096, device="meta")[..., :64]
    got = common.int32_addressable(do)
    assert got.is_contiguous() and got.shape == do.shape
    assert common.int32_addressable(torch.empty(0, device="meta")).numel() == 0
