"""ctxfast.models.xlnet.from_hf_xlnet: the same weights as a Hugging Face XLNetModel /
XLNetLMHeadModel (tiny, built from configs; nothing downloaded) give the same outputs in
eval: content stream with permutation ranks (HF: the equivalent perm_mask), query stream
with target_mapping, memory from a previous segment, and the config variants."""
import pytest
import torch

import ctxfast
from ctxfast.models.xlnet import (XLNetLMHeadModel, XLNetModel, from_hf_xlnet,
                                  perm_mask_to_perm_rank, perm_rank_to_perm_mask)
from utils import DEVICE, TRITON_ON_CPU, assert_close

transformers = pytest.importorskip("transformers")

FAST = "triton" if (TRITON_ON_CPU or torch.cuda.is_available()) else None
BACKENDS = ["eager"] + (["ctxfast"] if FAST else [])
V = 41


def _hf(lm=True, **kw):
    # initializer_range 0.3 (not 0.02): peaked attention, so that every term and mask counts
    cfg = dict(vocab_size=V, d_model=32, n_layer=2, n_head=2, d_inner=48, dropout=0.0,
               mem_len=6, initializer_range=0.3)
    cfg.update(kw)
    cls = transformers.XLNetLMHeadModel if lm else transformers.XLNetModel
    return cls(transformers.XLNetConfig(**cfg)).to(DEVICE).eval()


def _ours(hf, backend):
    return from_hf_xlnet(hf, backend=backend)


def _run(model, backend, **kw):
    with ctxfast.backend(FAST if backend == "ctxfast" else "eager"), torch.no_grad():
        return model(**kw)


def _ranks(B, T):
    return torch.stack([torch.randperm(T) for _ in range(B)]).to(DEVICE)


def _targets(rank, P):
    """[B, P, T] one-hot on the P last tokens of each order (none sees no key)."""
    B, T = rank.shape
    top = rank.argsort(dim=1, stable=True)[:, T - P:]                   # [B, P]
    return torch.nn.functional.one_hot(top, T).float()


@pytest.mark.parametrize("lm", [False, True])
def test_parameter_names_and_shapes_are_hf_ones(lm):
    hf = _hf(lm)
    ours = _ours(hf, "eager")
    assert isinstance(ours, XLNetLMHeadModel if lm else XLNetModel)
    a, b = ours.state_dict(), hf.state_dict()
    assert {k: tuple(v.shape) for k, v in a.items()} == {k: tuple(v.shape) for k, v in b.items()}
    for k in b:
        assert torch.equal(a[k], b[k]), k
    assert not ours.training
    if lm:
        assert ours.lm_loss.weight is ours.transformer.word_embedding.weight  # tied as HF


