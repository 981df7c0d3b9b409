"""ctxfast.models.transformer_xl: the original MemTransformerLM computation (written out
below from the paper's code: [q, k, b, n] einsums, pad-and-view shift, masks) on the same
state_dict; ctxfast kernels vs eager (outputs and every gradient); memory; checkpoints;
torch.compile; bad inputs; adaptive softmax; generate."""
import contextlib
import math
import re

import pytest
import torch
import torch.nn.functional as F

import ctxfast
from ctxfast.models.transformer_xl import TransformerXL, TransformerXLConfig
from utils import DEVICE, TRITON_ON_CPU, assert_close, owns_storage, rel_err

HAS_TRITON = TRITON_ON_CPU or torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")


def tiny(**kw):
    base = dict(n_token=37, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=48,
                dropout=0.0, dropatt=0.0, tgt_len=8, mem_len=8)
    return TransformerXLConfig(**{**base, **kw})


def ids(T, B, n=37, device="cpu"):
    return torch.randint(0, n, (T, B), device=device)


# --------------------------------------------------------------------------- the original

def _orig_rel_shift(x):
    """The original _rel_shift on the [qlen, klen, bsz, n_head] layout."""
    zero_pad = x.new_zeros((x.size(0), 1, *x.size()[2:]))
    x_padded = torch.cat([zero_pad, x], 1).view(x.size(1) + 1, x.size(0), *x.size()[2:])
    return x_padded[1:].view_as(x)


def original_forward(sd, c, data, mems):
    """MemTransformerLM._forward + the softmax head, functional, from the state_dict
    (attn_type 0, div_val 1, no cutoffs; dropout off). Returns (log-probs [T, B, V], hids)."""
    d_embed = sd["word_emb.emb_layers.0.weight"].shape[1]
    emb = sd["word_emb.emb_layers.0.weight"][data]
    if "word_emb.emb_projs.0" in sd:
        emb = F.linear(emb, sd["word_emb.emb_projs.0"])
    emb = emb * c.d_model ** 0.5
    qlen, bsz = data.shape
    mlen = mems[0].size(0) if mems else 0
    klen = mlen + qlen
    ones = emb.new_ones(qlen, klen)
    if c.same_length:
        mask_len = klen - c.mem_len
        shift = qlen - mask_len if mask_len > 0 else qlen
        mask = (torch.triu(ones, 1 + mlen) + torch.tril(ones, -shift)).bool()
    else:
        mask = torch.triu(ones, 1 + mlen).bool()
    pos_seq = torch.arange(klen - 1, -1, -1.0)
    if c.clamp_len > 0:
        pos_seq.clamp_(max=c.clamp_len)
    sinus = torch.ger(pos_seq, sd["pos_emb.inv_freq"])
    pos_emb = torch.cat([sinus.sin(), sinus.cos()], -1)            # [klen, d_model]
    H, Dh = c.n_head, c.d_head
    core, hids = emb, [emb]
    for i in range(c.n_layer):
        p = f"layers.{i}."
        ln = lambda x, n: F.layer_norm(  # noqa: E731
            x, (c.d_model,), sd[p + n + ".weight"], sd[p + n + ".bias"])
        rwb = sd[p + "dec_attn.r_w_bias"] if c.untie_r else sd["r_w_bias"]
        rrb = sd[p + "dec_attn.r_r_bias"] if c.untie_r else sd["r_r_bias"]
        cat = torch.cat([mems[i], core], 0) if mems else core
        heads = F.linear(ln(cat, "dec_attn.layer_norm") if c.pre_lnorm else cat,
                         sd[p + "dec_attn.qkv_net.weight"])
        q, k, v = torch.chunk(heads, 3, -1)
        q = q[-qlen:].reshape(qlen, bsz, H, Dh)
        k, v = k.reshape(klen, bsz, H, Dh), v.reshape(klen, bsz, H, Dh)
        rk = F.linear(pos_emb, sd[p + "dec_attn.r_net.weight"]).view(klen, H, Dh)
        ac = torch.einsum("ibnd,jbnd->ijbn", q + rwb, k)
        bd = _orig_rel_shift(torch.einsum("ibnd,jnd->ijbn", q + rrb, rk))
        score = ((ac + bd) / math.sqrt(Dh)).masked_fill(mask[:, :, None, None], float("-inf"))
        prob = F.softmax(score, 1)
        vec = torch.einsum("ijbn,jbnd->ibnd", prob, v).reshape(qlen, bsz, H * Dh)
        out = F.linear(vec, sd[p + "dec_attn.o_net.weight"])
        core = core + out if c.pre_lnorm else ln(core + out, "dec_attn.layer_norm")
        ff_in = ln(core, "pos_ff.layer_norm") if c.pre_lnorm else core
        ff = F.linear(F.relu(F.linear(ff_in, sd[p + "pos_ff.CoreNet.0.weight"],
                                      sd[p + "pos_ff.CoreNet.0.bias"])),
                      sd[p + "pos_ff.CoreNet.3.weight"], sd[p + "pos_ff.CoreNet.3.bias"])
        core = core + ff if c.pre_lnorm else ln(core + ff, "pos_ff.layer_norm")
        hids.append(core)
    h = core
    if "crit.out_projs.0" in sd:
        h = F.linear(h, sd["crit.out_projs.0"].t())
    logits = F.linear(h, sd["crit.out_layers.0.weight"], sd["crit.out_layers.0.bias"])
    assert logits.shape[-1] == sd["word_emb.emb_layers.0.weight"].shape[0] and d_embed > 0
    return F.log_softmax(logits, -1), hids


