"""In ``eval()`` no model or attention layer drops anything, whatever its dropout rates.

Every model test builds its models with the rates at 0 (to compare backends on the same
function), so a model whose fast path kept a rate in eval mode (``dropout_p=self.dropout.p``
without ``if self.training``) passed them all: the rates here are all above 0. Each model,
on both backends, in eval mode: two calls under different seeds give the same bits, and
those of the same weights built with every rate 0.
"""
import copy

import pytest
import torch

import ctxfast
from ctxfast.models import GPT, Bert, BertConfig, GPTConfig
from ctxfast.models.awd_lstm import AWDLSTMClassifier, AWDLSTMConfig, AWDLSTMLM
from ctxfast.models.elmo import Elmo, ElmoConfig, batch_to_ids
from ctxfast.models.transformer_xl import TransformerXL, TransformerXLConfig
from ctxfast.models.xlnet import XLNetConfig, XLNetLMHeadModel
from utils import DEVICE

V = 37


def _gpt(p, backend):
    return GPT(GPTConfig(vocab_size=V, n_positions=16, n_layer=2, n_head=2, n_embd=32,
                         dropout=p, attn_dropout=p, embd_dropout=p, backend=backend))


def _bert(p, backend):
    return Bert(BertConfig(vocab_size=V, n_positions=16, n_layer=2, n_head=2, n_embd=32,
                           dropout=p, attn_dropout=p, backend=backend))


def _xlnet(p, backend):
    return XLNetLMHeadModel(XLNetConfig(vocab_size=V, d_model=32, n_layer=2, n_head=2,
                                        d_inner=48, dropout=p, mem_len=5), backend=backend)


def _txl(p, backend):
    return TransformerXL(TransformerXLConfig(n_token=V, n_layer=2, n_head=2, d_model=32,
                                             d_head=16, d_inner=48, dropout=p, dropatt=p,
                                             tgt_len=8, mem_len=8, backend=backend))


def _awd(cls):
    def make(p, backend):
        return cls(AWDLSTMConfig(vocab_size=V, emb_sz=8, n_hid=16, n_layers=3, pad_token=1,
                                 embed_p=p, input_p=p, hidden_p=p, weight_p=p, output_p=p,
                                 n_class=3, lin_ftrs=(6,), lin_ps=(p,), bptt=4,
                                 backend=backend))
    return make


def _elmo(p, backend):
    return Elmo(ElmoConfig(char_embed_dim=4, filters=((1, 4), (2, 6)), n_highway=1,
                           projection_dim=8, cell_size=16, max_characters_per_token=8,
                           vocab_size=V, weight_dropout=p, lm_dropout=p, dropout=p,
                           backend=backend))


def _ids(B, T, lo=0):
    return torch.randint(lo, V, (B, T), device=DEVICE)


def _run_xlnet(model):
    B, T = 2, 7
    rank = torch.stack([torch.randperm(T) for _ in range(B)]).to(DEVICE)
    target = torch.zeros(B, 2, T, device=DEVICE)
    target[:, 0, -1] = target[:, 1, -2] = 1
    mask = torch.ones(B, T, device=DEVICE)
    mask[1, :2] = 0                                            # left padding, as XLNet's
    return model(_ids(B, T), attention_mask=mask, perm_rank=rank,
                 target_mapping=target).logits


def _run_bert(model):
    mask = torch.ones(3, 9, dtype=torch.long, device=DEVICE)
    mask[1, 6:] = 0
    return model(_ids(3, 9), torch.randint(0, 2, (3, 9), device=DEVICE), mask).last_hidden_state


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


SENTS = [["The", "cat", "sat"], ["A", "dog"], ["Hi"]]

MODELS = {
    # name: (model of (rate, backend), its output on fresh inputs)
    "gpt": (_gpt, lambda m: m(_ids(2, 9))[0]),
    "bert": (_bert, _run_bert),
    "xlnet": (_xlnet, _run_xlnet),
    "transformer_xl": (_txl, lambda m: m(_ids(8, 3).t(), _ids(8, 3).t())[0]),
    "awd_lstm_lm": (_awd(AWDLSTMLM), lambda m: m(_ids(3, 6, lo=2))[0]),
    "awd_lstm_classifier": (_awd(AWDLSTMClassifier), lambda m: m(_ids(3, 6, lo=2))[0]),
    # the layers alone (Transformer-XL's model runs its own attention, not this layer's)
    "nn.MultiheadAttention": (_mha, _run_mha),
    "nn.RelPartialLearnableMultiHeadAttn": (_rel_layer, _run_rel_layer),
    "elmo": (_elmo, lambda m: m(batch_to_ids(SENTS, 8).to(DEVICE),
                                _ids(3, 3)).elmo_representations[0]),
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
