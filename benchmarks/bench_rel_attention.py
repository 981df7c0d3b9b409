"""Benchmarks of ``ctxfast.rel_attention`` against the original Transformer-XL
formulation (einsum for AC and the whole ``[Tq, Tk]`` BD, pad-and-view shift, materialised
causal mask, softmax: ``ctxfast.reference.rel_attention_original``), on the same inputs in
the same run.

Backends timed: ``triton`` (CUDA only: on CPU it runs in the interpreter), ``eager``
(``ctxfast.reference.rel_attention``, direct indexing by distance) and the baseline
``eager-original``. Modes ``fwd`` and ``fwd+bwd`` (gradients of q, k, v, r and both biases).
Inputs: ``torch.randn`` (fp32 on CPU, bf16 on CUDA). ``CTXFAST_BENCH_QUICK=1``: small
cases. Full: Transformer-XL shapes (H 16, D 64, Tq 512, memory 512–3072 on CUDA).
FLOPs counted: AC and BD (``4·B·H·(visible pairs)·D`` for the forward, both terms), x3.5
for fwd+bwd as for attention.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Tuple

import pytest
import torch

import _common
import ctxfast
from ctxfast import reference as ref

OP = "rel_attention"
BASELINE = "eager-original"
MODES = ("fwd", "fwd+bwd")
BACKENDS = ("triton", "eager", BASELINE)


class Case(NamedTuple):
    shape: Tuple[int, int, int, int, int]   # B, H, Tq, mem, D
    devices: Tuple[str, ...] = ("cpu", "cuda")

    @property
    def name(self) -> str:                  # "B2 H4 Tq64 mem64 D32"
        return " ".join(f"{k}{v}" for k, v in zip(("B", "H", "Tq", "mem", "D"), self.shape))


QUICK_CASES = (Case((2, 4, 64, 64, 32)),)
FULL_CASES = (
    Case((2, 8, 128, 128, 64), ("cpu",)),
    *(Case((4, 16, 512, mem, 64), ("cuda",)) for mem in (512, 1024, 2048, 3072)),
)


def _params():
    return _common.params(QUICK_CASES, FULL_CASES, MODES, BACKENDS)


def flops(case: Case, mode: str) -> float:
    B, H, Tq, mem, D = case.shape
    visible = Tq * mem + Tq * (Tq + 1) / 2            # causal pairs with memory
    fwd = 2 * 2 * B * H * visible * D + 2 * B * H * visible * D   # AC + BD, then P·V
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


@pytest.mark.parametrize("case, mode, backend", _params())
def test_rel_attention(benchmark, bench_device, case: Case, mode: str, backend: str):
    if backend == "triton" and bench_device.type != "cuda":
        pytest.skip("triton on CPU tensors runs in the interpreter: only timed on CUDA")
    if backend != BASELINE:
        reason = ctxfast.why_unavailable(backend, bench_device)
        if reason is not None:
            pytest.skip(reason)
    B, H, Tq, mem, D = case.shape
    Tk = Tq + mem
    dtype = torch.bfloat16 if bench_device.type == "cuda" else torch.float32
    op = (ref.rel_attention_original if backend == BASELINE
          else functools.partial(ctxfast.rel_attention, backend=backend))

    def make():
        shapes = ((B, H, Tq, D), (B, H, Tk, D), (B, H, Tk, D), (H, Tk, D), (H, D), (H, D))
        ts = tuple(torch.randn(s, device=bench_device, dtype=dtype) for s in shapes)
        if mode == "fwd":
            return ts
        return tuple(t.requires_grad_(True) for t in ts) + (
            torch.randn(B, H, Tq, D, device=bench_device, dtype=dtype),)

    sets = _common.input_sets(make, bench_device)
    with torch.no_grad():                    # check against the reference on a slice
        s0 = [t.detach()[:1] if t.dim() == 4 else t.detach() for t in sets[0][:6]]
        got = op(*s0).float()
        want = ref.rel_attention(*(t.float() for t in s0))
        err = ((got - want).norm() / want.norm()).item()
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), err

    if mode == "fwd":
        def fn(*ts):
            with torch.no_grad():
                return op(*ts)
    else:
        def fn(*ts):
            return torch.autograd.grad(op(*ts[:6]), ts[:6], ts[6])

    v = _common.versions()
    benchmark.group = f"{OP} {case.name} {mode}"
    benchmark.extra_info.update(
        op=OP, case=case.name, mode=mode, backend=backend, dtype=str(dtype).replace("torch.", ""),
        device=str(bench_device), device_name=_common.device_name(bench_device),
        torch=v["torch"], triton=v["triton"], shape=list(case.shape), flops=flops(case, mode))
    quick = _common.quick()
    _common.measure(benchmark, fn, sets, bench_device, budget_s=0.4 if quick else 2.0,
                    min_rounds=5 if quick else 10)
    _common.record_peak_memory(benchmark, fn, sets[0], bench_device)
