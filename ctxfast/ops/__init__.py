"""The public ops of ctxfast: torch.library custom ops with autograd, input checks and
backend dispatch, one module per op family."""
from .attention import attention, attention_varlen
from .dropout import embedding_dropout, locked_dropout
from .linear import linear
from .lstm import lstm
from .rel_attention import rel_attention
from .rel_shift import rel_shift

__all__ = ["attention", "attention_varlen", "rel_attention", "rel_shift", "lstm", "linear",
           "locked_dropout", "embedding_dropout"]
