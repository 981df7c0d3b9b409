"""ctxfast.models.xlnet: the ctxfast backend (Triton rel_attention) agrees with the eager
one (ctxfast.reference) on outputs and every gradient; permutation-LM properties; one
optimizer step; half precision; bad inputs. Agreement with Hugging Face is in
test_from_hf_xlnet.py."""
import copy

import re

import pytest
import torch

import ctxfast
from ctxfast.models.xlnet import XLNetConfig, XLNetLMHeadModel, XLNetModel
from utils import (DEVICE, REL_TOL, TRITON_ON_CPU, assert_close, assert_exports,
                   assert_within_2x_eager, owns_storage)

# The fast path: Triton kernels (on CPU only under the interpreter).
FAST = "triton" if (TRITON_ON_CPU or torch.cuda.is_available()) else None
needs_triton = pytest.mark.skipif(FAST is None, reason="Triton cannot run here "
                                  "(no GPU and TRITON_INTERPRET != 1)")
V = 37


def _config(**kw):
    # initializer_range 0.3 (not 0.02): peaked attention, so that every term and mask counts
    base = dict(vocab_size=V, d_model=32, n_layer=2, n_head=2, d_inner=48, dropout=0.0,
                mem_len=5, initializer_range=0.3)
    base.update(kw)
    return XLNetConfig(**base)


def _pair(cls=XLNetModel, dtype=torch.float32, **kw):
    """Two models with the same weights: backend ctxfast and eager."""
    fast = cls(_config(**kw), backend="ctxfast").to(DEVICE, dtype)
    eager = copy.deepcopy(fast).set_backend("eager")
    return fast, eager


