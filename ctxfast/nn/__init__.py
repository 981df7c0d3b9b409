"""Drop-in nn.Modules built on ctxfast ops.

* :class:`MultiheadAttention` — ``torch.nn.MultiheadAttention`` on ``ctxfast.attention``.

* :class:`RelPartialLearnableMultiHeadAttn` — the Transformer-XL layer on ``ctxfast.rel_attention``.

Still to come: the weight-dropped LSTM (issue 5).
"""
from .attention import MultiheadAttention
from .rel_attention import RelPartialLearnableMultiHeadAttn

__all__ = ["MultiheadAttention", "RelPartialLearnableMultiHeadAttn"]
