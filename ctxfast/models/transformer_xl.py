"""Transformer-XL: the language model of Dai et al. (2019), ``MemTransformerLM`` with the
default relative attention (``attn_type=0``), on ctxfast's relative attention.

The model follows the original PyTorch code (kimiyoung/transformer-xl,
``pytorch/mem_transformer.py``) closely enough that its ``state_dict`` loads as it is:

* time-major layouts: ``data``/``target`` ``[T, B]``, hidden states ``[T, B, d_model]``;
* ``forward(data, target=None, *mems)``, mems from :meth:`TransformerXL.init_mems` or the
  previous call: ``n_layer + 1`` tensors ``[mlen, B, d_model]`` (the embedding output and
  every layer's output), each the last ``mem_len`` hidden states of ``[mems; current]``,
  detached (the stop-gradient of the paper);
* ``mem_len``, ``ext_len``, ``clamp_len``, ``same_length``, ``pre_lnorm``, tied or untied
  embeddings and projections, and ``untie_r`` (one ``r_w_bias``/``r_r_bias`` pair per
  layer, as in the original TensorFlow code; the PyTorch code shares one pair);
* parameter names: ``word_emb.emb_layers.0.weight``, ``word_emb.emb_projs.0``,
  ``pos_emb.inv_freq``, ``r_w_bias``, ``r_r_bias``, ``layers.{i}.dec_attn.{qkv_net, r_net,
  o_net, layer_norm}``, ``layers.{i}.pos_ff.CoreNet.{0,3}``, ``layers.{i}.pos_ff.layer_norm``,
  ``crit.out_layers.0.{weight, bias}``, ``crit.out_projs.{i}``, ``crit.cluster_{weight,
  bias}``.

Adaptive input/softmax (``cutoffs``, ``div_val``) are supported: the log-probabilities of
the whole vocabulary are built from the head and the tail clusters as the original does
(cluster ``i`` uses head column ``-i``). The sampled softmax and ``attn_type`` 1-3 are
not.

Backends (``TransformerXLConfig.backend``):

* ``"ctxfast"``: attention runs on :func:`ctxfast.rel_attention` (relative shift inside
  the kernel, no ``[Tq, Tk]`` position-score tensor). The op's ``backend=`` is left unset,
  so ctxfast's dispatch picks the implementation (``with ctxfast.backend("triton"):`` or
  ``CTXFAST_BACKEND`` choose it; on CPU tensors the default is the eager reference).
* ``"eager"``: the original formulation in plain PyTorch: einsums for the content and
  position scores, the pad-and-view relative shift, a materialised mask, softmax.

Everything else (embeddings, feed-forward, LayerNorm, softmax head) is plain PyTorch in
both. Evaluation on the ctxfast backend also keeps the memory's keys and values from call
to call instead of projecting the memory again (:class:`TransformerXL`, ``reuse_kv``).
``same_length=True`` (every query sees ``mem_len`` keys once the keys outnumber
``mem_len``: the paper's evaluation setting) is ``ctxfast.rel_attention``'s
``window=mem_len`` on the ctxfast backend and the original ``triu + tril`` mask on the eager
one.

    cfg = TransformerXLConfig(n_token=256, n_layer=2, n_head=2, d_model=32, d_head=16,
                              d_inner=64, tgt_len=8, mem_len=8)
    model = TransformerXL(cfg)
    mems = model.init_mems()
    for x, y in segments:                         # x, y [tgt_len, B], y = x shifted by one
        loss, mems = model(x, y, *mems)           # loss [tgt_len, B] (nats per token)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops, reference
from ..nn.rel_attention import RelPartialLearnableMultiHeadAttn as _RelAttnLayer
from ._common import (KVMemory, attach, attached, check_device, check_fields, check_sampling,
                      check_tied_entries, next_token, reuse_allowed, reuse_key, values_checked)

MODEL_BACKENDS = ("ctxfast", "eager")


@dataclass
class TransformerXLConfig:
    """``MemTransformerLM``'s arguments (same names and meaning), plus ``untie_r``,
    ``layer_norm_epsilon``, the initialisation scales and the backend."""
    n_token: int = 204               # vocabulary (enwik8: 204 symbols)
    n_layer: int = 12
    n_head: int = 8
    d_model: int = 512
    d_head: int = 64
    d_inner: int = 2048
    dropout: float = 0.1
    dropatt: float = 0.0
    tie_weight: bool = True          # crit.out_layers[i].weight is word_emb.emb_layers[i].weight
    d_embed: Optional[int] = None    # None = d_model
    div_val: int = 1                 # adaptive embedding: cluster i has d_embed // div_val**i
    tie_projs: Sequence[bool] = (False,)  # per cluster: crit.out_projs[i] is word_emb.emb_projs[.]
    pre_lnorm: bool = False
    tgt_len: int = 512               # segment length (informative; any T runs)
    ext_len: int = 0                 # tokens of the segment kept as extended context
    mem_len: int = 512               # hidden states kept per layer
    cutoffs: Sequence[int] = ()      # adaptive softmax cluster boundaries
    same_length: bool = False        # every query sees the same number of keys
    clamp_len: int = -1              # > 0: distances beyond it use its encoding
    untie_r: bool = False            # one r_w_bias / r_r_bias per layer
    layer_norm_epsilon: float = 1e-5
    init_std: float = 0.02           # the original train.py's --init_std
    proj_init_std: float = 0.01      # and --proj_init_std
    backend: str = "ctxfast"         # "ctxfast" | "eager"
    reuse_kv: bool = True            # ctxfast, no grad: keys / values of the memory kept

    @classmethod
    def enwik8(cls, **kw) -> "TransformerXLConfig":
        """The paper's 12-layer enwik8 model (``run_enwik8_base.sh``)."""
        base = dict(n_token=204, n_layer=12, n_head=8, d_model=512, d_head=64, d_inner=2048,
                    dropout=0.1, dropatt=0.0, tgt_len=512, mem_len=512)
        return cls(**{**base, **kw})


