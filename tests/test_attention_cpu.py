"""The ``cpu`` backend of ctxfast.attention and ctxfast.attention_varlen (csrc/cpu/attention.cpp)
against ctxfast.reference, with test_attention.py's rule: the kernel's error against the
float64 reference is at most twice the eager reference's error in the same dtype (plus a
small floor), forward and every gradient. The kernel's tiles are 64 queries x 128 keys, so
T = 70, 137 and 200 cross tile edges in both directions.
"""
import os
import subprocess
import sys

import pytest
import torch

import ctxfast
from ctxfast import reference
from ctxfast.ops.attention import draw_seed, dropout_keep_mask
from utils import CPU_BACKENDS, DEVICE, TRITON_ON_CPU, philox4x32_10, rel_err, softmax_grad_terms

pytestmark = pytest.mark.skipif("cpu" not in CPU_BACKENDS or not hasattr(
    torch.ops.ctxfast, "attention_fwd_cpu"), reason="ctxfast._C was built without attention")

FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _inputs(B, H, Tq, Tk, D, dtype=torch.float32, layout="bhtd"):
    def make(T):
        if layout == "bthd":   # [B, T, H, D] storage viewed as [B, H, T, D]
            return torch.randn(B, T, H, D, dtype=dtype).transpose(1, 2)
        return torch.randn(B, H, T, D, dtype=dtype)
    return make(Tq), make(Tk), make(Tk)


