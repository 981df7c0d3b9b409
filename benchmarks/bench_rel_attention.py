"""Benchmarks of ``ctxfast.rel_attention`` against the original Transformer-XL
formulation (einsum for AC and the whole ``[Tq, Tk]`` BD, pad-and-view shift, materialised
causal mask, softmax: ``ctxfast.reference.rel_attention_original``), on the same inputs in
the same run.

Backends timed:

* ``triton`` (CUDA only: on CPU it runs in the interpreter);
* ``cpu`` (CPU only: the C++ kernel of ``csrc/cpu/attention.cpp``, position term from the
  band of r per tile);
* ``eager`` (``ctxfast.reference.rel_attention``, direct indexing by distance);
* ``flex`` (CUDA only): FlexAttention as far as it can express the op —
  :func:`flex_rel_attention`: AC through ``q + u`` as flex's query, BD precomputed as
  ``(q + v) @ rᵀ`` (a ``[B, H, Tq, R]`` buffer, the one the fused kernel never stores) and
  gathered in ``score_mod`` at row ``pos_start − (mem_len + i − j)``, the causal mask as a
  ``mask_mod`` block mask (built once, outside the timing). The whole function (the BD
  matmul and flex) goes through ``torch.compile``, as flex's documentation requires.
  BD's gradient flows back through the captured buffer (FlexAttention supports
  gradients of captured ``score_mod`` tensors since torch 2.6, written with atomics in
  its backward kernel), so ``fwd+bwd`` is timed for flex too;
* ``ctxfast.attention`` (not rel_attention: a yardstick): our own attention kernel on the
  same q, k, v with the same causal mask and memory, without the position term and the
  biases (the default backend of the device: ``cpu`` or ``triton``; not for ``window``
  cases, which attention cannot express). The rows of the ``cpu`` and ``triton`` backends
  note their time as a multiple of it ("1.52x the time of ctxfast.attention"): what the
  position term costs on top of attention (one more ``[Tq, R] x [R, D]`` product each way:
  ~1.5x the arithmetic);
* the baseline ``eager-original``.

On the CPU the ``cpu`` backend is also timed in rounds interleaved with the baseline
(``_common.measure``'s ``paired``): the report's "interleaved" speedup.

Modes ``fwd`` and ``fwd+bwd`` (gradients of q, k, v, r and both biases). Inputs:
``torch.randn`` (fp32 on CPU, bf16 on CUDA). Every backend is checked against the fp32
reference on the first batch row (output, and in ``fwd+bwd`` every gradient with the
upstream gradient zero outside that row) before it is timed. ``CTXFAST_BENCH_QUICK=1``:
small cases. Full: Transformer-XL shapes (H 16, D 64, Tq 512, memory 512–3072),
decoding shapes (Tq 1 and 16, memory 3072) and the paper's WikiText-103 evaluation
(``same_length``: Tq 128, memory 1600, ``window=1600``; the baseline with the original
code's same_length mask, flex with the window in its mask_mod) on CUDA; a small window
case in the quick set.

FLOPs counted (``extra_info["flops"]``, TFLOP/s in the report): AC and BD, ``2·D`` each per
visible (causal, and within the window) pair, plus ``2·D`` for P·V — ``6·B·H·pairs·D`` for the forward, x3.5 for
fwd+bwd as for attention. Peak memory: ``_common.measure`` (CUDA).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Tuple

import pytest
import torch

import _common
import ctxfast
from ctxfast import reference as ref

OP = "rel_attention"
BASELINE = "eager-original"
MODES = ("fwd", "fwd+bwd")
ATTENTION = "ctxfast.attention"   # the yardstick row (see the module docstring)
BACKENDS = ("triton", "cpu", "eager", "flex", ATTENTION, BASELINE)
RTOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


class Case(NamedTuple):
    shape: Tuple[int, int, int, int, int]   # B, H, Tq, mem, D
    devices: Tuple[str, ...] = ("cpu", "cuda")
    window: Optional[int] = None            # same_length: keys at distance < window

    @property
    def name(self) -> str:                  # "B2 H4 Tq64 mem64 D32", "... window48"
        name = " ".join(f"{k}{v}" for k, v in zip(("B", "H", "Tq", "mem", "D"), self.shape))
        return name if self.window is None else f"{name} window{self.window}"


QUICK_CASES = (Case((2, 4, 64, 64, 32)), Case((2, 4, 64, 64, 32), window=48))
FULL_CASES = (
    # CPU (fp32): Transformer-XL training segments with memory = segment length
    Case((2, 8, 128, 128, 64), ("cpu",)),
    Case((1, 8, 512, 512, 64), ("cpu",)),
    Case((1, 8, 1024, 1024, 64), ("cpu",)),
    *(Case((4, 16, 512, mem, 64), ("cuda",)) for mem in (512, 1024, 2048, 3072)),
    # decoding (Transformer-XL evaluation): a few queries against a long memory
    Case((16, 16, 1, 3072, 64), ("cuda",)),
    Case((16, 16, 16, 3072, 64), ("cuda",)),
    # the paper's WikiText-103 evaluation: tgt_len 128, mem_len 1600, same_length
    Case((8, 16, 128, 1600, 64), ("cuda",), window=1600),
)


def _params():
    return _common.params(QUICK_CASES, FULL_CASES, MODES, BACKENDS)


def flops(case: Case, mode: str, position_term: bool = True) -> float:
    """2 · pairs · D per product over the visible pairs. rel_attention's forward: AC, BD,
    P·V (3 products); its backward: AC and BD again, dV, dP, dQ from K and from r, dK, dr
    (8; benchmarks/roofline.py counts the same). position_term=False: ctxfast.attention
    at the same shape, 2 forward products and 5 backward (FlashAttention's 2.5x)."""
    B, H, Tq, mem, D = case.shape
    W = case.window or Tq + mem                       # query i sees min(W, mem + i + 1) keys
    visible = sum(min(W, mem + i + 1) for i in range(Tq))
    fwd, bwd = (3, 8) if position_term else (2, 5)
    return 2 * B * H * visible * D * (fwd + (bwd if mode == "fwd+bwd" else 0))


# --------------------------------------------------------------------------- FlexAttention

def flex_score_mod(bd: torch.Tensor, mem_len: int, pos_start: int, scale: float) -> Callable:
    """FlexAttention ``score_mod`` adding the position term: ``score + scale · bd[b, h, i,
    pos_start − (mem_len + i − j)]`` where ``bd [B, H, Tq, R] = (q + v) @ rᵀ``. flex's
    ``score`` is already ``scale · (q + u)·k``. Pairs past the causal edge (masked by
    :func:`flex_mask_mod`, but evaluated in partial blocks) would index past row R − 1:
    the row is clamped, so every read stays inside ``bd``."""
    R = bd.shape[-1]

    def score_mod(score, b, h, q_idx, kv_idx):
        row = pos_start - (mem_len + q_idx - kv_idx)          # row of r of pair (i, j)
        row = torch.clamp(row, 0, R - 1)
        return score + bd[b, h, q_idx, row] * scale

    return score_mod


def flex_mask_mod(mem_len: int, window: Optional[int] = None) -> Callable:
    """FlexAttention ``mask_mod`` of Transformer-XL's causal mask: key j is visible to
    query i iff ``j <= i + mem_len`` (and, with `window`, ``mem_len + i - j < window``)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + mem_len

    def window_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + mem_len) & (mem_len + q_idx - kv_idx < window)

    return mask_mod if window is None else window_mask_mod


def flex_rel_attention(q, k, v, r, r_w_bias, r_r_bias, *, block_mask=None,
                       pos_start: Optional[int] = None, scale: Optional[float] = None):
    """``ctxfast.rel_attention``'s causal Transformer-XL form written for FlexAttention:
    q ``[B, H, Tq, D]``, k, v ``[B, H, Tk, D]``, r ``[H, R, D]``, biases ``[H, D]`` ->
    ``[B, H, Tq, D]``. Builds the ``[B, H, Tq, R]`` BD buffer. `block_mask`: from
    ``create_block_mask(flex_mask_mod(Tk - Tq), None, None, Tq, Tk)``. Wrap in
    ``torch.compile`` for the fused kernel (uncompiled, flex runs an unfused reference)."""
    from torch.nn.attention.flex_attention import flex_attention

    Tq, D = q.shape[2], q.shape[3]
    Tk = k.shape[2]
    pos_start = Tk - 1 if pos_start is None else pos_start
    scale = D ** -0.5 if scale is None else scale
    bd = torch.matmul(q + r_r_bias[None, :, None, :], r.transpose(-1, -2)[None])  # [B, H, Tq, R]
    score_mod = flex_score_mod(bd, Tk - Tq, pos_start, scale)
    return flex_attention(q + r_w_bias[None, :, None, :], k, v, score_mod=score_mod,
                          block_mask=block_mask, scale=scale)


def _flex_error() -> Optional[str]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except Exception as e:   # ImportError, or an older torch failing inside the module
        return f"FlexAttention unavailable: {type(e).__name__}: {e}"
    return None


def _flex_op(case: Case, device: torch.device) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask

    _, _, Tq, mem, _ = case.shape
    block_mask = create_block_mask(flex_mask_mod(mem, case.window), None, None, Tq, Tq + mem,
                                   device=device)
    torch._dynamo.reset()                   # a fresh compile per case: no recompile limit hit
    return functools.partial(torch.compile(flex_rel_attention, dynamic=False),
                             block_mask=block_mask)


# --------------------------------------------------------------------------- benchmark

def _skip_reason(backend: str, device: torch.device) -> Optional[str]:
    """None if `backend` should be timed on `device`, else why not."""
    if backend == BASELINE:
        return None
    if backend == "triton" and device.type != "cuda":
        return "triton on CPU tensors runs in the interpreter: only timed on CUDA"
    if backend == ATTENTION:
        return ctxfast.why_unavailable("triton" if device.type == "cuda" else "cpu", device)
    if backend == "flex":
        if device.type != "cuda":
            return "FlexAttention is a GPU baseline (no CPU backward): only timed on CUDA"
        return _flex_error()
    return ctxfast.why_unavailable(backend, device)


def _op(backend: str, case: Case, device: torch.device) -> Callable:
    if backend == BASELINE:
        return functools.partial(ref.rel_attention_original, window=case.window)
    if backend == "flex":
        return _flex_op(case, device)
    if backend == ATTENTION:
        return _attention_op
    return functools.partial(ctxfast.rel_attention, backend=backend, window=case.window)


def _attention_op(q, k, v, r=None, r_w_bias=None, r_r_bias=None, *, reference=False):
    """The yardstick: ``ctxfast.attention`` (or its reference) with rel_attention's
    causal mask and memory on the same q, k, v ``[B, H, T, D]``; r and the biases unused."""
    fn = ref.attention if reference else ctxfast.attention
    return fn(q, k, v, causal=True)


def _rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    den = y.norm().item()
    return (x - y).norm().item() / (den if den > 0 else 1.0)


def _check(op: Callable, backend: str, mode: str, case: Case, inputs, g) -> None:
    """`op` computes the fp32 reference's output (and gradients) on the first batch row,
    each within the larger of ``RTOL`` and twice the error of the reference itself run
    at the inputs' dtype (the rule of the tests: a long softmax row in bf16 is ~2% off
    for every backend, the original code included)."""
    rtol = RTOL[inputs[0].dtype]
    first = [t.detach()[:1] if t.dim() == 4 else t.detach() for t in inputs]
    want_in = [t.float().requires_grad_(mode != "fwd") for t in first]
    if backend == ATTENTION:
        spec = functools.partial(_attention_op, reference=True)
        names = ("dq", "dk", "dv")
    else:
        spec = functools.partial(ref.rel_attention, window=case.window)
        names = ("dq", "dk", "dv", "dr", "d_r_w_bias", "d_r_r_bias")
    n_in = len(names)

    def results(fn, ins, grad):         # out (first row) and the gradients of the first row
        if mode == "fwd":
            with torch.no_grad():
                return [fn(*ins)[:1]]
        out = fn(*ins)
        gs = torch.autograd.grad(out, ins[:n_in], grad)
        return [out.detach()[:1]] + [x[:1] if x.dim() == 4 else x for x in gs]

    g_first = None
    if mode != "fwd":
        g_first = torch.zeros_like(g)
        g_first[:1] = g[:1]                        # gradients of the first batch row only
    want = results(spec, want_in, None if g_first is None else g_first[:1].float())
    same = [t.detach().requires_grad_(mode != "fwd") for t in first]
    same_dtype = results(spec, same, None if g_first is None else g_first[:1])
    got = results(op, [t.detach().requires_grad_(mode != "fwd") for t in inputs], g_first)
    for what, x, x_same, w in zip(("out",) + names, got, same_dtype, want):
        err = _rel_err(x, w)                       # NaN fails too
        tol = max(rtol, 2 * _rel_err(x_same, w))
        assert err <= tol, (f"{backend} {case.name} {mode}: relative error of {what} "
                            f"{err:.3g} > {tol:.3g} (the larger of {rtol:g} and 2x the "
                            f"reference's own at {inputs[0].dtype}) against the reference")


@pytest.mark.parametrize("case, mode, backend", _params())
def test_rel_attention(benchmark, bench_device, case: Case, mode: str, backend: str):
    reason = _skip_reason(backend, bench_device)
    if reason is None and backend == ATTENTION and case.window is not None:
        reason = "ctxfast.attention has no same_length window"
    if reason is not None:
        pytest.skip(reason)
    B, H, Tq, mem, D = case.shape
    Tk = Tq + mem
    dtype = torch.bfloat16 if bench_device.type == "cuda" else torch.float32
    _common.describe(benchmark, op=OP, case=case.name, mode=mode, backend=backend,
                     dtype=dtype, device=bench_device, shape=list(case.shape), mem_len=mem,
                     flops=flops(case, mode, position_term=backend != ATTENTION),
                     T=Tk, series=f"Tq{Tq}",
                     relative_to=ATTENTION if backend in ("cpu", "triton") else None)

    def make():
        shapes = ((B, H, Tq, D), (B, H, Tk, D), (B, H, Tk, D), (H, Tk, D), (H, D), (H, D))
        ts = tuple(torch.randn(s, device=bench_device, dtype=dtype) for s in shapes)
        if mode == "fwd":
            return ts
        return tuple(t.requires_grad_(True) for t in ts) + (
            torch.randn(B, H, Tq, D, device=bench_device, dtype=dtype),)

    with _common.oom_guard(benchmark, bench_device):
        sets = _common.input_sets(make, bench_device)
        op = _op(backend, case, bench_device)
        _check(op, backend, mode, case, sets[0][:6], sets[0][6] if mode != "fwd" else None)

        if mode == "fwd":
            def fn(*ts):
                with torch.no_grad():
                    return op(*ts)
        else:
            wrt = 3 if backend == ATTENTION else 6   # the yardstick has no r, no biases

            def fn(*ts):
                return torch.autograd.grad(op(*ts[:6]), ts[:wrt], ts[6])

        paired = None
        if backend == "cpu":                         # ours against the baseline, interleaved
            base = _op(BASELINE, case, bench_device)
            if mode == "fwd":
                def base_fn(*ts):
                    with torch.no_grad():
                        return base(*ts)
            else:
                def base_fn(*ts):
                    return torch.autograd.grad(base(*ts[:6]), ts[:6], ts[6])
            paired = (BASELINE, base_fn)

        quick = _common.quick()
        _common.measure(benchmark, fn, sets, bench_device, budget_s=0.4 if quick else 2.0,
                        min_rounds=5 if quick else 10, paired=paired)
