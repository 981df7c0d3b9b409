"""XLNet (Yang et al., 2019) on ``ctxfast.rel_attention``: two-stream relative attention
(content and query streams), permutation masks from O(T) ranks, partial prediction with
``target_mapping``, relative segment encoding and memory.

Parameter names and layouts are those of Hugging Face's ``XLNetModel`` /
``XLNetLMHeadModel`` (``word_embedding``, ``mask_emb``, ``layer.{i}.rel_attn.{q,k,v,o,r}``
as ``[d_model, n_head, d_head]`` parameters, ``r_w_bias``, ``r_r_bias``, ``r_s_bias``,
``seg_embed``, ``layer.{i}.ff.layer_{1,2}``, ``lm_loss``), so their state dicts load as
they are: :func:`from_hf_xlnet`.

Forward, like HF's ``XLNetModel`` but with ``perm_rank [B, T]`` in place of the O(T²)
``perm_mask [B, T, T]``::

    model = XLNetModel(XLNetConfig(vocab_size=100, d_model=32, n_layer=2, n_head=2,
                                   d_inner=64), backend="ctxfast")
    out = model(input_ids,                  # [B, T] long, batch first
                attention_mask=None,        # [B, T], 1 = token, 0 = padding (as HF)
                token_type_ids=None,        # [B, T] segment ids (relative segment encoding)
                mems=None,                  # n_layer x [mlen, B, d_model] (HF's layout)
                perm_rank=None,             # [B, T] integer: place in the factorisation order
                target_mapping=None,        # [B, P, T]: query stream for P predictions
                use_mems=False)
    out.last_hidden_state   # query stream [B, P, d_model] with target_mapping, else [B, T, d_model]
    out.mems                # n_layer x [mem, B, d_model] when use_mems, else None

Masks (``ctxfast.attention``'s semantics, computed in the kernel from O(T) data): the
content stream of token i sees token t iff ``rank[t] <= rank[i]`` (so itself), the query
stream iff ``rank[t] < rank[i]``; memory is always visible; padding hides a key from every
query. For a strict permutation this is exactly HF's ``perm_mask[b, i, j] = 1 iff
rank[j] >= rank[i]`` (HF lets the content stream see itself by subtracting the identity);
:func:`perm_rank_to_perm_mask` builds that mask. Ties are allowed (tied tokens see each
other in the content stream, not in the query stream).

Differences from HF, all in rows that carry no information:

* a query that sees no key (the query stream of the first token in the order, without
  memory) gets zeros where HF's ``-1e30`` mask gives a uniform average of all values;
* a padded position does not see itself (HF's content stream lets every position see
  itself), so the hidden states *of padded positions* differ; those of real tokens agree
  within the segment. Memory is always visible (in HF too), and the padded positions'
  states are cached in ``mems`` as they are: so with padding and ``mems``, the *next*
  segment's outputs differ from HF's (each attends to its own padded states). Without
  padding in the cached segment they agree;
* in training, the dropout mask of the positional encodings is drawn once and shared by
  the batch (HF's draws one per sequence); the other dropouts are as HF's.

Backends: ``"ctxfast"`` calls :func:`ctxfast.rel_attention` (its backend picked by
ctxfast's dispatch: ``ctxfast.backend(...)``, ``CTXFAST_BACKEND``, or the device default);
``"eager"`` calls :func:`ctxfast.reference.rel_attention` directly. With dropout off the
two agree on outputs and gradients.

The query stream runs at the ``T`` sequence positions as HF does (the P prediction queries
are scattered to their positions with ``target_mapping``, attended, and gathered back),
so a ``target_mapping`` that is not one-hot gives HF's result too, as long as it puts no
weight on a position whose query stream sees no key (the first in the order, without
memory: 0 here, HF's uniform average there, the first difference above); it costs T query
rows per layer, not P.
"""
from dataclasses import dataclass, fields
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from .. import reference
from ._common import (KVMemory, attach, attached, check_device, check_fields, check_labels,
                      model_output, reuse_allowed, reuse_key, values_checked)

__all__ = ["XLNetConfig", "XLNetModel", "XLNetLMHeadModel", "XLNetOutput", "XLNetLMOutput",
           "from_hf_xlnet", "perm_rank_to_perm_mask", "perm_mask_to_perm_rank"]