def _masks(kind, B, Tq, Tk):
    kw = {}
    if "causal" in kind:
        kw["causal"] = True
    if "pad" in kind:
        kpm = torch.rand(B, Tk) < 0.3
        kpm[:, 0] = False
        if B > 1:
            kpm[-1, Tk // 2:] = True
        kw["key_padding_mask"] = kpm
    if "perm" in kind:
        kw["perm_rank"] = torch.stack([torch.randperm(Tq) for _ in range(B)])
        kw["perm_stream"] = "query" if "query" in kind else "content"
    if "ties" in kind:
        kw["perm_rank"] = torch.randint(0, 3, (B, Tq))
        kw["perm_stream"] = "query" if "query" in kind else "content"
    if "sorted" in kind:     # ranks already in order, ties and gaps: the kernels' staircase
        kw["perm_rank"] = torch.randint(-3, max(Tq // 4, 2), (B, Tq)).sort(dim=1).values
        kw["perm_stream"] = "query" if "query" in kind else "content"
    return kw


def check_cpu(q, k, v, grad_layout=None, ours_kw=None, ref_kw=None, **kw):
    """cpu backend vs eager in q's dtype vs float64 reference: forward and dq, dk, dv.
    ours_kw / ref_kw: extra arguments of ctxfast.attention / of the references (dropout)."""
    dtype = q.dtype
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    same = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    l64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out = ctxfast.attention(*leaves, backend="cpu", **kw, **(ours_kw or {}))
    out_same = reference.attention(*same, **kw, **(ref_kw or {}))
    out64 = reference.attention(*l64, **kw, **(ref_kw or {}))
    do = torch.randn_like(out)
    if grad_layout == "transposed":    # a non-contiguous grad_out
        do = torch.randn(out.shape[:2] + out.shape[2:][::-1], dtype=dtype).transpose(-1, -2)
    grads = torch.autograd.grad(out, leaves, do)
    grads_same = torch.autograd.grad(out_same, same, do)
    grads64 = torch.autograd.grad(out64, l64, do.double())
    # dq and dk: the floor scales with the terms the softmax cancels (utils.softmax_grad_terms)
    B, _, Tq, D = q.shape
    visible = reference.attention_mask(
        B, Tq, k.shape[2], causal=kw.get("causal", False),
        key_padding_mask=kw.get("key_padding_mask"), perm_rank=kw.get("perm_rank"),
        perm_stream=kw.get("perm_stream", "content"))
    terms = dict(zip(("dq", "dk"), softmax_grad_terms(
        q, k, v, do, visible, D ** -0.5 if kw.get("scale") is None else kw["scale"])))
    for name, ours, ref_same, ref in [("out", out, out_same, out64)] + list(
            zip(("dq", "dk", "dv"), grads, grads_same, grads64)):
        assert ours.dtype == dtype, (name, ours.dtype)
        assert not torch.isnan(ours).any(), f"{name}: NaN"
        err = (ours.double() - ref).norm().item()
        err_same = (ref_same.double() - ref).norm().item()
        bound = 2 * err_same + FLOOR[dtype] * max(ref.norm().item(), terms.get(name, 0.0), 1.0)
        assert err <= bound, (f"{name}: ‖cpu − ref64‖ = {err:.3e} > {bound:.3e} (eager "
                              f"{err_same:.3e}, relative {rel_err(ours, ref):.3e})")
    return out, grads


MASK_KINDS = ["none", "causal", "pad", "causal-pad", "perm", "perm-query", "ties",
              "ties-query", "perm-pad", "causal-perm"]


@pytest.mark.parametrize("mem", [0, 67])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masks_with_memory(kind, mem):
    B, H, Tq, D = 2, 2, 70, 32
    q, k, v = _inputs(B, H, Tq, Tq + mem, D)
    check_cpu(q, k, v, **_masks(kind, B, Tq, Tq + mem))


# 8, 40: head dims that end in a partial panel of 16 columns (the tile kernels' masked
# lanes); 56: a 32-column panel of the AVX-512 kernel whose second register is partial
@pytest.mark.parametrize("D", [8, 16, 40, 56, 64, 96])
def test_head_dims(D):
    q, k, v = _inputs(1, 2, 19, 140, D)
    check_cpu(q, k, v, causal=True)


# every height of a block of rows in the tile kernels (up to 12 rows on the AVX-512 one, 6
# on the AVX2 one), in the forward's products (queries) and the backward's (keys), with a
# head dim that ends in a partial register
@pytest.mark.parametrize("T", list(range(2, 14)))
def test_tile_row_blocks(T):
    q, k, v = _inputs(1, 2, T, T, 56)
    check_cpu(q, k, v)


def _tests_pass_in_fresh_process(tests, **env):
    """Runs `tests` (``file::test`` names in this folder) with pytest in a fresh process
    with `env` added (settings read once per process); every one must pass, none skip."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"] + [
        os.path.join(here, t) for t in tests]
    run = subprocess.run(cmd, env=dict(os.environ, **env), capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, f"{env}:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert "passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def _setting_refused_in_fresh_process(var, value):
    """In a fresh process with ``var=value``, the cpu backends of attention and
    rel_attention raise a ValueError naming the variable and the value, before any
    kernel runs."""
    code = ("import torch, ctxfast\n"
            "q = torch.randn(1, 2, 5, 8)\n"
            "for call in (lambda: ctxfast.attention(q, q, q, backend='cpu'),\n"
            "             lambda: ctxfast.rel_attention(q, q, q, torch.randn(2, 5, 8),\n"
            "                 torch.randn(2, 8), torch.randn(2, 8), backend='cpu')):\n"
            "    try:\n"
            "        call()\n"
            f"    except ValueError as e:\n"
            f"        assert {var!r} in str(e) and {value!r} in str(e), str(e)\n"
            "    else:\n"
            f"        raise SystemExit('no error for {var}={value}')\n"
            "print('refused')\n")
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **{var: value}),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "refused" in run.stdout, run.stdout + run.stderr[-3000:]


@pytest.mark.parametrize("gemm, simd", [("blas", None), ("own", None), ("own", "avx2")])
def test_tile_products_on_either_gemm(gemm, simd):
    """The tile products run on the BLAS or on the project's own kernel (AVX-512 where the
    CPU has it, else AVX2), chosen once per process from the CPU (the BLAS on an Intel CPU
    with AVX-512), so one machine runs only one of them in the rest of the suite.
    CTXFAST_ATTN_CPU_GEMM forces either, and CTXFAST_ATTN_CPU_SIMD=avx2 the AVX2 kernel
    on an AVX-512 CPU: each runs here in a fresh process over the head dims (partial
    panels), every height of a block of rows, odd lengths, rows that see no key, every mask
    with memory (the rank order, the staircase tiles) and rel_attention's band (long rows
    of r, odd D, the sliding window)."""
    env = {"CTXFAST_ATTN_CPU_GEMM": gemm}
    if simd is not None:
        env["CTXFAST_ATTN_CPU_SIMD"] = simd
    _tests_pass_in_fresh_process(
        ["test_attention_cpu.py::test_head_dims",
         "test_attention_cpu.py::test_tile_row_blocks",
         "test_attention_cpu.py::test_odd_lengths",
         "test_attention_cpu.py::test_rows_that_see_no_key",
         "test_attention_cpu.py::test_masks_with_memory",
         "test_rel_attention_cpu.py::test_transformer_xl_memory",
         "test_rel_attention_cpu.py::test_head_dims",
         "test_rel_attention_cpu.py::test_long_band_window_slides"],
        **env)


def test_cpu_without_avx2():
    """CTXFAST_ATTN_CPU_SIMD=off: the row kernels (softmax, exponentials, P and dS, the
    biased rows) take their portable loops and the products the BLAS, as on a CPU without
    AVX2; the kernel tests over odd sizes, rows that see no key and the masks pass there
    too, in a fresh process (the setting is read once)."""
    _tests_pass_in_fresh_process(
        ["test_attention_cpu.py::test_head_dims",
         "test_attention_cpu.py::test_odd_lengths",
         "test_attention_cpu.py::test_rows_that_see_no_key",
         "test_attention_cpu.py::test_masks_with_memory",
         "test_rel_attention_cpu.py::test_transformer_xl_memory",
         "test_rel_attention_cpu.py::test_rows_that_see_no_key"],
        CTXFAST_ATTN_CPU_SIMD="off")


def test_gemm_setting_is_checked_before_any_kernel():
    """A value of CTXFAST_ATTN_CPU_GEMM other than blas / own is refused with a ValueError
    naming the variable (not silently replaced by the CPU's default), in a fresh process:
    the setting is read once per process."""
    _setting_refused_in_fresh_process("CTXFAST_ATTN_CPU_GEMM", "mkl")


def test_simd_setting_is_checked_before_any_kernel():
    """CTXFAST_ATTN_CPU_SIMD takes avx2 / off only: another value is a ValueError naming it
    (not silently the CPU's choice), in a fresh process."""
    _setting_refused_in_fresh_process("CTXFAST_ATTN_CPU_SIMD", "avx3")


def test_no_task_writes_past_its_rows():
    """Outputs come from a cache of used blocks, and the rank order's tasks each scatter
    their rows back from a thread's copy: an element no task writes would keep a previous
    call's (likely right) value, and a task that wrote one row past its own end would be
    overwritten by the next task, in order. CTXFAST_ATTN_CPU_DEBUG=poison,reverse fills
    every output and copy with NaN first and hands the tasks out last first; in a fresh
    process on one thread (the order is then exact) the kernel tests that split heads over
    tasks, or rows over tiles, must pass as they are. (Checked: scatter_rows taking
    p <= hi passes the plain suite and fails here.)"""
    _tests_pass_in_fresh_process(
        ["test_attention_cpu.py::test_permutation_one_head_split_over_tasks",
         "test_attention_cpu.py::test_odd_lengths",
         "test_attention_cpu.py::test_rows_that_see_no_key",
         "test_attention_cpu.py::test_masks_with_memory",
         "test_attention_cpu.py::test_decoding_one_query",
         "test_rel_attention_cpu.py::test_transformer_xl_memory",
         "test_rel_attention_cpu.py::test_xlnet_segments_perm_padding_memory",
         "test_rel_attention_cpu.py::test_long_band_window_slides",
         "test_rel_attention_cpu.py::test_dr_summed_over_the_batch",
         "test_rel_attention_cpu.py::test_xlnet_sorted_ranks_after_another_call"],
        CTXFAST_ATTN_CPU_DEBUG="poison,reverse", OMP_NUM_THREADS="1")


def test_debug_setting_is_checked_before_any_kernel():
    """An unknown entry in CTXFAST_ATTN_CPU_DEBUG is refused with a ValueError naming the
    variable, in a fresh process (the setting is read once per process)."""
    _setting_refused_in_fresh_process("CTXFAST_ATTN_CPU_DEBUG", "posion")


@pytest.mark.parametrize("value", ["bogus", "0,0", "64", "16,16x"])
def test_tile_setting_is_checked_before_any_kernel(value):
    """CTXFAST_ATTN_CPU_TILE takes two positive integers "BQ,BK": another value is a
    ValueError naming it, in a fresh process (the C++ parser ignored it: the default tiles
    ran as if it were unset)."""
    _setting_refused_in_fresh_process("CTXFAST_ATTN_CPU_TILE", value)


@pytest.mark.parametrize("Tq, Tk, kind", [(1, 1, "none"), (1, 1, "causal"), (1, 40, "causal"),
                                          (17, 17, "causal"), (17, 5, "none"),
                                          (200, 200, "causal-pad"), (3, 50, "perm-query"),
                                          (129, 300, "causal")])
def test_odd_lengths(Tq, Tk, kind):
    q, k, v = _inputs(1, 2, Tq, Tk, 32)
    check_cpu(q, k, v, **_masks(kind, 1, Tq, Tk))


@pytest.mark.parametrize("Tk, D, kind", [(1, 75, "causal"), (37, 75, "causal"),
                                         (203, 13, "none"), (150, 41, "pad"),
                                         (300, 64, "causal")])
def test_decoding_one_query(Tk, D, kind):
    # one query (decoding): its products run as matrix-vector loops, not the BLAS (gemv_rm):
    # keys in groups of 4 and a remainder, head dims in vectors of 64 and 8 and a scalar tail
    q, k, v = _inputs(2, 3, 1, Tk, D)
    check_cpu(q, k, v, **_masks(kind, 2, 1, Tk))


def test_decoding_query_that_sees_no_key():
    # one query of the query stream without memory sees no key: zeros out, zero dq, dk, dv,
    # no NaN; with 40 memory keys the same query sees those (the one-row loops again)
    for mem in (0, 40):
        q, k, v = _inputs(2, 3, 1, 1 + mem, 75)
        out, grads = check_cpu(q, k, v, **_masks("perm-query", 2, 1, 1 + mem))
        if mem == 0:
            assert (out == 0).all() and all((g == 0).all() for g in grads)
        else:
            assert out.abs().sum() > 0 and grads[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64],
                         ids=str)
def test_dtypes(dtype):
    q, k, v = _inputs(2, 2, 21, 150, 64, dtype=dtype)
    check_cpu(q, k, v, **_masks("causal-pad", 2, 21, 150))


def test_non_contiguous_inputs_and_grad():
    q, k, v = _inputs(2, 3, 70, 90, 32, layout="bthd")
    assert not q.is_contiguous()
    check_cpu(q, k, v, grad_layout="transposed", causal=True, scale=0.3)


def test_expanded_grad_out():
    """out.sum() hands the backward a stride-0 gradient."""
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 9, 9, 16))
    ctxfast.attention(q, k, v, causal=True, backend="cpu").sum().backward()
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference.attention(q2, k2, v2, causal=True).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert rel_err(a.grad, b.grad) < 1e-5


