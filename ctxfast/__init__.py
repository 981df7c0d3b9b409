"""ctxfast: fused Triton and CUDA C++ kernels for context-based language models.

Ops (each takes ``backend=``; see :func:`ctxfast.backend`):

* :func:`ctxfast.attention` — fused attention: causal, padding, XLNet permutation masks, memory.
* :func:`ctxfast.attention_varlen` — the same over packed sequences (``cu_seqlens``).
* :func:`ctxfast.rel_attention` — Transformer-XL / XLNet relative attention, shift in-kernel.
* :func:`ctxfast.rel_shift` — the Transformer-XL relative shift.

Importing ctxfast loads ``ctxfast._C`` (C++ CPU kernels) and, where it was built,
``ctxfast._cuda`` (CUDA C++ kernels); their ops live under ``torch.ops.ctxfast``.
"""
from ._dispatch import BACKENDS, BackendUnavailable, backend, why_unavailable  # noqa: F401 (loads _C first)
from .ops import attention, attention_varlen, rel_attention, rel_shift
from . import nn  # noqa: E402 (modules on the ops)

__version__ = "0.1.0"

__all__ = ["BACKENDS", "BackendUnavailable", "backend", "why_unavailable", "attention", "attention_varlen", "rel_attention", "rel_shift",
           "__version__"]
