"""Helpers shared by the tests: comparisons that say where and how much they failed."""
import os
from typing import Optional

import torch

import ctxfast

# Backends that can run on CPU tensors in this process.
CPU_BACKENDS = [b for b in ctxfast.BACKENDS if ctxfast.why_unavailable(b, "cpu") is None]
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"

# Relative-error bounds from DESIGN.md §4 (‖out − ref‖ / ‖ref‖).
REL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def _where(out: torch.Tensor, ref: torch.Tensor) -> str:
    diff = (out.double() - ref.double()).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    n_bad = int((diff > 0).sum())
    return (f"{n_bad} of {diff.numel()} elements differ; worst at index {idx}: "
            f"out={out[idx].item()!r} ref={ref[idx].item()!r}")


def assert_equal(out: torch.Tensor, ref: torch.Tensor, name: str = "out") -> None:
    """Bit-exact comparison (for ops that only move data), with a diagnostic."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != {ref.dtype}"
    if not torch.equal(out, ref):
        raise AssertionError(f"{name}: not equal to the reference: {_where(out, ref)}")


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: Optional[float] = None,
                 name: str = "out") -> None:
    """‖out − ref‖ / ‖ref‖ <= tol (default from the dtype of `out`); NaN never passes."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    tol = REL_TOL[out.dtype] if tol is None else tol
    assert not torch.isnan(out).any(), f"{name}: NaN in output: {_where(out, ref)}"
    err = rel_err(out, ref)
    if not err <= tol:
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.1e}; {_where(out, ref)}")


def assert_param_grads_close(fast: "torch.nn.Module", eager: "torch.nn.Module") -> None:
    """Every parameter of `fast` has a non-zero gradient equal (assert_close) to the one of
    the same name in `eager` — for models run on two backends after a backward."""
    g = {n: p.grad for n, p in fast.named_parameters()}
    g_e = {n: p.grad for n, p in eager.named_parameters()}
    assert g.keys() == g_e.keys(), f"parameter names differ: {sorted(g.keys() ^ g_e.keys())}"
    for name in g:
        assert g[name] is not None and g_e[name] is not None, f"{name}: no gradient"
        assert g[name].abs().sum() > 0, f"{name}: zero gradient"
        assert_close(g[name], g_e[name], name=f"grad {name}")
