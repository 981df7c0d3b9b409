"""ctxfast: fused Triton and CUDA C++ kernels for context-based language models.

Ops (each takes ``backend=``; see :func:`ctxfast.backend`):

* :func:`ctxfast.attention` — fused attention: causal, padding, XLNet permutation masks, memory.
* :func:`ctxfast.attention_varlen` — the same over packed sequences (``cu_seqlens``).
* :func:`ctxfast.rel_attention` — Transformer-XL / XLNet relative attention, shift in-kernel.
* :func:`ctxfast.rel_shift` — the Transformer-XL relative shift.
* :func:`ctxfast.lstm` — fused multi-step LSTM layer: DropConnect mask on w_hh, projection, clips.
* :func:`ctxfast.linear` — ``F.linear`` with float32 on the tensor cores at float32's
  accuracy (tf32x3): a float32 language model's decoder.
* :func:`ctxfast.locked_dropout`, :func:`ctxfast.embedding_dropout` — AWD-LSTM's variational
  and word-level dropouts (plain PyTorch; masks can be given).

Importing ctxfast loads ``ctxfast._C`` (C++ CPU kernels) and, where it was built,
``ctxfast._cuda`` (CUDA C++ kernels); their ops live under ``torch.ops.ctxfast``.
"""
from ._dispatch import BACKENDS, BackendUnavailable, backend, why_unavailable  # noqa: F401 (loads _C first)
from .ops import attention, attention_varlen, lstm, rel_attention, rel_shift
from .ops import embedding_dropout, linear, locked_dropout
from . import nn  # noqa: E402 (modules on the ops)

__version__ = "0.1.0"

__all__ = ["BACKENDS", "BackendUnavailable", "backend", "why_unavailable", "attention", "attention_varlen", "rel_attention", "rel_shift", "lstm",
           "locked_dropout", "embedding_dropout", "linear",
           "__version__"]
