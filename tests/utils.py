"""Helpers shared by the tests: comparisons that say where and how much they failed."""
import os
from typing import Optional

import pytest
import torch

import ctxfast

# Backends that can run on CPU tensors in this process.
CPU_BACKENDS = [b for b in ctxfast.BACKENDS if ctxfast.why_unavailable(b, "cpu") is None]
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"

# The device every test runs on: CUDA when present, else CPU (conftest's `device` fixture
# returns it). Tests that need the Triton interpreter skip on CUDA with `needs_interpreter`.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_interpreter = pytest.mark.skipif(
    not TRITON_ON_CPU, reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 "
    "(set on machines without CUDA; on a CUDA machine the same kernels are tested on GPU)")

# Relative-error bounds (docs/ARCHITECTURE.md, "Test tolerances") (‖out − ref‖ / ‖ref‖).
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


def assert_within_2x_eager(ours: torch.Tensor, same: torch.Tensor, ref64: torch.Tensor,
                           floor: float, name: str = "out", min_scale: float = 1.0) -> None:
    """The accuracy rule for kernels (docs/ARCHITECTURE.md, "Test tolerances"): the error of
    `ours` against the float64 reference `ref64` is at most twice the error of `same` (the
    eager computation in the same dtype as `ours`) plus a floor for results eager gets
    (nearly) exactly:

        ‖ours − ref64‖ <= 2·‖same − ref64‖ + floor · max(‖ref64‖, min_scale)

    (min_scale=0 gives the relative form ``rel(ours) <= 2·rel(same) + floor``). NaN or inf
    in `ours` never passes. The message says by how much and where it failed."""
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    if not torch.isfinite(ours).all():
        raise AssertionError(f"{name}: not finite; {_where(ours, ref64)}")
    ref64 = ref64.double()
    err = (ours.double() - ref64).norm().item()
    err_same = (same.double() - ref64).norm().item()
    ref_norm = ref64.norm().item()
    bound = 2 * err_same + floor * max(ref_norm, min_scale)
    if not err <= bound:
        rel = (lambda e: e / ref_norm if ref_norm > 0 else e)
        raise AssertionError(
            f"{name}: ‖ours − ref64‖ = {err:.3e} > 2·‖eager − ref64‖ + floor = {bound:.3e} "
            f"(eager {err_same:.3e}; relative: ours {rel(err):.3e}, eager {rel(err_same):.3e}, "
            f"floor {floor:.1e}, {err / bound:.2f}x the bound); {_where(ours, ref64)}")


def softmax_grad_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                       visible: torch.Tensor, scale: float) -> tuple:
    """(‖scale (P∘dP) K‖, ‖scale (P∘dP)ᵀ Q‖) in float64: the size of the terms that dq and
    dk of attention sum before the softmax cancels them, as floor scales for
    assert_within_2x_eager (q ``[B, H, Tq, D]``, k, v ``[B, H, Tk, D]``, do ``[B, H, Tq,
    D]``, visible bool ``[B, Tq, Tk]`` as reference.attention_mask gives it).

    dS = P∘(dP − Δ) with Δ_i = Σ_j P_ij dP_ij, so every row of dS sums to zero: where a
    query sees one key, dq and dk are exactly 0, and eager, which takes Δ from the same
    products, gets exactly 0 too; a flash kernel takes Δ_i = dO_i·O_i (another summation
    of the same number) and keeps the rounding of dP − Δ, which scales with these terms,
    not with the (zero) gradient."""
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    vis = visible[:, None]                                              # [B, 1, Tq, Tk]
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~vis, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)                # rows without keys: 0
    t = p * (do @ v.transpose(-1, -2))                                  # P∘dP [B, H, Tq, Tk]
    return ((scale * t @ k).norm().item(), (scale * t.transpose(-1, -2) @ q).norm().item())


def assert_param_grads_within_2x_eager(fast: "torch.nn.Module", eager: "torch.nn.Module",
                                       ref64: "torch.nn.Module", floor: float) -> None:
    """Every parameter of `fast` has a non-zero gradient within the 2x-eager rule
    (assert_within_2x_eager, relative floor) of the float64 model `ref64`'s, `eager` being
    the same computation on the eager backend in `fast`'s dtype. For gradients that are
    small sums of larger terms (e.g. a bias whose gradient sums over the batch), where a
    fixed tolerance against eager depends on the machine's accumulation order."""
    g = {n: p.grad for n, p in fast.named_parameters()}
    g_e = {n: p.grad for n, p in eager.named_parameters()}
    g64 = {n: p.grad for n, p in ref64.named_parameters()}
    assert g.keys() == g_e.keys() == g64.keys(), "parameter names differ"
    for name in g:
        assert g[name] is not None and g_e[name] is not None, f"{name}: no gradient"
        assert g[name].abs().sum() > 0, f"{name}: zero gradient"
        assert_within_2x_eager(g[name], g_e[name], g64[name], floor, name=f"grad {name}",
                               min_scale=0.0)


def spy_launches(monkeypatch, module, names, pick, with_name=True):
    """Wrap the Triton kernels ``names`` of ``module`` (for this test only) so that each
    launch records ``pick(args, kwargs)`` (with the kernel's name unless ``with_name`` is
    False) and then runs as before. Returns the list of records, filled as launches happen."""
    seen = []

    class _Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                value = pick(args, kwargs)
                seen.append((self.name, value) if with_name else value)
                return launch(*args, **kwargs)
            return run
    for name in names:
        monkeypatch.setattr(module, name, _Spy(name, getattr(module, name)))
    return seen


def load_benchmark(filename: str):
    """A module of benchmarks/ (not a package) by file name, e.g. "lstm_phase_clock.py"."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / filename
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
