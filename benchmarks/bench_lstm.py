"""Benchmarks of ``ctxfast.nn.WeightDropLSTM`` (on ``ctxfast.lstm``) against
``torch.nn.LSTM`` with fastai-style weight dropout, on the same inputs in the same run.

A case is a stack of LSTM modules run one after the other on ``x [T, B, I]`` (time-major),
in training mode with DropConnect ``p`` on every ``weight_hh`` (one fresh mask per module,
layer and direction per forward), no other dropout:

* ULMFiT / AWD-LSTM (fastai's language model): three single-layer LSTMs 400 -> 1152 ->
  1152 -> 400, BPTT 70, batch 64, ``weight_p`` 0.2.
* ELMo's biLM: one 2-layer bidirectional LSTM, cell 4096, projection 512 (input 512),
  ``cell_clip = proj_clip = 3`` (AllenNLP's ELMo options), batch 32, T 50, and the same
  DropConnect p 0.2 (ELMo itself trained without it; the point is the weight drop's cost).
  nn.LSTM cannot clip, so the two baselines below compute strictly less (no clipping).
  ctxfast's module follows ``nn.LSTM``'s stacking (layer 2 reads both directions), not
  ElmoLstm's two separate stacks: the same work per layer.

Backends:

* ``triton`` (CUDA only: on CPU it runs in the interpreter), ``cuda``, ``cpu``, ``eager``
  (not timed at the CUDA sizes: the reference loop is no peer anyone runs):
  ``WeightDropLSTM(..., weight_dropout=p, backend=...)`` — the mask is an input of the
  fused op, no weight is written.
* the baseline ``nn.LSTM+WeightDropout``: :class:`FastaiWeightDropLSTM`, fastai's
  ``WeightDropout`` re-written here: the raw ``weight_hh`` are the parameters, and before
  every forward ``F.dropout(raw, p)`` (a dropped copy) is written into the wrapped
  ``nn.LSTM``, whose ``flatten_parameters`` is disabled as fastai does (cuDNN cannot keep
  a flat weight buffer whose members change every step, so it copies the weights into
  one at every call; PyTorch warns about that and the warning is silenced). cuDNN on a
  GPU, PyTorch's CPU LSTM (oneDNN where it applies) on the CPU.
* ``nn.LSTM-no-drop``: the same ``nn.LSTM`` stack with flattened weights and no DropConnect
  at all — what cuDNN does when nothing is dropped, the baseline's floor.

Modes: ``fwd`` (the forward of a training step, under ``torch.no_grad``: masks are drawn)
and ``fwd+bwd`` (forward, then the gradients of x and every parameter). dtype: fp32 on
the CPU; fp32 (TF32 where PyTorch allows it by default: cuDNN RNNs do) and fp16 on CUDA.
Before timing, each ctxfast backend is checked in eval mode (no mask) on the first two
sequences: its output (the last layer's, not the states) against the module's own
``eager`` backend in float64, within twice the error of eager at the same dtype plus a
floor (1e-5 on the CPU; on CUDA 5e-3 fp32, TF32's, and 1e-3 fp16); the baselines likewise
on the unclipped cases.

FLOPs counted (``extra_info["flops"]``): the GEMMs, ``2·T·B·(4H·(I + P) + P·H)`` per layer
and direction (the last term with a projection), x3 for fwd+bwd.
``CTXFAST_BENCH_QUICK=1``: small cases (seconds on a CPU).
"""
from __future__ import annotations

import warnings
from typing import List, NamedTuple, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _common
import ctxfast
from ctxfast import _dispatch

OP = "lstm"
BASELINE = "nn.LSTM+WeightDropout"
NO_DROP = "nn.LSTM-no-drop"
MODES = ("fwd", "fwd+bwd")
KERNEL_BACKENDS = ("triton", "cuda", "cpu", "eager")
BACKENDS = (*KERNEL_BACKENDS, NO_DROP, BASELINE)


class Layer(NamedTuple):
    """One LSTM module of a case (``nn.LSTM`` arguments plus ELMo's clips)."""
    input_size: int
    hidden_size: int
    num_layers: int = 1
    bidirectional: bool = False
    proj_size: int = 0
    cell_clip: Optional[float] = None
    proj_clip: Optional[float] = None


class Case(NamedTuple):
    model: str
    layers: Tuple[Layer, ...]
    T: int
    B: int
    p: float = 0.2                          # DropConnect on every weight_hh
    dtype: str = "float32"
    devices: Tuple[str, ...] = ("cpu", "cuda")

    @property
    def name(self) -> str:                  # "ULMFiT T70 B64 fp16"
        return f"{self.model} T{self.T} B{self.B}" + ("" if self.dtype == "float32"
                                                      else f" {self.dtype.replace('float', 'fp')}")

    @property
    def clipped(self) -> bool:
        return any(l.cell_clip is not None or l.proj_clip is not None for l in self.layers)


