"""Reference ``linear``: ``y = x @ weightᵀ + bias``, the specification of ``ctxfast.linear``."""
from typing import Optional

import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x [..., I] @ weight [N, I]ᵀ + bias [N]`` -> ``[..., N]``: ``F.linear`` (cuBLAS or
    MKL, in x's dtype, following torch's TF32 setting for float32)."""
    return F.linear(x, weight, bias)
