"""End-to-end benchmarks of the reference models (``ctxfast.models``): a training step and
an evaluation forward of each model with ``backend="ctxfast"`` against the same model with
``backend="eager"``, on the same weights and batches in the same run.

One case per model: ``gpt`` (GPT-2 small), ``bert`` (BERT-base, padded batches),
``xlnet`` (XLNet-base, two streams with memory and partial prediction),
``transformer_xl`` (the paper's 12-layer enwik8 model with memory), ``awd_lstm``
(ULMFiT's language model) and ``elmo`` (the ELMo-small biLM, trained with a full softmax).
Sizes: those on CUDA; smaller ones on the CPU (full run); toy ones with
``CTXFAST_BENCH_QUICK=1`` (the whole suite in well under a minute on the 2-core CPU).

Modes:

* ``train-step``: ``zero_grad``, forward with the loss, backward, ``AdamW.step()`` (torch's
  default implementation for the device), the model in ``train()`` mode (its dropouts on);
* ``eval``: the same forward and loss under ``torch.no_grad()`` in ``eval()`` mode (what a
  validation loop runs).

``ms`` is one step (or one evaluation batch); ``extra_info["tokens"]`` = ``B·T`` (the
token positions of a batch, also in the case name), so ``report.py``'s records carry
``tokens_per_s`` and ``baseline_tokens_per_s`` = ``B·T / ms``: training and evaluation
throughput, ours and eager's.

Backends:

* ``ctxfast``: the model with ``backend="ctxfast"``. ctxfast's dispatch picks each op's
  implementation (no ``backend=`` is forced): on CUDA the Triton kernels (LSTM: the CUDA
  C++ kernel where built); on the CPU the C++ kernels (``cpu`` backend) for ``attention``,
  ``rel_attention`` (segments and attention dropout included) and ``lstm``, against the
  eager reference (Transformer-XL: the original pad-and-view formulation; AWD-LSTM and
  ELMo: the eager loop over time steps). The op backends that ran are recorded in
  ``extra_info["op_backends"]`` ({op: [backends]}, seen through ``ctxfast._dispatch``
  during the check).
* ``hf-sdpa`` (CUDA only; GPT and BERT; needs transformers): the same model as Hugging
  Face's ``GPT2LMHeadModel`` / ``BertForPreTraining`` built with
  ``attn_implementation="sdpa"`` (``F.scaled_dot_product_attention``). Our models have
  no SDPA path of their own, so this is the "same model on SDPA": same architecture,
  configuration and loss, its weights checked against ours through
  ``ctxfast.models.from_hf``.
* ``fastai`` (AWD-LSTM only): the model as fastai's users run it — every LSTM layer
  an ``nn.LSTM`` (cuDNN on a GPU) wrapped in fastai's ``WeightDropout``, which writes a
  dropped copy of ``weight_hh_l0`` into the LSTM before each forward
  (``bench_lstm.FastaiWeightDropLSTM``); the other dropouts as the eager backend. It is the
  report's baseline for AWD-LSTM (:func:`report_baseline`): the eager backend's Python
  loop over time steps is no baseline anyone uses.
* ``eager``: the model with ``backend="eager"`` (``ctxfast/reference``, or for
  Transformer-XL the original formulation): the reference of the check, and the report's
  baseline for every model but AWD-LSTM.

Precision: fp32 on the CPU. On CUDA, GPT, BERT, XLNet and Transformer-XL train under
``torch.autocast(bfloat16)`` with fp32 weights (the attention ops run in bf16, their fp32
biases cast as SDPA casts its inputs); AWD-LSTM and ELMo in fp32.

Weights: built by the model, then every parameter of two or more dimensions redrawn from
``N(0, 1 / fan_in)`` (:func:`lecun_init_`), the same for every backend of a case. At
GPT-2's ``N(0, 0.02)`` attention is nearly uniform and the check below could not see a
wrong position term (measured: Transformer-XL with its ``r`` reversed changed the output
by less than 1e-4); with unit-variance scores it changes it by 2.6%.

Check before timing, on the first batch with dropout off (``eval()``): the output, the
loss and, in ``train-step``, the gradients (all parameters together; for ``hf-sdpa`` the
token embedding and the first layer's LayerNorm, parameters with the same meaning in both
models) against the eager model in fp32 without autocast. Bound on the relative error:
``1e-4`` in fp32 on the CPU (measured there: ≤ 7e-7), ``1e-2`` in fp32 on CUDA (Triton's
fp32 ``tl.dot`` runs in TF32), and in bf16 ``2 ×`` the eager model's own error in the same
precision ``+ 2e-2``. Measured on the CPU quick cases, deliberate bugs fail it: a causal
GPT made non-causal (error 0.78), BERT without its padding mask (0.13), XLNet's query
stream run as the content stream (0.026), Transformer-XL's ``r`` reversed (0.026), a
``rel_attention`` off by 1% (7e-4). The op tests in ``tests/`` are the accuracy tests.

FLOPs (``extra_info["flops"]``, TFLOP/s in the report): counted with
``torch.utils.flop_counter``'s formulas (:class:`FlopCount`) on the eager fp32 model's
forward (and backward, in ``train-step``) of the check: matmuls, convolutions and attention
as the eager code computes them (dense scores: causal and permutation masks are not
discounted); the optimizer step and elementwise work are not counted. The same count is
used for every backend of a case and mode.
"""
from __future__ import annotations