def original_names(n_layer, untie_r=False, proj=False):
    """The keys of MemTransformerLM(attn_type=0, div_val=1, no cutoffs).state_dict()."""
    names = ["word_emb.emb_layers.0.weight", "pos_emb.inv_freq", "crit.out_layers.0.weight",
             "crit.out_layers.0.bias"]
    if proj:
        names += ["word_emb.emb_projs.0", "crit.out_projs.0"]
    if not untie_r:
        names += ["r_w_bias", "r_r_bias"]
    for i in range(n_layer):
        p = f"layers.{i}."
        names += [p + "dec_attn.qkv_net.weight", p + "dec_attn.o_net.weight",
                  p + "dec_attn.r_net.weight", p + "dec_attn.layer_norm.weight",
                  p + "dec_attn.layer_norm.bias", p + "pos_ff.CoreNet.0.weight",
                  p + "pos_ff.CoreNet.0.bias", p + "pos_ff.CoreNet.3.weight",
                  p + "pos_ff.CoreNet.3.bias", p + "pos_ff.layer_norm.weight",
                  p + "pos_ff.layer_norm.bias"]
        if untie_r:
            names += [p + "dec_attn.r_w_bias", p + "dec_attn.r_r_bias"]
    return names


def synth_original_state_dict(c, d_embed=None):
    """Random tensors under the original names and shapes (as a checkpoint would hold)."""
    d_embed = d_embed or c.d_model
    V, D, H, Dh, F_ = c.n_token, c.d_model, c.n_head, c.d_head, c.d_inner
    shapes = {"word_emb.emb_layers.0.weight": (V, d_embed), "crit.out_layers.0.bias": (V,),
              "crit.out_layers.0.weight": (V, d_embed),
              "word_emb.emb_projs.0": (D, d_embed), "crit.out_projs.0": (D, d_embed),
              "r_w_bias": (H, Dh), "r_r_bias": (H, Dh)}
    per_layer = {"dec_attn.qkv_net.weight": (3 * H * Dh, D), "dec_attn.o_net.weight": (D, H * Dh),
                 "dec_attn.r_net.weight": (H * Dh, D), "dec_attn.layer_norm.weight": (D,),
                 "dec_attn.layer_norm.bias": (D,), "pos_ff.CoreNet.0.weight": (F_, D),
                 "pos_ff.CoreNet.0.bias": (F_,), "pos_ff.CoreNet.3.weight": (D, F_),
                 "pos_ff.CoreNet.3.bias": (D,), "pos_ff.layer_norm.weight": (D,),
                 "pos_ff.layer_norm.bias": (D,), "dec_attn.r_w_bias": (H, Dh),
                 "dec_attn.r_r_bias": (H, Dh)}
    sd = {}
    for name in original_names(c.n_layer, c.untie_r, d_embed != D):
        if name == "pos_emb.inv_freq":
            sd[name] = 1 / (10000 ** (torch.arange(0.0, D, 2.0) / D))
            continue
        shape = shapes.get(name) or per_layer[name.split(".", 2)[2]]
        sd[name] = torch.randn(shape) * (0.3 if len(shape) == 2 else 0.1)
        if name.endswith("layer_norm.weight"):
            sd[name] += 1
    sd["crit.out_layers.0.weight"] = sd["word_emb.emb_layers.0.weight"]     # tie_weight
    if d_embed != D:
        sd["crit.out_projs.0"] = sd["word_emb.emb_projs.0"]                 # tie_projs
    return sd


# --------------------------------------------------------------------------- names, loading

@pytest.mark.parametrize("untie_r, d_embed", [(False, None), (True, 24)])
def test_parameter_names_are_the_originals(untie_r, d_embed):
    c = tiny(untie_r=untie_r, d_embed=d_embed, tie_projs=(True,))
    model = TransformerXL(c)
    assert set(model.state_dict()) == set(original_names(c.n_layer, untie_r, d_embed is not None))
    if d_embed is not None:
        assert model.crit.out_projs[0] is model.word_emb.emb_projs[0]
    assert model.crit.out_layers[0].weight is model.word_emb.emb_layers[0].weight


@pytest.mark.parametrize("case", ["post_ln", "pre_ln_untied_r_proj_clamp", "same_length"])
def test_loads_original_state_dict_and_computes_the_original(case):
    """A state_dict under the original names loads (strict) and, with memory, the model
    gives the original computation's log-probabilities, new mems and hidden states."""
    kw = {"post_ln": {}, "same_length": dict(same_length=True, mem_len=6),
          "pre_ln_untied_r_proj_clamp": dict(pre_lnorm=True, untie_r=True, clamp_len=5)}[case]
    c = tiny(**kw)
    d_embed = 24 if case.startswith("pre_ln") else None
    sd = synth_original_state_dict(c, d_embed)
    over = {**dict(backend="eager", dropout=0.0, mem_len=c.mem_len, tgt_len=c.tgt_len,
                   pre_lnorm=c.pre_lnorm), **kw}
    model = TransformerXL.from_state_dict(sd, **over).eval()
    assert model.config.untie_r == c.untie_r and model.d_embed == (d_embed or c.d_model)
    x1, x2 = ids(7, 3), ids(5, 3)
    with torch.no_grad():
        lp1, mems = model(x1)
        ref1, hids1 = original_forward(sd, c, x1, [])
        lp2, mems2 = model(x2, None, *mems)
        ref_mems = [h[-c.mem_len:] for h in hids1]
        ref2, hids2 = original_forward(sd, c, x2, ref_mems)
    assert_close(lp1, ref1, name="segment 1")
    assert_close(lp2, ref2, name="segment 2 (with memory)")
    for i, (m, h, prev) in enumerate(zip(mems2, hids2, ref_mems)):
        assert_close(m, torch.cat([prev, h], 0)[-c.mem_len:], name=f"mems[{i}]")


def test_load_refuses_missing_and_wrong_names():
    c = tiny()
    sd = synth_original_state_dict(c)
    model = TransformerXL(c)
    bad = dict(sd)
    bad["layers.0.dec_attn.qkv.weight"] = bad.pop("layers.0.dec_attn.qkv_net.weight")
    with pytest.raises(RuntimeError, match="qkv_net"):
        model.load_state_dict(bad)
    with pytest.raises(ValueError, match="not a Transformer-XL"):
        TransformerXL.from_state_dict({"foo": torch.zeros(1)})


