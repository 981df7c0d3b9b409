"""Hugging Face transformers integration: ``model.set_attn_implementation("ctxfast")``.

    import ctxfast.integrations.hf as ctxfast_hf
    ctxfast_hf.register()                       # once
    model.set_attn_implementation("ctxfast")    # BERT, GPT-2, ... built from a config

Two registrations: the attention function (q, k, v ``[B, H, T, D]`` -> ``[B, T, H, D]``)
and a mask function that hands the attention a 2-D padding mask ``[B, Tk]`` (True = keep)
instead of a materialised ``[B, 1, Tq, Tk]`` one; causality comes from the module's
``is_causal``. Decoding with a cache works as is: ctxfast's causal mask is bottom-right
aligned, so the last ``Tq`` positions see the whole past. Masks that are not plain
causal or bidirectional (sliding windows, chunks, packed-sequence overlays) and 4-D
masks passed by the user are refused with an error rather than computed wrong, as are
the attention call's arguments that change the result and that ctxfast does not compute
(:data:`_UNSUPPORTED`: sinks, soft caps, sparse indices, packed ``cu_seq_lens``) and
``output_attentions=True``. GPT-2 takes ``output_attentions`` itself and does not pass it
on: its ``attentions`` come back empty, as with ``"sdpa"``.

transformers is optional: importing this module does not import it; :func:`register` does.
"""
from typing import Optional

import torch

from .. import ops


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * n_rep, T, D] (grouped-query attention)."""
    if n_rep == 1:
        return x
    B, Hkv, T, D = x.shape
    return x[:, :, None].expand(B, Hkv, n_rep, T, D).reshape(B, Hkv * n_rep, T, D)


#: Keyword arguments of transformers' attention calls that change the result and that
#: ctxfast's attention does not compute: refused when given (not None), not ignored. (The
#: models that pass sinks or a sliding window also build masks the mask function refuses;
#: refused here too, whatever mask comes with them.)
_UNSUPPORTED = {
    "softcap": "a logit soft cap", "position_bias": "an additive position_bias",
    "s_aux": "attention sinks", "sinks": "attention sinks",
    "sliding_window": "a sliding window", "indices": "sparse (top-k) attention",
    "block_indices": "block-sparse attention",
    "cu_seq_lens_q": "packed sequences", "cu_seq_lens_k": "packed sequences",
}


def make_attention_function(backend: Optional[str] = None):
    """The function registered with transformers' ``AttentionInterface``."""

    def ctxfast_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                  scaling=None, is_causal=None, **kwargs):
        for name, what in _UNSUPPORTED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"ctxfast attention does not support {what} ({name}=); use "
                                 "attn_implementation='sdpa' or 'eager' for this model")
        if kwargs.get("output_attentions"):
            raise ValueError("ctxfast attention does not form the attention weights "
                             "(output_attentions=True); use attn_implementation='eager' "
                             "for them")
        n_rep = query.shape[1] // key.shape[1]
        key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
        # causality from the call or the module; a module that says neither (Splinter,
        # ALIGN's and CLAP's text encoders) is refused rather than guessed: taken as causal,
        # those bidirectional encoders ran causally without a word
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", None)
        if causal is None:
            raise ValueError(f"ctxfast attention: {type(module).__name__} gives no is_causal "
                             "(neither in the call nor as an attribute), so whether its "
                             "attention is causal is unknown; use 'sdpa' or 'eager'")
        kpm = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    "ctxfast attention takes a 2-D padding mask [B, Tk] (from its registered "
                    f"mask function); got a mask of shape {tuple(attention_mask.shape)}. "
                    "Custom 4-D masks cannot be expressed from O(T) data.")
            kpm = ~attention_mask.to(torch.bool)                  # True = padding
        if causal and query.shape[2] > key.shape[2]:
            raise ValueError("ctxfast attention: causal with more queries than keys")
        out = ops.attention(query, key, value, causal=bool(causal), key_padding_mask=kpm,
                            dropout_p=float(dropout), scale=scaling, backend=backend)
        return out.transpose(1, 2).contiguous(), None            # [B, Tq, H, D]

    return ctxfast_attention_forward


def padding_mask_function(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                          mask_function=None, attention_mask=None, **kwargs):
    """The function registered with transformers' ``AttentionMaskInterface``: returns the
    2-D padding mask ``[B, kv_length]`` (True = keep), or None when nothing is padded."""
    from transformers import masking_utils as mu
    plain = (mu.causal_mask_function, mu.bidirectional_mask_function)
    if mask_function is not None and mask_function not in plain:
        raise ValueError("ctxfast attention supports causal and bidirectional masks with "
                         f"padding; this model asked for {getattr(mask_function, '__name__', mask_function)}")
    # ctxfast's causal mask is bottom-right aligned: right where the last query is the last
    # key. A cache with keys past the queries (StaticCache's empty slots) would let each
    # query see later keys (0.064 off a full pass, silently): refused
    if mask_function is mu.causal_mask_function and q_offset + q_length != kv_offset + kv_length:
        raise ValueError(f"ctxfast attention: the queries end at {q_offset + q_length} but the "
                         f"keys at {kv_offset + kv_length} (a static cache's empty slots?); "
                         "its causal mask needs them to end together: use a DynamicCache, "
                         "or 'sdpa'")
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[1] != kv_length:
        raise ValueError(f"ctxfast attention: padding mask covers {mask.shape[1]} keys, "
                         f"expected {kv_length}")
    if torch.compiler.is_compiling():
        return mask            # (mask.all() below is data-dependent: no fullgraph)
    return None if bool(mask.all()) else mask


def register(name: str = "ctxfast", backend: Optional[str] = None) -> str:
    """Register ctxfast's attention with transformers under `name`; returns `name`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, make_attention_function(backend))
    AttentionMaskInterface.register(name, padding_mask_function)
    return name
