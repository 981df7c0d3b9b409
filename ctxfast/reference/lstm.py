"""LSTM with DropConnect on the recurrent weights, projection and clipping, eager PyTorch
(the specification of ``ctxfast.lstm``).

Math, per time step (gate order i, f, g, o as ``torch.nn.LSTM``; clipping and projection
as AllenNLP's ``LstmCellWithProjection``)::

    W      = w_hh * mask * scale                       DropConnect (mask None: W = w_hh)
    z_t    = xw_t + h_{t-1} @ Wᵀ                        xw_t = x_t @ w_ihᵀ + b_ih + b_hh
    i, f, o = sigmoid(z_i), sigmoid(z_f), sigmoid(z_o);  g = tanh(z_g)
    c_t    = clamp(f * c_{t-1} + i * g, -cell_clip, cell_clip)
    hp_t   = o * tanh(c_t)                              [B, H]
    h_t    = clamp(hp_t @ w_hrᵀ, -proj_clip, proj_clip) if w_hr is given else hp_t   [B, P]

``reverse=True`` consumes ``t = T-1, ..., 0`` (the backward direction of a biLSTM); the
outputs stay in the original time order: ``out[t]`` is the state after consuming ``x[t]``.

``lengths`` (sequence b has ``lengths[b]`` steps, the rest padding): a step ``t >=
lengths[b]`` leaves b's state as it is and outputs 0. Reversed, those steps come first,
so each sequence is consumed from its own last step (``pack_padded_sequence``'s meaning).

Shapes: T time steps, B batch, I input, H hidden, P = proj_size if w_hr is given else H.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def _clamp(x: Tensor, clip: float) -> Tensor:
    """clamp(x, -clip, clip); clip = inf means no clip."""
    # ==, not math.isinf: under torch.compile(dynamic=True) clip may be a traced float
    return x if clip == math.inf else x.clamp(-clip, clip)


def lstm_recurrence(xw: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor,
                    w_hr: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                    scale: float = 1.0, cell_clip: float = math.inf,
                    proj_clip: float = math.inf, reverse: bool = False,
                    lengths: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The recurrence of one layer and direction over all time steps, given the input
    projection ``xw``: the specification of the fused recurrence ops.

    Args:
        xw: ``[T, B, 4H]`` = ``x @ w_ihᵀ + b_ih + b_hh``.
        h0: ``[B, P]``; c0: ``[B, H]``.
        w_hh: ``[4H, P]``; w_hr: ``[P, H]`` or None (then P = H).
        mask: ``[4H, P]`` of 0/1 (w_hh's dtype) or None; scale: multiplies the masked weight.
        cell_clip, proj_clip: clip values (``math.inf``: no clip).
        reverse: consume ``t = T-1 .. 0``.
        lengths: ``[B]`` integers, or None (every sequence T steps): see the module.

    Returns:
        ``(out [T, B, P], cells [T, B, H], gates [T, B, 4H])``: ``h_t``, ``c_t`` (post-clip)
        and the post-activation gates ``(i, f, g, o)`` of every step, in time order
        (with ``lengths``: 0 past a sequence's end; ``cells`` there carries the state on).
    """
    T = xw.shape[0]
    H = c0.shape[1]
    W = w_hh if mask is None else w_hh * mask * scale          # [4H, P]
    h, c = h0, c0
    out, cells, gates = [None] * T, [None] * T, [None] * T
    for t in (range(T - 1, -1, -1) if reverse else range(T)):
        z = xw[t] + h @ W.t()                                    # [B, 4H]
        z_i, z_f, z_g, z_o = z.split(H, dim=1)                   # 4 x [B, H]
        i, f, g, o = torch.sigmoid(z_i), torch.sigmoid(z_f), torch.tanh(z_g), torch.sigmoid(z_o)
        c_new = _clamp(f * c + i * g, cell_clip)                 # [B, H]
        hp = o * torch.tanh(c_new)                               # [B, H]
        h_new = hp if w_hr is None else _clamp(hp @ w_hr.t(), proj_clip)   # [B, P]
        gates[t] = torch.cat([i, f, g, o], dim=1)                # [B, 4H]
        if lengths is None:
            h, c = h_new, c_new
        else:                                # past its end a sequence keeps its state
            on = (t < lengths).to(xw.device)[:, None]            # [B, 1]
            h, c = torch.where(on, h_new, h), torch.where(on, c_new, c)
            h_new, gates[t] = torch.where(on, h_new, 0), torch.where(on, gates[t], 0)
        out[t], cells[t] = h_new, c
    if T == 0:
        B, P = h0.shape
        return (xw.new_empty((0, B, P)), xw.new_empty((0, B, H)), xw.new_empty((0, B, 4 * H)))
    return torch.stack(out), torch.stack(cells), torch.stack(gates)