def _check_config(c: TransformerXLConfig) -> None:
    if c.backend not in MODEL_BACKENDS:
        raise ValueError(f"backend must be one of {MODEL_BACKENDS}, got {c.backend!r}")
    if not isinstance(c.reuse_kv, bool):
        raise ValueError(f"TransformerXLConfig.reuse_kv must be a bool, got {c.reuse_kv!r}")
    check_fields(c, positive=("n_token", "n_layer", "n_head", "d_model", "d_head", "d_inner",
                              "div_val"),
                 non_negative=("mem_len", "ext_len", "tgt_len"),
                 drop_rates=("dropout",), attn_rates=("dropatt",))
    if c.d_model % 2:                  # (the encodings' width rounds up: a shape error later)
        raise ValueError(f"TransformerXLConfig.d_model must be even (sin/cos positional "
                         f"encoding), got {c.d_model}")
    cut = list(c.cutoffs)
    if cut != sorted(set(cut)) or (cut and (cut[0] <= 0 or cut[-1] >= c.n_token)):
        raise ValueError(f"TransformerXLConfig.cutoffs must increase strictly within "
                         f"(0, n_token={c.n_token}), got {cut}")


# --------------------------------------------------------------------------- blocks

class PositionalEmbedding(nn.Module):
    """Sinusoid encodings of (relative) positions: ``pos_seq [K]`` -> ``[K, 1, d]``
    (``cat(sin, cos)``, the original's layout). ``inv_freq`` is a buffer, as there."""

    def __init__(self, demb: int) -> None:
        super().__init__()
        self.demb = demb
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb)))

    def forward(self, pos_seq: Tensor) -> Tensor:
        inv_freq = self.inv_freq
        if inv_freq.dtype not in (torch.float32, torch.float64):   # model.half(): recompute
            inv_freq = 1.0 / (10000 ** (torch.arange(0.0, self.demb, 2.0,
                                                     device=inv_freq.device) / self.demb))
        sinusoid = torch.outer(pos_seq.float(), inv_freq.float())        # [K, d/2]
        return torch.cat([sinusoid.sin(), sinusoid.cos()], -1)[:, None, :]  # [K, 1, d]


class PositionwiseFF(nn.Module):
    """``CoreNet = Linear(d, d_inner), ReLU, Dropout, Linear(d_inner, d), Dropout`` with a
    residual and a LayerNorm (after, or before with ``pre_lnorm``)."""

    def __init__(self, d_model: int, d_inner: int, dropout: float, pre_lnorm: bool = False,
                 eps: float = 1e-5) -> None:
        super().__init__()
        self.CoreNet = nn.Sequential(nn.Linear(d_model, d_inner), nn.ReLU(),
                                     nn.Dropout(dropout), nn.Linear(d_inner, d_model),
                                     nn.Dropout(dropout))
        self.layer_norm = nn.LayerNorm(d_model, eps=eps)
        self.pre_lnorm = pre_lnorm

    def forward(self, inp: Tensor) -> Tensor:
        if self.pre_lnorm:
            return inp + self.CoreNet(self.layer_norm(inp))
        return self.layer_norm(inp + self.CoreNet(inp))


def rel_attention_eager(q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor,
                        r_r_bias: Tensor, mask: Optional[Tensor], scale: float,
                        dropatt: nn.Module) -> Tensor:
    """The original formulation: q ``[B, H, Tq, D]``, k, v ``[B, H, Tk, D]``, r ``[H, Tk, D]``
    (row m = distance ``Tk - 1 - m``), biases ``[H, D]``, mask bool ``[Tq, Tk]`` (True =
    masked) -> ``[B, H, Tq, D]``."""
    ac = torch.einsum("bhid,bhjd->bhij", q + r_w_bias[None, :, None], k)    # [B, H, Tq, Tk]
    bd = torch.einsum("bhid,hjd->bhij", q + r_r_bias[None, :, None], r)     # [B, H, Tq, Tk]
    bd = reference.rel_shift_pad_view(bd)                                   # [B, H, Tq, Tk]
    score = (ac + bd) * scale
    if mask is not None:
        score = score.float().masked_fill(mask, float("-inf")).type_as(score)
    prob = dropatt(torch.softmax(score, -1))
    return torch.matmul(prob, v)                                            # [B, H, Tq, D]