import contextlib
import copy
import gc
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import _common
from ctxfast import _dispatch
from ctxfast import models as M
from ctxfast.models import elmo as _elmo

OP = "models"
BASELINE = "eager"
HF_SDPA = "hf-sdpa"
FASTAI = "fastai"
MODES = ("train-step", "eval")
BACKENDS = ("ctxfast", HF_SDPA, FASTAI, BASELINE)
HF_MODELS = ("gpt", "bert")

#: precision -> (parameter dtype, autocast dtype or None)
PRECISIONS = {"fp32": (torch.float32, None), "bf16-amp": (torch.float32, torch.bfloat16),
              "bf16": (torch.bfloat16, None)}


class Case(NamedTuple):
    model: str                          # key of WORKLOADS
    label: str                          # e.g. "GPT-2-small"
    B: int
    T: int                              # sequence (segment) length
    cfg: Tuple[Tuple[str, object], ...]  # the model config's fields
    mem: int = 0                        # memory length (XLNet, Transformer-XL)
    P: int = 0                          # XLNet: predicted tokens per sequence
    precision: str = "fp32"             # key of PRECISIONS
    devices: Tuple[str, ...] = ("cpu", "cuda")

    @property
    def name(self) -> str:              # "gpt GPT-2-small B8 T1024 bf16-amp"
        tail = "" if self.precision == "fp32" else f" {self.precision}"
        return f"{self.model} {self.label} B{self.B} T{self.T}{tail}"

    @property
    def config(self) -> dict:
        return dict(self.cfg)


def _cfg(**kw) -> Tuple[Tuple[str, object], ...]:
    return tuple(sorted(kw.items()))


# Real sizes (CUDA). GPT-2 small: nanoGPT's dropout 0. BERT-base: phase-2 length 512,
# padded batches. XLNet-base: seq 512, mem 384, 85 predictions (1/6), as its pretraining.
# Transformer-XL: run_enwik8_base.sh (12 layers, d 512, tgt 512, mem 512). ULMFiT: fastai's
# AWD-LSTM LM (vocab 60k, 400/1152, bptt 70, its LM dropouts). ELMo-small: AllenNLP's
# "small" options (cell 1024, projection 128, one highway), unroll 20; a 32k-word full
# softmax in place of the original sampled softmax over 793k words.
_GPT2_SMALL = _cfg(vocab_size=50257, n_positions=1024, n_layer=12, n_head=12, n_embd=768)
_BERT_BASE = _cfg(vocab_size=30522, n_positions=512, n_layer=12, n_head=12, n_embd=768)
_XLNET_BASE = _cfg(vocab_size=32000, d_model=768, n_layer=12, n_head=12, d_inner=3072)
_TXL_ENWIK8 = _cfg(n_token=204, n_layer=12, n_head=8, d_model=512, d_head=64, d_inner=2048,
                   dropout=0.1, tgt_len=512, mem_len=512)
_ULMFIT = _cfg(vocab_size=60000, emb_sz=400, n_hid=1152, n_layers=3)
_ELMO_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))
_ELMO_SMALL = _cfg(filters=_ELMO_FILTERS, n_highway=1, char_embed_dim=16, projection_dim=128,
                   cell_size=1024, n_layers=2, max_characters_per_token=50,
                   vocab_size=32768, lm_dropout=0.1)

