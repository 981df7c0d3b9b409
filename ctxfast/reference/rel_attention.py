"""Transformer-XL / XLNet relative-position attention, eager PyTorch (the specification of
``ctxfast.rel_attention``), written from the papers' equations with direct indexing by
distance.

Shapes: ``q [B, H, Tq, D]``; ``k, v [B, H, Tk, D]`` = ``[memory; current]``,
``mem_len = Tk - Tq``; ``r [H, R, D]`` relative encodings already projected per head;
``r_w_bias, r_r_bias [H, D]`` (the paper's u and v).

The distance of query ``i`` to key ``j`` is ``dist = mem_len + i - j``; row ``m`` of ``r``
encodes distance ``pos_start - m``, so the pair uses ``r[pos_start - dist]``. Default
``pos_start = Tk - 1`` (Transformer-XL: ``pos_seq = arange(klen - 1, -1, -1)``); XLNet's
bidirectional form is ``pos_start = Tk`` with ``R = Tk + Tq``.

Scores, for the visible pairs (masks as in ``reference.attention``)::

    A[i, j] = scale · ( (q_i + u)·k_j  +  (q_i + v)·r[pos_start − dist(i, j)]
                        [+ (q_i + r_s_bias)·seg_embed[s(i, j)]] )

with ``s = 0`` where ``seg_q[b, i] == seg_k[b, j]`` and 1 otherwise (XLNet's relative
segment encoding). Softmax over j, optional dropout on the probabilities, times v. A
query that sees no key gets zeros.

``window`` (optional, >= 1) adds a sliding window: pair (i, j) is visible only if
``dist(i, j) < window``, so with ``causal`` every query sees at most ``window`` keys, its
own position and the ``window - 1`` before it. Transformer-XL's ``same_length`` mask is
``window = mem_len`` (the configured memory length; its ``tril(-mask_shift_len)`` masks
exactly ``dist >= mem_len``).
"""
from typing import Optional

import torch
from torch import Tensor

from .attention import attention_mask, masked_softmax
from .rel_shift import rel_shift_pad_view


def distance_rows(Tq: int, Tk: int, pos_start: int, device=None) -> Tensor:
    """Long ``[Tq, Tk]``: the row of ``r`` that pair (i, j) uses, ``pos_start - (mem_len + i - j)``."""
    mem_len = Tk - Tq
    i = torch.arange(Tq, device=device).unsqueeze(1)
    j = torch.arange(Tk, device=device).unsqueeze(0)
    return pos_start - (mem_len + i - j)


def rel_attention(q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor,
                  r_r_bias: Tensor, *, causal: bool = True, pos_start: Optional[int] = None,
                  key_padding_mask: Optional[Tensor] = None, perm_rank: Optional[Tensor] = None,
                  perm_stream: str = "content", seg_q: Optional[Tensor] = None,
                  seg_k: Optional[Tensor] = None, seg_embed: Optional[Tensor] = None,
                  r_s_bias: Optional[Tensor] = None, dropout_mask: Optional[Tensor] = None,
                  dropout_p: float = 0.0, scale: Optional[float] = None,
                  window: Optional[int] = None) -> Tensor:
    """The specification (see the module docstring). Returns ``[B, H, Tq, D]``."""
    scores = rel_scores(q, k, r, r_w_bias, r_r_bias, causal=causal, pos_start=pos_start,
                        key_padding_mask=key_padding_mask, perm_rank=perm_rank,
                        perm_stream=perm_stream, seg_q=seg_q, seg_k=seg_k,
                        seg_embed=seg_embed, r_s_bias=r_s_bias, scale=scale, window=window)
    p = masked_softmax(scores)                                            # [B, H, Tq, Tk]
    if dropout_mask is not None and dropout_p > 0:
        p = p * dropout_mask / (1.0 - dropout_p)
    return torch.matmul(p.to(v.dtype), v)


