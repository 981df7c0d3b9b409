"""ctxfast.rel_attention on a GPU at sizes the interpreter cannot reach: the decoding path
(keys split over programs, chosen automatically on CUDA) in bf16/fp16/fp32 against the
float64 reference, the split path against the unsplit one, a training shape, and the
FlexAttention formulation of the benchmarks (compiled, forward and backward). (The CPU
tests in tests/test_rel_attention*.py also run here: their tensors go to CUDA.) Skipped
without CUDA."""
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from ctxfast import reference  # noqa: E402
from test_attention import FLOOR  # noqa: E402
from test_rel_attention import NAMES, _inputs, check  # noqa: E402
from test_rel_attention_decode import bench  # noqa: E402,F401  (fixture)
from utils import rel_err  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("Tq, mem", [(1, 4095), (4, 2047), (16, 3001)])
def test_decoding_against_reference(dtype, Tq, mem):
    from ctxfast.kernels.rel_attention import decode_splits
    B, H, D = 2, 4, 64
    assert decode_splits(B, H, Tq, Tq + mem, D, "cuda") > 1    # the split path is tested
    check(B, H, Tq, Tq + mem, D, dtype=dtype)


def test_decoding_split_equals_unsplit():
    from ctxfast.kernels.rel_attention import rel_attention_forward
    B, H, Tq, Tk, D = 2, 4, 3, 3000, 64
    ts = _inputs(B, H, Tq, Tk, D, Tk)
    kpm = torch.rand(B, Tk, device="cuda") < 0.1
    out1, lse1 = rel_attention_forward(*ts, key_padding_mask=kpm, num_splits=1)
    out, lse = rel_attention_forward(*ts, key_padding_mask=kpm)        # automatic: split
    assert torch.allclose(out, out1, rtol=1e-4, atol=1e-5)
    assert torch.allclose(lse, lse1, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
def test_training_shape(dtype, D):
    """Each tile size's launch rows (64 x 64 at D 64, 32 x 32 at D 128) on a GPU: the H200
    computed a wrong dq at D 64 with the dQ kernel's first launch row (8 warps, 3 stages),
    which the interpreter runs right."""
    check(2, 4, 512, 1536, D, dtype=dtype)


def test_flex_formulation_forward_and_backward(bench):  # noqa: F811
    """The benchmark's ``flex`` backend (compiled FlexAttention, BD gathered in score_mod)
    against the float64 reference, forward and the gradient of every input (BD's through
    the captured buffer), within 2x the eager bf16 error."""
    reason = bench._flex_error()
    if reason is not None:
        pytest.skip(reason)
    B, H, Tq, mem, D = 2, 4, 256, 384, 64
    case = bench.Case((B, H, Tq, mem, D), ("cuda",))
    op = bench._flex_op(case, torch.device("cuda"))
    ts = _inputs(B, H, Tq, Tq + mem, D, Tq + mem, dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) for t in ts]
    same = [t.clone().requires_grad_(True) for t in ts]
    l64 = [t.double().requires_grad_(True) for t in ts]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = op(*leaves)
    out_same, out64 = reference.rel_attention(*same), reference.rel_attention(*l64)
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, leaves, do)
    g_same = torch.autograd.grad(out_same, same, do)
    g64 = torch.autograd.grad(out64, l64, do.double())
    for name, ours, s, ref in [("out", out, out_same, out64)] + list(zip(NAMES, g, g_same, g64)):
        err, err_same = (ours.double() - ref).norm().item(), (s.double() - ref).norm().item()
        bound = 2 * err_same + FLOOR[torch.bfloat16] * max(ref.norm().item(), 1.0)
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e} (relative {rel_err(ours, ref):.2e})"


