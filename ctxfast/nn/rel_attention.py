"""``ctxfast.nn.RelPartialLearnableMultiHeadAttn``: the Transformer-XL attention layer on
``ctxfast.rel_attention`` — same constructor, parameter names (``qkv_net``, ``r_net``,
``o_net``, ``layer_norm``, ``r_w_bias``, ``r_r_bias``) and forward
``(w, r, attn_mask=None, mems=None)`` (with its own biases, as in the ``untie_r``
variant). The original code's calling convention, where the model owns the biases and
passes them, works too: ``forward(w, r, r_w_bias, r_r_bias, attn_mask=None, mems=None)``;
built with ``own_biases=False`` the layer has exactly the original layer's parameters,
so an original layer's ``state_dict`` loads with ``strict=True``.

Layouts as in the original: ``w [qlen, bsz, d_model]``, ``r [rlen, d_model]`` (or
``[rlen, 1, d_model]``) with ``rlen = klen = mlen + qlen`` and row m encoding distance
``klen - 1 - m``, ``mems [mlen, bsz, d_model]``. ``attn_mask`` may be the standard causal
mask ``triu(ones(qlen, klen), 1 + mlen)`` (True = masked), which runs as ``causal=True``,
or that mask plus the original code's ``same_length`` part ``tril(ones(qlen, klen),
-mask_shift_len)``, which runs as ``causal=True, window=mlen + mask_shift_len`` (= the
model's ``mem_len``); other masks raise ``NotImplementedError``. ``attn_mask=None`` (no
mask: every query sees every key) with ``qlen = 1`` is the causal result; with ``qlen > 1``
the keys after a query are at negative distances, down to ``1 - qlen``, which klen rows
of r do not encode (the original code's ``rel_shift`` wraps them onto other rows, a
result that means nothing), so r must then carry them: ``rlen = klen + qlen - 1``, row m
still encoding distance ``klen - 1 - m`` (``pos_seq = arange(klen - 1, -qlen, -1)``);
None with klen rows and ``qlen > 1`` raises ``ValueError``.
"""
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops


