"""Every op on every backend under torch.compile(fullgraph=True, dynamic=True): sizes and
the float arguments (scales, dropout probabilities, clips) are traced as symbols, as a
training script compiled once for all batch shapes traces them. Two calls of different
sizes through one compiled function give the uncompiled call's outputs and gradients.
A custom op's float argument is then specialised by torch (another value recompiles).
The eager backends broke here: ``math.isinf`` of a traced clip, and
``torch.rand(..., generator=None)`` of traced sizes."""
import pytest
import torch

import ctxfast
from ctxfast import _dispatch
from utils import DEVICE, assert_close

BACKENDS = {op: [b for b in _dispatch.registered_ops()[op]
                 if ctxfast.why_unavailable(b, DEVICE) is None]
            for op in ("attention", "rel_attention", "lstm")}


def _randn(*shape):
    return torch.randn(*shape, device=DEVICE, requires_grad=True)


def _check(fn, calls):
    """fn(*args) -> a scalar loss of leaves; each call: (leaves, args). Compiled once."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for seed, (leaves, args) in enumerate(calls):
        torch.manual_seed(seed)      # dropout: the same draws (aot_eager keeps torch's stream)
        loss = compiled(*args)
        grads = torch.autograd.grad(loss, leaves)
        torch.manual_seed(seed)
        ref = fn(*args)
        ref_grads = torch.autograd.grad(ref, leaves)
        assert_close(loss.detach(), ref.detach(), name="loss")
        for i, (g, r) in enumerate(zip(grads, ref_grads)):
            assert_close(g, r, name=f"grad {i}")


@pytest.mark.parametrize("backend", BACKENDS["attention"])
def test_attention(backend):
    def fn(q, k, v, scale, p):
        out = ctxfast.attention(q, k, v, causal=True, scale=scale, dropout_p=p, backend=backend)
        return out.square().sum()

    calls = []
    for T, scale, p in ((7, 0.3, 0.1), (9, 0.3, 0.1)):
        q, k, v = _randn(2, 2, T, 16), _randn(2, 2, T + 3, 16), _randn(2, 2, T + 3, 16)
        calls.append(((q, k, v), (q, k, v, scale, p)))
    _check(fn, calls)


@pytest.mark.parametrize("backend", BACKENDS["rel_attention"])
def test_rel_attention(backend):
    def fn(q, k, v, r, rw, rr, scale, p):
        out = ctxfast.rel_attention(q, k, v, r, rw, rr, scale=scale, dropout_p=p,
                                    backend=backend)
        return out.square().sum()

    calls = []
    for T, scale, p in ((6, 0.3, 0.1), (8, 0.3, 0.1)):
        q, k, v = _randn(2, 2, T, 16), _randn(2, 2, T + 2, 16), _randn(2, 2, T + 2, 16)
        r, rw, rr = _randn(2, T + 2, 16), _randn(2, 16), _randn(2, 16)
        calls.append(((q, k, v, r, rw, rr), (q, k, v, r, rw, rr, scale, p)))
    _check(fn, calls)


@pytest.mark.parametrize("backend", BACKENDS["lstm"])
def test_lstm(backend):
    H, P, I = 8, 4, 5

    def fn(x, w_ih, w_hh, w_hr, b, mask, cell_clip, proj_clip):
        out, (h, c) = ctxfast.lstm(x, None, w_ih, w_hh, b, b, w_hr, weight_mask=mask,
                                   weight_dropout=0.3, cell_clip=cell_clip,
                                   proj_clip=proj_clip, backend=backend)
        return out.square().sum() + h.sum() + c.sum()

    calls = []
    # the eager backend's loop over steps specialises on T: another batch, not length
    for T, B, clips in ((5, 2, (0.5, 0.3)), (5, 3, (0.5, 0.3))):
        x, w_ih, w_hh = _randn(T, B, I), _randn(4 * H, I), _randn(4 * H, P)
        w_hr, b = _randn(P, H), _randn(4 * H)
        mask = torch.rand(4 * H, P, device=DEVICE) > 0.3
        calls.append(((x, w_ih, w_hh, w_hr, b), (x, w_ih, w_hh, w_hr, b, mask, *clips)))
    _check(fn, calls)


@pytest.mark.parametrize("backend", BACKENDS["rel_attention"])
def test_rel_attention_segments_under_inductor(backend):
    """XLNet's segment term under torch.compile with inductor (which checks each custom
    op's output strides against its fake): d_seg_embed came out of an einsum with strides of
    its own, and the backward failed inductor's check ("expected ... stride 16==32"); now
    contiguous, as the fakes declare. Gradients of every input as eager's."""
    torch.manual_seed(0)
    B, H, T, D = 1, 2, 6, 16
    ts = [_randn(B, H, T, D), _randn(B, H, T, D), _randn(B, H, T, D), _randn(H, 2 * T, D),
          _randn(H, D), _randn(H, D), _randn(2, H, D), _randn(H, D)]
    seg = torch.randint(0, 2, (B, T), device=DEVICE)

    def fn(q, k, v, r, rw, rr, se, rs):
        return ctxfast.rel_attention(q, k, v, r, rw, rr, causal=False, pos_start=T,
                                     seg_q=seg, seg_k=seg, seg_embed=se, r_s_bias=rs,
                                     backend=backend).square().sum()

    torch._dynamo.reset()
    try:
        got = torch.autograd.grad(torch.compile(fn, fullgraph=True)(*ts), ts)
    finally:
        torch._dynamo.reset()
    want = torch.autograd.grad(fn(*ts), ts)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, name=f"grad {i}")


@pytest.mark.parametrize("backend", BACKENDS["rel_attention"])
def test_rel_attention_key_lengths_share_one_graph(backend):
    """Transformer-XL's default pos_start (Tk - 1) traced from the key length: sequences of
    5 lengths under dynamic=True compile one graph after the first (the cpu op's schema
    took ``int pos_start``, so each length specialised a graph of its own: fullgraph hit
    the recompile limit at the 9th length)."""
    from torch._dynamo.testing import CompileCounter

    def fn(q, k, v, r, rw, rr):
        return ctxfast.rel_attention(q, k, v, r, rw, rr, backend=backend).square().sum()

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    try:
        for T in (5, 6, 9, 12, 7):
            ts = [_randn(1, 2, T, 16), _randn(1, 2, T, 16), _randn(1, 2, T, 16),
                  _randn(2, T, 16), _randn(2, 16), _randn(2, 16)]
            assert_close(compiled(*ts), fn(*ts), name=f"T={T}")
    finally:
        torch._dynamo.reset()
    assert counter.frame_count <= 2, counter.frame_count
