"""ctxfast.models.from_hf: BERT and GPT-2 built by transformers from tiny configs (no
downloads) and converted; our outputs agree with Hugging Face's (BERT with a padding mask,
GPT-2 logits) on both backends. XLNet's conversion is tested in test_from_hf_xlnet.py; here
only its dispatch."""
import contextlib
import sys
import types

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is an optional "
                                   "test dependency (pip install transformers)")
import ctxfast  # noqa: E402
from ctxfast.models import GPT, Bert, from_hf  # noqa: E402
from utils import DEVICE, assert_close  # noqa: E402

TRITON = ctxfast.why_unavailable("triton", DEVICE) is None
V = 53


def ops_backend(backend):
    if backend == "ctxfast" and TRITON:
        return ctxfast.backend("triton")
    return contextlib.nullcontext()


def _bert_config(**kw):
    base = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=48, max_position_embeddings=24, type_vocab_size=3)
    base.update(kw)
    return transformers.BertConfig(**base)


def _gpt2_config(**kw):
    base = dict(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=24, bos_token_id=0,
                eos_token_id=0)
    base.update(kw)
    return transformers.GPT2Config(**base)


def _bert_inputs():
    ids = torch.randint(1, V, (3, 11), device=DEVICE)
    tt = torch.randint(0, 3, (3, 11), device=DEVICE)
    am = torch.ones(3, 11, dtype=torch.long, device=DEVICE)
    am[1, 8:] = 0                                            # right padding
    am[2, 3:] = 0
    return ids, tt, am


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_bert_model_with_padding(backend, varlen):
    hf = transformers.BertModel(_bert_config()).to(DEVICE).eval()
    model = from_hf(hf, backend=backend)
    assert isinstance(model, Bert) and model.backend == backend and not model.training
    assert model.mlm is None and model.nsp is None and model.pooler is not None
    ids, tt, am = _bert_inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am)
        with ops_backend(backend):
            out = model(ids, tt, am, varlen=varlen)
    keep = am.bool()                                         # padded positions are undefined
    assert_close(out.last_hidden_state[keep], ref.last_hidden_state[keep], name="hidden")
    assert_close(out.pooler_output, ref.pooler_output, name="pooled")


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
def test_bert_for_pretraining_heads_and_loss(backend):
    hf = transformers.BertForPreTraining(_bert_config(hidden_act="gelu_new")).to(DEVICE).eval()
    model = from_hf(hf, backend=backend)
    assert model.mlm.decoder.weight is model.embeddings.word.weight   # still tied
    ids, tt, am = _bert_inputs()
    labels = torch.where(am.bool(), ids, torch.full_like(ids, -100))
    nsp = torch.tensor([0, 1, 1], device=DEVICE)
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am, labels=labels,
                 next_sentence_label=nsp)
        with ops_backend(backend):
            out = model(ids, tt, am, mlm_labels=labels, nsp_labels=nsp)
    keep = am.bool()
    assert_close(out.mlm_logits[keep], ref.prediction_logits[keep], name="mlm_logits")
    assert_close(out.nsp_logits, ref.seq_relationship_logits, name="nsp_logits")
    assert_close(out.loss, ref.loss, name="loss")


def test_bert_for_masked_lm_has_no_pooler():
    hf = transformers.BertForMaskedLM(_bert_config()).to(DEVICE).eval()
    model = from_hf(hf, backend="eager")
    assert model.pooler is None and model.nsp is None
    ids, tt, am = _bert_inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am).logits
        out = model(ids, tt, am).mlm_logits
    keep = am.bool()
    assert_close(out[keep], ref[keep], name="mlm_logits")


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
def test_gpt2_lm_head_logits(backend):
    hf = transformers.GPT2LMHeadModel(_gpt2_config()).to(DEVICE).eval()
    model = from_hf(hf, backend=backend)
    assert isinstance(model, GPT) and model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, V, (2, 13), device=DEVICE)
    with torch.no_grad():
        ref = hf(input_ids=idx, labels=idx)
        with ops_backend(backend):
            logits, _ = model(idx)
            _, loss = model(idx[:, :-1], idx[:, 1:])         # HF shifts inside; we do not
    assert_close(logits, ref.logits, name="logits")
    assert_close(loss, ref.loss, name="loss")


def test_gpt2_greedy_generate_matches_hf_generate():
    hf = transformers.GPT2LMHeadModel(_gpt2_config(bos_token_id=None, eos_token_id=None))
    hf = hf.to(DEVICE).eval()
    model = from_hf(hf, backend="eager")
    idx = torch.randint(0, V, (2, 5), device=DEVICE)
    ref = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=8,
                      min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(idx, 8, temperature=0.0), ref)


