"""ctxfast.models.bert: backend="ctxfast" against backend="eager" (outputs and every
parameter's gradient, padded and packed paths), the packed (varlen) path against the
padded one, training and input checks. Toy sizes: Triton runs in the interpreter on CPU.

The "ctxfast" model runs under ``ctxfast.backend("triton")`` wherever the Triton kernels can
run, so the kernels themselves are compared with the eager reference.
"""
import contextlib

import pytest
import torch

import ctxfast
from ctxfast.models import Bert, BertConfig
from utils import DEVICE, assert_close, assert_exports

TRITON = ctxfast.why_unavailable("triton", DEVICE) is None
V = 41


def ops_backend():
    return ctxfast.backend("triton") if TRITON else contextlib.nullcontext()


def _config(**kw):
    base = dict(vocab_size=V, n_positions=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
                attn_dropout=0.0)
    base.update(kw)
    return BertConfig(**base)


def _batch(B=3, T=10):
    """Right-padded batch of random tokens with two segments, MLM and NSP labels."""
    ids = torch.randint(1, V, (B, T), device=DEVICE)
    lengths = torch.tensor([T, 7, 3][:B], device=DEVICE)
    am = (torch.arange(T, device=DEVICE)[None] < lengths[:, None]).long()  # [B, T]
    tt = (torch.arange(T, device=DEVICE)[None] >= (lengths[:, None] // 2)).long() * am
    mlm = torch.where(torch.rand(B, T, device=DEVICE) < 0.5, ids, torch.full_like(ids, -100))
    mlm = mlm.masked_fill(am == 0, -100)
    mlm[:, 0] = ids[:, 0]                                    # at least one target per row
    nsp = torch.randint(0, 2, (B,), device=DEVICE)
    return ids, tt, am, mlm, nsp


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_ctxfast_matches_eager_outputs_and_every_grad(varlen):
    fast = Bert(_config(varlen=varlen)).to(DEVICE)
    eager = Bert(_config(varlen=varlen, backend="eager")).to(DEVICE)
    eager.load_state_dict(fast.state_dict())
    ids, tt, am, mlm, nsp = _batch()
    with ops_backend():
        out = fast(ids, tt, am, mlm_labels=mlm, nsp_labels=nsp)
        out.loss.backward()
    ref = eager(ids, tt, am, mlm_labels=mlm, nsp_labels=nsp)
    ref.loss.backward()
    keep = am.bool()
    assert_close(out.last_hidden_state[keep], ref.last_hidden_state[keep], name="hidden")
    assert_close(out.pooler_output, ref.pooler_output, name="pooled")
    assert_close(out.mlm_logits[keep], ref.mlm_logits[keep], name="mlm_logits")
    assert_close(out.nsp_logits, ref.nsp_logits, name="nsp_logits")
    assert_close(out.loss, ref.loss, name="loss")
    g, g_e = _grads(fast), _grads(eager)
    n_params = len(list(fast.parameters()))
    assert len(g) == len(g_e) == n_params, "every parameter must get a gradient"
    for name in g:
        assert_close(g[name], g_e[name], name=f"grad {name}")


def test_varlen_equals_padded_path():
    """Packed sequences give the padded path's outputs, loss and gradients (right padding;
    the loss reads only real tokens and the [CLS] position)."""
    model = Bert(_config()).to(DEVICE)
    ids, tt, am, mlm, nsp = _batch()
    results = []
    for varlen in (False, True):
        model.zero_grad()
        with ops_backend():
            out = model(ids, tt, am, mlm_labels=mlm, nsp_labels=nsp, varlen=varlen)
            out.loss.backward()
        results.append((out, _grads(model)))
    (pad, g_pad), (var, g_var) = results
    keep = am.bool()
    assert_close(var.last_hidden_state[keep], pad.last_hidden_state[keep], name="hidden")
    assert (var.last_hidden_state[~keep] == 0).all()         # padding comes back as zeros
    assert_close(var.pooler_output, pad.pooler_output, name="pooled")
    assert_close(var.loss, pad.loss, name="loss")
    assert g_pad.keys() == g_var.keys()
    for name in g_pad:
        assert_close(g_var[name], g_pad[name], name=f"grad {name}")


def test_varlen_left_padding_and_empty_row():
    """Padding anywhere (left here) and a row without tokens: real tokens still match."""
    model = Bert(_config(n_layer=1, add_nsp_head=False, add_pooler=False)).to(DEVICE).eval()
    ids = torch.randint(1, V, (3, 6), device=DEVICE)
    am = torch.ones(3, 6, dtype=torch.bool, device=DEVICE)
    am[0, :2] = False                                        # left padding
    am[1, 1:5:2] = False                                     # holes
    am[2] = False                                            # no token at all
    with torch.no_grad(), ops_backend():
        pad = model(ids, attention_mask=am).last_hidden_state
        var = model(ids, attention_mask=am, varlen=True).last_hidden_state
    assert_close(var[am], pad[am], name="hidden")
    assert (var[~am] == 0).all()


def test_varlen_with_pooler_refuses_left_padding():
    """With a pooler (it reads position 0, [CLS]) the varlen path, which does not compute
    padded positions, refuses a row whose position 0 is padding but that has tokens (left
    padding: the pooled output would be tanh(bias) of zeros), naming the row; right
    padding and rows without tokens run, and the pooled output equals the padded path's."""
    model = Bert(_config(n_layer=1)).to(DEVICE).eval()
    ids = torch.randint(1, V, (3, 6), device=DEVICE)
    am = torch.ones(3, 6, dtype=torch.bool, device=DEVICE)
    am[0, 4:] = False                                        # right padding
    am[1] = False                                            # no token at all
    with torch.no_grad(), ops_backend():
        pad = model(ids, attention_mask=am)
        var = model(ids, attention_mask=am, varlen=True)
        assert_close(var.pooler_output[[0, 2]], pad.pooler_output[[0, 2]], name="pooled")
        am[2, :2] = False                                    # left padding in row 2
        with pytest.raises(ValueError, match=r"position 0 of rows \[2\] is padding"):
            model(ids, attention_mask=am, varlen=True)
        model(ids, attention_mask=am)                        # the padded path takes it


def test_mask_of_ones_equals_no_mask_and_config_varlen():
    model = Bert(_config(n_layer=1)).to(DEVICE).eval()
    ids = torch.randint(0, V, (2, 5), device=DEVICE)
    ones = torch.ones(2, 5, dtype=torch.long, device=DEVICE)
    with torch.no_grad(), ops_backend():
        a = model(ids).last_hidden_state
        b = model(ids, attention_mask=ones).last_hidden_state
        c = model(ids, attention_mask=ones, varlen=True).last_hidden_state
        d = model(ids, torch.zeros_like(ids)).last_hidden_state   # default type 0
    assert_close(b, a, name="mask of ones")
    assert_close(c, a, name="varlen, mask of ones")
    assert_close(d, a, name="token_type_ids=0")


def test_length_one_and_empty_batch():
    model = Bert(_config(n_layer=1)).to(DEVICE).eval()
    ids = torch.randint(0, V, (2, 1), device=DEVICE)
    with torch.no_grad(), ops_backend():
        for varlen in (False, True):
            out = model(ids, attention_mask=torch.ones_like(ids), varlen=varlen)
            assert out.last_hidden_state.shape == (2, 1, 32)
            empty = model(ids[:0], attention_mask=torch.ones_like(ids[:0]), varlen=varlen)
            assert empty.last_hidden_state.shape == (0, 1, 32)
    with pytest.raises(ValueError, match="at least one token"):
        model(ids[:, :0])


def test_heads_and_tied_decoder():
    model = Bert(_config())
    assert model.mlm.decoder.weight is model.embeddings.word.weight
    bare = Bert(_config(add_pooler=False, add_mlm_head=False, add_nsp_head=False))
    out = bare(torch.randint(0, V, (2, 4)))
    assert out.pooler_output is None and out.mlm_logits is None and out.nsp_logits is None
    with pytest.raises(ValueError, match="add_nsp_head needs add_pooler"):
        Bert(_config(add_pooler=False))
    with pytest.raises(ValueError, match="no MLM head"):
        bare(torch.randint(0, V, (2, 4)), mlm_labels=torch.zeros(2, 4, dtype=torch.long))


def test_one_optimizer_step_lowers_the_loss():
    model = Bert(_config()).to(DEVICE)
    ids, tt, am, mlm, nsp = _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with ops_backend():
        loss0 = model(ids, tt, am, mlm_labels=mlm, nsp_labels=nsp).loss
        loss0.backward()
        opt.step()
        loss1 = model(ids, tt, am, mlm_labels=mlm, nsp_labels=nsp).loss
    assert loss1.item() < loss0.item(), (loss0.item(), loss1.item())


def test_bad_inputs_raise_clear_errors():
    model = Bert(_config(n_layer=1))
    ids = torch.randint(0, V, (2, 5))
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 41\)"):
        model(torch.tensor([[0, V]]))
    with pytest.raises(ValueError, match="n_positions"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[B, T\] = \[2, 5\]"):
        model(ids, attention_mask=torch.ones(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask must hold only 0"):
        model(ids, attention_mask=torch.full((2, 5), 2))
    with pytest.raises(TypeError, match="attention_mask must be a bool or integer"):
        model(ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"token_type_ids must be in \[0, 2\) \(type_vocab_size\)"):
        model(ids, torch.full((2, 5), 2))
    with pytest.raises(ValueError, match="token_type_ids must have the shape of input_ids"):
        model(ids, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mlm_labels must have shape \[2, 5\]"):
        model(ids, mlm_labels=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="nsp_labels must be in"):
        model(ids, nsp_labels=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="backend"):
        Bert(_config(backend="cuda"))


def test_inputs_on_another_device_are_refused():
    """Meta input_ids or token_type_ids gave NaN outputs on CPU."""
    model = Bert(_config(n_layer=1))
    ids = torch.randint(0, V, (2, 5))
    with pytest.raises(ValueError, match="input_ids is on meta, the model on cpu"):
        model(ids.to("meta"))
    with pytest.raises(ValueError, match="token_type_ids is on meta, the model on cpu"):
        model(ids, torch.zeros_like(ids).to("meta"))
    with pytest.raises(ValueError, match="mlm_labels is on meta, the model on cpu"):
        model(ids, mlm_labels=ids.to("meta"))
    with pytest.raises(ValueError, match="nsp_labels is on meta, the model on cpu"):
        model(ids, nsp_labels=torch.zeros(2, dtype=torch.long, device="meta"))


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
def test_varlen_torch_compile_fullgraph_forward_backward(backend):
    """The packed path under torch.compile(fullgraph=True): packing makes the total and
    max_seqlen values traced from data. The ctxfast model on a GPU is compiled as users
    compile it (inductor); on a CPU through dynamo and AOT autograd only, where the graph
    breaks were (inductor's C++ build of the CPU graph takes ~45 s here). The eager model's
    attention is a batched matmul over the packed rows, and inductor (torch 2.13) cannot
    lower a bmm whose size was traced from data: it runs without inductor everywhere."""
    compiler = "inductor" if backend == "ctxfast" and DEVICE == "cuda" else "aot_eager"
    torch._dynamo.reset()
    model = Bert(_config(n_layer=1, varlen=True, backend=backend)).to(DEVICE)
    ref = Bert(_config(n_layer=1, varlen=True, backend=backend)).to(DEVICE)
    ref.load_state_dict(model.state_dict())
    ids, tt, am, mlm, nsp = _batch()
    with torch._dynamo.config.patch(capture_scalar_outputs=True,
                                    capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(model, fullgraph=True, backend=compiler)
        with ops_backend():
            out = compiled(ids, tt, am, mlm_labels=mlm, nsp_labels=nsp)
            out.loss.backward()
    with ops_backend():
        out_ref = ref(ids, tt, am, mlm_labels=mlm, nsp_labels=nsp)
        out_ref.loss.backward()
    assert_close(out.loss.detach(), out_ref.loss.detach(), name="loss")
    g, g_ref = _grads(model), _grads(ref)
    assert g.keys() == g_ref.keys()
    for name in g:
        assert_close(g[name], g_ref[name], name=f"grad {name}")


def test_torch_export_gives_the_models_output():
    # BertOutput is a registered pytree node: torch.export sees its tensors (it refused
    # the output's type before)
    model = Bert(_config()).to(DEVICE).eval()
    assert_exports(model, (torch.randint(0, model.config.vocab_size, (2, 7), device=DEVICE),))
