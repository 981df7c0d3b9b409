"""ctxfast.attention_varlen (packed sequences) against the reference run per sequence."""
import pytest
import torch

import ctxfast
from ctxfast import reference
from test_attention import DEVICE, needs_triton
from utils import ATTN_BACKENDS, rel_err


def _packed(lens_q, lens_k, H, D, dtype=torch.float32):
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), H, D, dtype=dtype, device=DEVICE)
    k = torch.randn(int(cu_k[-1]), H, D, dtype=dtype, device=DEVICE)
    v = torch.randn(int(cu_k[-1]), H, D, dtype=dtype, device=DEVICE)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def _per_sequence_reference(q, k, v, cu_q, cu_k, causal):
    """float64, one sequence at a time through the dense reference."""
    outs = []
    for b in range(len(cu_q) - 1):
        sq, eq, sk, ek = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        # [T, H, D] -> [1, H, T, D]
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q[sq:eq], k[sk:ek], v[sk:ek]))
        outs.append(reference.attention(qb, kb, vb, causal=causal).squeeze(0).transpose(0, 1))
    return torch.cat(outs)


LENS_CASES = [([5, 17, 1, 33], [5, 17, 1, 33]),
              ([3, 20], [9, 31]),           # memory per sequence
              ([7, 0, 12], [7, 4, 12]),     # an empty query sequence
              ([9, 5], [4, 5])]             # causal: 5 rows see no key


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens_q, lens_k", LENS_CASES)
def test_varlen_matches_per_sequence_reference(causal, lens_q, lens_k):
    q, k, v, cu_q, cu_k, mq, mk = _packed(lens_q, lens_k, H=2, D=32)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ctxfast.attention_varlen(*leaves, cu_q, cu_k, mq, mk, causal=causal, backend="triton")
    leaves64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = _per_sequence_reference(*leaves64, cu_q, cu_k, causal)
    assert rel_err(out, ref) < 1e-5
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, do)
    ref_grads = torch.autograd.grad(ref, leaves64, do.double(), allow_unused=True)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        r = torch.zeros_like(g, dtype=torch.float64) if r is None else r
        assert rel_err(g, r) < 1e-5, (name, rel_err(g, r))
    if causal and lens_q == [9, 5]:       # queries 0..4 of sequence 0 see no key: zeros
        assert (out[:5] == 0).all() and (grads[0][:5] == 0).all()
    eager = ctxfast.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal, backend="eager")
    assert rel_err(eager, ref) < 1e-5


@needs_triton
def test_varlen_equals_dense_with_padding():
    """Packing [B, T] sequences of lengths L_b equals dense attention with a padding mask
    (on the valid rows)."""
    lens = [9, 17, 4]
    B, H, T, D = 3, 2, 17, 16
    q, k, v = (torch.randn(B, H, T, D, device=DEVICE) for _ in range(3))
    kpm = torch.arange(T, device=DEVICE)[None, :] >= torch.tensor(lens, device=DEVICE)[:, None]
    dense = ctxfast.attention(q, k, v, key_padding_mask=kpm, backend="triton")
    pack = lambda t: torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])  # noqa: E731
    cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
    out = ctxfast.attention_varlen(pack(q), pack(k), pack(v), cu, cu, max(lens), max(lens),
                                   backend="triton")
    assert rel_err(out, pack(dense)) < 1e-5


@needs_triton
def test_varlen_dropout_reproducible():
    q, k, v, cu_q, cu_k, mq, mk = _packed([6, 11], [6, 11], H=2, D=16)
    run = lambda s: ctxfast.attention_varlen(  # noqa: E731
        q, k, v, cu_q, cu_k, mq, mk, dropout_p=0.4, backend="triton",
        generator=torch.Generator(DEVICE).manual_seed(s))
    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))


@needs_triton
def test_varlen_opcheck():
    q, k, v, cu_q, cu_k, mq, mk = _packed([3, 7], [5, 7], H=2, D=16)
    torch.library.opcheck(torch.ops.ctxfast.attention_varlen_fwd_triton.default,
                          (q.requires_grad_(), k, v, cu_q, cu_k, mq, mk, True, 0.25, 0.0, None))


@pytest.mark.parametrize("change, exc, words", [
    (dict(q=torch.randn(2, 5, 2, 16)), ValueError, ["q must have shape [total, H, D]"]),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 3], dtype=torch.int32)), ValueError, ["cu_seqlens_q", "not decrease"]),
    (dict(cu_seqlens_q=torch.tensor([0, 3.0, 10])), TypeError,
     ["cu_seqlens_q must be an int32 or int64 tensor", "got torch.float32"]),
    (dict(max_seqlen_q=4), ValueError, ["max_seqlen 4"]),
    (dict(max_seqlen_k=-1), ValueError, ["max_seqlen for cu_seqlens_k", ">= 0, got -1"]),
    (dict(max_seqlen_q=7.0), TypeError, ["max_seqlen for cu_seqlens_q", "an int, got float"]),
    (dict(scale="x"), TypeError, ["attention_varlen: scale must be a float or None"]),
    (dict(dropout_p="0.1"), TypeError, ["attention_varlen: dropout_p must be a float"]),
    (dict(dropout_p=0.1, generator="g"), TypeError, ["generator", "torch.Generator or None"]),
    (dict(cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32)), ValueError, ["same length B + 1"]),
])
def test_varlen_bad_input(change, exc, words):
    args = dict(q=torch.randn(10, 2, 16), k=torch.randn(10, 2, 16), v=torch.randn(10, 2, 16),
                cu_seqlens_q=torch.tensor([0, 3, 10], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 3, 10], dtype=torch.int32),
                max_seqlen_q=7, max_seqlen_k=7)
    args.update(change)
    with pytest.raises(exc) as info:
        ctxfast.attention_varlen(**args)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