def lstm(x: Tensor, hx: Optional[Tuple[Tensor, Tensor]], w_ih: Tensor, w_hh: Tensor,
         b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None,
         w_hr: Optional[Tensor] = None, *, weight_mask: Optional[Tensor] = None,
         weight_dropout: float = 0.0, cell_clip: Optional[float] = None,
         proj_clip: Optional[float] = None, reverse: bool = False,
         lengths: Optional[Tensor] = None) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """One LSTM layer, one direction, time-major (the public signature of ``ctxfast.lstm``).

    Args:
        x: ``[T, B, I]``.
        hx: ``(h0 [B, P], c0 [B, H])`` or None (zeros).
        w_ih: ``[4H, I]``; w_hh: ``[4H, P]``; b_ih, b_hh: ``[4H]`` or None;
            w_hr: ``[P, H]`` or None.
        weight_mask: ``[4H, P]`` of 0/1 or None. With a mask, the recurrent weight is
            ``w_hh * weight_mask / (1 - weight_dropout)``; without one, ``weight_dropout``
            is not used.
        cell_clip, proj_clip: clip ``c_t`` to ``±cell_clip`` and the projection to
            ``±proj_clip`` (None: no clip).
        reverse: consume the sequence from ``t = T-1`` down to 0.
        lengths: ``[B]`` integers in ``[1, T]`` (sequence b is ``x[:lengths[b], b]``, the
            rest padding), or None: see the module.

    Returns:
        ``(out [T, B, P], (h_n [B, P], c_n [B, H]))``: ``h_n, c_n`` are the states after the
        last step consumed (``t = T-1``, or ``t = 0`` when reversed); for ``T = 0`` they are
        the initial states. With ``lengths``: ``out`` is 0 past each sequence's end and
        ``h_n, c_n`` are each sequence's states after its last step consumed.
    """
    T, B, _ = x.shape
    H = w_hh.shape[0] // 4
    P = w_hh.shape[1]
    if hx is None:
        hx = (x.new_zeros((B, P)), x.new_zeros((B, H)))
    h0, c0 = hx
    bias = b_ih if b_hh is None else b_hh if b_ih is None else b_ih + b_hh
    xw = F.linear(x, w_ih, bias)                                 # [T, B, 4H]
    scale = 1.0 / (1.0 - weight_dropout) if weight_mask is not None else 1.0
    out, cells, _ = lstm_recurrence(
        xw, h0, c0, w_hh, w_hr, weight_mask, scale,
        math.inf if cell_clip is None else float(cell_clip),
        math.inf if proj_clip is None else float(proj_clip), reverse, lengths)
    if T == 0:                  # copies, as for T > 0 (nn.LSTM's are new tensors)
        return out, (h0.clone(), c0.clone())
    last = 0 if reverse else T - 1
    if lengths is not None and not reverse:     # each sequence's own last step
        last = (lengths.to(x.device) - 1, torch.arange(B, device=x.device))
    return out, (out[last].clone(), cells[last].clone())   # copies, as nn.LSTM's
