"""The ops' autograd in eager code (ctxfast.ops._common.GradCall): a plain
torch.autograd.Function applies the formula registered with torch.library.register_autograd
(whose own path costs ~5 µs per schema argument per call). Both paths must give the same
gradients: the public functions take GradCall's, a direct ``torch.ops.ctxfast`` call takes
the registered one (as torch.compile and opcheck do). Also: no graph without grad, and
``torch.func.grad`` through the ops."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ctxfast
from utils import CPU_BACKENDS, TRITON_ON_CPU, assert_equal

needs_cpu = pytest.mark.skipif("cpu" not in CPU_BACKENDS or not hasattr(
    torch.ops.ctxfast, "rel_attention_fwd_cpu"), reason="ctxfast._C built without the ops")


class _SeenOps(TorchDispatchMode):
    """A dispatch mode that records the name of every op the dispatcher hands it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _leaves(*shapes):
    return [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]


def _same_grads(public, direct, leaves, name, node=None):
    """public(*leaves) and direct(*leaves) (a torch.ops.ctxfast call) give the same output
    and the same gradient of every leaf; public's graph is GradCall's Function, or the C++
    autograd Function `node` where the op has one."""
    out = public(*leaves)
    if node is None:
        assert type(out.grad_fn).__name__ == f"{name}_gradBackward", type(out.grad_fn).__name__
    else:
        assert node in out.grad_fn.name(), out.grad_fn.name()
    ref = direct(*leaves)
    assert type(ref.grad_fn).__name__.startswith("GeneratedBackwardFor_ctxfast_" + name)
    assert_equal(out, ref)
    do = torch.randn_like(out)
    for leaf, g, g_ref in zip(leaves, torch.autograd.grad(out, leaves, do),
                              torch.autograd.grad(ref, leaves, do)):
        assert_equal(g, g_ref, name=f"grad of {tuple(leaf.shape)}")


@needs_cpu
def test_attention_cpu_both_paths():
    B, H, Tq, Tk, D = 2, 3, 37, 50, 16
    kpm = torch.rand(B, Tk) < 0.2
    _same_grads(
        lambda q, k, v: ctxfast.attention(q, k, v, causal=True, key_padding_mask=kpm,
                                          backend="cpu"),
        lambda q, k, v: torch.ops.ctxfast.attention_fwd_cpu(
            q, k, v, kpm, None, True, False, D ** -0.5, 0.0, None)[0],
        _leaves((B, H, Tq, D), (B, H, Tk, D), (B, H, Tk, D)), "attention_fwd_cpu")


@needs_cpu
def test_attention_varlen_cpu_both_paths():
    H, D = 2, 16
    cu = torch.tensor([0, 5, 22, 30], dtype=torch.int32)
    _same_grads(
        lambda q, k, v: ctxfast.attention_varlen(q, k, v, cu, cu, 17, 17, causal=True,
                                                 backend="cpu"),
        lambda q, k, v: torch.ops.ctxfast.attention_varlen_fwd_cpu(
            q, k, v, cu, cu, True, D ** -0.5, 17, 17, 0.0, None)[0],
        _leaves((30, H, D), (30, H, D), (30, H, D)), "attention_varlen_fwd_cpu")


@needs_cpu
def test_rel_attention_cpu_both_paths():
    B, H, Tq, mem, D = 2, 2, 33, 20, 16
    Tk = Tq + mem
    _same_grads(
        lambda q, k, v, r, u, w: ctxfast.rel_attention(q, k, v, r, u, w, causal=True,
                                                       backend="cpu"),
        lambda q, k, v, r, u, w: torch.ops.ctxfast.rel_attention_fwd_cpu(
            q, k, v, r, u, w, None, None, None, None, None, None, True, Tk - 1, 0, False,
            D ** -0.5, 0.0, None)[0],
        _leaves((B, H, Tq, D), (B, H, Tk, D), (B, H, Tk, D), (H, Tk, D), (H, D), (H, D)),
        "rel_attention_fwd_cpu", node="RelAttentionCpuGrad")


