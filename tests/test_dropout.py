"""ctxfast.locked_dropout and ctxfast.embedding_dropout (and their modules) against
ctxfast.reference.dropout: given masks (deterministic), sampled masks (structure and keep
rate), eval mode, gradients, dtypes, bad inputs."""
import math

import pytest
import torch
import torch.nn.functional as F

import ctxfast
from ctxfast import reference
from ctxfast.nn import EmbeddingDropout, LockedDropout
from utils import assert_close, assert_equal, philox4x32_10

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _six_sigma(mean: float, p: float, n: int) -> None:
    """The fraction kept is 1 - p within 6 standard deviations (false alarm ~1 in 5e8)."""
    assert abs(mean - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n), mean


# --------------------------------------------------------------------------- locked dropout

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, batch_first", [((7, 3, 5), False), ((3, 7, 5), True),
                                                ((1, 2, 3), False), ((6, 4), False),
                                                ((5, 2, 3, 4), False), ((2, 5, 3, 4), True)],
                         ids=str)
def test_locked_dropout_given_mask_matches_reference(shape, batch_first, dtype):
    p = 0.3
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    tdim = 1 if batch_first else 0
    mshape = shape[:tdim] + shape[tdim + 1:]
    mask = torch.rand(mshape) >= p
    out = ctxfast.locked_dropout(x, p, batch_first=batch_first, mask=mask)
    ref = reference.locked_dropout(x, mask, 1 / (1 - p), batch_first)
    assert_equal(out, ref, "forward")
    g = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, g)
    (dref,) = torch.autograd.grad(ref, x, g)
    assert_equal(dx, dref, "grad x")


def test_locked_dropout_non_contiguous_and_float_mask():
    x = torch.randn(5, 8, 6)[:, ::2].transpose(1, 2)          # [5, 6, 4], non-contiguous
    mask = (torch.rand(6, 4) > 0.5).double()
    out = ctxfast.locked_dropout(x, 0.5, mask=mask)
    assert_equal(out, reference.locked_dropout(x, mask, 2.0), "forward")


def test_locked_dropout_sampled_mask_is_shared_over_time():
    p, T = 0.4, 9
    x = torch.randn(T, 64, 32) + 5.0                          # never zero
    out = ctxfast.locked_dropout(x, p)
    kept = out != 0                                           # [T, B, F]
    assert torch.equal(kept, kept[:1].expand_as(kept)), "one mask for all time steps"
    assert_close(out[kept], x[kept] / (1 - p), 1e-6, "kept values scaled by 1/(1-p)")
    _six_sigma(kept[0].float().mean().item(), p, kept[0].numel())
    out_bf = ctxfast.locked_dropout(x.transpose(0, 1), p, batch_first=True)
    kept_bf = out_bf != 0                                     # [B, T, F]
    assert torch.equal(kept_bf, kept_bf[:, :1].expand_as(kept_bf))
    assert not torch.equal(kept_bf.transpose(0, 1), kept), "a new mask per call"


def test_locked_dropout_eval_p0_p1_and_generator():
    x = torch.randn(4, 3, 2)
    m = torch.zeros(3, 2)
    assert ctxfast.locked_dropout(x, 0.5, training=False, mask=m) is x
    assert ctxfast.locked_dropout(x, 0.0) is x
    assert torch.equal(ctxfast.locked_dropout(x, 1.0), torch.zeros_like(x))
    a = ctxfast.locked_dropout(x, 0.5, generator=torch.Generator().manual_seed(1))
    b = ctxfast.locked_dropout(x, 0.5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


def test_locked_dropout_given_mask_applies_at_p0():
    # The module docstring: p = 0 leaves x unchanged only when no mask is given; a given
    # mask is applied (scale 1 / (1 - 0) = 1), in training, in both layouts.
    x = torch.randn(6, 3, 4) + 5.0                           # never zero
    mask = torch.rand(3, 4) > 0.5
    out = ctxfast.locked_dropout(x, 0.0, mask=mask)
    assert_equal(out, reference.locked_dropout(x, mask, 1.0), "p = 0, mask given")
    assert (out == 0).any(), "the mask's zeros must drop values"
    out_bf = ctxfast.locked_dropout(x.transpose(0, 1), 0.0, batch_first=True, mask=mask)
    assert_equal(out_bf, reference.locked_dropout(x.transpose(0, 1), mask, 1.0, True),
                 "p = 0, mask given, batch_first")


def test_locked_dropout_gradcheck():
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 5) > 0.3
    assert torch.autograd.gradcheck(lambda t: ctxfast.locked_dropout(t, 0.3, mask=mask), (x,))


