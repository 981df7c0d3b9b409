"""Test setup.

* Without a GPU, Triton kernels run in the interpreter, which must be switched on before
  triton is first imported (the Makefile exports it too).
* Every test starts from its own fixed seed (derived from its name): inputs stay random and
  non-zero, differ between tests, and a failure reproduces; CTXFAST_TEST_SEED=N
  runs the suite on other inputs.
* On a GPU, cuDNN's TF32 setting (which the CUDA LSTM follows for float32) is off in every
  test unless the test turns it on.
"""
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    # CTXFAST_TEST_SEED shifts every seed: run the suite under other inputs.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("CTXFAST_TEST_SEED", "0")))


@pytest.fixture(autouse=True)
def _float32_without_cudnn_tf32():
    """On a GPU the CUDA LSTM's float32 products follow torch's TF32 setting for cuDNN's
    RNNs, as nn.LSTM does (torch's default: TF32). The suite holds float32 to float32 (the
    2x-eager rule against float32 eager): the setting is off in every test, restored
    after; the tests of TF32 turn it on themselves (tests/gpu/test_lstm_gpu.py). Set with
    the legacy flag, which sets conv and RNN alike (reading it raises once they differ)."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = old


@pytest.fixture
def device():
    """The device a test runs on: CUDA when present, else CPU (``utils.DEVICE``, for tests
    that need it at collection time, is the same)."""
    from utils import DEVICE
    return torch.device(DEVICE)


@pytest.fixture
def no_dispatch(monkeypatch):
    """Makes backend dispatch fail: a bad-input test using it proves the op raised its
    error from the input check, before choosing (let alone launching) any kernel."""
    import ctxfast

    def resolve(*args, **kwargs):
        raise AssertionError("dispatch reached before the input check")
    monkeypatch.setattr(ctxfast._dispatch, "resolve", resolve)
