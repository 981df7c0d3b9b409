"""In ``eval()`` no model or attention layer drops anything, whatever its dropout rates.

Every model test builds its models with the rates at 0 (to compare backends on the same
function), so a model whose fast path kept a rate in eval mode (``dropout_p=self.dropout.p``
without ``if self.training``) passed them all: the rates here are all above 0. Each model,
on both backends, in eval mode: two calls under different seeds give the same bits, and
those of the same weights built with every rate 0. The models are built by their own test
modules' config helpers, on their own inputs.
"""
import copy

import pytest
import torch

import ctxfast
import test_models_awd_lstm as awd_tests
import test_models_bert as bert_tests
import test_models_elmo as elmo_tests
import test_models_gpt as gpt_tests
import test_models_transformer_xl as txl_tests
import test_models_xlnet as xlnet_tests
from ctxfast.models import GPT, Bert
from ctxfast.models.awd_lstm import AWDLSTMClassifier, AWDLSTMLM
from ctxfast.models.elmo import Elmo
from ctxfast.models.transformer_xl import TransformerXL
from ctxfast.models.xlnet import XLNetLMHeadModel
from utils import DEVICE


def _gpt(p, backend):
    return GPT(gpt_tests._config(dropout=p, attn_dropout=p, embd_dropout=p, backend=backend))


def _bert(p, backend):
    return Bert(bert_tests._config(dropout=p, attn_dropout=p, backend=backend))


def _xlnet(p, backend):
    return XLNetLMHeadModel(xlnet_tests._config(dropout=p), backend=backend)


def _txl(p, backend):
    return TransformerXL(txl_tests.tiny(dropout=p, dropatt=p, backend=backend))


def _awd(cls):
    def make(p, backend):
        return cls(awd_tests._config(embed_p=p, input_p=p, hidden_p=p, weight_p=p, output_p=p,
                                     lin_ps=(p,), backend=backend))
    return make


def _elmo(p, backend):
    return Elmo(elmo_tests._config(weight_dropout=p, lm_dropout=p, dropout=p, backend=backend))


def _ids(B, T, V, lo=0):
    return torch.randint(lo, V, (B, T), device=DEVICE)


def _run_xlnet(model):
    B, T = 2, 7
    rank = xlnet_tests._ranks(B, T)
    mask = torch.ones(B, T, device=DEVICE)
    mask[1, :2] = 0                                            # left padding, as XLNet's
    return model(_ids(B, T, xlnet_tests.V), attention_mask=mask, perm_rank=rank,
                 target_mapping=xlnet_tests._targets(rank, 2)).logits


def _run_bert(model):
    ids, tt, am = bert_tests._batch()[:3]                      # right-padded, two segments
    return model(ids, tt, am).last_hidden_state


def _mha(p, backend):
    return ctxfast.nn.MultiheadAttention(16, 2, dropout=p,
                                         backend=None if backend == "ctxfast" else backend)


def _run_mha(m):
    x = torch.randn(5, 3, 16, device=DEVICE)                  # [T, B, E]
    kpm = torch.zeros(3, 5, dtype=torch.bool, device=DEVICE)
    kpm[1, 3:] = True
    return m(x, x, x, key_padding_mask=kpm, need_weights=False)[0]


def _rel_layer(p, backend):
    return ctxfast.nn.RelPartialLearnableMultiHeadAttn(
        2, 16, 8, dropout=p, dropatt=p, backend=None if backend == "ctxfast" else backend)


def _run_rel_layer(m):
    w, r = torch.randn(4, 2, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE)
    mask = torch.ones(4, 4, device=DEVICE).triu(1).bool()     # the original's causal mask
    return m(w, r, attn_mask=mask)


MODELS = {
    # name: (model of (rate, backend), its output on fresh inputs)
    "gpt": (_gpt, lambda m: m(_ids(2, 9, m.config.vocab_size))[0]),
    "bert": (_bert, _run_bert),
    "xlnet": (_xlnet, _run_xlnet),
    "transformer_xl": (_txl, lambda m: m(txl_tests.ids(8, 3), txl_tests.ids(8, 3))[0]),
    "awd_lstm_lm": (_awd(AWDLSTMLM), lambda m: m(_ids(3, 6, awd_tests.V, lo=2))[0]),
    "awd_lstm_classifier": (_awd(AWDLSTMClassifier),
                            lambda m: m(_ids(3, 6, awd_tests.V, lo=2))[0]),
    # the layers alone (Transformer-XL's model runs its own attention, not this layer's)
    "nn.MultiheadAttention": (_mha, _run_mha),
    "nn.RelPartialLearnableMultiHeadAttn": (_rel_layer, _run_rel_layer),
    "elmo": (_elmo, lambda m: m(*elmo_tests._inputs()).elmo_representations[0]),
}


def _output(model, run, seed):
    """run(a copy of model) in no_grad: its inputs drawn under seed 1234 (the same each
    time), what the model draws under `seed` (reseeded as its forward starts); the copy
    starts from the model's carried state (AWD-LSTM carries one between calls)."""
    model = copy.deepcopy(model)

    def reseed(module, args):
        torch.manual_seed(seed)
    model.register_forward_pre_hook(reseed)
    torch.manual_seed(1234)
    with torch.no_grad():
        return run(model)


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_eval_drops_nothing(name, backend):
    make, run = MODELS[name]
    torch.manual_seed(0)
    model = make(0.4, backend).to(DEVICE).eval()
    plain = make(0.0, backend).to(DEVICE).eval()
    plain.load_state_dict(model.state_dict())
    first, second, ref = _output(model, run, 1), _output(model, run, 2), _output(plain, run, 1)
    assert torch.isfinite(ref).all()
    assert torch.equal(first, second), f"{name} ({backend}): eval output depends on the seed"
    assert torch.equal(first, ref), (
        f"{name} ({backend}): eval output differs from the same weights without dropout "
        f"(max diff {(first - ref).abs().max().item():.3g})")


def test_train_mode_does_drop():
    """The check above can fail: in train mode the same call depends on the seed."""
    for name, (make, run) in MODELS.items():
        torch.manual_seed(0)
        model = make(0.4, "ctxfast").to(DEVICE).train()
        assert not torch.equal(_output(model, run, 1), _output(model, run, 2)), name
