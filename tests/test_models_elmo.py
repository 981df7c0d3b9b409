"""ctxfast.models.elmo: backend="ctxfast" against backend="eager" (outputs and every
parameter's gradient), AllenNLP's semantics re-derived in plain PyTorch (the biLSTM with
separate directions, residuals and per-sentence lengths; the char mapper; highway; the
scalar mix; the biLM losses), dropout, training and input checks.

The ctxfast-vs-eager test runs the "ctxfast" model under ``ctxfast.backend(b)`` for every
non-eager LSTM backend that can run here (see tests/test_models_awd_lstm.py); the rest
use ctxfast's default dispatch. Toy sizes (cell 16, projection 8) keep the interpreted
Triton LSTM at one program per step.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import ctxfast
from ctxfast import _dispatch
from ctxfast.models.elmo import (Elmo, ElmoBiLM, ElmoConfig, Highway, ScalarMix,
                                 batch_to_ids, word_to_char_ids)
from utils import (DEVICE, REL_TOL, assert_close, assert_exports,
                   assert_param_grads_within_2x_eager, assert_within_2x_eager)

OP_BACKENDS = [b for b in _dispatch.registered_ops()["lstm"]
               if b != "eager" and ctxfast.why_unavailable(b, DEVICE) is None]
C, V = 8, 19
SENTS = [["hello", "world", "x"], ["ab", "c"], ["é"]]       # lengths 3, 2, 1: padding


def _config(**kw):
    base = dict(char_embed_dim=4, filters=((1, 4), (2, 6), (3, 6)), n_highway=1,
                projection_dim=8, cell_size=16, max_characters_per_token=C, vocab_size=V,
                cell_clip=0.1, proj_clip=0.02, dropout=0.0, lm_dropout=0.0)
    base.update(kw)
    return ElmoConfig(**base)


def _inputs():
    char_ids = batch_to_ids(SENTS, C).to(DEVICE)               # [3, 3, C]
    word_ids = torch.randint(0, V, char_ids.shape[:2], device=DEVICE)
    return char_ids, word_ids


@pytest.mark.parametrize("op_backend", OP_BACKENDS)
def test_ctxfast_matches_eager_outputs_and_every_grad(op_backend):
    """Two task mixes (one with layer norm is global, so take both), the biLM loss, clips
    that are active (cell 0.1, projection 0.02 at this init), padding."""
    kw = dict(num_output_representations=2, do_layer_norm=True)
    fast = Elmo(_config(backend="ctxfast", **kw)).to(DEVICE)
    eager = Elmo(_config(backend="eager", **kw)).to(DEVICE)
    eager.load_state_dict(fast.state_dict())
    with torch.no_grad():                                      # distinct mixing weights
        for m in (fast, eager):
            for i, p in enumerate(m.scalar_mixes[0].scalar_parameters):
                p.fill_(0.3 * i - 0.2)
    ref = copy.deepcopy(eager).double()
    char_ids, word_ids = _inputs()
    probes = [torch.randn(3, 3, 16, device=DEVICE) for _ in range(2)]
    results = []
    for model, ctx in ((fast, ctxfast.backend(op_backend)), (eager, contextlib.nullcontext()),
                       (ref, contextlib.nullcontext())):
        with ctx:
            out = model(char_ids, word_ids)
            total = out.loss + sum((r * w.to(r.dtype)).sum()
                                   for r, w in zip(out.elmo_representations, probes))
            total.backward()
        results.append(out)
    out, out_e, _ = results
    for i, (r, r_e) in enumerate(zip(out.elmo_representations, out_e.elmo_representations)):
        assert r.shape == (3, 3, 16)
        assert_close(r, r_e, name=f"representation {i}")
    assert torch.equal(out.mask, out_e.mask)
    assert_close(out.loss, out_e.loss, name="biLM loss")
    # gradients: the 2x-eager rule against float64 (scalar_mixes.0.gamma's gradient is a
    # sum over every element of the mix: a fixed 1e-5 against eager failed on CUDA, 3.1e-5)
    assert_param_grads_within_2x_eager(fast, eager, ref, REL_TOL[torch.float32])


@pytest.mark.parametrize("op_backend", OP_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_within_twice_eager_error(dtype, op_backend):
    """The flash-attention rule on the representation and the loss:
    ‖ctxfast − fp64‖ <= 2·‖eager − fp64‖ + floor."""
    models = [Elmo(_config(backend=b)).to(DEVICE).eval() for b in ("ctxfast", "eager", "eager")]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    fast, eager, ref = models[0].to(dtype), models[1].to(dtype), models[2].double()
    char_ids, word_ids = _inputs()
    with torch.no_grad():
        with ctxfast.backend(op_backend):
            out = fast(char_ids, word_ids)
        same, out64 = eager(char_ids, word_ids), ref(char_ids, word_ids)
    floor = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for name, get in (("representation", lambda o: o.elmo_representations[0]),
                      ("loss", lambda o: o.loss)):
        t, t_e, t64 = get(out), get(same), get(out64)
        assert t.dtype == dtype
        assert_within_2x_eager(t, t_e, t64, floor, name=name)


def test_length_one_empty_batch_and_non_contiguous_ids():
    """Default dispatch against eager."""
    fast = Elmo(_config()).to(DEVICE).eval()
    eager = Elmo(_config(backend="eager")).to(DEVICE).eval()
    eager.load_state_dict(fast.state_dict())
    char_ids, word_ids = _inputs()
    strided = char_ids.transpose(0, 1).contiguous().transpose(0, 1)     # same values, strided
    with torch.no_grad():
        for c, w in ((char_ids[:, :1], word_ids[:, :1]), (char_ids[:0], word_ids[:0]),
                     (strided, word_ids)):
            out, ref = fast(c, w), eager(c, w)
            assert out.elmo_representations[0].shape == (*c.shape[:2], 16)
            assert_close(out.loss, ref.loss, name=f"loss for {tuple(c.shape)}")
            if c.shape[0]:
                assert_close(out.elmo_representations[0], ref.elmo_representations[0],
                             name=f"representation for {tuple(c.shape)}")
    assert not strided.is_contiguous()


# --------------------------------------------------------------------------- AllenNLP semantics

def _cell_sequence(x, lstm, go_forward, cell_clip, proj_clip):
    """AllenNLP's LstmCellWithProjection over one sentence x ``[L, P]``, step by step."""
    H = lstm.hidden_size
    h = x.new_zeros(lstm.proj_size)
    c = x.new_zeros(H)
    outs = [None] * x.shape[0]
    for t in (range(x.shape[0]) if go_forward else reversed(range(x.shape[0]))):
        z = lstm.weight_ih_l0 @ x[t] + lstm.bias_ih_l0 + lstm.weight_hh_l0 @ h + lstm.bias_hh_l0
        i, f, g, o = torch.sigmoid(z[:H]), torch.sigmoid(z[H:2 * H]), torch.tanh(z[2 * H:3 * H]), \
            torch.sigmoid(z[3 * H:])
        c = (i * g + f * c).clamp(-cell_clip, cell_clip)
        h = (lstm.weight_hr_l0 @ (o * torch.tanh(c))).clamp(-proj_clip, proj_clip)
        outs[t] = h
    return torch.stack(outs)