def test_gpt2_options_untied_head_and_layer_scaling():
    cfg = _gpt2_config(tie_word_embeddings=False, scale_attn_by_inverse_layer_idx=True,
                       n_inner=40, activation_function="relu")
    hf = transformers.GPT2LMHeadModel(cfg).to(DEVICE).eval()
    with torch.no_grad():
        hf.lm_head.weight.normal_()                           # make sure it differs from wte
    model = from_hf(hf, backend="eager")
    assert model.lm_head.weight is not model.transformer.wte.weight
    idx = torch.randint(0, V, (2, 9), device=DEVICE)
    with torch.no_grad():
        assert_close(model(idx)[0], hf(input_ids=idx).logits, name="logits")


def test_gpt2_dropout_rates_are_carried():
    """HF's three GPT-2 dropout rates reach the model: embd_pdrop the embeddings',
    resid_pdrop the residual branches', attn_pdrop the attention's (each distinct here)."""
    hf = transformers.GPT2LMHeadModel(_gpt2_config(embd_pdrop=0.5, resid_pdrop=0.25,
                                                   attn_pdrop=0.125))
    model = from_hf(hf, backend="eager")
    assert model.transformer.drop.p == 0.5
    assert (model.config.dropout, model.config.attn_dropout) == (0.25, 0.125)
    rates = {m.p for name, m in model.named_modules()
             if isinstance(m, nn.Dropout) and name.startswith("transformer.h.")}
    assert rates <= {0.25, 0.125} and 0.25 in rates, rates


def test_bert_untied_mlm_decoder_keeps_its_own_weight():
    """BertForMaskedLM with tie_word_embeddings=False: the decoder's own weight is loaded
    (the model built untied), so the MLM logits are HF's."""
    hf = transformers.BertForMaskedLM(_bert_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():
        hf.cls.predictions.decoder.weight.normal_()
    assert hf.cls.predictions.decoder.weight is not hf.bert.embeddings.word_embeddings.weight
    model = from_hf(hf, backend="eager")
    assert model.mlm.decoder.weight is not model.embeddings.word.weight
    ids, tt, am = _bert_inputs()
    ids, tt, am = ids.cpu(), tt.cpu(), am.cpu()
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am).logits
        out = model(ids, tt, am).mlm_logits
    keep = am.bool()
    assert_close(out[keep], ref[keep], name="mlm logits, untied decoder")


def test_bert_dropout_rates_and_padding_row_are_carried():
    """HF's two BERT dropout rates reach the model (hidden_dropout_prob the embeddings' and
    residual branches', attention_probs_dropout_prob the attention's; distinct here), and
    pad_token_id is the word embedding's padding_idx: as in HF, a training step gives that
    row no gradient (the row of token 0 one)."""
    hf = transformers.BertModel(_bert_config(hidden_dropout_prob=0.25,
                                             attention_probs_dropout_prob=0.125,
                                             pad_token_id=3))
    model = from_hf(hf, backend="eager")
    assert (model.config.dropout, model.config.attn_dropout) == (0.25, 0.125)
    assert all(layer.attn.attn_dropout == 0.125 for layer in model.layers)
    assert model.embeddings.drop.p == 0.25
    assert model.embeddings.word.padding_idx == hf.embeddings.word_embeddings.padding_idx == 3
    ids = torch.tensor([[0, 5, 3, 7, 3, 0]])
    model.eval()(ids).last_hidden_state.square().sum().backward()
    grad = model.embeddings.word.weight.grad
    assert (grad[3] == 0).all(), "the padding row (pad_token_id=3) got a gradient"
    assert grad[0].abs().sum() > 0, "token 0 is not padding here but got no gradient"


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
def test_gpt2_model_hidden_states_through_tied_head(backend):
    """GPT2Model has no head: ours gets one tied to wte, so logits = hidden @ wte.T."""
    hf = transformers.GPT2Model(_gpt2_config()).to(DEVICE).eval()
    model = from_hf(hf, backend=backend)
    idx = torch.randint(0, V, (2, 7), device=DEVICE)
    with torch.no_grad():
        ref = hf(input_ids=idx).last_hidden_state @ hf.wte.weight.t()
        with ops_backend(backend):
            logits, _ = model(idx)
    assert_close(logits, ref, name="logits")