def test_locked_dropout_module():
    m = LockedDropout(0.25, batch_first=True)
    x = torch.randn(3, 6, 4)
    mask = torch.rand(3, 4) > 0.25
    assert_equal(m(x, mask), reference.locked_dropout(x, mask, 1 / 0.75, True), "module")
    m.eval()
    assert m(x) is x
    assert "p=0.25" in repr(m)


def test_locked_dropout_bad_inputs():
    x = torch.randn(4, 3, 2)
    with pytest.raises(ValueError, match=r"mask must have shape \[3, 2\]"):
        ctxfast.locked_dropout(x, 0.5, mask=torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        ctxfast.locked_dropout(x, 1.5)
    with pytest.raises(TypeError, match="p must be a float"):
        ctxfast.locked_dropout(x, "0.5")
    with pytest.raises(ValueError, match="rank >= 2"):
        ctxfast.locked_dropout(torch.randn(4), 0.5)
    with pytest.raises(TypeError, match="floating-point"):
        ctxfast.locked_dropout(torch.ones(4, 3, dtype=torch.long), 0.5)
    with pytest.raises(TypeError, match="mask must be bool or floating"):
        ctxfast.locked_dropout(x, 0.5, mask=torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="p must be a number"):
        LockedDropout(-0.1)


# --------------------------------------------------------------------------- embedding dropout

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_embedding_dropout_given_mask_matches_reference(scale, padding_idx, dtype):
    V, E, p = 11, 6, 0.4
    weight = torch.randn(V, E, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, V, (4, 9))
    ids[0, :3] = 2                                            # the padding row appears
    mask = torch.rand(V) >= p
    mask[ids[1, 0]] = False                                   # a dropped word that occurs
    out = ctxfast.embedding_dropout(weight, ids, p, scale=scale, padding_idx=padding_idx,
                                    mask=mask)
    ref = reference.embedding_dropout(weight, ids, mask, 1 / (1 - p), scale, padding_idx)
    assert out.shape == (4, 9, E) and out.dtype == dtype
    assert (out[1, 0] == 0).all()
    assert_close(out, ref, None, "forward")
    g = torch.randn_like(out)
    (dw,) = torch.autograd.grad(out, weight, g)
    (dref,) = torch.autograd.grad(ref, weight, g)
    assert_close(dw, dref, None, "grad weight")
    if padding_idx is not None:
        assert (dw[padding_idx] == 0).all()


def test_embedding_dropout_sampled_drops_whole_words():
    V, E, p = 400, 8, 0.3
    weight = torch.randn(V, E) + 3.0                          # never zero
    ids = torch.randint(0, V, (16, 50))
    out = ctxfast.embedding_dropout(weight, ids, p)           # [16, 50, E]
    kept_rows = (out != 0).all(-1)
    assert torch.equal(kept_rows, (out != 0).any(-1)), "a word is dropped as a whole"
    for v in ids.unique()[:50].tolist():                      # every occurrence alike
        k = kept_rows[ids == v]
        assert k.all() or not k.any(), v
    assert_close(out[kept_rows], weight[ids][kept_rows] / (1 - p), 1e-6, "kept scaled")
    many = torch.stack([(ctxfast.embedding_dropout(weight, torch.arange(V), p) != 0).all(-1)
                        for _ in range(20)])                  # 20 draws of V words
    _six_sigma(many.float().mean().item(), p, many.numel())


def test_embedding_dropout_eval_and_gradcheck():
    weight = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 3, 3, 6]])
    mask = torch.zeros(7)
    assert torch.equal(ctxfast.embedding_dropout(weight, ids, 0.5, training=False, mask=mask),
                       F.embedding(ids, weight))
    assert torch.equal(ctxfast.embedding_dropout(weight, ids, 0.5, training=False, scale=2.0),
                       2 * F.embedding(ids, weight))
    mask = torch.tensor([1., 0, 1, 1, 0, 1, 1], dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda w: ctxfast.embedding_dropout(w, ids, 0.5, mask=mask, scale=0.5), (weight,))


