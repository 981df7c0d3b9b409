"""ctxfast.integrations.hf: BERT and GPT-2 built from configs (no downloads) give the same
hidden states on ctxfast attention as on transformers' "sdpa"."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")  # optional dependency (installed by make test)
import ctxfast.integrations.hf as ctxfast_hf  # noqa: E402
from utils import DEVICE, TRITON_ON_CPU  # noqa: E402

BACKENDS = ["eager"] + (["triton"] if TRITON_ON_CPU or torch.cuda.is_available() else [])


@pytest.fixture(scope="module", autouse=True)
def _registered():
    for b in BACKENDS:
        ctxfast_hf.register(f"ctxfast_{b}", backend=b)


def _inputs():
    ids = torch.randint(0, 100, (3, 13), device=DEVICE)
    am = torch.ones(3, 13, dtype=torch.long, device=DEVICE)
    am[1, 9:] = 0        # right padding
    am[2, 4:] = 0
    return ids, am


def _bert():
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64)
    return transformers.BertModel(cfg).to(DEVICE).eval()


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(cfg).to(DEVICE).eval()


def _error_against_sdpa(model, backend, wrap=lambda m: m):
    """Largest |ours - sdpa| of the hidden states at unpadded positions (padded ones are
    undefined) on _inputs(); ours is ``wrap(model)`` on ctxfast_<backend>."""
    ids, am = _inputs()
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids, attention_mask=am).last_hidden_state
        model.set_attn_implementation(f"ctxfast_{backend}")
        out = wrap(model)(input_ids=ids, attention_mask=am).last_hidden_state
    return (out - ref)[am.bool()].abs().max().item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_matches_sdpa_with_padding(make, backend):
    err = _error_against_sdpa(make(), backend)
    assert err < 1e-5, err


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt2_decoding_with_cache(backend):
    """Prefill 8 tokens, then one token at a time with the key/value cache: the same hidden
    states as one full pass (bottom-right causal alignment)."""
    model = _gpt2()
    model.set_attn_implementation(f"ctxfast_{backend}")
    ids = torch.randint(0, 100, (2, 11), device=DEVICE)
    with torch.no_grad():
        full = model(input_ids=ids).last_hidden_state
        # transformers renamed past_key_values to cache (argument and output; 5.x)
        name = ("cache" if "cache" in inspect.signature(model.forward).parameters
                else "past_key_values")
        step = model(input_ids=ids[:, :8], use_cache=True)
        past, outs = getattr(step, name), [step.last_hidden_state]
        for t in range(8, 11):
            step = model(input_ids=ids[:, t:t + 1], use_cache=True, **{name: past})
            past = getattr(step, name)
            outs.append(step.last_hidden_state)
    err = (torch.cat(outs, 1) - full).abs().max().item()
    assert err < 1e-5, err


def test_training_backward_matches_sdpa():
    model = _bert().train()
    model.config.attention_probs_dropout_prob = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ids, am = _inputs()
    grads = {}
    for impl in ("sdpa", "ctxfast_eager"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        hidden = model(input_ids=ids, attention_mask=am).last_hidden_state
        (hidden * am[..., None]).sum().backward()
        grads[impl] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    rel = (grads["sdpa"] - grads["ctxfast_eager"]).norm() / grads["sdpa"].norm()
    assert rel < 1e-5, rel.item()


@pytest.mark.parametrize("case", ["scaling", "grouped-query", "call-over-module",
                                  "padding"])
def test_attention_function_against_sdpa(case):
    """The registered function on its own, against SDPA, for what the tested models never
    vary (their scale is D**-0.5, their key/value heads are the query heads, their calls
    and modules agree on causality): an explicit scaling, grouped-query heads (each key
    head serves consecutive query heads, as transformers' repeat_kv), the call's is_causal
    over the module's, a padding mask. Each passed every model test when done wrong."""
    import types

    import torch.nn.functional as F
    fn = ctxfast_hf.make_attention_function(BACKENDS[0])
    B, H, T, D = 2, 4, 6, 8
    Hkv = 2 if case == "grouped-query" else H
    q = torch.randn(B, H, T, D, device=DEVICE)
    k, v = (torch.randn(B, Hkv, T, D, device=DEVICE) for _ in range(2))
    module = types.SimpleNamespace(is_causal=True)
    kw, want_kw, mask = {}, {"is_causal": True}, None
    if case == "scaling":
        kw["scaling"] = want_kw["scale"] = 0.7
    if case == "call-over-module":
        kw["is_causal"] = want_kw["is_causal"] = False
    if case == "padding":
        mask = torch.ones(B, T, dtype=torch.long, device=DEVICE)
        mask[1, 4:] = 0
        keep = mask.bool()[:, None, None, :] & torch.ones(T, T, device=DEVICE).tril().bool()
        want_kw = {"attn_mask": keep}
    kk, vv = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    want = F.scaled_dot_product_attention(q, kk, vv, **want_kw).transpose(1, 2)
    got, weights = fn(module, q, k, v, mask, **kw)
    assert weights is None and got.shape == (B, T, H, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padding_mask_keeps_the_last_kv_length_columns():
    """A 2-D mask longer than the keys (the cached and the new tokens) is read from its
    end: here its last 4 columns keep everything, so there is no mask at all."""
    from transformers import masking_utils as mu
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]], device=DEVICE)
    assert ctxfast_hf.padding_mask_function(
        1, 4, 4, mask_function=mu.bidirectional_mask_function, attention_mask=mask) is None
    got = ctxfast_hf.padding_mask_function(
        1, 4, 5, mask_function=mu.bidirectional_mask_function, attention_mask=mask)
    assert got.tolist() == [[False, True, True, True, True]]


