"""kernels/rel_attention.py (forward; the backward and the public op are still to come)
against ctxfast.reference.rel_attention: the shift done in the kernel must equal direct
indexing by distance."""
import pytest
import torch

from ctxfast import reference
from test_attention import DEVICE, needs_triton
from utils import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _run(B, H, Tq, Tk, D, R=None, dtype=torch.float32, **kw):
    from ctxfast.kernels.rel_attention import rel_attention_forward
    R = R or Tk
    mk = lambda *s: torch.randn(*s, dtype=dtype, device=DEVICE)  # noqa: E731
    q, k, v, r = mk(B, H, Tq, D), mk(B, H, Tk, D), mk(B, H, Tk, D), mk(H, R, D)
    u, w = mk(H, D), mk(H, D)
    stream = kw.pop("perm_stream", "content")
    out, lse = rel_attention_forward(q, k, v, r, u, w, perm_strict=stream == "query", **kw)
    f64 = {a: (b.double() if torch.is_tensor(b) and b.is_floating_point() else b)
           for a, b in kw.items()}
    ref = reference.rel_attention(*(t.double() for t in (q, k, v, r, u, w)),
                                  perm_stream=stream, **f64)
    assert not torch.isnan(out).any()
    err = rel_err(out, ref)
    assert err < TOL[dtype], err
    return out


@needs_triton
@pytest.mark.parametrize("Tq, mem", [(17, 0), (17, 5), (17, 17), (9, 40), (1, 9), (33, 31)])
def test_transformer_xl_memory(Tq, mem):
    """Memory of 0, shorter, equal and longer than Tq; Tq = 1; odd sizes."""
    _run(2, 2, Tq, Tq + mem, 32)


@needs_triton
@pytest.mark.parametrize("D", [16, 32, 64, 96, 128])
def test_head_dims(D):
    _run(1, 2, 19, 27, D)


@needs_triton
@pytest.mark.parametrize("stream", ["content", "query"])
def test_xlnet_bidirectional_perm_segments_padding(stream):
    B, Tq, Tk = 2, 19, 30
    kpm = torch.rand(B, Tk, device=DEVICE) < 0.2
    _run(B, 2, Tq, Tk, 32, R=Tk + Tq, causal=False, pos_start=Tk, key_padding_mask=kpm,
         perm_rank=torch.stack([torch.randperm(Tq) for _ in range(B)]).to(DEVICE),
         perm_stream=stream, seg_q=torch.randint(0, 2, (B, Tq), device=DEVICE),
         seg_k=torch.randint(0, 2, (B, Tk), device=DEVICE),
         seg_embed=torch.randn(2, 2, 32, device=DEVICE), r_s_bias=torch.randn(2, 32, device=DEVICE))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_dtypes(dtype):
    _run(1, 2, 17, 40, 64, dtype=dtype)


@needs_triton
def test_rows_that_see_no_key_are_zero():
    kpm = torch.zeros(2, 12, dtype=torch.bool, device=DEVICE)
    kpm[0] = True
    out = _run(2, 2, 12, 12, 16, key_padding_mask=kpm)
    assert (out[0] == 0).all()
