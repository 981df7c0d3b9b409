"""The decoding path of ``ctxfast.rel_attention`` (a few queries, long memory): the Triton
forward with the keys split over programs (partial outputs + lse per split, then
``kernels.attention``'s combine kernel), BD still computed in the kernel from the band of
r rows; and the FlexAttention formulation of the benchmarks (``flex_score_mod``).

Forced split counts: through the public op by patching ``kernels.rel_attention.
decode_splits`` (the forward's automatic choice), or directly with
``rel_attention_forward(num_splits=n)``. A spy on the combine kernel records the split
count each forward really ran with, so a test cannot pass on the unsplit path. Gradients
and tolerances: ``check`` of tests/test_rel_attention.py (<= 2x the eager error at the same
dtype against float64, plus a small floor, forward and every input's gradient).
"""
import importlib.util
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ctxfast
from ctxfast import reference
from test_attention import DEVICE, needs_triton
from test_rel_attention import NAMES, _inputs, check, check_dropout
from utils import rel_err, spy_launches

ROOT = Path(__file__).resolve().parents[1]


def _cdiv(a, b):
    return -(-a // b)


def _kernels():
    import ctxfast.kernels.attention as attn
    import ctxfast.kernels.rel_attention as rel
    return rel, attn


def expected_combines(Tq, Tk, D, n):
    """The combine launches (their split counts) of one forward asked for n splits: whole
    key blocks per split, so at most one split per key block; one split is no split (the
    forward writes out directly, nothing to combine)."""
    bn = _kernels()[0]._config(D, Tq)[1]
    per = _cdiv(_cdiv(Tk, n), bn) * bn
    splits = _cdiv(Tk, per)
    return [splits] if splits > 1 else []


@pytest.fixture
def combine_spy(monkeypatch):
    """The split counts the combine kernel was launched with (one entry per split forward;
    kernels/_common.py launches it for both ops)."""
    from ctxfast.kernels import _common
    return spy_launches(monkeypatch, _common, ["_attn_combine_kernel"],
                        lambda args, kwargs: args[4], with_name=False)    # S, the splits


@pytest.fixture
def force_splits(monkeypatch, combine_spy):
    """force_splits(n): the public op's forward splits the keys n ways; returns the spy."""
    rel, _ = _kernels()

    def force(n):
        monkeypatch.setattr(rel, "decode_splits", lambda *args, **kwargs: n)
        return combine_spy
    return force


# --------------------------------------------------------------------------- vs reference

@needs_triton
@pytest.mark.parametrize("Tq, mem, n, kind", [
    (1, 97, 3, "txl"), (2, 61, 2, "txl"), (5, 43, 3, "txl"), (1, 41, 3, "txl-pad"),
    (5, 77, 3, "xlnet-content"), (2, 59, 2, "xlnet-query"), (5, 47, 2, "txl-fp16"),
    (3, 90, 3, "txl-window"), (37, 90, 4, "txl"), (21, 70, 3, "txl-window")])
def test_split_forward_and_every_gradient(force_splits, Tq, mem, n, kind):
    """Tq in {1, 2, 5} with an odd memory of 40-97 keys, 2-3 splits, and XL evaluation's
    shape in small (several query blocks against a long memory, the split that
    :func:`key_splits` now also makes for Tq > 16): forward and the gradient of every
    input against the float64 reference."""
    B, H, D = 2, 2, 32
    Tk = Tq + mem
    seen = force_splits(n)
    kw = {}
    if kind == "txl-pad":
        kpm = torch.rand(B, Tk, device=DEVICE) < 0.3
        kpm[:, -1] = False
        kpm[1, : Tk // 2] = True                 # a leading run: splits that see no key
        kw["key_padding_mask"] = kpm
    if kind == "txl-window":                     # same_length: the first splits see no key
        kw["window"] = 40
    if kind.startswith("xlnet"):
        kw = dict(R=Tk + Tq, seg=True, causal=False, pos_start=Tk,
                  key_padding_mask=torch.rand(B, Tk, device=DEVICE) < 0.2,
                  perm_rank=torch.stack([torch.randperm(Tq) for _ in range(B)]).to(DEVICE),
                  perm_stream=kind.split("-")[1])
    dtype = torch.float16 if kind.endswith("fp16") else torch.float32
    check(B, H, Tq, Tk, D, dtype=dtype, **kw)
    assert seen == expected_combines(Tq, Tk, D, n)


@needs_triton
@pytest.mark.parametrize("n", [8, 64])
def test_more_splits_than_key_blocks(combine_spy, n):
    """A split count above the number of key blocks runs one block per split. The keys
    span three blocks and a bit of whatever block the device uses (32 keys under the
    interpreter, 128 on a GPU, where 43 keys were one block and no split at all)."""
    from ctxfast.kernels.rel_attention import rel_attention_backward, rel_attention_forward
    B, H, Tq, D = 2, 2, 2, 16
    bn = _kernels()[0]._config(D, Tq)[1]
    Tk = 2 * bn + 11
    q, k, v, r, u, w = _inputs(B, H, Tq, Tk, D, Tk)
    out, lse = rel_attention_forward(q, k, v, r, u, w, num_splits=n)
    l64 = [t.double().requires_grad_(True) for t in (q, k, v, r, u, w)]
    ref = reference.rel_attention(*l64)
    assert rel_err(out, ref) < 1e-5 and not torch.isnan(out).any()
    assert combine_spy == [_cdiv(Tk, bn)] and _cdiv(Tk, bn) < n
    do = torch.randn_like(out)
    grads = rel_attention_backward(do, q, k, v, r, u, w, out, lse)[:6]
    for name, g, gr in zip(NAMES, grads, torch.autograd.grad(ref, l64, do.double())):
        assert rel_err(g, gr) < 1e-5, name


@needs_triton
def test_rows_that_see_no_key_are_zero(force_splits):
    """Batch row 0 is all padding: every split of it is empty; zeros, zero gradients,
    lse +inf (what the backward expects), never NaN."""
    B, H, Tq, Tk, D = 2, 2, 5, 52, 16
    seen = force_splits(3)
    kpm = torch.zeros(B, Tk, dtype=torch.bool, device=DEVICE)
    kpm[0] = True
    kpm[1, :20] = True
    out, grads = check(B, H, Tq, Tk, D, key_padding_mask=kpm)
    assert seen == expected_combines(Tq, Tk, D, 3)
    assert (out[0] == 0).all() and (grads[0][0] == 0).all()      # out, dq of row 0
    assert (grads[1][0] == 0).all() and (grads[2][0] == 0).all()  # dk, dv of row 0
    from ctxfast.kernels.rel_attention import rel_attention_forward
    _, lse = rel_attention_forward(*_inputs(B, H, Tq, Tk, D, Tk), key_padding_mask=kpm,
                                   num_splits=3)
    assert torch.isinf(lse[0]).all() and (lse[0] > 0).all() and torch.isfinite(lse[1]).all()


@needs_triton
def test_dropout_with_splits_matches_reference_with_the_same_mask(force_splits):
    """The dropout counter is a function of (b, h, i, j), not of the split: the reference
    with ``dropout_keep_mask`` gives the same output and gradients."""
    B, H, Tq, Tk, D = 2, 2, 2, 47, 16
    seen = force_splits(3)
    check_dropout(B, H, Tq, Tk, D, 0.3, seed=11)
    assert seen == expected_combines(Tq, Tk, D, 3)


# --------------------------------------------------------------------------- split == unsplit

@needs_triton
@pytest.mark.parametrize("kind", ["txl", "xlnet", "dropout"])
def test_split_equals_unsplit(kind):
    """Same out and lse (fp32 rounding) for 1 and 3 splits; the backward from the combined
    lse equals the backward from the unsplit one."""
    from ctxfast.kernels.rel_attention import rel_attention_backward, rel_attention_forward
    B, H, Tq, D = 2, 1, 5, 16
    Tk = Tq + (43 if kind == "txl" else 45 if kind == "xlnet" else 41)
    R = Tk + Tq if kind == "xlnet" else Tk
    q, k, v, r, u, w, se, rsb = _inputs(B, H, Tq, Tk, D, R, seg=True)
    kw = {"r": r}
    if kind == "xlnet":
        kw.update(causal=False, pos_start=Tk,
                  key_padding_mask=torch.rand(B, Tk, device=DEVICE) < 0.2,
                  perm_rank=torch.stack([torch.randperm(Tq) for _ in range(B)]).to(DEVICE),
                  perm_strict=True, seg_q=torch.randint(0, 2, (B, Tq), device=DEVICE),
                  seg_k=torch.randint(0, 2, (B, Tk), device=DEVICE), seg_embed=se,
                  r_s_bias=rsb)
    if kind == "dropout":
        kw.update(dropout_p=0.25, seed=torch.tensor([1234], dtype=torch.int64, device=DEVICE))
    r = kw.pop("r")
    out1, lse1 = rel_attention_forward(q, k, v, r, u, w, num_splits=1, **kw)
    do = torch.randn_like(out1)
    grads1 = rel_attention_backward(do, q, k, v, r, u, w, out1, lse1, **kw)
    for n in (3,):
        out, lse = rel_attention_forward(q, k, v, r, u, w, num_splits=n, **kw)
        assert torch.allclose(out, out1, rtol=1e-5, atol=1e-6), (n, (out - out1).abs().max())
        finite = torch.isfinite(lse1)
        assert torch.equal(finite, torch.isfinite(lse))
        assert torch.allclose(lse[finite], lse1[finite], rtol=0, atol=1e-5)
        grads = rel_attention_backward(do, q, k, v, r, u, w, out, lse, **kw)
        for name, a, b in zip(NAMES, grads, grads1):
            if b is not None:
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (n, name)


# --------------------------------------------------------------------------- automatic choice

def test_automatic_split_only_on_cuda(monkeypatch):
    """``decode_splits`` (the forward's choice when no count is given): 1 on CPU tensors
    and in the interpreter; on CUDA more than 1 for a few queries and long keys, 1 for
    training shapes and short keys."""
    rel, attn = _kernels()
    decode = (1, 16, 1, 4096, 64)
    assert rel.decode_splits(*decode, "cpu") == 1
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=132))
    if attn._interpreting():
        assert rel.decode_splits(*decode, "cuda") == 1       # interpreter: CPU tensors
    import ctxfast.kernels._common as common                  # _auto_splits lives there
    for mod in (rel, attn, common):                           # as on a GPU machine
        monkeypatch.setattr(mod, "_interpreting", lambda: False)
    assert rel.decode_splits(*decode, "cpu") == 1
    assert rel.decode_splits(*decode, "cuda") > 1
    assert rel.decode_splits(2, 16, 16, 3072, 64, "cuda") > 1    # 32 programs of 16 rows
    assert rel.decode_splits(16, 16, 1, 3072, 64, "cuda") == 2   # 256 programs, 528 slots
    assert rel.decode_splits(4, 16, 512, 1024, 64, "cuda") == 1  # 512 programs fill 132 SMs
    assert rel.decode_splits(1, 16, 1, 100, 64, "cuda") == 1     # short keys


