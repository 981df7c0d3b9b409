"""Benchmarks of ``ctxfast.linear`` against ``F.linear`` (its ``eager`` backend) at language
models' decoder sizes.

For every case (``x [M, I] @ weight [N, I]ᵀ + bias``) and mode (``fwd``, ``fwd+bwd``: the
gradients of x, weight and bias) this times the ``triton`` backend (float32 as tf32x3,
three TF32 products a multiply, where torch does not allow TF32: its default) and the
baseline ``eager`` (``F.linear``: cuBLAS's float32 GEMMs on the CUDA cores, what a float32
model's decoder runs, fastai's AWD-LSTM included) on the same inputs in the same run.
``cpu`` and ``cuda`` are ATen's GEMMs, the same calls as eager: not timed again.

Inputs are ``torch.randn`` in float32 (the dtype this op is for; 16-bit GEMMs are cuBLAS's).
Before timing, the triton backend's output and gradients are checked against float64 (the
relative error of each at most 2x eager's plus a float32 floor: the ops' rule). Triton is
only timed on CUDA tensors (the interpreter on a CPU is far too slow to mean anything).

``CTXFAST_BENCH_QUICK=1``: small cases. Otherwise: on CUDA ULMFiT's decoder (B 64 x T 70
rows, 400 -> 60,000 words), the benchmark's ELMo-small softmax (both directions: 2 x 2,560
rows, 128 -> 32,768) and GPT-2's LM head at B 8 x T 1,024 (768 -> 50,257); on a CPU one
decoder of ULMFiT's width at a smaller vocabulary.

``extra_info["flops"]``: ``2·M·I·N`` a product, three products for ``fwd+bwd``.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Tuple

import pytest
import torch

import _common
import ctxfast
from ctxfast import reference as ref

OP = "linear"
BASELINE = "eager"                         # F.linear
MODES = ("fwd", "fwd+bwd")
BACKENDS = ctxfast.BACKENDS                # triton, cuda, cpu, eager
FLOOR = 2e-6                               # float32's floor of the 2x-eager rule (tests)


class Case(NamedTuple):
    shape: Tuple[int, int, int]            # M rows, I in features, N out features
    model: str = ""
    devices: Tuple[str, ...] = ("cpu", "cuda")

    @property
    def name(self) -> str:                 # "ULMFiT decoder M4480 I400 N60000"
        dims = " ".join(f"{k}{v}" for k, v in zip(("M", "I", "N"), self.shape))
        return " ".join(s for s in (self.model, dims) if s)


QUICK_CASES = (Case((256, 64, 1024)),)
FULL_CASES = (
    Case((4480, 400, 8192), "ULMFiT-width decoder", ("cpu",)),
    Case((4480, 400, 60000), "ULMFiT decoder", ("cuda",)),
    Case((5120, 128, 32768), "ELMo-small softmax", ("cuda",)),
    Case((8192, 768, 50257), "GPT-2 LM head", ("cuda",)),
)


def _params():
    return _common.params(QUICK_CASES, FULL_CASES, MODES, BACKENDS)


def _skip_reason(backend: str, device: torch.device):
    """None if `backend` should be timed on `device`, else why not."""
    if backend in ("cpu", "cuda"):
        return "ATen's GEMM, the same call as eager (timed as the baseline)"
    if backend == "triton" and device.type != "cuda":
        return ("triton on CPU tensors runs in the Triton interpreter: far too slow to time; "
                "only timed on CUDA")
    return ctxfast.why_unavailable(backend, device)


def _outputs(op: Callable, x, w, b, g):
    leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
    y = op(*leaves)
    return [y, *torch.autograd.grad(y, leaves, g)]


def _check(op: Callable, x, w, b, g) -> None:
    """Output and every gradient within 2x eager's error against float64 (+ a floor): the
    eager and float64 computations are ``ctxfast.reference.linear``'s."""
    ours = _outputs(op, x, w, b, g)
    same = _outputs(ref.linear, x, w, b, g)
    want = _outputs(ref.linear, *(t.double() for t in (x, w, b)), g.double())
    for name, o, s, r in zip(("out", "grad_x", "grad_weight", "grad_bias"), ours, same, want):
        _common.assert_within_2x_eager(f"linear {name}", o, s, r, FLOOR)


@pytest.mark.parametrize("case, mode, backend", _params())
def test_linear(benchmark, bench_device, case: Case, mode: str, backend: str):
    reason = _skip_reason(backend, bench_device)
    if reason is not None:
        pytest.skip(reason)
    dtype = torch.float32
    M, I, N = case.shape
    _common.describe(benchmark, op=OP, case=case.name, mode=mode, backend=backend, dtype=dtype,
                     device=bench_device, baseline=BASELINE, shape=list(case.shape), T=N,
                     series=case.model or "quick",
                     flops=2 * M * I * N * (1 if mode == "fwd" else 3))
    op = functools.partial(ctxfast.linear, backend=backend)
    torch.manual_seed(0)

    def make():
        x = torch.randn(M, I, device=bench_device, dtype=dtype)
        w = torch.randn(N, I, device=bench_device, dtype=dtype) * I ** -0.5
        b = torch.randn(N, device=bench_device, dtype=dtype) * 0.1
        if mode == "fwd":
            return (x, w, b)
        return (x.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True),
                torch.randn(M, N, device=bench_device, dtype=dtype) / N ** 0.5)

    with _common.oom_guard(benchmark, bench_device):
        sets = _common.input_sets(make, bench_device)
        if backend != BASELINE:
            s0 = sets[0]
            _check(op, *s0[:3], s0[3] if mode != "fwd" else torch.randn(M, N, device=bench_device))

        if mode == "fwd":
            def fn(x, w, b):
                with torch.no_grad():
                    return op(x, w, b)
        else:
            def fn(x, w, b, g):
                return torch.autograd.grad(op(x, w, b), (x, w, b), g)

        _common.measure(benchmark, fn, sets, bench_device,
                        budget_s=0.4 if _common.quick() else 2.0,
                        min_rounds=5 if _common.quick() else 10)
