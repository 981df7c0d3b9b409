"""AWD-LSTM's two structured dropouts, eager PyTorch (the specification of
``ctxfast.locked_dropout`` and ``ctxfast.embedding_dropout``).

Both take the keep-mask (0/1) as an input, so they are deterministic; ``scale`` is
``1 / (1 - p)`` (0 when ``p = 1``).

* Locked (variational) dropout: one mask per sequence, the same at every time step::

      out[t, b, ...] = x[t, b, ...] * mask[b, ...] * scale        (time-major)

* Embedding dropout: whole rows (words) of the embedding matrix are dropped, so every
  occurrence of a dropped word in the batch is zero::

      W'       = weight * mask[:, None] * scale * extra_scale
      out[...] = W'[input_ids[...]]

  (``padding_idx``: that row receives no gradient, as in ``F.embedding``.)

Written for clarity (a loop over time; the whole dropped matrix), not speed.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def locked_dropout(x: Tensor, mask: Tensor, scale: float, batch_first: bool = False) -> Tensor:
    """x ``[T, B, *F]`` (``[B, T, *F]`` if batch_first), mask ``[B, *F]`` -> x's shape.

    Step by step over time: ``out[t] = x[t] * mask * scale``.
    """
    xt = x.transpose(0, 1) if batch_first else x            # [T, B, *F]
    steps = [xt[t] * (mask.to(x.dtype) * scale) for t in range(xt.shape[0])]
    out = torch.stack(steps, 0) if steps else xt * 0         # [T, B, *F]
    return out.transpose(0, 1) if batch_first else out


def embedding_dropout(weight: Tensor, input_ids: Tensor, mask: Optional[Tensor], scale: float,
                      extra_scale: Optional[float] = None,
                      padding_idx: Optional[int] = None) -> Tensor:
    """weight ``[V, E]``, input_ids any shape ``[*S]`` (int64), mask ``[V]`` or None ->
    ``[*S, E]``: the lookup in the row-dropped, rescaled matrix (fastai's formulation)."""
    w = weight if mask is None else weight * (mask.to(weight.dtype) * scale)[:, None]  # [V, E]
    if extra_scale is not None:
        w = w * extra_scale
    return F.embedding(input_ids, w, padding_idx)