@needs_cpu
def test_rel_attention_cpu_grad_op_matches_the_formula():
    """The C++ autograd Function (rel_attention_cpu_grad) against the op with its registered
    Python formula, with segments, a padding mask and dropout (the same seed), every input
    differentiable or only some, and a second backward through retain_graph."""
    B, H, Tq, mem, D = 2, 2, 19, 7, 8
    Tk = Tq + mem
    q, k, v, r, u, w, se, rs = _leaves((B, H, Tq, D), (B, H, Tk, D), (B, H, Tk, D),
                                       (H, Tk + Tq, D), (H, D), (H, D), (2, H, D), (H, D))
    kpm = torch.rand(B, Tk) < 0.2
    kpm[:, 0] = False
    seg_q, seg_k = torch.randint(0, 2, (B, Tq)), torch.randint(0, 2, (B, Tk))
    seed = torch.tensor([1234], dtype=torch.int64)
    args = lambda *t: (*t[:6], kpm, None, seg_q, seg_k, t[6], t[7], False, Tk, 0, False,
                       D ** -0.5, 0.1, seed)
    leaves = [q, k, v, r, u, w, se, rs]
    out, lse = torch.ops.ctxfast.rel_attention_cpu_grad(*args(*leaves))
    ref, ref_lse = torch.ops.ctxfast.rel_attention_fwd_cpu(*args(*leaves))
    assert_equal(out, ref)
    assert_equal(lse, ref_lse)
    assert not lse.requires_grad
    do = torch.randn_like(out)
    for _ in range(2):   # the saved tensors survive a first backward with retain_graph
        got = torch.autograd.grad(out, leaves, do, retain_graph=True)
        want = torch.autograd.grad(ref, leaves, do, retain_graph=True)
        for leaf, g, g_ref in zip(leaves, got, want):
            assert_equal(g, g_ref, name=f"grad of {tuple(leaf.shape)}")
    part = [t.detach() for t in leaves]
    part[3].requires_grad_()                # only r
    out2, _ = torch.ops.ctxfast.rel_attention_cpu_grad(*args(*part))
    (g_r,) = torch.autograd.grad(out2, part[3], do)
    assert_equal(g_r, torch.autograd.grad(ref, r, do)[0], name="grad of r alone")


@needs_cpu
def test_lstm_cpu_both_paths():
    T, B, I, Hd = 7, 3, 5, 6
    x, w_ih, w_hh, h0, c0 = _leaves((T, B, I), (4 * Hd, I), (4 * Hd, Hd), (B, Hd), (B, Hd))
    xw = torch.nn.functional.linear(x, w_ih)

    def public(xw_, w_hh_, h0_, c0_):       # the public op adds x w_ihᵀ itself: pass xw as x
        eye = torch.eye(4 * Hd, dtype=xw_.dtype)
        return ctxfast.lstm(xw_, (h0_, c0_), eye, w_hh_, backend="cpu")[0]

    _same_grads(public,
                lambda xw_, w_hh_, h0_, c0_: torch.ops.ctxfast.lstm_recurrence_native(
                    xw_, h0_, c0_, w_hh_, None, None, 1.0, math.inf, math.inf, False)[0],
                [xw.detach().requires_grad_(True), w_hh, h0, c0], "lstm_recurrence_native")


@needs_cpu
def test_rel_shift_cpu_both_paths():
    _same_grads(lambda x: ctxfast.rel_shift(x, backend="cpu"),
                lambda x: torch.ops.ctxfast.rel_shift_native(x, False),
                _leaves((2, 3, 17, 29)), "rel_shift_native")


@needs_cpu
def test_no_graph_without_grad_and_func_grad():
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        assert ctxfast.attention(q.requires_grad_(), k, v, backend="cpu").grad_fn is None
    q = q.detach()

    def loss(q_):
        return ctxfast.attention(q_, k, v, causal=True, backend="cpu").square().sum()

    g = torch.func.grad(loss)(q)
    leaf = q.clone().requires_grad_(True)
    loss(leaf).backward()
    assert_equal(g, leaf.grad, name="torch.func.grad")