def _allennlp_elmo_lstm(inputs, mask, lstm_module, cfg):
    """ElmoLstm, one sentence at a time: separate direction stacks, residual after the
    first layer, zeros at padding. -> ``[L, B, T, 2P]``."""
    L, (B, T, P) = cfg.n_layers, inputs.shape
    out = inputs.new_zeros(L, B, T, 2 * P)
    for b in range(B):
        n = int(mask[b].sum())
        if n == 0:
            continue
        fwd_in = bwd_in = inputs[b, :n]
        for k in range(L):
            f = _cell_sequence(fwd_in, lstm_module.forward_layers[k], True, cfg.cell_clip,
                               cfg.proj_clip)
            bk = _cell_sequence(bwd_in, lstm_module.backward_layers[k], False, cfg.cell_clip,
                                cfg.proj_clip)
            if k > 0:
                f, bk = f + fwd_in, bk + bwd_in
            out[k, b, :n] = torch.cat([f, bk], -1)
            fwd_in, bwd_in = f, bk
    return out


@pytest.mark.parametrize("boundaries", [True, False])
def test_bilm_matches_allennlp_semantics_per_sentence(boundaries):
    model = ElmoBiLM(_config(backend="eager", add_sentence_boundaries=boundaries,
                             n_layers=3, cell_clip=0.15, proj_clip=0.05)).double()
    char_ids, _ = _inputs()
    with torch.no_grad():
        out = model(char_ids.cpu())
        emb, mask, token_mask = model.token_embedder(char_ids.cpu())
        ref = _allennlp_elmo_lstm(emb, mask, model.lstm, model.config)
    lengths = [len(s) + (2 if boundaries else 0) for s in SENTS]
    assert mask.sum(1).tolist() == lengths
    assert token_mask.sum(1).tolist() == [len(s) for s in SENTS]
    assert len(out.activations) == 4
    assert_close(out.activations[0], torch.cat([emb, emb], -1) * mask[..., None],
                 name="layer 0")
    for k in range(3):
        assert_close(out.activations[k + 1], ref[k], name=f"layer {k + 1}")


