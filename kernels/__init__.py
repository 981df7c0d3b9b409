"""Triton kernels of ctxfast (installed as ``ctxfast.kernels``).

Each module holds pure ``@triton.jit`` kernels and their launch helpers; it imports
torch and triton, never ``ctxfast.ops``. Importing a module here imports triton, and
``TRITON_INTERPRET=1`` must be set before that for kernels to run on CPU tensors.
"""
