"""Scaled-dot-product attention with every mask the seed models use, eager PyTorch
(the specification of ``ctxfast.attention``).

Layout ``[B, H, T, D]``. Keys are ``[memory; current]``: ``mem_len = Tk - Tq``. Key
``j`` is the current token ``t = j - mem_len`` when ``j >= mem_len``. Query ``i`` sees
key ``j`` iff every mask given allows it:

* causal:           ``j <= i + mem_len`` (bottom-right aligned)
* key padding:      ``key_padding_mask[b, j]`` is False (True = padding)
* permutation (XLNet), ``r = perm_rank[b]``: memory keys always; current key ``t`` iff
  ``r[t] <= r[i]`` (content stream) or ``r[t] < r[i]`` (query stream)

``out[i] = Σ_j softmax_j(scale · q_i·k_j over the visible j) · v_j``; a query that sees no
key gets ``out[i] = 0`` (and zero gradient), never NaN.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def attention_mask(B: int, Tq: int, Tk: int, *, causal: bool = False,
                   key_padding_mask: Optional[Tensor] = None,
                   perm_rank: Optional[Tensor] = None, perm_stream: str = "content",
                   device=None) -> Tensor:
    """Bool ``[B, Tq, Tk]``: True where query i may see key j (materialised: reference only)."""
    mem_len = Tk - Tq
    i = torch.arange(Tq, device=device).view(1, Tq, 1)
    j = torch.arange(Tk, device=device).view(1, 1, Tk)
    visible = torch.ones(B, Tq, Tk, dtype=torch.bool, device=device)
    if causal:
        visible = visible & (j <= i + mem_len)
    if key_padding_mask is not None:
        visible = visible & ~key_padding_mask.bool().view(B, 1, Tk)
    if perm_rank is not None:
        rank_q = perm_rank.view(B, Tq, 1)                        # rank of query i
        rank_k = torch.cat([perm_rank.new_zeros(B, mem_len), perm_rank], 1).view(B, 1, Tk)
        sees = rank_k < rank_q if perm_stream == "query" else rank_k <= rank_q
        visible = visible & ((j < mem_len) | sees)              # memory always visible
    return visible


def masked_softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dim of scores with ``-inf`` at the pairs not visible; a row
    with no visible pair (or no key at all) gives zeros."""
    # the maxima over one more -inf column: Tk = 0 needs no branch, and torch.compile can
    # trace a Tk known only from data (a packed batch)
    row_max = F.pad(scores, (0, 1), value=float("-inf")).amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(-1, keepdim=True)
    return p / torch.where(denom > 0, denom, torch.ones_like(denom))


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              key_padding_mask: Optional[Tensor] = None, perm_rank: Optional[Tensor] = None,
              perm_stream: str = "content", dropout_mask: Optional[Tensor] = None,
              dropout_p: float = 0.0, scale: Optional[float] = None) -> Tensor:
    """q ``[B, H, Tq, D]``, k ``[B, H, Tk, D]``, v ``[B, H, Tk, Dv]`` -> ``[B, H, Tq, Dv]``.

    ``dropout_mask`` (bool ``[B, H, Tq, Tk]``, True = keep) with ``dropout_p`` applies
    attention dropout ``P * keep / (1 - p)`` after the softmax.
    """
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    visible = attention_mask(B, Tq, Tk, causal=causal, key_padding_mask=key_padding_mask,
                             perm_rank=perm_rank, perm_stream=perm_stream,
                             device=q.device).unsqueeze(1)           # [B, 1, Tq, Tk]
    # q scaled first (as torch's own attention): at fp16, q·k may pass 65504 where the
    # scaled score does not
    scores = torch.matmul(q * scale, k.transpose(-1, -2))           # [B, H, Tq, Tk]
    p = masked_softmax(scores.masked_fill(~visible, float("-inf")))  # empty rows stay 0
    if dropout_mask is not None and dropout_p > 0:
        p = p * dropout_mask / (1.0 - dropout_p)
    return torch.matmul(p.to(v.dtype), v)                            # [B, H, Tq, Dv]