def test_a_tie_override_refuses_an_untied_checkpoint():
    """tie_weight=True over a checkpoint whose output layer is not its embedding loaded
    both into the one parameter and kept the last (log-probs off by 0.63): refused now."""
    c = tiny()
    sd = synth_original_state_dict(c)
    sd["crit.out_layers.0.weight"] = torch.randn_like(sd["word_emb.emb_layers.0.weight"])
    over = dict(mem_len=c.mem_len, pre_lnorm=False)
    assert not TransformerXL.from_state_dict(sd, **over).config.tie_weight      # as stored
    with pytest.raises(ValueError, match="ties crit.out_layers.0.weight and "
                                         "word_emb.emb_layers.0.weight|ties word_emb"):
        TransformerXL.from_state_dict(sd, tie_weight=True, **over)


@pytest.mark.parametrize("field, value", [("d_model", 33), ("dropout", 1.5),
                                          ("dropatt", 1.0), ("dropatt", -0.1)])
def test_config_refuses_bad_values_by_name(field, value):
    with pytest.raises(ValueError, match=f"TransformerXLConfig.{field} must"):
        TransformerXL(tiny(**{field: value, **({"d_head": 11} if field == "d_model" else {})}))


# --------------------------------------------------------------------------- kernels vs eager

def _grads_of(model, x, y, mems):
    model.zero_grad()
    loss, new = model(x, y, *mems)
    g = torch.randn(loss.shape, generator=torch.Generator().manual_seed(0)).to(loss.device)
    (loss * g).sum().backward()
    return loss.detach(), new, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case, kernels", [
    pytest.param(dict(), True, id="kernels-post_ln", marks=needs_triton),
    pytest.param(dict(same_length=True, mem_len=7), True, id="kernels-same_length",
                 marks=needs_triton),
    pytest.param(dict(pre_lnorm=True, untie_r=True, clamp_len=4, d_embed=24,
                      tie_projs=(True,)), False, id="dispatch-default-pre_ln-untie_r-clamp"),
])
def test_ctxfast_matches_eager_outputs_and_every_gradient(case, kernels):
    """With dropout off, backend="ctxfast" (the Triton kernels under the interpreter, or
    ctxfast's default dispatch) and "eager" give the same loss, new mems and gradient of
    every parameter, over a segment with memory (same_length: 11 keys, a window of 7)."""
    model = TransformerXL(tiny(**case)).to(DEVICE)
    x, y, mem_x = (ids(t, 2, device=DEVICE) for t in (6, 6, 5))
    with torch.no_grad():
        _, mems = model(mem_x)                    # a memory of 5 steps
    model.set_backend("eager")
    ref_loss, ref_mems, ref_grads = _grads_of(model, x, y, mems)
    model.set_backend("ctxfast")
    with (ctxfast.backend("triton") if kernels else contextlib.nullcontext()):
        loss, new, grads = _grads_of(model, x, y, mems)
    assert_close(loss, ref_loss, name="loss")
    for i, (a, b) in enumerate(zip(new, ref_mems)):
        assert_close(a, b, name=f"mems[{i}]")
    assert set(grads) == set(ref_grads)
    for name in grads:
        assert grads[name].abs().sum() > 0, f"{name}: zero gradient (test would be vacuous)"
        assert_close(grads[name], ref_grads[name], name=f"grad {name}")


