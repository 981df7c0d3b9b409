"""BERT: a bidirectional transformer encoder on ctxfast attention.

Embeddings (word + position + token type, then LayerNorm and dropout), ``n_layer``
post-LayerNorm encoder layers (``x = ln_1(x + attn(x)); x = ln_2(x + mlp(x))``), a pooler
(``tanh(Linear(h[:, 0]))``), the masked-LM head (``Linear -> act -> LayerNorm -> decoder``,
the decoder tied to the word embedding) and the next-sentence head (``Linear(D, 2)`` on
the pooled output).

Padding: ``attention_mask [B, T]`` (1 = token, 0 = padding, as Hugging Face) becomes
ctxfast's ``key_padding_mask``. The *varlen* path (``BertConfig.varlen`` or
``forward(..., varlen=True)``) instead packs the non-padding tokens of the batch into one
``[total, D]`` tensor right after the embeddings, runs every layer on it with
:func:`ctxfast.attention_varlen` (no compute on padding) and unpacks at the end; the
hidden states of real tokens are the same as the padded path's, and padding positions
come back as zeros (in the padded path they hold values that mean nothing). With a pooler,
varlen needs position 0 ([CLS], which the pooler reads) unpadded: left padding is refused
there (the padded path takes it, as Hugging Face does).

    cfg = BertConfig(vocab_size=100, n_positions=64, n_layer=2, n_head=2, n_embd=32)
    out = Bert(cfg)(input_ids, token_type_ids, attention_mask, mlm_labels=labels)
    out.last_hidden_state, out.pooler_output, out.mlm_logits, out.nsp_logits, out.loss
"""
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import (MLP, SelfAttention, activation, check_backend, check_fields, check_ids,
                      check_labels, init_weights, model_output, pack, unpack, values_checked)


@dataclass
class BertConfig:
    vocab_size: int = 30522
    n_positions: int = 512           # max_position_embeddings
    type_vocab_size: int = 2
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_inner: Optional[int] = None    # intermediate_size; None = 4 * n_embd
    dropout: float = 0.1             # embeddings, residual branches (hidden_dropout_prob)
    attn_dropout: float = 0.1        # attention probabilities
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"         # "gelu" (erf) | "gelu_tanh" | "relu"
    pad_token_id: Optional[int] = 0  # the word embedding's padding_idx
    add_pooler: bool = True
    add_mlm_head: bool = True
    add_nsp_head: bool = True        # needs the pooler
    tie_weights: bool = True         # MLM decoder weight is the word embedding
    varlen: bool = False             # default path for padded batches: packed (True) or padded
    backend: str = "ctxfast"         # "ctxfast" | "eager"

    def __post_init__(self):
        check_fields(self, positive=("vocab_size", "n_positions", "type_vocab_size", "n_head",
                                     "n_embd"),
                     non_negative=("n_layer",), optional_positive=("n_inner",),
                     drop_rates=("dropout",), attn_rates=("attn_dropout",))
        if self.n_embd % self.n_head:
            raise ValueError(f"BertConfig: n_embd = {self.n_embd} must be divisible by "
                             f"n_head = {self.n_head}")


@model_output
@dataclass
class BertOutput:
    last_hidden_state: Tensor                 # [B, T, D]
    pooler_output: Optional[Tensor] = None    # [B, D]
    mlm_logits: Optional[Tensor] = None       # [B, T, V]
    nsp_logits: Optional[Tensor] = None       # [B, 2]
    loss: Optional[Tensor] = None             # MLM loss + NSP loss (those whose labels were given)