@needs_triton
@pytest.mark.parametrize("programs, Tk, bn, warps, want", [
    (256, 3928, 32, 4, 2),     # XL eval, fp32: 8 streams x 8 heads x 4 blocks of 32 queries
    (32, 3928, 32, 4, 14),     # one stream: 14 x 32 = 448 of 528 slots (85% of 16 x 32)
    (128, 3928, 64, 4, 4),     # 8 streams, bf16 (blocks of 64): 512 of 528
    (528, 3928, 32, 4, 1),     # a full wave of slots: no split
    (4096, 1024, 64, 4, 1),    # training shapes
    (64, 3928, 32, 8, 4),      # 8 warps a program: 2 per SM, 264 slots
    (16, 200, 64, 4, 1),       # fewer than 8 key blocks: no split worth its combine
    (1, 1 << 20, 64, 4, 55),   # at most 64 splits; 55 is within 85% of them
])
def test_key_splits_decision(programs, Tk, bn, warps, want):
    """The decision logic with the H100's 132 SMs (the default where no GPU is present)."""
    rel, _ = _kernels()
    assert rel.DEFAULT_SMS == 132
    assert rel.key_splits(programs, Tk, bn, warps) == want
    assert rel.key_splits(programs, Tk, bn, warps, sms=rel.DEFAULT_SMS) == want