def _awd(emb: int, hid: int, n: int = 3) -> Tuple[Layer, ...]:
    """AWD-LSTM's layers: emb -> hid -> ... -> hid -> emb, each a single-layer LSTM."""
    return tuple(Layer(emb if k == 0 else hid, hid if k != n - 1 else emb) for k in range(n))


def _elmo(cell: int, proj: int, clip: Optional[float] = 3.0) -> Tuple[Layer, ...]:
    return (Layer(proj, cell, 2, True, proj, clip, clip),)


QUICK_CASES = (
    Case("ULMFiT-mini", _awd(32, 64), T=20, B=8),
    Case("ELMo-mini", _elmo(128, 32), T=10, B=4),
)
FULL_CASES = (
    # CPU (fp32): ULMFiT's layers at a small batch; a scaled-down ELMo
    Case("ULMFiT", _awd(400, 1152), T=70, B=16, devices=("cpu",)),
    Case("ELMo-small", _elmo(1024, 128), T=20, B=8, devices=("cpu",)),
    # CUDA: the real sizes, fp32 and fp16
    *(Case("ULMFiT", _awd(400, 1152), T=70, B=64, dtype=dt, devices=("cuda",))
      for dt in ("float32", "float16")),
    *(Case("ELMo", _elmo(4096, 512), T=50, B=32, dtype=dt, devices=("cuda",))
      for dt in ("float32", "float16")),
)


def _params():
    return _common.params(QUICK_CASES, FULL_CASES, MODES, BACKENDS)


def flops(case: Case, mode: str) -> int:
    """GEMM FLOPs of one call (see the module docstring)."""
    total = 0
    for l in case.layers:
        D = 2 if l.bidirectional else 1
        P = l.proj_size or l.hidden_size
        for k in range(l.num_layers):
            I = l.input_size if k == 0 else P * D
            per_step = 4 * l.hidden_size * (I + P) + (P * l.hidden_size if l.proj_size else 0)
            total += D * 2 * case.T * case.B * per_step
    return total * (3 if mode == "fwd+bwd" else 1)


# --------------------------------------------------------------------------- the baseline

class FastaiWeightDropLSTM(nn.Module):
    """``nn.LSTM`` with fastai's ``WeightDropout`` (re-written): the undropped
    ``weight_hh_l{k}{_reverse}`` are parameters of this wrapper (``<name>_raw``); before
    every forward a dropped copy ``F.dropout(raw, p, training)`` is set as the LSTM's
    weight, so autograd carries the gradient back to the raw weight through the dropout.
    ``flatten_parameters`` is disabled, as in fastai."""

    def __init__(self, lstm: nn.LSTM, p: float) -> None:
        super().__init__()
        self.module, self.p = lstm, p
        self.names = [n for n in lstm._flat_weights_names if n.startswith("weight_hh")]
        for n in self.names:
            w = getattr(lstm, n)
            delattr(lstm, n)                                # no longer a parameter of the LSTM
            self.register_parameter(f"{n}_raw", nn.Parameter(w.detach().clone()))
            setattr(lstm, n, w.detach().clone())            # a plain tensor, replaced per call
        lstm.flatten_parameters = lambda: None

    def forward(self, x: torch.Tensor, hx=None):
        for n in self.names:
            raw = getattr(self, f"{n}_raw")
            # as fastai: a clone in eval mode (assigning the Parameter itself would register
            # it with the LSTM, and the next training call could not replace it)
            setattr(self.module, n, F.dropout(raw, self.p) if self.training else raw.clone())
        with warnings.catch_warnings():   # "weights are not part of single contiguous chunk"
            warnings.simplefilter("ignore", UserWarning)
            return self.module(x, hx)


def _nn_lstm(l: Layer, device, dtype) -> nn.LSTM:
    return nn.LSTM(l.input_size, l.hidden_size, l.num_layers, bidirectional=l.bidirectional,
                   proj_size=l.proj_size, device=device, dtype=dtype)


