"""Transformer-XL vs vanilla evaluation profiler (``ctxfast xl-eval``): see
:mod:`ctxfast.eval.xl_eval`. Imported on demand (``from ctxfast.eval import xl_eval``)."""
__all__ = ["xl_eval"]
