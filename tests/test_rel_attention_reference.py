"""The relative-attention reference itself: against the original Transformer-XL
formulation (pad-and-view shift) and against the papers' equations element by element."""
import math

import pytest
import torch

from ctxfast import reference


def _inputs(B, H, Tq, Tk, D, R, dtype=torch.float64):
    q = torch.randn(B, H, Tq, D, dtype=dtype)
    k, v = torch.randn(B, H, Tk, D, dtype=dtype), torch.randn(B, H, Tk, D, dtype=dtype)
    r = torch.randn(H, R, D, dtype=dtype)
    u, w = torch.randn(H, D, dtype=dtype), torch.randn(H, D, dtype=dtype)
    return q, k, v, r, u, w


@pytest.mark.parametrize("Tq, mem", [(7, 0), (7, 3), (7, 7), (5, 12), (1, 9)])
def test_matches_original_transformer_xl(Tq, mem):
    """Memory of 0, shorter, equal and longer than Tq; Tq = 1."""
    Tk = Tq + mem
    q, k, v, r, u, w = _inputs(2, 3, Tq, Tk, 8, Tk)
    ours = reference.rel_attention(q, k, v, r, u, w)
    orig = reference.rel_attention_original(q, k, v, r, u, w)
    assert torch.allclose(ours, orig, rtol=1e-12, atol=1e-12)
    for window in (1, 4, Tk):                 # same_length: the original's tril part
        ours = reference.rel_attention(q, k, v, r, u, w, window=window)
        orig = reference.rel_attention_original(q, k, v, r, u, w, window=window)
        assert torch.allclose(ours, orig, rtol=1e-12, atol=1e-12), window


def _loop(q, k, v, r, u, w, *, causal, pos_start, seg=None, rank=None, stream="content"):
    """The equations, one score at a time (tiny shapes)."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    mem = Tk - Tq
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                scores, vals = [], []
                for j in range(Tk):
                    if causal and j > i + mem:
                        continue
                    if rank is not None and j >= mem:
                        rt, ri = rank[b, j - mem], rank[b, i]
                        if (stream == "query" and not rt < ri) or (stream == "content" and not rt <= ri):
                            continue
                    m = pos_start - (mem + i - j)
                    a = (q[b, h, i] + u[h]) @ k[b, h, j] + (q[b, h, i] + w[h]) @ r[h, m]
                    if seg is not None:
                        seg_q, seg_k, seg_embed, r_s_bias = seg
                        s = int(seg_q[b, i] != seg_k[b, j])
                        a = a + (q[b, h, i] + r_s_bias[h]) @ seg_embed[s, h]
                    scores.append(a / math.sqrt(D))
                    vals.append(v[b, h, j])
                if scores:
                    p = torch.softmax(torch.stack(scores), 0)
                    out[b, h, i] = (p[:, None] * torch.stack(vals)).sum(0)
    return out


def test_matches_equations_transformer_xl():
    q, k, v, r, u, w = _inputs(1, 2, 4, 7, 4, 7)
    assert torch.allclose(reference.rel_attention(q, k, v, r, u, w),
                          _loop(q, k, v, r, u, w, causal=True, pos_start=6), atol=1e-12)


@pytest.mark.parametrize("stream", ["content", "query"])
def test_matches_equations_xlnet(stream):
    """Bidirectional pos_start = Tk, R = Tk + Tq; permutation ranks, memory and segments."""
    Tq, Tk = 4, 6
    q, k, v, r, u, w = _inputs(2, 2, Tq, Tk, 4, Tk + Tq)
    seg_q, seg_k = torch.randint(0, 2, (2, Tq)), torch.randint(0, 2, (2, Tk))
    seg_embed, r_s_bias = torch.randn(2, 2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    rank = torch.stack([torch.randperm(Tq) for _ in range(2)])
    ours = reference.rel_attention(q, k, v, r, u, w, causal=False, pos_start=Tk, perm_rank=rank,
                                   perm_stream=stream, seg_q=seg_q, seg_k=seg_k,
                                   seg_embed=seg_embed, r_s_bias=r_s_bias)
    ref = _loop(q, k, v, r, u, w, causal=False, pos_start=Tk, seg=(seg_q, seg_k, seg_embed, r_s_bias),
                rank=rank, stream=stream)
    assert torch.allclose(ours, ref, atol=1e-12)


def test_gradcheck_every_input():
    Tq, Tk = 3, 5
    q, k, v, r, u, w = (t.requires_grad_() for t in _inputs(1, 2, Tq, Tk, 4, Tk + Tq))
    seg_embed = torch.randn(2, 2, 4, dtype=torch.float64, requires_grad=True)
    r_s_bias = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    seg_q, seg_k = torch.randint(0, 2, (1, Tq)), torch.randint(0, 2, (1, Tk))

    def f(q, k, v, r, u, w, se, rsb):
        return reference.rel_attention(q, k, v, r, u, w, causal=False, pos_start=Tk, seg_q=seg_q,
                                       seg_k=seg_k, seg_embed=se, r_s_bias=rsb)
    assert torch.autograd.gradcheck(f, (q, k, v, r, u, w, seg_embed, r_s_bias))