@pytest.mark.parametrize("how", ["all-padding", "query-stream-lowest-rank"])
def test_rows_that_see_no_key(how):
    B, H, T, D = 2, 2, 20, 16
    q, k, v = _inputs(B, H, T, T, D)
    if how == "all-padding":
        kpm = torch.zeros(B, T, dtype=torch.bool)
        kpm[0] = True
        kw, empty = {"key_padding_mask": kpm}, (0, slice(None), slice(None))
    else:
        rank = torch.stack([torch.randperm(T) for _ in range(B)])
        kw = {"perm_rank": rank, "perm_stream": "query"}
        first = (rank == 0).nonzero()
        empty = (first[0, 0].item(), slice(None), first[0, 1].item())
    out, (dq, dk, dv) = check_cpu(q, k, v, **kw)
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()
    if how == "all-padding":
        assert (dk[0] == 0).all() and (dv[0] == 0).all()


def test_gradcheck_float64():
    q, k, v = (torch.randn(1, 2, 7, 8, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    kpm = torch.tensor([[False, True, False, False, False, True, False]])
    f = lambda a, b, c: ctxfast.attention(a, b, c, causal=True,  # noqa: E731
                                          key_padding_mask=kpm, backend="cpu")
    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_opcheck(dtype):
    # float64 too (its lse is float64: a fake function saying float32 passed at float32),
    # and varlen with other lengths for the keys than the queries (a backward fake giving
    # dk, dv q's shape passed where they were equal)
    q, k, v = (t.to(dtype).requires_grad_() for t in _inputs(1, 2, 9, 12, 16))
    seed = torch.tensor([1234], dtype=torch.int64)
    kpm = torch.zeros(1, 12, dtype=torch.bool)
    kpm[0, -3:] = True
    rank = torch.randperm(9).view(1, 9)
    for causal, drop in ((True, (0.0, None)), (False, (0.3, seed))):
        args = (q, k, v, kpm, rank, causal, False, 0.25) + drop
        torch.library.opcheck(torch.ops.ctxfast.attention_fwd_cpu.default, args)
        out, lse = torch.ops.ctxfast.attention_fwd_cpu(*args)
        torch.library.opcheck(torch.ops.ctxfast.attention_bwd_cpu.default,
                              (torch.randn_like(out), q.detach(), k.detach(), v.detach(),
                               out.detach(), lse, kpm, rank, causal, False, 0.25) + drop)
    qv = torch.randn(11, 2, 16, dtype=dtype, requires_grad=True)
    kv, vv = (torch.randn(16, 2, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    cu, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 4, 11], [0, 7, 16]))
    for causal, sizes, drop in ((True, (7, 9), (0.0, None)), (False, (9, 10), (0.2, seed))):
        args = (qv, kv, vv, cu, cu_k, causal, 0.25, *sizes, *drop)
        torch.library.opcheck(torch.ops.ctxfast.attention_varlen_fwd_cpu.default, args)
        out, lse = torch.ops.ctxfast.attention_varlen_fwd_cpu(*args)
        torch.library.opcheck(torch.ops.ctxfast.attention_varlen_bwd_cpu.default,
                              (torch.randn_like(out), qv.detach(), kv.detach(), vv.detach(),
                               out.detach(), lse, cu, cu_k, causal, 0.25, *sizes, *drop))


def test_torch_compile_fullgraph_default_backend():
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 17, 20, 16))

    def f(q, k, v):   # no backend=: the CPU default, which is the cpu kernel
        return ctxfast.attention(q * 1.5, k, v, causal=True).sum()

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    out.backward()
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q2 * 1.5, k2, v2, causal=True).sum()
    ref.backward()
    assert abs(out.item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item()))
    assert rel_err(q.grad, q2.grad) < 1e-5


