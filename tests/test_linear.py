"""ctxfast.linear (F.linear with float32 on the tensor cores at float32's accuracy) and the
GEMM under it (kernels/linear.py), on every backend this machine runs: forward and the
gradients of x, weight and bias against float64 with the 2x-eager rule, odd and empty
sizes, strided operands, autocast, torch.compile, opcheck, dispatch and bad input. On the
CPU the Triton GEMM runs in the interpreter, whose float32 dots are exact whatever the
precision asked for: the tf32x3 products' error is checked on a GPU (this file runs there
too; torch's TF32 for float32 matmuls is off by default, so ``triton`` runs tf32x3)."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import ctxfast
from ctxfast import reference
from utils import DEVICE, assert_within_2x_eager, rel_err, spy_launches

linear_ops = importlib.import_module("ctxfast.ops.linear")
BACKENDS = [b for b in ctxfast.BACKENDS if ctxfast.why_unavailable(b, DEVICE) is None]
needs_triton = pytest.mark.skipif("triton" not in BACKENDS,
                                  reason="Triton cannot run here (no GPU, no interpreter)")
FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# bf16 under the interpreter too (its dots take fp32 products there, UPCAST; the bf16
# output is rounded to nearest even as on a GPU, kernels/_interpreter.py; these cases also
# passed with Triton's own truncation)
DTYPES = [torch.float32, torch.float16, torch.float64, torch.bfloat16]


def _inputs(lead, I, N, dtype, *, bias=True, view="contiguous"):
    """x ``[*lead, I]``, weight ``[N, I]``, bias ``[N]`` or None, as leaves; ``view``:
    "x transposed" / "weight transposed" (strided views of other layouts; the latter with
    a strided bias too)."""
    def mk(*s):
        return torch.randn(*s, device=DEVICE, dtype=torch.float32)
    x = mk(I, *lead).movedim(0, -1) if view == "x transposed" else mk(*lead, I)
    w = mk(I, N).t() if view == "weight transposed" else mk(N, I)
    w = w * max(I, 1) ** -0.5
    b = (mk(2 * N)[::2] if view == "weight transposed" else mk(N)) if bias else None
    return [t.to(dtype).requires_grad_() if t is not None else None for t in (x, w, b)]


def _run(fn, x, w, b, g):
    y = fn(x, w, b)
    leaves = [t for t in (x, w, b) if t is not None]
    return [y, *torch.autograd.grad(y, leaves, g)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead, I, N, bias, view", [
    ((37,), 19, 23, True, "contiguous"), ((2, 17), 33, 40, False, "x transposed"),
    ((5,), 16, 97, True, "weight transposed"), ((1,), 1, 1, True, "contiguous"),
    ((), 7, 5, True, "contiguous"), ((3, 1, 4), 20, 9, True, "contiguous")] + (
    # a decoder's depth (tf32x3's error over long sums; too slow for the interpreter)
    [((2, 300), 400, 1500, True, "contiguous")] if DEVICE == "cuda" else []),
    ids=["37x19->23", "2x17x33->40-nobias-xT", "5x16->97-wT", "1x1->1", "rank1", "rank4",
         "decoder"][:7 if DEVICE == "cuda" else 6])
def test_against_float64(backend, dtype, lead, I, N, bias, view):
    """Output and every gradient within 2x the error of eager (F.linear) at the same dtype
    against float64; the output's shape, dtype and layout as F.linear's."""
    x, w, b = _inputs(lead, I, N, dtype, bias=bias, view=view)
    g = torch.randn(*lead, N, device=DEVICE, dtype=dtype)
    ours = _run(lambda *a: ctxfast.linear(*a, backend=backend), x, w, b, g)
    same = _run(reference.linear, x, w, b, g)
    ref = _run(reference.linear, *[t.detach().double().requires_grad_() if t is not None else None
                           for t in (x, w, b)], g.double())
    y = ours[0]
    assert y.shape == (*lead, N) and y.dtype == dtype and y.is_contiguous()
    names = ["out", "grad_x", "grad_weight", "grad_bias"]
    for name, o, s, r in zip(names, ours, same, ref):
        assert o.dtype == dtype and o.shape == r.shape, name
        assert_within_2x_eager(o, s, r, FLOOR[dtype], name=f"{backend} {dtype} {name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead, I, N", [((0,), 5, 4), ((3,), 0, 4), ((3, 2), 5, 0),
                                        ((0, 2), 0, 0)])
def test_empty(backend, lead, I, N):
    """Empty rows, inputs or outputs: F.linear's values (zeros, or the bias) and
    gradients, without a launch on nothing."""
    x, w, b = _inputs(lead, I, N, torch.float32)
    g = torch.randn(*lead, N, device=DEVICE)
    ours = _run(lambda *a: ctxfast.linear(*a, backend=backend), x, w, b, g)
    want = _run(reference.linear, x, w, b, g)
    for o, r in zip(ours, want):
        assert o.shape == r.shape and torch.allclose(o, r, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("M, K, N, bias, view", [
    (37, 19, 23, True, "contiguous"), (5, 33, 40, False, "a transposed"),
    (18, 16, 17, True, "b transposed"), (1, 1, 1, True, "contiguous"),
    (3, 0, 4, True, "contiguous"), (0, 5, 4, False, "contiguous"),
    (4, 5, 0, False, "contiguous")])
def test_matmul_against_float64(precision, M, K, N, bias, view):
    """kernels/linear.py's GEMM, float32: odd and edge sizes, transposed operands read
    through their strides, bias or not, against float64. One TF32 product: 1e-2 of the
    result on a GPU (exact in the interpreter); tf32x3: within 2x torch.mm's error at
    float32 (TF32 off)."""
    from ctxfast.kernels.linear import matmul
    a = torch.randn(K, M).t() if view == "a transposed" else torch.randn(M, K)
    b = torch.randn(N, K).t() if view == "b transposed" else torch.randn(K, N)
    a, b = a.to(DEVICE), b.to(DEVICE)
    bv = torch.randn(N, device=DEVICE) if bias else None
    got = matmul(a, b, bv, precision=precision)
    want = a.double() @ b.double() + (bv.double() if bias else 0)
    assert got.shape == (M, N) and got.dtype == torch.float32 and got.is_contiguous()
    if want.numel() == 0:
        return
    if precision == "tf32" and DEVICE == "cuda":
        assert rel_err(got, want) <= 1e-2
    else:
        same = a @ b + (bv if bias else 0)
        assert_within_2x_eager(got, same, want, FLOOR[torch.float32], name=precision)


@needs_triton
def test_steps_summed_apart(monkeypatch):
    """kernels.linear.PROMOTE: each K step's products summed on their own and added to the
    running sum outside the MMA (float32 only): the same values against float64, over
    several K steps (K 70 is 5 of the interpreter's 16-deep steps), and the kernel ran it."""
    from ctxfast.kernels import linear as klinear
    monkeypatch.setattr(klinear, "PROMOTE", True)
    seen = spy_launches(monkeypatch, klinear, ["_linear_kernel"],
                        lambda a, kw: kw["PROMOTE"], with_name=False)
    x, w, b = _inputs((33,), 70, 21, torch.float32)
    g = torch.randn(33, 21, device=DEVICE)
    ours = _run(lambda *a: ctxfast.linear(*a, backend="triton"), x, w, b, g)
    same = _run(reference.linear, x, w, b, g)
    ref = _run(reference.linear, *[t.detach().double().requires_grad_() for t in (x, w, b)],
               g.double())
    for name, o, s, r in zip(["out", "grad_x", "grad_weight", "grad_bias"], ours, same, ref):
        assert_within_2x_eager(o, s, r, FLOOR[torch.float32], name=f"promote {name}")
    assert seen == [True] * 3
    x16, w16 = x.detach().half(), w.detach().half()
    ctxfast.linear(x16, w16, backend="triton")
    assert seen[-1] is False                          # 16-bit: one MMA sum, as before


@needs_triton
def test_triton_float32_takes_tf32x3_unless_torch_allows_tf32(monkeypatch):
    """The triton backend's float32 products follow torch's setting for float32 matmuls at
    each call: tf32x3 (float32's accuracy) by default, one TF32 product where allowed."""
    from ctxfast.kernels import _common as kcommon
    from ctxfast.kernels import linear as klinear
    asked = []
    real = klinear.matmul
    monkeypatch.setattr(klinear, "matmul", lambda *a, precision: asked.append(precision)
                        or real(*a, precision=precision))
    allowed = {"tf32": False}
    monkeypatch.setattr(kcommon, "_tf32_allowed", lambda: allowed["tf32"])
    x, w, b = _inputs((6,), 5, 4, torch.float32)
    ctxfast.linear(x, w, b, backend="triton").sum().backward()
    assert asked == ["tf32x3"] * 3                        # forward, grad_x, grad_weight
    allowed["tf32"] = True
    asked.clear()
    ctxfast.linear(x, w, b, backend="triton").sum().backward()
    assert asked == ["tf32"] * 3


@needs_triton
def test_unneeded_gradients_are_not_computed(monkeypatch):
    """A frozen input (the first layer of a model, a frozen decoder) costs no GEMM."""
    from ctxfast.kernels import linear as klinear
    shapes = []
    real = klinear.matmul
    monkeypatch.setattr(klinear, "matmul", lambda a, *r, **k: shapes.append(tuple(a.shape))
                        or real(a, *r, **k))
    x, w, b = _inputs((6,), 5, 4, torch.float32)
    y = ctxfast.linear(x.detach(), w, b, backend="triton")
    (gw, gb) = torch.autograd.grad(y.sum(), (w, b))
    assert shapes == [(6, 5), (4, 6)]                    # forward, grad_weight: no grad_x
    shapes.clear()
    (gx,) = torch.autograd.grad(ctxfast.linear(x, w.detach(), None, backend="triton").sum(),
                                (x,))
    assert shapes == [(6, 5), (6, 4)]                    # forward, grad_x: no grad_weight


@needs_triton
@pytest.mark.parametrize("mode", ["triton", "rnn"])
def test_opcheck(monkeypatch, mode):
    if mode == "rnn":        # the TF32 kernel, as CUDA float32 with torch's defaults
        monkeypatch.setattr(linear_ops, "_precision", lambda m, x2: "tf32")
    x = torch.randn(9, 5, device=DEVICE, requires_grad=True)
    w = torch.randn(8, 5, device=DEVICE, requires_grad=True)
    for b in (torch.randn(8, device=DEVICE, requires_grad=True), None):
        torch.library.opcheck(torch.ops.ctxfast.linear.default, (x, w, b, mode))
    torch.library.opcheck(torch.ops.ctxfast.linear_backward.default,
                          (torch.randn(9, 8, device=DEVICE), x.detach(), w.detach(), True,
                           False, mode))


@needs_triton
def test_under_torch_compile():
    """torch.compile(fullgraph=True) traces ctxfast.linear on the Triton GEMM (the op is
    one node) with its gradients: the same values as without compiling."""
    torch._dynamo.reset()
    x, w, b = _inputs((13,), 6, 10, torch.float32)

    def f(x, w, b):
        return (ctxfast.linear(x * 2.0, w, b, backend="triton") ** 2).sum()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, b)
    grads = torch.autograd.grad(got, (x, w, b))
    want = f(x, w, b)
    want_grads = torch.autograd.grad(want, (x, w, b))
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    for g, r in zip(grads, want_grads):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_runs_in_the_autocast_dtype(backend):
    """As F.linear (on autocast's lower-precision list): float32 inputs under
    autocast(bfloat16) give bfloat16, the gradients reach the float32 leaves as float32."""
    x, w, b = _inputs((7,), 12, 9, torch.float32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = ctxfast.linear(x, w, b, backend=backend)
        want = F.linear(x, w, b)
    assert y.dtype == want.dtype == torch.bfloat16
    # a bfloat16 activation (the output of an earlier autocast op) meets float32 weights
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y16 = ctxfast.linear(x.detach().bfloat16(), w, b, backend=backend)
        want16 = F.linear(x.detach().bfloat16(), w, b)
    assert y16.dtype == want16.dtype == torch.bfloat16
    grads = torch.autograd.grad(y.float().sum(), (x, w, b))
    assert all(g.dtype == torch.float32 for g in grads)
    ref = F.linear(x.double(), w.double(), b.double())
    assert_within_2x_eager(y, want, ref, FLOOR[torch.bfloat16])


def test_default_backend(monkeypatch):
    """eager (cuBLAS, MKL) unless CUDA_DEFAULT says triton, which only CUDA float32 takes;
    a bad CUDA_DEFAULT is refused by name; an explicit backend wins."""
    x, w, b = _inputs((3,), 4, 5, torch.float32)
    assert linear_ops._route(x, None) == "eager"
    monkeypatch.setattr(linear_ops, "CUDA_DEFAULT", "triton")
    want = "triton" if DEVICE == "cuda" else "eager"
    assert linear_ops._route(x, None) == want
    assert linear_ops._route(x.detach().half(), None) == "eager"
    if "triton" in BACKENDS:
        assert linear_ops._route(x, "triton") == "triton"
        with ctxfast.backend("triton"):
            assert linear_ops._route(x, "eager") == "eager"
    monkeypatch.setattr(linear_ops, "CUDA_DEFAULT", "cuda")
    with pytest.raises(ValueError, match=r"CTXFAST_LINEAR_CUDA \(ctxfast.ops.linear."
                                         r"CUDA_DEFAULT\) must be 'eager' or"):
        ctxfast.linear(x, w, b)


def test_cuda_default_takes_float32_only(monkeypatch):
    """The decision a GPU machine makes, made here: with CUDA_DEFAULT "triton", float32
    CUDA tensors default to the Triton GEMM and every other dtype stays on cuBLAS (only
    the route is asked: no tensor is made on the GPU)."""
    from types import SimpleNamespace
    monkeypatch.setattr(ctxfast._dispatch, "_cuda_present", lambda: True)
    monkeypatch.setattr(ctxfast._dispatch, "_TRITON_INSTALLED", True)
    monkeypatch.setattr(linear_ops, "CUDA_DEFAULT", "triton")
    monkeypatch.delenv("CTXFAST_BACKEND", raising=False)
    cuda = torch.device("cuda")
    for dtype, want in ((torch.float32, "triton"), (torch.float16, "eager"),
                        (torch.bfloat16, "eager"), (torch.float64, "eager")):
        x = SimpleNamespace(is_cuda=True, dtype=dtype, device=cuda)
        assert linear_ops._route(x, None) == want, dtype


def test_triton_refused_where_it_cannot_run(monkeypatch):
    if "triton" in BACKENDS:
        monkeypatch.setattr(ctxfast._dispatch, "_TRITON_INTERPRET", False)
        if DEVICE == "cuda":
            pytest.skip("Triton runs on this machine's tensors")
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    with pytest.raises(ctxfast.BackendUnavailable, match="ctxfast.linear: backend 'triton'"):
        ctxfast.linear(x, w, b, backend="triton")


@pytest.mark.parametrize("args, err, match", [
    ((torch.randn(3, 4), torch.randn(5, 6)), ValueError,
     r"weight must have shape \[N, I\] = \[N, 4\].*got \(5, 6\)"),
    ((torch.randn(3, 4), torch.randn(4)), ValueError, r"weight must have shape \[N, I\]"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.randn(4)), ValueError,
     r"bias must have shape \[N\] = \[5\], got \(4,\)"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.randn(1, 5)), ValueError,
     r"bias must have shape \[N\] = \[5\], got \(1, 5\)"),
    ((torch.tensor(1.0), torch.randn(5, 4)), ValueError, r"x must have shape \[\.\.\., I\]"),
    ((torch.randn(3, 4), torch.randn(5, 4).double()), TypeError, "one dtype"),
    ((torch.randn(3, 4).long(), torch.randn(5, 4)), TypeError, "x must be float16"),
    (([1.0, 2.0], torch.randn(5, 2)), TypeError, "x must be a torch.Tensor"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, device="meta")), ValueError,
     "one device"),
], ids=["I", "weight-rank", "bias", "bias-rank2", "x-rank0", "dtype", "int", "list",
        "device"])