def test_one_optimizer_step_lowers_the_loss():
    model = TransformerXL(tiny(dropout=0.1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = ids(8, 4), ids(8, 4)
    model.eval()
    with torch.no_grad():
        before = model(x, y)[0].mean().item()
    model.train()
    opt.zero_grad()
    model(x, y)[0].mean().backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        after = model(x, y)[0].mean().item()
    assert after < before - 1e-3, (before, after)


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
def test_attention_dropout_rate_set_on_the_module_is_used(backend):
    """The original train.py changes the rate by ``layer.dec_attn.dropatt.p = x``
    (update_dropatt): every backend must use it, not the rate the model was built with."""
    model = TransformerXL(tiny(dropatt=0.5, backend=backend)).train()
    x, y = ids(8, 3), ids(8, 3)

    def loss(seed):
        torch.manual_seed(seed)
        return model(x, y)[0].mean()
    assert loss(1) != loss(2), "dropatt 0.5 gave the same loss under two seeds (vacuous)"
    for m in model.modules():
        if hasattr(m, "dropatt"):
            m.dropatt.p = 0.0
    model.eval()
    with torch.no_grad():
        ref = model(x, y)[0].mean()
    model.train()
    assert loss(1) == loss(2)
    assert_close(loss(1), ref, name="loss")


# --------------------------------------------------------------------------- memory

@pytest.mark.parametrize("mem_len", [6, 12, 20])
def test_memory_holds_only_its_rows(mem_len):
    """Each memory is its rows alone: a view of [mems; hidden] kept the whole of it alive
    (2x-5x the memory, every layer, between training steps)."""
    model = TransformerXL(tiny(mem_len=mem_len)).train()
    mems = []
    for _ in range(3):
        loss, mems = model(ids(8, 2), ids(8, 2), *mems)
        loss.mean().backward()
        assert all(m.shape[0] == min(mem_len, 8 * (_ + 1)) for m in mems)
        assert all(owns_storage(m) for m in mems)


@pytest.mark.parametrize("ext_len", [0, 2])
def test_memory_is_the_last_mem_len_hidden_states_detached(ext_len):
    # with ext_len, the original's _update_mems: the mem_len steps before the segment's
    # last ext_len (end = mlen + max(0, qlen - ext_len), begin = max(0, end - mem_len))
    model = TransformerXL(tiny(mem_len=6, ext_len=ext_len))
    outs = {}
    model.word_emb.register_forward_hook(lambda m, i, o: outs.__setitem__(0, o))
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, inp, o, i=i: outs.__setitem__(i + 1, o))
    mems = model.init_mems()
    assert len(mems) == 3 and all(m.numel() == 0 for m in mems)
    prev = None
    for T in (4, 5, 3):                            # memory fills up, then slides
        x = ids(T, 2)
        loss, new = model(x, x, *mems)
        assert len(new) == model.n_layer + 1
        for i, m in enumerate(new):
            h = outs[i]
            full = h if prev is None else torch.cat([prev[i], h], 0)
            end = full.shape[0] - h.shape[0] + max(0, h.shape[0] - ext_len)
            assert_close(m, full[max(0, end - 6):end], name=f"mems[{i}]")
            assert m.shape[0] == min(6, end)
            assert not m.requires_grad and m.grad_fn is None, "mems must be detached"
        loss.sum().backward()                       # the graph does not reach old segments
        prev = mems = new


def test_segments_with_memory_equal_one_long_segment():
    """With mem_len covering the whole past, the log-probs of consecutive segments equal
    one forward of the concatenation (relative positions line up across segments)."""
    model = TransformerXL(tiny(mem_len=20)).eval()
    x = ids(15, 2)
    with torch.no_grad():
        full, _ = model(x)
        parts, mems = [], model.init_mems()
        for s in range(0, 15, 4):
            lp, mems = model(x[s:s + 4], None, *mems)
            parts.append(lp)
    assert_close(torch.cat(parts), full)


def test_ext_len_and_mem_len_zero():
    model = TransformerXL(tiny(mem_len=0))
    assert model.init_mems() == []
    assert model(ids(5, 2))[1] == []
    model.reset_length(tgt_len=4, ext_len=2, mem_len=3)
    _, mems = model(ids(6, 2))
    assert [m.shape[0] for m in mems] == [3] * 3                     # steps 1..3 (before ext)


def test_a_shorter_target_scores_the_last_positions():
    """target ``[tgt_len, B]`` with tgt_len < T is the next token of the *last* tgt_len
    positions (the original's ``hidden[-tgt_len:]``): its loss is the log-probabilities of
    those positions, memory or not."""
    model = TransformerXL(tiny(mem_len=6)).eval()
    x, y = ids(7, 2), ids(3, 2)
    with torch.no_grad():
        for mems in ([], model(ids(4, 2))[1]):
            lp, _ = model(x, None, *mems)                           # [7, 2, V]
            loss, _ = model(x, y, *mems)                            # [3, 2]
            assert_close(loss, -lp[-3:].gather(2, y[..., None])[..., 0],
                         name=f"loss of the last 3 of 7 positions, mlen {len(mems) and 4}")


@needs_triton
def test_same_length_runs_on_the_kernels_over_segments():
    """same_length (the paper's evaluation setting) on the Triton kernels equals eager over
    three segments, and the window matters (the output differs from same_length=False)."""
    model = TransformerXL(tiny(same_length=True, mem_len=4)).to(DEVICE).eval()
    with torch.no_grad():               # unit-variance scores: at std 0.02 attention is ~uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    xs = [ids(3, 2, device=DEVICE) for _ in range(3)]
    outs = {}
    with torch.no_grad():
        for name in ("ctxfast", "eager", "no-window"):
            model.set_backend("eager" if name == "eager" else "ctxfast")
            model.same_length = name != "no-window"
            mems, outs[name] = [], []
            with ctxfast.backend("triton"):
                for x in xs:
                    lp, mems = model(x, None, *mems)
                    outs[name].append(lp)
    for i, (a, b) in enumerate(zip(outs["ctxfast"], outs["eager"])):
        assert_close(a, b, name=f"segment {i}")
    assert rel_err(outs["ctxfast"][2], outs["no-window"][2]) > 1e-3


# --------------------------------------------------------------------------- compile

@needs_triton
def test_torch_compile_fullgraph_forward_backward():
    """torch.compile(model, fullgraph=True) (the default inductor backend) runs the
    forward and backward with the ctxfast kernels and no graph break; same gradients as
    eager."""
    torch._dynamo.reset()
    model = TransformerXL(tiny(n_layer=1))
    x, y = ids(4, 1), ids(4, 1)
    with torch.no_grad():
        _, mems = model(ids(3, 1))
    compiled = torch.compile(model, fullgraph=True)
    with ctxfast.backend("triton"):
        loss, new = compiled(x, y, *mems)
        loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_backend("eager")
    ref, ref_new = model(x, y, *mems)
    ref.sum().backward()
    assert_close(loss.detach(), ref.detach(), name="loss")
    assert_close(new[-1], ref_new[-1], name="mems[-1]")
    for n, p in model.named_parameters():
        assert_close(grads[n], p.grad, name=f"grad {n}")


# --------------------------------------------------------------------------- bad inputs

def _bad_calls():
    c = tiny()
    m = lambda L, B=2: torch.randn(L, B, c.d_model)  # noqa: E731
    good = [m(3)] * 3
    V = ValueError
    yield "id-too-large", (torch.full((4, 2), 37),), V, "data must hold ids in [0, n_token=37)"
    yield "negative-id", (torch.full((4, 2), -1),), V, "data must hold ids"
    yield "target-out-of-range", (ids(4, 2), torch.full((4, 2), 99)), V, "target must hold ids"
    yield "float-data", (torch.randn(4, 2),), TypeError, "data must be an integer tensor"
    yield "1-d-data", (ids(4, 2)[:, 0],), V, "data must have shape [T, B]"
    yield "empty-data", (ids(0, 2),), V, "data must have shape [T, B] (time-major, T, B >= 1)"
    yield "target-longer", (ids(4, 2), ids(5, 2)), V, "target must have shape [tgt_len, B]"
    yield "mems-count", (ids(4, 2), None, *good[:2]), V, "mems must be n_layer + 1 = 3"
    yield "mems-batch", (ids(4, 2), None, m(3), m(3), m(3, B=3)), V, "mems[2] must have shape"
    yield "mems-width", (ids(4, 2), None, m(3), torch.randn(3, 2, 8), m(3)), ValueError, "mems[1]"
    yield "mems-lengths-differ", (ids(4, 2), None, m(3), m(4), m(3)), ValueError, "same mlen"
    yield "mems-too-long", (ids(4, 2), None, m(9), m(9), m(9)), ValueError, "mem_len=8"
    yield "mems-not-tensor", (ids(4, 2), None, m(3), m(3), [1.0]), ValueError, "mems[2]"


@pytest.mark.parametrize("args, exc, msg", [pytest.param(*c[1:], id=c[0]) for c in _bad_calls()])
def test_bad_inputs_name_the_argument(args, exc, msg):
    model = TransformerXL(tiny())
    with pytest.raises(exc, match=re.escape(msg)):
        model(*args)


def test_bad_config_and_arguments():
    with pytest.raises(ValueError, match="backend must be one of"):
        TransformerXL(tiny(backend="triton"))
    with pytest.raises(ValueError, match="cutoffs"):
        TransformerXL(tiny(cutoffs=(20, 10)))
    with pytest.raises(ValueError, match="n_head"):
        TransformerXL(tiny(n_head=0))
    with pytest.raises(ValueError, match="reuse_kv must be a bool, got 'yes'"):
        TransformerXL(tiny(reuse_kv="yes"))
    model = TransformerXL(tiny())
    with pytest.raises(ValueError, match="last must be"):
        model.log_probs(ids(4, 1), last=5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(ids(2, 1), -1)


def test_inputs_on_another_device_are_refused():
    """Meta data (or target) gave garbage log-probabilities and losses on CPU."""
    model = TransformerXL(tiny())
    x = ids(4, 2)
    for call in (lambda: model(x.to("meta")), lambda: model.forward_hidden(x.to("meta")),
                 lambda: model.log_probs(x.to("meta")),
                 lambda: model.log_probs(x.to("meta"), validate=False),
                 lambda: model.generate(x.to("meta"), 1)):
        with pytest.raises(ValueError, match=r"TransformerXL: (data|prompt) is on meta, the "
                                             r"model on cpu"):
            call()
    with pytest.raises(ValueError, match="TransformerXL: target is on meta, the model on cpu"):
        model(x, x.to("meta"))


# --------------------------------------------------------------------------- adaptive softmax

@pytest.mark.parametrize("div_val", [1, 2])
def test_adaptive_embedding_and_softmax(div_val):
    c = tiny(n_token=60, cutoffs=(10, 30), div_val=div_val, d_embed=32,
             tie_projs=(False, True, True))
    model = TransformerXL(c).eval()
    names = set(model.state_dict())
    assert {"crit.cluster_weight", "crit.cluster_bias"} <= names
    if div_val == 2:
        assert {"word_emb.emb_layers.2.weight", "crit.out_projs.2", "word_emb.emb_projs.1"} <= names
        assert model.word_emb.emb_layers[2].weight.shape == (30, 8)
        assert model.crit.out_projs[1] is model.word_emb.emb_projs[1]
    x = torch.randint(0, 60, (5, 2))
    with torch.no_grad():
        lp, _ = model(x)
        nll, _ = model(x, x)
    assert_close(lp.logsumexp(-1), torch.zeros(5, 2), tol=1e-5, name="normalised")
    assert_close(nll, -lp.gather(2, x[..., None])[..., 0], name="nll")
    # The head's cluster columns are used in reverse order (cluster i: column -i), as in
    # the original: moving probability into cluster 1 raises tokens 10..29 only.
    with torch.no_grad():
        model.crit.cluster_bias[-1] += 5.0
        lp2, _ = model(x)
    gain = (lp2 - lp).mean((0, 1))
    assert gain[10:30].min() > 0 and gain[30:].max() < 0 and gain[:10].max() < 0


def test_adaptive_input_embeds_each_cluster_as_the_original():
    """div_val > 1: token t of cluster i is ``emb_layers[i](t - lo_i) @ emb_projs[i]ᵀ``
    times sqrt(d_model) (the original AdaptiveEmbedding), every cluster present."""
    from ctxfast.models.transformer_xl import AdaptiveEmbedding
    emb = AdaptiveEmbedding(60, 32, 16, (10, 30), div_val=2)
    with torch.no_grad():
        for p in emb.parameters():
            p.normal_()
    x = torch.tensor([[0, 9, 10, 29], [30, 59, 5, 44]])             # [T, B], each cluster
    ref = torch.empty(*x.shape, 16)
    for idx in torch.cartesian_prod(torch.arange(2), torch.arange(4)):
        t = int(x[tuple(idx)])
        i = sum(t >= c for c in (10, 30))
        lo = (0, 10, 30)[i]
        ref[tuple(idx)] = emb.emb_layers[i].weight[t - lo] @ emb.emb_projs[i].t() * 16 ** 0.5
    with torch.no_grad():
        assert_close(emb(x), ref, name="adaptive input embedding")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_position_encodings_of_a_cast_model_are_the_float32_ones(dtype):
    """A model cast to 16 bits holds inv_freq in 16 bits, so the frequencies are recomputed
    from d_model (in float32): the encodings are float32's (the model casts them after)."""
    from ctxfast.models.transformer_xl import PositionalEmbedding
    pos = torch.arange(40.0, -1, -1)
    ref = PositionalEmbedding(32)(pos)                                  # [41, 1, 32]
    got = PositionalEmbedding(32).to(dtype)(pos)
    assert got.dtype == ref.dtype == torch.float32
    assert_close(got, ref, name=f"encodings of the {dtype} module")


# --------------------------------------------------------------------------- generate

def test_generate_reuses_memory_greedy_matches_full_recompute():
    model = TransformerXL(tiny(mem_len=32, tgt_len=3)).eval()
    prompt = ids(7, 2)
    out, mems = model.generate(prompt, 5, temperature=0.0)
    assert out.shape == (12, 2) and torch.equal(out[:7], prompt)
    assert mems[0].shape[0] == 11                   # every token but the last
    with torch.no_grad():
        lp, _ = model(out[:-1])                     # one full forward over the result
    assert torch.equal(lp[6:].argmax(-1), out[7:])
    g = torch.Generator().manual_seed(3)
    s1, _ = model.generate(prompt, 4, temperature=1.0, top_k=5, generator=g)
    s2, _ = model.generate(prompt, 4, temperature=1.0, top_k=5,
                           generator=torch.Generator().manual_seed(3))
    assert torch.equal(s1, s2)


# --------------------------------------------------------------------------- K/V reuse

@contextlib.contextmanager
def reuse_spy():
    """Records, per attention call, (memory k/v given, projected r given): what
    TransformerXL._forward reused."""
    from ctxfast.models.transformer_xl import TransformerXLAttention
    calls, orig = [], TransformerXLAttention.forward

    def spy(self, *args, kv_mem=None, r_head=None, **kw):
        calls.append((kv_mem is not None, r_head is not None))
        return orig(self, *args, kv_mem=kv_mem, r_head=r_head, **kw)
    TransformerXLAttention.forward = spy
    try:
        yield calls
    finally:
        TransformerXLAttention.forward = orig


def _segments(model, xs, mems=()):
    """log-probs of each segment of xs in turn and the final mems (no grad)."""
    outs, mems = [], list(mems)
    with torch.no_grad():
        for x in xs:
            lp, mems = model(x, None, *mems)
            outs.append(lp)
    return outs, mems


@pytest.mark.parametrize("case, kernels", [
    ("post_ln", "default"), ("pre_ln_untied_r_proj_clamp", "default"),
    ("same_length", "default"), ("ext_len", "default"),
    # the reuse is the model's, whatever runs the attention: one case on the Triton kernels
    # (the interpreter takes seconds a case on the CPU)
    pytest.param("same_length", "triton", marks=needs_triton)])
def test_reused_keys_and_values_compute_the_original(case, kernels):
    """Evaluation (no grad) on the ctxfast backend keeps each layer's keys and values of the
    next memory, and the projected position encodings, with the returned mems, and the next
    call projects only its own rows: the log-probs and mems of every segment are the
    original computation's (segments of changing length: the encodings are reused only
    where klen repeats)."""
    kw = {"post_ln": {}, "same_length": dict(same_length=True, mem_len=6),
          "pre_ln_untied_r_proj_clamp": dict(pre_lnorm=True, untie_r=True, clamp_len=5),
          "ext_len": {}}[case]
    c = tiny(**kw)
    sd = synth_original_state_dict(c, 24 if case.startswith("pre_ln") else None)
    model = TransformerXL.from_state_dict(
        sd, **{**dict(dropout=0.0, mem_len=c.mem_len, tgt_len=c.tgt_len,
                      pre_lnorm=c.pre_lnorm), **kw}).to(DEVICE).eval()
    if case == "ext_len":
        model.reset_length(tgt_len=4, ext_len=2, mem_len=c.mem_len)
    xs = [ids(T, 3, device=DEVICE) for T in (5, 4, 4, 7, 4, 4)]
    ctx = ctxfast.backend("triton") if kernels == "triton" else contextlib.nullcontext()
    with ctx, reuse_spy() as calls:
        outs, _ = _segments(model, xs)
    n = c.n_layer
    kv = [all(kv for kv, _ in calls[i * n:(i + 1) * n]) for i in range(len(xs))]
    assert kv == [False] + [True] * (len(xs) - 1), kv
    sd = {k: v.cpu() for k, v in model.state_dict().items()}
    mems, ext = [], 2 if case == "ext_len" else 0
    for i, (x, out) in enumerate(zip(xs, outs)):
        ref, hids = original_forward(sd, c, x.cpu(), mems)
        assert_close(out.cpu(), ref, name=f"segment {i}")
        cat = [torch.cat([m, h], 0) for m, h in zip(mems, hids)] if mems else hids
        end = (mems[0].shape[0] if mems else 0) + x.shape[0] - ext
        mems = [t[max(0, end - c.mem_len):end] for t in cat]


def test_reuse_projects_only_the_new_rows_and_r_once_per_length():
    """What is saved: after the first segment each layer's qkv_net sees the segment's rows
    only, and r_net runs again only when the number of keys changes."""
    model = TransformerXL(tiny(mem_len=8)).eval()
    attn = model.layers[1].dec_attn
    qkv_rows, r_rows = [], []
    attn.qkv_net.register_forward_hook(lambda mod, a, out: qkv_rows.append(a[0].shape[0]))
    attn.r_net.register_forward_hook(lambda mod, a, out: r_rows.append(a[0].shape[0]))
    _segments(model, [ids(4, 2) for _ in range(5)])
    assert qkv_rows == [4] * 5                        # 4, 8 + 4 and so on: never the memory
    assert r_rows == [4, 8, 12]                        # klen 4, 8, 12, 12, 12


def test_reuse_is_dropped_when_its_inputs_change():
    """A kept value is used only with the very memory tensor it was kept with, unchanged,
    and the same weights: weights changed in place (an optimizer step, load_state_dict),
    a memory changed in place, copied or built by the caller, a weight rebound to another
    storage at its own address, gradients on, autocast
    changed, the eager backend or inference mode all recompute, and every result equals
    the computation without reuse."""
    torch.manual_seed(0)
    model = TransformerXL(tiny(mem_len=8)).eval()
    other = TransformerXL(tiny(mem_len=8, reuse_kv=False)).eval()
    xs = [ids(4, 2) for _ in range(3)]

    def both(fn, *, reused=False):
        """fn(model) -> mems for the last segment; the last segment on both models."""
        with reuse_spy() as calls:
            out = fn(model)
        ref = fn(other)
        assert [kv for kv, _ in calls[-model.n_layer:]] == [reused] * model.n_layer
        assert_close(out, ref)

    def step(prep):
        def fn(m):
            _, mems = _segments(m, xs[:2])
            mems = prep(m, mems)
            with torch.no_grad():
                return m(xs[2], None, *mems)[0]
        return fn

    other.load_state_dict(model.state_dict())
    both(step(lambda m, mems: mems), reused=True)                   # the control
    both(step(lambda m, mems: [t.clone() for t in mems]))
    both(step(lambda m, mems: [t.mul_(0.5) for t in mems]))

    def new_weights(m, mems):
        with torch.no_grad():
            for layer in m.layers:
                layer.dec_attn.qkv_net.weight.mul_(1.5)
                layer.dec_attn.r_net.weight.mul_(0.5)
        return mems
    both(step(new_weights))

    def loaded(m, mems):
        m.load_state_dict({k: v * 1.1 for k, v in m.state_dict().items()})
        return mems
    both(step(loaded))

    def rebound_in_place(m, mems):
        # a weight rebound to another tensor at its own address with other values (what two
        # rebindings, p.data = t or .half().float(), give where the allocator hands the
        # freed block back): its version is unchanged, its storage is another
        for layer in m.layers:
            w = layer.dec_attn.qkv_net.weight
            other_storage = torch.utils.dlpack.from_dlpack(w.detach())   # same address
            assert other_storage.data_ptr() == w.data_ptr()
            other_storage.mul_(1.5)                   # w's values too; w's version stays
            w.data = other_storage
        return mems
    both(step(rebound_in_place))

    def eager(m, mems):
        m.set_backend("eager")
        return mems
    both(step(eager))
    model.set_backend("ctxfast"), other.set_backend("ctxfast")

    with torch.inference_mode():                      # its tensors have no version counter
        both(step(lambda m, mems: mems))

    with reuse_spy() as calls:                        # gradients on: the weights' gradients
        _, mems = _segments(model, xs[:2])            # need every row's projection
        loss = model(xs[2], None, *mems)[0].sum()
    assert not any(kv or r for kv, r in calls[-model.n_layer:])
    loss.backward()
    _, mems = _segments(other, xs[:2])
    other(xs[2], None, *mems)[0].sum().backward()
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        if p.grad is not None:
            assert_close(p.grad, q.grad, name=f"grad {name}")


@pytest.mark.parametrize("change", ["pre_ln_weight", "clamp_len"])
def test_reuse_follows_the_pre_ln_weights_and_clamp_len(change):
    """With pre_lnorm the keys and values are projected from ``layer_norm([mems; w])``: a
    change of that LayerNorm (an optimizer step on it alone) recomputes them. The projected
    position encodings depend on ``clamp_len`` (which the original evaluation script sets
    on a loaded model): a change recomputes them although klen repeats. Both against the
    same model without reuse."""
    torch.manual_seed(0)
    kw = dict(mem_len=8, pre_lnorm=True, clamp_len=6)
    model = TransformerXL(tiny(**kw)).eval()
    other = TransformerXL(tiny(reuse_kv=False, **kw)).eval()
    with torch.no_grad():                   # unit-variance scores: every term counts
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() >= 2 else 0.2))
    other.load_state_dict(model.state_dict())
    xs = [ids(4, 2) for _ in range(4)]
    out = {}
    for m in (model, other):
        _, mems = _segments(m, xs[:3])                             # klen 12 from now on
        if change == "pre_ln_weight":
            with torch.no_grad():
                for layer in m.layers:
                    layer.dec_attn.layer_norm.weight.mul_(2.0)
                    layer.dec_attn.layer_norm.bias.add_(0.5)
        else:
            m.clamp_len = 2
        out[m is model] = _segments(m, xs[3:], mems)[0][0]
    assert_close(out[True], out[False], name=f"segment after a {change} change")