@pytest.mark.skipif(not (TRITON_ON_CPU or torch.cuda.is_available()),
                    reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_attention_triton_takes_grad_call():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(1, 2, 16, 16, device=dev, requires_grad=True) for _ in range(3))
    out = ctxfast.attention(q, k, v, causal=True, backend="triton")
    assert type(out.grad_fn).__name__ == "attention_fwd_triton_gradBackward"
    ref = torch.ops.ctxfast.attention_fwd_triton(q, k, v, None, None, True, False, 0.25, 0.0,
                                                 None)[0]
    do = torch.randn_like(out)
    for g, g_ref in zip(torch.autograd.grad(out, (q, k, v), do),
                        torch.autograd.grad(ref, (q, k, v), do)):
        assert_equal(g, g_ref)


@needs_cpu
def test_no_grad_call_starts_below_autograd_and_modes_still_see_it():
    """Without anything to differentiate, GradCall enters the dispatcher below the autograd
    key (the registered formula would only pass the call on): same output as the grad-mode
    call, no graph, inference tensors accepted, and a TorchDispatchMode still sees the op
    (FlopCounterMode, FSDP's and profilers' modes rely on that)."""
    q, k, v = (torch.randn(2, 3, 11, 8) for _ in range(3))
    leaf = q.clone().requires_grad_(True)
    with_grad = ctxfast.attention(leaf, k, v, causal=True, backend="cpu")
    assert with_grad.grad_fn is not None
    plain = ctxfast.attention(q, k, v, causal=True, backend="cpu")   # grad mode, no leaf
    assert plain.grad_fn is None and not plain.requires_grad
    assert_equal(plain, with_grad.detach(), name="no-grad call")
    with torch.inference_mode():
        inf = ctxfast.attention(q.clone(), k.clone(), v.clone(), causal=True, backend="cpu")
    assert inf.is_inference()
    assert_equal(inf, plain, name="inference_mode call")
    seen = _SeenOps()
    with seen, torch.no_grad():
        ctxfast.attention(q, k, v, causal=True, backend="cpu")
    assert any("ctxfast.attention_fwd_cpu" in o for o in seen.ops), seen.ops