def test_perm_rank_to_perm_mask():
    rank = torch.tensor([[2, 0, 1]])
    # i may not attend j iff rank[j] >= rank[i]
    want = torch.tensor([[[1, 0, 0], [1, 1, 1], [1, 0, 1]]]).float()
    assert torch.equal(perm_rank_to_perm_mask(rank), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_content_stream_with_perm_rank_segments_and_padding(backend):
    hf = _hf(lm=False)
    ours = _ours(hf, backend)
    B, T = 2, 9
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    tt = torch.randint(0, 2, (B, T), device=DEVICE)
    am = torch.ones(B, T, device=DEVICE)
    am[1, :3] = 0                                                        # left padding
    rank = _ranks(B, T)
    with torch.no_grad():
        want = hf(ids, attention_mask=am, token_type_ids=tt,
                  perm_mask=perm_rank_to_perm_mask(rank), use_mems=True)
    got = _run(ours, backend, input_ids=ids, attention_mask=am, token_type_ids=tt,
               perm_rank=rank, use_mems=True)
    real = am.bool()                     # padded positions' own states differ (docstring)
    assert_close(got.last_hidden_state[real], want.last_hidden_state[real])
    for i, (a, b) in enumerate(zip(got.mems, want.mems)):
        keep = real[:, T - a.shape[0]:]                                  # last mem_len steps
        assert_close(a.transpose(0, 1)[keep], b.transpose(0, 1)[keep], name=f"mems[{i}]")


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_stream_with_target_mapping(backend):
    hf = _hf(lm=True)
    ours = _ours(hf, backend)
    B, T, P = 3, 8, 3
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    tt = torch.randint(0, 2, (B, T), device=DEVICE)
    rank = _ranks(B, T)
    tm = _targets(rank, P)
    labels = torch.randint(0, V, (B, P), device=DEVICE)
    with torch.no_grad():
        want = hf(ids, token_type_ids=tt, perm_mask=perm_rank_to_perm_mask(rank),
                  target_mapping=tm, labels=labels)
    got = _run(ours, backend, input_ids=ids, token_type_ids=tt, perm_rank=rank,
               target_mapping=tm, labels=labels)
    assert got.logits.shape == (B, P, V)
    assert_close(got.logits, want.logits)
    assert_close(got.loss, want.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mems_from_a_previous_segment(backend):
    hf = _hf(lm=True, mem_len=6)
    ours = _ours(hf, backend)
    B, T1, T2, P = 2, 5, 4, 2
    ids1 = torch.randint(0, V, (B, T1), device=DEVICE)
    ids2 = torch.randint(0, V, (B, T2), device=DEVICE)
    tt2 = torch.randint(0, 2, (B, T2), device=DEVICE)
    rank = _ranks(B, T2)
    tm = _targets(rank, P)
    with torch.no_grad():
        w1 = hf(ids1, use_mems=True)
        w2 = hf(ids2, mems=w1.mems, token_type_ids=tt2, perm_mask=perm_rank_to_perm_mask(rank),
                target_mapping=tm, use_mems=True)
    g1 = _run(ours, backend, input_ids=ids1, use_mems=True)
    for i, (a, b) in enumerate(zip(g1.mems, w1.mems)):
        assert a.shape == b.shape == (T1, B, 32)
        assert_close(a, b, name=f"segment 1 mems[{i}]")
    g2 = _run(ours, backend, input_ids=ids2, mems=g1.mems, token_type_ids=tt2, perm_rank=rank,
              target_mapping=tm, use_mems=True)
    assert_close(g2.logits, w2.logits)
    for i, (a, b) in enumerate(zip(g2.mems, w2.mems)):
        assert a.shape == b.shape == (6, B, 32)                          # clipped to mem_len
        assert_close(a, b, name=f"segment 2 mems[{i}]")


def test_generation_pattern_with_tied_ranks():
    """HF's prepare_inputs_for_generation: nobody sees the last (dummy) token, which is
    predicted: ranks 0, ..., 0, 1 (ties) give the same attention pattern."""
    hf = _hf(lm=True)
    ours = _ours(hf, "eager")
    B, T = 2, 6
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    perm_mask = torch.zeros(B, T, T, device=DEVICE)
    perm_mask[:, :, -1] = 1.0
    tm = torch.zeros(B, 1, T, device=DEVICE)
    tm[:, 0, -1] = 1.0
    rank = torch.zeros(B, T, dtype=torch.long, device=DEVICE)
    rank[:, -1] = 1
    with torch.no_grad():
        want = hf(ids, perm_mask=perm_mask, target_mapping=tm).logits
        want_h = hf.transformer(ids, perm_mask=perm_mask).last_hidden_state
    assert_close(_run(ours, "eager", input_ids=ids, perm_rank=rank, target_mapping=tm).logits,
                 want)
    assert_close(_run(ours.transformer, "eager", input_ids=ids, perm_rank=rank)
                 .last_hidden_state, want_h)


VARIANTS = {
    "uni": dict(attn_type="uni"),
    "uni_same_length": dict(attn_type="uni", same_length=True),
    "bi_data_clamp": dict(bi_data=True, clamp_len=3),
    "gelu_new_untied_reuse": dict(ff_activation="gelu_new", tie_word_embeddings=False,
                                  reuse_len=3, mem_len=0),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants(variant):
    hf = _hf(lm=True, **VARIANTS[variant])
    B, T, mlen, P = 2, 6, 3, 2
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    mems = [torch.randn(mlen, B, 32, device=DEVICE) for _ in range(2)]
    rank = _ranks(B, T)
    tm = _targets(rank, P)
    # HF's "uni" cannot take a perm_mask (its in-place `attn_mask += data_mask` fails to
    # broadcast over the batch): causal only there, both streams then see j <= i + mlen
    uni = variant.startswith("uni")
    perm = {} if uni else dict(perm_mask=perm_rank_to_perm_mask(rank))
    with torch.no_grad():
        want = hf(ids, mems=mems, target_mapping=tm, use_mems=True, **perm)
    for backend in BACKENDS if uni else ["eager"]:   # uni: the kernels' causal / window masks
        got = _run(_ours(hf, backend), backend, input_ids=ids, mems=mems, target_mapping=tm,
                   use_mems=True, perm_rank=rank if perm else None)
        assert_close(got.logits, want.logits, name=backend)
        for a, b in zip(got.mems, want.mems):
            assert_close(a, b, name="mems")


def test_from_hf_keeps_dtype_and_mode_and_refuses_other_models():
    hf = _hf(lm=False).double().train()
    ours = _ours(hf, "eager")
    assert ours.training and ours.word_embedding.weight.dtype == torch.float64
    with pytest.raises(TypeError, match="XLNetModel"):
        from_hf_xlnet(torch.nn.Linear(2, 2))


def test_from_hf_dispatches_xlnet_here():
    from ctxfast.models import from_hf
    hf = _hf(lm=True)
    ours = from_hf(hf, backend="eager")
    assert isinstance(ours, XLNetLMHeadModel) and ours.transformer.backend == "eager"
    ids = torch.randint(0, V, (2, 5), device=DEVICE)
    with torch.no_grad():
        assert_close(ours(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_perm_mask_converted_to_perm_rank_gives_hf_outputs(backend):
    """HF's documented use (every token sees the context, no token sees the last two,
    which are predicted, and the last sees the one before it): HF with that perm_mask
    equals ours with perm_mask_to_perm_rank(perm_mask, target_mapping), both streams."""
    hf = _hf(lm=True)
    ours = _ours(hf, backend)
    B, T = 2, 7
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    perm_mask = torch.zeros(B, T, T, device=DEVICE)
    perm_mask[:, :, -2:] = 1                      # the two targets are hidden from all...
    perm_mask[:, -1, -2] = 0                      # ...but the last sees the one before it
    tm = torch.zeros(B, 2, T, device=DEVICE)
    tm[:, 0, -2] = tm[:, 1, -1] = 1
    rank = perm_mask_to_perm_rank(perm_mask, tm)
    assert rank.tolist() == [[4, 4, 4, 4, 4, 5, 6]] * B
    with torch.no_grad():
        want = hf(ids, perm_mask=perm_mask, target_mapping=tm)
    got = _run(ours, backend, input_ids=ids, perm_rank=rank, target_mapping=tm)
    assert_close(got.logits, want.logits)