def test_bad_input_is_refused_before_dispatch(no_dispatch, args, err, match):
    with pytest.raises(err, match=match):
        ctxfast.linear(*args)


def test_op_refuses_an_unknown_mode():
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="mode must be one of"):
        torch.ops.ctxfast.linear(x, w, None, "fast")


@needs_triton
def test_matmul_refuses_bad_operands_before_launching(monkeypatch):
    from ctxfast.kernels import linear as klinear
    launched = []
    monkeypatch.setattr(klinear, "fast", lambda k: launched.append(k))
    a, b = torch.randn(4, 5, device=DEVICE), torch.randn(5, 3, device=DEVICE)
    for args, kw, err, match in (
            ((a, torch.randn(6, 3, device=DEVICE)), {}, ValueError,
             r"a must be \[M, K\].*\[4, 5\]"),
            ((a, b.double()), {}, TypeError, "b must be torch.float32"),
            ((a.long(), b.long()), {}, TypeError, "a must be float16"),
            ((a, b, torch.randn(4, device=DEVICE)), {}, ValueError, r"bias must have shape \[N\]"),
            ((a, b, torch.randn(3, device=DEVICE).double()), {}, TypeError,
             "bias must be torch.float32"),
            ((a, b), {"precision": "ieee"}, ValueError, "precision must be one of")):
        with pytest.raises(err, match=match):
            klinear.matmul(*args, **kw)
    assert launched == []


