"""Helpers shared by the tests: comparisons that say where and how much they failed."""
import os
from typing import Optional

import pytest
import torch

import ctxfast
from ctxfast import reference

# Backends that can run on CPU tensors in this process.
CPU_BACKENDS = [b for b in ctxfast.BACKENDS if ctxfast.why_unavailable(b, "cpu") is None]
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"

# The device every test runs on: CUDA when present, else CPU (conftest's `device` fixture
# returns it). Tests that need the Triton interpreter skip on CUDA with `needs_interpreter`.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The attention ops' backends that can run on DEVICE in this process (eager always; cpu on
# CPU tensors where ctxfast._C is built; triton on CUDA or under the interpreter).
ATTN_BACKENDS = [b for b in ("eager", "cpu", "triton")
                 if b in ctxfast.BACKENDS and ctxfast.why_unavailable(b, DEVICE) is None]
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


def owns_storage(t: torch.Tensor) -> bool:
    """Whether `t` holds all of its storage (no view of a larger tensor that a kept `t`
    would keep alive)."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def assert_exports(model: "torch.nn.Module", args: tuple) -> None:
    """``torch.export.export(model, args)`` runs, and its module returns what the model
    returns: the same output class, the same tensors (equal) in the same places."""
    from torch.utils import _pytree
    want = model(*args)
    got = torch.export.export(model, args).module()(*args)
    assert type(got) is type(want)
    (got, got_spec), (want, want_spec) = (_pytree.tree_flatten(o) for o in (got, want))
    assert got_spec == want_spec and any(isinstance(t, torch.Tensor) for t in want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_equal(a, b, f"exported output leaf {i}")


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
    q, k = (t.detach().double().requires_grad_(True) for t in (q, k))
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible[:, None], float("-inf"))
    return tuple(score_grad_terms(s, (q, k), v, do))


def score_grad_terms(scores: torch.Tensor, leaves, v: torch.Tensor, do: torch.Tensor,
                     dropout_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0
                     ) -> list:
    """For each leaf, ‖Σ_ij (P∘dP)_ij ∂S_ij/∂leaf‖ in float64: the gradient the leaf would
    get if the softmax did not subtract Δ_i = Σ_j P_ij dP_ij from every dP_ij. ``scores``
    ``[B, H, Tq, Tk]`` (``-inf`` where not visible) is a float64 function of the float64
    ``leaves`` (requires_grad); v ``[B, H, Tk, D]``, do ``[B, H, Tq, D]``, the dropout mask
    as the op takes it.

    Each row of dS = P∘(dP − Δ) sums to zero, so a gradient that sums dS over a row's keys
    (dq, the biases added to q) is a cancellation of terms this size; a flash backward,
    which takes Δ_i = dO_i·O_i, keeps their rounding (an error e_i in Δ_i moves dS_ij by
    −e_i P_ij), where eager, taking Δ from the same products, cancels it. These norms are
    the scale of that rounding: the floor of assert_within_2x_eager scales with them
    (``min_scale``), not with the (possibly much smaller) gradient."""
    p = reference.masked_softmax(scores.detach())
    dp = do.detach().double() @ v.detach().double().transpose(-1, -2)   # [B, H, Tq, Tk]
    if dropout_mask is not None and dropout_p > 0:
        dp = dp * dropout_mask.double() / (1.0 - dropout_p)
    grads = torch.autograd.grad(scores, list(leaves), p * dp, allow_unused=True)
    return [0.0 if g is None else g.norm().item() for g in grads]


def _rel_scores64(tensors, kw: dict):
    """(scores [B, H, Tq, Tk] float64, its leaves, the dropout arguments) of
    ctxfast.rel_attention's ``tensors`` = (q, k, v, r, r_w_bias, r_r_bias[, seg_embed,
    r_s_bias]) and other keyword arguments ``kw`` (``backend`` ignored)."""
    kw = {n: a for n, a in kw.items() if n != "backend"}
    drop = {n: kw.pop(n) for n in ("dropout_mask", "dropout_p") if n in kw}
    leaves = [t.detach().double().requires_grad_(True) for t in tensors]
    q, k, v, r, u, w = leaves[:6]
    seg = dict(zip(("seg_embed", "r_s_bias"), leaves[6:]))
    return reference.rel_scores(q, k, r, u, w, **seg, **kw), leaves, drop


def rel_grad_terms(tensors, do: torch.Tensor, **kw) -> list:
    """score_grad_terms of ctxfast.rel_attention, one norm per tensor: ``tensors`` = (q, k,
    v, r, r_w_bias, r_r_bias[, seg_embed, r_s_bias]), kw the op's other keyword arguments
    (masks, window, scale, seg ids, a dropout mask and p; ``backend`` is ignored)."""
    s, leaves, drop = _rel_scores64(tensors, kw)
    return score_grad_terms(s, leaves, leaves[2], do, **drop)


#: float32's unit roundoff: every kernel forms its softmax exponents in float32.
U32 = 2.0 ** -24


def exponent_floor(scores: torch.Tensor) -> float:
    """The relative error a flash kernel's softmax weights carry from their exponent alone:
    ``P = exp(s − lse)`` (the backward) or ``exp(s − m)`` (the forward, m the running row
    max) from operands held in float32, each rounded by half an ulp of its size, so the
    exponent is off by up to ``u·(|s| + |lse|)`` and P by that relatively: ``2·u·max|s|``
    (u = 2**-24) for the scaled scores ``scores`` (float64, −inf where not visible). Eager,
    which subtracts the row max from the scores it formed, has no such term. Below the
    float32 floor (2e-6) for scores under ~17; ~1e-5 at a scale of 2.5 (scores of 83)."""
    finite = scores.detach()[torch.isfinite(scores.detach())]
    return 2 * U32 * finite.abs().max().item() if finite.numel() else 0.0


def rel_exponent_floor(tensors, **kw) -> float:
    """:func:`exponent_floor` of ctxfast.rel_attention's scores (arguments as
    :func:`rel_grad_terms`)."""
    return exponent_floor(_rel_scores64(tensors, kw)[0])


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


def spy_launch_settings(monkeypatch, module, names=None):
    """:func:`spy_launches` recording, per launch, the kernel's name and its keyword
    arguments that are plain values (constexprs, ``num_warps``, ``num_stages``; not tensors
    or descriptors), as a comparable string. ``names``: the module's kernels (every
    ``*_kernel`` it holds) by default."""
    if names is None:
        names = [n for n, v in vars(module).items() if n.endswith("_kernel")
                 and hasattr(v, "__getitem__")]         # (JIT or interpreter kernel objects)
    plain = (bool, int, float, str, type(None))
    return spy_launches(monkeypatch, module, names, lambda args, kwargs: repr(sorted(
        (k, v) for k, v in kwargs.items() if isinstance(v, plain))))


def load_benchmark(filename: str):
    """A module of benchmarks/ (not a package) by file name, e.g. "lstm_phase_clock.py"."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / filename
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cached_build(cmd: list, output, inputs: list, timeout: int = 600):
    """``subprocess.run(cmd)`` for a compile whose result depends only on the compiler, the
    command and `inputs` (files, or directories: every file under them). A successful
    run's output file (`output`, a path in `cmd`; or None) and its stdout / stderr are
    kept under ``~/.cache/ctxfast-tests`` (``CTXFAST_TEST_BUILD_CACHE`` elsewhere; ``0``
    turns it off) keyed by all three, and a run with the same key returns them without
    compiling. Returns a ``subprocess.CompletedProcess``. The nvcc / g++ builds the tests
    check were ~45 s of the suite on a 2-core machine."""
    import hashlib
    import json
    import shutil
    import subprocess
    from pathlib import Path

    root = os.environ.get("CTXFAST_TEST_BUILD_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "ctxfast-tests"))
    if root == "0":
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    key = hashlib.sha256()
    version = subprocess.run([cmd[0], "--version"], capture_output=True, text=True)
    key.update((shutil.which(cmd[0]) or cmd[0]).encode() + version.stdout.encode())
    key.update(json.dumps([str(c) if c != str(output) else "<output>" for c in cmd]).encode())
    for top in map(Path, inputs):
        for path in [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file()):
            key.update(str(path).encode() + b"\0" + path.read_bytes())
    kept = Path(root) / "builds" / key.hexdigest()
    if (kept / "run.json").exists():
        run = json.loads((kept / "run.json").read_text())
        if output is not None:
            shutil.copy2(kept / "output", output)
        return subprocess.CompletedProcess(cmd, 0, run["stdout"], run["stderr"])
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if run.returncode == 0:                       # a failure is not kept: it runs again
        def fill(staging):
            staging.mkdir()
            if output is not None:
                shutil.copy2(output, staging / "output")
            (staging / "run.json").write_text(json.dumps({"stdout": run.stdout,
                                                          "stderr": run.stderr}))
        keep_whole(kept, fill)
    return run


def keep_whole(path, fill) -> None:
    """Make `path` (a file or a directory) whole or not at all, with processes racing:
    ``fill(staging)`` writes it under a name of this process's beside `path`, which is then
    renamed to `path`. Where another process kept a directory first, its copy stays; a
    fill that fails leaves nothing."""
    import shutil
    from pathlib import Path

    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)

    def remove_staging():
        shutil.rmtree(staging, ignore_errors=True)
        if staging.is_file():
            staging.unlink()

    remove_staging()
    try:
        fill(staging)
    except BaseException:
        remove_staging()
        raise
    try:
        os.replace(staging, path)                 # a directory: refused if `path` exists
    except OSError:
        remove_staging()


def philox4x32_10(seed: int, counter: int) -> list:
    """Philox-4x32-10 (Salmon et al., 2011) in plain Python: the four output words of
    counter (counter_lo, counter_hi, 0, 0) under key (seed_lo, seed_hi)."""
    M = 0xFFFFFFFF
    c = [counter & M, (counter >> 32) & M, 0, 0]
    k0, k1 = seed & M, (seed >> 32) & M
    for _ in range(10):
        pa, pb = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((pb >> 32) ^ c[1] ^ k0) & M, pb & M, ((pa >> 32) ^ c[3] ^ k1) & M, pa & M]
        k0, k1 = (k0 + 0x9E3779B9) & M, (k1 + 0xBB67AE85) & M
    return c
