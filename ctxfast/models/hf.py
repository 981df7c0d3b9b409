"""``ctxfast.models.from_hf``: a ctxfast model with the weights of a Hugging Face model.

    import transformers, ctxfast.models
    hf = transformers.GPT2LMHeadModel.from_pretrained("gpt2")
    model = ctxfast.models.from_hf(hf)            # ctxfast.models.GPT, same weights
    logits, _ = model(idx)                         # == hf(idx).logits

Supported (by class name):

* ``BertModel``, ``BertForMaskedLM``, ``BertForPreTraining`` -> :class:`~ctxfast.models.bert.Bert`
  (pooler, MLM and NSP heads present exactly where the Hugging Face model has them);
* ``GPT2Model``, ``GPT2LMHeadModel`` -> :class:`~ctxfast.models.gpt.GPT` (GPT-2 layout; a
  ``GPT2Model`` gets an LM head tied to its token embedding);
* ``XLNetModel``, ``XLNetLMHeadModel`` -> ``ctxfast.models.xlnet.from_hf_xlnet``.

The weights are copied (the ctxfast model shares no storage with the Hugging Face one) and
the new model is in the Hugging Face model's dtype, device and train/eval mode. Options
our models do not implement (cross-attention, decoder BERT, relative position embeddings,
unscaled attention, an activation other than gelu/gelu_new/relu) raise ``ValueError``.
transformers itself is never imported here: the model passed in is inspected as it is.
"""
from typing import Dict

import torch
from torch import Tensor, nn

from ._common import check_backend
from .bert import Bert, BertConfig
from .gpt import GPT, GPTConfig

BERT_CLASSES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
GPT2_CLASSES = ("GPT2Model", "GPT2LMHeadModel")
XLNET_CLASSES = ("XLNetModel", "XLNetLMHeadModel")
SUPPORTED = BERT_CLASSES + GPT2_CLASSES + XLNET_CLASSES

# Hugging Face activation names -> ours
_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
        "gelu_fast": "gelu_tanh", "relu": "relu"}


def from_hf(hf_model: nn.Module, backend: str = "ctxfast") -> nn.Module:
    """Build the ctxfast model equivalent to `hf_model` (a transformers model instance;
    see the module docstring for the classes) with a copy of its weights."""
    check_backend(backend)
    names = [c.__name__ for c in type(hf_model).__mro__]
    kind = next((n for n in names if n in SUPPORTED), None)
    if kind is None:
        raise TypeError(f"from_hf: unsupported model class {type(hf_model).__name__}; "
                        f"supported: {', '.join(SUPPORTED)}")
    if kind in XLNET_CLASSES:
        try:
            from .xlnet import from_hf_xlnet
        except ImportError as e:
            raise ImportError(f"from_hf: {kind} needs ctxfast.models.xlnet.from_hf_xlnet, "
                              f"which is not available: {e}") from e
        return from_hf_xlnet(hf_model, backend=backend)
    model = _bert(hf_model, kind, backend) if kind in BERT_CLASSES else _gpt2(hf_model, kind, backend)
    p = next(hf_model.parameters())
    return model.to(device=p.device, dtype=p.dtype).train(hf_model.training)


def _act(name, where: str) -> str:
    if not isinstance(name, str) or name not in _ACT:
        raise ValueError(f"from_hf: {where}={name!r} is not supported; supported: "
                         f"{', '.join(_ACT)}")
    return _ACT[name]