def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {
    "gelu": F.gelu,                                             # erf form (HF "gelu")
    "gelu_new": _gelu_tanh,                                     # HF "gelu_new"
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


@dataclass
class XLNetConfig:
    vocab_size: int = 32000
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    d_head: Optional[int] = None         # default d_model / n_head (which must divide)
    d_inner: int = 3072
    ff_activation: str = "gelu"
    attn_type: str = "bi"                # "bi" (XLNet) or "uni" (causal, Transformer-XL-like)
    layer_norm_eps: float = 1e-12
    dropout: float = 0.1                 # embeddings, positions, attention probs, outputs (as HF)
    mem_len: Optional[int] = 512         # None or 0: keep all of memory + current (as HF)
    reuse_len: Optional[int] = None      # cache only the first reuse_len tokens of a segment
    bi_data: bool = False                # second half of the batch uses negated distances
    clamp_len: int = -1                  # clamp distances to [-clamp_len, clamp_len] if > 0
    same_length: bool = False            # attn_type="uni": every query sees mlen + 1 keys
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    use_mems_eval: bool = True           # forward's use_mems=None default in eval (as HF)
    use_mems_train: bool = False         # ... and in training (as HF)
    reuse_kv: bool = True                # ctxfast, no grad: keys / values of the memory kept

    def __post_init__(self):
        # (a negative length ran: cache_mem kept everything, K/V reuse read it as a count)
        check_fields(self, positive=("n_head",), optional_non_negative=("mem_len", "reuse_len"),
                     attn_rates=("dropout",))
        if self.d_head is None:
            if self.d_model % self.n_head:
                raise ValueError(f"XLNetConfig: d_model = {self.d_model} must be divisible by "
                                 f"n_head = {self.n_head} (d_head = d_model / n_head), or give "
                                 f"d_head explicitly")
            self.d_head = self.d_model // self.n_head
        if self.d_model % 2:
            raise ValueError(f"XLNetConfig: d_model must be even (sin/cos positional "
                             f"encoding), got {self.d_model}")
        if self.attn_type not in ("bi", "uni"):
            raise ValueError(f"XLNetConfig: attn_type must be 'bi' or 'uni', got "
                             f"{self.attn_type!r}")
        if not isinstance(self.reuse_kv, bool):
            raise ValueError(f"XLNetConfig: reuse_kv must be a bool, got {self.reuse_kv!r}")
        if self.ff_activation not in _ACTIVATIONS:
            raise ValueError(f"XLNetConfig: ff_activation must be one of "
                             f"{sorted(_ACTIVATIONS)}, got {self.ff_activation!r}")


@model_output
@dataclass
class XLNetOutput:
    last_hidden_state: Tensor   # [B, P, d] (query stream) with target_mapping, else [B, T, d]
    mems: Optional[List[Tensor]] = None        # n_layer x [mem, B, d] (when use_mems)
    content_hidden_state: Optional[Tensor] = None   # [B, T, d], always
    query_hidden_state: Optional[Tensor] = None     # [B, P, d], with target_mapping


@model_output
@dataclass
class XLNetLMOutput:
    logits: Tensor                             # [B, P or T, vocab_size]
    loss: Optional[Tensor] = None
    mems: Optional[List[Tensor]] = None


def perm_rank_to_perm_mask(perm_rank: Tensor) -> Tensor:
    """HF's float ``perm_mask [B, T, T]`` for a ``perm_rank [B, T]`` that is a strict
    permutation of each row: ``perm_mask[b, i, j] = 1`` (i may not attend j) iff
    ``rank[b, j] >= rank[b, i]``. Materialises ``T²`` values: for interop and tests.

    Ties are refused: HF's content stream does not let tied tokens see each other, and
    its query stream would let them, so no perm_mask means what tied ranks mean here."""
    if not isinstance(perm_rank, Tensor) or perm_rank.dim() != 2 or perm_rank.is_floating_point():
        raise TypeError(f"perm_rank_to_perm_mask: perm_rank must be an integer tensor [B, T], "
                        f"got {_shape(perm_rank)}")
    srt = perm_rank.sort(dim=1).values
    if (srt[:, 1:] == srt[:, :-1]).any():
        raise ValueError("perm_rank_to_perm_mask: perm_rank has ties; HF's perm_mask expresses "
                         "only a strict order (each row of perm_rank a permutation)")
    return (perm_rank[:, None, :] >= perm_rank[:, :, None]).float()   # [B, T(i), T(j)]


def perm_mask_to_perm_rank(perm_mask: Tensor, target_mapping: Optional[Tensor] = None) -> Tensor:
    """The ``perm_rank [B, T]`` (int64) that gives the same attention as HF's
    ``perm_mask [B, T, T]`` (``perm_mask[b, i, j] = 1``: i may not attend j).

    HF's content stream lets i see j (j != i) iff ``perm_mask[b, i, j] = 0``; ctxfast's sees
    j iff ``rank[j] <= rank[i]``. So the mask must be a total order with ties on each
    batch row: whenever i sees j, everything j sees i sees too, and of any two tokens at
    least one sees the other (tied tokens see each other). The rank of i is then the number
    of other tokens it sees. The query stream (rows that are predictions: those selected
    by ``target_mapping [B, P, T]``, or without it the rows with ``perm_mask[b, i, i] = 1``)
    sees ``rank[j] < rank[i]``: such a row must not see itself nor a tied token.

    Raises ValueError, naming a (b, i, j) and the reason, for a mask no rank order can
    express, e.g. one where i sees j and j sees k but i does not see k. Materialises ``T²``
    values, as perm_mask does."""
    if not isinstance(perm_mask, Tensor) or perm_mask.dim() != 3 or \
            perm_mask.shape[1] != perm_mask.shape[2]:
        raise ValueError(f"perm_mask_to_perm_rank: perm_mask must have shape [B, T, T], got "
                         f"{_shape(perm_mask)}")
    if not ((perm_mask == 0) | (perm_mask == 1)).all():
        raise ValueError("perm_mask_to_perm_rank: perm_mask must hold 0 (may attend) and 1 "
                         "(may not attend) only")
    B, T, _ = perm_mask.shape
    blocked = perm_mask.bool()
    off = ~torch.eye(T, dtype=torch.bool, device=perm_mask.device)
    sees = ~blocked & off                                               # [B, i, j], j != i
    rank = sees.sum(-1)                                                 # [B, T]
    want = (rank[:, None, :] <= rank[:, :, None]) & off
    bad = (want != sees).nonzero()
    if len(bad):
        b, i, j = (int(v) for v in bad[0])
        raise ValueError(
            f"perm_mask_to_perm_rank: no rank order gives perm_mask[{b}] (at i={i}, j={j}: "
            f"{'i sees j' if sees[b, i, j] else 'i does not see j'}, but {i} sees "
            f"{int(rank[b, i])} tokens and {j} sees {int(rank[b, j])}): the tokens a token "
            f"sees must be all tokens of lower or equal place in one order (transitive, every "
            f"pair ordered or tied)")
    if target_mapping is not None:
        if not isinstance(target_mapping, Tensor) or target_mapping.dim() != 3 or \
                tuple(target_mapping.shape[::2]) != (B, T):
            raise ValueError(f"perm_mask_to_perm_rank: target_mapping must have shape "
                             f"[B, P, T] = [{B}, P, {T}], got {_shape(target_mapping)}")
        query = (target_mapping != 0).any(1)                               # [B, T]
    else:
        query = blocked.diagonal(dim1=1, dim2=2)                           # [B, T]
    own = ~blocked.diagonal(dim1=1, dim2=2) & query
    tied = ((rank[:, None, :] == rank[:, :, None]) & off).any(-1) & query
    for what, where in (("sees its own token", own), ("sees a token of the same place",
                                                      tied)):
        if where.any():
            b, i = (int(v) for v in where.nonzero()[0])
            raise ValueError(f"perm_mask_to_perm_rank: prediction {i} of row {b} {what} in "
                             f"perm_mask; the query stream sees only earlier places "
                             f"(rank[j] < rank[i])")
    return rank.long()


def _heads(x: Tensor, w: Tensor) -> Tensor:
    """x ``[B, T, d_model]`` times w ``[d_model, H, D]`` -> ``[B, H, T, D]`` (a strided view)."""
    B, T, d = x.shape
    _, H, D = w.shape
    y = x @ w.reshape(d, H * D)               # [B, T, H*D]
    return y.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]


