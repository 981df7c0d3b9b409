"""Backend selection: backend= > ctxfast.backend(...) > CTXFAST_BACKEND > default; an
explicit backend that cannot run raises and never falls back silently."""
import pytest
import torch

import ctxfast
from ctxfast import _dispatch
from utils import DEVICE, needs_interpreter

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("CTXFAST_BACKEND", raising=False)


def test_default_on_cpu_is_the_cpp_kernel():
    assert _dispatch.resolve("rel_shift", CPU) == "cpu"


def test_precedence(monkeypatch):
    monkeypatch.setenv("CTXFAST_BACKEND", "eager")
    assert _dispatch.resolve("rel_shift", CPU) == "eager"
    with ctxfast.backend("cpu"):
        assert _dispatch.resolve("rel_shift", CPU) == "cpu"              # context beats env
        assert _dispatch.resolve("rel_shift", CPU, "eager") == "eager"   # argument beats context


def test_context_manager_nests_and_restores():
    with ctxfast.backend("eager"):
        with ctxfast.backend("cpu"):
            assert _dispatch.resolve("rel_shift", CPU) == "cpu"
        assert _dispatch.resolve("rel_shift", CPU) == "eager"
        with pytest.raises(KeyError):
            with ctxfast.backend("cpu"):
                raise KeyError("boom")
        assert _dispatch.resolve("rel_shift", CPU) == "eager"
    assert _dispatch.resolve("rel_shift", CPU) == "cpu"


def test_context_manager_holds_for_its_own_thread():
    """A ``ctxfast.backend`` block holds for the thread that opened it: another thread's
    calls keep their own choice (they took it, silently: one list for the process), and
    blocks of two threads that close out of order leave each thread its own. Compiled
    code reads the blocks of every thread (documented) and is guarded on them: a block
    opened after the first call recompiles, not reuses the stale choice."""
    import threading
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def other():
        with ctxfast.backend("eager"):
            seen["inside"] = _dispatch.resolve("rel_shift", CPU)
            entered.set()
            release.wait(30)
        seen["after"] = _dispatch.resolve("rel_shift", CPU)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(30)
    assert _dispatch.resolve("rel_shift", CPU) == "cpu"      # not the other thread's block
    with ctxfast.backend("cpu"):
        release.set()                                         # its block closes inside ours
        assert done.wait(30)
        assert _dispatch.resolve("rel_shift", CPU) == "cpu"
        with ctxfast.backend("eager"):
            assert _dispatch.resolve("rel_shift", CPU) == "eager"
    t.join()
    assert seen == {"inside": "eager", "after": "cpu"}
    assert _dispatch.resolve("rel_shift", CPU) == "cpu" and not _dispatch._stack
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + len(_dispatch.resolve("rel_shift", CPU)), fullgraph=True,
                      backend="eager")
    x = torch.zeros(1)
    assert f(x).item() == len("cpu")
    with ctxfast.backend("eager"):
        assert f(x).item() == len("eager")
    assert f(x).item() == len("cpu")
    torch._dynamo.reset()


def test_blocks_closed_out_of_order_leave_compiled_code_the_open_ones(monkeypatch):
    """Compiled code reads every thread's blocks in one list (the innermost opened last):
    a block that closes while another thread's, opened after it, is still open removes its
    own entry, not the last one."""
    import threading
    entered, release, done = threading.Event(), threading.Event(), threading.Event()

    def other():
        with ctxfast.backend("eager"):
            entered.set()
            release.wait(30)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(30)
    with ctxfast.backend("cpu"):                    # opened after the other thread's block
        assert _dispatch._stack == ["eager", "cpu"]
        release.set()
        assert done.wait(30)
        assert _dispatch._stack == ["cpu"], _dispatch._stack
        with monkeypatch.context() as m:            # what a traced call reads
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            assert _dispatch.requested_backend() == ("cpu", "ctxfast.backend(...)")
    t.join()
    assert not _dispatch._stack