def test_reused_rows_grow_in_place_and_branches_stay_apart():
    """The kept keys and values grow in one buffer from call to call (no copy of the whole
    memory each time), and two continuations of the same memory (a branch) and then of
    each branch, or a generation one token at a time, give what recomputing gives."""
    torch.manual_seed(0)
    model = TransformerXL(tiny(mem_len=12)).eval()
    other = TransformerXL(tiny(mem_len=12, reuse_kv=False)).eval()
    other.load_state_dict(model.state_dict())
    xs = [ids(3, 2) for _ in range(6)]
    _, mems = _segments(model, xs[:2])
    _, ref_mems = _segments(other, xs[:2])
    buffers = set()
    for x in xs[2:5]:                         # one buffer: rows appended where they end
        _, mems = _segments(model, [x], mems)
        buffers.add(mems[1]._ctxfast_kv[2].k.untyped_storage().data_ptr())
        _, ref_mems = _segments(other, [x], ref_mems)
    assert len(buffers) == 1
    a, mems_a = _segments(model, [xs[5]], mems)          # two branches from one memory
    b, mems_b = _segments(model, [xs[0]], mems)
    ra, ref_a = _segments(other, [xs[5]], ref_mems)
    rb, ref_b = _segments(other, [xs[0]], ref_mems)
    assert_close(a[0], ra[0], name="branch a")
    assert_close(b[0], rb[0], name="branch b")
    for mm, rm, name in ((mems_a, ref_a, "a"), (mems_b, ref_b, "b")):   # and on from each
        out, _ = _segments(model, [xs[1]], mm)
        ref, _ = _segments(other, [xs[1]], rm)
        assert_close(out[0], ref[0], name=f"after branch {name}")
    prompt = ids(5, 2)
    got, _ = model.generate(prompt, 20, temperature=0.0, mems=mems_a)
    want, _ = other.generate(prompt, 20, temperature=0.0, mems=ref_a)
    assert torch.equal(got, want)