def test_custom_4d_mask_is_refused():
    fn = ctxfast_hf.make_attention_function("eager")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="2-D padding mask"):
        fn(torch.nn.Module(), q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool),
           is_causal=False)


def test_a_module_without_is_causal_is_refused():
    # Splinter's (and ALIGN's, CLAP's) text encoders give no is_causal: taken as causal,
    # these bidirectional encoders ran causally without a word (0.04-0.6 off eager)
    cfg = transformers.SplinterConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=64)
    model = transformers.SplinterModel(cfg).to(DEVICE).eval()
    model.set_attn_implementation(f"ctxfast_{BACKENDS[0]}")
    with pytest.raises(ValueError, match="SplinterSelfAttention gives no is_causal"):
        model(input_ids=torch.randint(3, 100, (2, 6), device=DEVICE))


@pytest.mark.parametrize("name", sorted(ctxfast_hf._UNSUPPORTED))
def test_arguments_that_change_the_result_are_refused(name):
    # attention sinks (gpt-oss's s_aux), sparse indices, packed cu_seq_lens, ...: ignored,
    # they gave another result than the model's own attention without a word
    fn = ctxfast_hf.make_attention_function("eager")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=f"{name}="):
        fn(torch.nn.Module(), q, q, q, None, is_causal=True, **{name: torch.zeros(2)})
    fn(torch.nn.Module(), q, q, q, None, is_causal=True, **{name: None})     # None: absent


def test_output_attentions_is_refused_not_dropped():
    # it returned no weights (attentions == ()) without a word
    model = _bert()
    model.set_attn_implementation(f"ctxfast_{BACKENDS[0]}")
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=torch.randint(0, 100, (2, 6), device=DEVICE), output_attentions=True)


def test_static_cache_is_refused():
    # a StaticCache's keys run past the queries (empty slots): with ctxfast's bottom-right
    # causal alignment each prefill query saw later keys (0.064 off a full pass)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).to(DEVICE).eval()
    model.set_attn_implementation(f"ctxfast_{BACKENDS[0]}")
    cache = transformers.StaticCache(config=cfg, max_cache_len=32)
    with pytest.raises(ValueError, match="queries end at 8 but the keys at 32"):
        with torch.no_grad():
            model(input_ids=torch.randint(1, 100, (1, 8), device=DEVICE), past_key_values=cache,
                  use_cache=True)


def test_compiles_fullgraph():
    # the mask function read mask.all() (data-dependent): fullgraph failed, and the default
    # compile broke the graph there
    torch._dynamo.reset()
    try:
        err = _error_against_sdpa(_bert(), BACKENDS[0],
                                  lambda m: torch.compile(m, fullgraph=True, backend="eager"))
    finally:
        torch._dynamo.reset()
    assert err < 1e-5, err
