"""Backend selection for every ctxfast op (docs/ARCHITECTURE.md, "Backends and dispatch").

Four backends can implement an op:

=========  =====================================================================
``triton`` ``kernels/`` — CUDA tensors; CPU tensors only under ``TRITON_INTERPRET=1``
``cuda``   ``csrc/cuda`` through ``ctxfast._cuda`` — CUDA tensors, when it was built
``cpu``    ``csrc/cpu`` through ``ctxfast._C`` — CPU tensors
``eager``  ``ctxfast.reference`` — anywhere
=========  =====================================================================

Which one runs, first match wins:

1. the op's ``backend=`` keyword;
2. the innermost ``with ctxfast.backend(name):`` block;
3. the ``CTXFAST_BACKEND`` environment variable (read at each call, a plain
   ``os.environ`` lookup that ``torch.compile`` traces; ``auto`` or empty means unset);
4. the op's default for the tensor's device: the fastest measured backend that can run.

A backend asked for in 1–3 that cannot run raises :class:`BackendUnavailable` saying why;
it is never replaced silently by another one. Only the default (4) picks among those
that can run.

What can only change between processes (is triton installed, is Triton's interpreter on,
did the extensions import) is decided once, when this module is imported: the per-call
path touches no importlib, file or import machinery, which ``torch.compile`` refuses to
trace (torch 2.11's dynamo breaks the graph on ``importlib.util.find_spec``).
``tests/test_dispatch.py`` guards this on a CPU machine.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import threading
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

BACKENDS: Tuple[str, ...] = ("triton", "cuda", "cpu", "eager")

# name -> (supported backends, default order on CPU tensors, default order on CUDA tensors)
_OPS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...], Tuple[str, ...]]] = {}

# Names set by `with ctxfast.backend(...)`: each thread's own stack (what eager calls read),
# and every thread's entries in one plain list (what torch.compile's traced calls read: it
# traces and guards a module-level list; a ContextVar or a thread id is a graph break, and
# a threading.local attribute is traced as a constant, unguarded).
_local = threading.local()
_stack: List[str] = []
_stack_lock = threading.Lock()


class BackendUnavailable(RuntimeError):
    """A backend that was asked for cannot run these inputs (the message says why)."""


# --------------------------------------------------------------------------- extensions

def _import_error(module: str) -> Optional[str]:
    """Why `module` does not import, or None; with the torch it was built for when that
    is not the torch running (an undefined C++ symbol says nothing of the cause)."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        built = build_info().get("torch")
        if built and built != torch.__version__:
            return f"{e} (built for torch {built}, running torch {torch.__version__}: rebuild)"
        return str(e)
    return None


def build_info() -> dict:
    """What setup.py decided (``ctxfast/_build_info.json``), or {} if not recorded."""
    path = os.path.join(os.path.dirname(__file__), "_build_info.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# Decided once, at import (see the module docstring). Triton's interpreter is switched on
# or off when triton is imported, so reading TRITON_INTERPRET later could only disagree.
_TRITON_INSTALLED: bool = importlib.util.find_spec("triton") is not None
_TRITON_INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

_C_ERROR = _import_error("ctxfast._C")
_CUDA_ERROR: Optional[str] = None
if _C_ERROR is None:
    _CUDA_ERROR = _import_error("ctxfast._cuda")  # registers CUDA impls of _C's schemas
else:
    _CUDA_ERROR = "ctxfast._C is missing, so ctxfast._cuda cannot load"


def c_available() -> bool:
    return _C_ERROR is None


def cuda_ext_available() -> bool:
    return _CUDA_ERROR is None


def _compute_cuda_ext_reason() -> str:
    info = build_info()
    if info and not info.get("cuda_built", False):
        return f"ctxfast._cuda was not built: {info.get('cuda_reason', 'unknown reason')}"
    return f"ctxfast._cuda failed to import: {_CUDA_ERROR}"


# Read once (it opens _build_info.json): the per-call path must not touch files.
_CUDA_EXT_REASON: Optional[str] = None if _CUDA_ERROR is None else _compute_cuda_ext_reason()


def _cuda_ext_reason() -> str:
    return _CUDA_EXT_REASON or ""


def _cuda_present() -> bool:
    """torch.cuda.is_available(), which dynamo traces (a seam for the CPU tests that make
    the decision a GPU machine makes)."""
    return torch.cuda.is_available()


#: The oldest GPU architecture the CUDA C++ kernels are built for (setup.py: sm_80 and sm_90
#: machine code, and compute_90 PTX that newer GPUs compile at load). An older GPU (sm_75:
#: T4, RTX 20xx) has no image of them: the backend is unavailable there, so the default
#: falls to the next backend instead of "no kernel image is available" at the launch.
CUDA_MIN_ARCH = (8, 0)
_ARCH_REASONS: dict = {}


def _constant_under_compile(fn):
    """``torch.compiler.assume_constant_result`` without its import of ``torch._dynamo``,
    which made 1.8 s of ``import ctxfast``'s 2.3 (after ``import torch``) on a 2-core CPU
    machine: the decorator only sets this attribute, which dynamo reads when it meets the
    call (tests/test_dispatch.py checks that torch's sets the same, and that a compiled
    call runs `fn` once, while tracing)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile
def _cuda_arch_reason(index: Optional[int]) -> str:
    """"" if the CUDA C++ kernels have an image for GPU `index` (None: the current one),
    else the reason. Asked of the driver once per GPU; torch.compile calls it while tracing
    and keeps the answer as a constant."""
    if index is None:
        index = torch.cuda.current_device()
    if index not in _ARCH_REASONS:
        cap = tuple(torch.cuda.get_device_capability(index))
        _ARCH_REASONS[index] = "" if cap >= CUDA_MIN_ARCH else (
            f"ctxfast's CUDA C++ kernels are built for sm_{CUDA_MIN_ARCH[0]}{CUDA_MIN_ARCH[1]} "
            f"and newer; cuda:{index} is sm_{cap[0]}{cap[1]}")
    return _ARCH_REASONS[index]


def _triton_reason(device: torch.device) -> Optional[str]:
    if not _TRITON_INSTALLED:
        return "triton is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if _TRITON_INTERPRET:
            return None
        return ("Triton kernels need CUDA tensors; CPU tensors run only under the Triton "
                "interpreter (set TRITON_INTERPRET=1 before importing ctxfast; slow, "
                "for tests)")
    return f"Triton kernels do not run on {device.type} tensors"


def why_unavailable(name: str, device: torch.device) -> Optional[str]:
    """None if backend `name` can run on tensors of `device`, else the reason."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    kind = device.type              # read once: each read builds a new str (~0.25 µs)
    if kind == "cuda":
        if name == "cuda" and _CUDA_ERROR is not None:
            return _cuda_ext_reason()
        if not _cuda_present():
            return "no CUDA device here (torch.cuda.is_available() is False)"
    if name == "eager":
        return None
    if name == "cpu":
        if kind != "cpu":
            return f"the cpu backend runs on CPU tensors, got tensors on {device}"
        if _C_ERROR is not None:
            return (f"ctxfast._C failed to import ({_C_ERROR}); rebuild with "
                    "`pip install --no-build-isolation --no-deps -e .` (or without -e)")
        return None
    if name == "cuda":
        if kind != "cuda":
            return f"the cuda backend runs on CUDA tensors, got tensors on {device}"
        if _CUDA_ERROR is not None:
            return _cuda_ext_reason()
        return _cuda_arch_reason(device.index) or None
    return _triton_reason(device)


# --------------------------------------------------------------------------- selection

def register_op(name: str, supported: Sequence[str], cpu_default: Sequence[str],
                cuda_default: Sequence[str]) -> None:
    """Declare op `name`: the backends it has and its default order per device type."""
    for b in (*supported, *cpu_default, *cuda_default):
        if b not in BACKENDS:
            raise ValueError(f"unknown backend {b!r}")
    _OPS[name] = (tuple(supported), tuple(cpu_default), tuple(cuda_default))


def registered_ops() -> Dict[str, Tuple[str, ...]]:
    """{op name: supported backends}."""
    return {k: v[0] for k, v in _OPS.items()}


def _check_name(name: object, source: str) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{source}: unknown backend {name!r}; expected one of "
                         f"{', '.join(BACKENDS)}")
    return name


