"""Benchmarks of ``ctxfast.attention`` against the eager reference, SDPA and FlexAttention.

For every case (``q [B, H, Tq, D]``, ``k, v [B, H, Tk, D]``, keys ``[memory; current]``
with ``mem_len = Tk - Tq``, and one mask kind) and mode (``fwd``, ``fwd+bwd``) this times,
on the same inputs in the same run:

* each backend of ``ctxfast.attention`` that can run on the device (``triton``: CUDA
  tensors only; ``cpu``: the C++ kernel, CPU tensors only; ``eager``);
* the baseline ``eager`` (``ctxfast.reference.attention``: materialised mask + softmax);
* ``sdpa``: ``F.scaled_dot_product_attention`` (on the CPU too: the peer there, since
  the Triton backend only runs in the interpreter on CPU tensors), with
  ``is_causal=True`` for a plain causal mask without memory, else with the materialised
  bool mask (``reference.attention_mask``, ``[B, 1, Tq, Tk]``, built once outside the
  timing);
* on CUDA, ``flex``: ``torch.compile(flex_attention)`` with a ``mask_mod`` that computes
  the same mask from O(T) data (causal offset, padding lookup, rank lookup); its block
  mask is built once outside the timing (``block_mask_ms`` in ``extra_info`` says what
  one build costs: XLNet draws a new permutation every batch).

``report.py`` turns the pytest-benchmark JSON into ratios against the baseline.

Mask kinds: ``causal`` (GPT), ``padding`` (BERT: the last ~15% of the keys of each row are
padding, 0-30% across the batch), ``perm-content`` and ``perm-query`` (XLNet: a random
permutation rank ``[B, Tq]`` per row, content / query stream), ``causal-memory``
(Transformer-XL: ``Tk = Tq + mem``).

Inputs are ``torch.randn`` (never zeros: zeros run faster and hide bugs), fp32 on the CPU
and bf16 on CUDA. Each timed backend's output (and for ``fwd+bwd`` its gradients) is
checked against the reference in fp32 before it is timed: relative error
``||out - ref|| / ||ref||`` at most 2e-2 (bf16) or 1e-4 (fp32), on the first batch rows
and heads (attention is independent per (b, h), so a slice checks the same code without
the reference's O(Tq·Tk) memory). For SDPA, queries that see no key are left out of the
comparison (it may return NaN there; the reference and ctxfast return 0). A backend that
runs out of GPU memory is recorded as ``OOM`` in the report (``_common.measure`` /
``oom_guard``), not skipped and not a crash.

``extra_info["flops"]``: the FlashAttention count, forward ``4·B·H·Tq·Tk·D`` (padding and
permutation masks count the dense work), halved for causal without memory; causal with
memory counts the visible (i, j) pairs exactly; ``fwd+bwd`` = 3.5 x forward.

``CTXFAST_BENCH_QUICK=1``: tiny cases and a short T sweep (seconds on a CPU). Otherwise:
real-model shapes (BERT-base, GPT-2 small, XLNet-base, Transformer-XL enwik8 base and
WT103 base) and a causal T sweep (``B·T = 16k`` tokens, ``H·D = 2048`` on CUDA; ``B·T =
4k``, ``H·D = 512`` on the CPU). On the CPU the real-model shapes keep their sequence
lengths and head counts but a batch of 1–2.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

import _common
import ctxfast
from ctxfast import _dispatch
from ctxfast import reference as ref

OP = "attention"
BASELINE = "eager"                          # ctxfast.reference.attention
MODES = ("fwd", "fwd+bwd")
MASKS = ("causal", "padding", "perm-content", "perm-query", "causal-memory")
#: the backends of ctxfast.attention (triton, cpu, eager), then SDPA and FlexAttention
BACKENDS = (*_dispatch.registered_ops()[OP], "sdpa", "flex")
PAD_FRACTION = 0.15                         # mean padding of the "padding" cases
RTOL = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-4}
CHECK_ELEMENTS = 1 << 26                    # most score elements in the reference check


class Case(NamedTuple):
    mask: str                               # one of MASKS
    shape: Tuple[int, int, int, int, int]   # B, H, Tq, Tk, D
    model: str = ""                         # whose shapes these are ("" for the quick set)
    devices: Tuple[str, ...] = ("cpu", "cuda")
    modes: Tuple[str, ...] = MODES          # decoding cases: forward only (inference)

    @property
    def name(self) -> str:   # "GPT-2 causal B16 H12 Tq1024 Tk1024 D64"
        dims = " ".join(f"{k}{v}" for k, v in zip(("B", "H", "Tq", "Tk", "D"), self.shape))
        return " ".join(s for s in (self.model, self.mask, dims) if s)

    @property
    def mem_len(self) -> int:
        return self.shape[3] - self.shape[2]


def _sweep(D: int, Ts=(1024, 2048, 4096, 8192, 16384), tokens: int = 16384,
           hidden: int = 2048, devices=("cuda",)):
    """Causal T sweep at head dim `D`: B·T = `tokens`, H·D = `hidden` (FlashAttention's
    benchmark convention)."""
    return tuple(Case("causal", (tokens // T, hidden // D, T, T, D), "sweep", devices)
                 for T in Ts)


QUICK_CASES = (
    Case("causal", (2, 4, 128, 128, 64)),
    Case("padding", (2, 4, 128, 128, 64)),
    Case("perm-content", (2, 4, 128, 192, 64)),   # with 64 memory keys
    Case("perm-query", (2, 4, 128, 128, 64)),     # no memory: the first-ranked query sees nothing
    Case("causal-memory", (2, 4, 128, 256, 64)),
    *_sweep(64, (64, 256, 512), tokens=512, hidden=256, devices=("cpu", "cuda")),
)
FULL_CASES = (
    # CPU (fp32): real sequence lengths and heads, batch 1-2; a few seconds each
    Case("padding", (1, 12, 512, 512, 64), "BERT-base", ("cpu",)),
    Case("padding", (4, 12, 512, 512, 64), "BERT-base", ("cpu",)),  # lengths vary over the batch
    Case("causal", (1, 12, 1024, 1024, 64), "GPT-2", ("cpu",)),
    Case("perm-content", (1, 12, 512, 896, 64), "XLNet-base", ("cpu",)),    # mem 384
    Case("perm-query", (1, 12, 512, 896, 64), "XLNet-base", ("cpu",)),
    Case("perm-query", (8, 8, 128, 128, 64), "XLNet short", ("cpu",)),      # the goal's T 128
    Case("causal-memory", (1, 8, 512, 1024, 64), "TXL-enwik8", ("cpu",)),   # mem 512
    Case("causal-memory", (4, 10, 150, 300, 41), "TXL-WT103", ("cpu",)),    # mem 150, D 41
    *_sweep(64, (256, 512, 1024, 2048), tokens=4096, hidden=512, devices=("cpu",)),
    # decoding: one query (or a chunk of 16) against the cache, forward only
    Case("causal-memory", (1, 12, 1, 1024, 64), "GPT-2 decode", ("cpu",), ("fwd",)),
    Case("causal-memory", (8, 12, 1, 512, 64), "GPT-2 decode", ("cpu",), ("fwd",)),
    Case("causal-memory", (1, 12, 16, 1024, 64), "GPT-2 decode", ("cpu",), ("fwd",)),
    # CUDA (bf16): the models' training batches (B·Tq ≈ 9k-16k tokens)
    Case("padding", (32, 12, 512, 512, 64), "BERT-base", ("cuda",)),
    Case("causal", (16, 12, 1024, 1024, 64), "GPT-2", ("cuda",)),
    Case("perm-content", (32, 12, 512, 512, 64), "XLNet-base", ("cuda",)),
    Case("perm-query", (32, 12, 512, 512, 64), "XLNet-base", ("cuda",)),
    Case("perm-content", (32, 12, 512, 896, 64), "XLNet-base", ("cuda",)),   # mem 384
    Case("perm-query", (32, 12, 512, 896, 64), "XLNet-base", ("cuda",)),     # mem 384
    Case("causal-memory", (22, 8, 512, 1024, 64), "TXL-enwik8", ("cuda",)),  # base: bsz 22, mem 512
    Case("causal-memory", (60, 10, 150, 300, 41), "TXL-WT103", ("cuda",)),   # base: bsz 60, mem 150
    *_sweep(64),
    *_sweep(128),
    # decoding: 1 and 16 queries against a long cache (not yet run on a GPU)
    Case("causal-memory", (8, 32, 1, 8192, 128), "decode", ("cuda",), ("fwd",)),
    Case("causal-memory", (8, 32, 16, 8192, 128), "decode", ("cuda",), ("fwd",)),
)


def _params():
    return [p for p in _common.params(QUICK_CASES, FULL_CASES, MODES, BACKENDS)
            if p.values[1] in p.values[0].modes]


# --------------------------------------------------------------------------- masks, flops

def _mask_kwargs(case: Case, device: torch.device) -> dict:
    """The mask arguments of ``ctxfast.attention`` for `case` (O(T) data, on `device`)."""
    B, _, Tq, Tk, _ = case.shape
    if case.mask in ("causal", "causal-memory"):
        return {"causal": True}
    if case.mask == "padding":   # row b: the last 0-30% of the keys (mean 15%) are padding
        n_pad = [round(Tk * 2 * PAD_FRACTION * (b + 0.5) / B) for b in range(B)]
        j = torch.arange(Tk)
        kpm = torch.stack([j >= Tk - n for n in n_pad])
        return {"key_padding_mask": kpm.to(device)}
    if case.mask in ("perm-content", "perm-query"):
        gen = torch.Generator().manual_seed(1)
        rank = torch.argsort(torch.rand(B, Tq, generator=gen), dim=1)   # a random permutation
        return {"perm_rank": rank.to(device), "perm_stream": case.mask[len("perm-"):]}
    raise ValueError(f"unknown mask kind {case.mask!r}")


def _visible(mask_kw: dict, B: int, Tq: int, Tk: int, device) -> torch.Tensor:
    """Bool ``[B, Tq, Tk]`` visibility (materialised) of the first `B` rows of `mask_kw`."""
    kw = {k: (v[:B] if isinstance(v, torch.Tensor) else v) for k, v in mask_kw.items()}
    return ref.attention_mask(B, Tq, Tk, device=device, **kw)


def flops(case: Case, mode: str) -> int:
    """FlashAttention FLOP count of one call (see the module docstring)."""
    B, H, Tq, Tk, D = case.shape
    mem = Tk - Tq
    if case.mask in ("causal", "causal-memory") and mem == 0:
        fwd = 2 * B * H * Tq * Tk * D
    elif case.mask in ("causal", "causal-memory"):
        pairs = Tq * (mem + 1) + Tq * (Tq - 1) // 2   # query i sees keys 0 .. i + mem
        fwd = 4 * D * B * H * pairs
    else:
        fwd = 4 * B * H * Tq * Tk * D
    return fwd if mode == "fwd" else fwd * 7 // 2


# --------------------------------------------------------------------------- backends

def _flex_error() -> Optional[str]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except Exception as e:   # ImportError, or an older torch failing inside the module
        return f"FlexAttention unavailable: {type(e).__name__}: {e}"
    return None


def _skip_reason(backend: str, device: torch.device) -> Optional[str]:
    """None if `backend` should be timed on `device`, else why not."""
    if backend == BASELINE:
        return None
    if backend == "triton" and device.type != "cuda":
        return ("triton on CPU tensors runs in the Triton interpreter: far too slow to time; "
                "only timed on CUDA")
    if backend == "sdpa":
        return None                                  # a peer on every device
    if backend == "flex":
        if device.type != "cuda":
            return "FlexAttention is a GPU baseline: only timed on CUDA"
        return _flex_error()
    return ctxfast.why_unavailable(backend, device)


def _flex_op(case: Case, mask_kw: dict, device: torch.device) -> Tuple[Callable, float]:
    """(op, ms of one block-mask build) for FlexAttention with `case`'s mask as a mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, _, Tq, Tk, _ = case.shape
    mem = Tk - Tq
    causal = mask_kw.get("causal", False)
    kpm = mask_kw.get("key_padding_mask")
    valid = None if kpm is None else ~kpm                                    # [B, Tk]
    rank = mask_kw.get("perm_rank")                                          # [B, Tq]
    rank_k = None if rank is None else torch.cat([rank.new_zeros(B, mem), rank], 1)  # [B, Tk]
    query_stream = mask_kw.get("perm_stream") == "query"

    def mask_mod(b, h, q_idx, kv_idx):
        visible = kv_idx >= 0
        if causal:
            visible = visible & (kv_idx <= q_idx + mem)
        if valid is not None:
            visible = visible & valid[b, kv_idx]
        if rank is not None:
            rk, rq = rank_k[b, kv_idx], rank[b, q_idx]
            sees = rk < rq if query_stream else rk <= rq
            visible = visible & ((kv_idx < mem) | sees)                      # memory: always
        return visible

    per_batch = valid is not None or rank is not None

    def build():
        return create_block_mask(mask_mod, B if per_batch else None, None, Tq, Tk,
                                 device=device)

    build()                                                  # warm-up
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    block_mask = build()
    sync()
    build_ms = (time.perf_counter() - t0) * 1e3
    torch._dynamo.reset()                   # a fresh compile per case: no recompile limit hit
    flex = torch.compile(flex_attention)
    return functools.partial(flex, block_mask=block_mask), build_ms


