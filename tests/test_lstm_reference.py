"""ctxfast.reference.lstm (the specification) against torch.nn.LSTM and a hand-written
AllenNLP-style cell (LstmCellWithProjection's step: clamp the cell, project, clamp the
projection), in float64, forward and every gradient."""
import pytest
import torch
from torch.func import functional_call

from ctxfast import reference
from utils import assert_close

DT = torch.float64


def _lstm_module(I, H, P, bidirectional=False):
    return torch.nn.LSTM(I, H, proj_size=P if P != H else 0, bidirectional=bidirectional,
                         dtype=DT)


def _params(mod, suffix=""):
    """(w_ih, w_hh, b_ih, b_hh, w_hr | None) of layer 0 (suffix "_reverse": other direction)."""
    g = lambda n: getattr(mod, n + suffix, None)  # noqa: E731
    return [g("weight_ih_l0"), g("weight_hh_l0"), g("bias_ih_l0"), g("bias_hh_l0"),
            g("weight_hr_l0")]


def _grads(outputs, inputs):
    gs = [torch.randn_like(o) for o in outputs]
    return torch.autograd.grad(outputs, [t for t in inputs if t is not None], gs), gs


@pytest.mark.parametrize("P", [7, 0], ids=["proj", "noproj"])
@pytest.mark.parametrize("given_hx", [True, False])
def test_equals_nn_lstm(P, given_hx):
    T, B, I, H = 6, 3, 5, 9
    P = P or H
    mod = _lstm_module(I, H, P)
    x = torch.randn(T, B, I, dtype=DT, requires_grad=True)
    h0 = torch.randn(B, P, dtype=DT, requires_grad=True)
    c0 = torch.randn(B, H, dtype=DT, requires_grad=True)
    w = _params(mod)
    out, (h, c) = reference.lstm(x, (h0, c0) if given_hx else None, *w)
    out_nn, (h_nn, c_nn) = mod(x, (h0[None], c0[None]) if given_hx else None)
    assert_close(out, out_nn, 1e-12, "out")
    assert_close(h, h_nn[0], 1e-12, "h_n")
    assert_close(c, c_nn[0], 1e-12, "c_n")
    leaves = [x, *w] + ([h0, c0] if given_hx else [])
    leaves = [t for t in leaves if t is not None]
    gs = [torch.randn_like(t) for t in (out, h, c)]
    ours = torch.autograd.grad((out, h, c), leaves, gs)
    theirs = torch.autograd.grad((out_nn, h_nn[0], c_nn[0]), leaves, gs)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(a, b, 1e-12, f"grad of leaf {k}")


def test_mask_equals_nn_lstm_with_dropped_weight():
    T, B, I, H, P, p = 5, 2, 4, 8, 6, 0.4
    mod = _lstm_module(I, H, P)
    x = torch.randn(T, B, I, dtype=DT, requires_grad=True)
    w_ih, w_hh, b_ih, b_hh, w_hr = _params(mod)
    mask = (torch.rand(4 * H, P) >= p).to(DT)
    assert 0 < mask.sum() < mask.numel()
    out, (h, c) = reference.lstm(x, None, w_ih, w_hh, b_ih, b_hh, w_hr, weight_mask=mask,
                                 weight_dropout=p)
    dropped = {"weight_hh_l0": w_hh * mask / (1 - p)}
    out_nn, (h_nn, c_nn) = functional_call(mod, dropped, (x,))
    assert_close(out, out_nn, 1e-12, "out")
    assert_close(c, c_nn[0], 1e-12, "c_n")
    gs = [torch.randn_like(t) for t in (out, c)]
    leaves = [x, w_ih, w_hh, b_ih, b_hh, w_hr]
    ours = torch.autograd.grad((out, c), leaves, gs)
    theirs = torch.autograd.grad((out_nn, c_nn[0]), leaves, gs)
    for name, a, b in zip(("x", "w_ih", "w_hh", "b_ih", "b_hh", "w_hr"), ours, theirs):
        assert_close(a, b, 1e-12, f"d{name}")
    # dropped weights get no gradient
    assert (ours[2][mask == 0] == 0).all()


