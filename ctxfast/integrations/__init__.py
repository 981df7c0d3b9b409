"""Bridges to other libraries.

* :mod:`ctxfast.integrations.hf` — ``register()`` makes ``"ctxfast"`` an attention
  implementation of Hugging Face transformers (optional dependency).
"""
__all__ = ["hf"]
