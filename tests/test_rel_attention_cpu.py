"""The ``cpu`` backend of ctxfast.rel_attention (csrc/cpu/attention.cpp: the position term
from the band of r each tile needs) against ctxfast.reference.rel_attention, forward and the
gradient of q, k, v, r and both biases; tolerance: <= 2x the eager error at the same dtype
against float64, plus a small floor. Tiles are 64 queries x 128 keys, so T = 70, 137, 200
cross their edges. Segments and dropout are not in the cpu kernels: they run on eager by
default and are refused when ``cpu`` is asked for."""
import pytest
import torch

import ctxfast
from ctxfast import reference
from utils import CPU_BACKENDS, rel_err

pytestmark = pytest.mark.skipif("cpu" not in CPU_BACKENDS or not hasattr(
    torch.ops.ctxfast, "rel_attention_fwd_cpu"), reason="ctxfast._C built without rel_attention")

FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NAMES = ["q", "k", "v", "r", "r_w_bias", "r_r_bias"]


def check(B, H, Tq, Tk, D, R=None, dtype=torch.float32, layout="bhtd", **kw):
    R = R or Tk
    mk = lambda *s: torch.randn(*s, dtype=dtype)  # noqa: E731
    if layout == "bthd":
        qkv = [mk(B, T, H, D).transpose(1, 2) for T in (Tq, Tk, Tk)]
    else:
        qkv = [mk(B, H, T, D) for T in (Tq, Tk, Tk)]
    ts = qkv + [mk(H, R, D), mk(H, D), mk(H, D)]
    leaves = [t.detach().clone().requires_grad_(True) for t in ts]
    same = [t.detach().clone().requires_grad_(True) for t in ts]
    l64 = [t.detach().double().requires_grad_(True) for t in ts]
    out = ctxfast.rel_attention(*leaves, backend="cpu", **kw)
    out_same = reference.rel_attention(*same, **kw)
    out64 = reference.rel_attention(*l64, **kw)
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, leaves, do)
    g_same = torch.autograd.grad(out_same, same, do)
    g64 = torch.autograd.grad(out64, l64, do.double())
    for name, ours, s, ref in [("out", out, out_same, out64)] + list(zip(NAMES, g, g_same, g64)):
        assert ours.dtype == dtype, name
        assert not torch.isnan(ours).any(), name
        err, err_same = (ours.double() - ref).norm().item(), (s.double() - ref).norm().item()
        bound = 2 * err_same + FLOOR[dtype] * max(ref.norm().item(), 1.0)
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e} (relative {rel_err(ours, ref):.2e})"
    return out, g


@pytest.mark.parametrize("Tq, mem", [(17, 0), (70, 5), (70, 67), (9, 140), (1, 9), (200, 0)])
def test_transformer_xl_memory(Tq, mem):
    check(2, 2, Tq, Tq + mem, 32)


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
            True, 11, 0, False, 0.25)
    torch.library.opcheck(torch.ops.ctxfast.rel_attention_fwd_cpu.default, args)
    torch._dynamo.reset()

    def fn(q, k, v, r, u, w):
        return ctxfast.rel_attention(q, k, v, r, u, w).sum()   # default on CPU: cpu

    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, r, u, w)
    ref = reference.rel_attention(*(t.detach().double() for t in (q, k, v, r, u, w))).sum()
    assert abs(out.item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item()))


def test_default_and_refusals():
    assert ctxfast._dispatch.resolve("rel_attention", torch.device("cpu")) == "cpu"
    B, H, T, D = 1, 2, 6, 8
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    r, u, w = torch.randn(H, 2 * T, D), torch.randn(H, D), torch.randn(H, D)
    seg = dict(seg_q=torch.zeros(B, T, dtype=torch.long), seg_k=torch.ones(B, T, dtype=torch.long),
               seg_embed=torch.randn(2, H, D), r_s_bias=torch.randn(H, D))
    kw = dict(causal=False, pos_start=T, **seg)
    a = ctxfast.rel_attention(q, k, v, r, u, w, **kw)          # default: eager runs segments
    b = ctxfast.rel_attention(q, k, v, r, u, w, backend="eager", **kw)
    assert torch.equal(a, b)
    with pytest.raises(ctxfast.BackendUnavailable, match="segment term"):
        ctxfast.rel_attention(q, k, v, r, u, w, backend="cpu", **kw)
    with pytest.raises(ctxfast.BackendUnavailable, match="dropout"):
        ctxfast.rel_attention(q, k, v, r[:, :T], u, w, dropout_p=0.1, backend="cpu")
    with pytest.raises(ValueError, match="r too short"):   # the op's own check
        torch.ops.ctxfast.rel_attention_fwd_cpu(q, k, v, r[:, :3], u, w, None, None, True, 5,
                                                0, False, 1.0)