def requested_backend(backend: Optional[str] = None) -> Tuple[Optional[str], str]:
    """(name, where it came from) of the backend asked for, or (None, '') if none."""
    if backend is not None:
        return _check_name(backend, "backend="), "the backend= argument"
    stack = _stack if torch.compiler.is_compiling() else getattr(_local, "stack", None)
    if stack:
        return stack[-1], "ctxfast.backend(...)"
    env = os.environ.get("CTXFAST_BACKEND")
    if env and (env := env.strip()) and env != "auto":
        return _check_name(env, "CTXFAST_BACKEND"), "CTXFAST_BACKEND"
    return None, ""


def resolve(op: str, device: torch.device, backend: Optional[str] = None) -> str:
    """The backend that op `op` runs on tensors of `device` (see the module docstring)."""
    supported = _OPS[op][0]
    if not isinstance(device, torch.device):
        device = torch.device(device)
    name, source = requested_backend(backend)
    if name is not None:
        if name not in supported:
            raise BackendUnavailable(
                f"ctxfast.{op}: backend {name!r} (from {source}) is not implemented for "
                f"this op; it has {', '.join(supported)}")
        reason = why_unavailable(name, device)
        if reason is not None:
            raise BackendUnavailable(
                f"ctxfast.{op}: backend {name!r} (from {source}) cannot run: {reason}")
        return name
    return default_backend(op, device)


def default_backend(op: str, device: torch.device) -> str:
    """The backend op `op` picks for tensors of `device` when none is asked for."""
    _, cpu_default, cuda_default = _OPS[op]
    if not isinstance(device, torch.device):
        device = torch.device(device)
    order = cuda_default if device.type == "cuda" else cpu_default
    for cand in order:
        if why_unavailable(cand, device) is None:
            return cand
    return "eager"


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run every ctxfast op inside the block on backend `name` (unless a call says
    ``backend=`` itself). Blocks nest; the innermost wins. The block holds for the thread
    that opens it (other threads' calls are not affected), except in code compiled by
    torch.compile, which reads every thread's blocks (the innermost opened last): in
    compiled code run from several threads, pass ``backend=`` instead.

    >>> with ctxfast.backend("eager"):
    ...     y = ctxfast.rel_shift(x)
    """
    name = _check_name(name, "ctxfast.backend")
    if not hasattr(_local, "stack"):
        _local.stack = []
    _local.stack.append(name)
    with _stack_lock:
        _stack.append(name)
    try:
        yield
    finally:
        _local.stack.pop()
        with _stack_lock:          # this thread's entry (blocks of other threads may follow)
            del _stack[len(_stack) - 1 - _stack[::-1].index(name)]
