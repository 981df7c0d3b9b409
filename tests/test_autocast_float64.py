"""Autocast leaves float64 alone, as torch's own ops do (SDPA, F.linear, nn.LSTM): under
``torch.autocast`` a float64 call of every op and of ``WeightDropLSTM`` runs in float64,
bit for bit as outside the region, and float64 beside float32 inputs is refused as a dtype
mismatch (autocast casts the float32 one, SDPA then refuses). The ops cast every floating
tensor, float64 included, to bf16: 2.8e-3 relative error on float64 attention, and a
float64 Transformer-XL under autocast failed in its output projection."""
import pytest
import torch

import ctxfast
from utils import ATTN_BACKENDS, DEVICE

BACKENDS = [b for b in ATTN_BACKENDS]
f64 = torch.float64


def _rand(*shape):
    return torch.randn(*shape, dtype=f64, device=DEVICE)


def _calls():
    """{op: (callable of backend and dtype of the float32 operand)}: the first tensor of
    every call float64; `other` the dtype of a second operand (float64, or float32 for the
    mismatch)."""
    q, k, v = _rand(1, 2, 9, 16), _rand(1, 2, 12, 16), _rand(1, 2, 12, 16)
    r, u, w = _rand(2, 21, 16), _rand(2, 16), _rand(2, 16)
    qv, kv = _rand(9, 2, 16), _rand(12, 2, 16)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    x, w_ih, w_hh = _rand(5, 3, 8), _rand(24, 8), _rand(24, 6)
    lw, lb = _rand(7, 8), _rand(7)
    return {
        "attention": lambda be, o: ctxfast.attention(q, k.to(o), v, causal=True, backend=be),
        "rel_attention": lambda be, o: ctxfast.rel_attention(q, k.to(o), v, r, u, w,
                                                             backend=be),
        "attention_varlen": lambda be, o: ctxfast.attention_varlen(
            qv, kv.to(o), kv, cu_q, cu_k, 5, 7, causal=True, backend=be),
        "lstm": lambda be, o: ctxfast.lstm(x, None, w_ih, w_hh.to(o), backend=be)[0],
        "linear": lambda be, o: ctxfast.linear(x, lw.to(o), lb, backend=be),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(_calls()))
def test_float64_runs_in_float64_under_autocast(op, backend):
    torch.manual_seed(0)
    call = _calls()[op]
    want = call(backend, f64)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = call(backend, f64)
        assert got.dtype == f64, f"{op}: float64 under autocast came out {got.dtype}"
        # float64 beside a float32 operand: autocast casts the float32 one only
        with pytest.raises(TypeError, match="dtype"):
            call(backend, torch.float32)
    assert torch.equal(got, want), f"{op}: float64 under autocast differs from outside it"


def test_float64_lstm_module_runs_in_float64_under_autocast():
    torch.manual_seed(0)
    lstm = ctxfast.nn.WeightDropLSTM(8, 6, num_layers=2, weight_dropout=0.0).to(DEVICE).double()
    ref = torch.nn.LSTM(8, 6, num_layers=2).to(DEVICE).double()
    ref.load_state_dict(lstm.state_dict())
    x = _rand(5, 3, 8)
    want = lstm(x)[0]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got, (h, c) = lstm(x)
        assert got.dtype == h.dtype == c.dtype == f64
        assert ref(x)[0].dtype == f64                       # nn.LSTM's behaviour, the model
        with pytest.raises(TypeError, match="does not match the parameters' dtype"):
            lstm(x.float())
    assert torch.equal(got, want)
