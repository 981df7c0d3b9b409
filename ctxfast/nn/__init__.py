"""Drop-in nn.Modules built on ctxfast ops.

* :class:`MultiheadAttention` — ``torch.nn.MultiheadAttention`` on ``ctxfast.attention``.

Still to come: relative attention (issue 4) and the weight-dropped LSTM (issue 5).
"""
from .attention import MultiheadAttention

__all__ = ["MultiheadAttention"]
