"""The fast launch path (``kernels/_launch.py``) on a GPU: the compiled kernels it reuses
get the arguments Triton's own launch gives them. Each op runs twice per launch mode, the
second time through the remembered kernels, and every output must equal, bit for bit, the
same call launched by Triton's JIT (``LAUNCH = "jit"``). A call with an input moved off
its 16-byte alignment, after an aligned one, must go through Triton again (a new key) and
still match. Skipped without CUDA. (The key rules themselves: tests/test_launch.py.)"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import ctxfast  # noqa: E402
from ctxfast.kernels import _launch  # noqa: E402


def _attention(q, k, v):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ctxfast.attention(q, k, v, causal=True, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return (out, *grads)


def _rel_attention(q, k, v):
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    g = torch.Generator(device="cpu").manual_seed(1)
    r = torch.randn(H, Tk, D, generator=g).to(q)
    wb, rb = (torch.randn(H, D, generator=g).to(q) for _ in range(2))
    ins = [t.detach().requires_grad_() for t in (q, k, v, r, wb, rb)]
    out = ctxfast.rel_attention(*ins, causal=True, backend="triton")
    return (out, *torch.autograd.grad(out, ins, torch.ones_like(out)))


def _lstm(q, k, v):
    x = q[0].transpose(0, 1)                                # [T, B=H, D]: any strides
    T, B, I = x.shape
    H = 48
    g = torch.Generator(device="cpu").manual_seed(2)
    ws = [(torch.randn(*shape, generator=g) * 0.2).to(q).requires_grad_()
          for shape in ((4 * H, I), (4 * H, H), (4 * H,), (4 * H,))]
    mask = (torch.rand(4 * H, H, generator=g) > 0.3).to(q.device)
    x = x.detach().requires_grad_()
    out, _ = ctxfast.lstm(x, None, *ws, weight_mask=mask, weight_dropout=0.3,
                          backend="triton")
    return (out, *torch.autograd.grad(out, [x, *ws], torch.ones_like(out)))


OPS = {"attention": _attention, "rel_attention": _rel_attention, "lstm": _lstm}


def _inputs(dtype, offset):
    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, T, D = 2, 3, 97, 64
    flat = [torch.randn(B * H * T * D + offset, generator=g) for _ in range(3)]
    return [f.to("cuda", dtype)[offset:].view(B, H, T, D) for f in flat]


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fast_launch_matches_jit_launch(op, dtype, monkeypatch):
    fn = OPS[op]
    aligned, shifted = _inputs(dtype, 0), _inputs(dtype, 1)
    assert shifted[0].data_ptr() % 16 != 0
    monkeypatch.setattr(_launch, "LAUNCH", "jit")
    want = [fn(*aligned), fn(*shifted)]
    monkeypatch.setattr(_launch, "LAUNCH", "fast")
    monkeypatch.setattr(_launch, "_WRAPPED", {})
    got = [fn(*aligned), fn(*aligned), fn(*shifted), fn(*shifted)]
    for i, (g, w) in enumerate(zip(got, [want[0], want[0], want[1], want[1]])):
        for j, (a, b) in enumerate(zip(g, w)):
            assert torch.equal(a, b), f"{op} call {i} output {j}: fast launch != jit launch"
    wrapped = list(_launch._WRAPPED.values())
    assert wrapped and sum(w.hits for w in wrapped) > 0
    assert all(w.misses >= 1 for w in wrapped)


@pytest.mark.parametrize("launch", ["fast", "jit"])
def test_tuner_compiles_candidates_ahead_on_worker_threads(launch, monkeypatch):
    """CTXFAST_AUTOTUNE's first call of a kind (rel_attention bf16, forward and backward)
    compiles each kernel's candidates before timing them (kernels/_tune.py
    ``compile_ahead``): every compile made while tuning happens in that phase, some on
    worker threads, none in the timed trials; the tuned call's gradients match the table
    rows' within the tuner's own agreement (the tuner checks its outputs; here the
    gradients of the call that tuned against an untuned one)."""
    import threading

    from triton import knobs

    from ctxfast.kernels import _tune

    state = {"tuning": 0, "ahead": 0, "callers": set()}
    events = []
    real_ahead, real_tune = _tune.compile_ahead, _tune._tune

    def inside(key, real):      # real, counting the calls in progress in state[key]
        def call(*args, **kwargs):
            state[key] += 1
            if key == "ahead":  # the threads that called it: not its workers
                state["callers"].add(threading.get_ident())
            try:
                return real(*args, **kwargs)
            finally:
                state[key] -= 1
        return call
    ahead, tune = inside("ahead", real_ahead), inside("tuning", real_tune)

    def compiled(**kwargs):
        events.append((threading.get_ident(), state["tuning"] > 0, state["ahead"] > 0))

    monkeypatch.setattr(_launch, "LAUNCH", launch)
    monkeypatch.setattr(_launch, "_WRAPPED", {})
    # Triton's in-process tables of compiled kernels, emptied: an earlier test in this
    # process may have compiled these rows (a compile from Triton's disk cache still counts)
    from collections import defaultdict

    from triton.runtime.jit import JITFunction

    from ctxfast.kernels import _common as kcommon
    from ctxfast.kernels import rel_attention as krel
    for mod in (krel, kcommon):
        for fn in vars(mod).values():
            if isinstance(fn, JITFunction):
                monkeypatch.setattr(fn, "device_caches", defaultdict(fn.create_binder))
    monkeypatch.setattr(_tune, "compile_ahead", ahead)
    monkeypatch.setattr(_tune, "_tune", tune)
    monkeypatch.setattr(_tune, "COMPILE_THREADS", 4)
    ins = _inputs(torch.bfloat16, 0)
    want = _rel_attention(*ins)
    monkeypatch.setattr(_tune, "MODE", "on")
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", compiled)
    _tune.reset()
    try:
        got = _rel_attention(*ins)
    finally:
        _tune.reset()
    during = [e for e in events if e[1]]
    assert not [e for e in during if not e[2]], f"compiled while timing: {events}"
    assert any(ident not in state["callers"] for ident, _, _ in during), events
    for j, (a, b) in enumerate(zip(got, want)):
        gap = float((a.float() - b.float()).abs().max()) / float(b.float().abs().max())
        assert gap <= _tune.AGREE[torch.bfloat16], f"output {j}: {gap}"
