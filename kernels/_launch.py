"""A shorter host path from a launcher to a compiled Triton kernel, on a GPU.

``kernel[grid](*args, **kwargs)`` runs ``JITFunction.run`` (Triton 3.6-3.9) at every launch:
it reads the current device and stream, specialises every argument (its type; for a tensor
its dtype and whether its address is a multiple of 16; for an int whether it is 1, its range
and whether it is a multiple of 16), hashes that with the options into a cache key, looks up
the compiled kernel, checks the globals the kernel read, builds launch metadata for the
launch hooks, and only then calls the compiled kernel's launcher. On the H200 machine that
took ~88 us of host time per launch (``benchmarks/results/nvidia-h200/2026-11-26-round2/
host_profile.log``: attention's forward + backward makes 4 launches, rel_attention's 5),
while the kernels of a GPT-2-size call take ~150 us in all: at short sequences the launches,
not the kernels, set the time.

:func:`fast` wraps a kernel so that the launch goes the same way on a first call (Triton's
own path: compile or cache lookup, launch) and remembers the compiled kernel under a key
that is at least as fine as Triton's own specialisation, so that a later call whose key
matches is one that Triton would have given the same compiled kernel:

* a tensor: its dtype and whether ``data_ptr() % 16 == 0``;
* an int (not a bool): 1, or else its range (i32 / i64 / u64) and whether it is a multiple
  of 16 -- the classes ``native_specialize_impl`` uses (``tests/test_launch.py`` checks the
  implication against it);
* any other value (float, bool, None, a string): its type and its value;
* a positional argument of a ``tl.constexpr`` parameter, and every keyword argument
  (constexprs, ``num_warps``, ``num_stages``): the value;
* the current device, and the Triton knobs that enter the options (``debug``,
  ``instrumentation_mode``, and with Triton 3.9 ``fpsan_homomorphic_casts``).

The per-argument part is one C call (``ctxfast._C.launch_key``; a Python loop where the
extension is not built cost about as much as it saved). A matching call then reads the
current stream and calls the launcher directly with the arguments in parameter order,
exactly as ``JITFunction.run`` passes them (``*bound_args.values()``: positional arguments,
then every later parameter from the keywords or its default). Triton's path is taken instead whenever a launch hook is set
(profilers such as proton), the kernel has pre-run hooks, a global the kernel read has
changed (Triton raises then), or the grid is not a tuple; and for good, with a warning, if a
launcher ever refuses the arguments (a Triton release this path does not match). ``CTXFAST_TRITON_LAUNCH=jit`` (at
import) or ``LAUNCH = "jit"`` turns the fast path off; under the interpreter it is never on.

Every launch on either path passes :data:`OPTIONS`, Triton compile options that ctxfast's
kernels rely on, unless the call gives its own: ``enable_fp_fusion=True``. Triton 3.6-3.9
fuse ``a * b + c`` into one FMA by default; 3.9 warns that 3.10 will not (its
``TRITON_DEFAULT_FP_FUSION``), and without fusion the attention backward's exponent
``s · scale − lse`` and ``P ∘ (dP − Δ)`` become a multiply and an add each (the sm_90 PTX of
the D 64 dQ kernel: 64 ``fma.rn.f32`` a thread and tile, none without fusion; 64 more
multiplies and adds, and ptxas fuses nothing else).
Host time before the launcher, measured on a CPU (``benchmarks/launch_overhead.py``): ~44
us per launch through Triton, ~7.6 through the fast path.
"""
import contextlib
import importlib
import inspect
import os
import threading
import warnings

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from . import _interpreter
from ._common import _interpreting

#: "fast" (default): :func:`fast` returns the wrapper; "jit": the kernel itself (every
#: launch through ``JITFunction.run``). From ``CTXFAST_TRITON_LAUNCH`` at import.
LAUNCH = os.environ.get("CTXFAST_TRITON_LAUNCH", "fast")

#: Compiled kernels remembered per wrapped kernel; past this many keys (calls whose shapes
#: keep changing the int classes or alignments) the table starts again.
MAX_KEYS = 256

#: Triton compile options every launch passes unless the call names them (module docstring).
OPTIONS = {"enable_fp_fusion": True}

_LOCAL = threading.local()

_I32_LO, _I32_HI = -(1 << 31), 1 << 31
_I64_LO, _I64_HI = -(1 << 63), 1 << 63
_MISSING = object()


def arg_key(a):
    """The key of one non-constexpr argument (module docstring). Exposed for the tests."""
    if isinstance(a, torch.Tensor):
        return a.dtype, not a.data_ptr() & 15
    if type(a) is int:
        if a == 1:
            return 16
        aligned = (a & 15) == 0
        if _I32_LO <= a < _I32_HI:
            return 2 | aligned
        return (4 | aligned) if _I64_LO <= a < _I64_HI else (8 | aligned)
    return type(a), a


def _args_key_py(args):
    return tuple([arg_key(a) for a in args])