def test_char_mapper_and_sentence_boundaries_are_allennlps():
    # ELMoCharacterMapper (+1 for masking): begin-word 259, end-word 260, padding 261
    assert word_to_char_ids("a", 6) == [259, 98, 260, 261, 261, 261]
    assert word_to_char_ids("<S>", 5) == [259, 257, 260, 261, 261]
    assert word_to_char_ids("</S>", 5) == [259, 258, 260, 261, 261]
    assert word_to_char_ids("abcdefg", 5) == [259, 98, 99, 100, 260]       # cut to C - 2
    assert word_to_char_ids("é", 5) == [259, 0xC3 + 1, 0xA9 + 1, 260, 261]  # utf-8 bytes
    enc = ElmoBiLM(_config()).token_embedder
    char_ids = batch_to_ids(SENTS, C)
    assert char_ids.shape == (3, 3, C) and char_ids[2, 1:].eq(0).all()
    with_b, mask = enc.add_boundaries(char_ids, (char_ids > 0).any(-1))
    bos, eos = torch.tensor(word_to_char_ids("<S>", C)), torch.tensor(word_to_char_ids("</S>", C))
    for b, s in enumerate(SENTS):
        assert torch.equal(with_b[b, 0], bos) and torch.equal(with_b[b, len(s) + 1], eos)
        assert torch.equal(with_b[b, 1:len(s) + 1], char_ids[b, :len(s)])
        assert mask[b].tolist() == [True] * (len(s) + 2) + [False] * (3 - len(s))


def test_highway_and_scalar_mix_formulas():
    x = torch.randn(5, 6)
    hw = Highway(6, 2)
    ref = x
    for layer in hw.layers:
        a, gate = (ref @ layer.weight.t() + layer.bias).split(6, -1)
        g = torch.sigmoid(gate)
        ref = g * ref + (1 - g) * torch.relu(a)
    assert_close(hw(x), ref, name="highway")
    assert torch.equal(hw.layers[0].bias[6:], torch.ones(6))              # carry bias

    tensors = [torch.randn(2, 4, 3) * (k + 1) + k for k in range(3)]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    for layer_norm in (False, True):
        mix = ScalarMix(3, do_layer_norm=layer_norm, initial_scalar_parameters=[0.1, -0.5, 0.7])
        with torch.no_grad():
            mix.gamma.fill_(1.7)
        w = torch.softmax(torch.tensor([0.1, -0.5, 0.7]), 0)
        ref = 0
        for k, t in enumerate(tensors):
            if layer_norm:                   # over every non-padding element of the tensor
                vals = t[mask]
                t = (t - vals.mean()) / torch.sqrt(vals.var(unbiased=False) + 1e-12)
            ref = ref + w[k] * t
        assert_close(mix(tensors, mask), 1.7 * ref, name=f"scalar mix, layer norm {layer_norm}")


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_char_cnn_formula(activation):
    """AllenNLP's _ElmoCharacterEncoder, one token at a time: embed the characters, each
    filter's convolution max-pooled over the characters then the activation, concatenated,
    highway, projection; padding characters (id 0) embed to zero."""
    cfg = _config(activation=activation, add_sentence_boundaries=False)
    enc = ElmoBiLM(cfg).token_embedder.double()
    with torch.no_grad():
        for p in enc.parameters():
            p.copy_(torch.randn_like(p))
        enc.char_embedding.weight[0] = 0
    char_ids = batch_to_ids(SENTS, C)
    with torch.no_grad():
        got, mask, _ = enc(char_ids)
        act = torch.relu if activation == "relu" else torch.tanh
        for b, sent in enumerate(SENTS):
            for t in range(len(sent)):
                e = enc.char_embedding.weight[char_ids[b, t]]                # [C, d]
                feats = []
                for conv, (w, n) in zip(enc.convs, cfg.filters):
                    windows = torch.stack([e[s:s + w].t().reshape(-1)
                                           for s in range(C - w + 1)])     # [C - w + 1, d*w]
                    scores = windows @ conv.weight.reshape(n, -1).t() + conv.bias
                    feats.append(act(scores.max(0).values))                  # [n]
                x = enc.highways(torch.cat(feats))
                ref = x @ enc.projection.weight.t() + enc.projection.bias
                assert_close(got[b, t], ref, name=f"token {b}, {t} ({activation})")
    assert mask.sum(1).tolist() == [len(s) for s in SENTS]