class EncoderLayer(nn.Module):
    """Post-LN transformer layer: ``x = ln_1(x + attn(x)); x = ln_2(x + mlp(x))``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        C = config.n_embd
        self.attn = SelfAttention(C, config.n_head, attn_dropout=config.attn_dropout,
                                  resid_dropout=config.dropout, backend=config.backend)
        self.ln_1 = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.mlp = MLP(C, 4 * C if config.n_inner is None else config.n_inner,
                       act=config.activation,
                       dropout=config.dropout)
        self.ln_2 = nn.LayerNorm(C, eps=config.layer_norm_eps)

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """x ``[B, T, D]``, key_padding_mask bool ``[B, T]`` (True = padding) -> ``[B, T, D]``."""
        x = self.ln_1(x + self.attn(x, key_padding_mask=key_padding_mask))
        return self.ln_2(x + self.mlp(x))

    def forward_packed(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """x ``[total, D]`` (packed tokens) -> ``[total, D]``."""
        x = self.ln_1(x + self.attn.forward_packed(x, cu_seqlens, max_seqlen))
        return self.ln_2(x + self.mlp(x))


class Bert(nn.Module):
    """BERT encoder with optional pooler, MLM and NSP heads.

    Parameters: ``embeddings.{word, position, token_type, ln}``,
    ``layers.{i}.{attn.qkv, attn.proj, ln_1, mlp.fc, mlp.proj, ln_2}``, ``pooler``,
    ``mlm.{dense, ln, decoder}`` (``decoder.weight`` is ``embeddings.word.weight`` when
    ``tie_weights``), ``nsp``.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        check_backend(config.backend)
        if config.add_nsp_head and not config.add_pooler:
            raise ValueError("add_nsp_head needs add_pooler=True (NSP reads the pooled output)")
        self.config = config = replace(config)                 # our own copy (set_backend)
        C = config.n_embd
        self.embeddings = nn.ModuleDict(dict(
            word=nn.Embedding(config.vocab_size, C, padding_idx=config.pad_token_id),
            position=nn.Embedding(config.n_positions, C),
            token_type=nn.Embedding(config.type_vocab_size, C),
            ln=nn.LayerNorm(C, eps=config.layer_norm_eps),
            drop=nn.Dropout(config.dropout),
        ))
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_layer)])
        self.pooler = nn.Linear(C, C) if config.add_pooler else None
        self.mlm = None
        if config.add_mlm_head:
            self.mlm = nn.ModuleDict(dict(dense=nn.Linear(C, C),
                                          ln=nn.LayerNorm(C, eps=config.layer_norm_eps),
                                          decoder=nn.Linear(C, config.vocab_size)))
        self.nsp = nn.Linear(C, 2) if config.add_nsp_head else None
        self.apply(init_weights)
        if self.mlm is not None and config.tie_weights:
            self.mlm.decoder.weight = self.embeddings.word.weight

    @property
    def backend(self) -> str:
        return self.config.backend

    def set_backend(self, backend: str) -> "Bert":
        """Switch every attention layer to ``"ctxfast"`` or ``"eager"`` (weights unchanged)."""
        self.config.backend = check_backend(backend)
        for layer in self.layers:
            layer.attn.backend = backend
        return self

    def forward(self, input_ids: Tensor, token_type_ids: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None, *, mlm_labels: Optional[Tensor] = None,
                nsp_labels: Optional[Tensor] = None, varlen: Optional[bool] = None) -> BertOutput:
        """input_ids ``[B, T]``; token_type_ids ``[B, T]`` (segment A = 0, B = 1; default 0);
        attention_mask ``[B, T]``, 1/True = token, 0/False = padding (default: no padding);
        mlm_labels ``[B, T]`` (-100 = not predicted); nsp_labels ``[B]`` (0 = B follows A,
        1 = random); varlen: pack the padded batch (default ``config.varlen``)."""
        cfg = self.config
        device = self.embeddings.word.weight.device
        check_ids("input_ids", input_ids, cfg.vocab_size, cfg.n_positions, device=device)
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("input_ids must hold at least one token per row ([CLS]), got T=0")
        if token_type_ids is not None:
            check_ids("token_type_ids", token_type_ids, cfg.type_vocab_size, None,
                      what="type_vocab_size", device=device)
            if token_type_ids.shape != input_ids.shape:
                raise ValueError(f"token_type_ids must have the shape of input_ids [B, T] = "
                                 f"{(B, T)}, got {tuple(token_type_ids.shape)}")
        keep = _check_attention_mask(attention_mask, B, T, input_ids.device)
        if mlm_labels is not None and self.mlm is None:
            raise ValueError("mlm_labels given but the model has no MLM head (add_mlm_head)")
        if nsp_labels is not None and self.nsp is None:
            raise ValueError("nsp_labels given but the model has no NSP head (add_nsp_head)")
        check_labels("mlm_labels", mlm_labels, (B, T), cfg.vocab_size, device)
        check_labels("nsp_labels", nsp_labels, (B,), 2, device)

        emb = self.embeddings
        pos = torch.arange(T, device=input_ids.device)          # [T]
        x = emb.word(input_ids) + emb.position(pos)             # [B, T, D]
        if token_type_ids is not None:
            x = x + emb.token_type(token_type_ids)
        else:
            x = x + emb.token_type.weight[0]
        x = emb.drop(emb.ln(x))

        use_varlen = cfg.varlen if varlen is None else varlen
        if keep is None:                                        # no padding
            for layer in self.layers:
                x = layer(x)
        elif use_varlen:                                        # pack, run, unpack
            if self.pooler is not None and not torch.compiler.is_compiling():
                _check_first_position_kept(keep)
            xp, indices, cu_seqlens, max_seqlen = pack(x, keep)  # [total, D]
            for layer in self.layers:
                xp = layer.forward_packed(xp, cu_seqlens, max_seqlen)
            x = unpack(xp, indices, B, T)                       # [B, T, D]
        else:                                                   # padded, masked keys
            kpm = ~keep                                         # True = padding
            for layer in self.layers:
                x = layer(x, kpm)

        out = BertOutput(last_hidden_state=x)
        if self.pooler is not None:
            out.pooler_output = torch.tanh(self.pooler(x[:, 0]))  # [B, D]
        if self.mlm is not None:
            h = self.mlm.ln(activation(cfg.activation, self.mlm.dense(x)))
            out.mlm_logits = self.mlm.decoder(h)                # [B, T, V]
        if self.nsp is not None:
            out.nsp_logits = self.nsp(out.pooler_output)        # [B, 2]
        losses = []
        if mlm_labels is not None:
            # [B, T, V] -> [B*T, V]; [B, T] -> [B*T]
            losses.append(F.cross_entropy(out.mlm_logits.reshape(B * T, -1),
                                          mlm_labels.reshape(B * T), ignore_index=-100))
        if nsp_labels is not None:
            losses.append(F.cross_entropy(out.nsp_logits, nsp_labels))
        if losses:
            out.loss = sum(losses[1:], losses[0])
        return out