@needs_triton
def test_xl_eval_shape_splits_on_an_h100(monkeypatch):
    """decode_splits as on an H100 (132 SMs) for XL evaluation (8 streams, 8 heads, 128
    queries, 3,800 keys, D 64): fp32 and bf16 split, the training shape does not. (bf16's
    64-row tiles run 4 warps, the H200's fastest forward launch: 4 programs per SM, 128
    programs after 4 splits fill 512 of 528.)"""
    rel, attn = _kernels()
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(rel, "_interpreting", lambda: False)
    assert rel.decode_splits(8, 8, 128, 3800, 64, "cuda", torch.float32) == 2
    assert rel.decode_splits(8, 8, 128, 3800, 64, "cuda", torch.bfloat16) == 4
    assert rel.decode_splits(1, 8, 128, 3800, 64, "cuda", torch.float32) > 8
    assert rel.decode_splits(16, 8, 512, 1024, 64, "cuda", torch.bfloat16) == 1


@needs_triton
def test_op_does_not_split_on_cpu(combine_spy):
    if DEVICE != "cpu":
        pytest.skip("on a GPU the automatic choice may split")
    B, H, Tq, Tk, D = 1, 1, 1, 97, 16
    ts = _inputs(B, H, Tq, Tk, D, Tk)
    out = ctxfast.rel_attention(*ts, backend="triton")
    assert combine_spy == []
    assert rel_err(out, reference.rel_attention(*(t.double() for t in ts))) < 1e-5