def test_lm_dropout_drops_both_directions_states():
    """lm_dropout (training) applies to the forward and the backward states before their
    softmaxes: each head reads its half of the top layer, zeroed or scaled by 1 / (1 - p)."""
    model = ElmoBiLM(_config(lm_dropout=0.5, share_softmax=False)).to(DEVICE).train()
    seen = {}
    for name in ("softmax", "softmax_backward"):
        getattr(model, name).register_forward_hook(
            lambda m, i, o, name=name: seen.__setitem__(name, i[0].detach()))
    char_ids, word_ids = _inputs()
    out = model(char_ids, word_ids)
    top = out.activations[-1].detach()
    for name, half in (("softmax", top[..., :8]), ("softmax_backward", top[..., 8:])):
        got = seen[name]
        kept = got != 0
        assert (~kept & (half != 0)).any(), f"{name}: no state dropped"
        assert_close(got[kept], 2 * half[kept], name=f"{name}: kept states")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scalar_mix_layer_norm_at_16_bits(dtype):
    # the count of unpadded elements (64 tokens x 1,024 features = 65,536) was summed in
    # fp16, where it is inf (and 1e-12 is 0): the mix came out inf / NaN. Now within the
    # dtype's rounding of the fp32 mix.
    torch.manual_seed(0)
    tensors = [torch.randn(2, 40, 1024) * (k + 1) + k for k in range(3)]
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 36:] = False                                       # 76 tokens, 77,824 elements
    mix = ScalarMix(3, do_layer_norm=True, initial_scalar_parameters=[0.1, -0.5, 0.7])
    want = mix(tensors, mask)
    got = mix([t.to(dtype) for t in tensors], mask)
    assert got.isfinite().all()
    assert_close(got.float(), want, REL_TOL[dtype], name=f"scalar mix {dtype}")


def test_lstm_biases_start_as_allennlps():
    """AllenNLP's LstmCellWithProjection starts the forget gate's bias at 1 and every other
    bias at 0; in nn.LSTM's gate order (i, f, g, o) the forget gate is the second block.
    (Every other test loads or compares weights, so a wrong slice here showed nowhere.)"""
    model = ElmoBiLM(_config(cell_size=12)).to(DEVICE)
    H = 12
    layers = [*model.lstm.forward_layers, *model.lstm.backward_layers]
    assert len(layers) == 2 * model.config.n_layers
    for m in layers:
        forget = torch.zeros(4 * H, dtype=torch.bool, device=DEVICE)
        forget[H:2 * H] = True
        assert (m.bias_ih_l0[forget] == 1).all() and (m.bias_ih_l0[~forget] == 0).all()
        assert (m.bias_hh_l0 == 0).all()


@pytest.mark.parametrize("boundaries", [True, False])
@pytest.mark.parametrize("share", [True, False])
def test_bilm_losses_are_the_next_and_previous_token_nll(boundaries, share):
    """Forward: the state at a position predicts the next real token; backward: the
    previous one; each loss is the mean over its targets; loss = their average."""
    model = ElmoBiLM(_config(add_sentence_boundaries=boundaries, share_softmax=share)).to(DEVICE)
    char_ids, word_ids = _inputs()
    word_ids[0, 1] = -100                                        # ignored target
    out = model(char_ids, word_ids)
    top = out.activations[-1]
    off = 1 if boundaries else 0
    back = model.softmax if share else model.softmax_backward
    assert (model.softmax_backward is None) == share
    fwd, bwd = [], []
    for b, s in enumerate(SENTS):
        for k in range(len(s)):
            if int(word_ids[b, k]) == -100:
                continue
            p = k + off                                          # the token's position
            if p - 1 >= 0:                                        # predicted from the left
                fwd.append(F.cross_entropy(model.softmax(top[b, p - 1, :8])[None],
                                           word_ids[b, k][None]))
            if p + 1 < len(s) + 2 * off:                          # from the right
                bwd.append(F.cross_entropy(back(top[b, p + 1, 8:])[None], word_ids[b, k][None]))
    f, bk = torch.stack(fwd).mean(), torch.stack(bwd).mean()
    assert_close(out.forward_loss, f, name="forward loss")
    assert_close(out.backward_loss, bk, name="backward loss")
    assert_close(out.loss, (f + bk) / 2, name="loss")


# --------------------------------------------------------------------------- training, dropout

def test_one_optimizer_step_lowers_the_loss():
    model = ElmoBiLM(_config()).to(DEVICE)
    char_ids, word_ids = _inputs()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss0 = model(char_ids, word_ids).loss
    loss0.backward()
    opt.step()
    loss1 = model(char_ids, word_ids).loss
    assert loss1.item() < loss0.item(), (loss0.item(), loss1.item())


