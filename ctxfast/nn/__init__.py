"""Drop-in nn.Modules built on ctxfast ops.

* :class:`MultiheadAttention` — ``torch.nn.MultiheadAttention`` on ``ctxfast.attention``.

* :class:`RelPartialLearnableMultiHeadAttn` — the Transformer-XL layer on ``ctxfast.rel_attention``.

* :class:`WeightDropLSTM` — ``torch.nn.LSTM`` on ``ctxfast.lstm``, with DropConnect on ``W_hh``
  (AWD-LSTM) and ELMo's projection clips; :func:`load_awd_lstm` reads fastai/Salesforce
  AWD-LSTM checkpoints.

* :class:`Linear` — ``torch.nn.Linear`` on ``ctxfast.linear`` (float32 at float32's accuracy on
  the tensor cores).

* :class:`LockedDropout`, :class:`EmbeddingDropout` — AWD-LSTM's variational and embedding dropout.
"""
from .attention import MultiheadAttention
from .linear import Linear
from .lstm import EmbeddingDropout, LockedDropout, WeightDropLSTM, load_awd_lstm
from .rel_attention import RelPartialLearnableMultiHeadAttn

__all__ = ["MultiheadAttention", "RelPartialLearnableMultiHeadAttn", "WeightDropLSTM",
           "LockedDropout", "EmbeddingDropout", "load_awd_lstm", "Linear"]