# --------------------------------------------------------------------------- FlexAttention form

@pytest.fixture(scope="module")
def bench():
    """benchmarks/bench_rel_attention.py, loaded by path (benchmarks/ is not a package)."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)                               # its `import _common`
    try:
        name = "ctxfast_bench_rel_attention"
        spec = importlib.util.spec_from_file_location(
            name, ROOT / "benchmarks" / "bench_rel_attention.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module                           # dynamo looks its globals up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


@pytest.mark.parametrize("Tq, mem, R, pos_start", [(5, 41, None, None), (1, 40, None, None),
                                                   (7, 13, 27, 23)])
def test_flex_score_mod_reproduces_the_scores(bench, Tq, mem, R, pos_start):
    """The benchmark's score_mod and mask_mod, evaluated eagerly on every (b, h, i, j)
    (no FlexAttention needed), give the reference's scores on the visible pairs, the causal
    mask, and the reference's output; every read of the BD buffer stays inside it."""
    B, H, D = 2, 3, 16
    Tk = Tq + mem
    R = R or Tk
    pos_start = Tk - 1 if pos_start is None else pos_start
    q, k, v, r, u, w = _inputs(B, H, Tq, Tk, D, R, dtype=torch.float64)
    scale = D ** -0.5
    bd = torch.matmul(q + w[None, :, None], r.transpose(-1, -2)[None])     # [B, H, Tq, R]
    score_mod = bench.flex_score_mod(bd, mem, pos_start, scale)
    mask_mod = bench.flex_mask_mod(mem)
    b, h, i, j = torch.meshgrid(*(torch.arange(n, device=DEVICE) for n in (B, H, Tq, Tk)),
                                indexing="ij")                            # [B, H, Tq, Tk] each
    ac = torch.matmul(q + u[None, :, None], k.transpose(-1, -2)) * scale  # flex's score
    scores = score_mod(ac, b, h, i, j)          # raises IndexError if a row falls outside bd
    visible = mask_mod(b, h, i, j)
    assert torch.equal(visible[0, 0], reference.attention_mask(1, Tq, Tk, causal=True,
                                                                device=DEVICE)[0])
    rows = reference.distance_rows(Tq, Tk, pos_start, DEVICE)             # [Tq, Tk]
    r_pair = r[:, rows.clamp(0, R - 1)]                                   # [H, Tq, Tk, D]
    want = (torch.einsum("bhid,bhjd->bhij", q + u[None, :, None], k)
            + torch.einsum("bhid,hijd->bhij", q + w[None, :, None], r_pair)) * scale
    assert torch.allclose(scores[visible], want[visible], rtol=1e-12, atol=1e-12)
    out = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v
    ref = reference.rel_attention(q, k, v, r, u, w, pos_start=pos_start)
    assert rel_err(out, ref) < 1e-12
    # the same_length case's mask_mod: the reference's visibility with a window
    dist = mem + i - j
    for window in (1, 9):
        assert torch.equal(bench.flex_mask_mod(mem, window)(b, h, i, j),
                           (dist >= 0) & (dist < window))