QUICK_CASES = (
    Case("gpt", "tiny", 2, 32, _cfg(vocab_size=256, n_positions=64, n_layer=2, n_head=2,
                                     n_embd=64)),
    Case("bert", "tiny", 2, 32, _cfg(vocab_size=256, n_positions=64, n_layer=2, n_head=2,
                                      n_embd=64)),
    Case("xlnet", "tiny", 2, 32, _cfg(vocab_size=256, d_model=64, n_layer=2, n_head=2,
                                       d_inner=128), mem=16, P=6),
    Case("transformer_xl", "tiny", 2, 32, _cfg(n_token=204, n_layer=2, n_head=2, d_model=64,
                                                d_head=32, d_inner=128, tgt_len=32,
                                                mem_len=32), mem=32),
    Case("awd_lstm", "tiny", 4, 16, _cfg(vocab_size=256, emb_sz=32, n_hid=64, n_layers=3)),
    Case("elmo", "tiny", 4, 10, _cfg(filters=((1, 16), (2, 16), (3, 32)), n_highway=1,
                                      char_embed_dim=8, projection_dim=32, cell_size=64,
                                      n_layers=2, max_characters_per_token=16,
                                      vocab_size=256)),
)
FULL_CASES = (
    # CPU (fp32): a few layers of each model, a few minutes for the suite on 2 cores
    Case("gpt", "4L-256", 4, 256, _cfg(vocab_size=8192, n_positions=256, n_layer=4, n_head=4,
                                        n_embd=256), devices=("cpu",)),
    Case("bert", "4L-256", 4, 256, _cfg(vocab_size=8192, n_positions=256, n_layer=4,
                                         n_head=4, n_embd=256), devices=("cpu",)),
    Case("xlnet", "4L-256", 4, 256, _cfg(vocab_size=8192, d_model=256, n_layer=4, n_head=4,
                                          d_inner=1024), mem=128, P=42, devices=("cpu",)),
    Case("transformer_xl", "4L-256", 4, 256, _cfg(n_token=204, n_layer=4, n_head=4,
                                                   d_model=256, d_head=64, d_inner=1024,
                                                   tgt_len=256, mem_len=256),
         mem=256, devices=("cpu",)),
    Case("awd_lstm", "200-576", 8, 35, _cfg(vocab_size=8192, emb_sz=200, n_hid=576,
                                             n_layers=3), devices=("cpu",)),
    Case("elmo", "cell512-proj64", 8, 20, _cfg(filters=_ELMO_FILTERS[:5], n_highway=1,
                                                char_embed_dim=16, projection_dim=64,
                                                cell_size=512, n_layers=2,
                                                max_characters_per_token=50,
                                                vocab_size=8192), devices=("cpu",)),
    # CUDA: the real sizes
    Case("gpt", "GPT-2-small", 8, 1024, _GPT2_SMALL, precision="bf16-amp", devices=("cuda",)),
    Case("bert", "BERT-base", 16, 512, _BERT_BASE, precision="bf16-amp", devices=("cuda",)),
    Case("xlnet", "XLNet-base", 8, 512, _XLNET_BASE, mem=384, P=85, precision="bf16-amp",
         devices=("cuda",)),
    Case("transformer_xl", "enwik8-base", 16, 512, _TXL_ENWIK8, mem=512,
         precision="bf16-amp", devices=("cuda",)),
    Case("awd_lstm", "ULMFiT", 64, 70, _ULMFIT, devices=("cuda",)),
    Case("elmo", "ELMo-small", 128, 20, _ELMO_SMALL, devices=("cuda",)),
)


# --------------------------------------------------------------------------- workloads

