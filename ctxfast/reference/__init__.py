"""Eager PyTorch implementations of every ctxfast op: the specification that every
kernel is tested against. Written for clarity, not speed; imports nothing of ctxfast."""
from .attention import attention, attention_mask
from .rel_shift import rel_shift, rel_shift_pad_view, rel_unshift

__all__ = ["attention", "attention_mask", "rel_shift", "rel_unshift", "rel_shift_pad_view"]