def test_no_mask_ignores_weight_dropout():
    T, B, I, H = 3, 2, 4, 5
    w = _params(_lstm_module(I, H, H))
    x = torch.randn(T, B, I, dtype=DT)
    a, _ = reference.lstm(x, None, *w)
    b, _ = reference.lstm(x, None, *w, weight_dropout=0.5)
    assert torch.equal(a, b)


@pytest.mark.parametrize("P", [6, 0], ids=["proj", "noproj"])
def test_reverse_equals_flipped_time_and_nn_lstm_backward_direction(P):
    T, B, I, H = 5, 2, 3, 7
    P = P or H
    mod = _lstm_module(I, H, P, bidirectional=True)
    x = torch.randn(T, B, I, dtype=DT, requires_grad=True)
    h0 = torch.randn(2, B, P, dtype=DT)
    c0 = torch.randn(2, B, H, dtype=DT)
    w = _params(mod, "_reverse")
    out, (h, c) = reference.lstm(x, (h0[1], c0[1]), *w, reverse=True)
    flip, (hf, cf) = reference.lstm(x.flip(0), (h0[1], c0[1]), *w)
    assert_close(out, flip.flip(0), 1e-12, "out vs flipped")
    assert_close(h, hf, 1e-12, "h_n vs flipped")
    out_nn, (h_nn, c_nn) = mod(x, (h0, c0))
    assert_close(out, out_nn[..., P:], 1e-12, "out vs nn.LSTM reverse direction")
    assert_close(h, h_nn[1], 1e-12, "h_n vs nn.LSTM")
    assert_close(c, c_nn[1], 1e-12, "c_n vs nn.LSTM")
    g = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, g)
    (dx_nn,) = torch.autograd.grad(out_nn[..., P:], x, g)
    assert_close(dx, dx_nn, 1e-12, "dx")


def _allennlp_style(x, h0, c0, input_linearity, state_linearity, state_bias, projection,
                    cell_clip, proj_clip):
    """A hand-written step loop in the manner of AllenNLP's LstmCellWithProjection (forward
    direction, no dropout, every sequence full length)."""
    H = c0.shape[1]
    h, c = h0, c0
    outs = []
    for t in range(x.shape[0]):
        proj_in = x[t] @ input_linearity.t()
        proj_state = h @ state_linearity.t() + state_bias
        input_gate = torch.sigmoid(proj_in[:, 0 * H:1 * H] + proj_state[:, 0 * H:1 * H])
        forget_gate = torch.sigmoid(proj_in[:, 1 * H:2 * H] + proj_state[:, 1 * H:2 * H])
        memory_init = torch.tanh(proj_in[:, 2 * H:3 * H] + proj_state[:, 2 * H:3 * H])
        output_gate = torch.sigmoid(proj_in[:, 3 * H:4 * H] + proj_state[:, 3 * H:4 * H])
        memory = input_gate * memory_init + forget_gate * c
        memory = torch.clamp(memory, -cell_clip, cell_clip)
        pre_projection = output_gate * torch.tanh(memory)
        out = pre_projection @ projection.t()
        out = torch.clamp(out, -proj_clip, proj_clip)
        outs.append(out)
        h, c = out, memory
    return torch.stack(outs), h, c


