"""Helpers shared by the ops in ``ctxfast.ops``: the float dtypes the ops accept, the
argument checks of attention (which rel_attention extends), backend resolution with the
float64-on-CUDA rule, autocast casting, and the registration of an op's autograd formula
(:func:`register_autograd`). One definition each, imported by the op files.
"""
import functools
import numbers
from typing import Callable, Optional, Union

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false
from torch._functorch.pyfunctorch import \
    retrieve_all_functorch_interpreters as _functorch_interpreters

from .. import _dispatch

_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def check_float_tensor(op: str, name: str, t) -> None:
    """`t` (argument `name` of `op`) is a tensor of one of FLOAT_DTYPES, else TypeError."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float16, bfloat16, float32 or float64, "
                        f"got {t.dtype}")


def check_qkv(op: str, q, k, v, layout: str) -> None:
    """Types, rank (that of `layout`, e.g. "[B, H, T, D]"), dtype and device of q, k, v."""
    rank = layout.count(",") + 1
    if (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
            and q.dim() == rank and k.dim() == rank and v.dim() == rank):
        dt = q.dtype
        if dt in FLOAT_DTYPES and dt == k.dtype and dt == v.dtype:
            dev = q.device
            if dev == k.device and dev == v.device:
                return      # the common case, in one pass; the loop below says what is wrong
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            check_float_tensor(op, name, t)
        if t.dim() != rank:
            raise ValueError(f"{op}: {name} must have shape {layout} (rank {rank}), got "
                             f"shape {shape(t)}")
        check_float_tensor(op, name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v must be on one device, got {q.device}, "
                         f"{k.device}, {v.device}")


def check_dropout_scale(op: str, dropout_p, scale) -> None:
    """dropout_p a number in [0, 1) and scale None or a number (bools neither), named by
    `op` in the error."""
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool):
        raise TypeError(f"{op}: dropout_p must be a float in [0, 1), got "
                        f"{type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p}")
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)):
        # (numbers.Real: Python's and NumPy's ints and floats, np.float32 included)
        raise TypeError(f"{op}: scale must be a float or None, got {type(scale).__name__}")


def check_attention(q, k, v, causal, key_padding_mask, perm_rank, perm_stream, dropout_p, scale,
                    op: str = "attention"):
    check_qkv(op, q, k, v, "[B, H, T, D]")
    qs, ks, vs = q.shape, k.shape, v.shape
    B, H, Tq, D = qs
    Tk = ks[2]
    if ks[0] != B or ks[1] != H or ks[3] != D:
        raise ValueError(f"{op}: k must have shape [B, H, Tk, D] = [{B}, {H}, Tk, {D}] "
                         f"to match q {shape(q)}, got {shape(k)}")
    if vs[0] != B or vs[1] != H or vs[2] != Tk or vs[3] != D:
        raise ValueError(f"{op}: v must have shape [B, H, Tk, D] = {list(k.shape)} to "
                         f"match k (head dims of q, k, v must agree), got {shape(v)}")
    if (causal or perm_rank is not None) and Tk < Tq:
        raise ValueError(f"{op}: with causal or perm_rank the keys are [memory; current], "
                         f"so Tk >= Tq is needed; got q {shape(q)}, k {shape(k)}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(f"{op}: key_padding_mask must be a bool tensor [B, Tk] "
                            "(True = padding)")
        if shape(key_padding_mask) != (B, Tk):
            raise ValueError(f"{op}: key_padding_mask must have shape [B, Tk] = "
                             f"[{B}, {Tk}], got {shape(key_padding_mask)}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"{op}: key_padding_mask must be on {q.device}, got "
                             f"{key_padding_mask.device}")
    if perm_rank is not None:
        if (not isinstance(perm_rank, Tensor) or perm_rank.dtype.is_floating_point
                or perm_rank.dtype.is_complex or perm_rank.dtype == torch.bool):
            raise TypeError(f"{op}: perm_rank must be an integer tensor [B, Tq], got "
                            f"{getattr(perm_rank, 'dtype', type(perm_rank).__name__)}")
        if shape(perm_rank) != (B, Tq):
            raise ValueError(f"{op}: perm_rank must have shape [B, Tq] = [{B}, {Tq}], "
                             f"got {shape(perm_rank)}")
        if perm_rank.device != q.device:
            raise ValueError(f"{op}: perm_rank must be on {q.device}, got {perm_rank.device}")
    if perm_stream not in ("content", "query"):
        raise ValueError(f"{op}: perm_stream must be 'content' or 'query', got "
                         f"{perm_stream!r}")
    check_dropout_scale(op, dropout_p, scale)


def softmax_scale(D: int, scale) -> float:
    """The softmax scale of an attention call: ``scale``, or ``D ** -0.5`` (1 for D = 0,
    where every score is 0 and the output has no columns)."""
    if scale is not None:
        return float(scale)
    return float(D ** -0.5) if D > 0 else 1.0


#: Devices whose tensors' values (ids, labels, mask entries) the models and ops check
#: before they run. Reading a CUDA tensor's values is a host-device synchronisation: the
#: host waits for every kernel queued before it, and a training step's forward paid it 2-7
#: times (one model to the next) before this rule. On a GPU an id or label out of range is
#: caught by torch's own device-side assert instead (embedding, cross_entropy).
VALUE_CHECK_DEVICES = ("cpu",)


def values_checked(t: Tensor) -> bool:
    """Whether the models and ops check the values of ``t``: a tensor with elements on a
    device of :data:`VALUE_CHECK_DEVICES`, outside torch.compile (a graph break there)."""
    return (t.device.type in VALUE_CHECK_DEVICES and t.numel() > 0
            and not torch.compiler.is_compiling())


def check_int32_ids(op: str, **ids) -> None:
    """The Triton kernels read ranks and segment ids as int32: a wider integer tensor (e.g.
    int64, torch.randperm's) whose values do not fit is refused where its values are checked
    (:func:`values_checked`; on a GPU that would cost a host sync per call: documented
    instead). None entries are skipped."""
    for name, t in ids.items():
        if t is None or t.dtype in (torch.int32, torch.int16, torch.int8, torch.uint8,
                                    torch.bool) or not values_checked(t):
            continue
        lo, hi = int(t.min()), int(t.max())
        if lo < -2**31 or hi >= 2**31:
            raise ValueError(f"{op}: the triton backend reads {name} as int32; its values "
                             f"must lie in [-2**31, 2**31), got {lo}..{hi}")


def uniform(shape, generator: Optional[torch.Generator], device) -> Tensor:
    """``torch.rand(shape)`` on ``device``, from ``generator`` where one is given. Without
    one, ``generator=`` is left out: torch.rand's generator overload refuses sizes that
    ``torch.compile(dynamic=True)`` traces (torch 2.13)."""
    if generator is None:
        return torch.rand(shape, device=device)
    return torch.rand(shape, generator=generator, device=device)


def check_int32_extent(op: str, **tensors) -> None:
    """The Triton attention kernels address each tensor with 32-bit offsets from its first
    element (Triton passes a stride below 2**31 as i32, and ``b * stride_b`` is i32), and
    write outputs and gradients of the same sizes contiguously: a tensor with 2**31 or more
    elements, or whose last element lies 2**31 or more elements past its first, is refused
    before anything is allocated or launched (it would read and write the wrong memory).
    None entries are skipped."""
    for name, t in tensors.items():
        if t is None or guard_or_false(t.numel() == 0):
            continue
        numel = t.numel()
        extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        if guard_or_false(numel >= 2**31) or guard_or_false(extent >= 2**31):
            raise ValueError(
                f"{op}: the triton backend addresses {name} with 32-bit offsets; {name} of "
                f"shape {tuple(t.shape)} has {numel} elements spanning {extent}, both must "
                f"be below 2**31 (split the batch, or use backend='eager')")
        # sizes traced from data (torch.compile of a packed batch): checked when the graph runs
        torch._check(numel < 2**31, lambda: f"{op}: {name} must have below 2**31 elements")
        torch._check(extent < 2**31, lambda: f"{op}: {name} must span below 2**31 elements")


# The Triton kernels keep a whole head-dim row of q, k, v and the output accumulator in one
# program (BLOCK_D = next power of two >= D): beyond 256 they exceed a GPU's registers and
# shared memory. The eager backend has no such limit.
MAX_HEAD_DIM = 256


def resolve(op: str, q: Tensor, backend: Optional[str]) -> str:
    """``_dispatch.resolve``, except where the Triton kernels cannot run what was asked:

    * float64 on CUDA (the kernels keep fp32 softmax statistics and do not compile for
      float64 on a GPU; the interpreter runs them, for the CPU tests);
    * a head dim ``D = q.shape[-1]`` above ``MAX_HEAD_DIM``.

    By default these run on eager; asking for triton explicitly is an error, raised before
    anything runs. Shared by attention, attention_varlen and rel_attention."""
    name = _dispatch.resolve(op, q.device, backend)
    if name != "triton":
        return name
    shape_ = getattr(q, "shape", None)
    D = shape_[-1] if shape_ is not None and len(shape_) else None
    if q.dtype == torch.float64 and q.device.type == "cuda":
        why = ("cannot run float64 on CUDA (the kernels keep float32 statistics and are not "
               "compiled for float64); use backend='eager' for float64")
    elif D is not None and D > MAX_HEAD_DIM:
        why = (f"supports head dims D <= {MAX_HEAD_DIM} (a whole row of q, k, v is held per "
               f"program), got D = {D}; use backend='eager' for larger heads")
    else:
        return name
    asked, source = _dispatch.requested_backend(backend)
    if asked is not None:
        raise _dispatch.BackendUnavailable(f"ctxfast.{op}: backend 'triton' (from {source}) {why}")
    return "eager"


def autocast(*tensors):
    """Under torch.autocast, run in the autocast dtype, as F.scaled_dot_product_attention
    does (it is on autocast's lower-precision list): every fp32, fp16 or bf16 tensor among
    `tensors` (the first one's device decides; None and non-tensors pass through) is cast
    to the autocast dtype, so fp32 parameters (e.g. rel_attention's biases) meet
    lower-precision activations. float64 is left alone, as autocast leaves it: float64
    inputs run in float64, and float64 beside fp32 inputs is refused as a dtype mismatch."""
    if not torch._C._is_any_autocast_enabled():     # one C call, ~0.15 µs (dynamo folds it)
        return tensors
    first = tensors[0] if tensors else None
    if not isinstance(first, Tensor):
        return tensors
    dev = first.device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return tensors
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if isinstance(t, Tensor) and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in tensors)


_below_autograd = torch._C._AutoDispatchBelowAutograd


def on_tensor_device(fn: Callable) -> Callable:
    """`fn` (a Triton op's function) run with its first tensor argument's CUDA device as the
    current device. Triton launches on the current device and its current stream, whatever
    device the pointers are on: tensors on ``cuda:1`` while ``cuda:0`` is current gave an
    illegal memory access or "cannot be accessed from Triton" where torch's own ops work
    (torch and the C++ ops switch to the tensor's device). A call on the current device, or
    on the CPU (the interpreter), adds one device query."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t = next((a for a in args if isinstance(a, Tensor)), None)
        if (t is not None and t.device.type == "cuda"
                and t.device.index != torch.cuda.current_device()):
            with torch.cuda.device(t.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    run.on_tensor_device = True
    return run


def _plain(args) -> bool:
    """True when an eager call may skip the dispatcher and run the op's Python function
    (:func:`_impl`): no Python dispatch mode or torch-function mode is active (FakeTensor,
    FlopCounter, ``with torch.device(...)`` are such modes) and every tensor argument is a
    plain ``torch.Tensor`` (no subclass, no functorch wrapper: ``torch.func.vjp``'s function
    runs the backward on the ended transform's wrapped tensors, whose storage the kernels
    cannot read) off the meta device. Otherwise the call goes through the dispatcher, which
    those need to see it (it unwraps an ended transform's tensors)."""
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    return all(type(a) is Tensor and not a.is_meta and not _functorch_wrapped(a)
               for a in args if isinstance(a, Tensor))


_IMPLS: dict = {}


def _impl(op) -> Optional[Callable]:
    """The Python function of a ``torch.library.custom_op`` given its ``torch.ops`` object
    (packet or overload), or None (a C++ op, or a torch without the registry). Calling it
    directly costs what the function costs: through the dispatcher a custom op adds ~20 µs
    a call on a CPU (torch 2.13: its backend wrapper, the dynamo-disable frame, the
    output-alias check), a floor under every small Triton call on a GPU."""
    key = getattr(op, "_qualified_op_name", None) or getattr(op, "name", lambda: None)()
    if key not in _IMPLS:
        from torch._library import custom_ops
        opdef = getattr(custom_ops, "OPDEFS", {}).get(str(key).split(".")[0])
        _IMPLS[key] = getattr(opdef, "_init_fn", None)
    return _IMPLS[key]


def _call_below_autograd(op, args):
    """``op(*args)`` with the dispatcher starting below the autograd key, or the op's Python
    function itself where nothing else must see the call (:func:`_plain`)."""
    fn = _impl(op)
    if fn is not None and _plain(args):
        return fn(*args)
    with _below_autograd():
        return op(*args)

_FORWARD_AD_MSG = ("torch.ops.ctxfast.{}: forward-mode AD ({}) is not supported: the op has no "
                   "forward-derivative formula, and the tangent of its output would be "
                   "silently dropped or zero. Use reverse mode (backward, torch.func.grad, "
                   "torch.func.vjp), or backend='eager' for forward mode.")


def _refuse_forward_ad(name: str, args) -> None:
    """Inside ``torch.autograd.forward_ad.dual_level()``: raise if an input carries a
    tangent (PyTorch would drop it without a word)."""
    if any(isinstance(a, Tensor) and _forward_ad.unpack_dual(a).tangent is not None
           for a in args):
        raise NotImplementedError(_FORWARD_AD_MSG.format(name, "a dual tensor"))


def _refuse_jvp(name: str, args) -> None:
    """Under ``torch.func.jvp`` (or jacfwd, hessian): raise if an input is one of the
    transform's wrapped tensors (PyTorch would give a zero tangent without a word)."""
    if not any(i.key() == torch._C._functorch.TransformType.Jvp
               for i in _functorch_interpreters()):
        return
    if any(isinstance(a, Tensor) and torch._C._functorch.is_gradtrackingtensor(a)
           for a in args):
        raise NotImplementedError(_FORWARD_AD_MSG.format(
            name, "torch.func.jvp, jacfwd or hessian"))


def call_in_backward(op: Callable, *args, name: Optional[str] = None):
    """Call a ctxfast backward op from an autograd formula. In a plain backward (grad mode
    off: no ``create_graph``), outside ``torch.compile`` and functorch transforms, the
    dispatcher starts below the autograd key: a ``torch.library.custom_op``'s own autograd
    kernel would only pass the call on, in Python (~50 µs a call measured on a CPU, torch
    2.13; a floor under every small attention backward on a GPU).

    Under functorch transforms (``torch.func.grad``, ``vjp``, ``jacrev``, ``vmap`` of them)
    the op runs with grad mode off: a custom op's autograd kernel is an
    ``autograd.Function`` without ``setup_context``, which the transforms refuse with an
    error that names no op ("must override the setup_context staticmethod"), and the
    backward ops have no derivative anyway. A gradient of the gradient (two grad
    transforms, e.g. ``grad(grad(f))``) is refused by the public op's `name` instead, as
    :func:`first_order_only` refuses it in eager code."""
    if torch.compiler.is_compiling():
        return op(*args)
    if torch._C._are_functorch_transforms_active():
        grads = [i for i in _functorch_interpreters()
                 if i.key() == torch._C._functorch.TransformType.Grad]
        if len(grads) > 1:
            raise NotImplementedError(
                f"{name or op}: a second derivative (the gradient of its gradient: nested "
                "torch.func.grad / vjp / jacrev) is not implemented")
        with torch.no_grad():
            return op(*args)
    if torch.is_grad_enabled():
        return op(*args)
    return _call_below_autograd(op, args)


class GradCall:
    """Calls a ctxfast op; where eager code needs its gradient, the op's autograd formula
    (the `backward` and `setup_context` given to :func:`register_autograd`) is applied by
    a plain ``torch.autograd.Function`` around the op's no-grad call.

    Why: the formula registered with ``torch.library.register_autograd`` runs, on every
    call in grad mode, a Python loop that reads the op's schema once per argument
    (``torch._library.utils.fill_defaults``): measured 21 / 49 / 111 / 151 µs per call at
    2 / 10 / 19 / 24 schema arguments (torch 2.13, CPU; ``benchmarks/NOTES.md``), before
    any kernel runs; the rel_attention forwards have 19. Here the same formula costs an
    ``autograd.Function.apply``. Under functorch transforms (``torch.func.grad``, ...) a
    second Function with a ``setup_context`` staticmethod applies it (that style costs an
    ``inspect.signature`` per call, so plain eager code does not take it). Under
    ``torch.compile`` the op is called as is, and its registered formula (the same two
    functions) applies; in eager code with nothing to differentiate the dispatcher starts
    below the autograd key.
    """

    def __init__(self, name: str, backward: Callable, setup_context: Callable,
                 fast: Optional[Callable] = None):
        self.name = name
        op = self.op = getattr(torch.ops.ctxfast, name).default
        # the same formula as a C++ autograd Function (an op with an Autograd kernel), where
        # the op has one: plain eager code with something to differentiate takes it
        self.fast = fast

        def forward(ctx, *args):
            # grad mode is off here: the op's registered autograd kernel would only pass the
            # call on (~6-12 µs); the dispatcher starts below it, or is skipped
            output = _call_below_autograd(op, args)
            setup_context(ctx, args, output)
            return output

        self.function = type(f"{name}_grad", (torch.autograd.Function,), {
            "forward": staticmethod(forward), "backward": staticmethod(backward)})
        self.transformable = type(f"{name}_func", (torch.autograd.Function,), {
            "forward": staticmethod(lambda *args: op(*args)),
            "setup_context": staticmethod(lambda ctx, inputs, output:
                                          setup_context(ctx, inputs, output)),
            "backward": staticmethod(backward),
            # vmap over forward and backward as written (the ops run per sample
            # through functorch's fallback): per-sample gradients, vmap(grad(...))
            "generate_vmap_rule": True})

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        if _forward_ad._current_level >= 0:     # inside a dual_level() block
            _refuse_forward_ad(self.name, args)
        if torch._C._are_functorch_transforms_active():
            _refuse_jvp(self.name, args)
            if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad
                                               for a in args):
                return self.transformable.apply(*args)
            return self.op(*args)
        if (torch.is_grad_enabled()
                and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
            if self.fast is not None:
                return self.fast(*args)
            return self.function.apply(*args)
        # Nothing to differentiate: the registered autograd formula would only pass the
        # call on (a Python function, ~6 µs a call on a CPU); the dispatcher starts below
        # it, or is skipped. Python dispatch modes and tensor subclasses still see the op.
        return _call_below_autograd(self.op, args)


class _SecondDerivative(torch.autograd.Function):
    """The identity on a gradient that :func:`first_order_only` computed, made a function
    of what it depends on (``anchors``: the tensors that need a gradient among the upstream
    gradients and the op's saved inputs), whose derivative raises NotImplementedError
    naming the op."""

    @staticmethod
    def forward(ctx, name, x, *anchors):
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{ctx.name}: a second derivative (the gradient of its gradient: "
            "create_graph=True, then a gradient through the first) is not implemented")


def first_order_only(name: str, backward: Callable) -> Callable:
    """An autograd formula `backward` of op `name` for a backward taken with
    ``create_graph=True``: the gradients are computed as in any backward, and the
    derivative of each raises NotImplementedError naming the op when one is taken (as
    ``torch.autograd.function.once_differentiable``, also where only the op's inputs, not
    the upstream gradient, need a gradient). The backward ops have no derivative of their
    own: without this a C++ one (no Autograd kernel) gave silent zeros there, with a
    warning, and a custom op raised at the first backward. Under functorch transforms and
    torch.compile the formula runs as it is."""
    def run(ctx, *grads):
        if (not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or torch._C._are_functorch_transforms_active()):
            return backward(ctx, *grads)
        # what the gradients depend on: the upstream gradients and the op's saved inputs
        anchors = [t for t in (*grads, *ctx.saved_tensors)
                   if isinstance(t, Tensor) and t.requires_grad]
        with torch.no_grad():
            out = backward(ctx, *grads)
        if not anchors:
            return out
        return tuple(_SecondDerivative.apply(name, g, *anchors) if isinstance(g, Tensor)
                     else g for g in out)
    return run


def register_autograd(op: Union[str, Callable], backward: Callable,
                      setup_context: Callable, fast: Optional[Callable] = None, *,
                      first_order: Optional[str] = None) -> GradCall:
    """``torch.library.register_autograd(op, backward, setup_context=setup_context)`` for
    `op` (``"ctxfast::name"`` of a C++ op, or a ``torch.library.custom_op``), and the
    :class:`GradCall` of ``torch.ops.ctxfast.name`` that the op's Python function calls.
    Every argument is passed positionally (setup_context receives them all). `fast`: the
    same op and formula with a C++ autograd kernel, which GradCall takes in plain eager code
    with something to differentiate (:class:`GradCall`). `first_order`: the public op's
    name, where `backward` has no derivative (:func:`first_order_only`)."""
    if first_order is not None:
        backward = first_order_only(first_order, backward)
    if isinstance(op, str):
        torch.library.register_autograd(op, backward, setup_context=setup_context)
        name = op.split("::")[-1]
    else:
        op.register_autograd(backward, setup_context=setup_context)
        name = op._name.split("::")[-1]
    return GradCall(name, backward, setup_context, fast)
