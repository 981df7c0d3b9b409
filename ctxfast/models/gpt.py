"""GPT: a decoder-only transformer language model on ctxfast attention.

Both layouts of the original models, chosen by ``GPTConfig.prenorm``:

* GPT-2 (``prenorm=True``):  ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``, final ``ln_f``.
* GPT-1 (``prenorm=False``): ``x = ln_1(x + attn(x)); x = ln_2(x + mlp(x))``, no ``ln_f``.

Learned position embeddings, an LM head tied to the token embedding (``tie_weights``),
and :meth:`GPT.generate` with a key/value cache. Attention runs on
:func:`ctxfast.attention` (``backend="ctxfast"``) or on the eager reference
(``backend="eager"``); everything else is plain PyTorch.

    cfg = GPTConfig(vocab_size=100, n_positions=64, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    logits, loss = model(idx, targets)                      # idx, targets [B, T]
    out = model.generate(idx, max_new_tokens=20, temperature=0.0)   # greedy

Decoding with the cache: keys are ``[cache; new]`` and ctxfast's causal mask is
bottom-right aligned (query ``i`` sees key ``j <= i + cache_len``), so a cached step is
just ``attention(q_new, k_all, v_all, causal=True)``.
"""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import (MLP, KVCache, SelfAttention, check_backend, check_device, check_fields,
                      check_ids, check_sampling, init_weights, lm_decoder, next_token,
                      values_checked)


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    n_positions: int = 1024          # longest sequence (context window)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_inner: Optional[int] = None    # feed-forward width; None = 4 * n_embd
    dropout: float = 0.0             # residual branches (and embeddings, unless embd_dropout)
    attn_dropout: float = 0.0        # attention probabilities
    embd_dropout: Optional[float] = None   # embeddings; None = dropout (HF's embd_pdrop)
    bias: bool = True                # biases in Linear layers
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_tanh"    # GPT-2: "gelu_tanh" (gelu_new); GPT-1: "gelu"
    prenorm: bool = True             # True: GPT-2 (pre-LN + ln_f); False: GPT-1 (post-LN)
    tie_weights: bool = True         # lm_head.weight is wte.weight
    scale_attn_by_inverse_layer_idx: bool = False  # GPT-2 option: scale / (layer + 1)
    backend: str = "ctxfast"         # "ctxfast" | "eager"

    def __post_init__(self):
        check_fields(self, positive=("vocab_size", "n_positions", "n_head", "n_embd"),
                     non_negative=("n_layer",), optional_positive=("n_inner",),
                     drop_rates=("dropout", "embd_dropout"), attn_rates=("attn_dropout",))
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd = {self.n_embd} must be divisible by "
                             f"n_head = {self.n_head}")


