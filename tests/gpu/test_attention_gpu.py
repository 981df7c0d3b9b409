"""ctxfast.attention on a GPU at sizes the interpreter cannot reach. (tests/test_attention.py
also runs on the GPU when one is present: its tensors go to CUDA.) Skipped without CUDA."""
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import ctxfast  # noqa: E402
from test_attention import check_against_reference  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Tq, Tk, causal", [(1025, 1025, True), (1025, 1025, False),
                                            (512, 1536, True), (1, 4096, True)])
def test_large_against_reference(dtype, D, Tq, Tk, causal):
    q, k, v = (torch.randn(2, 4, T, D, device="cuda", dtype=dtype) for T in (Tq, Tk, Tk))
    check_against_reference(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_matches_sdpa(dtype):
    q, k, v = (torch.randn(2, 8, 777, 64, device="cuda", dtype=dtype) for _ in range(3))
    ours = ctxfast.attention(q, k, v, causal=True, backend="triton")
    ref64 = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    err = (ours.double() - ref64).norm() / ref64.norm()
    err_sdpa = (sdpa.double() - ref64).norm() / ref64.norm()
    assert err <= 2 * err_sdpa + 1e-3, (err.item(), err_sdpa.item())


def test_permutation_and_padding_with_memory_bf16():
    B, H, Tq, mem, D = 2, 4, 300, 200, 64
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
               for T in (Tq, Tq + mem, Tq + mem))
    kpm = torch.rand(B, Tq + mem, device="cuda") < 0.2
    rank = torch.stack([torch.randperm(Tq) for _ in range(B)]).cuda()
    for stream in ("content", "query"):
        check_against_reference(q, k, v, key_padding_mask=kpm, perm_rank=rank, perm_stream=stream)


def test_float64_default_runs_on_eager():
    """The Triton attention kernels do not compile for float64 on a GPU: the default runs
    float64 on the eager reference (equal to it), asking for triton is refused."""
    q, k, v = (torch.randn(2, 2, 33, 16, device="cuda", dtype=torch.float64) for _ in range(3))
    out = ctxfast.attention(q, k, v, causal=True)
    assert torch.equal(out, ctxfast.attention(q, k, v, causal=True, backend="eager"))
    with pytest.raises(ctxfast.BackendUnavailable, match="float64"):
        ctxfast.attention(q, k, v, causal=True, backend="triton")


@pytest.mark.parametrize("dtype, D, Tq, Tk, kind", [
    (torch.bfloat16, 128, 1025, 1025, "causal"), (torch.bfloat16, 64, 512, 1536, "causal-pad"),
    (torch.float16, 128, 777, 777, "none"), (torch.bfloat16, 128, 4, 4096, "causal"),
    (torch.float16, 64, 1025, 1025, "causal-pad")])
def test_tma_tiles_large(monkeypatch, dtype, D, Tq, Tk, kind):
    """TMA_MODE "on" on the GPU (TMA loads on sm_90+) at sizes the interpreter cannot
    reach, with the [B, T, H, D] layout models use: forward and every gradient within 2x
    eager against float64, every launch through the descriptors."""
    import ctxfast.kernels.attention as kattn
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9 or later")
    from test_attention import _masks, spy_tma
    B, H = 2, 4
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=dtype).transpose(1, 2)
               for T in (Tq, Tk, Tk))
    kw = _masks(kind, B, Tq, Tk)
    used = spy_tma(monkeypatch, kattn)
    monkeypatch.setattr(kattn, "TMA_MODE", "on")
    check_against_reference(q, k, v, **kw)
    assert used and all(used), used


@pytest.mark.parametrize("mode", ["atomic", "bulk"])
@pytest.mark.parametrize("dtype, D, Tq, Tk, kind", [
    (torch.bfloat16, 128, 1025, 1025, "causal"), (torch.bfloat16, 64, 512, 1536, "causal-pad"),
    (torch.float16, 64, 1025, 1025, "none")])