def rel_scores(q: Tensor, k: Tensor, r: Tensor, r_w_bias: Tensor, r_r_bias: Tensor, *,
               causal: bool = True, pos_start: Optional[int] = None,
               key_padding_mask: Optional[Tensor] = None, perm_rank: Optional[Tensor] = None,
               perm_stream: str = "content", seg_q: Optional[Tensor] = None,
               seg_k: Optional[Tensor] = None, seg_embed: Optional[Tensor] = None,
               r_s_bias: Optional[Tensor] = None, scale: Optional[float] = None,
               window: Optional[int] = None) -> Tensor:
    """The scaled scores ``A`` of :func:`rel_attention` (arguments as there), ``-inf`` where
    a pair is not visible: ``[B, H, Tq, Tk]``."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    R = r.shape[1]
    pos_start = Tk - 1 if pos_start is None else pos_start
    scale = D ** -0.5 if scale is None else scale
    visible = attention_mask(B, Tq, Tk, causal=causal, key_padding_mask=key_padding_mask,
                             perm_rank=perm_rank, perm_stream=perm_stream,
                             device=q.device).unsqueeze(1)                # [B, 1, Tq, Tk]
    if window is not None:                                                # dist < window
        dist = (Tk - Tq) + torch.arange(Tq, device=q.device)[:, None] \
            - torch.arange(Tk, device=q.device)[None, :]                  # [Tq, Tk]
        visible = visible & (dist < window)
    # the query operands scaled first (as torch's own attention): at fp16 the unscaled
    # products may pass 65504 where the scaled scores do not
    qu = (q + r_w_bias[None, :, None, :]) * scale                         # [B, H, Tq, D]
    qw = (q + r_r_bias[None, :, None, :]) * scale
    ac = torch.matmul(qu, k.transpose(-1, -2))                            # [B, H, Tq, Tk]
    rows = distance_rows(Tq, Tk, pos_start, q.device)                     # [Tq, Tk]
    qr = torch.matmul(qw, r.transpose(-1, -2)[None])                      # [B, H, Tq, R]
    bd = torch.gather(qr, -1, rows.clamp(0, R - 1).expand(B, H, Tq, Tk))  # [B, H, Tq, Tk]
    bd = bd.masked_fill(~((rows >= 0) & (rows < R)), 0.0)                 # (never visible)
    scores = ac + bd
    if seg_embed is not None:
        qs = (q + r_s_bias[None, :, None, :]) * scale                     # [B, H, Tq, D]
        ef = torch.einsum("bhid,shd->bhis", qs, seg_embed)                # [B, H, Tq, 2]
        diff = (seg_q[:, :, None] != seg_k[:, None, :]).unsqueeze(1)      # [B, 1, Tq, Tk]
        scores = scores + torch.where(diff, ef[..., 1:2], ef[..., 0:1])
    return scores.masked_fill(~visible, float("-inf"))


def rel_attention_original(q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor,
                           r_r_bias: Tensor, *, scale: Optional[float] = None,
                           window: Optional[int] = None) -> Tensor:
    """The original Transformer-XL formulation (causal, ``pos_start = Tk - 1``, ``R = Tk``):
    einsum for AC and for the full ``[Tq, R]`` BD, the pad-and-view shift, a materialised
    causal mask (plus, with `window`, its ``same_length`` part ``tril(mem_len − window)``),
    softmax. The eager baseline of the benchmarks and a cross-check of
    :func:`rel_attention`."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    ac = torch.einsum("bhid,bhjd->bhij", q + r_w_bias[None, :, None], k)    # [B, H, Tq, Tk]
    bd = torch.einsum("bhid,hjd->bhij", q + r_r_bias[None, :, None], r)     # [B, H, Tq, R=Tk]
    bd = rel_shift_pad_view(bd)                                             # [B, H, Tq, Tk]
    scores = (ac + bd) * scale
    future = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).triu(1 + Tk - Tq)
    if window is not None:                                                  # same_length
        future = future | torch.ones_like(future).tril(Tk - Tq - window)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v)