class Block(nn.Module):
    """One transformer layer: attention and MLP, each with a residual and a LayerNorm."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        C = config.n_embd
        scale = (C // config.n_head) ** -0.5
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        self.layer, self.prenorm = layer, config.prenorm
        self.ln_1 = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.attn = SelfAttention(C, config.n_head, bias=config.bias,
                                  attn_dropout=config.attn_dropout,
                                  resid_dropout=config.dropout, scale=scale,
                                  backend=config.backend)
        self.ln_2 = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.mlp = MLP(C, 4 * C if config.n_inner is None else config.n_inner,
                       act=config.activation, bias=config.bias,
                       dropout=config.dropout)

    def forward(self, x: Tensor, cache: Optional[KVCache] = None) -> Tensor:
        """x ``[B, T, D]`` -> ``[B, T, D]``."""
        if self.prenorm:                                     # GPT-2
            x = x + self.attn(self.ln_1(x), causal=True, cache=cache, layer=self.layer)
            x = x + self.mlp(self.ln_2(x))
        else:                                                # GPT-1
            x = self.ln_1(x + self.attn(x, causal=True, cache=cache, layer=self.layer))
            x = self.ln_2(x + self.mlp(x))
        return x


class GPT(nn.Module):
    """Decoder-only LM. Parameters (nanoGPT's names): ``transformer.wte`` ``[V, D]``,
    ``transformer.wpe`` ``[n_positions, D]``, ``transformer.h.{i}.{ln_1, attn.qkv,
    attn.proj, ln_2, mlp.fc, mlp.proj}``, ``transformer.ln_f`` (GPT-2 layout only) and
    ``lm_head`` (``[V, D]``, the same tensor as ``wte`` when ``tie_weights``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        check_backend(config.backend)
        self.config = config = replace(config)                 # our own copy (set_backend)
        C = config.n_embd
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, C),
            wpe=nn.Embedding(config.n_positions, C),
            drop=nn.Dropout(config.dropout if config.embd_dropout is None
                            else config.embd_dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
        ))
        if config.prenorm:
            self.transformer.ln_f = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.lm_head = lm_decoder(C, config.vocab_size, False, config.backend)
        self.apply(init_weights)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight

    @property
    def backend(self) -> str:
        return self.config.backend

    def set_backend(self, backend: str) -> "GPT":
        """Switch every attention layer and the LM head to ``"ctxfast"`` or ``"eager"`` (weights
        unchanged)."""
        self.config.backend = check_backend(backend)
        for block in self.transformer.h:
            block.attn.backend = backend
        self.lm_head.backend = None if backend == "ctxfast" else "eager"
        return self

    def forward(self, idx: Tensor, targets: Optional[Tensor] = None, *,
                cache: Optional[KVCache] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """idx ``[B, T]`` token ids -> (logits ``[B, T, V]``, loss or None).

        targets: ``[B, T]``, the next token of each position (already shifted), -100 =
        ignored; the loss is the mean cross-entropy. cache: a :class:`KVCache` holding the
        keys/values of the previous tokens; idx then holds only the new ones, their
        positions continue after the cached ones, and the cache is extended in place.
        """
        cfg = self.config
        past = cache.length if cache is not None else 0
        check_ids("idx", idx, cfg.vocab_size, cfg.n_positions - past,
                  device=self.transformer.wte.weight.device)
        if cache is not None:
            cache.check_batch(idx.shape[0])
        if targets is not None:
            _check_targets(targets, idx, cfg.vocab_size)
        B, T = idx.shape
        pos = torch.arange(past, past + T, device=idx.device)   # [T]
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # [B, T, D]
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, cache)
        if cfg.prenorm:
            x = self.transformer.ln_f(x)
        logits = self.lm_head(x)                                # [B, T, V]
        loss = None
        if targets is not None:
            # [B, T, V] -> [B*T, V]; [B, T] -> [B*T]
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T),
                                   ignore_index=-100)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, *, use_cache: bool = True,
                 generator: Optional[torch.Generator] = None) -> Tensor:
        """Extend idx ``[B, T]`` by `max_new_tokens` tokens -> ``[B, T + max_new_tokens]``.

        temperature: divides the logits before sampling; 0 = greedy (argmax). top_k: sample
        only among the k most likely tokens. use_cache: keep the keys/values of the context
        (each new token then costs one step over the cache); without it every step runs the
        whole context again. Once the context exceeds ``n_positions`` only its last
        ``n_positions`` tokens are seen (positions are absolute, so the cache is then
        rebuilt for each step). Put the model in ``eval()`` mode first to turn dropout off.
        """
        cfg = self.config
        check_sampling(max_new_tokens, temperature, top_k)
        check_ids("idx", idx, cfg.vocab_size,                  # longer than n_positions is fine
                  device=self.transformer.wte.weight.device)
        if idx.shape[1] == 0:
            raise ValueError("idx must hold at least one token to generate from, got T=0")
        cache = KVCache(cfg.n_layer) if use_cache else None
        for _ in range(max_new_tokens):
            window = idx[:, -cfg.n_positions:]                  # [B, <= n_positions]
            if cache is not None and 0 < cache.length < cfg.n_positions:
                logits, _ = self(idx[:, -1:], cache=cache)      # one new token over the cache
            else:
                if cache is not None:
                    cache.reset()                               # (re)fill with the window
                logits, _ = self(window, cache=cache)
            nxt = next_token(logits[:, -1, :], temperature, top_k, generator)  # [B, 1]
            idx = torch.cat([idx, nxt], 1)
        return idx


def _check_targets(targets: Tensor, idx: Tensor, vocab: int) -> None:
    if not isinstance(targets, Tensor) or targets.dtype.is_floating_point:
        raise TypeError("targets must be an integer tensor [B, T]")
    if targets.shape != idx.shape:
        raise ValueError(f"targets must have the shape of idx [B, T] = {tuple(idx.shape)}, "
                         f"got {tuple(targets.shape)}")
    check_device("targets", targets, idx.device)                # idx is on the model's device
    if values_checked(targets):
        bad = (targets != -100) & ((targets < 0) | (targets >= vocab))
        if bool(bad.any()):
            raise ValueError(f"targets must be in [0, {vocab}) or -100 (ignored), got "
                             f"{targets[bad][0].item()}")


__all__ = ["GPTConfig", "GPT", "Block", "KVCache"]