def test_reuse_under_autocast_switches():
    """Keys kept under bf16 autocast are not reused by a float32 call (nor the reverse)."""
    model = TransformerXL(tiny(mem_len=8)).eval()
    xs = [ids(4, 2) for _ in range(2)]
    with reuse_spy() as calls:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, mems = _segments(model, xs[:1])
        _segments(model, xs[1:], mems)
    assert not any(kv for kv, _ in calls)


# --------------------------------------------------------------------------- dtypes, layouts

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_follows_float32(dtype):
    """The model cast to fp16/bf16 (eager and ctxfast's default dispatch) runs with
    memory and stays within the dtype's tolerance of the float32 model."""
    model = TransformerXL(tiny()).eval()
    x1, x2 = ids(6, 2), ids(5, 2)
    with torch.no_grad():
        ref_mems = model(x1)[1]
        ref = model(x2, None, *ref_mems)[0]
        half = TransformerXL(tiny()).to(dtype).eval()
        half.load_state_dict(model.state_dict())
        for backend in ("eager", "ctxfast"):
            half.set_backend(backend)
            mems = half(x1)[1]
            assert all(m.dtype == dtype for m in mems)
            out = half(x2, None, *mems)[0]
            assert out.dtype == dtype
            assert_close(out.float(), ref, tol=2e-2, name=f"{backend} {dtype}")


