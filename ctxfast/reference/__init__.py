"""Eager PyTorch implementations of every ctxfast op: the specification that every
kernel is tested against. Written for clarity, not speed; imports nothing of ctxfast."""
from .attention import attention, attention_mask, masked_softmax
from .dropout import embedding_dropout, locked_dropout
from .rel_attention import distance_rows, rel_attention, rel_attention_original, rel_scores
from .linear import linear
from .lstm import lstm, lstm_recurrence
from .rel_shift import rel_shift, rel_shift_pad_view, rel_unshift

__all__ = ["rel_attention", "rel_attention_original", "rel_scores", "masked_softmax",
           "distance_rows", "attention", "attention_mask", "rel_shift", "rel_unshift", "rel_shift_pad_view", "lstm", "lstm_recurrence", "linear",
           "locked_dropout", "embedding_dropout"]