def test_weights_are_copied_and_dtype_follows():
    hf = transformers.GPT2LMHeadModel(_gpt2_config()).double().train()
    model = from_hf(hf, backend="eager")
    assert model.training and next(model.parameters()).dtype == torch.float64
    hf_ptrs = {p.data_ptr() for p in hf.parameters()}
    assert not hf_ptrs & {p.data_ptr() for p in model.parameters()}
    # the Conv1D weights were transposed, not reinterpreted
    w = hf.transformer.h[0].attn.c_attn.weight                # [D, 3D]
    assert torch.equal(model.transformer.h[0].attn.qkv.weight, w.t())


def test_unsupported_models_and_options():
    with pytest.raises(TypeError, match="supported: BertModel.*GPT2Model.*XLNetModel"):
        from_hf(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="is_decoder"):
        from_hf(transformers.BertModel(_bert_config(is_decoder=True)))
    with pytest.raises(ValueError, match="hidden_act"):
        from_hf(transformers.BertModel(_bert_config(hidden_act="silu")))
    with pytest.raises(ValueError, match="scale_attn_weights"):
        from_hf(transformers.GPT2Model(_gpt2_config(scale_attn_weights=False)))
    with pytest.raises(ValueError, match="backend"):
        from_hf(transformers.GPT2Model(_gpt2_config()), backend="triton")


def test_xlnet_dispatches_to_from_hf_xlnet(monkeypatch):
    """XLNet classes go to ctxfast.models.xlnet.from_hf_xlnet (replaced here by a stub, so
    this test does not depend on that module); a missing module gives a clear ImportError."""
    seen = []
    stub = types.ModuleType("ctxfast.models.xlnet")
    stub.from_hf_xlnet = lambda m, backend="ctxfast": seen.append((m, backend)) or "converted"
    XLNetLMHeadModel = type("XLNetLMHeadModel", (nn.Module,), {})
    monkeypatch.setitem(sys.modules, "ctxfast.models.xlnet", stub)
    hf = XLNetLMHeadModel()
    assert from_hf(hf, backend="eager") == "converted" and seen == [(hf, "eager")]
    monkeypatch.setitem(sys.modules, "ctxfast.models.xlnet", None)   # import fails
    with pytest.raises(ImportError, match="from_hf_xlnet"):
        from_hf(hf)


def test_float64_weights_keep_every_bit():
    # the model was built in fp32, loaded, then cast: fp64 weights lost their low bits
    # (an untied head 9.5e-7 off, logits 5.5e-7)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=53, n_embd=32, n_layer=2, n_head=2, n_positions=24,
        tie_word_embeddings=False)).eval().double()
    with torch.no_grad():
        hf.lm_head.weight.normal_()
    model = from_hf(hf)
    for name, p in hf.named_parameters():
        ours = dict(model.named_parameters()).get(name)
        if ours is not None:
            assert torch.equal(ours, p), name
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
def test_gpt2_cached_steps_and_other_epsilon_and_gelu(backend):
    """Single-token steps through the KV cache give HF's full-sequence logits; a
    layer-norm epsilon and an activation other than the defaults are carried."""
    from ctxfast.models._common import KVCache
    cfg = _gpt2_config(layer_norm_epsilon=1e-2, activation_function="gelu_pytorch_tanh")
    hf = transformers.GPT2LMHeadModel(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for p in hf.parameters():                 # larger weights: the options show more
            p.add_(torch.randn_like(p) * 0.1)
    model = from_hf(hf, backend=backend)
    idx = torch.randint(0, V, (2, 11), device=DEVICE)
    with torch.no_grad(), ops_backend(backend):
        ref = hf(input_ids=idx).logits
        cache = KVCache(cfg.n_layer)
        model(idx[:, :5], cache=cache)
        steps = torch.cat([model(idx[:, t:t + 1], cache=cache)[0] for t in range(5, 8)], 1)
        full = model(idx)[0]
    assert_close(full, ref, name="logits")
    assert_close(steps, ref[:, 5:8], name="cached steps")


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
def test_bert_mlm_left_padding_without_token_types(backend):
    """Left and right padding, no token_type_ids (HF: all segment 0), a pad token other
    than 0, another epsilon and gelu_new in both the layers and the MLM transform."""
    cfg = _bert_config(layer_norm_eps=1e-3, hidden_act="gelu_new", pad_token_id=3)
    hf = transformers.BertForMaskedLM(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = from_hf(hf, backend=backend)
    ids = torch.randint(0, V, (3, 9), device=DEVICE)
    am = torch.ones(3, 9, dtype=torch.long, device=DEVICE)
    am[1, :4] = 0                                            # left padding
    am[2, 7:] = 0
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=am).logits
        with ops_backend(backend):
            out = model(ids, None, am).mlm_logits
    keep = am.bool()
    assert_close(out[keep], ref[keep], name="mlm logits")
