"""``ctxfast.nn.Linear``: ``torch.nn.Linear`` on ``ctxfast.linear`` (float32 on the tensor
cores at float32's accuracy with the ``triton`` backend). Same constructor arguments and
parameter names, so an existing ``state_dict`` loads as it is."""
from typing import Optional

from torch import Tensor, nn

from .. import ops


class Linear(nn.Linear):
    """``torch.nn.Linear`` on ``ctxfast.linear``: input ``[..., in_features]`` -> output
    ``[..., out_features]``. Extra keyword: ``backend`` (``"triton" | "cuda" | "cpu" |
    "eager" | None``), passed to ``ctxfast.linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, backend: Optional[str] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.backend = backend

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias, backend=self.backend)
