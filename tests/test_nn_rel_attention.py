"""ctxfast.nn.RelPartialLearnableMultiHeadAttn: the original Transformer-XL layer's
computation (einsum, pad-and-view shift, mask, softmax), written out here in eager
PyTorch on the same weights, agrees with the module on every backend."""
import pytest
import torch
import torch.nn.functional as F

import ctxfast
from ctxfast import reference
from utils import TRITON_ON_CPU, rel_err

BACKENDS = ["eager"] + (["triton"] if TRITON_ON_CPU or torch.cuda.is_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _original_layer(m, w, r, attn_mask, mems):
    """The layer as the Transformer-XL paper's code computes it ([T, B, ...] layouts)."""
    qlen, bsz = w.shape[:2]
    cat = w if mems is None else torch.cat([mems, w], 0)
    heads = m.qkv_net(m.layer_norm(cat) if m.pre_lnorm else cat)
    q, k, v = torch.chunk(heads, 3, -1)
    q = q[-qlen:]
    klen, H, Dh = k.shape[0], m.n_head, m.d_head
    q, k, v = q.view(qlen, bsz, H, Dh), k.view(klen, bsz, H, Dh), v.view(klen, bsz, H, Dh)
    rk = m.r_net(r.reshape(klen, -1)).view(klen, H, Dh)
    ac = torch.einsum("ibnd,jbnd->bnij", q + m.r_w_bias, k)
    bd = reference.rel_shift_pad_view(torch.einsum("ibnd,jnd->bnij", q + m.r_r_bias, rk))
    score = (ac + bd) * m.scale
    if attn_mask is not None:
        score = score.masked_fill(attn_mask[None, None], float("-inf"))
    prob = F.softmax(score, -1)
    vec = torch.einsum("bnij,jbnd->ibnd", prob, v).reshape(qlen, bsz, H * Dh)
    out = m.o_net(vec)
    return w + out if m.pre_lnorm else m.layer_norm(w + out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pre_lnorm", [False, True])
@pytest.mark.parametrize("mlen", [0, 6])
def test_matches_original_layer(backend, pre_lnorm, mlen):
    torch.manual_seed(1)
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.0, pre_lnorm=pre_lnorm,
                                                    backend=backend).to(DEVICE).eval()
    qlen, bsz = 9, 3
    klen = qlen + mlen
    w = torch.randn(qlen, bsz, 32, device=DEVICE, requires_grad=True)
    mems = torch.randn(mlen, bsz, 32, device=DEVICE) if mlen else None
    r = torch.randn(klen, 1, 32, device=DEVICE)
    mask = torch.ones(qlen, klen, device=DEVICE).triu(1 + mlen).bool()
    out = m(w, r, attn_mask=mask, mems=mems)
    w2 = w.detach().clone().requires_grad_(True)
    ref = _original_layer(m, w2, r, mask, mems)
    assert rel_err(out, ref) < 1e-5
    g = torch.randn_like(out)
    params = list(m.parameters())
    grads = torch.autograd.grad(out, [w] + params, g)
    ref_grads = torch.autograd.grad(ref, [w2] + params, g)
    for (name, _), a, b in zip([("w", None)] + list(m.named_parameters()), grads, ref_grads):
        assert rel_err(a, b) < 1e-5, name


def test_parameter_names_are_the_original_ones():
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.1)
    assert set(m.state_dict()) == {"qkv_net.weight", "o_net.weight", "r_net.weight",
                                   "layer_norm.weight", "layer_norm.bias", "r_w_bias", "r_r_bias"}


def test_same_length_mask_is_refused():
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 16, 8, dropout=0.0)
    w, r = torch.randn(4, 1, 16), torch.randn(4, 16)
    mask = torch.ones(4, 4).triu(1).bool() | torch.ones(4, 4).tril(-2).bool()
    with pytest.raises(NotImplementedError, match="same_length"):
        m(w, r, attn_mask=mask)