def _ranks(B, T, ties=False):
    if ties:
        return torch.randint(0, max(T // 2, 1), (B, T), device=DEVICE)
    return torch.stack([torch.randperm(T) for _ in range(B)]).to(DEVICE)


def _targets(rank, P):
    """target_mapping [B, P, T] on the P last tokens of each order (partial prediction)."""
    B, T = rank.shape
    top = rank.argsort(dim=1, stable=True)[:, T - P:]                        # [B, P]
    return torch.nn.functional.one_hot(top, T).float()                   # [B, P, T]


CASES = {
    # content stream only: padding (left, as XLNet's tokenizer pads) and segments
    "content_pad_seg": dict(B=2, T=9, mlen=0, pad=True, seg=True, perm=False, P=0, cfg={}),
    # two streams with permutation ranks, partial prediction, segments and memory
    "two_stream_mems": dict(B=2, T=7, mlen=4, pad=False, seg=True, perm=True, P=3, cfg={}),
    # causal attention type, bi_data (two position tables), clamp_len, tied ranks, padding
    "uni_bidata_clamp_ties": dict(B=2, T=6, mlen=3, pad=True, seg=False, perm="ties", P=2,
                                  cfg=dict(attn_type="uni", bi_data=True, clamp_len=3)),
    # one token, with memory (its query stream sees only the memory)
    "len1_mems": dict(B=2, T=1, mlen=5, pad=False, seg=True, perm=True, P=1, cfg={}),
}


def _inputs(case, d_model=32, dtype=torch.float32):
    B, T, mlen = case["B"], case["T"], case["mlen"]
    kw = dict(input_ids=torch.randint(0, V, (B, T), device=DEVICE))
    if case["pad"]:
        am = torch.ones(B, T, device=DEVICE)
        am[0, :2] = 0                                                     # left padding
        kw["attention_mask"] = am
    if case["seg"]:
        kw["token_type_ids"] = torch.randint(0, 3, (B, T), device=DEVICE)
    if case["perm"]:
        rank = _ranks(B, T, ties=case["perm"] == "ties")
        kw["perm_rank"] = rank.t().contiguous().t()                        # non-contiguous
    if case["P"]:
        kw["target_mapping"] = _targets(kw.get("perm_rank", _ranks(B, T)), case["P"])
    if mlen:
        kw["mems"] = [torch.randn(mlen, B, d_model, device=DEVICE, dtype=dtype)
                      for _ in range(2)]
    return kw


def _terms_scale(name, ref_grads):
    """The floor's scale for a gradient (0: relative to the gradient itself). The segment
    term's gradients (r_s_bias, seg_embed) cancel across each softmax row (see
    test_ctxfast_matches_eager_outputs_and_gradients): the size of their summed terms is
    measured by the same layer's r_w_bias gradient (the same dS times the keys)."""
    if name.endswith(("rel_attn.r_s_bias", "rel_attn.seg_embed")):
        return ref_grads[name.rsplit(".", 1)[0] + ".r_w_bias"].double().norm().item()
    return 0.0


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_ctxfast_matches_eager_outputs_and_gradients(name):
    """fp32 outputs within REL_TOL of eager; every gradient (parameters and mems) within
    2x eager's own error against the fp64 model + REL_TOL relative to the gradient's size.

    The segment term's gradients (r_s_bias, seg_embed) are sums over a softmax row of dS
    times one of two vectors, and every row of dS sums to zero: they cancel, down to ~0
    (e.g. 5e-17 when a layer's tokens share a segment). Their rounding error scales with
    the terms, not with the sum, and how large it is depends on the accumulation order,
    which differs between machines (the Triton interpreter's tl.dot is numpy's BLAS,
    eager's is torch's; their kernels and vector widths follow the CPU): a bound relative
    to the cancelled sum failed on some machines (3.8e-5 against 1.6e-5) and passed on
    others. Their floor is taken relative to the size of the terms instead, measured by
    the same layer's r_w_bias gradient (the same dS times the keys, which do not cancel)."""
    case = CASES[name]
    fast, eager = _pair(**case["cfg"])
    ref = copy.deepcopy(eager).double()
    kw = _inputs(case)
    outs, grads = [], []
    for model in (fast, eager, ref):
        dtype = next(model.parameters()).dtype
        mems = None
        if "mems" in kw:
            mems = [m.clone().to(dtype).requires_grad_(True) for m in kw["mems"]]
        with ctxfast.backend(FAST if model is fast else "eager"):
            out = model(**{**kw, "mems": mems}, use_mems=True)
        streams = [out.content_hidden_state] + ([out.query_hidden_state]
                                                if case["P"] else [])
        if not outs:
            weights = [torch.randn_like(s) for s in streams]
        loss = sum((s * w.to(dtype)).sum() for s, w in zip(streams, weights))
        loss.backward()
        outs.append(streams + list(out.mems))
        grads.append({n: p.grad for n, p in model.named_parameters()}
                     | {f"mems[{i}]": m.grad for i, m in enumerate(mems or [])})
    for i, (a, b) in enumerate(zip(outs[0], outs[1])):
        assert_close(a, b, name=f"output {i}")
    for n, g in grads[2].items():
        if g is None:                       # unused in this case (e.g. seg_embed without segments)
            assert grads[0][n] is None and grads[1][n] is None, n
            continue
        assert_within_2x_eager(grads[0][n], grads[1][n], g, REL_TOL[torch.float32],
                               name=f"grad {n}", min_scale=_terms_scale(n, grads[2]))
    assert grads[0]["layer.0.rel_attn.r_w_bias"] is not None


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_error_within_twice_eager(dtype):
    """ctxfast in fp16/bf16 is no further from the fp64 model than eager in the same dtype
    (x2 + a floor), as tests/test_attention.py rules for attention."""
    case = CASES["two_stream_mems"]
    fast, eager = _pair()
    ref = XLNetModel(_config(), backend="eager").to(DEVICE, torch.float64)
    ref.load_state_dict(fast.state_dict())
    fast, eager = fast.to(dtype), eager.to(dtype)
    kw = _inputs(case)
    with torch.no_grad():
        want = ref(**{**kw, "mems": [m.double() for m in kw["mems"]]})
        with ctxfast.backend(FAST):
            got = fast(**{**kw, "mems": [m.to(dtype) for m in kw["mems"]]})
        base = eager(**{**kw, "mems": [m.to(dtype) for m in kw["mems"]]})
    for attr in ("content_hidden_state", "query_hidden_state"):
        a, b, w = (getattr(o, attr) for o in (got, base, want))
        assert a.dtype == dtype
        assert_within_2x_eager(a, b, w, REL_TOL[dtype] / 2, name=attr, min_scale=0.0)


AMP_BACKENDS = (["cpu"] if DEVICE == "cpu" else []) + ([FAST] if FAST else [])


@pytest.mark.parametrize("backend", AMP_BACKENDS)
def test_autocast_bf16_trains_within_twice_eager(backend):
    """fp32 weights under torch.autocast(bfloat16), as mixed-precision training runs: the
    fp32 biases and seg_embed meet bf16 queries inside rel_attention. Outputs and every
    parameter's gradient are no further from the fp64 model than eager's under the same
    autocast (x2 + the bf16 floor, half of it for the outputs, as the fp32 test above
    rules); the gradients stay fp32. Every backend that runs here: the cpu kernel (the
    default on CPU tensors) and Triton. (Eager under autocast keeps q + u and the softmax
    in fp32; the fused op runs wholly in bf16, as SDPA does.)

    The errors compared are root-mean-square over AMP_DRAWS draws of weights, each on a
    batch of AMP_BATCH sequences (the case's 2, eight times over, each with its own inputs,
    ranks and memory): one small draw's bf16 gradient error, ours and eager's alike, is a
    noisy sample. Measured on 30 seeds of the case as it is (B 2), the ratio ours / eager
    has a geometric mean of 0.97 (Triton) and 0.85 (the cpu kernel) over the gradients,
    but ranges 0.3x-4x on mask_emb (9x on r_s_bias, whose sum cancels), so the 2x rule on
    one draw failed in 4 of 40 seeds, up to 1.81x the bound (CTXFAST_TEST_SEED=1 found
    it). 2 draws of B 16: the worst of 40 seeds at 0.67x the bound (cpu kernel).
    (Several loss weightings of one draw average less: 2 draws x 4 weightings still read
    1.19x on Triton's r_r_bias in one seed of 40.)"""
    errs = {}                                  # name -> [sum of squared errors] x 3 models
    for _ in range(AMP_DRAWS):
        for name, sq in _amp_draw(backend).items():
            acc = errs.setdefault(name, [0.0, 0.0, 0.0])
            for i in range(3):
                acc[i] += sq[i]
    for name, (ours, eager, ref) in errs.items():
        floor = REL_TOL[torch.bfloat16] / (2 if name.startswith("stream") else 1)
        bound = 2 * eager ** 0.5 + floor * ref ** 0.5
        assert ours ** 0.5 <= bound, (
            f"{backend} {name}: rms error {ours ** 0.5:.3e} > 2 x eager's {eager ** 0.5:.3e} "
            f"+ floor = {bound:.3e} (rms of the fp64 values {ref ** 0.5:.3e})")


AMP_DRAWS, AMP_BATCH, AMP_COTANGENTS = 2, 16, 1


def _amp_draw(backend):
    """One draw of weights and inputs for the autocast test: {name: (Σ‖ours − ref‖²,
    Σ‖eager − ref‖², scale²)} over AMP_COTANGENTS loss weightings, for each stream output
    and each parameter's gradient; ``scale`` is the fp64 value's norm (the segment
    gradients, which cancel, are measured by their terms: :func:`_terms_scale`)."""
    case = dict(CASES["two_stream_mems"], B=AMP_BATCH)
    fast, eager = _pair()
    ref = copy.deepcopy(eager).double()
    kw = _inputs(case)
    runs = []
    for model in (fast, eager, ref):
        dtype = next(model.parameters()).dtype
        amp = torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=model is not ref)
        with amp, ctxfast.backend(backend if model is fast else "eager"):
            out = model(**{**kw, "mems": [m.to(dtype) for m in kw["mems"]]})
        runs.append((model, (out.content_hidden_state, out.query_hidden_state)))
    weights = [[torch.randn_like(s, dtype=torch.float32) for s in runs[0][1]]
               for _ in range(AMP_COTANGENTS)]
    names = [n for n, _ in fast.named_parameters()]
    grads = []                                  # per model: per weighting: {name: grad}
    for model, streams in runs:
        dtype = next(model.parameters()).dtype
        assert all(s.dtype == dtype for s in streams)
        params = list(model.parameters())
        per = []
        for w in weights:
            loss = sum((s.to(dtype) * x.to(dtype)).sum() for s, x in zip(streams, w))
            g = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            per.append(dict(zip(names, g)))
        grads.append(per)
    sq = {}
    for i in range(2):                          # the outputs: one value per draw
        a, b, r = (runs[m][1][i].double() for m in range(3))
        sq[f"stream {i}"] = ((a - r).norm().item() ** 2, (b - r).norm().item() ** 2,
                             r.norm().item() ** 2)
    for name in names:
        if grads[2][0][name] is None:
            continue
        acc = [0.0, 0.0, 0.0]
        for k in range(AMP_COTANGENTS):
            ours, same, r = grads[0][k][name], grads[1][k][name], grads[2][k][name].double()
            assert ours.dtype == torch.float32, name
            acc[0] += (ours.double() - r).norm().item() ** 2
            acc[1] += (same.double() - r).norm().item() ** 2
            acc[2] += max(r.norm().item(), _terms_scale(name, grads[2][k])) ** 2
        sq[f"grad {name}"] = tuple(acc)
    return sq


@needs_triton
def test_one_optimizer_step_lowers_the_loss():
    """Permutation LM with partial prediction: predict the last 3 tokens of each order."""
    model = XLNetLMHeadModel(_config(), backend="ctxfast").to(DEVICE)
    B, T, P = 2, 8, 3
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    rank = _ranks(B, T)
    tm = _targets(rank, P)                                                 # [B, P, T]
    labels = (tm @ ids[:, :, None].float()).squeeze(-1).long()             # [B, P]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ctxfast.backend(FAST):
        loss0 = model(ids, perm_rank=rank, target_mapping=tm, labels=labels).loss
        loss0.backward()
        opt.step()
        with torch.no_grad():
            loss1 = model(ids, perm_rank=rank, target_mapping=tm, labels=labels).loss
    assert torch.isfinite(loss0) and loss1 < loss0 - 1e-3, (loss0.item(), loss1.item())


# ------------------------------------------------------------------ semantics (eager, fast)

def test_content_stream_does_not_see_later_tokens_in_the_order():
    model = XLNetModel(_config(), backend="eager").to(DEVICE).eval()
    B, T = 2, 8
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    rank = _ranks(B, T)
    later = rank >= T // 2                                    # the second half of each order
    ids2 = torch.where(later, (ids + 1 + torch.randint(0, V - 1, ids.shape, device=DEVICE)) % V, ids)
    with torch.no_grad():
        a = model(ids, perm_rank=rank).last_hidden_state
        b = model(ids2, perm_rank=rank).last_hidden_state
    assert torch.equal(a[~later], b[~later])                  # earlier tokens: unchanged
    assert not torch.allclose(a[later], b[later])             # the changed ones: changed


def test_query_stream_does_not_see_its_own_token():
    model = XLNetModel(_config(), backend="eager").to(DEVICE).eval()
    B, T, P = 2, 7, 2
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    rank = _ranks(B, T)
    tm = _targets(rank, P)
    own = tm[:, 0].bool()                  # the token of prediction 0 (rank T - 2)
    ids2 = torch.where(own, (ids + 1) % V, ids)
    with torch.no_grad():
        a = model(ids, perm_rank=rank, target_mapping=tm)
        b = model(ids2, perm_rank=rank, target_mapping=tm)
    assert torch.equal(a.query_hidden_state[:, 0], b.query_hidden_state[:, 0])
    # prediction 1 (rank T - 1) sees that token
    assert not torch.allclose(a.query_hidden_state[:, 1], b.query_hidden_state[:, 1])
    assert a.last_hidden_state.shape == (B, P, 32)


def test_padding_is_invisible_to_real_tokens():
    model = XLNetModel(_config(), backend="eager").to(DEVICE).eval()
    B, T = 2, 9
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    am = torch.ones(B, T, dtype=torch.long, device=DEVICE)
    am[:, :3] = 0
    ids2 = ids.clone()
    ids2[:, :3] = (ids[:, :3] + 5) % V
    with torch.no_grad():
        a = model(ids, attention_mask=am).last_hidden_state
        b = model(ids2, attention_mask=am).last_hidden_state
    assert torch.equal(a[:, 3:], b[:, 3:])


def test_mems_are_the_layer_inputs_clipped_and_detached():
    model = XLNetModel(_config(mem_len=5, reuse_len=None), backend="eager").to(DEVICE)
    B, T = 2, 4
    out1 = model(torch.randint(0, V, (B, T), device=DEVICE), use_mems=True)
    assert [tuple(m.shape) for m in out1.mems] == [(4, B, 32)] * 2
    assert not any(m.requires_grad for m in out1.mems)
    out2 = model(torch.randint(0, V, (B, T), device=DEVICE), mems=out1.mems, use_mems=True)
    assert [tuple(m.shape) for m in out2.mems] == [(5, B, 32)] * 2      # mem_len clips
    assert torch.equal(out2.mems[0][:1], out1.mems[0][3:])              # oldest step kept
    assert all(owns_storage(m) for m in out2.mems)   # clipped: a copy, not a view of 8 rows
    assert model(torch.randint(0, V, (B, T), device=DEVICE)).mems is None


# ------------------------------------------------------------------ bad inputs

def _bad(name):
    B, T = 2, 6
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    mems = [torch.randn(3, B, 32, device=DEVICE) for _ in range(2)]
    return {
        "perm_rank": dict(input_ids=ids, perm_rank=_ranks(B, T + 1)),
        "input_ids": dict(input_ids=ids.masked_fill(ids == ids[0, 0], V)),
        "input_ids ": dict(input_ids=-ids - 1),
        "input_ids  ": dict(input_ids=ids.float()),
        "mems": dict(input_ids=ids, mems=mems[:1]),
        r"mems\[1\]": dict(input_ids=ids, mems=[mems[0], torch.randn(3, B + 1, 32)]),
        r"mems\[0\]": dict(input_ids=ids, mems=[torch.randn(3, B, 16), mems[1]]),
        r"mems\[1\] ": dict(input_ids=ids, mems=[mems[0], torch.randn(2, B, 32)]),
        "target_mapping": dict(input_ids=ids, target_mapping=torch.zeros(B, 2, T - 1)),
        # with labels: the mapping's own error, not one from reading its shape for them
        "target_mapping ": dict(input_ids=ids, target_mapping=[[0.0] * T] * B,
                                labels=torch.zeros(B, 1).long()),
        "target_mapping  ": dict(input_ids=ids, target_mapping=torch.zeros(B, T),
                                 labels=torch.zeros(B, T).long()),
        "token_type_ids": dict(input_ids=ids, token_type_ids=torch.zeros(B, T + 2).long()),
        "attention_mask": dict(input_ids=ids, attention_mask=torch.ones(B + 1, T)),
        "labels": dict(input_ids=ids, labels=torch.zeros(B, T + 1).long()),
    }[name]


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
@pytest.mark.parametrize("arg", ["perm_rank", "input_ids", "input_ids ", "input_ids  ", "mems",
                                 r"mems\[1\]", r"mems\[0\]", r"mems\[1\] ", "target_mapping",
                                 "target_mapping ", "target_mapping  ",
                                 "token_type_ids", "attention_mask", "labels"])
def test_bad_inputs_raise_value_error_naming_the_argument(backend, arg):
    model = XLNetLMHeadModel(_config(), backend=backend).to(DEVICE)
    with pytest.raises(ValueError, match=arg.strip()):
        model(**_bad(arg))


def test_bad_config_and_backend():
    with pytest.raises(ValueError, match="backend"):
        XLNetModel(_config(), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        XLNetLMHeadModel(_config()).set_backend("cuda")
    with pytest.raises(ValueError, match="B = 3"):
        XLNetModel(_config(bi_data=True), backend="eager")(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="ff_activation"):
        _config(ff_activation="tanh_nope")
    with pytest.raises(ValueError, match="reuse_kv must be a bool, got 1"):
        _config(reuse_kv=1)


def test_labels_out_of_the_vocabulary_are_refused_as_the_other_models_do():
    """labels >= vocab_size raised torch's IndexError from cross_entropy; float labels a
    shape error."""
    model = XLNetLMHeadModel(_config(), backend="eager")
    ids = torch.randint(0, V, (2, 6))
    with pytest.raises(ValueError, match=rf"XLNetLMHeadModel: labels must be in \[0, {V}\) or "
                                         r"-100 \(ignored\), got"):
        model(ids, labels=ids + V)
    with pytest.raises(TypeError, match="XLNetLMHeadModel: labels must be an integer tensor"):
        model(ids, labels=ids.float())
    labels = ids.masked_fill(ids < 5, -100)                      # -100: ignored, accepted
    assert model(ids, labels=labels).loss.isfinite()


def test_d_model_not_divisible_by_n_head_is_refused_unless_d_head_is_given():
    """d_head = d_model // n_head silently dropped the remainder (16 // 3 = 5); HF refuses."""
    with pytest.raises(ValueError, match=r"d_model = 16 must be divisible by n_head = 3"):
        XLNetConfig(d_model=16, n_head=3)
    with pytest.raises(ValueError, match=r"n_head must be an int >= 1, got 0"):
        XLNetConfig(d_model=16, n_head=0)
    assert XLNetConfig(d_model=16, n_head=3, d_head=8).d_head == 8   # explicit: as given
    assert XLNetConfig(d_model=16, n_head=4).d_head == 4


def test_backends_route_to_the_op_and_the_reference(monkeypatch):
    calls = []
    op, ref = ctxfast.ops.rel_attention, ctxfast.reference.rel_attention
    monkeypatch.setattr(ctxfast.ops, "rel_attention",
                        lambda *a, **k: calls.append("op") or op(*a, **k))
    monkeypatch.setattr(ctxfast.reference, "rel_attention",
                        lambda *a, **k: calls.append("ref") or ref(*a, **k))
    model = XLNetModel(_config(), backend="ctxfast").to(DEVICE)
    ids = torch.randint(0, V, (1, 3), device=DEVICE)
    with ctxfast.backend("eager"):
        model(ids, target_mapping=torch.eye(3, device=DEVICE)[None, :1])
    assert calls.count("op") == 4                # 2 layers x 2 streams
    calls.clear()
    model.set_backend("eager")(ids)
    assert calls == ["ref", "ref"]


@needs_triton
def test_training_mode_applies_dropout_on_the_fast_path():
    model = XLNetLMHeadModel(_config(dropout=0.3), backend="ctxfast").to(DEVICE)
    ids = torch.randint(0, V, (2, 5), device=DEVICE)
    rank = _ranks(2, 5)
    tm = _targets(rank, 2)
    with ctxfast.backend(FAST), torch.no_grad():
        train = model.train()(ids, perm_rank=rank, target_mapping=tm).logits
        ev = model.eval()(ids, perm_rank=rank, target_mapping=tm).logits
    assert torch.isfinite(train).all() and not torch.allclose(train, ev)


def test_training_drops_both_streams_inputs_and_outputs():
    """As HF: the word embeddings (content stream) and mask_emb (query stream) pass a
    dropout on the way in and the outputs one on the way out. With no layer in between,
    every kept value is its input times (1 / (1 - p))² = 4 at p = 0.5 (once: 2)."""
    model = XLNetModel(_config(n_layer=0, dropout=0.5), backend="eager").to(DEVICE).train()
    ids = torch.randint(0, V, (2, 6), device=DEVICE)
    tm = torch.nn.functional.one_hot(torch.tensor([[1, 3], [0, 4]], device=DEVICE), 6).float()
    with torch.no_grad():
        out = model(ids, target_mapping=tm)
        inputs = {"content": model.word_embedding(ids), "query": model.mask_emb.expand(2, 2, -1)}
        for name, got in (("content", out.content_hidden_state),
                          ("query", out.query_hidden_state)):
            x = inputs[name]
            kept = got != 0
            assert kept.any() and (~kept).any(), name
            assert_close(got[kept], 4 * x[kept], name=f"{name} stream: kept values")


# ------------------------------------------------------------------ HF perm_mask, use_mems

def test_perm_mask_round_trips_to_perm_rank():
    from ctxfast.models.xlnet import perm_mask_to_perm_rank, perm_rank_to_perm_mask
    rank = _ranks(3, 7)
    mask = perm_rank_to_perm_mask(rank)
    assert mask.shape == (3, 7, 7) and torch.equal(mask.diagonal(dim1=1, dim2=2), torch.ones_like(mask[:, 0]))
    assert torch.equal(perm_mask_to_perm_rank(mask), rank.long())
    # HF's documented use: every token sees the others, none sees the last one (to predict)
    hf = torch.zeros(2, 5, 5, device=DEVICE)
    hf[:, :, -1] = 1
    tm = torch.zeros(2, 1, 5, device=DEVICE)
    tm[:, 0, -1] = 1
    got = perm_mask_to_perm_rank(hf, tm)
    assert got.tolist() == [[3, 3, 3, 3, 4]] * 2     # four tied, the target after them


def test_perm_mask_no_rank_order_expresses_is_refused_with_the_reason():
    from ctxfast.models.xlnet import perm_mask_to_perm_rank, perm_rank_to_perm_mask
    m = perm_rank_to_perm_mask(torch.tensor([[0, 1, 2]], device=DEVICE))
    m[0, 2, 0] = 1                                   # 2 sees 1, 1 sees 0, 2 not 0: not transitive
    with pytest.raises(ValueError, match=r"no rank order gives perm_mask\[0\].*transitive"):
        perm_mask_to_perm_rank(m)
    m = perm_rank_to_perm_mask(torch.tensor([[0, 1, 2]], device=DEVICE))
    m[0, 1, 1] = 0                                   # a prediction sees its own token
    with pytest.raises(ValueError, match="prediction 1 of row 0 sees its own token"):
        perm_mask_to_perm_rank(m, torch.eye(3, device=DEVICE)[None, 1:2])
    hf = torch.zeros(1, 3, 3, device=DEVICE)        # all see all: ties, and the query row 0
    hf[0, 0, 0] = 1                                  # (declared by its diagonal) sees a tie
    with pytest.raises(ValueError, match="sees a token of the same place"):
        perm_mask_to_perm_rank(hf)
    with pytest.raises(ValueError, match="0 \\(may attend\\) and 1"):
        perm_mask_to_perm_rank(torch.full((1, 2, 2), 0.5))
    with pytest.raises(ValueError, match="ties"):
        perm_rank_to_perm_mask(torch.tensor([[0, 0, 1]]))


@pytest.mark.parametrize("cfg", [dict(mem_len=6), dict(mem_len=6, reuse_len=2),
                                 dict(mem_len=None), dict(attn_type="uni", same_length=True,
                                                          bi_data=True, clamp_len=3)])
def test_eval_with_memory_reuses_keys_and_values(cfg):
    """Evaluation with memory on the ctxfast backend keeps each layer's keys and values of
    the next memory (and the position keys) with the returned mems; the next call projects
    only its own rows. Segments, a branch from one memory, and a weight change: every
    output and memory equals the computation without reuse, and the reuse happens (a spy
    on the layers)."""
    from ctxfast.models.xlnet import XLNetRelativeAttention
    model = XLNetModel(_config(**cfg)).to(DEVICE).eval()
    plain = copy.deepcopy(model)
    plain.config = XLNetConfig(**{**model.config.__dict__, "reuse_kv": False})
    B = 2
    segs = [torch.randint(0, V, (B, T), device=DEVICE) for T in (4, 3, 3, 5, 3)]
    calls, orig = [], XLNetRelativeAttention.forward

    def spy(self, *a, kv_mem=None, **kw):
        calls.append(kv_mem is not None)
        return orig(self, *a, kv_mem=kv_mem, **kw)

    def run(m, xs, mems=None):
        outs = []
        with torch.no_grad():
            for x in xs:
                o = m(x, mems=mems, use_mems=True)
                outs.append(o.last_hidden_state)
                mems = o.mems
        return outs, mems
    XLNetRelativeAttention.forward = spy
    try:
        got, mems = run(model, segs[:3])
    finally:
        XLNetRelativeAttention.forward = orig
    assert calls == [False] * 2 + [True] * 4, calls
    want, ref_mems = run(plain, segs[:3])
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, name=f"segment {i}")
    for x in segs[3:]:                                   # two branches from one memory
        a, a_mems = run(model, [x, segs[0]], mems)
        b, b_mems = run(plain, [x, segs[0]], ref_mems)
        for i, (u, w) in enumerate(zip(a + a_mems, b + b_mems)):
            assert_close(u, w, name=f"branch, output {i}")
    with torch.no_grad():                                # weights changed: recomputed
        for layer in model.layer:
            layer.rel_attn.k.mul_(1.5)
            layer.rel_attn.r.mul_(0.5)
    plain.load_state_dict(model.state_dict())
    a, _ = run(model, segs[3:4], mems)
    b, _ = run(plain, segs[3:4], ref_mems)
    assert_close(a[0], b[0], name="after a weight change")


def test_use_mems_defaults_from_the_config_as_hf():
    model = XLNetModel(_config(), backend="eager").to(DEVICE)
    ids = torch.randint(0, V, (2, 3), device=DEVICE)
    assert model.train()(ids).mems is None                         # use_mems_train=False
    assert len(model.eval()(ids).mems) == model.config.n_layer     # use_mems_eval=True
    assert model.eval()(ids, use_mems=False).mems is None
    model.config.use_mems_train = True
    assert model.train()(ids).mems is not None


def test_inputs_on_another_device_are_refused():
    """input_ids, token_type_ids, target_mapping and mems on another device than the model
    (the meta device here) are refused by name (models/_common.check_device)."""
    model = XLNetModel(_config(), backend="eager")
    c = model.config
    ids = torch.randint(0, V, (2, 6))
    meta = torch.device("meta")
    mems = [torch.randn(3, 2, c.d_model) for _ in range(c.n_layer)]
    for arg, kw in (("input_ids", dict(input_ids=ids.to(meta))),
                    ("token_type_ids", dict(input_ids=ids, token_type_ids=ids.to(meta))),
                    ("target_mapping", dict(input_ids=ids,
                                            target_mapping=torch.eye(6)[None, :2].expand(2, -1, -1)
                                            .to(meta))),
                    ("mems[1]", dict(input_ids=ids, mems=[mems[0], mems[1].to(meta)]
                                     + mems[2:]))):
        with pytest.raises(ValueError, match=re.escape(f"{arg} is on meta, the model on cpu")):
            model(**kw)


@pytest.mark.parametrize("cls", [XLNetModel, XLNetLMHeadModel])
def test_torch_export_gives_the_models_output(cls):
    # XLNetOutput (with its mems) and XLNetLMOutput are registered pytree nodes
    model = cls(_config(), backend="ctxfast").to(DEVICE).eval()
    assert_exports(model, (torch.randint(0, V, (2, 7), device=DEVICE),))