def _load(model: nn.Module, sd: Dict[str, Tensor]) -> None:
    """Copy `sd` into `model`, cast first to the weights' dtype and device (loaded into the
    fp32 model and cast after, fp64 weights lost their low bits: 9.5e-7 off); every
    parameter must be covered (tied ones once is enough)."""
    sd = {k: v.detach().clone() for k, v in sd.items()}
    first = next((v for v in sd.values() if v.is_floating_point()), None)
    if first is not None:
        model.to(device=first.device, dtype=first.dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    given = {id(params[n]) for n in sd if n in params}
    missing = [m for m in missing if id(params.get(m)) not in given]  # tied: loaded once
    if missing or unexpected:
        raise RuntimeError(f"from_hf: weight mapping incomplete: missing {missing}, "
                           f"unexpected {unexpected}")


# --------------------------------------------------------------------------- GPT-2

def _gpt2(hf: nn.Module, kind: str, backend: str) -> GPT:
    c = hf.config
    if getattr(c, "add_cross_attention", False):
        raise ValueError("from_hf: GPT-2 with add_cross_attention=True is not supported")
    if not getattr(c, "scale_attn_weights", True):
        raise ValueError("from_hf: GPT-2 with scale_attn_weights=False is not supported")
    tr = hf.transformer if kind == "GPT2LMHeadModel" else hf
    tied = kind == "GPT2Model" or hf.lm_head.weight is tr.wte.weight
    cfg = GPTConfig(vocab_size=c.vocab_size, n_positions=c.n_positions, n_layer=c.n_layer,
                    n_head=c.n_head, n_embd=c.n_embd, n_inner=c.n_inner,
                    dropout=c.resid_pdrop, attn_dropout=c.attn_pdrop,
                    embd_dropout=c.embd_pdrop, bias=True,
                    layer_norm_eps=c.layer_norm_epsilon,
                    activation=_act(c.activation_function, "activation_function"),
                    prenorm=True, tie_weights=tied,
                    scale_attn_by_inverse_layer_idx=bool(c.scale_attn_by_inverse_layer_idx),
                    backend=backend)
    model = GPT(cfg)
    # Conv1D stores weight [in, out] (x @ W); nn.Linear stores [out, in] (x @ W.T): transpose.
    sd = {"transformer.wte.weight": tr.wte.weight, "transformer.wpe.weight": tr.wpe.weight,
          "transformer.ln_f.weight": tr.ln_f.weight, "transformer.ln_f.bias": tr.ln_f.bias}
    for i, h in enumerate(tr.h):
        p = f"transformer.h.{i}."
        sd.update({
            p + "ln_1.weight": h.ln_1.weight, p + "ln_1.bias": h.ln_1.bias,
            p + "attn.qkv.weight": h.attn.c_attn.weight.t(),     # [D, 3D] -> [3D, D]
            p + "attn.qkv.bias": h.attn.c_attn.bias,
            p + "attn.proj.weight": h.attn.c_proj.weight.t(),    # [D, D] -> [D, D]
            p + "attn.proj.bias": h.attn.c_proj.bias,
            p + "ln_2.weight": h.ln_2.weight, p + "ln_2.bias": h.ln_2.bias,
            p + "mlp.fc.weight": h.mlp.c_fc.weight.t(),          # [D, 4D] -> [4D, D]
            p + "mlp.fc.bias": h.mlp.c_fc.bias,
            p + "mlp.proj.weight": h.mlp.c_proj.weight.t(),      # [4D, D] -> [D, 4D]
            p + "mlp.proj.bias": h.mlp.c_proj.bias,
        })
    if not tied:
        sd["lm_head.weight"] = hf.lm_head.weight
    _load(model, sd)
    return model


# --------------------------------------------------------------------------- BERT

def _bert(hf: nn.Module, kind: str, backend: str) -> Bert:
    c = hf.config
    if getattr(c, "is_decoder", False) or getattr(c, "add_cross_attention", False):
        raise ValueError("from_hf: BERT as a decoder (is_decoder / add_cross_attention) is "
                         "not supported")
    pos_type = getattr(c, "position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ValueError(f"from_hf: BERT with position_embedding_type={pos_type!r} is not "
                         "supported (only 'absolute')")
    bert = hf if kind == "BertModel" else hf.bert
    heads = None if kind == "BertModel" else hf.cls
    pred = heads.predictions if heads is not None else None
    has_nsp = kind == "BertForPreTraining"
    tied = pred is not None and pred.decoder.weight is bert.embeddings.word_embeddings.weight
    emb = bert.embeddings
    cfg = BertConfig(vocab_size=c.vocab_size, n_positions=c.max_position_embeddings,
                     type_vocab_size=c.type_vocab_size, n_layer=c.num_hidden_layers,
                     n_head=c.num_attention_heads, n_embd=c.hidden_size,
                     n_inner=c.intermediate_size, dropout=c.hidden_dropout_prob,
                     attn_dropout=c.attention_probs_dropout_prob, layer_norm_eps=c.layer_norm_eps,
                     activation=_act(c.hidden_act, "hidden_act"),
                     pad_token_id=emb.word_embeddings.padding_idx,
                     add_pooler=bert.pooler is not None, add_mlm_head=pred is not None,
                     add_nsp_head=has_nsp, tie_weights=tied or pred is None, backend=backend)
    model = Bert(cfg)
    sd = {"embeddings.word.weight": emb.word_embeddings.weight,
          "embeddings.position.weight": emb.position_embeddings.weight,
          "embeddings.token_type.weight": emb.token_type_embeddings.weight,
          "embeddings.ln.weight": emb.LayerNorm.weight, "embeddings.ln.bias": emb.LayerNorm.bias}
    for i, layer in enumerate(bert.encoder.layer):
        p, a = f"layers.{i}.", layer.attention
        q, k, v = a.self.query, a.self.key, a.self.value
        sd.update({
            p + "attn.qkv.weight": torch.cat([q.weight, k.weight, v.weight], 0),  # [3D, D]
            p + "attn.qkv.bias": torch.cat([q.bias, k.bias, v.bias], 0),          # [3D]
            p + "attn.proj.weight": a.output.dense.weight, p + "attn.proj.bias": a.output.dense.bias,
            p + "ln_1.weight": a.output.LayerNorm.weight, p + "ln_1.bias": a.output.LayerNorm.bias,
            p + "mlp.fc.weight": layer.intermediate.dense.weight,
            p + "mlp.fc.bias": layer.intermediate.dense.bias,
            p + "mlp.proj.weight": layer.output.dense.weight,
            p + "mlp.proj.bias": layer.output.dense.bias,
            p + "ln_2.weight": layer.output.LayerNorm.weight,
            p + "ln_2.bias": layer.output.LayerNorm.bias,
        })
    if bert.pooler is not None:
        sd.update({"pooler.weight": bert.pooler.dense.weight, "pooler.bias": bert.pooler.dense.bias})
    if pred is not None:
        t = pred.transform
        sd.update({"mlm.dense.weight": t.dense.weight, "mlm.dense.bias": t.dense.bias,
                   "mlm.ln.weight": t.LayerNorm.weight, "mlm.ln.bias": t.LayerNorm.bias,
                   "mlm.decoder.bias": pred.decoder.bias if pred.decoder.bias is not None
                   else pred.bias})
        if not tied:
            sd["mlm.decoder.weight"] = pred.decoder.weight
    if has_nsp:
        sd.update({"nsp.weight": heads.seq_relationship.weight,
                   "nsp.bias": heads.seq_relationship.bias})
    _load(model, sd)
    return model


__all__ = ["from_hf", "SUPPORTED"]