def _stack(case: Case, backend: str, device, dtype) -> List[nn.Module]:
    """The case's modules for `backend`, all from the same seeded weights."""
    mods: List[nn.Module] = []
    for i, l in enumerate(case.layers):
        torch.manual_seed(1000 + i)
        ref = _nn_lstm(l, device, dtype)
        if backend == NO_DROP:
            ref.flatten_parameters()
            mods.append(ref)
        elif backend == BASELINE:
            mods.append(FastaiWeightDropLSTM(ref, case.p))
        else:
            m = ctxfast.nn.WeightDropLSTM(
                l.input_size, l.hidden_size, l.num_layers, bidirectional=l.bidirectional,
                proj_size=l.proj_size, weight_dropout=case.p, cell_clip=l.cell_clip,
                proj_clip=l.proj_clip, backend=backend, device=device, dtype=dtype)
            m.load_state_dict(ref.state_dict())
            mods.append(m)
    for m in mods:
        m.train()
    return mods


def _run(mods: List[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for m in mods:
        x = m(x)[0]
    return x


# --------------------------------------------------------------------------- check

def _skip_reason(backend: str, device: torch.device) -> Optional[str]:
    if backend in (BASELINE, NO_DROP):
        return None
    if backend == "eager" and device.type == "cuda" and not _common.quick():
        # ctxfast's per-step Python loop is the reference, not a peer anyone runs: at the
        # real sizes it costs 0.1-0.2 s a call and tells nothing cuDNN does not
        return "the eager reference loop is not timed at the CUDA sizes (the peers are cuDNN)"
    if backend == "triton" and device.type != "cuda":
        return "triton on CPU tensors runs in the Triton interpreter: only timed on CUDA"
    if backend not in _dispatch.registered_ops()[OP]:
        return f"ctxfast.lstm has no {backend!r} backend in this build"
    return ctxfast.why_unavailable(backend, device)


def _check(case: Case, backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Eval mode (no mask), first two sequences: `backend` at `dtype` against ctxfast's
    eager backend in float64, within 2x the error of eager at the same dtype plus a floor
    (the project's rule: fp16 inputs alone put every backend, cuDNN included, ~3e-2 from
    float64, which a fixed fp16 tolerance of 3e-2 failed on the first H100 run)."""
    if backend == "eager" or (backend in (BASELINE, NO_DROP) and case.clipped):
        return
    torch.manual_seed(7)
    x = torch.randn(case.T, 2, case.layers[0].input_size, device=device, dtype=torch.float64)
    errs = {}
    for name, be, dt in (("ours", backend, dtype), ("eager", "eager", dtype),
                         ("ref", "eager", torch.float64)):
        # Same weights for all three: built in float32 (the seeded init draws differ by
        # dtype), then cast.
        mods = [m.to(dt).eval() for m in _stack(case, be, device, torch.float32)]
        with torch.no_grad():
            errs[name] = _run(mods, x.to(dt)).double()
    # Floor: float32 GEMMs on CUDA may run in TF32 (cuDNN's default), ~1e-3 relative.
    floor = 1e-5 if device.type == "cpu" else (5e-3 if dtype == torch.float32 else 1e-3)
    _common.assert_within_2x_eager(f"{backend} {case.name} {dtype}", errs["ours"],
                                   errs["eager"], errs["ref"], floor)


# --------------------------------------------------------------------------- benchmark

@pytest.mark.parametrize("case, mode, backend", _params())
def test_lstm(benchmark, bench_device, case: Case, mode: str, backend: str):
    reason = _skip_reason(backend, bench_device)
    if reason is not None:
        pytest.skip(reason)
    dtype = getattr(torch, case.dtype)
    _common.describe(benchmark, op=OP, case=case.name, mode=mode, backend=backend,
                     dtype=dtype, device=bench_device, baseline=BASELINE, T=case.T,
                     series=case.model, flops=flops(case, mode), p=case.p,
                     layers=[list(l) for l in case.layers], batch=case.B)
    with _common.oom_guard(benchmark, bench_device):
        _check(case, backend, bench_device, dtype)
        mods = _stack(case, backend, bench_device, dtype)
        params = [p for m in mods for p in m.parameters()]

        def make():
            x = torch.randn(case.T, case.B, case.layers[0].input_size, device=bench_device,
                            dtype=dtype)
            if mode == "fwd":
                return (x,)
            D = 2 if case.layers[-1].bidirectional else 1
            out_size = D * (case.layers[-1].proj_size or case.layers[-1].hidden_size)
            g = torch.randn(case.T, case.B, out_size, device=bench_device, dtype=dtype)
            return (x.requires_grad_(True), g)

        sets = _common.input_sets(make, bench_device)
        if mode == "fwd":
            def fn(x):
                with torch.no_grad():
                    return _run(mods, x)
        else:
            def fn(x, g):
                return torch.autograd.grad(_run(mods, x), [x, *params], g)

        quick = _common.quick()
        _common.measure(benchmark, fn, sets, bench_device, budget_s=0.4 if quick else 2.0,
                        min_rounds=5 if quick else 10)