def test_dropout_on_weight_drop_once_per_forward_and_backends_agree_under_one_seed():
    """DropConnect (one mask per LSTM per forward, constant over time), LM dropout and the
    representation dropout: training runs, both backends draw the same masks."""
    kw = dict(weight_dropout=0.4, lm_dropout=0.3, dropout=0.5)
    fast, eager = Elmo(_config(backend="ctxfast", **kw)), Elmo(_config(backend="eager", **kw))
    fast, eager = fast.to(DEVICE), eager.to(DEVICE)
    eager.load_state_dict(fast.state_dict())
    calls = []
    lstms = [*fast.bilm.lstm.forward_layers, *fast.bilm.lstm.backward_layers]
    for m in lstms:
        sample = m.sample_weight_masks
        m.sample_weight_masks = lambda *a, _s=sample, **k: calls.append(1) or _s(*a, **k)
    char_ids, word_ids = _inputs()
    outs = []
    for model in (fast, eager):
        torch.manual_seed(3)
        out = model(char_ids, word_ids)
        (out.loss + out.elmo_representations[0].sum()).backward()
        outs.append(out)
    assert len(calls) == len(lstms)
    assert torch.isfinite(outs[0].loss)
    assert_close(outs[0].elmo_representations[0], outs[1].elmo_representations[0],
                 name="representation with dropout")
    assert_close(outs[0].loss, outs[1].loss, name="loss with dropout")
    for (n, p), (_, p_e) in zip(fast.named_parameters(), eager.named_parameters()):
        assert_close(p.grad, p_e.grad, name=f"grad {n}")
    rep = outs[0].elmo_representations[0][outs[0].mask]         # [tokens, 2P]
    assert (rep == 0).any() and (rep != 0).any()                # representation dropout
    fast.eval()
    a = fast(char_ids).elmo_representations[0]
    assert torch.equal(a, fast(char_ids).elmo_representations[0])   # eval: deterministic


# --------------------------------------------------------------------------- bad inputs

def test_bad_inputs_raise_naming_the_argument():
    model = Elmo(_config())
    char_ids, word_ids = (t.cpu() for t in _inputs())
    with pytest.raises(ValueError, match=r"char_ids must be in \[0, 262\)"):
        model(char_ids.masked_fill(char_ids == 98, 262))
    with pytest.raises(ValueError, match=r"char_ids must be in \[0, 262\)"):
        model(char_ids - 1)
    with pytest.raises(ValueError, match=r"char_ids must have shape \[B, T, "
                                         r"max_characters_per_token=8\]"):
        model(char_ids[0])
    with pytest.raises(ValueError, match=r"char_ids must have shape"):
        model(char_ids[..., :5])
    with pytest.raises(TypeError, match="char_ids"):
        model(char_ids.float())
    with pytest.raises(ValueError, match="right padding"):
        model(char_ids.flip(1))                                 # padding before tokens
    with pytest.raises(ValueError, match=r"word_ids must be in \[0, 19\)"):
        model(char_ids, word_ids.masked_fill(word_ids >= 0, V))
    with pytest.raises(ValueError, match=r"word_ids must have shape \[B, T\]"):
        model(char_ids, word_ids[:, :2])
    with pytest.raises(TypeError, match="word_ids"):
        model(char_ids, word_ids.float())
    with pytest.raises(ValueError, match="vocab_size=0"):
        Elmo(_config(vocab_size=0))(char_ids, word_ids)
    with pytest.raises(ValueError, match="filters"):
        Elmo(_config(filters=((9, 4),)))
    with pytest.raises(ValueError, match="projection_dim"):
        Elmo(_config(projection_dim=16))
    with pytest.raises(ValueError, match="backend"):
        Elmo(_config(backend="fast"))
    with pytest.raises(ValueError, match="expected 3 tensors"):
        model.scalar_mixes[0]([torch.zeros(1, 1, 16)] * 2)
    # the padding value ignored: word ids at padding positions are not checked
    ok = word_ids.clone()
    ok[2, 1:] = 10 ** 6
    assert torch.isfinite(model(char_ids, ok).loss)


def test_torch_export_gives_the_models_output():
    # ElmoOutput and ElmoBiLMOutput (lists of tensors and the mask) are registered
    # pytree nodes
    char_ids, word_ids = _inputs()
    assert_exports(Elmo(_config(num_output_representations=2)).to(DEVICE).eval(), (char_ids,))
    assert_exports(ElmoBiLM(_config()).to(DEVICE).eval(), (char_ids, word_ids))
