"""Test setup: without a GPU, Triton kernels run in the interpreter, which must be
switched on before triton is first imported (the Makefile exports it too)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