def _c_args_key():
    """ctxfast._C.launch_key (the same classes in C, ~20x faster), or None if not built."""
    try:
        return importlib.import_module("ctxfast._C").launch_key
    except (ImportError, AttributeError):
        return None


#: The key of a call's positional arguments: one entry per argument, with arg_key's
#: classes (ctxfast._C.launch_key encodes them as small ints; the Python loop is the
#: fallback where the extension is not built).
args_key = _c_args_key() or _args_key_py


def _knob_state():
    """The knob values that enter Triton's options, or None when a hook is set (the launch
    then goes through Triton, which calls the hooks with its launch metadata)."""
    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and (not hasattr(hook, "calls") or hook.calls):
            return None
    if getattr(rt, "add_stages_inspection_hook", None) is not None:
        return None
    comp = knobs.compilation
    return rt.debug, comp.instrumentation_mode, getattr(comp, "fpsan_homomorphic_casts", None)


@contextlib.contextmanager
def compile_only():
    """Launches on this thread compile their kernel and run nothing: Triton's warm-up
    (``JITFunction.run(warmup=True)``), which leaves the compiled kernel in Triton's cache as
    a launch would. A launcher called in it still allocates and runs its torch ops, on
    outputs no kernel wrote. For compiling a tuner's candidate rows side by side
    (kernels/_tune.py); under the interpreter launches are not wrapped and run."""
    saved = compiling_only()
    _LOCAL.compile_only = True
    try:
        yield
    finally:
        _LOCAL.compile_only = saved


def compiling_only() -> bool:
    """Whether :func:`compile_only` is in force on this thread."""
    return getattr(_LOCAL, "compile_only", False)


_TABLES_LOCK = threading.Lock()


def _warm_up(fn: JITFunction, grid, args, kwargs):
    """Triton's warm-up of ``fn`` (compile, cache, no launch), its per-device tables made
    first under a lock: threads compiling side by side would each make them and keep only
    the last one's compiled kernels (the others compiled again at their first launch)."""
    with _TABLES_LOCK:
        fn.device_caches[_driver_calls()[0]()]
    return fn.run(*args, grid=grid, warmup=True, **kwargs)


_device_stream = None  # (get_current_device, get_current_stream) of Triton's active driver


def _driver_calls():
    global _device_stream
    if _device_stream is None:
        from triton.runtime import driver
        _device_stream = (driver.active.get_current_device, driver.active.get_current_stream)
    return _device_stream


def _runtime_kw_key(value):
    """The key of a keyword argument of a parameter that is not a constexpr: a tensor
    descriptor by its dtype and block (``RowTiles._spec``), a tensor or an int by
    :func:`arg_key`, as Triton specialises them. Never the object: the table would keep the first call's
    tensors alive (a descriptor holds its tensor: k and v of a call on a GPU, for the
    table's life), and a tensor hashed by identity made every call a new key (up to
    :data:`MAX_KEYS` entries, each holding its call's tensors)."""
    spec = getattr(value, "_spec", None)
    if spec is not None:
        return type(value), spec()
    if isinstance(value, torch.Tensor) or type(value) is int:
        return type(value), arg_key(value)
    return value