def test_default_is_cpu_with_and_without_dropout():
    assert ctxfast._dispatch.resolve("attention", torch.device("cpu")) == "cpu"
    assert ctxfast._dispatch.resolve("attention_varlen", torch.device("cpu")) == "cpu"
    q, k, v = _inputs(1, 2, 6, 6, 8)
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a = ctxfast.attention(q, k, v, dropout_p=0.5, generator=gen())
    b = ctxfast.attention(q, k, v, dropout_p=0.5, generator=gen(), backend="cpu")
    assert torch.equal(a, b)
    qv, kv, vv = (t[0].transpose(0, 1) for t in (q, k, v))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    a = ctxfast.attention_varlen(qv, kv, vv, cu, cu, 6, 6, dropout_p=0.5, generator=gen())
    b = ctxfast.attention_varlen(qv, kv, vv, cu, cu, 6, 6, dropout_p=0.5, generator=gen(),
                                 backend="cpu")
    assert torch.equal(a, b)


def _triton_keep_mask(seed, B, H, Tq, Tk, p):
    """The Triton kernels' keep mask for `seed` (on CUDA where there is one, else the kernel in
    the interpreter), as a CPU bool tensor."""
    return dropout_keep_mask(seed.to(DEVICE), B, H, Tq, Tk, p).cpu()


