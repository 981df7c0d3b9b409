"""ctxfast.nn.MultiheadAttention is a drop-in for torch.nn.MultiheadAttention: the same
state_dict loads, and outputs, weights and gradients agree."""
import re

import pytest
import torch
from torch import nn

import ctxfast
from utils import DEVICE, TRITON_ON_CPU, rel_err

BACKENDS = ["eager"] + (["triton"] if TRITON_ON_CPU or torch.cuda.is_available() else [])


def _pair(backend, **kw):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(**kw).to(DEVICE).eval()
    ours = ctxfast.nn.MultiheadAttention(**kw, backend=backend).to(DEVICE).eval()
    missing = ours.load_state_dict(ref.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys
    return ref, ours


def _compare(ref, ours, args, kwargs, tol=2e-5):
    leaves_r = [a.detach().clone().requires_grad_(True) for a in args]
    leaves_o = [a.detach().clone().requires_grad_(True) for a in args]
    out_r, w_r = ref(*leaves_r, **kwargs)
    out_o, w_o = ours(*leaves_o, **kwargs)
    assert rel_err(out_o, out_r) < tol, rel_err(out_o, out_r)
    if w_r is None:
        assert w_o is None
    else:
        assert w_o.shape == w_r.shape and rel_err(w_o, w_r) < tol
    g = torch.randn_like(out_r)
    grads_r = torch.autograd.grad(out_r, leaves_r + list(ref.parameters()), g, allow_unused=True)
    grads_o = torch.autograd.grad(out_o, leaves_o + list(ours.parameters()), g, allow_unused=True)
    for a, b in zip(grads_o, grads_r):
        if b is None:
            assert a is None or (a == 0).all()
        else:
            assert rel_err(a, b) < tol, rel_err(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_self_attention_with_padding(backend, batch_first, need_weights):
    ref, ours = _pair(backend, embed_dim=32, num_heads=2, batch_first=batch_first)
    B, T = 3, 11
    x = torch.randn((B, T, 32) if batch_first else (T, B, 32), device=DEVICE)
    kpm = torch.rand(B, T, device=DEVICE) < 0.3
    kpm[:, 0] = False
    _compare(ref, ours, (x, x, x), dict(key_padding_mask=kpm, need_weights=need_weights))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_padding_mask_of_zeros_and_minus_inf(backend):
    """torch adds a float key_padding_mask to the scores: one of 0 and -inf is the bool mask
    (-inf = padding), against torch's module; other values (an additive bias) and
    integer masks are refused by name."""
    ref, ours = _pair(backend, embed_dim=32, num_heads=2, batch_first=True)
    B, T = 3, 9
    x = torch.randn(B, T, 32, device=DEVICE)
    pad = torch.rand(B, T, device=DEVICE) < 0.3
    pad[:, 0] = False
    fmask = torch.zeros(B, T, device=DEVICE).masked_fill(pad, float("-inf"))
    _compare(ref, ours, (x, x, x), dict(key_padding_mask=fmask, need_weights=True))
    with torch.no_grad():
        assert torch.equal(ours(x, x, x, key_padding_mask=fmask, need_weights=False)[0],
                           ours(x, x, x, key_padding_mask=pad, need_weights=False)[0])
        with pytest.raises(ValueError, match="float key_padding_mask must hold only 0 and"):
            ours(x, x, x, key_padding_mask=fmask.masked_fill(~pad, -1.0))
        with pytest.raises(TypeError, match="key_padding_mask must be bool .* got torch.int64"):
            ours(x, x, x, key_padding_mask=pad.long())


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal(backend):
    ref, ours = _pair(backend, embed_dim=32, num_heads=4, batch_first=True)
    x = torch.randn(2, 13, 32, device=DEVICE)
    causal = nn.Transformer.generate_square_subsequent_mask(13, device=DEVICE)
    _compare(ref, ours, (x, x, x), dict(attn_mask=causal, is_causal=True, need_weights=False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_kdim_vdim_bias_kv_zero_attn(backend):
    ref, ours = _pair(backend, embed_dim=32, num_heads=2, kdim=24, vdim=20, add_bias_kv=True,
                      add_zero_attn=True)
    q = torch.randn(7, 2, 32, device=DEVICE)
    k = torch.randn(9, 2, 24, device=DEVICE)
    v = torch.randn(9, 2, 20, device=DEVICE)
    kpm = torch.zeros(2, 9, dtype=torch.bool, device=DEVICE)
    kpm[1, 5:] = True
    _compare(ref, ours, (q, k, v), dict(key_padding_mask=kpm, need_weights=True,
                                        average_attn_weights=False))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra", ["bias_kv", "zero_attn", "both"])
def test_causal_with_extra_keys(backend, extra):
    """add_bias_kv / add_zero_attn with is_causal: the extra keys are visible to every query
    and the causal diagonal stays where it was (torch pads its causal mask with a visible
    column; a query must not see the next token). Against torch's mask path (need_weights
    True; its is_causal fast path with need_weights False hides the extra keys instead)."""
    kw = dict(add_bias_kv=extra != "zero_attn", add_zero_attn=extra != "bias_kv")
    ref, ours = _pair(backend, embed_dim=32, num_heads=4, batch_first=True, **kw)
    x = torch.randn(2, 9, 32, device=DEVICE)
    causal = nn.Transformer.generate_square_subsequent_mask(9, device=DEVICE)
    _compare(ref, ours, (x, x, x), dict(attn_mask=causal, is_causal=True, need_weights=True,
                                        average_attn_weights=False))
    out_r = ref(x, x, x, attn_mask=causal, is_causal=True, need_weights=True)[0]
    out_o = ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    assert rel_err(out_o, out_r) < 2e-5, rel_err(out_o, out_r)
    x2 = x.clone()
    x2[:, 1:] += 1.0                           # later tokens change: query 0's output does not
    assert torch.equal(ours(x2, x2, x2, attn_mask=causal, is_causal=True)[0][:, 0], out_o[:, 0])


def test_fully_padded_row_has_zero_weights():
    """A batch row whose every key is padding: output the out_proj bias (zero attention) and
    weights 0 (torch gives NaN for both), not NaN weights beside a finite output."""
    _, ours = _pair("eager", embed_dim=16, num_heads=2, batch_first=True)
    x = torch.randn(2, 5, 16, device=DEVICE)
    kpm = torch.zeros(2, 5, dtype=torch.bool, device=DEVICE)
    kpm[1] = True
    out, w = ours(x, x, x, key_padding_mask=kpm)
    assert torch.equal(w[1], torch.zeros_like(w[1])) and not w.isnan().any()
    assert torch.allclose(out[1], ours.out_proj.bias.expand(5, 16))
    assert torch.allclose(w[0].sum(-1), torch.ones(5, device=DEVICE))


@pytest.mark.parametrize("batch_first", [False, True])
def test_unbatched_input(batch_first):
    # [T, E]: no batch dimension, whichever batch_first says (inserting it at dim 1 with
    # batch_first returned [T, 1, E] and passed with batch_first False only)
    ref, ours = _pair("eager", embed_dim=16, num_heads=2, batch_first=batch_first)
    x = torch.randn(5, 16, device=DEVICE)
    _compare(ref, ours, (x, x, x), dict(need_weights=False))


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("average", [True, False])
def test_unbatched_input_with_padding_and_weights(batch_first, average):
    # unbatched [T, E] with torch's unbatched key_padding_mask [Tk] and need_weights: the
    # weights come back unbatched too ([Tq, Tk], or [H, Tq, Tk] per head), as torch's
    ref, ours = _pair("eager", embed_dim=16, num_heads=2, batch_first=batch_first)
    q, kv = torch.randn(4, 16, device=DEVICE), torch.randn(6, 16, device=DEVICE)
    kpm = torch.tensor([False, True, False, False, True, False], device=DEVICE)
    _compare(ref, ours, (q, kv, kv), dict(key_padding_mask=kpm, need_weights=True,
                                         average_attn_weights=average))


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_mask_with_more_keys_than_queries(backend):
    """Tq < Tk (queries after a cache of keys): torch's mask for that is the causal mask
    aligned to the last key, triu(ones(Tq, Tk), 1 + Tk - Tq): with is_causal=True it runs
    and agrees with torch; the top-left one, triu(ones(Tq, Tk), 1), is another mask
    (query i sees keys 0..i only): refused, not run as the bottom-right one."""
    ref, ours = _pair(backend, embed_dim=16, num_heads=2, batch_first=True)
    Tq, Tk = 4, 7
    q, kv = torch.randn(2, Tq, 16, device=DEVICE), torch.randn(2, Tk, 16, device=DEVICE)
    ones = torch.ones(Tq, Tk, device=DEVICE)
    bottom_right = ones.triu(1 + Tk - Tq).bool()
    _compare(ref, ours, (q, kv, kv), dict(attn_mask=bottom_right, is_causal=True,
                                         need_weights=True, average_attn_weights=False))
    with pytest.raises(NotImplementedError, match="attn_mask"):
        ours(q, kv, kv, attn_mask=ones.triu(1).bool(), is_causal=True)


def test_causal_mask_without_is_causal_is_refused_or_applied():
    # the causal mask passed without the is_causal hint is still a mask torch applies: the
    # module must refuse it (the general-mask rule) or apply it, never run unmasked
    ref, ours = _pair("eager", embed_dim=16, num_heads=2)
    x = torch.randn(5, 2, 16, device=DEVICE)
    causal = nn.Transformer.generate_square_subsequent_mask(5, device=DEVICE)
    try:
        out = ours(x, x, x, attn_mask=causal, need_weights=False)[0]
    except NotImplementedError:
        return
    want = ref(x, x, x, attn_mask=causal, need_weights=False)[0]
    assert rel_err(out, want) < 2e-5, f"causal mask without is_causal: {rel_err(out, want)}"


def test_general_attn_mask_is_refused():
    _, ours = _pair("eager", embed_dim=16, num_heads=2)
    x = torch.randn(5, 1, 16, device=DEVICE)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        ours(x, x, x, attn_mask=torch.rand(5, 5, device=DEVICE) < 0.5)
    # a float mask with -inf where the causal one has it and a bias elsewhere (ALiBi; a
    # [B*H, T, T] mask with a bias per head) is not the causal mask: refused, not run as it
    causal = nn.Transformer.generate_square_subsequent_mask(5, device=DEVICE)
    i = torch.arange(5, device=DEVICE)
    alibi = causal - 0.5 * (i[:, None] - i[None, :]).clamp(min=0)
    per_head = causal.expand(2, 5, 5).clone()
    per_head[1] += alibi.nan_to_num(neginf=0.0)
    for mask in (alibi, per_head):
        with pytest.raises(NotImplementedError, match="attn_mask"):
            ours(x, x, x, attn_mask=mask, is_causal=True)
    ours(x, x, x, attn_mask=causal.expand(2, 5, 5), is_causal=True)   # causal per head: runs


@pytest.mark.parametrize("case", ["embed_dim", "kdim", "batch", "rank", "lengths", "kpm"])
def test_wrong_shapes_are_named(case):
    """Shapes that do not fit the module are refused by name before any projection (they
    raised torch's own matmul / reshape / unpacking errors)."""
    m = ctxfast.nn.MultiheadAttention(8, 2, kdim=6, vdim=4)
    q, k, v = torch.randn(5, 3, 8), torch.randn(7, 3, 6), torch.randn(7, 3, 4)
    kw = {}
    if case == "embed_dim":
        q, words = torch.randn(5, 3, 6), "query must have last dim embed_dim = 8"
    elif case == "kdim":
        k, words = torch.randn(7, 3, 8), "key must have last dim kdim = 6"
    elif case == "batch":
        k, v, words = k[:, :2], v[:, :2], "same batch size, got 3 and 2"
    elif case == "rank":
        q, words = q[:, :, None], "must all be [T, B, E] or all unbatched [T, E]"
    elif case == "lengths":
        v, words = v[:6], "key and value must have the same length and batch"
    else:
        kw["key_padding_mask"] = torch.zeros(3, 6, dtype=torch.bool)
        words = "key_padding_mask must have shape [B, Tk] = [3, 7]"
    with pytest.raises(ValueError, match=re.escape(words)):
        m(q, k, v, **kw)
    assert m(torch.randn(5, 3, 8), torch.randn(7, 3, 6), torch.randn(7, 3, 4))[0].shape == \
        (5, 3, 8)


def test_causal_mask_compiles_without_a_graph_break():
    """attn_mask (the causal mask) with is_causal=True under torch.compile(fullgraph=True):
    the mask's values are not read there (a data-dependent branch: the graph broke, and
    fullgraph failed), only its shape; the output is the eager one."""
    _, ours = _pair("eager", embed_dim=16, num_heads=2, batch_first=True)
    x = torch.randn(2, 7, 16, device=DEVICE)
    causal = nn.Transformer.generate_square_subsequent_mask(7, device=DEVICE)
    torch._dynamo.reset()
    try:
        got = torch.compile(lambda t: ours(t, t, t, attn_mask=causal, is_causal=True,
                                           need_weights=False)[0],
                            fullgraph=True, backend="eager")(x)
    finally:
        torch._dynamo.reset()
    want = ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    assert torch.equal(got, want)