class FastKernel:
    """``kernel[grid](*args, **kwargs)`` with a remembered compiled kernel (module
    docstring). ``hits`` / ``misses`` count the launches each way."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        params = list(inspect.signature(fn.fn).parameters.values())
        self.names = [p.name for p in params]
        self.defaults = [p.default for p in params]
        constexpr = [getattr(kp, "is_constexpr", False) for kp in fn.params]
        self.constexpr_pos = tuple(i for i, c in enumerate(constexpr) if c)
        self.constexpr_names = frozenset(self.names[i] for i in self.constexpr_pos)
        #: parameters that are not constexprs: passed by keyword (descriptors, DS_SPAN),
        #: keyed by their class (:func:`_runtime_kw_key`), not held by the table
        self.runtime_names = frozenset(self.names) - self.constexpr_names
        self._positional_constexprs = {}  # len(args) -> the constexpr positions among them
        self.cache = {}
        self.hits = 0
        self.misses = 0

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args, kwargs, state):
        """The call's key (module docstring), given the knob state."""
        kw = tuple(kwargs.items())
        if not self.runtime_names.isdisjoint(kwargs):
            kw = tuple((n, _runtime_kw_key(v) if n in self.runtime_names else v)
                       for n, v in kw)
        # the keywords' types too: W=4 and W=4.0 (or True and 1) are equal but Triton
        # compiles each apart (its key is the constexpr's text)
        key = (state, kw, tuple(map(type, kwargs.values())), args_key(args))
        positional = self._positional_constexprs.get(len(args))
        if positional is None:
            positional = self._positional_constexprs[len(args)] = tuple(
                i for i in self.constexpr_pos if i < len(args))
        if positional:  # a constexpr passed by position: its value
            key += tuple((i, type(args[i]), args[i]) for i in positional)
        return key

    def _globals_unchanged(self) -> bool:
        for (name, _), (val, globals_dict) in self.fn.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != val:
                return False
        return True

    def launch(self, grid, args, kwargs):
        kwargs = {**OPTIONS, **kwargs}
        if compiling_only():
            return _warm_up(self.fn, grid, args, kwargs)
        state = _knob_state()
        if state is None or type(grid) is not tuple or self.fn.pre_run_hooks:
            return self.fn[grid](*args, **kwargs)
        current_device, current_stream = _driver_calls()
        device = current_device()
        try:
            key = (device, self.key(args, kwargs, state))
            entry = self.cache.get(key)
        except (TypeError, ValueError):  # an unhashable argument, a tensor with no storage
            return self.fn[grid](*args, **kwargs)   # (none of ours): Triton's own path
        if entry is None or not self._globals_unchanged():
            return self._first(key, grid, args, kwargs)
        kernel, run, function, packed, tail, fresh = entry
        if fresh:   # keyword arguments passed at run time (descriptors): this call's own
            tail = list(tail)
            for i, name in fresh:
                tail[i] = kwargs[name]
        n = len(grid)
        try:
            run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                current_stream(device), function, packed, None, None, None, *args, *tail)
        except (TypeError, SystemError) as e:
            # The launcher refused the arguments before launching anything (its argument
            # parsing): a Triton release whose launcher this path does not match. Say so
            # once, launch through Triton from now on.
            _give_up(e)
            return self.fn[grid](*args, **kwargs)
        self.hits += 1
        return kernel

    def tail(self, args, kwargs):
        """The parameters after the positional ones, in order, from the keywords or their
        defaults (what Triton's binder puts after ``args`` in ``bound_args``); None if one
        has neither."""
        tail = []
        for name, default in zip(self.names[len(args):], self.defaults[len(args):]):
            value = kwargs.get(name, default)
            if value is inspect.Parameter.empty:
                return None
            tail.append(value)
        return tuple(tail)

    def _first(self, key, grid, args, kwargs):
        """Triton's own launch; remember what it launched, with :meth:`tail`. A keyword
        argument of a parameter that is not a constexpr (a tensor descriptor: keyed by its
        dtype and block, as Triton specialises it, not by its tensor) is remembered by
        position and taken from each call's keywords, never from the first call's."""
        self.misses += 1
        kernel = self.fn[grid](*args, **kwargs)
        tail = self.tail(args, kwargs)
        if kernel is None or tail is None:
            return kernel
        if len(self.cache) >= MAX_KEYS:
            self.cache.clear()
        names = self.names[len(args):]
        fresh = tuple((i, name) for i, name in enumerate(names)
                      if name in kwargs and name not in self.constexpr_names)
        if fresh:   # the first call's descriptors (and their tensors) are not kept
            fresh_names = {name for _, name in fresh}
            tail = tuple(None if name in fresh_names else v for name, v in zip(names, tail))
        # The kernel itself is kept: its module is unloaded when it is collected.
        self.cache[key] = (kernel, kernel.run, kernel.function, kernel.packed_metadata, tail,
                           fresh)
        return kernel


class WithOptions:
    """``kernel[grid](*args, **kwargs)`` through Triton's own path, with :data:`OPTIONS`
    (the launch object when the fast path is off)."""

    def __init__(self, fn: JITFunction):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs = {**OPTIONS, **kwargs}
            if compiling_only():
                return _warm_up(self.fn, grid, args, kwargs)
            return self.fn[grid](*args, **kwargs)
        return launch


_WRAPPED = {}


def _give_up(error: BaseException) -> None:
    global LAUNCH
    LAUNCH = "jit"
    warnings.warn(f"ctxfast: the fast Triton launch path failed ({type(error).__name__}: "
                  f"{error}); every launch goes through Triton's JITFunction.run from now on "
                  "(CTXFAST_TRITON_LAUNCH=jit does this from the start)", RuntimeWarning,
                  stacklevel=3)


def fast(kernel):
    """The launch object for ``kernel``: a :class:`FastKernel` for a Triton kernel on the
    GPU path, a :class:`WithOptions` with ``LAUNCH == "jit"``, the kernel itself under the
    interpreter (whose fixes it installs first: ``_interpreter.install``)
    or when ``kernel`` is not a ``JITFunction`` (a test's recorder or spy)."""
    if LAUNCH not in ("fast", "jit"):
        raise ValueError(f"CTXFAST_TRITON_LAUNCH must be 'fast' or 'jit', got {LAUNCH!r}")
    if _interpreting():
        _interpreter.install()
        return kernel
    if not isinstance(kernel, JITFunction):
        return kernel
    if LAUNCH == "jit":
        return WithOptions(kernel)
    # by identity: a JITFunction's own hash is its source's (computed on first use)
    wrapped = _WRAPPED.get(id(kernel))
    if wrapped is None or wrapped.fn is not kernel:
        wrapped = _WRAPPED[id(kernel)] = FastKernel(kernel)
    return wrapped