@pytest.mark.parametrize("kind, Tq, mem", [("none", 70, 0), ("causal", 70, 67), ("pad", 33, 9),
                                           ("perm", 140, 20), ("causal", 1, 5),
                                           ("sorted-query", 140, 20)])
def test_dropout_is_the_triton_mask(kind, Tq, mem):
    """Dropout on the cpu backend draws the Triton kernels' Philox numbers for the same seed:
    forward and every gradient match the float64 reference given that mask."""
    if DEVICE == "cpu" and not TRITON_ON_CPU:
        pytest.skip("the Triton keep mask needs a GPU or TRITON_INTERPRET=1")
    B, H, D, p = 2, 3, 16, 0.3
    q, k, v = _inputs(B, H, Tq, Tq + mem, D)
    seed = draw_seed("cpu", torch.Generator().manual_seed(11))
    keep = _triton_keep_mask(seed, B, H, Tq, Tq + mem, p)
    masks = _masks(kind, B, Tq, Tq + mem)
    out, _ = check_cpu(q, k, v, ours_kw=dict(dropout_p=p,
                                             generator=torch.Generator().manual_seed(11)),
                       ref_kw=dict(dropout_p=p, dropout_mask=keep), **masks)
    plain = ctxfast.attention(q, k, v, backend="cpu", **masks)
    assert not torch.allclose(out, plain), "dropout changed nothing"


def test_bad_input_to_the_op_itself():
    """The C++ entry points check their own inputs (the Python layer checks first)."""
    q, k, v = _inputs(1, 2, 5, 5, 8)
    with pytest.raises(ValueError, match="rank 4"):
        torch.ops.ctxfast.attention_fwd_cpu(q[0], k, v, None, None, False, False, 1.0, 0.0, None)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        torch.ops.ctxfast.attention_fwd_cpu(q, k, v, torch.zeros(1, 4, dtype=torch.bool),
                                            None, False, False, 1.0, 0.0, None)
    with pytest.raises(ValueError, match="Tk >= Tq"):
        torch.ops.ctxfast.attention_fwd_cpu(q, k[:, :, :3], v[:, :, :3], None, None, True,
                                            False, 1.0, 0.0, None)
    with pytest.raises(ValueError, match="dropout needs seed"):
        torch.ops.ctxfast.attention_fwd_cpu(q, k, v, None, None, False, False, 1.0, 0.2, None)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        torch.ops.ctxfast.attention_fwd_cpu(q, k, v, None, None, False, False, 1.0, 1.0,
                                            torch.tensor([1]))
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        torch.ops.ctxfast.attention_varlen_fwd_cpu(
            q[0], k[0], v[0], torch.tensor([1, 2]), torch.tensor([0, 2]), False, 1.0, 2, 2,
            0.0, None)
    with pytest.raises(ValueError, match="must bound every sequence"):
        torch.ops.ctxfast.attention_varlen_fwd_cpu(
            q[0], k[0], v[0], torch.tensor([0, 2]), torch.tensor([0, 2]), False, 1.0, 1, 2,
            0.5, torch.tensor([3]))