def _check_first_position_kept(keep: Tensor) -> None:
    """The varlen path with a pooler: the pooler reads position 0 ([CLS]), which the packed
    layers do not compute where it is padding (left padding): refused, naming the rows
    (the padded path computes it, as Hugging Face does). Rows that are all padding pass
    (their pooled output means nothing on either path). One small reduction beside pack's
    own host sync."""
    left = (~keep[:, 0] & keep.any(1)).nonzero().flatten().tolist()
    if left:
        raise ValueError(f"varlen=True: position 0 of rows {left[:8]} is padding (left "
                         "padding), but the pooler reads position 0 ([CLS]) and the varlen "
                         "path does not compute padded positions; pad on the right, or use "
                         "varlen=False")


def _check_attention_mask(mask: Optional[Tensor], B: int, T: int, device) -> Optional[Tensor]:
    """attention_mask ``[B, T]`` (1 = token, 0 = padding) -> bool keep ``[B, T]`` or None."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError("attention_mask must be a bool or integer tensor [B, T] (1 = token, "
                        f"0 = padding), got {getattr(mask, 'dtype', type(mask).__name__)}")
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"attention_mask must have shape [B, T] = [{B}, {T}], got "
                         f"{tuple(mask.shape)}")
    if mask.device != torch.device(device):
        raise ValueError(f"attention_mask must be on {device}, got {mask.device}")
    if mask.dtype != torch.bool:
        if values_checked(mask) and bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
        mask = mask != 0
    return mask


__all__ = ["BertConfig", "BertOutput", "Bert", "EncoderLayer"]