class TransformerXLAttention(_RelAttnLayer):
    """The model's attention layer (``layers.i.dec_attn``; named
    ``RelPartialLearnableMultiHeadAttn`` here before, which is the name of the public layer
    :class:`ctxfast.nn.RelPartialLearnableMultiHeadAttn` alone now; the old name still
    imports, with a DeprecationWarning).
    :class:`ctxfast.nn.RelPartialLearnableMultiHeadAttn` (same parameters: ``qkv_net``,
    ``r_net``, ``o_net``, ``layer_norm``) as the model uses it: the biases come from the
    model (shared by all layers) unless ``untie_r``, the position encodings are projected
    once per call, and the mask may be the ``same_length`` window."""

    def __init__(self, n_head: int, d_model: int, d_head: int, dropout: float,
                 dropatt: float = 0.0, pre_lnorm: bool = False, untie_r: bool = False,
                 layer_norm_epsilon: float = 1e-5, backend: str = "ctxfast") -> None:
        super().__init__(n_head, d_model, d_head, dropout, dropatt, pre_lnorm=pre_lnorm,
                         layer_norm_epsilon=layer_norm_epsilon,
                         own_biases=untie_r)  # else the model's r_w_bias / r_r_bias are used
        self.untie_r = untie_r
        self.backend = backend

    def forward(self, w: Tensor, r: Tensor, r_w_bias: Optional[Tensor] = None,
                r_r_bias: Optional[Tensor] = None, mems: Optional[Tensor] = None,
                window: Optional[int] = None, *, kv_mem: Optional["KVMemory"] = None,
                keep: Optional[Tuple[int, int]] = None, r_head: Optional[Tensor] = None):
        """w ``[qlen, B, d_model]``, r ``[klen, 1, d_model]`` (position encodings of the
        distances ``klen-1 … 0``), biases ``[H, d_head]`` (ignored with ``untie_r``), mems
        ``[mlen, B, d_model]`` or None; ``window``: the ``same_length`` window (query i
        sees key j only at distance ``mlen + i - j < window``; None = causal only).
        Returns ``[qlen, B, d_model]``.

        K/V reuse (the model's evaluation path, :meth:`TransformerXL._forward`; never with
        the eager backend): ``kv_mem``, the keys and values of the memory rows as this layer
        projected them when they were current rows (:class:`KVMemory`): only the current
        rows are projected, and appended to them. ``keep`` = (beg, end): also return the
        :class:`KVMemory` of rows ``beg:end`` of ``[mems; w]`` (the next memory),
        ``(out, kept)``. ``r_head``: the projected position encodings ``[H, klen, d_head]``
        of an earlier call with the same klen (:meth:`project_r`)."""
        qlen, bsz = w.shape[0], w.shape[1]
        H, Dh = self.n_head, self.d_head
        if self.untie_r:
            r_w_bias, r_r_bias = self.r_w_bias, self.r_r_bias
        if kv_mem is not None:                         # memory rows' k, v given: project w only
            x = self.layer_norm(w) if self.pre_lnorm else w             # [qlen, B, d_model]
            q, k, v = torch.chunk(self.qkv_net(x), 3, dim=-1)            # [qlen, B, H*Dh] each
            q, k, v = (t.reshape(qlen, bsz, H, Dh).permute(1, 2, 0, 3) for t in (q, k, v))
            kv = kv_mem.extend(k, v)                 # [memory; current] rows, one buffer
            k, v = kv.k, kv.v                                            # [B, H, klen, Dh]
            klen = k.shape[2]
        else:
            cat = w if mems is None else torch.cat([mems, w], 0)         # [klen, B, d_model]
            klen = cat.shape[0]
            x = self.layer_norm(cat) if self.pre_lnorm else cat         # [klen, B, d_model]
            # q [qlen, B, H*Dh], k, v [klen, B, H*Dh]; eager: the original's one GEMM
            q, k, v = self._project_qkv(x, qlen, split=self.backend != "eager")
            # [T, B, H*Dh] -> [T, B, H, Dh] -> [B, H, T, Dh]
            q, k, v = (t.reshape(t.shape[0], bsz, H, Dh).permute(1, 2, 0, 3) for t in (q, k, v))
        if r_head is None:
            r_head = self.project_r(r, w.dtype)                          # [H, klen, Dh]
        u, b = r_w_bias.to(q.dtype), r_r_bias.to(q.dtype)
        if self.backend == "eager":
            mask = torch.ones(qlen, klen, dtype=torch.bool, device=w.device).triu(1 + klen - qlen)
            if window is not None:                   # the original same_length mask
                mask = mask | torch.ones_like(mask).tril(klen - qlen - window)
            out = rel_attention_eager(q, k, v, r_head, u, b, mask, self.scale, self.dropatt)
        else:
            out = ops.rel_attention(q, k, v, r_head, u, b, causal=True, pos_start=klen - 1,
                                    window=window, scale=self.scale,
                                    dropout_p=self.dropatt.p if self.training else 0.0)
        out = out.permute(2, 0, 1, 3).reshape(qlen, bsz, H * Dh)        # [qlen, B, H*Dh]
        out = self.drop(self.o_net(out))                                 # [qlen, B, d_model]
        out = w + out if self.pre_lnorm else self.layer_norm(w + out)
        if keep is None:
            return out
        kv = kv if kv_mem is not None else KVMemory(k, v)
        return out, kv.rows(*keep)

    def project_r(self, r: Tensor, dtype: torch.dtype) -> Tensor:
        """r ``[klen, 1, d_model]`` -> ``r_net(r)`` as ``[H, klen, d_head]``."""
        klen = r.shape[0]
        r_head = self.r_net(r.reshape(klen, -1).to(dtype))              # [klen, H*Dh]
        return r_head.view(klen, self.n_head, self.d_head).transpose(0, 1)  # [H, klen, Dh]


class RelPartialLearnableDecoderLayer(nn.Module):
    """``dec_attn`` (relative attention with memory) then ``pos_ff``."""

    def __init__(self, c: TransformerXLConfig) -> None:
        super().__init__()
        self.dec_attn = TransformerXLAttention(
            c.n_head, c.d_model, c.d_head, c.dropout, c.dropatt, pre_lnorm=c.pre_lnorm,
            untie_r=c.untie_r, layer_norm_epsilon=c.layer_norm_epsilon, backend=c.backend)
        self.pos_ff = PositionwiseFF(c.d_model, c.d_inner, c.dropout, pre_lnorm=c.pre_lnorm,
                                     eps=c.layer_norm_epsilon)

    def forward(self, dec_inp: Tensor, r: Tensor, r_w_bias: Optional[Tensor],
                r_r_bias: Optional[Tensor], mems: Optional[Tensor] = None,
                window: Optional[int] = None, **reuse):
        """``[qlen, B, d_model]`` -> ``[qlen, B, d_model]`` (and the kept keys and values
        where ``reuse`` has ``keep``: :meth:`TransformerXLAttention.forward`)."""
        out = self.dec_attn(dec_inp, r, r_w_bias, r_r_bias, mems, window, **reuse)
        if isinstance(out, tuple):
            return self.pos_ff(out[0]), out[1]
        return self.pos_ff(out)