def test_masks_and_lse_checked_by_the_op_itself():
    """perm_rank of another length than the queries, and the backward's lse of another shape,
    are refused by the C++ entry points before the kernels index them (forward and
    backward)."""
    q, k, v = _inputs(2, 2, 5, 5, 8)
    out, lse = torch.ops.ctxfast.attention_fwd_cpu(q, k, v, None, None, False, False, 1.0,
                                                   0.0, None)
    for rank in (torch.zeros(2, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)):
        with pytest.raises(ValueError, match="perm_rank must have shape"):
            torch.ops.ctxfast.attention_fwd_cpu(q, k, v, None, rank, False, False, 1.0, 0.0,
                                                None)
        with pytest.raises(ValueError, match="perm_rank must have shape"):
            torch.ops.ctxfast.attention_bwd_cpu(out, q, k, v, out, lse, None, rank, False, False,
                                                1.0, 0.0, None)
    for bad in (lse[:, :, :4], lse[:1], lse[0]):
        with pytest.raises(ValueError, match="lse must have shape"):
            torch.ops.ctxfast.attention_bwd_cpu(out, q, k, v, out, bad, None, None, False, False,
                                                1.0, 0.0, None)
    with pytest.raises(ValueError, match="grad_out and out must have q's shape"):
        torch.ops.ctxfast.attention_bwd_cpu(out[:, :, :4], q, k, v, out, lse, None, None, False,
                                            False, 1.0, 0.0, None)


def _philox_uniform(seed: int, counter: int) -> float:
    """The Triton kernels' tl.rand for `counter` under `seed`: word 0 of Philox-4x32-10 of
    counter (lo, hi, 0, 0), key (seed_lo, seed_hi), as a float32 in [0, 1)."""
    c = philox4x32_10(seed, counter)
    x = c[0] - (1 << 32) if c[0] >= 1 << 31 else c[0]      # as int32
    x = ~x if x < 0 else x
    return (torch.tensor(float(x)) * torch.tensor(4.6566127342e-10)).item()


def test_varlen_dropout_counters_past_32_bits():
    """The dropout counter (b H + h) max_seqlen_q + i) max_seqlen_k + j is 64 bits wide: a
    large max_seqlen_k (any bound is allowed) puts query row 1's counters across 2^32, inside
    one group of 8 that the vectorised draw forms at once (its low word wraps there and the
    high word must carry). The mask must still be Philox of the full counter."""
    seed, p, Tk, D = (0x0BAD_F00D << 32) | 0x1234_5678, 0.5, 16, 8
    max_k = (1 << 32) - 4                   # row 1: counters 2^32 - 4 .. 2^32 + 11
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 1, D, generator=g) for n in (2, Tk, Tk))
    cu_q, cu_k = torch.tensor([0, 2]), torch.tensor([0, Tk])
    out, _ = torch.ops.ctxfast.attention_varlen_fwd_cpu(q, k, v, cu_q, cu_k, False, D ** -0.5,
                                                        2, max_k, p, torch.tensor([seed]))
    keep = torch.tensor([[_philox_uniform(seed, i * max_k + j) >= p for j in range(Tk)]
                         for i in range(2)])
    q64, k64, v64 = (t[:, 0].double() for t in (q, k, v))
    P = torch.softmax(q64 @ k64.T * D ** -0.5, dim=-1)
    ref = (P * keep / (1 - p)) @ v64
    assert keep[1, :8].any() and not keep[1, :8].all(), "a draw that tells the counters apart"
    assert rel_err(out[:, 0], ref) < 1e-5, (
        f"dropout mask of counters past 2^32 differs: rel err {rel_err(out[:, 0], ref):.3e}")