def test_nn_linear_is_a_drop_in(device, monkeypatch):
    """ctxfast.nn.Linear loads nn.Linear's state dict and computes F.linear's values; its
    ``backend`` reaches the op (the Triton GEMM runs where asked for)."""
    ref = torch.nn.Linear(6, 4).to(device)
    ours = ctxfast.nn.Linear(6, 4, backend="eager").to(device)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 6, device=device)
    assert torch.equal(ours(x), ref(x))
    assert reference.linear(x, ref.weight, ref.bias).shape == (2, 3, 4)
    if "triton" in BACKENDS:
        from ctxfast.kernels import linear as klinear
        calls = []
        real = klinear.matmul
        monkeypatch.setattr(klinear, "matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
        ours.backend = "triton"
        assert_within_2x_eager(ours(x), ref(x), F.linear(x.double(), ref.weight.double(),
                                                         ref.bias.double()), FLOOR[torch.float32])
        assert calls == [1]


@needs_triton
def test_language_model_decoders_run_on_ctxfast_linear(monkeypatch):
    """AWD-LSTM's decoder, ELMo's softmax and GPT's LM head are ``ctxfast.nn.Linear``
    modules: under the
    ctxfast backend the dispatch picks their GEMM (Triton here, in a ``ctxfast.backend``
    block), under eager (and after ``set_backend("eager")``) F.linear; the parameters keep
    nn.Linear's names, and a forward hook on the decoder still sees every call."""
    from ctxfast.kernels import linear as klinear
    from ctxfast.models import GPT, AWDLSTMConfig, AWDLSTMLM, ElmoBiLM, ElmoConfig, GPTConfig
    shapes = []
    real = klinear.matmul
    monkeypatch.setattr(klinear, "matmul", lambda a, *r, **k: shapes.append(tuple(a.shape))
                        or real(a, *r, **k))
    awd = AWDLSTMLM(AWDLSTMConfig(vocab_size=11, emb_sz=4, n_hid=8, n_layers=2, embed_p=0.0,
                                  input_p=0.0, hidden_p=0.0, weight_p=0.0, output_p=0.0))
    elmo = ElmoBiLM(ElmoConfig(char_embed_dim=4, filters=((1, 4), (2, 6)), n_highway=1,
                               projection_dim=4, cell_size=8, max_characters_per_token=6,
                               vocab_size=13))
    assert {"decoder.weight", "decoder.bias"} <= set(awd.state_dict())
    assert {"softmax.weight", "softmax.bias"} <= set(elmo.state_dict())
    gpt = GPT(GPTConfig(vocab_size=17, n_positions=8, n_layer=1, n_head=2, n_embd=8))
    assert gpt.lm_head.weight is gpt.transformer.wte.weight              # still tied
    hooked = []
    awd.decoder.register_forward_hook(lambda *a: hooked.append(1))
    ids = torch.randint(0, 11, (2, 3))
    chars = torch.randint(1, 20, (2, 3, 6))
    words = torch.randint(0, 13, (2, 3))
    for model, run in ((awd.to(DEVICE), lambda: awd(ids.to(DEVICE), ids.to(DEVICE))[1]),
                       (elmo.to(DEVICE), lambda: elmo(chars.to(DEVICE), words.to(DEVICE)).loss),
                       (gpt.to(DEVICE), lambda: gpt(ids.to(DEVICE), ids.to(DEVICE))[1])):
        for backend, used in (("ctxfast", True), ("eager", False)):
            model.set_backend(backend)
            shapes.clear()
            with ctxfast.backend("triton"):
                run().backward()
            assert bool(shapes) == used, (type(model).__name__, backend, shapes)
    assert len(hooked) == 2
