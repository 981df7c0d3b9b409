"""ctxfast.nn.RelPartialLearnableMultiHeadAttn: the original Transformer-XL layer's
computation (einsum, pad-and-view shift, mask, softmax), written out here in eager
PyTorch on the same weights, agrees with the module on every backend."""
import pytest
import torch
import torch.nn.functional as F

import ctxfast
from ctxfast import reference
from utils import DEVICE, TRITON_ON_CPU, owns_storage, rel_err

BACKENDS = ["eager"] + (["triton"] if TRITON_ON_CPU or torch.cuda.is_available() else [])


def _original_layer(m, w, r, attn_mask, mems, scale=None):
    """The layer as the Transformer-XL paper's code computes it ([T, B, ...] layouts);
    ``scale`` of the scores: m.scale unless given; the output dropout is m.drop."""
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
    score = (ac + bd) * (m.scale if scale is None else scale)
    if attn_mask is not None:
        score = score.masked_fill(attn_mask[None, None], float("-inf"))
    prob = F.softmax(score, -1)
    vec = torch.einsum("bnij,jbnd->ibnd", prob, v).reshape(qlen, bsz, H * Dh)
    out = m.drop(m.o_net(vec))
    return w + out if m.pre_lnorm else m.layer_norm(w + out)


def _mask(qlen, mlen, mem_len=None):
    """The original code's mask: causal, plus the same_length part when mem_len is given."""
    klen = qlen + mlen
    ones = torch.ones(qlen, klen, device=DEVICE)
    mask = ones.triu(1 + mlen)
    if mem_len is not None and klen > mem_len:
        mask = mask + ones.tril(-(qlen - (klen - mem_len)))
    return mask.bool()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pre_lnorm", [False, True])
@pytest.mark.parametrize("mlen, mem_len", [(0, None), (6, None), (6, 7), (0, 4)])
def test_matches_original_layer(backend, pre_lnorm, mlen, mem_len):
    """Causal mask, with memory and with the same_length part (mem_len given: a window)."""
    torch.manual_seed(1)
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.0, pre_lnorm=pre_lnorm,
                                                    backend=backend).to(DEVICE).eval()
    qlen, bsz = 9, 3
    klen = qlen + mlen
    w = torch.randn(qlen, bsz, 32, device=DEVICE, requires_grad=True)
    mems = torch.randn(mlen, bsz, 32, device=DEVICE) if mlen else None
    r = torch.randn(klen, 1, 32, device=DEVICE)
    mask = _mask(qlen, mlen, mem_len)
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


def test_same_length_mask_is_a_window():
    from ctxfast.nn.rel_attention import _window_of
    for qlen, mlen, mem_len in [(4, 0, 2), (5, 3, 4), (3, 9, 9), (6, 2, 1)]:
        assert _window_of(_mask(qlen, mlen, mem_len), qlen, qlen + mlen) == mem_len
    assert _window_of(_mask(4, 3), 4, 7) is None