@needs_cpu
def test_forward_mode_ad_is_refused_not_silently_zero():
    """The ops have no forward-derivative formula: a dual tensor or torch.func.jvp through
    them raises (PyTorch itself would drop the tangent or return zeros without a word).
    A jvp whose tangents do not reach the op is unaffected; the eager backend does forward
    mode."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            ctxfast.attention(dual, k, v, backend="cpu")
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            ctxfast.rel_shift(dual[0], backend="cpu")
        eager = fwAD.unpack_dual(ctxfast.attention(dual, k, v, backend="eager")).tangent
        assert eager is not None and eager.abs().sum() > 0
        # float32: the lstm's projection may take oneDNN (a Function without a jvp)
        x, w_ih, w_hh = torch.randn(4, 2, 3), torch.randn(12, 3), torch.randn(12, 3)
        for i in range(2):
            args = [x, w_ih]
            args[i] = fwAD.make_dual(args[i], torch.randn_like(args[i]))
            with pytest.raises(NotImplementedError,
                               match="lstm_recurrence_native: forward-mode AD"):
                ctxfast.lstm(args[0], None, args[1], w_hh, backend="cpu")
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda x: ctxfast.attention(x, k, v, backend="cpu"), (q,),
                       (torch.randn_like(q),))
    s = torch.randn(())
    out, tangent = torch.func.jvp(
        lambda x: x * ctxfast.attention(q, k, v, backend="cpu").sum(), (s,), (torch.ones(()),))
    assert_equal(tangent, ctxfast.attention(q, k, v, backend="cpu").sum().to(tangent.dtype),
                 name="jvp that does not reach the op")


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_second_derivatives_are_refused_by_name(backend):
    """A gradient of a gradient through an op (create_graph=True, then differentiating the
    gradient) raises NotImplementedError naming the op, on every backend's backward op: the
    C++ CPU ones gave silent zeros there (no Autograd kernel: torch warns and goes on), the
    Triton ones an error from the dispatcher at the first backward. The first backward
    itself, with create_graph=True, still gives the gradient (a gradient penalty that does
    not differentiate through the op again works), and warns nothing; except rel_attention's
    C++ CPU autograd Function (its eager path), which refuses create_graph=True at once."""
    import warnings
    if backend not in CPU_BACKENDS:
        pytest.skip(f"no {backend} backend here")
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    x, w_ih, w_hh = (torch.randn(*s, requires_grad=True) for s in ((4, 2, 3), (12, 3), (12, 3)))
    r, u, w = torch.randn(2, 5, 8), torch.randn(2, 8), torch.randn(2, 8)
    cases = {
        "attention": (lambda q: ctxfast.attention(q, k, v, causal=True, backend=backend), q),
        "attention_varlen": (lambda q: ctxfast.attention_varlen(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 3, 3,
            backend=backend), q),
        "rel_attention": (lambda q: ctxfast.rel_attention(q, k, v, r, u, w, backend=backend),
                          q),
        "lstm": (lambda x: ctxfast.lstm(x, None, w_ih, w_hh, backend=backend)[0], x),
    }
    for name, (f, leaf) in cases.items():
        if name == "rel_attention" and backend == "cpu":
            with pytest.raises(NotImplementedError, match=f"^{name}: a second derivative"):
                torch.autograd.grad(f(leaf).square().sum(), leaf, create_graph=True)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = f(leaf)
            g, = torch.autograd.grad(out.square().sum(), leaf, create_graph=True)
        plain, = torch.autograd.grad(f(leaf).square().sum(), leaf)
        assert_equal(g.detach(), plain, name=f"{name}: first derivative with create_graph")
        with pytest.raises(NotImplementedError, match=f"^{name}: a second derivative"):
            torch.autograd.grad(g.square().sum(), leaf)


@needs_cpu
def test_per_sample_gradients_with_vmap():
    """vmap(grad(...)) through the ops (per-sample gradients, as DP-SGD code computes them):
    the Function vmaps its forward and backward as written, the ops running per sample.
    Each sample's gradient equals grad of that sample alone."""
    N, B, H, T, D = 3, 1, 2, 7, 8
    qs, ks = torch.randn(N, B, H, T, D), torch.randn(N, B, H, T, D)
    v = torch.randn(B, H, T, D)
    w = torch.randn(B, H, T, D)

    def loss(q, k):
        return (ctxfast.attention(q, k, v, causal=True, backend="cpu") * w).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(qs, ks)
    for i in range(N):
        one = torch.func.grad(loss, argnums=(0, 1))(qs[i], ks[i])
        assert_equal(per_sample[0][i], one[0], name=f"dq of sample {i}")
        assert_equal(per_sample[1][i], one[1], name=f"dk of sample {i}")

    xs = torch.randn(N, 5, 2, 4)                         # [N, T, B, I]
    w_ih, w_hh = torch.randn(12, 4), torch.randn(12, 3)

    def lstm_loss(x):
        out, _ = ctxfast.lstm(x, None, w_ih, w_hh, backend="cpu")
        return out.square().sum()

    per_sample = torch.func.vmap(torch.func.grad(lstm_loss))(xs)
    for i in range(N):
        assert_equal(per_sample[i], torch.func.grad(lstm_loss)(xs[i]), name=f"lstm dx {i}")


def test_backward_ops_start_below_autograd_only_in_a_plain_backward():
    """ops._common.call_in_backward: a backward op called from an autograd formula skips
    the custom op's own autograd kernel (Python, ~50 µs a call) when grad mode is off, and
    keeps it where it decides something (create_graph: grad mode on)."""
    from ctxfast.ops._common import call_in_backward
    seen = []

    def op(x):   # stands for the op: is the dispatcher told to start below autograd?
        seen.append(torch._C._dispatch_tls_is_dispatch_key_excluded(
            torch._C.DispatchKey.AutogradFunctionality))
        return x * 2

    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():                                 # a plain backward
        call_in_backward(op, x)
    with torch.enable_grad():                             # backward with create_graph
        call_in_backward(op, x)
    assert seen == [True, False]
    # and end to end: a public op's gradients are the same bits by either way (a plain
    # backward, below autograd; create_graph=True, through it), and only the second keeps
    # a graph. (Not against eager: the triton backend keeps float64's softmax statistics in
    # float32, ~1e-7 relative, a known limit (benchmarks/NOTES.md); this test compared with
    # eager at float64's default tolerance and failed under CTXFAST_TEST_SEED=13, 1.7e-7.)
    q, k, v = _leaves((1, 2, 5, 4), (1, 2, 7, 4), (1, 2, 7, 4))
    backend = "triton" if TRITON_ON_CPU else "eager"
    out = ctxfast.attention(q, k, v, causal=True, backend=backend)
    plain = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    graph = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    for a, b in zip(plain, graph):
        assert not a.requires_grad and b.requires_grad
        assert torch.equal(a, b.detach())


