"""The public ops of ctxfast: torch.library custom ops with autograd, input checks and
backend dispatch, one module per op family."""
from .attention import attention
from .rel_shift import rel_shift

__all__ = ["attention", "rel_shift"]