def _op(backend: str, case: Case, mask_kw: dict, device: torch.device) -> Tuple[Callable, dict]:
    """(``op(q, k, v) -> out``, extra_info to add) for `backend` with `case`'s mask."""
    if backend in _dispatch.registered_ops()[OP]:
        return functools.partial(ctxfast.attention, backend=backend, **mask_kw), {}
    if backend == "sdpa":
        if case.mask == "causal" and case.mem_len == 0:
            return functools.partial(F.scaled_dot_product_attention, is_causal=True), {}
        B, _, Tq, Tk, _ = case.shape
        attn_mask = _visible(mask_kw, B, Tq, Tk, device).unsqueeze(1)       # [B, 1, Tq, Tk]
        if bool(attn_mask.all()):   # e.g. one query seeing its whole cache: as users call it
            return F.scaled_dot_product_attention, {}
        return functools.partial(F.scaled_dot_product_attention, attn_mask=attn_mask), {}
    if backend == "flex":
        op, build_ms = _flex_op(case, mask_kw, device)
        return op, {"block_mask_ms": build_ms}
    raise ValueError(f"unknown backend {backend!r}")


# --------------------------------------------------------------------------- check

def _rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    den = y.norm().item()
    return (x - y).norm().item() / (den if den > 0 else 1.0)