def test_non_contiguous_ids_and_mems():
    model = TransformerXL(tiny()).eval()
    x = ids(2, 7).t()                                  # [7, 2] view of a [2, 7] tensor
    assert not x.is_contiguous()
    with torch.no_grad():
        lp, mems = model(x)
        ref, ref_mems = model(x.contiguous())
        assert_close(lp, ref)
        strided = [torch.randn(2, 5, 32).transpose(0, 1)[:, :2] for _ in range(3)]  # [5, 2, 32]
        out = model(x, None, *strided)[0]
        ref = model(x.contiguous(), None, *[m.contiguous() for m in strided])[0]
    assert_close(out, ref)


@pytest.mark.parametrize("div_val", [1, 2])
def test_from_state_dict_infers_adaptive_shapes_and_requires_what_it_cannot(div_val):
    """cutoffs (div_val > 1: from the cluster sizes), div_val, d_embed and the tied weights
    and projections come from the state_dict; pre_lnorm and mem_len must be given (a wrong
    pre_lnorm changes the outputs silently), and so must cutoffs for div_val 1."""
    c = tiny(n_token=60, cutoffs=(10, 30), div_val=div_val, d_embed=24 if div_val == 1 else 48,
             tie_projs=(True, False, True), pre_lnorm=True, mem_len=6)
    src = TransformerXL(c).eval()
    sd = src.state_dict()
    with pytest.raises(ValueError, match="pre_lnorm and mem_len cannot be read"):
        TransformerXL.from_state_dict(sd)
    with pytest.raises(ValueError, match="mem_len cannot be read"):
        TransformerXL.from_state_dict(sd, pre_lnorm=True)
    need = dict(pre_lnorm=True, mem_len=6)
    if div_val == 1:
        with pytest.raises(ValueError, match=r"2 tail cluster\(s\).*pass cutoffs"):
            TransformerXL.from_state_dict(sd, **need)
        need["cutoffs"] = (10, 30)
    model = TransformerXL.from_state_dict(sd, **need).eval()
    got = model.config
    assert (tuple(got.cutoffs), got.div_val, got.d_embed, got.n_token) == ((10, 30), div_val, c.d_embed, 60)
    assert got.tie_weight and tuple(got.tie_projs) == (True, False, True)
    x = ids(5, 2, n=60)
    with torch.no_grad():
        assert torch.equal(model(x)[0], src(x)[0])
    # a key the sizes are read from, missing: named (it was a bare KeyError)
    for key in ("layers.0.dec_attn.o_net.weight", "layers.0.pos_ff.CoreNet.0.weight",
                "r_w_bias"):
        partial = {k: t for k, t in sd.items() if k != key}
        with pytest.raises(ValueError, match=f"has no .*{re.escape(key)}"):
            TransformerXL.from_state_dict(partial, **need)