@pytest.mark.parametrize("backend", ATTN_BACKENDS)
def test_strided_int32_offsets(backend):
    """cu_seqlens given as a strided int32 view (every other element of a buffer) read as
    their values on every backend, forward and gradients: the triton kernels read element b
    at b, and took the view as it was (wrong rows: garbage, NaN or a crash)."""
    q, k, v, cu_q, cu_k, mq, mk = _packed([3, 5, 4], [6, 5, 2], H=2, D=16)
    strided = [torch.stack([cu, torch.zeros_like(cu)], 1).reshape(-1)[::2] for cu in
               (cu_q.to(torch.int32), cu_k.to(torch.int32))]
    assert strided[0].stride() == (2,) and torch.equal(strided[0], cu_q.to(torch.int32))
    runs = []
    for cus in ((cu_q, cu_k), strided):
        ts = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = ctxfast.attention_varlen(*ts, *cus, mq, mk, causal=True, backend=backend)
        runs.append([out] + list(torch.autograd.grad(out.square().sum(), ts)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", ATTN_BACKENDS)
def test_no_sequence_at_all(backend):
    """cu_seqlens [0] (a batch of none): zeros in q's graph with zero gradient, on every
    backend (eager returned a tensor outside the graph: backward raised)."""
    x = torch.randn(2, 1, 8, device=DEVICE, requires_grad=True)
    cu = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    out = ctxfast.attention_varlen(x, x, x, cu, cu, 0, 0, backend=backend)
    assert out.shape == x.shape and (out == 0).all()
    out.sum().backward()
    assert (x.grad == 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens_q, lens_k", LENS_CASES)
def test_eager_traced_form_matches_per_sequence_reference(causal, lens_q, lens_k):
    """The eager backend's form under torch.compile (one masked attention over all packed
    rows) against the float64 reference, forward and backward; two query rows after the
    last sequence belong to none: zeros, zero gradient."""
    from ctxfast.ops.attention import _varlen_eager_traced
    q, k, v, cu_q, cu_k, _, _ = _packed(lens_q, lens_k, H=2, D=16)
    q = torch.cat([q, torch.randn(2, 2, 16, device=DEVICE)])       # [total_q + 2, H, D]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = _varlen_eager_traced(*leaves, cu_q, cu_k, causal, 0.0, 16 ** -0.5, None)
    leaves64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = _per_sequence_reference(leaves64[0][:-2], *leaves64[1:], cu_q, cu_k, causal)
    ref = torch.cat([ref, ref.new_zeros(2, 2, 16)])
    assert (out[-2:] == 0).all()
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, do)
    ref_grads = torch.autograd.grad(ref, leaves64, do.double(), allow_unused=True)
    assert rel_err(out, ref) < 1e-5, rel_err(out, ref)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        r = torch.zeros_like(g, dtype=torch.float64) if r is None else r
        assert rel_err(g, r) < 1e-5, (name, rel_err(g, r))
    assert (grads[0][-2:] == 0).all()


@pytest.mark.parametrize("backend", ATTN_BACKENDS)
def test_compiles_fullgraph_with_lengths_from_data(backend):
    """torch.compile(fullgraph=True) of a padded batch packed inside the graph (nonzero; the
    lengths and max_seqlen from data, as BERT's varlen path): every backend traces without a
    graph break (the checks guarded on max_seqlen and on the packed sizes, and the eager
    backend's loop over sequences sliced at their values, broke it) and gives the uncompiled
    call's outputs and gradients."""
    H, D, T = 2, 16, 9
    keep = torch.tensor([[1] * 7 + [0] * 2, [1] * 3 + [0] * 6, [1] * 9], dtype=torch.bool,
                        device=DEVICE)                                   # [B, T]

    def f(x, keep):
        B = x.shape[0]
        idx = keep.reshape(-1).nonzero().squeeze(1)                      # [total]
        lens = keep.sum(1, dtype=torch.int32)                            # [B]
        cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))  # [B + 1]
        mx = int(lens.max())
        xp = x.reshape(B * T, H, D)[idx]                                 # [total, H, D]
        out = ctxfast.attention_varlen(xp, xp, xp, cu, cu, mx, mx, causal=True,
                                       backend=backend)
        return out.square().sum()

    x = torch.randn(3, T, H * D, device=DEVICE, requires_grad=True)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True,
                                    capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        loss = compiled(x, keep)
        (grad,) = torch.autograd.grad(loss, x)
    ref_loss = f(x, keep)
    (ref_grad,) = torch.autograd.grad(ref_loss, x)
    assert rel_err(loss, ref_loss) < 1e-5 and rel_err(grad, ref_grad) < 1e-5