def _unmasked_by_distance(m, w, r, mems):
    """No mask, every query sees every key: query i and key j at distance d = mlen + i - j
    (negative for the keys after i) use row klen - 1 - d of r, indexed directly."""
    qlen, bsz = w.shape[:2]
    cat = w if mems is None else torch.cat([mems, w], 0)
    q, k, v = torch.chunk(m.qkv_net(m.layer_norm(cat) if m.pre_lnorm else cat), 3, -1)
    klen, H, Dh = k.shape[0], m.n_head, m.d_head
    q = q[-qlen:].view(qlen, bsz, H, Dh)
    k, v = k.view(klen, bsz, H, Dh), v.view(klen, bsz, H, Dh)
    rk = m.r_net(r.reshape(r.shape[0], -1)).view(-1, H, Dh)
    i, j = torch.arange(qlen, device=w.device)[:, None], torch.arange(klen, device=w.device)
    rows = rk[klen - 1 - (klen - qlen + i - j)]                           # [qlen, klen, H, Dh]
    ac = torch.einsum("ibnd,jbnd->bnij", q + m.r_w_bias, k)
    bd = torch.einsum("ibnd,ijnd->bnij", q + m.r_r_bias, rows)
    prob = F.softmax((ac + bd) * m.scale, -1)
    out = m.o_net(torch.einsum("bnij,jbnd->ibnd", prob, v).reshape(qlen, bsz, H * Dh))
    return w + out if m.pre_lnorm else m.layer_norm(w + out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mlen", [0, 3])
def test_no_mask_needs_the_negative_distances_in_r(backend, mlen):
    """attn_mask=None: with qlen > 1 the keys after a query are at negative distances,
    which r's klen rows do not encode (the original code's rel_shift wraps them onto other
    rows): refused with the reason, and computed by distance when r carries qlen - 1 more
    rows (distances down to 1 - qlen). qlen = 1 needs none: klen rows, the causal result."""
    torch.manual_seed(2)
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.0,
                                                    backend=backend).to(DEVICE).eval()
    qlen, bsz = 5, 2
    klen = qlen + mlen
    w = torch.randn(qlen, bsz, 32, device=DEVICE)
    mems = torch.randn(mlen, bsz, 32, device=DEVICE) if mlen else None
    with pytest.raises(ValueError, match=rf"attn_mask=None .* qlen = 5 > 1 .* klen \+ qlen - 1 "
                                         rf"= {klen + 4} rows"):
        m(w, torch.randn(klen, 32, device=DEVICE), mems=mems)
    r = torch.randn(klen + qlen - 1, 1, 32, device=DEVICE)
    out = m(w, r, mems=mems)
    assert rel_err(out, _unmasked_by_distance(m, w, r, mems)) < 1e-5
    causal = m(w, r, attn_mask=_mask(qlen, mlen), mems=mems)       # the extra rows: unused
    assert rel_err(causal, _original_layer(m, w, r[:klen], _mask(qlen, mlen), mems)) < 1e-5
    with pytest.raises(ValueError, match=rf"r must have klen = {klen} rows .* got {klen + 1}"):
        m(w, r[:klen + 1], attn_mask=_mask(qlen, mlen), mems=mems)
    one = m(w[:1], r[:mlen + 1], mems=mems)                         # qlen 1: nothing after it
    assert rel_err(one, _original_layer(m, w[:1], r[:mlen + 1], None, mems)) < 1e-5


@pytest.mark.parametrize("mask", ["not-causal", "diagonal-masked", "ragged", "shape"])
def test_other_masks_are_refused(mask):
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 16, 8, dropout=0.0)
    w, r = torch.randn(4, 1, 16), torch.randn(4, 16)
    causal = torch.ones(4, 4).triu(1)
    ragged = causal.clone()
    ragged[2, 0] = 1                          # distance 2 masked in row 2, not in row 3
    bad = {"not-causal": torch.ones(4, 4).triu(2), "diagonal-masked": causal + torch.eye(4),
           "ragged": ragged, "shape": torch.ones(4, 5).triu(1)}[mask].bool()
    with pytest.raises(NotImplementedError, match="same_length part"):
        m(w, r, attn_mask=bad)


def test_original_calling_convention_and_strict_load_of_an_original_layer():
    """The original layer owns no biases (the model passes them to forward): built with
    own_biases=False, an original layer's state_dict loads with strict=True and
    forward(w, r, r_w_bias, r_r_bias, attn_mask, mems) equals the original computation."""
    own = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.0).to(DEVICE).eval()
    sd = {k: v for k, v in own.state_dict().items() if k not in ("r_w_bias", "r_r_bias")}
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.0, own_biases=False)
    m = m.to(DEVICE).eval()
    m.load_state_dict(sd, strict=True)                   # the original layer's parameters
    assert "r_w_bias" not in m.state_dict()
    qlen, mlen, bsz = 5, 3, 2
    w = torch.randn(qlen, bsz, 32, device=DEVICE)
    mems = torch.randn(mlen, bsz, 32, device=DEVICE)
    r = torch.randn(qlen + mlen, 1, 32, device=DEVICE)
    mask = _mask(qlen, mlen)
    out = m(w, r, own.r_w_bias, own.r_r_bias, mask, mems)          # positional, as the original
    kw = m(w, r, r_w_bias=own.r_w_bias, r_r_bias=own.r_r_bias, attn_mask=mask, mems=mems)
    ref = _original_layer(own, w, r, mask, mems)
    assert rel_err(out, ref) < 1e-5 and torch.equal(out, kw)
    assert torch.equal(out, own(w, r, mask, mems))                # own biases, same numbers
    with pytest.raises(ValueError, match="own_biases=False, so forward needs r_w_bias"):
        m(w, r, mask, mems)
    with pytest.raises(ValueError, match="has its own r_w_bias"):
        own(w, r, own.r_w_bias, own.r_r_bias, mask, mems)
    with pytest.raises(ValueError, match=r"r_r_bias must have shape \[n_head, d_head\] = \[2, 16\]"):
        m(w, r, own.r_w_bias, own.r_r_bias[:1], mask, mems)