def test_flex_rel_attention_runs_uncompiled_on_cpu(bench):
    """flex_rel_attention itself through FlexAttention's (uncompiled) CPU path, forward:
    the same output as the reference. (CPU flex has no backward: GPU tests cover it.)"""
    reason = bench._flex_error()
    if reason is not None:
        pytest.skip(reason)
    from torch.nn.attention.flex_attention import create_block_mask
    B, H, Tq, mem, D = 2, 2, 5, 43, 16
    Tk = Tq + mem
    ts = [t.cpu() for t in _inputs(B, H, Tq, Tk, D, Tk)]
    block_mask = create_block_mask(bench.flex_mask_mod(mem), None, None, Tq, Tk, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # "flex_attention called without compile"
        out = bench.flex_rel_attention(*ts, block_mask=block_mask)
    assert rel_err(out, reference.rel_attention(*(t.double() for t in ts))) < 1e-5


@needs_triton
@pytest.mark.parametrize("kind", ["txl", "txl-window", "xlnet-query", "split"])
def test_forward_with_a_query_block_shorter_than_the_key_block(monkeypatch, force_splits, kind):
    """The decoding tile (16 queries against 64-key blocks on a GPU) under the interpreter:
    the forward's position term takes one new chunk of BLOCK_N rows of r per key block and
    reads each pair's row from that chunk or the one before (``_skewed``), which holds
    for any BLOCK_M <= BLOCK_N + 1, not only the square tiles every other test runs.
    Forward and every gradient against float64 (the backward on its own square tiles)."""
    rel, _ = _kernels()
    square = rel._config

    def decode_tile(D, Tq=None, dtype=torch.float16):
        bm, bn, bd, band, warps, stages = square(D, Tq, dtype)
        return (bm, 2 * bn, bd, 4 * bn, warps, stages) if Tq is not None else \
            (bm, bn, bd, band, warps, stages)
    monkeypatch.setattr(rel, "_config", decode_tile)
    B, H, Tq, D = 2, 2, 13, 16
    # keys over three of the decoding tile's blocks (32 keys under the interpreter, 128 or
    # more on a GPU, where a fixed 88 keys were one block: nothing to split)
    mem = 2 * rel._config(D, Tq)[1] + 11
    Tk = Tq + mem
    seen = force_splits(3 if kind == "split" else 1)
    kw = {}
    if kind == "txl-window":
        kw["window"] = 30
    if kind == "xlnet-query":
        kw = dict(R=Tk + Tq, seg=True, causal=False, pos_start=Tk,
                  key_padding_mask=torch.rand(B, Tk, device=DEVICE) < 0.2,
                  perm_rank=torch.stack([torch.randperm(Tq) for _ in range(B)]).to(DEVICE),
                  perm_stream="query")
    check(B, H, Tq, Tk, D, **kw)
    bm, bn = rel._config(D, Tq)[:2]
    assert bm < bn, (bm, bn)          # the interpreter's 16 x 32; a GPU's 16 x 128
    if kind == "split":
        assert seen == [3]