class AdaptiveEmbedding(nn.Module):
    """Token embedding times ``sqrt(d_proj)``. ``div_val == 1``: one ``Embedding(n_token,
    d_embed)`` and a projection ``emb_projs[0] [d_proj, d_embed]`` when ``d_embed !=
    d_proj``; otherwise one embedding of width ``d_embed // div_val**i`` and one projection
    per cluster of ``cutoffs``."""

    def __init__(self, n_token: int, d_embed: int, d_proj: int, cutoffs: Sequence[int],
                 div_val: int = 1) -> None:
        super().__init__()
        self.n_token, self.d_embed, self.d_proj, self.div_val = n_token, d_embed, d_proj, div_val
        self.cutoffs = list(cutoffs) + [n_token]
        self.cutoff_ends = [0] + self.cutoffs
        self.emb_scale = d_proj ** 0.5
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(n_token, d_embed))
            if d_proj != d_embed:
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)))
        else:
            for i in range(len(self.cutoffs)):
                lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
                d_i = d_embed // (div_val ** i)
                self.emb_layers.append(nn.Embedding(hi - lo, d_i))
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_i)))

    def forward(self, inp: Tensor) -> Tensor:
        """ids ``[T, B]`` -> ``[T, B, d_proj]``."""
        if self.div_val == 1:
            embed = self.emb_layers[0](inp)                              # [T, B, d_embed]
            if self.d_proj != self.d_embed:
                embed = F.linear(embed, self.emb_projs[0])               # [T, B, d_proj]
        else:
            param = self.emb_projs[0]
            flat = inp.reshape(-1)                                       # [T*B]
            emb = torch.zeros(flat.shape[0], self.d_proj, dtype=param.dtype, device=param.device)
            for i in range(len(self.cutoffs)):
                lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
                sel = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)  # [n_i]
                if sel.numel() == 0:
                    continue
                emb_i = F.linear(self.emb_layers[i](flat[sel] - lo), self.emb_projs[i])
                emb = emb.index_copy(0, sel, emb_i.to(emb.dtype))        # [T*B, d_proj]
            embed = emb.view(*inp.shape, self.d_proj)                    # [T, B, d_proj]
        return embed * self.emb_scale


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """The output layer: ``out_layers`` (one ``Linear(d_embed, n_token)`` when ``div_val
    == 1``, else one per cluster), ``out_projs`` (``[d_proj, d_embed_i]`` or None) and, with
    cutoffs, ``cluster_weight [n_clusters, d_embed]`` / ``cluster_bias``."""

    def __init__(self, n_token: int, d_embed: int, d_proj: int, cutoffs: Sequence[int],
                 div_val: int = 1) -> None:
        super().__init__()
        self.n_token, self.d_embed, self.d_proj, self.div_val = n_token, d_embed, d_proj, div_val
        self.cutoffs = list(cutoffs) + [n_token]
        self.cutoff_ends = [0] + self.cutoffs
        self.shortlist_size = self.cutoffs[0]
        self.n_clusters = len(self.cutoffs) - 1
        if self.n_clusters > 0:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        if div_val == 1:
            for _ in range(len(self.cutoffs)):
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_embed))
                                      if d_proj != d_embed else None)
            self.out_layers.append(nn.Linear(d_embed, n_token))
        else:
            for i in range(len(self.cutoffs)):
                lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
                d_i = d_embed // (div_val ** i)
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_i)))
                self.out_layers.append(nn.Linear(d_i, hi - lo))

    @staticmethod
    def _logit(hidden: Tensor, weight: Tensor, bias: Tensor, proj: Optional[Tensor]) -> Tensor:
        if proj is not None:
            hidden = F.linear(hidden, proj.t())                          # [N, d_embed_i]
        return F.linear(hidden, weight, bias)

    def _cluster(self, i: int) -> Tuple[Tensor, Tensor]:
        if self.div_val == 1:
            lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
            return self.out_layers[0].weight[lo:hi], self.out_layers[0].bias[lo:hi]
        return self.out_layers[i].weight, self.out_layers[i].bias

    def log_prob(self, hidden: Tensor) -> Tensor:
        """hidden ``[N, d_proj]`` -> log-probabilities of every token ``[N, n_token]``."""
        if self.n_clusters == 0:
            logit = self._logit(hidden, self.out_layers[0].weight, self.out_layers[0].bias,
                                self.out_projs[0])
            return F.log_softmax(logit.float(), -1).to(hidden.dtype)
        w0, b0 = self._cluster(0)
        head_w = torch.cat([w0, self.cluster_weight], 0)                 # [short + n_cl, d]
        head_b = torch.cat([b0, self.cluster_bias], 0)
        head = F.log_softmax(self._logit(hidden, head_w, head_b, self.out_projs[0]).float(), -1)
        parts = [head[:, :self.shortlist_size]]                          # [N, shortlist]
        for i in range(1, len(self.cutoffs)):
            w_i, b_i = self._cluster(i)
            tail = F.log_softmax(self._logit(hidden, w_i, b_i, self.out_projs[i]).float(), -1)
            parts.append(tail + head[:, -i, None])                       # cluster i: column -i
        return torch.cat(parts, -1).to(hidden.dtype)                     # [N, n_token]

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """hidden ``[N, d_proj]``, target ``[N]`` -> negative log-likelihood ``[N]``."""
        return -self.log_prob(hidden).gather(1, target[:, None]).squeeze(1)


# --------------------------------------------------------------------------- the model