def test_dq_by_adds_large(monkeypatch, mode, dtype, D, Tq, Tk, kind):
    """DQ_MODE "atomic" and "bulk" (TMA bulk reductions, sm_90+) at sizes where many key
    blocks add into the same dQ rows at once (17-24 key blocks a sequence, 8 sequences):
    forward and every gradient within 2x eager against float64; bulk's launches took the
    descriptor."""
    import ctxfast.kernels.attention as kattn
    if mode == "bulk" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9 or later")
    from test_attention import _masks
    B, H = 2, 4
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype) for T in (Tq, Tk, Tk))
    bulk = []
    real = kattn._dq_bulk_args
    monkeypatch.setattr(kattn, "_dq_bulk_args", lambda *a: bulk.append(real(*a)) or bulk[-1])
    monkeypatch.setattr(kattn, "DQ_MODE", mode)
    check_against_reference(q, k, v, **_masks(kind, B, Tq, Tk))
    assert (mode == "bulk") == bool(bulk and all(bulk)), bulk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("Tq, Tk", [(1025, 1025), (512, 1536)])
def test_register_capped_backward_large(monkeypatch, dtype, Tq, Tk):
    """The tuner's register-capped dK/dV and dQ rows (D 64, no mask: one more CTA an SM,
    kernels/attention._TUNE_REG_CAPS; dK/dV spills by design) against float64 within 2x
    eager, causal, at sizes with many key and query blocks."""
    import ctxfast.kernels.attention as kattn
    for (kernel, _D), cap in kattn._TUNE_REG_CAPS.items():
        monkeypatch.setitem(kattn.LAUNCH_OVERRIDE, kernel + ":maxnreg", cap)
    q, k, v = (torch.randn(2, 4, T, 64, device="cuda", dtype=dtype) for T in (Tq, Tk, Tk))
    check_against_reference(q, k, v, causal=True)
    # and a sequence whose every key is padding: zeros, zero gradients, no NaN
    kpm = torch.zeros(2, Tk, dtype=torch.bool, device="cuda")
    kpm[0] = True
    out, (dq, dk, dv) = check_against_reference(q, k, v, causal=True, key_padding_mask=kpm)
    assert (out[0] == 0).all() and (dq[0] == 0).all() and (dk[0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Tq, Tk, causal", [(1024, 1024, True), (1025, 1025, True),
                                            (512, 1536, True), (776, 1000, False),
                                            (1, 4096, False)])
def test_warp_specialised_kernels_large(monkeypatch, dtype, D, Tq, Tk, causal):
    """The warp-specialised forward, dK/dV and dQ kernels (the tuner's ``"<kernel>:ws"``
    rows, each of kernels/attention._WS_CANDIDATES: descriptors built on the device, their
    global scratch from kernels._common.descriptor_scratch) against float64 within 2x eager
    at sizes with many blocks (dQ's where Tq is a multiple of 4); the allocator of the
    caller's context is left as it was."""
    import ctxfast.kernels.attention as kattn
    from triton.runtime import _allocation
    before = _allocation._allocator.get()
    seen = []
    for name in ("_launch_forward_ws", "_launch_bwd_ws"):
        launch = getattr(kattn, name)
        monkeypatch.setattr(kattn, name, lambda *a, launch=launch, name=name, **kw:
                            seen.append(name) or launch(*a, **kw))
    q, k, v = (torch.randn(2, 4, T, D, device="cuda", dtype=dtype) for T in (Tq, Tk, Tk))
    rows = [kattn._WS_CANDIDATES[(kernel, D)] for kernel in ("fwd", "dkdv", "dq")]
    for fwd, dkdv, dq in zip(*rows):
        monkeypatch.setattr(kattn, "LAUNCH_OVERRIDE", {
            "fwd:ws": True, "dkdv:ws": True, "dq:ws": True, "fwd": fwd, "dkdv": dkdv, "dq": dq})
        check_against_reference(q, k, v, causal=causal)
    n = len(rows[0])
    assert seen.count("_launch_forward_ws") == n
    assert seen.count("_launch_bwd_ws") == n * (2 if Tq % 4 == 0 else 1)
    assert _allocation._allocator.get() is before
