"""``ctxfast.nn.MultiheadAttention``: a drop-in for ``torch.nn.MultiheadAttention`` whose
attention runs through ``ctxfast.attention`` (no ``[T, T]`` mask or score tensor).

Same constructor arguments, parameter names and forward signature, so an existing
``state_dict`` loads as it is. Supported masks: ``key_padding_mask`` (bool, True =
padding; or float with values 0 and -inf only, -inf = padding, which torch adds to the
scores: other values are refused, and under ``torch.compile`` not checked) and
``is_causal=True`` (with ``attn_mask`` None or the causal mask itself). A general
``attn_mask`` is not expressible from O(T) data and raises ``NotImplementedError``.
``need_weights=True`` (torch's default) also returns the attention weights, which this
computes separately in eager PyTorch (O(T²)); pass ``need_weights=False`` for the fast path.
They are the weights before attention dropout (torch returns them after it, in training);
a query that sees no key (every key padding) has weights 0, as its output (the out_proj
bias alone), where torch gives NaN for both.

``add_bias_kv`` / ``add_zero_attn``: the extra key is visible to every query, also with
``is_causal`` (as torch pads its mask with a visible column). The op takes the extra keys
first (its causal diagonal is aligned to the last key, so appended keys would shift it by
one); the returned weights have them last, as torch's.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops, reference


def _bool_padding(mask: Tensor) -> Tensor:
    """A float key_padding_mask (torch adds it to the scores) as the bool one it equals:
    -inf = padding; only 0 and -inf are expressible (checked outside torch.compile, where
    reading the values would break the graph)."""
    if not mask.dtype.is_floating_point:
        raise TypeError(f"ctxfast.nn.MultiheadAttention: key_padding_mask must be bool (True = "
                        f"padding) or float (0 / -inf), got {mask.dtype}")
    padding = torch.isneginf(mask)
    if not torch.compiler.is_compiling() and not bool((padding | (mask == 0)).all()):
        raise ValueError("ctxfast.nn.MultiheadAttention: a float key_padding_mask must hold "
                         "only 0 and -inf (an additive mask of other values is not "
                         "supported); or pass a bool mask (True = padding)")
    return padding


class MultiheadAttention(nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` on ctxfast's fused attention.

    Extra keyword: ``backend`` (``"triton" | "cpu" | "eager" | None``), passed to
    ``ctxfast.attention``.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None, *, backend: Optional[str] = None) -> None:
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias,
                         add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim,
                         vdim=vdim, batch_first=batch_first, device=device, dtype=dtype)
        self.backend = backend

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """query ``[Tq, B, E]`` (``[B, Tq, E]`` if batch_first), key/value ``[Tk, B, kdim/vdim]``
        -> (output ``[Tq, B, E]``, weights ``[B, Tq, Tk]`` averaged over heads (or
        ``[B, H, Tq, Tk]``) if need_weights else None). Unbatched 2-D inputs work too."""
        _check_shapes(self, query, key, value)
        unbatched = query.dim() == 2
        if unbatched:                                        # [T, E] -> [T, 1, E] (or [1, T, E])
            bdim = 0 if self.batch_first else 1
            query, key, value = (t.unsqueeze(bdim) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if self.batch_first:                                 # [B, T, E] -> [T, B, E]
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        Tq, B, E = query.shape
        if key.shape[1] != B:
            raise ValueError(f"ctxfast.nn.MultiheadAttention: query and key must have the same "
                             f"batch size, got {B} and {key.shape[1]}")
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (B, key.shape[0]):
            raise ValueError(f"ctxfast.nn.MultiheadAttention: key_padding_mask must have shape "
                             f"[B, Tk] = [{B}, {key.shape[0]}], got "
                             f"{tuple(key_padding_mask.shape)}")
        causal = is_causal
        if attn_mask is not None:       # (under torch.compile only its shape is checked)
            if not (is_causal and _is_causal_mask(attn_mask, Tq, key.shape[0])):
                raise NotImplementedError(
                    "ctxfast.nn.MultiheadAttention: a general attn_mask is not supported "
                    "(masks come from O(T) data); use key_padding_mask and/or is_causal=True")
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            key_padding_mask = _bool_padding(key_padding_mask)

        q, k, v = self._project(query, key, value)           # [T, B, E] each
        extra_k, extra_v = [], []                            # keys every query sees, first
        if self.bias_k is not None:                          # one extra learned key/value
            extra_k.append(self.bias_k.expand(1, B, E))
            extra_v.append(self.bias_v.expand(1, B, E))
        if self.add_zero_attn:                               # one extra zero key/value
            extra_k.append(k.new_zeros(1, B, E))
            extra_v.append(v.new_zeros(1, B, E))
        n_extra = len(extra_k)
        if n_extra:                                          # [n_extra + Tk, B, E]
            k, v = torch.cat(extra_k + [k]), torch.cat(extra_v + [v])
            if key_padding_mask is not None:
                key_padding_mask = torch.cat([key_padding_mask.new_zeros(B, n_extra),
                                              key_padding_mask], 1)
        H, Dh = self.num_heads, self.head_dim
        Tk = k.shape[0]
        # [T, B, E] -> [T, B, H, Dh] -> [B, H, T, Dh]
        q, k, v = (t.reshape(t.shape[0], B, H, Dh).permute(1, 2, 0, 3) for t in (q, k, v))
        if causal and Tk - n_extra < Tq:
            raise ValueError(f"ctxfast.nn.MultiheadAttention: is_causal needs at least as many "
                             f"keys as queries, got Tq={Tq}, Tk={Tk - n_extra}")
        out = ops.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                            dropout_p=self.dropout if self.training else 0.0,
                            backend=self.backend)            # [B, H, Tq, Dh]
        out = out.permute(2, 0, 1, 3).reshape(Tq, B, E)      # [Tq, B, E]
        out = self.out_proj(out)
        weights = None
        if need_weights:                                     # eager, O(T²): API compatibility
            mask = reference.attention_mask(B, Tq, Tk, causal=causal,
                                            key_padding_mask=key_padding_mask, device=q.device)
            scores = torch.matmul(q * Dh ** -0.5, k.transpose(-1, -2))   # q first, as torch
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
            weights = torch.softmax(scores, -1)              # [B, H, Tq, Tk]
            weights = weights.masked_fill(~mask[:, None].any(-1, keepdim=True), 0.0)
            if n_extra:                                      # torch's order: extra keys last
                weights = torch.cat([weights[..., n_extra:], weights[..., :n_extra]], -1)
            if average_attn_weights:
                weights = weights.mean(1)                    # [B, Tq, Tk]
        if self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(0 if self.batch_first else 1)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor):
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            return (F.linear(query, w[:E], bq), F.linear(key, w[E:2 * E], bk),
                    F.linear(value, w[2 * E:], bv))
        return (F.linear(query, self.q_proj_weight, bq), F.linear(key, self.k_proj_weight, bk),
                F.linear(value, self.v_proj_weight, bv))


def _is_causal_mask(mask: Tensor, Tq: int, Tk: int) -> bool:
    """True if `mask` (``[Tq, Tk]`` or ``[B·H, Tq, Tk]``; bool, True = masked, or float, -inf
    = masked and 0 elsewhere) is the causal mask: a float mask with any other value (a bias:
    ALiBi, relative positions) is not, whatever its -inf entries."""
    if mask.dim() not in (2, 3) or tuple(mask.shape[-2:]) != (Tq, Tk):
        return False
    if torch.compiler.is_compiling():   # its values: a graph break; is_causal vouches for them
        return True
    want = torch.ones(Tq, Tk, dtype=torch.bool, device=mask.device).triu(1 + Tk - Tq)
    if mask.dtype == torch.bool:
        return bool((mask == want).all())
    return bool(((mask == float("-inf")) == want).all() and (mask[..., ~want] == 0).all())


def _check_shapes(mha, query, key, value) -> None:
    """query, key, value are 3-D (or all 2-D: unbatched) with last dims embed_dim, kdim and
    vdim, key and value of one length and batch; else ValueError naming the argument."""
    name = "ctxfast.nn.MultiheadAttention"
    layout = "[B, T, E]" if mha.batch_first else "[T, B, E]"
    for arg, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {arg} must be a tensor, got {type(t).__name__}")
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(f"{name}: query, key and value must all be {layout} or all "
                         f"unbatched [T, E], got shapes {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    for arg, t, dim, what in (("query", query, mha.embed_dim, "embed_dim"),
                              ("key", key, mha.kdim, "kdim"),
                              ("value", value, mha.vdim, "vdim")):
        if t.shape[-1] != dim:
            raise ValueError(f"{name}: {arg} must have last dim {what} = {dim}, got shape "
                             f"{tuple(t.shape)}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"{name}: key and value must have the same length and batch, got "
                         f"shapes {tuple(key.shape)} and {tuple(value.shape)}")
