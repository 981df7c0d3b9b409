"""Transformer-XL vs vanilla evaluation profiler (``ctxfast xl-eval``). Not yet: see
issue 7."""
__all__: list = []