def test_env_auto_means_default(monkeypatch):
    monkeypatch.setenv("CTXFAST_BACKEND", "auto")
    assert _dispatch.resolve("rel_shift", CPU) == "cpu"


def test_backend_is_really_used(monkeypatch):
    """The name chosen is the implementation that runs."""
    calls = []
    real = ctxfast.reference.rel_shift
    monkeypatch.setattr(ctxfast.reference, "rel_shift", lambda x: calls.append(1) or real(x))
    x = torch.randn(3, 4)
    ctxfast.rel_shift(x, backend="cpu")
    assert calls == []
    with ctxfast.backend("eager"):
        ctxfast.rel_shift(x)
    assert calls == [1]


@pytest.mark.parametrize("how", ["argument", "context", "env"])
def test_unknown_backend_names_the_choices(monkeypatch, how):
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="unknown backend 'fast'.*triton, cuda, cpu, eager"):
        if how == "argument":
            ctxfast.rel_shift(x, backend="fast")
        elif how == "context":
            with ctxfast.backend("fast"):
                pass
        else:
            monkeypatch.setenv("CTXFAST_BACKEND", "fast")
            ctxfast.rel_shift(x)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_backend_the_op_does_not_have_is_refused_as_such(device):
    # rel_attention has no cuda backend: asked for (by argument or block), on any device,
    # it is refused as not implemented, before asking whether the device could run it
    for how in ("argument", "block"):
        with pytest.raises(ctxfast.BackendUnavailable,
                           match=r"rel_attention: backend 'cuda' \(from .*\) is not "
                                 r"implemented for this op; it has triton"):
            if how == "argument":
                _dispatch.resolve("rel_attention", torch.device(device), "cuda")
            else:
                with ctxfast.backend("cuda"):
                    _dispatch.resolve("rel_attention", torch.device(device))


def test_cuda_backend_on_cpu_tensor_says_why():
    with pytest.raises(ctxfast.BackendUnavailable, match="backend= argument.*CUDA tensors"):
        ctxfast.rel_shift(torch.randn(3, 4), backend="cuda")


def test_env_backend_that_cannot_run_raises(monkeypatch):
    monkeypatch.setenv("CTXFAST_BACKEND", "cuda")
    with pytest.raises(ctxfast.BackendUnavailable, match="CTXFAST_BACKEND"):
        ctxfast.rel_shift(torch.randn(3, 4))


def test_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    # Triton's interpreter is fixed when triton is imported: dispatch records it at import.
    monkeypatch.setattr(_dispatch, "_TRITON_INTERPRET", False)
    with pytest.raises(ctxfast.BackendUnavailable, match="TRITON_INTERPRET=1"):
        ctxfast.rel_shift(torch.randn(3, 4), backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_reason_without_gpu():
    reason = ctxfast.why_unavailable("cuda", "cuda")
    assert reason is not None
    if torch.version.cuda is None:   # setup.py's reason: the CPU torch, or the skip switch
        assert "not built" in reason and ("CPU build" in reason
                                          or "CTXFAST_SKIP_CUDA_BUILD" in reason), reason


@needs_interpreter
def test_triton_is_never_the_cpu_default():
    """The interpreter is for tests: the default on CPU stays the C++ kernel."""
    assert _dispatch.resolve("rel_shift", CPU) == "cpu"


def test_dispatch_traces_under_torch_compile(monkeypatch):
    """Backend selection (env var, context stack) must not break the graph."""
    monkeypatch.setenv("CTXFAST_BACKEND", "eager")
    torch._dynamo.reset()
    f = torch.compile(lambda x: ctxfast.rel_shift(x) * 2, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 3, 5)
    assert torch.equal(f(x), ctxfast.reference.rel_shift(x) * 2)


def test_arch_reason_is_marked_as_torch_marks_a_constant_result():
    """_dispatch marks _cuda_arch_reason itself (torch's decorator would import dynamo):
    with the attribute torch's own decorator sets, and nothing else."""
    marked = torch.compiler.assume_constant_result(lambda: None)
    assert vars(marked) == {"_dynamo_marked_constant": True}
    assert vars(_dispatch._cuda_arch_reason) == vars(marked)


def test_a_marked_call_runs_once_while_tracing():
    """What the mark buys: dynamo calls the function while tracing and keeps its answer;
    the compiled graph never calls it again (unmarked, its side effect would be replayed on
    every call)."""
    calls = []

    @_dispatch._constant_under_compile
    def reason(index):
        calls.append(index)
        return "" if index is None else "no"

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2 if reason(None) == "" else x, fullgraph=True,
                      backend="eager")
    x = torch.randn(3)
    for _ in range(3):
        assert torch.equal(f(x), x * 2)
    assert calls == [None]