def test_varlen_offsets_checked_by_the_op_itself():
    """The varlen ops read the packed rows where cu_seqlens_q / _k point: offsets past the
    packed length, or decreasing, are refused before any kernel reads memory (forward and
    backward), and with dropout max_seqlen_k must bound every key sequence as well."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in _inputs(1, 2, 6, 6, 8))  # [6, 2, 8]
    ok, past, down = torch.tensor([0, 2, 6]), torch.tensor([0, 2, 7]), torch.tensor([0, 4, 3])
    out, lse = torch.ops.ctxfast.attention_varlen_fwd_cpu(q, k, v, ok, ok, False, 1.0, 4, 4,
                                                          0.0, None)
    for name, cu_q, cu_k, words in [("q past", past, ok, "cu_seqlens_q must start at 0"),
                                    ("k past", ok, past, "cu_seqlens_k must start at 0"),
                                    ("q down", down, ok, "cu_seqlens_q must not decrease"),
                                    ("k down", ok, down, "cu_seqlens_k must not decrease")]:
        with pytest.raises(ValueError, match=words):
            torch.ops.ctxfast.attention_varlen_fwd_cpu(q, k, v, cu_q, cu_k, False, 1.0, 6, 6,
                                                       0.0, None)
        with pytest.raises(ValueError, match=words):
            torch.ops.ctxfast.attention_varlen_bwd_cpu(out, q, k, v, out, lse, cu_q, cu_k,
                                                       False, 1.0, 6, 6, 0.0, None)
    for op_args in [(q, k, v), (out, q, k, v, out, lse)]:
        op = (torch.ops.ctxfast.attention_varlen_fwd_cpu if len(op_args) == 3
              else torch.ops.ctxfast.attention_varlen_bwd_cpu)
        with pytest.raises(ValueError, match="must bound every sequence"):  # keys of 4 > 3
            op(*op_args, ok, ok, False, 1.0, 4, 3, 0.5, torch.tensor([3]))


# --------------------------------------------------------------------------- varlen

def _varlen_ref(q, k, v, cu_q, cu_k, causal):
    outs = []
    for b in range(len(cu_q) - 1):
        sq, eq, sk, ek = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q[sq:eq], k[sk:ek], v[sk:ek]))
        outs.append(reference.attention(qb, kb, vb, causal=causal).squeeze(0).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens_q, lens_k", [([5, 70, 1, 33], [5, 70, 1, 33]),
                                            ([3, 20], [9, 150]),
                                            ([7, 0, 12], [7, 4, 12]),
                                            ([9, 5], [4, 5]),
                                            ([100, 70], [60, 70])])
def test_varlen_matches_per_sequence_reference(causal, lens_q, lens_k):
    H, D = 2, 32
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), H, D)
    k, v = torch.randn(int(cu_k[-1]), H, D), torch.randn(int(cu_k[-1]), H, D)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ctxfast.attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                   backend="cpu")
    l64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = _varlen_ref(*l64, cu_q, cu_k, causal)
    assert rel_err(out, ref) < 1e-5
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, do)
    ref_grads = torch.autograd.grad(ref, l64, do.double(), allow_unused=True)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        r = torch.zeros_like(g, dtype=torch.float64) if r is None else r
        assert not torch.isnan(g).any()
        assert rel_err(g, r) < 1e-5, (name, rel_err(g, r))
    if causal and lens_q[0] > lens_k[0]:  # the first lens_q - lens_k queries see no key
        n = lens_q[0] - lens_k[0]            # (100 vs 60: across the diagonal's key tiles)
        assert (out[:n] == 0).all() and (grads[0][:n] == 0).all()


@pytest.mark.parametrize("kind", ["perm", "perm-query", "ties", "ties-query", "perm-pad"])
def test_permutation_over_many_tiles(kind):
    """The permutation path sorts queries and current keys by rank and skips the key tiles
    above the diagonal: several query blocks and key tiles, memory in front, ranks with
    ties (randint) as well as permutations."""
    B, H, Tq, mem, D = 2, 2, 300, 45, 32
    q, k, v = _inputs(B, H, Tq, Tq + mem, D, layout="bthd")
    kw = _masks(kind, B, Tq, Tq + mem)
    if "ties" in kind:
        kw["perm_rank"] = torch.randint(-5, 40, (B, Tq))   # ties and gaps
    check_cpu(q, k, v, **kw)


@pytest.mark.parametrize("kind", ["sorted", "sorted-query", "causal-sorted",
                                  "causal-sorted-query", "sorted-pad"])
def test_sorted_ranks_staircase(kind):
    """Ranks given in order (ties and gaps), so that no sorting happens (with causal: the
    plain path) and the key tiles follow the ranks' staircase: full tiles up to the keys
    that a block's first row sees, then diagonal tiles each from the first row that sees
    its first key (several query blocks, memory in front)."""
    B, H, Tq, mem, D = 2, 2, 203, 37, 32
    q, k, v = _inputs(B, H, Tq, Tq + mem, D)
    check_cpu(q, k, v, **_masks(kind, B, Tq, Tq + mem))


@pytest.mark.parametrize("mem", [0, 20])
@pytest.mark.parametrize("kind", ["perm", "perm-query", "perm-pad"])
def test_permutation_one_head_split_over_tasks(kind, mem):
    """One sequence and one head: the forward splits the head's query blocks over several
    tasks, each copying only the keys its queries may see (and the backward's task the
    whole head), in rank order, with the rows written back in the original order. Without
    memory the query stream's first-ranked query sees nothing (zeros, zero gradient)."""
    B, H, Tq, D = 1, 1, 333, 16
    q, k, v = _inputs(B, H, Tq, Tq + mem, D, layout="bthd")
    check_cpu(q, k, v, **_masks(kind, B, Tq, Tq + mem))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_dropout_is_the_triton_mask(causal, backend):
    """Packed sequences with dropout: sequence b, head h draws the counters
    ((b H + h) max_seqlen_q + i) max_seqlen_k + j of the Triton varlen kernels (here
    max_seqlen larger than the longest sequence, as a user may pass it). The Triton
    backend too, whose backward no other test held to the mask (its dQ kernel drawing
    with the sequence's own lengths passed the rest of the suite)."""
    if DEVICE == "cpu" and not TRITON_ON_CPU:
        pytest.skip("the Triton keep mask needs a GPU or TRITON_INTERPRET=1")
    H, D, p, lens_q, lens_k = 2, 16, 0.3, [5, 70, 33], [9, 70, 40]
    max_q, max_k = 75, 80
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), H, D, requires_grad=True)
    k, v = (torch.randn(int(cu_k[-1]), H, D, requires_grad=True) for _ in range(2))
    out = ctxfast.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                   dropout_p=p, generator=torch.Generator().manual_seed(4),
                                   backend=backend)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    seed = draw_seed("cpu", torch.Generator().manual_seed(4))
    keep = dropout_keep_mask(seed.to(DEVICE), len(lens_q), H, max_q, max_k, p).cpu()
    for b in range(len(lens_q)):
        sq, eq, sk, ek = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        t64 = [t.detach()[s:e].double().transpose(0, 1).unsqueeze(0).requires_grad_()
               for t, s, e in ((q, sq, eq), (k, sk, ek), (v, sk, ek))]
        o64 = reference.attention(*t64, causal=causal, dropout_p=p,
                                  dropout_mask=keep[b:b + 1, :, :eq - sq, :ek - sk])
        g64 = torch.autograd.grad(o64, t64, do[sq:eq].double().transpose(0, 1).unsqueeze(0))
        pairs = [("out", out[sq:eq], o64)] + [
            (n, g[s:e], r) for n, g, r, (s, e) in
            zip(("dq", "dk", "dv"), grads, g64, ((sq, eq), (sk, ek), (sk, ek)))]
        for name, ours, ref in pairs:
            ref = ref.squeeze(0).transpose(0, 1)
            assert rel_err(ours, ref) < 1e-5, (b, name, rel_err(ours, ref))