def test_from_state_dict_ties_only_when_every_cluster_is_tied():
    """An untied adaptive softmax (div_val 2) whose first cluster's output weight happens to
    equal its embedding is read as untied (tie_weight ties every cluster), loads and
    computes what it computed."""
    c = tiny(n_token=60, cutoffs=(10, 30), div_val=2, d_embed=48, tie_weight=False, mem_len=6)
    src = TransformerXL(c).eval()
    sd = src.state_dict()
    sd["crit.out_layers.0.weight"] = sd["word_emb.emb_layers.0.weight"].clone()
    src.load_state_dict(sd)
    model = TransformerXL.from_state_dict(sd, pre_lnorm=False, mem_len=6).eval()
    assert not model.config.tie_weight
    x = ids(5, 2, n=60)
    with torch.no_grad():
        assert torch.equal(model(x)[0], src(x)[0])


def test_one_class_per_name_old_model_layer_name_deprecated():
    """The model's attention layer is TransformerXLAttention; the old name (shared with the
    public ctxfast.nn layer) still imports, with a DeprecationWarning."""
    import ctxfast.models.transformer_xl as txl
    with pytest.warns(DeprecationWarning, match="TransformerXLAttention"):
        old = txl.RelPartialLearnableMultiHeadAttn
    assert old is txl.TransformerXLAttention
    assert txl.TransformerXLAttention.__name__ != ctxfast.nn.RelPartialLearnableMultiHeadAttn.__name__
    assert isinstance(TransformerXL(tiny()).layers[0].dec_attn, txl.TransformerXLAttention)


def test_torch_export_with_a_dynamic_segment_length():
    # Evaluation with memory exported once for every segment length up to mem_len: the
    # outputs and the new memory equal the model's at a length it was not traced at.
    # (The position sequence was a float arange, whose traced length ceil(klen / 1.0)
    # export could not prove equal to klen.)
    model = TransformerXL(tiny()).to(DEVICE).eval()
    _, mems = model(ids(8, 2, device=DEVICE), ids(8, 2, device=DEVICE))
    T = torch.export.Dim("T", min=2, max=model.mem_len)
    ep = torch.export.export(model, (ids(8, 2, device=DEVICE), ids(8, 2, device=DEVICE), *mems),
                             dynamic_shapes=({0: T}, {0: T}, (None,) * len(mems)))
    x, y = ids(5, 2, device=DEVICE), ids(5, 2, device=DEVICE)
    (loss, new), (want_loss, want_new) = ep.module()(x, y, *mems), model(x, y, *mems)
    assert torch.equal(loss, want_loss) and len(new) == len(want_new)
    assert all(torch.equal(a, b) for a, b in zip(new, want_new))