def test_embedding_dropout_given_mask_applies_at_p0():
    # As locked_dropout: p = 0 with a given mask drops the mask's words (scale 1), with
    # the extra scale applied on top.
    weight = torch.randn(9, 4) + 3.0                          # never zero
    ids = torch.tensor([[0, 3, 3, 8], [1, 2, 5, 3]])
    mask = torch.tensor([1, 0, 1, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    for scale in (None, 0.5):
        out = ctxfast.embedding_dropout(weight, ids, 0.0, mask=mask, scale=scale)
        ref = reference.embedding_dropout(weight, ids, mask, 1.0, scale)
        assert_equal(out, ref, f"p = 0, mask given, scale {scale}")
        assert (out[0, 1] == 0).all() and (out[1, 0] == 0).all(), "masked words dropped"


def test_embedding_dropout_padding_idx_at_both_ends_of_its_range():
    # padding_idx in [-V, V), as F.embedding: -V and V - 1 are the first and last rows.
    V = 6
    weight = torch.randn(V, 3, requires_grad=True)
    ids = torch.tensor([[0, 5, 2], [5, 0, 1]])
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    for padding_idx, row in ((-V, 0), (V - 1, V - 1)):
        out = ctxfast.embedding_dropout(weight, ids, 0.25, mask=mask, padding_idx=padding_idx)
        ref = reference.embedding_dropout(weight, ids, mask, 1 / 0.75, None, padding_idx)
        assert_close(out, ref, None, f"padding_idx {padding_idx}")
        (dw,) = torch.autograd.grad(out.sum(), weight)
        assert (dw[row] == 0).all(), f"padding_idx {padding_idx}: row {row} got a gradient"


def test_embedding_dropout_of_no_ids():
    # An empty batch of ids (no values to check) gives an empty lookup, in training with
    # a sampled mask and with a given one, as F.embedding does.
    weight = torch.randn(7, 3)
    for shape in ((0,), (2, 0)):
        ids = torch.empty(shape, dtype=torch.long)
        for mask in (None, torch.ones(7)):
            out = ctxfast.embedding_dropout(weight, ids, 0.5, mask=mask)
            assert out.shape == (*shape, 3) and out.dtype == weight.dtype, (shape, out.shape)


def test_embedding_dropout_module_wraps_embedding():
    emb = torch.nn.Embedding(10, 4, padding_idx=1)
    m = EmbeddingDropout(emb, 0.2)
    assert m.emb is emb and list(m.state_dict()) == ["emb.weight"]
    ids = torch.randint(0, 10, (3, 5))
    mask = torch.rand(10) > 0.2
    assert_close(m(ids, mask=mask),
                 reference.embedding_dropout(emb.weight, ids, mask, 1 / 0.8, None, 1),
                 None, "module")
    m.eval()
    assert torch.equal(m(ids), emb(ids))
    with pytest.raises(NotImplementedError, match="max_norm"):
        EmbeddingDropout(torch.nn.Embedding(10, 4, max_norm=1.0), 0.1)


@pytest.mark.parametrize("scale_grad_by_freq, sparse", [(False, False), (True, False),
                                                       (False, True)])
def test_embedding_dropout_module_honours_the_embeddings_options(scale_grad_by_freq, sparse):
    """The module takes padding_idx, scale_grad_by_freq and sparse from its nn.Embedding:
    forward and weight gradient as F.embedding with those options on the dropped weight
    (fastai's EmbeddingDropout); the padding row gets no gradient, a sparse embedding a
    sparse one, repeated words a gradient divided by their count."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, padding_idx=3, scale_grad_by_freq=scale_grad_by_freq,
                             sparse=sparse, dtype=torch.float64)
    m = EmbeddingDropout(emb, 0.3)
    ids = torch.tensor([[3, 1, 1, 5], [1, 3, 7, 5]])
    mask = torch.rand(10) >= 0.3
    mask[[1, 3, 5, 7]] = True                                  # the words used: kept
    out = m(ids, mask=mask)
    g = torch.randn_like(out)
    out.backward(g)
    w = emb.weight.detach().clone().requires_grad_(True)
    ref = F.embedding(ids, w * mask[:, None] / 0.7, 3, None, 2.0, scale_grad_by_freq, False)
    ref.backward(g)
    assert_close(out, ref, None, "forward")
    grad = emb.weight.grad
    assert grad.is_sparse == sparse, f"sparse={sparse}: a {grad.layout} gradient"
    assert_close(grad.to_dense(), w.grad, None, "grad weight")
    assert (grad.to_dense()[3] == 0).all(), "the padding row got a gradient"


def test_embedding_dropout_bad_inputs():
    w = torch.randn(5, 3)
    ids = torch.tensor([0, 4])
    with pytest.raises(ValueError, match=r"mask must have shape \[5\]"):
        ctxfast.embedding_dropout(w, ids, 0.5, mask=torch.ones(4))
    with pytest.raises(TypeError, match="input_ids must be an integer"):
        ctxfast.embedding_dropout(w, ids.float(), 0.5)
    with pytest.raises(ValueError, match=r"weight must have shape \[V, E\]"):
        ctxfast.embedding_dropout(torch.randn(5), ids, 0.5)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        ctxfast.embedding_dropout(w, ids, -0.5)
    for bad in (5, -1):                                         # out of the vocabulary
        with pytest.raises(ValueError, match=rf"input_ids must be in \[0, V\) with V = 5.*got id {bad}"):
            ctxfast.embedding_dropout(w, torch.tensor([0, bad]), 0.5)
        with pytest.raises(ValueError, match=r"EmbeddingDropout: words must be in .* V = 5"):
            ctxfast.nn.EmbeddingDropout(torch.nn.Embedding(5, 3), 0.1)(torch.tensor([[bad]]))


def test_embedding_dropout_refuses_ids_on_another_device_and_a_bad_padding_idx():
    """Meta ids gave uninitialised values; padding_idx out of range a bare AssertionError
    from F.embedding."""
    w = torch.randn(10, 4)
    ids = torch.tensor([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="input_ids is on meta but weight is on cpu"):
        ctxfast.embedding_dropout(w, ids.to("meta"), 0.5)
    with pytest.raises(ValueError, match="input_ids is on meta but weight is on cpu"):
        EmbeddingDropout(torch.nn.Embedding(10, 4), 0.5)(ids.to("meta"))
    for bad in (10, 20, -11):
        with pytest.raises(ValueError, match=rf"padding_idx must be in \[-V, V\) with V = 10.*"
                                             rf"got {bad}"):
            ctxfast.embedding_dropout(w, ids, 0.5, padding_idx=bad)
    with pytest.raises(TypeError, match="padding_idx must be None or an int, got float"):
        ctxfast.embedding_dropout(w, ids, 0.5, padding_idx=1.0)
    out = ctxfast.embedding_dropout(w, ids, 0.0, padding_idx=-1)        # row 9, as F.embedding
    assert torch.equal(out, F.embedding(ids, w, padding_idx=-1))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32], ids=str)
def test_embedding_dropout_takes_any_integer_dtype(dtype):
    """The docstring's "integer tensor": narrow dtypes too (uint8 must not index as a bool
    mask), the same result as int64 ids."""
    w = torch.randn(10, 4, requires_grad=True)
    ids = torch.tensor([[1, 2, 2], [9, 0, 4]])
    mask = torch.tensor([1., 0, 1, 1, 1, 0, 1, 1, 1, 1])
    for kw in (dict(mask=mask, scale=0.5), dict(training=False)):
        out = ctxfast.embedding_dropout(w, ids.to(dtype), 0.3, **kw)
        assert torch.equal(out, ctxfast.embedding_dropout(w, ids, 0.3, **kw)), kw
    out.sum().backward()
    assert w.grad is not None


# --------------------------------------------------------------------------- DropConnect masks

def _mask_reference(seed: int, n: int, p: float) -> torch.Tensor:
    """keep_mask's contract: value e = 32 b + 8 w + l is word w of counter 8 b + l, kept iff
    its uniform (int32 x, x < 0 -> ~x, times 2^-31 in float32) is >= p (in float32)."""
    out = torch.empty(n)
    for e in range(n):
        b, r = divmod(e, 32)
        w, lane = divmod(r, 8)
        x = philox4x32_10(seed, 8 * b + lane)[w]
        x = x - (1 << 32) if x >= 1 << 31 else x              # as int32
        x = ~x if x < 0 else x
        u = torch.tensor(float(x), dtype=torch.float32) * torch.tensor(4.6566127342e-10)
        out[e] = float(u >= torch.tensor(p, dtype=torch.float32))
    return out


needs_cpu_mask = pytest.mark.skipif(not hasattr(torch.ops.ctxfast, "keep_mask_cpu"),
                                    reason="the C++ extension is not built")


@needs_cpu_mask
@pytest.mark.parametrize("n", [1, 31, 32, 33, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_keep_mask_cpu_is_the_philox_stream(n, dtype):
    """Every value against a plain-Python Philox-4x32-10, for lengths that end inside a
    block of 32 (the scalar tail) and whole blocks (the AVX2 path for float32), with a seed
    whose high word is used."""
    seed, p = (0x1234_5678 << 32) | 0x9ABC_DEF1, 0.3
    got = torch.ops.ctxfast.keep_mask_cpu(torch.empty(n, dtype=dtype),
                                          torch.tensor([seed]), p)
    assert got.dtype == dtype and got.shape == (n,)
    assert_equal(got.float(), _mask_reference(seed, n, p))


@needs_cpu_mask
def test_keep_mask_keep_rate_dtypes_seeds():
    from ctxfast.ops.dropout import keep_mask
    w = torch.empty(301, 1000)                                # not a multiple of the chunks
    for p in (0.1, 0.5, 0.9):
        m = keep_mask(w, p)
        assert m.shape == w.shape and m.dtype == w.dtype and m.is_contiguous()
        assert set(m.unique().tolist()) <= {0.0, 1.0}
        _six_sigma(m.mean().item(), p, m.numel())
    torch.manual_seed(5)
    a = keep_mask(w, 0.4)
    torch.manual_seed(5)
    assert torch.equal(a, keep_mask(w, 0.4))                   # torch's RNG draws the seed
    assert not torch.equal(a, keep_mask(w, 0.4))               # the next draw differs
    g = torch.Generator().manual_seed(9)
    b = keep_mask(w, 0.4, generator=g)
    assert torch.equal(b, keep_mask(w, 0.4, generator=torch.Generator().manual_seed(9)))
    assert not torch.equal(b, keep_mask(w, 0.4, generator=g))
    # float64 (scalar) and float32 (AVX2 + tail) give the same values; half types too
    for dt in (torch.float64, torch.bfloat16, torch.float16):
        m = keep_mask(w.to(dt), 0.4, generator=torch.Generator().manual_seed(9))
        assert m.dtype == dt and torch.equal(m.float(), b)
    assert torch.equal(keep_mask(w, 0.0), torch.ones_like(w))
    assert keep_mask(torch.empty(0, 7), 0.5).shape == (0, 7)
    with pytest.raises(ValueError, match="p must be in"):
        keep_mask(w, 1.0)
    with pytest.raises(ValueError, match="p must be in"):
        torch.ops.ctxfast.keep_mask_cpu(w, torch.tensor([1]), -0.1)
    with pytest.raises(ValueError, match="seed must be"):
        torch.ops.ctxfast.keep_mask_cpu(w, torch.tensor([1.0]), 0.1)