class TransformerXL(nn.Module):
    """``MemTransformerLM`` (attn_type 0). See the module docstring.

    K/V reuse (``config.reuse_kv``, on by default; the ctxfast backend only). Layer i's
    memory is the hidden states it saw as current rows in earlier calls, and the original
    projects them to keys and values again at every call: at the paper's evaluation
    lengths (128 new rows against 3,672 of memory) almost all of the layer's ``qkv_net``
    work. Where no gradient is taken (``torch.no_grad()``: evaluation, :meth:`generate`),
    each call keeps the keys and values of the rows that become the next memory, and the
    projected position encodings ``r_net(pos_emb)`` of every layer, with the new mems it
    returns (Python attributes of those tensors: they live and die with them); a call given
    those very mems projects only its own rows, and the encodings again only when the
    number of keys changes. A kept value is used only if the memory tensor is the one it
    was kept with and unchanged since (its version counter), and the weights it came from
    are the same tensors unchanged (an optimizer step, ``load_state_dict`` or any in-place
    change recompute, as does a weight rebound to another tensor, ``p.data = t``; a write
    in place through ``.data`` moves no version counter and is not seen),
    under the same dtype and autocast state; mems that the caller
    copied, built or converted to another dtype are projected as the original does. Not
    under ``torch.inference_mode()`` (its tensors carry no version counter to check), with
    gradients on (the projection weights' gradients need every row), nor while
    torch.compile traces. The results are the original's; the kept keys and values cost
    ``2 · (mlen + room) · B · n_head · d_head`` elements per layer beside the mems, the room
    (``max(8 · qlen, 128)`` rows) taking the next calls' rows in place (:class:`KVMemory`)."""

    def __init__(self, config: TransformerXLConfig) -> None:
        super().__init__()
        _check_config(config)
        self.config = c = replace(config, cutoffs=tuple(config.cutoffs),
                                  tie_projs=tuple(config.tie_projs))
        self.n_token, self.n_layer, self.d_model = c.n_token, c.n_layer, c.d_model
        self.n_head, self.d_head = c.n_head, c.d_head
        self.d_embed = c.d_model if c.d_embed is None else c.d_embed
        self.tgt_len, self.mem_len, self.ext_len = c.tgt_len, c.mem_len, c.ext_len
        self.same_length, self.clamp_len = c.same_length, c.clamp_len

        self.word_emb = AdaptiveEmbedding(c.n_token, self.d_embed, c.d_model, c.cutoffs,
                                          div_val=c.div_val)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList([RelPartialLearnableDecoderLayer(c)
                                     for _ in range(c.n_layer)])
        self.crit = ProjectedAdaptiveLogSoftmax(c.n_token, self.d_embed, c.d_model, c.cutoffs,
                                                div_val=c.div_val)
        self.pos_emb = PositionalEmbedding(c.d_model)
        if not c.untie_r:
            self.r_w_bias = nn.Parameter(torch.empty(c.n_head, c.d_head))
            self.r_r_bias = nn.Parameter(torch.empty(c.n_head, c.d_head))
        self.apply(self._init_weights)
        if c.tie_weight:
            for i in range(len(self.crit.out_layers)):
                self.crit.out_layers[i].weight = self.word_emb.emb_layers[i].weight
        for i, tie in enumerate(c.tie_projs):
            if i >= len(self.crit.out_projs) or not tie:
                continue
            if c.div_val == 1 and c.d_model != self.d_embed:
                self.crit.out_projs[i] = self.word_emb.emb_projs[0]
            elif c.div_val != 1:
                self.crit.out_projs[i] = self.word_emb.emb_projs[i]

    def _init_weights(self, m: nn.Module) -> None:
        """The original train.py's ``weights_init`` (normal init)."""
        std, pstd = self.config.init_std, self.config.proj_init_std
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)
        elif isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 1.0, std)
            nn.init.zeros_(m.bias)
        elif isinstance(m, (AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax)):
            projs = m.emb_projs if isinstance(m, AdaptiveEmbedding) else m.out_projs
            for p in projs:
                if p is not None:
                    nn.init.normal_(p, 0.0, pstd)
            if isinstance(m, ProjectedAdaptiveLogSoftmax) and m.n_clusters > 0:
                nn.init.normal_(m.cluster_weight, 0.0, std)
                nn.init.zeros_(m.cluster_bias)
        for name in ("r_w_bias", "r_r_bias"):
            p = m._parameters.get(name)
            if p is not None:
                nn.init.normal_(p, 0.0, std)

    # ----------------------------------------------------------------- settings

    @property
    def backend(self) -> str:
        return self.config.backend

    def set_backend(self, backend: str) -> "TransformerXL":
        """Switch every attention layer to ``"ctxfast"`` or ``"eager"`` (weights unchanged)."""
        if backend not in MODEL_BACKENDS:
            raise ValueError(f"backend must be one of {MODEL_BACKENDS}, got {backend!r}")
        self.config.backend = backend
        for layer in self.layers:
            layer.dec_attn.backend = backend
        return self

    def reset_length(self, tgt_len: int, ext_len: int, mem_len: int) -> None:
        """As the original: change the segment, extended-context and memory lengths."""
        for name, v in (("tgt_len", tgt_len), ("ext_len", ext_len), ("mem_len", mem_len)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"reset_length: {name} must be an int >= 0, got {v!r}")
        self.tgt_len, self.ext_len, self.mem_len = tgt_len, ext_len, mem_len

    def init_mems(self) -> List[Tensor]:
        """``n_layer + 1`` empty memories (``[0]`` tensors), or ``[]`` when ``mem_len == 0``."""
        if self.mem_len <= 0:
            return []
        p = self.word_emb.emb_layers[0].weight
        return [torch.empty(0, dtype=p.dtype, device=p.device) for _ in range(self.n_layer + 1)]

    # ----------------------------------------------------------------- checks

    def _check_ids(self, name: str, ids: Tensor) -> None:
        if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex \
                or ids.dtype == torch.bool:
            raise TypeError(f"TransformerXL: {name} must be an integer tensor [T, B], got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError(f"TransformerXL: {name} must have shape [T, B] (time-major, "
                             f"T, B >= 1), got {tuple(ids.shape)}")
        check_device(f"TransformerXL: {name}", ids, self.word_emb.emb_layers[0].weight.device)
        if values_checked(ids):
            lo, hi = torch.aminmax(ids)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= self.n_token:
                raise ValueError(f"TransformerXL: {name} must hold ids in [0, n_token="
                                 f"{self.n_token}), got values in [{lo}, {hi}]")

    def _check_mems(self, mems: Sequence[Tensor], data: Tensor) -> Optional[List[Tensor]]:
        """None (no memory) or the list of ``n_layer + 1`` tensors ``[mlen, B, d_model]``."""
        if len(mems) == 0:
            return None
        n = self.n_layer + 1
        if len(mems) != n:
            raise ValueError(f"TransformerXL: mems must be n_layer + 1 = {n} tensors (the "
                             f"embedding output and each layer's output), got {len(mems)}")
        if all(isinstance(m, Tensor) and m.numel() == 0 for m in mems):
            return None                                   # init_mems(): empty memory
        B = data.shape[1]
        p = self.word_emb.emb_layers[0].weight
        mlen = mems[0].shape[0] if isinstance(mems[0], Tensor) and mems[0].dim() == 3 else -1
        for i, m in enumerate(mems):
            if not isinstance(m, Tensor) or m.dim() != 3 or m.shape[0] != mlen \
                    or tuple(m.shape[1:]) != (B, self.d_model):
                got = tuple(m.shape) if isinstance(m, Tensor) else type(m).__name__
                raise ValueError(f"TransformerXL: mems[{i}] must have shape [mlen, B, d_model] = "
                                 f"[{max(mlen, 0)}, {B}, {self.d_model}] (the same mlen in every "
                                 f"layer), got {got}")
            if m.device != data.device or not m.dtype.is_floating_point:
                raise TypeError(f"TransformerXL: mems[{i}] must be a floating tensor on "
                                f"{data.device}, got {m.dtype} on {m.device}")
        if mlen > self.mem_len:
            raise ValueError(f"TransformerXL: mems hold mlen={mlen} steps but mem_len="
                             f"{self.mem_len}; pass at most mem_len (reset_length changes it)")
        return [m.to(p.dtype) for m in mems]

    # ----------------------------------------------------------------- forward

    def _mem_rows(self, mlen: int, qlen: int) -> Tuple[int, int]:
        """(beg, end): the rows of ``[mems; current]`` that the next memory keeps: the last
        ``mem_len`` before the ``ext_len`` tail."""
        end = mlen + max(0, qlen - self.ext_len)
        return max(0, end - self.mem_len), end

    def _update_mems(self, hids: List[Tensor], mems: Optional[List[Tensor]], mlen: int,
                     qlen: int) -> List[Tensor]:
        """The last ``mem_len`` steps of ``[mems; hids]`` (before the ``ext_len`` tail),
        detached: the stop-gradient."""
        if self.mem_len <= 0:
            return []
        beg, end = self._mem_rows(mlen, qlen)
        with torch.no_grad():
            new = []
            for i, h in enumerate(hids):
                cat = h if mems is None else torch.cat([mems[i], h], 0)  # [mlen + qlen, B, d]
                keep = cat[beg:end].detach()                             # [end - beg, B, d]
                # a part of cat is copied: a view would keep all of cat's storage alive.
                # (Concatenating only the kept rows of mems and h would copy less, but its
                # slice of mems at a traced start puts guards on the segment length that
                # stop a dynamic torch.export.)
                new.append(keep if end - beg == cat.shape[0] else keep.clone())
        return new

    def forward_hidden(self, data: Tensor, *mems: Tensor) -> Tuple[Tensor, List[Tensor]]:
        """data ``[T, B]`` -> (last layer's hidden states ``[T, B, d_model]`` (after dropout),
        new mems: ``n_layer + 1`` tensors ``[min(mem_len, mlen + T), B, d_model]``)."""
        self._check_ids("data", data)
        return self._forward(data, self._check_mems(mems, data))

    def _forward(self, dec_inp: Tensor,
                 mems: Optional[List[Tensor]]) -> Tuple[Tensor, List[Tensor]]:
        qlen = dec_inp.shape[0]
        word_emb = self.word_emb(dec_inp)                                # [qlen, B, d_model]
        mlen = 0 if mems is None else mems[0].shape[0]
        klen = mlen + qlen
        window = None
        if self.same_length and 0 < self.mem_len < klen:  # query i sees the mem_len keys up to it
            window = self.mem_len                        # (the original: mask j <= i - shift,
            #                                              shift = qlen - (klen - mem_len))
        # [klen]: klen - 1 .. 0, an integer arange made float (the original's float step
        # gives the same values, but a traced length of ceil(klen / 1.0), which
        # torch.export cannot prove equal to klen)
        pos_seq = torch.arange(klen - 1, -1, -1, device=word_emb.device).float()
        if self.clamp_len > 0:
            pos_seq = pos_seq.clamp(max=self.clamp_len)
        pos_emb = self.drop(self.pos_emb(pos_seq).to(word_emb.dtype))    # [klen, 1, d_model]
        core_out = self.drop(word_emb)
        hids = [core_out]
        r_w_bias = getattr(self, "r_w_bias", None)
        r_r_bias = getattr(self, "r_r_bias", None)
        reuse = self._reuse_on(word_emb)
        if not reuse:
            for i, layer in enumerate(self.layers):
                core_out = layer(core_out, pos_emb, r_w_bias, r_r_bias,
                                 None if mems is None else mems[i], window)  # [qlen, B, d_model]
                hids.append(core_out)
            return self.drop(core_out), self._update_mems(hids, mems, mlen, qlen)
        # K/V reuse (see the class docstring): the memory rows' keys and values and the
        # projected position encodings come from the previous call where they match
        keep = self._mem_rows(mlen, qlen) if self.mem_len > 0 else None
        r_key = self._reuse_key(word_emb, ("r", klen, self.clamp_len, self.training, self.drop.p))
        r_heads = attached(None if mems is None else mems[0], "_ctxfast_r", r_key)
        if r_heads is None:
            r_heads = [layer.dec_attn.project_r(pos_emb, word_emb.dtype) for layer in self.layers]
        kept = []
        for i, layer in enumerate(self.layers):
            m = None if mems is None else mems[i]
            kv_mem = attached(m, "_ctxfast_kv", self._reuse_key(word_emb, ("kv", i)))
            out = layer(core_out, pos_emb, r_w_bias, r_r_bias, m, window, kv_mem=kv_mem,
                        keep=keep, r_head=r_heads[i])
            if keep is not None:
                out, kv = out                            # kv: KVMemory of the next memory
                kept.append(kv)
            core_out = out                                                # [qlen, B, d_model]
            hids.append(core_out)
        new_mems = self._update_mems(hids, mems, mlen, qlen)
        if new_mems:
            for i, kv in enumerate(kept):
                attach(new_mems[i], "_ctxfast_kv", self._reuse_key(word_emb, ("kv", i)), kv)
            if self.drop.p == 0 or not self.training:   # the same encodings next call
                attach(new_mems[0], "_ctxfast_r", r_key, r_heads)
        return self.drop(core_out), new_mems

    def _reuse_on(self, like: Tensor) -> bool:
        """Whether this call reuses keys, values and position encodings (the class
        docstring; :func:`~ctxfast.models._common.reuse_allowed`)."""
        return reuse_allowed(self.config.reuse_kv, self.backend, like,
                             self.layers[0].dec_attn.qkv_net.weight)

    def _reuse_key(self, like: Tensor, what: tuple) -> tuple:
        """The key of a kept value (:func:`~ctxfast.models._common.reuse_key`): a layer's
        qkv_net (and its LayerNorm when pre-LN) for its keys and values, every r_net and
        the frequencies for the position encodings."""
        if what[0] == "kv":
            attn = self.layers[what[1]].dec_attn
            ps = [attn.qkv_net.weight, attn.qkv_net.bias]
            if attn.pre_lnorm:
                ps += [attn.layer_norm.weight, attn.layer_norm.bias]
        else:
            ps = [layer.dec_attn.r_net.weight for layer in self.layers] + [self.pos_emb.inv_freq]
        return reuse_key(like, what, ps)

    def forward(self, data: Tensor, target: Optional[Tensor] = None,
                *mems: Tensor) -> Tuple[Tensor, List[Tensor]]:
        """data ``[T, B]`` token ids; target ``[tgt_len, B]`` (``tgt_len <= T``: the next
        token of each of the last ``tgt_len`` positions) or None; mems as returned by the
        previous call or :meth:`init_mems` (none = no memory).

        Returns (loss, new_mems): loss ``[tgt_len, B]`` negative log-likelihood in nats (as
        the original), or without target the log-probabilities ``[T, B, n_token]``;
        new_mems: ``n_layer + 1`` detached tensors ``[min(mem_len, mlen + T), B, d_model]``
        (``[]`` when ``mem_len == 0``).
        """
        self._check_ids("data", data)
        if target is not None:
            self._check_ids("target", target)
            if target.shape[0] > data.shape[0] or target.shape[1] != data.shape[1]:
                raise ValueError(f"TransformerXL: target must have shape [tgt_len, B] with "
                                 f"tgt_len <= T and B = {data.shape[1]} (data is "
                                 f"{tuple(data.shape)}), got {tuple(target.shape)}")
        hidden, new_mems = self._forward(data, self._check_mems(mems, data))
        if target is None:
            T, B = data.shape
            logp = self.crit.log_prob(hidden.reshape(T * B, -1))          # [T*B, n_token]
            return logp.view(T, B, -1), new_mems
        tgt_len, B = target.shape
        pred = hidden[-tgt_len:]                                          # [tgt_len, B, d_model]
        loss = self.crit(pred.reshape(tgt_len * B, -1), target.reshape(-1))  # [tgt_len*B]
        return loss.view(tgt_len, B), new_mems

    def log_probs(self, data: Tensor, *mems: Tensor, last: Optional[int] = None,
                  validate: bool = True) -> Tuple[Tensor, List[Tensor]]:
        """data ``[T, B]`` -> (log-probabilities of the next token ``[T', B, n_token]``,
        new mems), ``T' = T`` or, with ``last``, only the last ``last`` positions (the
        output layer then runs on those only: what a sliding-window evaluation needs).
        ``validate=False`` skips the id range check (one host sync per call) for callers
        that checked the whole stream once; shapes and the device are always checked."""
        if validate:
            self._check_ids("data", data)
        elif not isinstance(data, Tensor) or data.dim() != 2:
            raise ValueError(f"TransformerXL: data must have shape [T, B], got "
                             f"{tuple(getattr(data, 'shape', ()))}")
        else:
            check_device("TransformerXL: data", data, self.word_emb.emb_layers[0].weight.device)
        T, B = data.shape
        if last is not None and (not isinstance(last, int) or not 1 <= last <= T):
            raise ValueError(f"TransformerXL.log_probs: last must be an int in [1, T={T}], "
                             f"got {last!r}")
        hidden, new_mems = self._forward(data, self._check_mems(mems, data))
        if last is not None:
            hidden = hidden[-last:]                                       # [last, B, d_model]
        n = hidden.shape[0]
        logp = self.crit.log_prob(hidden.reshape(n * B, -1))              # [n*B, n_token]
        return logp.view(n, B, -1), new_mems

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, *, mems: Sequence[Tensor] = (),
                 generator: Optional[torch.Generator] = None) -> Tuple[Tensor, List[Tensor]]:
        """Continue prompt ``[T, B]`` by `max_new_tokens` tokens, reusing the memory: the
        prompt runs in segments of ``tgt_len`` (mems carried over), then each new token is
        one step of length 1 over the memory. Returns (tokens ``[T + max_new_tokens, B]``,
        final mems: the memory of every returned token but the last). temperature 0 =
        greedy; top_k restricts sampling to the k most likely tokens. `mems` continues from
        an earlier memory. Put the model in ``eval()`` mode first to turn dropout off."""
        check_sampling(max_new_tokens, temperature, top_k)
        self._check_ids("prompt", prompt)
        mems = list(mems) if len(mems) else self.init_mems()
        seg = max(self.tgt_len, 1)
        ctx, out = prompt[:-1], prompt
        for s in range(0, ctx.shape[0], seg):        # all but the last prompt token
            _, mems = self.forward_hidden(ctx[s:s + seg], *mems)
        nxt = prompt[-1:]                                                # [1, B]
        for _ in range(max_new_tokens):
            logp, mems = self.log_probs(nxt, *mems)                      # [1, B, n_token]
            nxt = next_token(logp[0].float(), temperature, top_k, generator).T  # [1, B]
            out = torch.cat([out, nxt], 0)
        return out, mems

    # ----------------------------------------------------------------- checkpoints

    @classmethod
    def config_from_state_dict(cls, state_dict: dict, **overrides) -> TransformerXLConfig:
        """The config of an original-style (``MemTransformerLM``) ``state_dict``.

        Read from the shapes: n_token, n_layer, n_head, d_head, d_model, d_embed, d_inner,
        untie_r, the adaptive embedding and softmax (``div_val`` and, for ``div_val > 1``,
        ``cutoffs`` from the cluster sizes), and which weights and projections are tied.
        Required in `overrides`, because no shape says them: ``pre_lnorm`` (a wrong value
        gives wrong outputs silently) and ``mem_len``; and ``cutoffs`` for an adaptive
        softmax with ``div_val == 1`` (its clusters share one output layer). Everything
        else (dropout, clamp_len, same_length, ...) is the config's default unless given.
        """
        sd = state_dict
        if "word_emb.emb_layers.0.weight" not in sd:
            raise ValueError("config_from_state_dict: no 'word_emb.emb_layers.0.weight': not a "
                             "Transformer-XL (MemTransformerLM) state_dict")
        missing = [n for n in ("pre_lnorm", "mem_len") if n not in overrides]
        if missing:
            raise ValueError(f"config_from_state_dict: {' and '.join(missing)} cannot be read from "
                             f"a state_dict (pre_lnorm changes the outputs); pass them, e.g. "
                             f"from_state_dict(sd, pre_lnorm=False, mem_len=512)")
        n_emb = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("word_emb.emb_layers."))
        widths = [sd[f"word_emb.emb_layers.{i}.weight"].shape[1] for i in range(n_emb)]
        sizes = [sd[f"word_emb.emb_layers.{i}.weight"].shape[0] for i in range(n_emb)]
        d_embed, n_token = int(widths[0]), int(sum(sizes))
        if n_emb == 1:
            div_val = 1
            cutoffs = list(overrides.get("cutoffs", ()))
            if "crit.cluster_weight" in sd:
                n_clusters = sd["crit.cluster_weight"].shape[0]
                if len(cutoffs) != n_clusters:
                    raise ValueError(
                        f"config_from_state_dict: the adaptive softmax has {n_clusters} tail "
                        f"cluster(s) on one output layer (div_val 1), whose boundaries no shape "
                        f"gives; pass cutoffs=[...] ({n_clusters} values), got {cutoffs}")
        else:
            div_val = int(widths[0] // widths[1])
            expect = [d_embed // div_val ** i for i in range(n_emb)]
            if [int(w) for w in widths] != expect:
                raise ValueError(f"config_from_state_dict: embedding widths {widths} are not "
                                 f"d_embed // div_val**i for one div_val")
            cutoffs = [int(sum(sizes[:i + 1])) for i in range(n_emb - 1)]
        n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
        untie_r = "r_w_bias" not in sd
        shape_keys = ("layers.0.dec_attn.r_w_bias" if untie_r else "r_w_bias",
                      "layers.0.dec_attn.o_net.weight", "layers.0.pos_ff.CoreNet.0.weight")
        missing = [k for k in shape_keys if k not in sd]
        if missing:
            raise ValueError(f"config_from_state_dict: the state_dict has no {missing} (the "
                             "sizes are read from them: r_w_bias, shared or layer 0's, gives "
                             "n_head and d_head; layer 0's o_net d_model and CoreNet d_inner)")
        H, Dh = sd[shape_keys[0]].shape
        d_model = sd[shape_keys[1]].shape[0]
        d_inner = sd[shape_keys[2]].shape[0]

        def same(a, b):
            return a in sd and b in sd and sd[a].shape == sd[b].shape and torch.equal(sd[a], sd[b])
        tie = all(same(f"crit.out_layers.{i}.weight", f"word_emb.emb_layers.{i}.weight")
                  for i in range(n_emb))
        n_proj = len(cutoffs) + 1
        if div_val == 1:
            tie_projs = tuple(same(f"crit.out_projs.{i}", "word_emb.emb_projs.0")
                              for i in range(n_proj))
        else:
            tie_projs = tuple(same(f"crit.out_projs.{i}", f"word_emb.emb_projs.{i}")
                              for i in range(n_proj))
        kw = dict(n_token=n_token, n_layer=n_layer, n_head=int(H), d_head=int(Dh),
                  d_model=int(d_model), d_embed=d_embed, d_inner=int(d_inner), div_val=div_val,
                  cutoffs=tuple(cutoffs), untie_r=untie_r, tie_weight=bool(tie),
                  tie_projs=tie_projs)
        return TransformerXLConfig(**{**kw, **overrides})

    @classmethod
    def from_state_dict(cls, state_dict: dict, **overrides) -> "TransformerXL":
        """Build the model from an original-style ``state_dict`` (see
        :meth:`config_from_state_dict`: ``pre_lnorm`` and ``mem_len`` are required) and
        load it (strict)."""
        model = cls(cls.config_from_state_dict(state_dict, **overrides))
        check_tied_entries(model, state_dict, "TransformerXL.from_state_dict")  # tie override
        model.load_state_dict(state_dict)
        return model


def __getattr__(name: str):
    if name == "RelPartialLearnableMultiHeadAttn":
        import warnings
        warnings.warn("ctxfast.models.transformer_xl.RelPartialLearnableMultiHeadAttn is now "
                      "TransformerXLAttention (the public layer of that name is "
                      "ctxfast.nn.RelPartialLearnableMultiHeadAttn)", DeprecationWarning,
                      stacklevel=2)
        return TransformerXLAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TransformerXLConfig", "TransformerXL", "TransformerXLAttention",
           "RelPartialLearnableDecoderLayer", "PositionwiseFF", "PositionalEmbedding",
           "AdaptiveEmbedding", "ProjectedAdaptiveLogSoftmax", "rel_attention_eager"]