@pytest.mark.parametrize("mode", ["kernel", "atomic", "bulk", "gemm", "stored"])
def test_training_shape_dr_modes(monkeypatch, mode):
    """rel_attention's dr by the dR kernel, element-wise atomics, TMA bulk reductions
    (sm_90+) or GEMMs over the stored dS (which also form dq's position term; "stored":
    and over the stored P, dK and dV) at a
    training shape (bf16, 64 x 64 tiles: 8 query blocks of 8 sequences add into each
    head's dr, the band's first rows before 0): every gradient within 2x eager against
    float64."""
    import ctxfast.kernels.rel_attention as krel
    if mode == "bulk" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9 or later")
    monkeypatch.setattr(krel, "DR_MODE", mode)
    check(2, 4, 512, 1536, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", ["gemm", "stored"])
def test_stored_dr_modes_at_d128(monkeypatch, mode):
    """The GEMMs over the stored dS (and P) at D 128, 16-bit: there their row tiles are
    taller than the dQ kernel's query blocks, so one tile spans blocks of different key
    ranges (under the interpreter every tile is 16 rows, inside one block: no CPU test
    can see a range taken per tile instead of per row); odd lengths, memory."""
    import ctxfast.kernels.rel_attention as krel
    monkeypatch.setattr(krel, "DR_MODE", mode)
    check(2, 4, 300, 300 + 211, 128, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_row_bias_product_at_a_training_shape(monkeypatch, dtype):
    """The forward's row bias as a product of TMA tiles (RB_MMA, opt-in: 64 x 64, 16-bit,
    sm_90+) against the same forward adding it as a vector: rows of r before 0 and past R
    read through the descriptor (negative coordinates included), every tile of 8 query
    blocks (test_rel_attention_bwd.check_row_bias_product's bound)."""
    import ctxfast.kernels.rel_attention as krel
    from test_rel_attention_bwd import check_row_bias_product
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9 or later")
    seen = []
    real = krel._rb_mma_args
    monkeypatch.setattr(krel, "_rb_mma_args", lambda *a: seen.append(real(*a)) or seen[-1])
    check_row_bias_product(monkeypatch, 2, 4, 512, 1024, 64, dtype)
    assert seen[0].get("RB_MMA") and not seen[1], seen



def test_three_ctas_an_sm_forward_at_a_training_shape(monkeypatch):
    """The tuner's register-capped forward (FWD_MAXNREG_3CTA, two stages: three CTAs an SM,
    spilling by design) against the table row's on the same inputs at a training shape
    (bf16, 64 x 64 TMA tiles): the same softmax statistics and outputs to bf16 rounding (a
    cap changes no arithmetic; a miscompile moves everything), and the module's reference
    check with it in force."""
    import ctxfast.kernels.rel_attention as krel
    from ctxfast.kernels.rel_attention import rel_attention_forward
    ts = _inputs(2, 4, 512, 1536, 64, 1536, dtype=torch.bfloat16)
    out_t, lse_t = rel_attention_forward(*ts)
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "fwd", (4, 2))
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "fwd_maxnreg", krel.FWD_MAXNREG_3CTA)
    out, lse = rel_attention_forward(*ts)
    assert torch.allclose(lse, lse_t, rtol=0, atol=1e-4), (lse - lse_t).abs().max()
    assert torch.allclose(out.float(), out_t.float(), rtol=2e-2, atol=2e-2)
    check(2, 4, 512, 1536, 64, dtype=torch.bfloat16)
    _no_key_rows(64, torch.bfloat16)


@pytest.mark.parametrize("D", [64, 128])
def test_capped_backward_rows_at_a_training_shape(monkeypatch, D):
    """The tuner's register-capped rows at a training shape (bf16), every gradient within 2x
    eager against float64: D 64, dK/dV at three CTAs an SM and the gemm mode's dQ at two
    (spilling by design); D 128, the forward at three and dK/dV at two."""
    import ctxfast.kernels.rel_attention as krel
    if D == 64:
        monkeypatch.setattr(krel, "DR_MODE", "gemm")
        rows = {"dkdv": (4, 1), "dkdv_maxnreg": krel.DKDV_MAXNREG_3CTA, "dq": (8, 1),
                "dq_maxnreg": krel.DQ_MAXNREG_2CTA}
    else:
        rows = {"fwd_maxnreg": krel.FWD_MAXNREG_3CTA,
                "dkdv_maxnreg": krel.DKDV128_MAXNREG_2CTA}
    for key, value in rows.items():
        monkeypatch.setitem(krel.LAUNCH_OVERRIDE, key, value)
    check(2, 4, 512, 1536, D, dtype=torch.bfloat16)
    _no_key_rows(D, torch.bfloat16)


def _no_key_rows(D, dtype):
    """A sequence whose every key is padding, at two query blocks and more: zeros out, zero
    gradients through it, no NaN (test_rel_attention.test_rows_that_see_no_key's, larger)."""
    kpm = torch.zeros(2, 300, dtype=torch.bool, device="cuda")
    kpm[0] = True
    out, grads = check(2, 2, 150, 300, D, dtype=dtype, key_padding_mask=kpm)
    assert (out[0] == 0).all() and (grads[0][0] == 0).all()


def test_capped_float32_forward_at_xl_evaluation(monkeypatch):
    """The tuner's register-capped float32 forward (XL evaluation's: three CTAs an SM,
    FWD_MAXNREG_3CTA), at torch's default precision (tf32x3) and with TF32 allowed: the
    forward and every gradient within 2x eager against float64, and rows that see no key."""
    import ctxfast.kernels.rel_attention as krel
    monkeypatch.setitem(krel.LAUNCH_OVERRIDE, "fwd_maxnreg", krel.FWD_MAXNREG_3CTA)
    for tf32 in (False, True):
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
        check(2, 4, 128, 1024, 64, dtype=torch.float32)
        _no_key_rows(64, torch.float32)
