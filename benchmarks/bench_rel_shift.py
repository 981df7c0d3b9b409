"""Benchmarks of ``ctxfast.rel_shift`` against the eager pad-and-view trick.

For every case (shape of ``x [B, H, Tq, Tk]``) and mode (``fwd``, ``fwd+bwd``) this times
each backend of ``ctxfast.rel_shift`` that can run on the device, and the baseline
``eager-pad-view`` (``ctxfast.reference.rel_shift_pad_view``, the original Transformer-XL
code) on the same inputs in the same run. ``report.py`` turns the pytest-benchmark JSON
into ratios against the baseline.

Inputs are ``torch.randn`` (never zeros: zeros run faster and hide bugs), fp32 on the CPU
and bf16 on CUDA. Each backend's result is checked against the reference before it is
timed. The Triton backend is only timed on CUDA tensors: on the CPU it runs in the
interpreter, far too slowly to mean anything.

``CTXFAST_BENCH_QUICK=1``: small cases (seconds on a CPU). Otherwise: a T sweep
(``x [8, 8, T, 2T]``: Transformer-XL's ``mem_len = tgt_len``) and the Transformer-XL
shapes (WT103 base and enwik8 base score tensors; the big ones only on CUDA).

``extra_info["min_bytes"]``: the least traffic of one call — read x, write out (twice
that for ``fwd+bwd``); the report turns it into GB/s. The shift does no arithmetic.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Tuple

import pytest
import torch

import _common
import ctxfast
from ctxfast import reference as ref

OP = "rel_shift"
BASELINE = "eager-pad-view"
MODES = ("fwd", "fwd+bwd")
BACKENDS = (*ctxfast.BACKENDS, BASELINE)   # triton, cuda, cpu, eager, eager-pad-view


class Case(NamedTuple):
    shape: Tuple[int, int, int, int]   # B, H, Tq, Tk
    devices: Tuple[str, ...] = ("cpu", "cuda")
    series: str = "sweep"              # the line of the speedup plot this case belongs to

    @property
    def name(self) -> str:   # "B2 H4 Tq64 Tk128"
        return " ".join(f"{k}{v}" for k, v in zip(("B", "H", "Tq", "Tk"), self.shape))


QUICK_CASES = (
    Case((2, 4, 64, 128)),
    Case((4, 8, 128, 256)),
)
FULL_CASES = (
    # T sweep with mem = tgt (Tk = 2T); 8 x 8 x 512 x 1024 fp32 is 128 MiB: fits a CPU run
    *(Case((8, 8, T, 2 * T)) for T in (64, 128, 256, 512)),
    Case((60, 10, 150, 300), ("cuda",), "TXL-WT103-base"),     # batch 60, 10 heads, tgt=mem=150
    Case((22, 8, 512, 1024), ("cuda",), "TXL-enwik8-base"),    # batch 22, 8 heads, tgt=mem=512
)


def _params():
    return _common.params(QUICK_CASES, FULL_CASES, MODES, BACKENDS)


def _op(backend: str) -> Callable:
    if backend == BASELINE:
        return ref.rel_shift_pad_view
    return functools.partial(ctxfast.rel_shift, backend=backend)


def _skip_reason(backend: str, device: torch.device):
    """None if `backend` should be timed on `device`, else why not."""
    if backend == BASELINE:
        return None
    if backend == "triton" and device.type != "cuda":
        return ("triton on CPU tensors runs in the Triton interpreter: far too slow to time; "
                "only timed on CUDA")
    return ctxfast.why_unavailable(backend, device)


def _check(op: Callable, backend: str, mode: str, x: torch.Tensor, g: torch.Tensor) -> None:
    """The backend computes rel_shift (the baseline: where it is defined) before timing."""
    if backend == "eager":
        return                                   # it is the reference
    Tq, Tk = x.shape[-2:]
    if backend == BASELINE:                      # junk outside the causal region j <= i + Tk - Tq
        i = torch.arange(Tq, device=x.device).unsqueeze(1)
        j = torch.arange(Tk, device=x.device).unsqueeze(0)
        causal = j <= i + (Tk - Tq)
        with torch.no_grad():
            torch.testing.assert_close(op(x)[..., causal], ref.rel_shift(x)[..., causal],
                                       rtol=0, atol=0)
        return
    if mode == "fwd":
        with torch.no_grad():
            torch.testing.assert_close(op(x), ref.rel_shift(x), rtol=0, atol=0)
    else:
        xg = x.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(op(xg), xg, g)
        torch.testing.assert_close(grad, ref.rel_unshift(g), rtol=0, atol=0)


@pytest.mark.parametrize("case, mode, backend", _params())
def test_rel_shift(benchmark, bench_device, case: Case, mode: str, backend: str):
    reason = _skip_reason(backend, bench_device)
    if reason is not None:
        pytest.skip(reason)

    dtype = torch.bfloat16 if bench_device.type == "cuda" else torch.float32
    op = _op(backend)
    quick = _common.quick()
    B, H, Tq, Tk = case.shape
    nbytes = B * H * Tq * Tk * torch.tensor([], dtype=dtype).element_size()
    _common.describe(
        benchmark, op=OP, case=case.name, mode=mode, backend=backend, dtype=dtype,
        device=bench_device, baseline=BASELINE, shape=list(case.shape), T=Tq,
        series=case.series,
        # least traffic the op needs: read x, write out (and the same again for backward)
        min_bytes=nbytes * (2 if mode == "fwd" else 4),
    )
    torch.manual_seed(0)

    def make():
        x = torch.randn(case.shape, device=bench_device, dtype=dtype)
        if mode == "fwd":
            return (x,)
        return (x.requires_grad_(True), torch.randn_like(x))

    with _common.oom_guard(benchmark, bench_device):
        sets = _common.input_sets(make, bench_device)
        x0 = sets[0][0].detach()
        _check(op, backend, mode, x0, sets[0][1] if mode != "fwd" else torch.randn_like(x0))

        if mode == "fwd":
            def fn(x):
                with torch.no_grad():
                    return op(x)
        else:
            def fn(x, g):
                return torch.autograd.grad(op(x), x, g)

        _common.measure(benchmark, fn, sets, bench_device,
                        budget_s=0.4 if quick else 2.0, min_rounds=5 if quick else 10)