class _Masks:
    """What the attention of every layer needs, built once per forward from O(T) data."""

    def __init__(self, causal, pos_start, key_padding_mask, perm_rank, seg_q, seg_k, r_halves,
                 window=None):
        self.causal = causal                       # attn_type == "uni"
        self.window = window                       # same_length: distance < mlen + 1 (as HF)
        self.pos_start = pos_start                 # Tk: row m of r encodes distance Tk - m
        self.key_padding_mask = key_padding_mask   # bool [B, Tk] (True = padding) or None
        self.perm_rank = perm_rank                 # [B, T] or None
        self.seg_q, self.seg_k = seg_q, seg_k      # [B, T], [B, Tk] or None
        self.r_halves = r_halves                   # 1 (or 2 with bi_data) batch slices


class XLNetRelativeAttention(nn.Module):
    def __init__(self, config: XLNetConfig, backend: str = "ctxfast"):
        super().__init__()
        d, H, D = config.d_model, config.n_head, config.d_head
        self.n_head, self.d_head, self.d_model = H, D, d
        self.scale = 1 / (D ** 0.5)
        self.q = nn.Parameter(torch.empty(d, H, D))
        self.k = nn.Parameter(torch.empty(d, H, D))
        self.v = nn.Parameter(torch.empty(d, H, D))
        self.o = nn.Parameter(torch.empty(d, H, D))
        self.r = nn.Parameter(torch.empty(d, H, D))
        self.r_r_bias = nn.Parameter(torch.empty(H, D))
        self.r_s_bias = nn.Parameter(torch.empty(H, D))
        self.r_w_bias = nn.Parameter(torch.empty(H, D))
        self.seg_embed = nn.Parameter(torch.empty(2, H, D))
        self.layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.backend = backend

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, r: Tensor, m: _Masks,
                stream: str) -> Tensor:
        """q ``[B, H, T, D]``, k, v ``[B, H, Tk, D]``, r ``[n, H, R, D]`` (n = 1, or 2 with
        bi_data: one per half of the batch) -> ``[B, H, T, D]``."""
        p = self.dropout.p if self.training else 0.0
        seg = m.seg_q is not None
        outs = []
        for half, sl in enumerate(m.r_halves):
            def pick(t):
                return None if t is None else t[sl]
            kw = dict(causal=m.causal, pos_start=m.pos_start,
                      key_padding_mask=pick(m.key_padding_mask), perm_rank=pick(m.perm_rank),
                      perm_stream=stream, seg_q=pick(m.seg_q), seg_k=pick(m.seg_k),
                      seg_embed=self.seg_embed if seg else None,
                      r_s_bias=self.r_s_bias if seg else None, scale=self.scale,
                      window=m.window)
            qs, ks, vs = q[sl], k[sl], v[sl]
            if self.backend == "eager":       # the specification, scores materialised
                keep = None
                if p > 0:
                    keep = torch.rand(qs.shape[:3] + (ks.shape[2],), device=q.device) >= p
                out = reference.rel_attention(qs, ks, vs, r[half], self.r_w_bias,
                                              self.r_r_bias, dropout_mask=keep, dropout_p=p,
                                              **kw)
            else:                             # fused kernel: no [T, Tk] tensor stored
                out = ops.rel_attention(qs, ks, vs, r[half], self.r_w_bias, self.r_r_bias,
                                        dropout_p=p, **kw)
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    def post_attention(self, h: Tensor, attn: Tensor) -> Tensor:
        """h ``[B, L, d]`` residual, attn ``[B, H, L, D]`` -> ``[B, L, d]``."""
        B, H, L, D = attn.shape
        attn = attn.transpose(1, 2).reshape(B, L, H * D)            # [B, L, H*D]
        out = attn @ self.o.reshape(self.d_model, H * D).t()        # [B, L, d]
        return self.layer_norm(self.dropout(out) + h)

    def project_r(self, pos_emb: Tensor) -> Tensor:
        """pos_emb ``[n, R, d]`` -> the position keys ``[n, H, R, D]``."""
        n, R, d = pos_emb.shape
        H, D = self.n_head, self.d_head
        return (pos_emb @ self.r.reshape(d, H * D)).view(n, R, H, D).transpose(1, 2)

    def forward(self, h: Tensor, g: Optional[Tensor], pos_emb: Tensor, m: _Masks,
                mem: Optional[Tensor] = None, target_mapping: Optional[Tensor] = None, *,
                kv_mem: Optional[KVMemory] = None, keep=None, r: Optional[Tensor] = None):
        """h ``[B, T, d]`` content stream; g ``[B, P, d]`` query stream or None; pos_emb
        ``[n, R, d]``; mem ``[B, mlen, d]`` or None; target_mapping ``[B, P, T]``.

        K/V reuse (:class:`XLNetModel`'s evaluation; never on the eager backend):
        ``kv_mem``, the memory rows' keys and values as this layer projected them when they
        were current (:class:`KVMemory`), so only h is projected; ``keep`` = (beg, end):
        also return the :class:`KVMemory` of rows ``beg:end`` of ``[mem; h]`` (the next
        memory) as a third value; ``r``: :meth:`project_r` of an earlier call."""
        if kv_mem is not None:                       # the memory's k, v kept: project h only
            kv = kv_mem.extend(_heads(h, self.k), _heads(h, self.v))
            k, v = kv.k, kv.v                                       # [B, H, Tk, D]
        else:
            cat = h if mem is None else torch.cat([mem, h], 1)      # [B, Tk, d]
            k = _heads(cat, self.k)                                 # [B, H, Tk, D]
            v = _heads(cat, self.v)                                 # [B, H, Tk, D]
            kv = KVMemory(k, v)
        if r is None:
            r = self.project_r(pos_emb)                             # [n, H, R, D]
        out_h, out_g = self._streams(h, g, k, v, r, m, target_mapping)
        if keep is None:
            return out_h, out_g
        return out_h, out_g, kv.rows(*keep)

    def _streams(self, h, g, k, v, r, m, target_mapping):
        """The content stream's output and the query stream's (or None)."""
        # content stream: token i sees itself and the tokens before it in the order
        q = _heads(h, self.q)                                       # [B, H, T, D]
        out_h = self.post_attention(h, self._attend(q, k, v, r, m, "content"))
        if g is None:
            return out_h, None
        # query stream: prediction p queries from position target_mapping[p] without its token
        qg = _heads(g, self.q)                                      # [B, H, P, D]
        qg = torch.einsum("bpt,bhpd->bhtd", target_mapping, qg)     # [B, H, T, D]
        ag = self._attend(qg, k, v, r, m, "query")                  # [B, H, T, D]
        ag = torch.einsum("bpt,bhtd->bhpd", target_mapping, ag)     # [B, H, P, D]
        return out_h, self.post_attention(g, ag)