def _lengths(B: int, T: int, device) -> Tensor:
    """Right-padding lengths ``[B]`` in ``[T // 2, T]``, the first row full."""
    lengths = torch.randint(T // 2, T + 1, (B,), device=device)
    lengths[0] = T
    return lengths


class Workload:
    """How to build one model, make a batch, and run it to ``(loss, output)``.

    ``build(case, backend)``: the model in fp32 on the CPU. ``batch(case, device, dtype)``:
    a tuple of tensors (floats in `dtype`). ``run(model, batch)``: ``(scalar loss, main
    output)``; ``view(out, batch)``: the part of the output compared in the check.
    Hugging Face (GPT, BERT): ``hf_build(case)``, ``hf_run(hf, batch)`` and ``hf_grads``,
    pairs of (our parameter name, theirs) whose gradients are compared."""

    hf_grads: Tuple[Tuple[str, str], ...] = ()

    def build(self, case: Case, backend: str) -> nn.Module:
        raise NotImplementedError

    def batch(self, case: Case, device, dtype) -> tuple:
        raise NotImplementedError

    def run(self, model: nn.Module, batch: tuple) -> Tuple[Tensor, Tensor]:
        raise NotImplementedError

    def view(self, out: Tensor, batch: tuple) -> Tensor:
        return out


class GPTWorkload(Workload):
    hf_grads = (("transformer.wte.weight", "transformer.wte.weight"),
                ("transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.weight"))

    def build(self, case, backend):
        return M.GPT(M.GPTConfig(**case.config, backend=backend))

    def batch(self, case, device, dtype):
        idx = torch.randint(0, case.config["vocab_size"], (case.B, case.T), device=device)
        targets = F.pad(idx[:, 1:], (0, 1), value=-100)     # next token; none for the last
        return idx, targets

    def run(self, model, batch):
        idx, targets = batch
        logits, loss = model(idx, targets)                  # [B, T, V]
        return loss, logits

    def hf_build(self, case):
        import transformers
        c = case.config
        hc = transformers.GPT2Config(vocab_size=c["vocab_size"], n_positions=c["n_positions"],
                                     n_embd=c["n_embd"], n_layer=c["n_layer"],
                                     n_head=c["n_head"], activation_function="gelu_new",
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     layer_norm_epsilon=1e-5,
                                     bos_token_id=c["vocab_size"] - 1,
                                     eos_token_id=c["vocab_size"] - 1)
        return transformers.GPT2LMHeadModel._from_config(hc, attn_implementation="sdpa")

    def hf_run(self, hf, batch):
        idx, _ = batch
        r = hf(input_ids=idx, labels=idx)   # HF shifts the labels: the same loss as ours
        return r.loss, r.logits


class BertWorkload(Workload):
    hf_grads = (("embeddings.word.weight", "bert.embeddings.word_embeddings.weight"),
                ("layers.0.ln_1.weight",
                 "bert.encoder.layer.0.attention.output.LayerNorm.weight"))

    def build(self, case, backend):
        return M.Bert(M.BertConfig(**case.config, backend=backend))

    def batch(self, case, device, dtype):
        B, T, V = case.B, case.T, case.config["vocab_size"]
        ids = torch.randint(1, V, (B, T), device=device)
        pos = torch.arange(T, device=device)[None]                         # [1, T]
        lengths = _lengths(B, T, device)[:, None]                           # [B, 1]
        am = (pos < lengths).long()                                         # [B, T]
        tt = (pos >= lengths // 2).long() * am                              # two segments
        pick = (torch.rand(B, T, device=device) < 0.15) & (am == 1)         # 15% predicted
        pick[:, 0] = True
        mlm = torch.where(pick, ids, torch.full_like(ids, -100))
        nsp = torch.randint(0, 2, (B,), device=device)
        return ids, tt, am, mlm, nsp

    def run(self, model, batch):
        ids, tt, am, mlm, nsp = batch
        out = model(ids, tt, am, mlm_labels=mlm, nsp_labels=nsp)
        return out.loss, out.mlm_logits                                     # [B, T, V]

    def view(self, out, batch):
        return out[batch[2].bool()]        # real tokens only: padded rows mean nothing

    def hf_build(self, case):
        import transformers
        c = case.config
        hc = transformers.BertConfig(vocab_size=c["vocab_size"], hidden_size=c["n_embd"],
                                     num_hidden_layers=c["n_layer"],
                                     num_attention_heads=c["n_head"],
                                     intermediate_size=4 * c["n_embd"],
                                     max_position_embeddings=c["n_positions"],
                                     hidden_act="gelu", layer_norm_eps=1e-12)
        return transformers.BertForPreTraining._from_config(hc, attn_implementation="sdpa")

    def hf_run(self, hf, batch):
        ids, tt, am, mlm, nsp = batch
        r = hf(input_ids=ids, attention_mask=am, token_type_ids=tt, labels=mlm,
               next_sentence_label=nsp)
        return r.loss, r.prediction_logits


class XLNetWorkload(Workload):
    def build(self, case, backend):
        return M.XLNetLMHeadModel(M.XLNetConfig(**case.config), backend=backend)

    def batch(self, case, device, dtype):
        c = case.config
        B, T, P = case.B, case.T, case.P
        ids = torch.randint(0, c["vocab_size"], (B, T), device=device)
        tt = (torch.arange(T, device=device) >= T // 2).long().expand(B, T).contiguous()
        rank = torch.stack([torch.randperm(T, device=device) for _ in range(B)])  # [B, T]
        last = rank.argsort(dim=1)[:, T - P:]            # [B, P]: the last P in each order
        tm = F.one_hot(last, T).to(dtype)                # [B, P, T]
        labels = ids.gather(1, last)                     # [B, P]
        mems = tuple(torch.randn(case.mem, B, c["d_model"], device=device, dtype=dtype)
                     for _ in range(c["n_layer"]))
        return (ids, tt, rank, tm, labels) + mems

    def run(self, model, batch):
        ids, tt, rank, tm, labels = batch[:5]
        out = model(ids, token_type_ids=tt, mems=list(batch[5:]) or None, perm_rank=rank,
                    target_mapping=tm, labels=labels)
        return out.loss, out.logits                      # [B, P, V]


class TransformerXLWorkload(Workload):
    def build(self, case, backend):
        return M.TransformerXL(M.TransformerXLConfig(**case.config, backend=backend))

    def batch(self, case, device, dtype):
        c = case.config
        seq = torch.randint(0, c["n_token"], (case.T + 1, case.B), device=device)
        mems = tuple(torch.randn(case.mem, case.B, c["d_model"], device=device, dtype=dtype)
                     for _ in range(c["n_layer"] + 1))
        return (seq[:-1], seq[1:]) + mems                # data, target [T, B]; mems

    def run(self, model, batch):
        data, target = batch[:2]
        nll, _ = model(data, target, *batch[2:])         # [T, B] nats per token
        return nll.float().mean(), nll


class AWDLSTMWorkload(Workload):
    def build(self, case, backend):
        return M.AWDLSTMLM(M.AWDLSTMConfig(**case.config, backend=backend))

    def batch(self, case, device, dtype):
        seq = torch.randint(0, case.config["vocab_size"], (case.B, case.T + 1), device=device)
        return seq[:, :-1], seq[:, 1:]

    def run(self, model, batch):
        logits, loss = model(*batch)                     # [B, T, V]; the state is carried
        return loss, logits


class ElmoWorkload(Workload):
    def build(self, case, backend):
        return M.ElmoBiLM(M.ElmoConfig(**case.config, backend=backend))

    def batch(self, case, device, dtype):
        c = case.config
        B, T, C = case.B, case.T, c["max_characters_per_token"]
        # words of 1-10 random letters: [BOW, letters, EOW, PAD...] (+1, as batch_to_ids)
        wl = torch.randint(1, min(10, C - 2) + 1, (B, T, 1), device=device)
        pos = torch.arange(C, device=device)                                # [C]
        letters = torch.randint(ord("a"), ord("z") + 1, (B, T, C), device=device)
        ids = torch.where(pos <= wl, letters, _elmo.PAD_CHAR)
        ids = torch.where(pos == wl + 1, _elmo.EOW_CHAR, ids)
        ids[..., 0] = _elmo.BOW_CHAR
        ids = ids + 1                                                       # [B, T, C]
        words = torch.arange(T, device=device)[None] < _lengths(B, T, device)[:, None]
        char_ids = ids * words[..., None]                # right padding: all-zero tokens
        word_ids = torch.randint(0, c["vocab_size"], (B, T), device=device)
        return char_ids, word_ids

    def run(self, model, batch):
        out = model(*batch)
        return out.loss, out.activations[-1]             # [B, T + 2, 2 * projection_dim]


WORKLOADS: Dict[str, Workload] = {
    "gpt": GPTWorkload(), "bert": BertWorkload(), "xlnet": XLNetWorkload(),
    "transformer_xl": TransformerXLWorkload(), "awd_lstm": AWDLSTMWorkload(),
    "elmo": ElmoWorkload(),
}


def _params():
    return [p for p in _common.params(QUICK_CASES, FULL_CASES, MODES, BACKENDS)
            if not (p.values[2] == HF_SDPA and p.values[0].model not in HF_MODELS)
            and not (p.values[2] == FASTAI and p.values[0].model != "awd_lstm")]


def report_baseline(case: Case) -> str:
    """The backend the report pairs the others with: for AWD-LSTM the model as fastai's
    users run it (:data:`FASTAI`), for the others the model's eager backend."""
    return FASTAI if case.model == "awd_lstm" else BASELINE


def to_fastai(model: nn.Module, weight_p: float) -> nn.Module:
    """An AWD-LSTM language model (eager backend) with every ``WeightDropLSTM`` replaced by
    what fastai runs: ``nn.LSTM`` (cuDNN on a GPU) wrapped in fastai's ``WeightDropout``,
    which writes a dropped copy of ``weight_hh_l0`` into the LSTM before every forward
    (``bench_lstm.FastaiWeightDropLSTM``). Same weights; parameter names as fastai's
    (``rnns.{k}.weight_hh_l0_raw``, ``rnns.{k}.module.weight_ih_l0``, ...)."""
    from bench_lstm import FastaiWeightDropLSTM
    for k, rnn in enumerate(model.encoder.rnns):
        lstm = nn.LSTM(rnn.input_size, rnn.hidden_size, 1, batch_first=True)
        lstm.load_state_dict({n: t for n, t in rnn.state_dict().items()})
        model.encoder.rnns[k] = FastaiWeightDropLSTM(lstm, weight_p)
    dec = model.decoder                   # a plain nn.Linear, the same (tied) parameters
    plain = nn.Linear(dec.in_features, dec.out_features, bias=dec.bias is not None)
    plain.weight, plain.bias = dec.weight, dec.bias
    model.decoder = plain
    return model


def fastai_name(name: str) -> str:
    """Our AWD-LSTM parameter name -> the :func:`to_fastai` model's."""
    parts = name.split(".")
    if len(parts) == 4 and parts[:2] == ["encoder", "rnns"]:
        if parts[3].startswith("weight_hh"):
            return ".".join(parts[:3] + [parts[3] + "_raw"])
        return ".".join(parts[:3] + ["module", parts[3]])
    return name


# --------------------------------------------------------------------------- helpers

def _hf_error() -> Optional[str]:
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return f"transformers is not installed ({e}): no Hugging Face SDPA baseline"
    return None


def _skip_reason(case: Case, backend: str, device: torch.device) -> Optional[str]:
    if backend == HF_SDPA:
        if device.type != "cuda":
            return "the Hugging Face SDPA baseline is timed on CUDA only"
        return _hf_error()
    return None


def _autocast(device: torch.device, amp: Optional[torch.dtype]):
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp)


def _reset(model: nn.Module) -> None:
    """Forget state carried between batches (AWD-LSTM's hidden state)."""
    if hasattr(model, "reset"):
        model.reset()


@torch.no_grad()
def lecun_init_(model: nn.Module) -> nn.Module:
    """Redraw every parameter with two or more dimensions from ``N(0, 1 / fan_in)``
    (``fan_in = p[0].numel()``: a Linear's inputs, a Conv1d's inputs x width, an XLNet
    ``[d, H, D]`` projection's d); LayerNorm weights and biases stay as built. At GPT-2's
    ``N(0, 0.02)`` initialisation attention is almost uniform, so a wrong mask or position
    term would barely change any output; with unit-variance scores the check sees it. The
    timings do not depend on the values."""
    for p in model.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, p[0].numel() ** -0.5)
    return model


def _models(case: Case, backend: str, device: torch.device) -> Tuple[nn.Module, nn.Module]:
    """(the model timed for `backend`, the eager fp32 reference with the same weights)."""
    wl = WORKLOADS[case.model]
    dtype, _ = PRECISIONS[case.precision]
    torch.manual_seed(0)
    with torch.device(device):      # built and initialised where they run: no CPU init + copy
        return _build_pair(case, backend, device, wl, dtype)


def _build_pair(case: Case, backend: str, device: torch.device, wl: "Workload",
                dtype: torch.dtype) -> Tuple[nn.Module, nn.Module]:
    if backend == HF_SDPA:
        hf = lecun_init_(wl.hf_build(case))
        if getattr(hf.config, "_attn_implementation", None) != "sdpa":
            raise RuntimeError(f"transformers built {type(hf).__name__} with attention "
                               f"{getattr(hf.config, '_attn_implementation', None)!r}, "
                               "not 'sdpa'")
        ref = M.from_hf(hf, backend="eager")
        model = hf
    else:
        ref = lecun_init_(wl.build(case, "eager"))
        model = wl.build(case, "eager" if backend == FASTAI else backend)
        model.load_state_dict(ref.state_dict())
        if backend == FASTAI:
            model = to_fastai(model, case.config.get("weight_p", M.AWDLSTMConfig.weight_p))
    return model.to(device=device, dtype=dtype), ref.to(device)


@contextlib.contextmanager
def _record_op_backends(seen: Dict[str, List[str]]):
    """Collect {op: [backends]} that ctxfast's dispatch resolves inside the block."""
    real = _dispatch.resolve

    def resolve(op, device, backend=None):
        name = real(op, device, backend)
        if name not in seen.setdefault(op, []):
            seen[op].append(name)
        return name

    _dispatch.resolve = resolve
    try:
        yield
    finally:
        _dispatch.resolve = real


class FlopCount(TorchDispatchMode):
    """FLOPs of the aten ops run inside the block (``.total``), with the formulas of
    ``torch.utils.flop_counter`` (matmuls, convolutions, attention). ``FlopCounterMode``
    itself is not used: its module tracker fails on XLNet under ``torch.no_grad()``
    (torch 2.13: "Expected gradient function to be set")."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = flop_registry.get(func._overloadpacket)
        if formula is None and hasattr(func, "decompose"):  # count the parts, as FlopCounterMode
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


def _evaluate(run: Callable, view: Callable, model: nn.Module, batch: tuple, train: bool,
              device: torch.device, amp: Optional[torch.dtype]):
    """(loss, compared output, {name: grad} or None) of one call in eval() mode."""
    model.eval()
    _reset(model)
    model.zero_grad(set_to_none=True)
    with (contextlib.nullcontext() if train else torch.no_grad()), _autocast(device, amp):
        loss, out = run(model, batch)
    grads = None
    if train:
        loss.backward()
        grads = {n: p.grad.detach() for n, p in model.named_parameters()
                 if p.grad is not None}
    res = loss.detach().float(), view(out.detach(), batch).float(), grads
    model.zero_grad(set_to_none=True)
    _reset(model)
    return res


def _rel_err(x: Tensor, y: Tensor) -> float:
    x, y = x.double(), y.double()
    den = y.norm().item()
    return (x - y).norm().item() / (den if den > 0 else 1.0)


def _grad_err(got: Dict[str, Tensor], want: Dict[str, Tensor],
              pairs: List[Tuple[str, str]]) -> float:
    """Relative error of the gradients of `pairs` (want's name, got's name) taken together;
    a gradient present on one side only is an error (inf)."""
    num = den = 0.0
    for w_name, g_name in pairs:
        w, g = want.get(w_name), got.get(g_name)
        if w is None and g is None:
            continue
        if w is None or g is None:
            return float("inf")
        num += (g.double() - w.double()).norm().item() ** 2
        den += w.double().norm().item() ** 2
    return (num ** 0.5) / (den ** 0.5 if den > 0 else 1.0)


def _errors(res, ref, pairs) -> Dict[str, float]:
    loss, out, grads = res
    errs = {"out": _rel_err(out, ref[1]), "loss": _rel_err(loss, ref[0])}
    if grads is not None:
        errs["grad"] = _grad_err(grads, ref[2], pairs)
    return errs


#: FLOPs of (case, mode, device): the same count for every backend, so the eager fp32
#: reference runs under the counting mode once per case and mode, not once per backend
#: (and not at all for the fp32 eager baseline once counted: its check is the reference).
_FLOPS: Dict[tuple, int] = {}


def _check(case: Case, mode: str, backend: str, model: nn.Module, ref: nn.Module,
           batch: tuple, device: torch.device) -> dict:
    """Compare `model` with the eager fp32 `ref` on `batch` (module docstring); returns
    what goes into ``extra_info``: flops, op_backends, the errors and their bounds."""
    wl = WORKLOADS[case.model]
    train = mode == "train-step"
    dtype, amp = PRECISIONS[case.precision]
    low = case.precision != "fp32"
    key = (case, mode, str(device))
    if backend == BASELINE and not low and key in _FLOPS:
        return {"flops": _FLOPS[key]}                # nothing to compare: no reference run
    ref_ops: Dict[str, List[str]] = {}
    if key in _FLOPS:                                # counted once per case and mode
        with _record_op_backends(ref_ops):
            want = _evaluate(wl.run, wl.view, ref, batch, train, device, None)
    else:
        with FlopCount() as counter, _record_op_backends(ref_ops):
            want = _evaluate(wl.run, wl.view, ref, batch, train, device, None)
        _FLOPS[key] = counter.total
    info = {"flops": _FLOPS[key], "op_backends": ref_ops}
    assert torch.isfinite(want[0]) and torch.isfinite(want[1]).all(), \
        f"{case.name} {mode}: the eager fp32 model gives a non-finite loss or output"
    if backend == BASELINE and not low:
        return info                                  # the timed model is the reference

    if backend == HF_SDPA:
        run, pairs = wl.hf_run, list(wl.hf_grads)     # (our name, theirs)
    elif backend == FASTAI:
        run, pairs = wl.run, ([(n, fastai_name(n)) for n in want[2]] if train else [])
    else:
        run, pairs = wl.run, ([(n, n) for n in want[2]] if train else [])
    seen: Dict[str, List[str]] = {}
    with _record_op_backends(seen):
        got = _evaluate(run, wl.view, model, batch, train, device, amp)
    info["op_backends"] = ({"attention": ["torch sdpa (transformers)"]}
                           if backend == HF_SDPA else seen)
    errs = _errors(got, want, pairs)
    if low:
        # The eager model in the same precision: its own distance from fp32 sets the bound.
        if backend == BASELINE:
            eager_errs = errs
        else:
            same = ref if dtype == torch.float32 else copy.deepcopy(ref).to(dtype)
            eager_errs = _errors(_evaluate(wl.run, wl.view, same, batch, train, device, amp),
                                 want, [(w, w) for w, _ in pairs])
            del same
        bounds = {k: 2 * eager_errs[k] + 2e-2 for k in errs}
        info["check_eager_err"] = eager_errs
    else:
        tol = 1e-4 if device.type == "cpu" else 1e-2
        bounds = {k: tol for k in errs}
    info["check_err"], info["check_bound"] = errs, bounds
    for k, err in errs.items():
        finite = err == err and err != float("inf")
        assert finite and (backend == BASELINE or err <= bounds[k]), (
            f"{backend} {case.name} {mode}: relative error of the {k} {err:.3g} > "
            f"{bounds[k]:.3g} against the eager fp32 model")
    return info


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- benchmark

@pytest.mark.parametrize("case, mode, backend", _params())
def test_models(benchmark, bench_device, case: Case, mode: str, backend: str):
    reason = _skip_reason(case, backend, bench_device)
    if reason is not None:
        pytest.skip(reason)
    _free(bench_device)
    wl = WORKLOADS[case.model]
    dtype, amp = PRECISIONS[case.precision]
    tokens = case.B * case.T
    _common.describe(benchmark, op=OP, case=case.name, mode=mode, backend=backend,
                     dtype=amp or dtype, device=bench_device, baseline=report_baseline(case),
                     T=case.T,
                     series=case.model, model=case.model, precision=case.precision,
                     batch=case.B, mem=case.mem, predictions=case.P,
                     tokens=tokens, config={k: repr(v) for k, v in case.cfg})
    with _common.oom_guard(benchmark, bench_device):
        model, ref = _models(case, backend, bench_device)
        torch.manual_seed(1)
        sets = _common.input_sets(lambda: wl.batch(case, bench_device, dtype), bench_device)
        benchmark.extra_info.update(_check(case, mode, backend, model, ref, sets[0],
                                           bench_device))
        benchmark.extra_info["params"] = sum(p.numel() for p in model.parameters())
        del ref
        _free(bench_device)
        run = wl.hf_run if backend == HF_SDPA else wl.run

        if mode == "train-step":
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def fn(*batch):
                opt.zero_grad(set_to_none=True)
                with _autocast(bench_device, amp):
                    loss, _ = run(model, batch)
                loss.backward()
                opt.step()
                return loss.detach()
        else:
            model.eval()

            def fn(*batch):
                with torch.no_grad(), _autocast(bench_device, amp):
                    return run(model, batch)[0]

        quick = _common.quick()
        _common.measure(benchmark, fn, sets, bench_device, budget_s=0.3 if quick else 2.0,
                        min_rounds=5 if quick else 10, warmup=3 if quick else 5)