class RelPartialLearnableMultiHeadAttn(nn.Module):
    def __init__(self, n_head: int, d_model: int, d_head: int, dropout: float,
                 dropatt: float = 0.0, tgt_len=None, ext_len=None, mem_len=None,
                 pre_lnorm: bool = False, r_r_bias: Optional[Tensor] = None,
                 r_w_bias: Optional[Tensor] = None, layer_norm_epsilon: float = 1e-5, *,
                 own_biases: bool = True, backend: Optional[str] = None):
        super().__init__()
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.dropout = dropout
        # attention dropout as the original's module: ``layer.dropatt.p = x`` (the original
        # train.py's update_dropatt) changes the rate on every backend
        self.dropatt = nn.Dropout(dropatt)
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.drop = nn.Dropout(dropout)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.scale = 1 / (d_head ** 0.5)
        self.pre_lnorm = pre_lnorm
        self.own_biases = own_biases
        if own_biases:
            # each bias as given (the parameter shares its storage, as the original's), or
            # drawn from N(0, 0.02^2) where not given, each on its own
            for name, given in (("r_w_bias", r_w_bias), ("r_r_bias", r_r_bias)):
                if given is None:
                    given = nn.init.normal_(torch.empty(n_head, d_head), std=0.02)
                elif not isinstance(given, Tensor) or tuple(given.shape) != (n_head, d_head):
                    got = (tuple(given.shape) if isinstance(given, Tensor)
                           else type(given).__name__)
                    raise ValueError(f"RelPartialLearnableMultiHeadAttn: {name} must have "
                                     f"shape [n_head, d_head] = [{n_head}, {d_head}], "
                                     f"got {got}")
                setattr(self, name, nn.Parameter(given))
        elif r_w_bias is not None or r_r_bias is not None:
            raise ValueError("RelPartialLearnableMultiHeadAttn: with own_biases=False the "
                             "biases are passed to forward, not to the constructor")
        self.backend = backend

    def _project_qkv(self, x: Tensor, qlen: int, split: bool):
        """x ``[klen, B, d_model]`` -> q ``[qlen, B, H*Dh]`` (the last qlen rows), k, v
        ``[klen, B, H*Dh]``. The original projects every row in one GEMM and drops the
        memory rows' q; ``split`` projects q for the current rows only (the same numbers,
        less work, and autograd keeps no q of the memory rows)."""
        if not split or x.shape[0] == qlen:
            q, k, v = torch.chunk(self.qkv_net(x), 3, dim=-1)   # [klen, B, H*Dh] each
            return q[-qlen:], k, v
        wt, bias = self.qkv_net.weight, self.qkv_net.bias            # [3*H*Dh, d_model]
        n = self.n_head * self.d_head
        q = F.linear(x[-qlen:], wt[:n], None if bias is None else bias[:n])  # [qlen, B, n]
        kv = F.linear(x, wt[n:], None if bias is None else bias[n:])  # [klen, B, 2n]
        k, v = torch.chunk(kv, 2, dim=-1)                            # [klen, B, n] each
        return q, k, v

    def forward(self, w: Tensor, r: Tensor, *args, attn_mask: Optional[Tensor] = None,
                mems: Optional[Tensor] = None, r_w_bias: Optional[Tensor] = None,
                r_r_bias: Optional[Tensor] = None) -> Tensor:
        """``forward(w, r, attn_mask=None, mems=None)`` with the layer's own biases, or the
        original code's ``forward(w, r, r_w_bias, r_r_bias, attn_mask=None, mems=None)``
        (biases ``[n_head, d_head]``, floating point; the model's, shared by all layers).
        Returns ``[qlen, bsz, d_model]``."""
        if args and isinstance(args[0], Tensor) and args[0].is_floating_point():
            if len(args) < 2 or len(args) > 4:
                raise TypeError("RelPartialLearnableMultiHeadAttn: the original calling "
                                "convention is forward(w, r, r_w_bias, r_r_bias, attn_mask, "
                                f"mems); got {len(args) + 2} positional arguments")
            r_w_bias, r_r_bias, *rest = args
        else:
            rest = list(args)
        if len(rest) > 2:
            raise TypeError(f"RelPartialLearnableMultiHeadAttn: too many positional arguments "
                            f"({len(args) + 2})")
        if rest:
            attn_mask = rest[0]
        if len(rest) > 1:
            mems = rest[1]
        H, Dh = self.n_head, self.d_head
        if (r_w_bias is None) != (r_r_bias is None):
            raise ValueError("RelPartialLearnableMultiHeadAttn: pass both r_w_bias and r_r_bias "
                             "or neither")
        if r_w_bias is None:
            if not self.own_biases:
                raise ValueError("RelPartialLearnableMultiHeadAttn: built with own_biases=False, "
                                 "so forward needs r_w_bias and r_r_bias [n_head, d_head] "
                                 "(the original code's forward(w, r, r_w_bias, r_r_bias, ...))")
            r_w_bias, r_r_bias = self.r_w_bias, self.r_r_bias
        elif self.own_biases:
            raise ValueError("RelPartialLearnableMultiHeadAttn: this layer has its own "
                             "r_w_bias/r_r_bias parameters; build it with own_biases=False to "
                             "take the biases from forward (the original code's convention)")
        for name, t in (("r_w_bias", r_w_bias), ("r_r_bias", r_r_bias)):
            if not isinstance(t, Tensor) or tuple(t.shape) != (H, Dh):
                raise ValueError(f"RelPartialLearnableMultiHeadAttn: {name} must have shape "
                                 f"[n_head, d_head] = [{H}, {Dh}], got "
                                 f"{list(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        qlen, bsz = w.shape[0], w.shape[1]
        klen = qlen + (0 if mems is None else mems.shape[0])
        r2 = r.reshape(r.shape[0], -1)                                  # [rlen, d_model]
        rlen = r2.shape[0]
        if attn_mask is None and rlen == klen and qlen > 1:
            raise ValueError(
                f"RelPartialLearnableMultiHeadAttn: attn_mask=None (no mask) with qlen = {qlen} "
                f"> 1 lets a query see the keys after it, at negative distances, which r's "
                f"klen = {klen} rows (distances {klen - 1}..0) do not encode (the original "
                f"code's rel_shift wraps them onto other rows); pass the causal mask, or r "
                f"with klen + qlen - 1 = {klen + qlen - 1} rows (distances down to {1 - qlen})")
        if rlen not in (klen, klen + qlen - 1):
            raise ValueError(f"RelPartialLearnableMultiHeadAttn: r must have klen = {klen} rows "
                             f"(mems + w), or klen + qlen - 1 = {klen + qlen - 1} (distances "
                             f"down to {1 - qlen}, for no mask), got {rlen}")
        cat = w if mems is None else torch.cat([mems, w], 0)           # [klen, bsz, d_model]
        x = self.layer_norm(cat) if self.pre_lnorm else cat
        q, k, v = self._project_qkv(x, qlen, split=self.backend != "eager")
        r_head = self.r_net(r2).view(rlen, H, Dh).transpose(0, 1)      # [H, rlen, Dh]
        # [T, bsz, H*Dh] -> [T, bsz, H, Dh] -> [bsz, H, T, Dh]
        q, k, v = (t.reshape(t.shape[0], bsz, H, Dh).permute(1, 2, 0, 3) for t in (q, k, v))
        causal, window = False, None
        if attn_mask is not None:
            window = _window_of(attn_mask, qlen, klen)
            causal = True
        out = ops.rel_attention(q, k, v, r_head.to(q.dtype), r_w_bias.to(q.dtype),
                                r_r_bias.to(q.dtype), causal=causal, window=window,
                                pos_start=klen - 1, scale=self.scale,
                                dropout_p=self.dropatt.p if self.training else 0.0,
                                backend=self.backend)                   # [bsz, H, qlen, Dh]
        out = out.permute(2, 0, 1, 3).reshape(qlen, bsz, H * Dh)        # [qlen, bsz, H*Dh]
        out = self.drop(self.o_net(out))
        return w + out if self.pre_lnorm else self.layer_norm(w + out)


# The last mask read by _window_of: (weak reference to it, its version counter, qlen, klen,
# window). The original code hands the same dec_attn_mask to every layer of a forward.
_last_mask = None


def _window_of(attn_mask: Tensor, qlen: int, klen: int) -> Optional[int]:
    """The ``window`` of an original-code mask (True = masked, ``[qlen, klen]`` or
    ``[qlen, klen, 1]``): None for the causal mask, ``W`` for causal + same_length (masked
    exactly where the distance ``mlen + i - j`` is ``< 0`` or ``>= W``).

    Reading the mask's values is a host-device synchronisation on a GPU (2-3 per read). The
    original code builds one mask per forward and passes it to every layer: the answer for
    the mask last read is kept (the same tensor object, unmodified since: its version
    counter), so a forward of n layers synchronises once, not n times."""
    global _last_mask
    # (an inference tensor has no version counter to check: read each time)
    if torch.compiler.is_compiling() or attn_mask.is_inference():
        return _read_window(attn_mask, qlen, klen)
    last = _last_mask
    if (last is not None and last[0]() is attn_mask and last[1] == attn_mask._version
            and last[2:4] == (qlen, klen)):
        return last[4]
    window = _read_window(attn_mask, qlen, klen)
    _last_mask = (weakref.ref(attn_mask), attn_mask._version, qlen, klen, window)
    return window


def _read_window(attn_mask: Tensor, qlen: int, klen: int) -> Optional[int]:
    mask = (attn_mask if attn_mask.dim() == 2 else attn_mask[..., 0]).bool()
    if tuple(mask.shape) == (qlen, klen):
        dist = (klen - qlen) + torch.arange(qlen, device=mask.device)[:, None] \
            - torch.arange(klen, device=mask.device)[None, :]            # [qlen, klen]
        causal = dist < 0
        extra = mask & ~causal
        if not extra.any():
            if torch.equal(mask, causal):
                return None
        else:
            window = int(dist[extra].min())
            if window >= 1 and torch.equal(mask, causal | (dist >= window)):
                return window
    raise NotImplementedError(
        "RelPartialLearnableMultiHeadAttn: attn_mask must be the original code's causal mask "
        "triu(ones(qlen, klen), 1 + mlen), optionally with its same_length part "
        f"tril(ones(qlen, klen), -mask_shift_len); got another mask of shape "
        f"{list(attn_mask.shape)} (qlen={qlen}, klen={klen})")