def test_import_leaves_dynamo_unloaded():
    """``import ctxfast`` does not import torch._dynamo (1.8 s of a 2.3 s import on a 2-core
    CPU machine, paid by every fresh process: each test that starts one, each CLI run),
    where ``import torch`` does not either."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "before = 'torch._dynamo' in sys.modules\n"
            "import ctxfast, ctxfast.nn, ctxfast.models\n"
            "print(before, 'torch._dynamo' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    before, after = run.stdout.split()
    assert before == "True" or after == "False", "import ctxfast loaded torch._dynamo"


@pytest.mark.parametrize("op", ["attention", "attention_varlen", "rel_attention"])
def test_float64_on_cuda_never_reaches_the_triton_attention_kernels(monkeypatch, op):
    """They do not compile for float64 on a GPU (tests/test_triton_compile.py found it):
    the default runs float64 CUDA inputs on eager, asking for triton fails before any
    launch; other dtypes and CPU tensors (the interpreter) keep triton. Checked on the
    routing with a stand-in for a CUDA tensor: no GPU needed."""
    from types import SimpleNamespace

    from ctxfast.ops.attention import _resolve
    monkeypatch.setattr(_dispatch, "resolve", lambda *args, **kwargs: "triton")
    cuda = torch.device("cuda")
    assert _resolve(op, SimpleNamespace(device=cuda, dtype=torch.float64), None) == "eager"
    assert _resolve(op, SimpleNamespace(device=cuda, dtype=torch.float32), None) == "triton"
    assert _resolve(op, SimpleNamespace(device=CPU, dtype=torch.float64), None) == "triton"
    with pytest.raises(ctxfast.BackendUnavailable, match="cannot run float64 on CUDA"):
        _resolve(op, SimpleNamespace(device=cuda, dtype=torch.float64), "triton")
    with ctxfast.backend("triton"), pytest.raises(ctxfast.BackendUnavailable, match=op):
        _resolve(op, SimpleNamespace(device=cuda, dtype=torch.float64), None)


# ------------------------------------------------------------------ the per-call path on CUDA
# On the first H100 run, torch.compile broke on every op with CUDA tensors because the
# dispatch called importlib.util.find_spec per call (torch 2.11's dynamo refuses to trace
# it; 2.13 traces it, so a CPU-only compile test did not see it). These tests make the
# CUDA decision run on a CPU machine and fail if it touches the import machinery or files.

def _pretend_cuda(monkeypatch, capability=(9, 0)):
    """A CUDA device (of `capability`, current device 0) is present and ctxfast._cuda
    imported: the decision a GPU machine makes, on this machine."""
    monkeypatch.setattr(_dispatch, "_cuda_present", lambda: True)
    monkeypatch.setattr(_dispatch, "_CUDA_ERROR", None)
    monkeypatch.setattr(_dispatch, "_CUDA_EXT_REASON", None)
    monkeypatch.setattr(_dispatch, "_ARCH_REASONS", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 9), (9, 0), (12, 0)])
def test_the_cuda_backend_needs_a_gpu_its_kernels_are_built_for(monkeypatch, capability):
    # sm_80 and sm_90 machine code and compute_90 PTX (setup.py): an sm_75 GPU has no
    # image, so the backend is unavailable there, by name, and the default moves on
    _pretend_cuda(monkeypatch, capability)
    for index in (None, 1):
        reason = _dispatch.why_unavailable("cuda", torch.device("cuda", index))
        if capability >= (8, 0):
            assert reason is None
            assert _dispatch.resolve("lstm", torch.device("cuda", index)) == "cuda"
        else:
            assert "sm_75" in reason and "sm_80" in reason and f"cuda:{index or 0}" in reason
            with pytest.raises(RuntimeError, match="sm_75"):
                _dispatch.resolve("lstm", torch.device("cuda", index), "cuda")
            assert _dispatch.resolve("lstm", torch.device("cuda", index)) == "triton"
    if capability < (8, 0):
        assert _dispatch.resolve("lstm", torch.device("cpu"), "cpu") == "cpu"


def _forbid_imports_and_files(monkeypatch, files=True):
    import builtins
    import importlib
    import importlib.util

    def forbidden(name):
        def f(*args, **kwargs):
            raise AssertionError(f"{name} called on the per-call dispatch path")
        return f
    monkeypatch.setattr(importlib.util, "find_spec", forbidden("importlib.util.find_spec"))
    if files:   # dynamo itself imports modules and reads source files while tracing
        monkeypatch.setattr(importlib, "import_module", forbidden("importlib.import_module"))
        monkeypatch.setattr(builtins, "open", forbidden("open"))


@pytest.mark.parametrize("op", sorted(_dispatch.registered_ops()))
def test_cuda_dispatch_touches_no_import_machinery_or_files(monkeypatch, op):
    _pretend_cuda(monkeypatch)
    cuda = torch.device("cuda")
    expected = {b: _dispatch.why_unavailable(b, cuda) is None
                for b in _dispatch.registered_ops()[op]}   # computed before the patches
    _forbid_imports_and_files(monkeypatch)
    name = _dispatch.resolve(op, cuda)
    order = _dispatch._OPS[op][2]                    # the op's declared default order on CUDA
    first = next((b for b in order if expected.get(b, b == "eager")), "eager")
    assert name == first, f"{op}: default on CUDA is {name!r}, not the first of {order} " \
        f"that can run ({expected})"
    for b, ok in expected.items():
        if ok:
            assert _dispatch.resolve(op, cuda, b) == b


def test_cuda_dispatch_decision_compiles_fullgraph(monkeypatch):
    """The decision for a CUDA device, traced by dynamo with fullgraph=True: a graph break
    (an untraceable call on the per-call path) fails here."""
    torch._dynamo.reset()   # imports dynamo (which uses find_spec itself) before the patch
    _pretend_cuda(monkeypatch)
    _forbid_imports_and_files(monkeypatch, files=False)
    cuda = torch.device("cuda")
    ops = sorted(_dispatch.registered_ops())

    def f(x):
        names = [_dispatch.resolve(op, cuda) for op in ops]
        return x + len("".join(names))   # the decision feeds the graph

    try:
        out = torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(2))
    finally:
        torch._dynamo.reset()
    monkeypatch.undo()
    assert out.tolist() == [float(len("".join(_resolve_all_cuda(ops)))) ] * 2


def _resolve_all_cuda(ops):
    with pytest.MonkeyPatch.context() as mp:
        _pretend_cuda(mp)
        return [_dispatch.resolve(op, torch.device("cuda")) for op in ops]


@pytest.mark.parametrize("op", ["attention", "attention_varlen", "rel_attention"])
def test_head_dims_above_the_triton_limit_never_reach_the_kernels(monkeypatch, op):
    """The Triton kernels take D <= MAX_HEAD_DIM (256): by default larger heads run on
    eager; asking for triton raises, naming the limit and the D passed, before any launch.
    D = 256 itself keeps triton."""
    from types import SimpleNamespace

    from ctxfast.ops._common import MAX_HEAD_DIM, resolve
    monkeypatch.setattr(_dispatch, "resolve", lambda *args, **kwargs: "triton")
    cuda = torch.device("cuda")

    def q(D, device=cuda):
        return SimpleNamespace(device=device, dtype=torch.float16, shape=(2, 3, 5, D))
    assert MAX_HEAD_DIM == 256
    assert resolve(op, q(256), None) == "triton"
    assert resolve(op, q(257), None) == "eager"
    for device in (cuda, CPU):
        with pytest.raises(ctxfast.BackendUnavailable, match=r"D <= 256.*got D = 320"):
            resolve(op, q(320, device), "triton")


def test_attention_refuses_a_head_dim_above_256_on_triton_before_launch():
    """Through the public op (on this machine's device)."""
    q = torch.randn(1, 1, 2, 264, device=DEVICE)
    with pytest.raises(ctxfast.BackendUnavailable, match=r"D <= 256.*got D = 264"):
        ctxfast.attention(q, q, q, backend="triton")
    out = ctxfast.attention(q, q, q, backend="eager")             # eager has no limit
    assert out.shape == q.shape


def _guard_spies(monkeypatch, current: int):
    """torch.cuda's device query and switch replaced by spies: `current` is the current
    device; the returned list gets the index each `torch.cuda.device(...)` block enters."""
    entered = []

    class _Device:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device", _Device)
    return entered


@pytest.mark.parametrize("current,switched", [(0, [1]), (1, [])])
def test_a_triton_op_runs_on_its_tensors_device(monkeypatch, current, switched):
    # Triton launches on the current device, wherever the pointers are: an op given
    # cuda:1 tensors while cuda:0 is current must switch to cuda:1 for the call (and only
    # then). FakeTensors give a cuda:1 tensor without a GPU.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ctxfast.ops._common import on_tensor_device
    entered = _guard_spies(monkeypatch, current)
    seen = []
    run = on_tensor_device(lambda flag, x, y: seen.append((flag, x.device, y)) or "out")
    with FakeTensorMode():
        x = torch.empty(2, device="cuda:1")
    assert run(True, x, y=3) == "out"
    assert entered == switched and seen == [(True, torch.device("cuda:1"), 3)]


def test_a_triton_op_on_cpu_tensors_queries_no_cuda_device(monkeypatch):
    from ctxfast.ops._common import on_tensor_device

    def no_cuda():
        raise AssertionError("queried the CUDA device for CPU tensors")
    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    assert on_tensor_device(lambda x: x + 1)(torch.ones(2)).tolist() == [2.0, 2.0]


def test_every_python_op_switches_to_its_tensors_device():
    # The ops defined in Python (the Triton ones, and those that launch them) must each
    # be wrapped, or a second GPU crashes them.
    from torch._library import custom_ops
    ops = {k: v for k, v in custom_ops.OPDEFS.items() if k.startswith("ctxfast::")}
    assert "ctxfast::attention_fwd_triton" in ops and len(ops) >= 11
    unguarded = [k for k, d in ops.items() if not getattr(d._init_fn, "on_tensor_device", False)]
    assert unguarded == []
    from ctxfast.ops.attention import dropout_keep_mask
    assert getattr(dropout_keep_mask, "on_tensor_device", False)


def test_an_extension_that_does_not_import_names_the_torch_it_was_built_for(monkeypatch):
    # a module built for another torch fails with an undefined C++ symbol, which says
    # nothing of the cause: the reason (ctxfast info, the cpu backend's refusal) says it
    monkeypatch.setattr(_dispatch, "build_info", lambda: {"torch": "0.0.1"})
    why = _dispatch._import_error("ctxfast._no_such_extension")
    assert "built for torch 0.0.1" in why and torch.__version__ in why
    monkeypatch.setattr(_dispatch, "build_info", lambda: {"torch": torch.__version__})
    assert "built for" not in _dispatch._import_error("ctxfast._no_such_extension")
    assert _dispatch._import_error("ctxfast._dispatch") is None