class XLNetFeedForward(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.layer_1 = nn.Linear(config.d_model, config.d_inner)
        self.layer_2 = nn.Linear(config.d_inner, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.activation = config.ff_activation

    def forward(self, x: Tensor) -> Tensor:
        y = self.dropout(_ACTIVATIONS[self.activation](self.layer_1(x)))
        y = self.dropout(self.layer_2(y))
        return self.layer_norm(y + x)


class XLNetLayer(nn.Module):
    def __init__(self, config: XLNetConfig, backend: str = "ctxfast"):
        super().__init__()
        self.rel_attn = XLNetRelativeAttention(config, backend)
        self.ff = XLNetFeedForward(config)

    def forward(self, h, g, pos_emb, m, mem=None, target_mapping=None, **reuse):
        """(h, g), and the kept keys and values where ``reuse`` has ``keep``
        (:meth:`XLNetRelativeAttention.forward`)."""
        out = self.rel_attn(h, g, pos_emb, m, mem, target_mapping, **reuse)
        h, g = self.ff(out[0]), (None if out[1] is None else self.ff(out[1]))
        return (h, g) if len(out) == 2 else (h, g, out[2])


def _shape(t) -> str:
    return str(list(t.shape)) if isinstance(t, Tensor) else type(t).__name__


def _is_int(t: Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


class XLNetModel(nn.Module):
    """The XLNet encoder (HF ``XLNetModel``'s parameters and forward, ``perm_rank`` in place
    of ``perm_mask``); see the module docstring.

    K/V reuse (``config.reuse_kv``, on by default; the ctxfast backend, as
    ``TransformerXL``'s): with no gradient and ``use_mems``, each call keeps the keys and
    values of the rows that become the next memory, and every layer's position keys, with
    the mems it returns; a call given those very mems (unchanged, same weights, dtype and
    autocast state) projects only its own rows (a write in place through ``.data`` moves
    no version counter and is not seen: ``TransformerXL``'s rules). Otherwise, and under
    ``torch.inference_mode()`` or torch.compile, every row is projected as HF does."""

    def __init__(self, config: XLNetConfig, backend: str = "ctxfast"):
        super().__init__()
        if backend not in ("ctxfast", "eager"):
            raise ValueError(f"XLNetModel: backend must be 'ctxfast' or 'eager', got {backend!r}")
        self.config, self.backend = config, backend
        self.word_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.mask_emb = nn.Parameter(torch.empty(1, 1, config.d_model))
        self.layer = nn.ModuleList([XLNetLayer(config, backend) for _ in range(config.n_layer)])
        self.dropout = nn.Dropout(config.dropout)
        self.apply(self._init_weights)

    def set_backend(self, backend: str) -> "XLNetModel":
        """Switch every attention layer to ``"ctxfast"`` or ``"eager"`` (weights unchanged)."""
        if backend not in ("ctxfast", "eager"):
            raise ValueError(f"XLNetModel: backend must be 'ctxfast' or 'eager', got {backend!r}")
        self.backend = backend
        for layer in self.layer:
            layer.rel_attn.backend = backend
        return self

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, XLNetRelativeAttention):
            for p in (module.q, module.k, module.v, module.o, module.r, module.r_r_bias,
                      module.r_s_bias, module.r_w_bias, module.seg_embed):
                nn.init.normal_(p, std=std)
        elif isinstance(module, XLNetModel):
            nn.init.normal_(module.mask_emb, std=std)

    # ------------------------------------------------------------------ positions, memory

    def relative_positional_encoding(self, qlen: int, klen: int, device, dtype) -> Tensor:
        """``[n, R, d_model]`` sinusoids, row m for distance ``klen - m`` (clamped):
        ``R = klen + qlen`` ("bi") or ``klen + 1`` ("uni"); n = 2 with bi_data (the second
        for the negated distances, used by the second half of the batch), else 1."""
        c = self.config
        freq_seq = torch.arange(0, c.d_model, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1 / torch.pow(10000, (freq_seq / c.d_model))                 # [d/2]
        end = -qlen if c.attn_type == "bi" else -1
        fwd = torch.arange(klen, end, -1, dtype=torch.int64, device=device).float()  # [R]
        seqs = [fwd, -fwd] if c.bi_data else [fwd]
        embs = []
        for pos in seqs:
            if c.clamp_len > 0:
                pos = pos.clamp(-c.clamp_len, c.clamp_len)
            sinusoid = pos[:, None] * inv_freq                                  # [R, d/2]
            embs.append(torch.cat([torch.sin(sinusoid), torch.cos(sinusoid)], -1))  # [R, d]
        return torch.stack(embs).to(dtype)                                      # [n, R, d]

    def _reuse_on(self, like: Tensor) -> bool:
        """Whether this call reuses keys, values and position keys (the class docstring;
        :func:`~ctxfast.models._common.reuse_allowed`)."""
        return reuse_allowed(self.config.reuse_kv, self.backend, like, self.layer[0].rel_attn.k)

    def _reuse_key(self, like: Tensor, what: tuple) -> tuple:
        """The key of a kept value (:func:`~ctxfast.models._common.reuse_key`): a layer's
        k and v for its keys and values, every layer's r for the position keys."""
        if what[0] == "kv":
            attn = self.layer[what[1]].rel_attn
            return reuse_key(like, what, [attn.k, attn.v])
        return reuse_key(like, what, [layer.rel_attn.r for layer in self.layer])

    def cache_mem(self, cur: Tensor, prev: Optional[Tensor]) -> Tensor:
        """cur ``[B, T, d]`` (a layer's input), prev ``[mlen, B, d]`` -> the new memory
        ``[min(mem_len, mlen + T), B, d]`` (HF's layout), detached (stop-gradient)."""
        c = self.config
        if c.reuse_len is not None and c.reuse_len > 0:
            cur = cur[:, :c.reuse_len]
        cur = cur.transpose(0, 1)                                   # [T, B, d]
        T, mlen = cur.shape[0], 0 if prev is None else prev.shape[0]
        keep = mlen + T                      # the last mem_len rows of [prev; cur], or all
        if c.mem_len is not None and c.mem_len > 0:
            keep = min(keep, c.mem_len)
        if keep > T:                                                # [keep, B, d]
            new = torch.cat([prev[mlen + T - keep:], cur], 0)
        else:   # rows of cur alone: a part is copied (a view keeps all of cur alive)
            new = cur if keep == T else cur[T - keep:].clone()
        return new.detach()

    # ------------------------------------------------------------------ input checks

    def _check(self, input_ids, attention_mask, token_type_ids, mems, perm_rank,
               target_mapping):
        c = self.config
        name = type(self).__name__
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or not _is_int(input_ids):
            raise ValueError(f"{name}: input_ids must be an integer tensor [B, T], got "
                             f"{getattr(input_ids, 'dtype', '')} {_shape(input_ids)}")
        B, T = input_ids.shape
        if B == 0 or T == 0:
            raise ValueError(f"{name}: input_ids must not be empty, got shape [{B}, {T}]")
        device = self.word_embedding.weight.device
        check_device(f"{name}: input_ids", input_ids, device)
        if values_checked(input_ids):
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= c.vocab_size:
                raise ValueError(f"{name}: input_ids must be in [0, vocab_size) = "
                                 f"[0, {c.vocab_size}), got values in [{lo}, {hi}]")
        for arg, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                       ("perm_rank", perm_rank)):
            if t is None:
                continue
            if not isinstance(t, Tensor) or tuple(t.shape) != (B, T):
                raise ValueError(f"{name}: {arg} must have the shape of input_ids [B, T] = "
                                 f"[{B}, {T}], got {_shape(t)}")
            if arg != "attention_mask" and not _is_int(t):
                raise ValueError(f"{name}: {arg} must be an integer tensor [B, T], got {t.dtype}")
            check_device(f"{name}: {arg}", t, device)
        if target_mapping is not None:
            if (not isinstance(target_mapping, Tensor) or target_mapping.dim() != 3
                    or target_mapping.shape[0] != B or target_mapping.shape[2] != T
                    or target_mapping.shape[1] == 0):
                raise ValueError(f"{name}: target_mapping must have shape [B, P, T] = "
                                 f"[{B}, P, {T}] with P >= 1, got {_shape(target_mapping)}")
            check_device(f"{name}: target_mapping", target_mapping, device)
        if mems is not None:
            if not isinstance(mems, (list, tuple)) or len(mems) != c.n_layer:
                raise ValueError(f"{name}: mems must be a list of n_layer = {c.n_layer} tensors "
                                 f"[mlen, B, d_model], got {type(mems).__name__} of "
                                 f"{len(mems) if isinstance(mems, (list, tuple)) else '?'}")
            mlen = mems[0].shape[0] if isinstance(mems[0], Tensor) else -1
            for i, mem in enumerate(mems):
                if (not isinstance(mem, Tensor) or tuple(mem.shape) != (mlen, B, c.d_model)
                        or not mem.is_floating_point()):
                    raise ValueError(f"{name}: mems[{i}] must be a float tensor [mlen, B, "
                                     f"d_model] = [{mlen}, {B}, {c.d_model}] (HF's layout, one "
                                     f"mlen for all layers), got {_shape(mem)}")
                check_device(f"{name}: mems[{i}]", mem, device)
        if c.bi_data and B % 2:
            raise ValueError(f"{name}: bi_data needs an even batch (half forward, half "
                             f"backward distances), got input_ids with B = {B}")

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, mems: Optional[Sequence[Tensor]] = None,
                perm_rank: Optional[Tensor] = None, target_mapping: Optional[Tensor] = None,
                use_mems: Optional[bool] = None) -> XLNetOutput:
        """Args (batch first, as HF):
            input_ids: ``[B, T]`` token ids in ``[0, vocab_size)``.
            attention_mask: ``[B, T]``, 1 for tokens, 0 for padding (HF's convention).
            token_type_ids: ``[B, T]`` segment ids; memory counts as segment 0 (as HF).
            mems: ``n_layer`` tensors ``[mlen, B, d_model]`` (HF's layout), from a previous
                call with ``use_mems=True``; always visible to every query.
            perm_rank: integer ``[B, T]``, place of each token in the factorisation order.
            target_mapping: ``[B, P, T]``, row p selects the position of prediction p; runs
                the query stream.
            use_mems: return the new memory (each layer's input, last ``mem_len`` steps).
                None (default): ``config.use_mems_train`` in training, else
                ``config.use_mems_eval`` (False and True by default, as HF).

        Returns :class:`XLNetOutput`; ``last_hidden_state`` is ``[B, P, d_model]`` (query
        stream) with target_mapping, else ``[B, T, d_model]`` (content stream).
        """
        self._check(input_ids, attention_mask, token_type_ids, mems, perm_rank, target_mapping)
        c = self.config
        if use_mems is None:
            use_mems = c.use_mems_train if self.training else c.use_mems_eval
        B, T = input_ids.shape
        mlen = mems[0].shape[0] if mems is not None else 0
        Tk = mlen + T
        dtype = self.word_embedding.weight.dtype
        device = input_ids.device

        kpm = None
        if attention_mask is not None:
            pad = attention_mask == 0                                      # [B, T] True = pad
            kpm = torch.cat([pad.new_zeros(B, mlen), pad], 1)              # [B, Tk]
        seg_q = seg_k = None
        if token_type_ids is not None:
            seg_q = token_type_ids
            seg_k = torch.cat([token_type_ids.new_zeros(B, mlen), token_type_ids], 1)  # [B, Tk]
        halves = [slice(0, B // 2), slice(B // 2, B)] if c.bi_data else [slice(0, B)]
        # same_length (attn_type "uni", as HF's create_mask): key j < qlen is also masked
        # for queries i > j, i.e. distance mlen + i - j > mlen: a window of mlen + 1 keys
        window = mlen + 1 if c.attn_type == "uni" and c.same_length else None
        masks = _Masks(c.attn_type == "uni", Tk, kpm, perm_rank, seg_q, seg_k, halves, window)

        h = self.dropout(self.word_embedding(input_ids))                   # [B, T, d]
        g = None
        if target_mapping is not None:
            target_mapping = target_mapping.to(dtype)
            P = target_mapping.shape[1]
            g = self.dropout(self.mask_emb.expand(B, P, c.d_model))        # [B, P, d]
        pos_emb = self.dropout(self.relative_positional_encoding(T, Tk, device, dtype))

        new_mems = []
        reuse = use_mems and self._reuse_on(h)
        if reuse:         # K/V reuse (see the class docstring): the memory's keys and values
            end = mlen + (min(c.reuse_len, T) if c.reuse_len else T)   # rows of [mem; h] the
            keep = (max(0, end - c.mem_len) if c.mem_len else 0, end)  # next memory keeps
            r_key = self._reuse_key(h, ("r", T, mlen, self.training, self.dropout.p,
                                        c.attn_type, c.bi_data, c.clamp_len))
            rs = attached(None if mems is None else mems[0], "_ctxfast_r", r_key)
            if rs is None:
                rs = [layer.rel_attn.project_r(pos_emb) for layer in self.layer]
        like = h
        for i, layer in enumerate(self.layer):
            prev = None if mems is None else mems[i]
            if use_mems:
                new_mems.append(self.cache_mem(h, prev))
            mem = None if prev is None else prev.transpose(0, 1).to(dtype)  # [B, mlen, d]
            if not reuse:
                h, g = layer(h, g, pos_emb, masks, mem, target_mapping)
                continue
            key = self._reuse_key(like, ("kv", i))
            h, g, kv = layer(h, g, pos_emb, masks, mem, target_mapping, keep=keep, r=rs[i],
                             kv_mem=attached(prev, "_ctxfast_kv", key))
            attach(new_mems[i], "_ctxfast_kv", key, kv)
        if reuse and (not self.training or self.dropout.p == 0):   # the same encodings next
            attach(new_mems[0], "_ctxfast_r", r_key, rs)

        h = self.dropout(h)
        g = None if g is None else self.dropout(g)
        return XLNetOutput(last_hidden_state=h if g is None else g,
                           mems=new_mems if use_mems else None,
                           content_hidden_state=h, query_hidden_state=g)


class XLNetLMHeadModel(nn.Module):
    """XLNet with the LM head (``lm_loss``, weight tied to ``transformer.word_embedding``)."""

    def __init__(self, config: XLNetConfig, backend: str = "ctxfast"):
        super().__init__()
        self.config = config
        self.transformer = XLNetModel(config, backend)
        self.lm_loss = nn.Linear(config.d_model, config.vocab_size, bias=True)
        nn.init.zeros_(self.lm_loss.bias)
        if config.tie_word_embeddings:
            self.lm_loss.weight = self.transformer.word_embedding.weight
        else:
            nn.init.normal_(self.lm_loss.weight, std=config.initializer_range)

    def set_backend(self, backend: str) -> "XLNetLMHeadModel":
        self.transformer.set_backend(backend)
        return self

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, mems: Optional[Sequence[Tensor]] = None,
                perm_rank: Optional[Tensor] = None, target_mapping: Optional[Tensor] = None,
                use_mems: Optional[bool] = None, labels: Optional[Tensor] = None) -> XLNetLMOutput:
        """As :meth:`XLNetModel.forward`; ``labels [B, P]`` (with target_mapping) or
        ``[B, T]``, -100 = ignored, gives the mean cross-entropy ``loss``.
        Returns logits ``[B, P or T, vocab_size]``."""
        # a target_mapping that is not [B, P, T] is refused by name by the model's checks
        mapping_ok = target_mapping is None or (isinstance(target_mapping, Tensor)
                                                and target_mapping.dim() == 3)
        if (labels is not None and isinstance(input_ids, Tensor) and input_ids.dim() == 2
                and mapping_ok):
            L = input_ids.shape[1] if target_mapping is None else target_mapping.shape[1]
            if not isinstance(labels, Tensor) or tuple(labels.shape) != (input_ids.shape[0], L):
                raise ValueError(f"XLNetLMHeadModel: labels must have shape [B, P or T] = "
                                 f"[{input_ids.shape[0]}, {L}], got {_shape(labels)}")
            check_labels("XLNetLMHeadModel: labels", labels, (input_ids.shape[0], L),
                         self.config.vocab_size, self.transformer.word_embedding.weight.device)
        out = self.transformer(input_ids, attention_mask, token_type_ids, mems, perm_rank,
                               target_mapping, use_mems)
        logits = self.lm_loss(out.last_hidden_state)                       # [B, L, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),   # [B*L, V]
                                   labels.reshape(-1), ignore_index=-100)  # [B*L]
        return XLNetLMOutput(logits=logits, loss=loss, mems=out.mems)


# ---------------------------------------------------------------------- Hugging Face

def from_hf_xlnet(hf_model, backend: str = "ctxfast"):
    """The ctxfast model with the weights of a Hugging Face ``XLNetModel`` (-> our
    :class:`XLNetModel`) or ``XLNetLMHeadModel`` (-> :class:`XLNetLMHeadModel`), on the
    same device, dtype and train/eval mode. Outputs agree with HF's (see the module
    docstring for the rows that differ and for ``perm_rank`` vs ``perm_mask``)."""
    names = [c.__name__ for c in type(hf_model).__mro__]   # transformers is not imported
    lm = "XLNetLMHeadModel" in names
    if not lm and "XLNetModel" not in names:
        raise TypeError(f"from_hf_xlnet: expected a transformers XLNetModel or "
                        f"XLNetLMHeadModel, got {type(hf_model).__name__}")
    hc = hf_model.config
    if not isinstance(hc.ff_activation, str):
        raise ValueError(f"from_hf_xlnet: ff_activation must be one of {sorted(_ACTIVATIONS)}, "
                         f"got {hc.ff_activation!r}")
    keys = {f.name for f in fields(XLNetConfig)}
    config = XLNetConfig(**{n: getattr(hc, n) for n in keys if hasattr(hc, n)})
    model = (XLNetLMHeadModel if lm else XLNetModel)(config, backend)
    param = next(hf_model.parameters())
    model.to(device=param.device, dtype=param.dtype)
    state = hf_model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_loss.weight"} if lm and config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"from_hf_xlnet: state dicts do not match: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.train(hf_model.training)