def _check_slice(case: Case) -> Tuple[int, int]:
    """(batch rows, heads) that the reference check covers: at least one of each, at most
    2 rows and ~CHECK_ELEMENTS score elements."""
    B, H, Tq, Tk, _ = case.shape
    nb = min(B, 2)
    nh = max(1, min(H, CHECK_ELEMENTS // (nb * Tq * Tk)))
    return nb, nh


def _check(op: Callable, backend: str, mode: str, case: Case, mask_kw: dict,
           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
    """The backend computes the fp32 reference's attention (and gradients) before timing,
    each within the larger of ``RTOL`` and twice the error of the reference itself run at
    the inputs' dtype (the rule of the tests: a long softmax row in bf16 is ~2% off for
    every backend, SDPA's included, as rel_attention's decoding rows were on a GPU)."""
    if backend == BASELINE:
        return                                   # it is the reference
    _, _, Tq, Tk, _ = case.shape
    nb, nh = _check_slice(case)
    rtol = RTOL[q.dtype]
    sub_kw = {key: (val[:nb] if isinstance(val, torch.Tensor) else val)
              for key, val in mask_kw.items()}
    # queries that see some key; SDPA's output (NaN or not) on the others is not checked
    seen = _visible(mask_kw, nb, Tq, Tk, q.device).any(-1)[:, None, :, None]  # [nb, 1, Tq, 1]
    seen = seen.expand(nb, nh, Tq, 1)
    skip_empty = backend == "sdpa" and not bool(seen.all())
    q_s, k_s, v_s = (t[:nb, :nh].detach().float().requires_grad_(mode != "fwd")
                     for t in (q, k, v))
    # the same reference at the inputs' dtype: what that dtype itself costs
    q_d, k_d, v_d = (t[:nb, :nh].detach().requires_grad_(mode != "fwd") for t in (q, k, v))

    def compare(what: str, got: torch.Tensor, want: torch.Tensor, same: torch.Tensor,
                per_query: bool) -> None:
        got, want, same = got[:nb, :nh].float(), want.float(), same.float()
        if skip_empty and per_query:
            sel = seen.expand_as(want)
            got, want, same = got[sel], want[sel], same[sel]
        err = _rel_err(got, want)                # NaN fails too
        tol = max(rtol, 2 * _rel_err(same, want))
        assert err <= tol, (f"{backend} {case.name} {mode}: relative error of {what} "
                            f"{err:.3g} > {tol:.3g} (the larger of {rtol:g} and 2x the "
                            f"reference's own at {q.dtype}) against the reference")

    if mode == "fwd":
        with torch.no_grad():
            out = op(q, k, v)
            want = ref.attention(q_s, k_s, v_s, **sub_kw)
            same = ref.attention(q_d, k_d, v_d, **sub_kw)
        compare("out", out, want, same, True)
        return
    # upstream gradient: zero outside the slice (and for SDPA on queries that see no key)
    g_full = torch.zeros_like(g)
    g_full[:nb, :nh] = g[:nb, :nh] * seen if skip_empty else g[:nb, :nh]
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = op(qg, kg, vg)
    grads = torch.autograd.grad(out, (qg, kg, vg), g_full)
    want = ref.attention(q_s, k_s, v_s, **sub_kw)
    want_grads = torch.autograd.grad(want, (q_s, k_s, v_s), g_full[:nb, :nh].float())
    same = ref.attention(q_d, k_d, v_d, **sub_kw)
    same_grads = torch.autograd.grad(same, (q_d, k_d, v_d), g_full[:nb, :nh])
    compare("out", out.detach(), want.detach(), same.detach(), True)
    if skip_empty and not all(bool(torch.isfinite(t[:nb, :nh]).all()) for t in grads):
        return        # SDPA: NaN on queries that see no key poisons dk, dv; forward checked
    for name, got, wnt, sm in zip(("dq", "dk", "dv"), grads, want_grads, same_grads):
        compare(name, got, wnt, sm, name == "dq")


# --------------------------------------------------------------------------- benchmark

def _bench(benchmark, device: torch.device, case: Case, mode: str, backend: str) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    quick = _common.quick()
    B, H, Tq, Tk, D = case.shape
    elt = torch.tensor([], dtype=dtype).element_size()
    qo_bytes, kv_bytes = B * H * Tq * D * elt, B * H * Tk * D * elt
    _common.describe(
        benchmark, op=OP, case=case.name, mode=mode, backend=backend, dtype=dtype,
        device=device, baseline=BASELINE, shape=list(case.shape), mask=case.mask,
        mem_len=case.mem_len, T=Tq,
        series=" ".join(s for s in (case.model, case.mask, f"D{D}") if s),
        # least traffic: read q, k, v, write out; backward also reads q, k, v, out, dout
        # and writes dq, dk, dv
        min_bytes=(qo_bytes + kv_bytes) * (2 if mode == "fwd" else 6),
        flops=flops(case, mode),
    )
    torch.manual_seed(0)
    mask_kw = _mask_kwargs(case, device)

    def make():
        q = torch.randn(B, H, Tq, D, device=device, dtype=dtype)
        k = torch.randn(B, H, Tk, D, device=device, dtype=dtype)
        v = torch.randn(B, H, Tk, D, device=device, dtype=dtype)
        if mode == "fwd":
            return (q, k, v)
        return (*(t.requires_grad_(True) for t in (q, k, v)), torch.randn_like(q))

    sets = _common.input_sets(make, device)
    op, op_info = _op(backend, case, mask_kw, device)
    benchmark.extra_info.update(op_info)
    q0, k0, v0 = (t.detach() for t in sets[0][:3])
    _check(op, backend, mode, case, mask_kw, q0, k0, v0,
           sets[0][3] if mode != "fwd" else torch.randn_like(q0))

    def timed(op):
        if mode == "fwd":
            def fn(q, k, v):
                with torch.no_grad():
                    return op(q, k, v)
        else:
            def fn(q, k, v, g):
                return torch.autograd.grad(op(q, k, v), (q, k, v), g)
        return fn

    paired = None
    if backend == "cpu":   # interleaved with the peer of its goal: SDPA, eager for XLNet
        peer = BASELINE if case.mask.startswith("perm") else "sdpa"
        paired = (peer, timed(_op(peer, case, mask_kw, device)[0]))
    _common.measure(benchmark, timed(op), sets, device,
                    budget_s=0.4 if quick else 2.0, min_rounds=5 if quick else 10,
                    paired=paired)


@pytest.mark.parametrize("case, mode, backend", _params())
def test_attention(benchmark, bench_device, case: Case, mode: str, backend: str):
    reason = _skip_reason(backend, bench_device)
    if reason is not None:
        pytest.skip(reason)
    with _common.oom_guard(benchmark, bench_device):    # OOM in the setup or check: a result
        _bench(benchmark, bench_device, case, mode, backend)