@pytest.mark.skipif(not (TRITON_ON_CPU or torch.cuda.is_available()),
                    reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_triton_ops_skip_the_dispatcher_only_where_nothing_else_must_see_them(monkeypatch):
    """Plain eager code calls a Triton custom op's Python function directly (forward and the
    backward op in a plain backward: ~20 µs a call less through the dispatcher); a Python
    dispatch mode still sees the op (and gets the same result), and FakeTensorMode gets the
    registered fake (no kernel runs), as through the dispatcher."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ctxfast.ops import _common
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    called = []
    for name in ("attention_fwd_triton", "attention_bwd_triton"):
        op = getattr(torch.ops.ctxfast, name)
        fn = _common._impl(op)
        assert fn is not None, name

        def spy(*args, _fn=fn, _name=name):
            called.append(_name)
            return _fn(*args)
        monkeypatch.setitem(_common._IMPLS, op._qualified_op_name, spy)

    q, k, v = (torch.randn(1, 2, 16, 16, device=dev, requires_grad=True) for _ in range(3))
    out = ctxfast.attention(q, k, v, causal=True, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert called == ["attention_fwd_triton", "attention_bwd_triton"], called
    called.clear()
    with torch.no_grad():
        plain = ctxfast.attention(q, k, v, causal=True, backend="triton")
    assert called == ["attention_fwd_triton"]
    called.clear()
    seen = _SeenOps()
    with seen:
        moded = ctxfast.attention(q, k, v, causal=True, backend="triton")
        moded_grads = torch.autograd.grad(moded, (q, k, v), torch.ones_like(moded))
    assert called == [], called
    assert any("ctxfast.attention_fwd_triton" in o for o in seen.ops), seen.ops
    assert any("ctxfast.attention_bwd_triton" in o for o in seen.ops), seen.ops
    assert_equal(moded.detach(), plain, name="out under a dispatch mode")
    for g, g_ref in zip(moded_grads, grads):
        assert_equal(g, g_ref, name="grad under a dispatch mode")
    detached = [t.detach() for t in (q, k, v)]
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in detached)
        fake = ctxfast.attention(fq, fk, fv, causal=True, backend="triton")
    assert called == [] and tuple(fake.shape) == tuple(q.shape)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_func_grad_through_every_op(backend):
    """torch.func.grad and vmap(grad) through every op on the backends GradCall serves
    (attention, attention_varlen, rel_attention, lstm, rel_shift, linear) give the plain
    backward's gradient. (Through the Triton ops, and rel_shift on every backend, they
    failed in torch's autograd.Function check, "must override the setup_context
    staticmethod", naming no op: the backward op's own custom-op autograd kernel.) A
    gradient of a gradient (grad of grad) is refused naming the op, except rel_shift's,
    whose gradient is its inverse and differentiable; forward mode (jvp) is refused."""
    if backend not in CPU_BACKENDS:
        pytest.skip(f"no {backend} backend here")
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    w_ih, w_hh = torch.randn(12, 3), torch.randn(12, 3)
    r, u, w = torch.randn(2, 5, 8), torch.randn(2, 8), torch.randn(2, 8)
    wl = torch.randn(6, 8)
    cases = {
        "attention": (lambda q: ctxfast.attention(q, k, v, causal=True, backend=backend),
                      (1, 2, 5, 8)),
        "attention_varlen": (lambda q: ctxfast.attention_varlen(
            q, k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 3, 3, backend=backend),
            (5, 2, 8)),
        "rel_attention": (lambda q: ctxfast.rel_attention(q, k, v, r, u, w, backend=backend),
                          (1, 2, 5, 8)),
        "lstm": (lambda x: ctxfast.lstm(x, None, w_ih, w_hh, backend=backend)[0], (4, 2, 3)),
        "rel_shift": (lambda x: ctxfast.rel_shift(x, backend=backend), (2, 4, 6)),
    }
    if backend == "triton":
        cases["linear"] = (lambda x: ctxfast.linear(x, wl, backend=backend), (3, 8))
    for name, (f, shape) in cases.items():
        x = torch.randn(*shape)
        weight = torch.randn_like(f(x))

        def loss(x_):
            return (f(x_) * weight).sum()

        leaf = x.clone().requires_grad_(True)
        plain, = torch.autograd.grad(loss(leaf), leaf)
        assert_equal(torch.func.grad(loss)(x), plain, name=f"{name}: torch.func.grad")
        xs = torch.stack([x, 2 * x])
        per_sample = torch.func.vmap(torch.func.grad(loss))(xs)
        assert_equal(per_sample[0], plain, name=f"{name}: vmap(grad)")
        # vjp's function runs the backward after the transform's level has ended, on its
        # (dead) wrapped tensors: the Triton launchers read their storage and failed
        # ("Cannot access storage of TensorWrapper") when the op's Python function was
        # called directly on them
        out, vjp_fn = torch.func.vjp(f, x)
        assert_equal(vjp_fn(weight)[0], plain, name=f"{name}: vjp")
        jac = torch.func.jacrev(loss)(x)
        assert_equal(jac, plain, name=f"{name}: jacrev")
        if name == "rel_shift":
            torch.func.grad(lambda x_: torch.func.grad(loss)(x_).square().sum())(x)
        else:
            with pytest.raises(NotImplementedError, match=f"^{name}: a second derivative"):
                torch.func.grad(lambda x_: torch.func.grad(loss)(x_).square().sum())(x)
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                torch.func.jvp(f, (x,), (torch.randn_like(x),))


def _calls():
    """name: (public call of float64 leaves, leaf shapes) for every op with gradients."""
    B, H, Tq, Tk, D, T, I, Hd = 2, 2, 9, 13, 8, 5, 4, 6
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    return {
        "attention": (lambda b, q, k, v: ctxfast.attention(q, k, v, causal=True, backend=b),
                      [(B, H, Tq, D), (B, H, Tk, D), (B, H, Tk, D)]),
        "attention_varlen": (lambda b, q, k, v: ctxfast.attention_varlen(
            q, k, v, cu, cu_k, 5, 7, causal=True, backend=b), [(9, H, D), (13, H, D), (13, H, D)]),
        "rel_attention": (lambda b, q, k, v, r, u, w: ctxfast.rel_attention(
            q, k, v, r, u, w, causal=True, backend=b),
            [(B, H, Tq, D), (B, H, Tk, D), (B, H, Tk, D), (H, Tk, D), (H, D), (H, D)]),
        "lstm": (lambda b, x, w_ih, w_hh, h0, c0: ctxfast.lstm(x, (h0, c0), w_ih, w_hh,
                                                                backend=b)[0],
                 [(T, B, I), (4 * Hd, I), (4 * Hd, Hd), (B, Hd), (B, Hd)]),
        "rel_shift": (lambda b, x: ctxfast.rel_shift(x, backend=b), [(2, 3, 7, 11)]),
    }


@pytest.mark.parametrize("backend", [b for b in ("cpu", "triton", "eager") if b in CPU_BACKENDS])
@pytest.mark.parametrize("name", sorted(_calls()))
def test_a_gradient_for_each_input_that_alone_requires_it(name, backend):
    """Any one input requiring grad makes a graph, and its gradient is the one it gets when
    every input requires grad: the shared call path once looked at the first argument only
    (the others' gradients were silently None, and no test saw it: they all made q, or
    everything, require grad)."""
    call, shapes = _calls()[name]
    values = [torch.randn(*s, dtype=torch.float64) for s in shapes]
    every = [t.clone().requires_grad_() for t in values]
    out = call(backend, *every)
    do = torch.randn_like(out)
    want = torch.autograd.grad(out, every, do)
    for i in range(len(values)):
        leaves = [t.clone().requires_grad_(j == i) for j, t in enumerate(values)]
        out_i = call(backend, *leaves)
        assert out_i.requires_grad, f"{name}: input {i} alone requires grad, the output not"
        (got,) = torch.autograd.grad(out_i, leaves[i], do)
        assert_equal(got, want[i], name=f"{name} ({backend}): gradient of input {i} alone")