def test_clips_match_allennlp_style_cell():
    T, B, I, H, P = 6, 3, 5, 10, 4
    cell_clip, proj_clip = 0.6, 0.25
    x = torch.randn(T, B, I, dtype=DT, requires_grad=True)
    h0 = (0.5 * torch.randn(B, P, dtype=DT)).requires_grad_()
    c0 = torch.randn(B, H, dtype=DT, requires_grad=True)
    w_ih = torch.randn(4 * H, I, dtype=DT, requires_grad=True)
    w_hh = torch.randn(4 * H, P, dtype=DT, requires_grad=True)
    b_hh = torch.randn(4 * H, dtype=DT, requires_grad=True)
    w_hr = torch.randn(P, H, dtype=DT, requires_grad=True)
    out, (h, c) = reference.lstm(x, (h0, c0), w_ih, w_hh, None, b_hh, w_hr,
                                 cell_clip=cell_clip, proj_clip=proj_clip)
    out_a, h_a, c_a = _allennlp_style(x, h0, c0, w_ih, w_hh, b_hh, w_hr, cell_clip, proj_clip)
    # the clips are active on a good share of the entries (else the test proves nothing)
    _, cells, _ = reference.lstm_recurrence(
        x.detach() @ w_ih.detach().t() + b_hh.detach(), h0.detach(), c0.detach(),
        w_hh.detach(), w_hr.detach(), cell_clip=cell_clip, proj_clip=proj_clip)
    assert (cells.abs() == cell_clip).float().mean() > 0.1
    assert (out.abs() == proj_clip).float().mean() > 0.1
    assert (out.abs() < proj_clip).any() and (cells.abs() < cell_clip).any()
    assert_close(out, out_a, 1e-12, "out")
    assert_close(c, c_a, 1e-12, "c_n")
    leaves = [x, h0, c0, w_ih, w_hh, b_hh, w_hr]
    gs = [torch.randn_like(t) for t in (out, h, c)]
    ours = torch.autograd.grad((out, h, c), leaves, gs)
    theirs = torch.autograd.grad((out_a, h_a, c_a), leaves, gs)
    for name, a, b in zip(("x", "h0", "c0", "w_ih", "w_hh", "b_hh", "w_hr"), ours, theirs):
        assert_close(a, b, 1e-12, f"d{name}")


def test_recurrence_outputs_cells_and_gates():
    T, B, H = 4, 2, 5
    xw = torch.randn(T, B, 4 * H, dtype=DT)
    h0, c0 = torch.randn(B, H, dtype=DT), torch.randn(B, H, dtype=DT)
    w_hh = torch.randn(4 * H, H, dtype=DT)
    out, cells, gates = reference.lstm_recurrence(xw, h0, c0, w_hh)
    assert out.shape == (T, B, H) and cells.shape == (T, B, H) and gates.shape == (T, B, 4 * H)
    i, f, g, o = gates.split(H, dim=-1)
    c_prev = torch.cat([c0[None], cells[:-1]])
    assert_close(cells, f * c_prev + i * g, 1e-12, "cells from gates")
    assert_close(out, o * torch.tanh(cells), 1e-12, "out from gates")
    assert ((i > 0) & (i < 1)).all() and ((g > -1) & (g < 1)).all()


def test_empty_sequence_returns_hx_unchanged():
    B, I, H, P = 2, 3, 5, 4
    x = torch.randn(0, B, I, dtype=DT)
    h0, c0 = torch.randn(B, P, dtype=DT), torch.randn(B, H, dtype=DT)
    w_ih, w_hh, w_hr = (torch.randn(4 * H, I, dtype=DT), torch.randn(4 * H, P, dtype=DT),
                        torch.randn(P, H, dtype=DT))
    out, (h, c) = reference.lstm(x, (h0, c0), w_ih, w_hh, None, None, w_hr)
    assert out.shape == (0, B, P)
    # equal copies, never the caller's tensors (as for T > 0; h_n.zero_() zeroed h0)
    assert torch.equal(h, h0) and torch.equal(c, c0)
    assert h.data_ptr() != h0.data_ptr() and c.data_ptr() != c0.data_ptr()
    out, (h, c) = reference.lstm(x, None, w_ih, w_hh, None, None, w_hr)
    assert out.shape == (0, B, P) and torch.equal(h, torch.zeros(B, P, dtype=DT))