@pytest.mark.parametrize("op", ["attention", "attention-perm", "rel_attention"])
def test_gradients_are_bitwise_reproducible(op):
    """Tasks go to whichever thread is free (the kernels' shared counter), but each task's
    arithmetic is fixed and nothing accumulates across tasks: two runs give bitwise-equal
    outputs and gradients. Uneven padding over the batch, so that the threads take
    different tasks from run to run."""
    B, H, T, mem, D = 3, 3, 150, 40, 16
    q, k, v = (t.requires_grad_() for t in _inputs(B, H, T, T + mem, D))
    kpm = torch.zeros(B, T + mem, dtype=torch.bool)
    kpm[1, 60:] = True
    kpm[2, 100:] = True
    extra = []
    if op == "rel_attention":
        r = torch.randn(H, T + mem, D, requires_grad=True)
        u, w = (torch.randn(H, D, requires_grad=True) for _ in range(2))
        extra = [r, u, w]
        call = lambda: ctxfast.rel_attention(q, k, v, r, u, w, key_padding_mask=kpm,  # noqa
                                             backend="cpu")
    elif op == "attention-perm":
        rank = torch.stack([torch.randperm(T) for _ in range(B)])
        call = lambda: ctxfast.attention(q, k, v, perm_rank=rank, key_padding_mask=kpm,  # noqa
                                         backend="cpu")
    else:
        call = lambda: ctxfast.attention(q, k, v, causal=True, key_padding_mask=kpm,  # noqa
                                         backend="cpu")
    do = torch.randn(B, H, T, D)
    runs = []
    for _ in range(3):
        out = call()
        runs.append([out.detach()] + list(torch.autograd.grad(out, [q, k, v, *extra], do)))
    for later in runs[1:]:
        for i, (a, b) in enumerate(zip(runs[0], later)):
            assert torch.equal(a, b), f"run differs in tensor {i}"