def test_one_mask_is_read_once_for_every_layer(monkeypatch):
    # Reading the mask's values syncs a GPU: the layers of one forward share one mask
    # (the original code builds dec_attn_mask once), so it is read once, and again only
    # for another mask, the same one modified in place, or other lengths.
    from ctxfast.nn import rel_attention as mod
    reads = []
    real = mod._read_window
    monkeypatch.setattr(mod, "_read_window", lambda *a: reads.append(a) or real(*a))
    mask = _mask(4, 3)
    for _ in range(3):
        assert mod._window_of(mask, 4, 7) is None
    assert len(reads) == 1
    other = _mask(4, 3, 5)
    assert mod._window_of(other, 4, 7) == 5 and len(reads) == 2
    other[0, 0] = other[0, 0]                   # in place: the version counter moves on
    assert mod._window_of(other, 4, 7) == 5 and len(reads) == 3
    with pytest.raises(NotImplementedError):
        other[0, 0] = ~other[0, 0]              # no longer a mask of the original code
        mod._window_of(other, 4, 7)
    assert len(reads) == 4


def test_a_masked_call_under_inference_mode():
    # an inference tensor has no version counter: the mask's cache must not ask for it
    # (every masked call under torch.inference_mode raised "Inference tensors do not track
    # version counter"); the output equals the one under no_grad
    torch.manual_seed(0)
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.0).eval()
    w, r, mems = torch.randn(4, 2, 32), torch.randn(7, 1, 32), torch.randn(3, 2, 32)
    with torch.no_grad():
        want = m(w, r, attn_mask=_mask(4, 3, 5), mems=mems)
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(m(w, r, attn_mask=_mask(4, 3, 5), mems=mems), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_dropout_is_the_original_module(backend):
    # the original layer keeps its attention dropout as ``self.dropatt`` (an nn.Dropout)
    # and its train.py sets ``dropatt.p`` to change the rate: the rate must follow it
    torch.manual_seed(0)
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.0, dropatt=0.5,
                                                     backend=backend).to(DEVICE)
    w, r = torch.randn(5, 2, 32, device=DEVICE), torch.randn(5, 1, 32, device=DEVICE)
    mask = _mask(5, 0)

    def run(seed):
        torch.manual_seed(seed)
        return m(w, r, attn_mask=mask)
    assert not torch.equal(run(1), run(2)), "dropatt 0.5 had no effect (vacuous)"
    m.dropatt.p = 0.0
    assert torch.equal(run(1), run(2))
    with torch.no_grad():
        assert torch.equal(run(1), m.eval()(w, r, attn_mask=mask))


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_projected_for_the_current_rows_only(backend):
    # the memory rows' queries are never used: the layer projects q for w's rows only
    # (autograd kept the memory rows' q alive too: 0.87 of 5.13 MiB saved at qlen 64,
    # mlen 448); the result is the original's one GEMM over every row
    torch.manual_seed(0)
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.0,
                                                     backend=backend).to(DEVICE)
    w, mems = torch.randn(4, 2, 32, device=DEVICE), torch.randn(9, 2, 32, device=DEVICE)
    r = torch.randn(13, 1, 32, device=DEVICE)
    x = torch.cat([mems, w], 0)
    got = m._project_qkv(x, 4, split=backend != "eager")
    want = torch.chunk(m.qkv_net(x), 3, dim=-1)
    for a, b, rows in zip(got, (want[0][-4:], want[1], want[2]), (4, 13, 13)):
        assert a.shape == (rows, 2, 32) and rel_err(a, b) < 1e-6
    if backend != "eager":
        assert owns_storage(got[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_are_scaled_by_one_over_sqrt_d_head(backend):
    # the original's scale is 1 / sqrt(d_head), whatever d_model and n_head (here all differ)
    torch.manual_seed(3)
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(3, 20, 8, dropout=0.0,
                                                     backend=backend).to(DEVICE).eval()
    w, r = torch.randn(5, 2, 20, device=DEVICE), torch.randn(7, 1, 20, device=DEVICE)
    mems, mask = torch.randn(2, 2, 20, device=DEVICE), _mask(5, 2)
    out = m(w, r, attn_mask=mask, mems=mems)
    ref = _original_layer(m, w, r, mask, mems, scale=8 ** -0.5)
    assert rel_err(out, ref) < 1e-5, f"scale 1/sqrt(d_head): {rel_err(out, ref)}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_dropout_in_training(backend):
    """The original layer drops the o_net output (``self.drop``) in training: under one seed
    the module's output is the original computation's (dropatt 0 draws nothing), and it
    differs from the eval output (the dropout acts)."""
    torch.manual_seed(0)
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.5,
                                                     backend=backend).to(DEVICE).train()
    w, r = torch.randn(5, 2, 32, device=DEVICE), torch.randn(8, 1, 32, device=DEVICE)
    mems, mask = torch.randn(3, 2, 32, device=DEVICE), _mask(5, 3)
    torch.manual_seed(7)
    out = m(w, r, attn_mask=mask, mems=mems)
    torch.manual_seed(7)
    ref = _original_layer(m, w, r, mask, mems)
    assert rel_err(out, ref) < 1e-5, f"training, output dropout: {rel_err(out, ref)}"
    m.eval()
    assert rel_err(out, m(w, r, attn_mask=mask, mems=mems)) > 1e-2, "dropout 0.5 had no effect"


def test_biases_given_to_the_constructor_are_the_layers():
    # own_biases with r_w_bias / r_r_bias given (the model's initial values): each becomes
    # the parameter of its name, as given (not re-initialised, not swapped)
    rw, rr = torch.randn(2, 16), torch.randn(2, 16)
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.0, r_w_bias=rw.clone(),
                                                     r_r_bias=rr.clone())
    assert torch.equal(m.r_w_bias, rw) and torch.equal(m.r_r_bias, rr)
    # one given: it is kept, the other drawn (N(0, 0.02^2)), never zeros nor the given's
    for given in ("r_w_bias", "r_r_bias"):
        t = torch.ones(2, 16)
        m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, dropout=0.0, **{given: t})
        other = m.r_r_bias if given == "r_w_bias" else m.r_w_bias
        assert torch.equal(getattr(m, given), torch.ones(2, 16)), f"{given} re-drawn"
        assert torch.equal(t, torch.ones(2, 16)), f"the caller's {given} overwritten"
        assert 0.005 < other.std().item() < 0.05, f"the other bias not drawn: {other}"
    with pytest.raises(ValueError, match=r"r_r_bias must have shape \[n_head, d_head\] = "
                                         r"\[2, 16\], got \(16,\)"):
        ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 32, 16, 0.0, r_r_bias=torch.ones(16))


def test_the_original_codes_three_dim_mask():
    # the original model passes dec_attn_mask[:, :, None] ([qlen, klen, 1]) to its layers:
    # read as the [qlen, klen] mask (causal, and causal + same_length: a window)
    torch.manual_seed(4)
    m = ctxfast.nn.RelPartialLearnableMultiHeadAttn(2, 16, 8, dropout=0.0).to(DEVICE).eval()
    w, r = torch.randn(4, 2, 16, device=DEVICE), torch.randn(7, 1, 16, device=DEVICE)
    mems = torch.randn(3, 2, 16, device=DEVICE)
    for mem_len in (None, 5):
        mask = _mask(4, 3, mem_len)
        got = m(w, r, attn_mask=mask[:, :, None], mems=mems)
        assert torch.equal(got, m(w, r, attn_mask=mask, mems=mems)), f"mem_len={mem_len}"
