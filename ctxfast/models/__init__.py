"""Reference model definitions, each taking ``backend="ctxfast" | "eager"``:

* :mod:`gpt` — GPT-1/GPT-2 with a key/value cache; :mod:`bert` — BERT (padded or varlen);
* :mod:`xlnet` — two-stream XLNet (perm ranks, target mapping, segments, memory);
* :mod:`transformer_xl` — the original MemTransformerLM (memory, adaptive softmax);
* :mod:`awd_lstm` — ULMFiT's AWD-LSTM encoder, LM and classifier;
* :mod:`elmo` — char CNN + highway, projected biLSTM, biLM losses, scalar mix;
* :func:`from_hf` — the same weights from a Hugging Face BERT, GPT-2 or XLNet model.
"""
from .gpt import GPT, GPTConfig
from .bert import Bert, BertConfig, BertOutput
from .hf import from_hf
from .xlnet import XLNetConfig, XLNetLMHeadModel, XLNetModel, from_hf_xlnet
from .transformer_xl import TransformerXL, TransformerXLConfig
from .awd_lstm import AWDLSTM, AWDLSTMClassifier, AWDLSTMConfig, AWDLSTMLM
from .elmo import Elmo, ElmoBiLM, ElmoConfig, ScalarMix, batch_to_ids

__all__ = ["GPT", "GPTConfig", "Bert", "BertConfig", "BertOutput", "from_hf",
           "XLNetConfig", "XLNetModel", "XLNetLMHeadModel", "from_hf_xlnet",
           "TransformerXL", "TransformerXLConfig",
           "AWDLSTM", "AWDLSTMClassifier", "AWDLSTMConfig", "AWDLSTMLM",
           "Elmo", "ElmoBiLM", "ElmoConfig", "ScalarMix", "batch_to_ids"]
