"""AWD-LSTM and ELMo building blocks on ctxfast ops.

* :class:`WeightDropLSTM` — a drop-in for ``torch.nn.LSTM`` (same constructor, parameter
  names, shapes, initialisation and forward), plus DropConnect on the hidden-to-hidden
  weights (AWD-LSTM's weight drop, one mask per forward shared by every time step) and
  ELMo's clipped cell and clipped projection. Every layer and direction is one call of
  ``ctxfast.lstm`` (the mask goes into the op; no dropped copy of a weight is written).
* :class:`LockedDropout`, :class:`EmbeddingDropout` — AWD-LSTM's variational dropout and
  word-level embedding dropout, on ``ctxfast.locked_dropout`` / ``ctxfast.embedding_dropout``.
* :func:`load_awd_lstm` — builds one :class:`WeightDropLSTM` per layer from a fastai or
  Salesforce AWD-LSTM checkpoint.

``WeightDropLSTM`` is deliberately not a subclass of ``nn.LSTM``: TorchDynamo refuses
every instance of ``nn.RNN``/``nn.GRU``/``nn.LSTM``, subclasses included (unless
``torch._dynamo.config.allow_rnn``), while this module compiles with
``torch.compile(fullgraph=True)`` (checked by hand with the eager backend, torch 2.13;
a ``PackedSequence`` input breaks the graph: its lengths are read on the host). It is not
TorchScript-able (``torch.jit.script``), as nn.LSTM is. The parameter layout is
``nn.LSTM``'s (``all_weights``, ``_flat_weights`` read as nn.LSTM's), so ``state_dict``s
move both ways.
"""
from __future__ import annotations

import contextlib
import math
import re
import warnings
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..ops._common import FLOAT_DTYPES as _FLOAT_DTYPES
from ..ops.dropout import check_ids_in_vocab
from ..ops.dropout import keep_mask as _keep_mask

_SUFFIXES = ("", "_reverse")


def _autocast_on(x: Tensor) -> bool:
    """Whether autocast is on for x's device type (cuda or cpu)."""
    dev = x.device.type
    return torch.is_autocast_enabled(dev) if dev in ("cuda", "cpu") else False


class WeightDropLSTM(nn.Module):
    r"""Multi-layer LSTM with DropConnect on ``W_hh`` and ELMo's projection clips.

    Args (``torch.nn.LSTM``'s, in its order):
        input_size: I, features of the input.
        hidden_size: H, cell size.
        num_layers: stacked layers (layer k > 0 reads the outputs of layer k-1).
        bias: with ``bias_ih_l{k}`` and ``bias_hh_l{k}``.
        batch_first: input and output are ``[B, T, *]`` instead of ``[T, B, *]`` (the
            states ``h_n``, ``c_n`` are not affected, as in ``nn.LSTM``).
        dropout: ordinary dropout on the outputs of every layer but the last, in training
            (what ``nn.LSTM`` does; use :class:`LockedDropout` between single-layer
            modules for AWD-LSTM's variational version).
        bidirectional: a second direction per layer running ``t = T-1 .. 0``; outputs of
            both directions are concatenated, forward first.
        proj_size: P > 0 adds ``weight_hr_l{k}`` ``[P, H]`` and ``h_t = W_hr (o * tanh c_t)``
            (P = H when 0).

    Keyword-only extras:
        weight_dropout: p of DropConnect on every ``weight_hh_l{k}{_reverse}``, in [0, 1).
        weight_dropout_names: the ``weight_hh_*`` names DropConnect applies to (a subset of
            :meth:`weight_hh_names`), or None for all of them. fastai's ``WeightDropout``
            drops ``weight_hh_l0`` alone, also in a bidirectional layer (the reverse
            weight runs as it is, unscaled): ``("weight_hh_l0",)`` gives that.
        cell_clip: clip ``c_t`` to ``[-cell_clip, cell_clip]`` (AllenNLP's
            ``memory_cell_clip_value``); None: no clip.
        proj_clip: clip the projected ``h_t`` (AllenNLP's ``state_projection_clip_value``);
            needs ``proj_size > 0``; None: no clip.
        backend: passed to ``ctxfast.lstm`` (``"triton" | "cuda" | "cpu" | "eager"`` or
            None for the default, see ``ctxfast.backend``).
        device, dtype: of the parameters, as in ``nn.LSTM``.

    Parameters: exactly ``nn.LSTM``'s names and shapes, registered in its order
    (``weight_ih_l{k}{sfx}`` ``[4H, I_k]``, ``weight_hh_l{k}{sfx}`` ``[4H, P]``,
    ``bias_ih_l{k}{sfx}``, ``bias_hh_l{k}{sfx}`` ``[4H]``, ``weight_hr_l{k}{sfx}`` ``[P, H]``
    with ``I_0 = I``, ``I_k = P * num_directions``, ``sfx`` in ``("", "_reverse")``), and
    its initialisation ``U(-1/sqrt(H), 1/sqrt(H))`` — under the same seed the two modules
    start from the same values, and ``load_state_dict(nn_lstm.state_dict())`` works.
    Gate order i, f, g, o.

    DropConnect: in training with ``weight_dropout > 0``, ``forward`` samples one keep-mask
    per layer and direction of ``weight_dropout_names`` (keep probability ``1 - p``;
    ``ctxfast.ops.dropout.keep_mask``: Philox keyed by a seed from torch's RNG on CPU, ``torch.bernoulli`` on CUDA; shape of
    ``weight_hh_l{k}{sfx}``, in :meth:`weight_hh_names` order, before anything else
    random in the forward) and the recurrence uses ``W_hh * mask / (1 - p)`` at every
    time step. ``forward(..., weight_masks=...)`` gives the masks instead (see
    :meth:`forward`). In eval mode no mask is used. The module never writes to its
    parameters.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, *,
                 weight_dropout: float = 0.0,
                 weight_dropout_names: Optional[Sequence[str]] = None,
                 cell_clip: Optional[float] = None, proj_clip: Optional[float] = None,
                 backend: Optional[str] = None, device=None, dtype=None) -> None:
        super().__init__()
        for name, v, low in (("input_size", input_size, 1), ("hidden_size", hidden_size, 1),
                             ("num_layers", num_layers, 1), ("proj_size", proj_size, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"WeightDropLSTM: {name} must be an int >= {low}, got {v!r}")
        if proj_size >= hidden_size:
            raise ValueError(f"WeightDropLSTM: proj_size must be smaller than hidden_size, got "
                             f"proj_size={proj_size}, hidden_size={hidden_size}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
                or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"WeightDropLSTM: dropout must be a number in [0, 1], got "
                             f"{dropout!r}")
        if isinstance(weight_dropout, bool) or not isinstance(weight_dropout, (int, float)) \
                or not 0.0 <= weight_dropout < 1.0:
            raise ValueError(f"WeightDropLSTM: weight_dropout must be a number in [0, 1), got "
                             f"{weight_dropout!r}")
        for name, v in (("cell_clip", cell_clip), ("proj_clip", proj_clip)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not v > 0):
                raise ValueError(f"WeightDropLSTM: {name} must be None or a number > 0, "
                                 f"got {v!r}")
        if proj_clip is not None and proj_size == 0:
            raise ValueError("WeightDropLSTM: proj_clip clips the projection and needs "
                             "proj_size > 0")
        self.input_size, self.hidden_size = input_size, hidden_size
        self.num_layers, self.bias, self.batch_first = num_layers, bool(bias), bool(batch_first)
        self.dropout, self.bidirectional = float(dropout), bool(bidirectional)
        self.proj_size = proj_size
        self.weight_dropout = float(weight_dropout)
        self.cell_clip = None if cell_clip is None else float(cell_clip)
        self.proj_clip = None if proj_clip is None else float(proj_clip)
        self.backend = backend

        factory = {"device": device, "dtype": dtype}
        D = 2 if bidirectional else 1
        P = proj_size if proj_size > 0 else hidden_size
        G = 4 * hidden_size
        # per layer, per direction: the names of (w_ih, w_hh, b_ih, b_hh, w_hr), None = absent
        self._names: List[List[Tuple[Optional[str], ...]]] = []
        for k in range(num_layers):
            in_k = input_size if k == 0 else P * D
            dirs = []
            for sfx in _SUFFIXES[:D]:
                shapes = [("weight_ih", (G, in_k)), ("weight_hh", (G, P))]
                if self.bias:
                    shapes += [("bias_ih", (G,)), ("bias_hh", (G,))]
                if proj_size > 0:
                    shapes += [("weight_hr", (P, hidden_size))]
                for kind, shape in shapes:
                    self.register_parameter(f"{kind}_l{k}{sfx}",
                                            nn.Parameter(torch.empty(shape, **factory)))
                present = {kind for kind, _ in shapes}
                dirs.append(tuple(f"{kind}_l{k}{sfx}" if kind in present else None
                                  for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh",
                                               "weight_hr")))
            self._names.append(dirs)
        names = self.weight_hh_names()
        if weight_dropout_names is None:
            self.weight_dropout_names = tuple(names)
        else:
            if isinstance(weight_dropout_names, str) or not all(
                    isinstance(n, str) for n in weight_dropout_names):
                raise ValueError("WeightDropLSTM: weight_dropout_names must be a sequence of "
                                 f"names among {names}, got {weight_dropout_names!r}")
            unknown = [n for n in weight_dropout_names if n not in names]
            if unknown:
                raise ValueError(f"WeightDropLSTM: weight_dropout_names must be among {names}, "
                                 f"got unknown {unknown}")
            self.weight_dropout_names = tuple(n for n in names if n in weight_dropout_names)
        if dropout > 0 and num_layers == 1:
            warnings.warn("WeightDropLSTM: dropout acts between layers; with num_layers=1 it "
                          "does nothing (as in nn.LSTM)", stacklevel=2)
        self.reset_parameters()

    # ------------------------------------------------------------------ parameters

    def reset_parameters(self) -> None:
        """``nn.LSTM``'s initialisation: every parameter ``U(-1/sqrt(H), 1/sqrt(H))``."""
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0.0
        for w in self.parameters():
            nn.init.uniform_(w, -stdv, stdv)

    def flatten_parameters(self) -> None:
        """No-op, for code written for ``nn.LSTM`` (there is no cuDNN weight buffer)."""

    # nn.LSTM's views of its parameters, for code that reads them (read-only here)
    @property
    def _all_weights(self) -> List[List[str]]:
        """Per layer and direction, the parameter names in nn.LSTM's order."""
        return [[n for n in d if n is not None] for layer in self._names for d in layer]

    @property
    def all_weights(self) -> List[List[nn.Parameter]]:
        return [[getattr(self, n) for n in names] for names in self._all_weights]

    @property
    def _flat_weights_names(self) -> List[str]:
        return [n for names in self._all_weights for n in names]

    @property
    def _flat_weights(self) -> List[nn.Parameter]:
        return [getattr(self, n) for n in self._flat_weights_names]

    def weight_hh_names(self) -> List[str]:
        """``["weight_hh_l0", ("weight_hh_l0_reverse",) "weight_hh_l1", ...]``: every
        recurrent weight, in layer-then-direction order (the order masks are sampled); the
        keys of ``weight_masks`` are those of them in ``weight_dropout_names``."""
        return [d[1] for layer in self._names for d in layer]

    @torch.no_grad()
    def sample_weight_masks(self, generator: Optional[torch.Generator] = None
                            ) -> Dict[str, Tensor]:
        """One DropConnect keep-mask per layer and direction, as ``forward`` samples them.

        Returns ``{name: mask}`` for every name of ``weight_dropout_names`` (by default
        every name of :meth:`weight_hh_names`; in that order),
        each of the weight's shape ``[4H, P]``, dtype and device, with 0/1 values (keep
        probability ``1 - weight_dropout``). Reusable as ``forward(..., weight_masks=)``.
        """
        masks = {}
        for name in self.weight_dropout_names:
            masks[name] = _keep_mask(getattr(self, name), self.weight_dropout, generator)
        return masks

    # ------------------------------------------------------------------ forward

    def _check_masks(self, weight_masks: object) -> Dict[str, Tensor]:
        names = list(self.weight_dropout_names)
        if not isinstance(weight_masks, Mapping):
            raise TypeError(f"WeightDropLSTM: weight_masks must be a dict {{name: mask}} with "
                            f"the keys {names}, got {type(weight_masks).__name__}")
        missing = [n for n in names if n not in weight_masks]
        unknown = [n for n in weight_masks if n not in names]
        if missing or unknown:
            raise ValueError(f"WeightDropLSTM: weight_masks must have exactly the keys {names}; "
                             f"missing {missing}, unknown {unknown}")
        out = {}
        for n in names:
            m, w = weight_masks[n], getattr(self, n)
            if not isinstance(m, Tensor):
                raise TypeError(f"WeightDropLSTM: weight_masks[{n!r}] must be a tensor, got "
                                f"{type(m).__name__}")
            if tuple(m.shape) != tuple(w.shape):
                raise ValueError(f"WeightDropLSTM: weight_masks[{n!r}] must have the shape of "
                                 f"{n}, {list(w.shape)} ([4*hidden_size, proj_size or "
                                 f"hidden_size]), got {list(m.shape)}")
            if not (m.dtype == torch.bool or m.is_floating_point()):
                raise TypeError(f"WeightDropLSTM: weight_masks[{n!r}] must be bool or floating "
                                f"point with 0/1 values, got {m.dtype}")
            if m.device != w.device:
                raise ValueError(f"WeightDropLSTM: weight_masks[{n!r}] is on {m.device}, the "
                                 f"weights on {w.device}")
            out[n] = m.detach()
        return out

    def _check_input(self, input: object, hx: object, time_major: bool = False):
        """-> (x [T, B, I], (h0 [L*D, B, P], c0 [L*D, B, H]) or None, unbatched);
        ``time_major``: input is ``[T, B, I]`` whatever batch_first (a PackedSequence's)."""
        if not isinstance(input, Tensor):
            raise TypeError(f"WeightDropLSTM: input must be a torch.Tensor, got "
                            f"{type(input).__name__}")
        w0 = self.weight_ih_l0
        if input.dim() not in (2, 3):
            raise ValueError(f"WeightDropLSTM: input must be 3-D {self._layout('input_size')} or "
                             f"unbatched 2-D [T, input_size], got shape {list(input.shape)}")
        if input.shape[-1] != self.input_size:
            raise ValueError(f"WeightDropLSTM: input must have size(-1) == input_size = "
                             f"{self.input_size}, got shape {list(input.shape)}")
        if input.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"WeightDropLSTM: input must be floating point, got {input.dtype}")
        if input.device != w0.device:
            raise ValueError(f"WeightDropLSTM: input is on {input.device}, the parameters on "
                             f"{w0.device}")
        unbatched = input.dim() == 2
        x = input.unsqueeze(1) if unbatched else (
            input.transpose(0, 1) if self.batch_first and not time_major else input)  # [T, B, I]
        T, B = x.shape[0], x.shape[1]
        if T == 0:
            raise ValueError(f"WeightDropLSTM: input must have at least one time step, got "
                             f"shape {list(input.shape)}")
        if hx is None:
            return x, None, unbatched
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError("WeightDropLSTM: hx must be None or a tuple (h_0, c_0)")
        LD = self.num_layers * (2 if self.bidirectional else 1)
        P = self.proj_size if self.proj_size > 0 else self.hidden_size
        states = []
        for i, (name, size) in enumerate((("h_0", P), ("c_0", self.hidden_size))):
            s = hx[i]
            want = [LD, size] if unbatched else [LD, B, size]
            if not isinstance(s, Tensor):
                raise TypeError(f"WeightDropLSTM: hx[{i}] ({name}) must be a tensor, got "
                                f"{type(s).__name__}")
            if list(s.shape) != want:
                dims = ("[num_layers*num_directions, " + ("" if unbatched else "batch, ")
                        + ("proj_size or hidden_size]" if i == 0 else "hidden_size]"))
                raise ValueError(f"WeightDropLSTM: hx[{i}] ({name}) must have shape {want} "
                                 f"{dims}, got {list(s.shape)}")
            # under autocast any float dtype (both are cast to the autocast dtype), as
            # nn.LSTM takes them
            if (s.device != input.device or s.dtype not in _FLOAT_DTYPES
                    or (s.dtype != input.dtype and not self._amp(input))):
                raise TypeError(f"WeightDropLSTM: hx[{i}] ({name}) must match the input's "
                                f"dtype and device ({input.dtype}, {input.device}), got "
                                f"({s.dtype}, {s.device})")
            states.append(s.unsqueeze(1) if unbatched else s)           # [L*D, B, *]
        return x, tuple(states), unbatched

    def _amp(self, x: Tensor) -> bool:
        """Whether the call runs in the autocast dtype: autocast is on for x's device and
        the module is not float64 (autocast leaves float64 alone, as for nn.LSTM)."""
        return _autocast_on(x) and self.weight_ih_l0.dtype != torch.float64

    def _layout(self, last: str) -> str:
        return f"[batch, T, {last}]" if self.batch_first else f"[T, batch, {last}]"

    def forward(self, input: Tensor, hx: Optional[Tuple[Tensor, Tensor]] = None,
                weight_masks: Optional[Mapping[str, Tensor]] = None
                ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """``nn.LSTM``'s forward, with optional DropConnect masks.

        Args:
            input: ``[T, B, I]`` (``[B, T, I]`` with batch_first) or unbatched ``[T, I]``,
                in the parameters' dtype (or any float dtype under autocast) and device;
                or a ``PackedSequence`` (``nn.utils.rnn.pack_padded_sequence``; batch_first
                does not apply): each sequence runs over its own steps, as in ``nn.LSTM``
                (the kernels over the padded batch, see :func:`ctxfast.lstm`'s lengths).
            hx: None (zeros) or ``(h_0 [L*D, B, P], c_0 [L*D, B, H])`` (unbatched:
                ``[L*D, P]``, ``[L*D, H]``), row ``k*D + d`` for layer k, direction d.
            weight_masks: in training, the DropConnect keep-masks to use instead of sampled
                ones: a dict ``{name: mask}`` with exactly the keys of
                ``weight_dropout_names`` (by default those of :meth:`weight_hh_names`), each
                of that weight's shape ``[4H, P]``, 0/1
                values (bool or float); the recurrence uses
                ``W_hh * mask / (1 - weight_dropout)`` (so with ``weight_dropout = 0`` the
                mask alone). Ignored in eval mode, like every dropout.

        Returns:
            ``(output, (h_n, c_n))``: output ``[T, B, D*P]`` (``[B, T, D*P]`` with
            batch_first, ``[T, D*P]`` unbatched; a PackedSequence with the input's batch
            sizes and indices for one), h_n ``[L*D, B, P]``, c_n ``[L*D, B, H]`` (unbatched
            ``[L*D, P]``, ``[L*D, H]``; each sequence's last step), in the input's dtype.

        Raises:
            TypeError: a non-tensor input, wrong dtypes.
            ValueError: input not 2-D/3-D, ``input.size(-1) != input_size``, no time
                step, hx or a mask of the wrong shape.
        """
        packed, lengths = None, None
        if isinstance(input, nn.utils.rnn.PackedSequence):
            packed = input
            # [T, B, I] in the batch's own order (the indices undone), lengths [B] (CPU)
            input, lengths = nn.utils.rnn.pad_packed_sequence(packed)
        x, states, unbatched = self._check_input(input, hx, time_major=packed is not None)
        masks: Dict[str, Optional[Tensor]] = {n: None for n in self.weight_hh_names()}
        if self.training:
            if weight_masks is not None:
                masks.update(self._check_masks(weight_masks))
            elif self.weight_dropout > 0:
                masks.update(self.sample_weight_masks())
        elif weight_masks is not None:
            self._check_masks(weight_masks)           # bad masks fail in eval mode too

        dev = x.device.type
        amp = self._amp(x)
        dtype = torch.get_autocast_dtype(dev) if amp else self.weight_ih_l0.dtype
        if x.dtype != dtype and (not amp or x.dtype == torch.float64):
            raise TypeError(f"WeightDropLSTM: input dtype {x.dtype} does not match the "
                            f"parameters' dtype {self.weight_ih_l0.dtype}; convert the input "
                            "or the module")
        with torch.autocast(dev, enabled=False) if amp else contextlib.nullcontext():
            out, h_n, c_n = self._run(x.to(dtype), None if states is None else
                                      tuple(s.to(dtype) for s in states), masks, dtype,
                                      lengths)
        if packed is not None:
            return _repack(out, packed), (h_n, c_n)
        if unbatched:
            return out.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))     # [T, D*P], [L*D, *]
        if self.batch_first:
            out = out.transpose(0, 1)                                   # [B, T, D*P]
        return out, (h_n, c_n)

    def _run(self, x: Tensor, states, masks: Dict[str, Optional[Tensor]], dtype: torch.dtype,
             lengths: Optional[Tensor] = None):
        D = 2 if self.bidirectional else 1
        h_all, c_all = [], []
        layer_in = x                                                    # [T, B, I_k]
        for k, dirs in enumerate(self._names):
            outs = []
            for d, (n_ih, n_hh, n_bih, n_bhh, n_hr) in enumerate(dirs):
                w = [None if n is None else getattr(self, n).to(dtype)
                     for n in (n_ih, n_hh, n_bih, n_bhh, n_hr)]
                mask = masks[n_hh]
                if mask is not None:
                    mask = mask.to(dtype)
                h0 = None if states is None else (states[0][k * D + d], states[1][k * D + d])
                out, (h, c) = ops.lstm(layer_in, h0, *w, weight_mask=mask,
                                       weight_dropout=self.weight_dropout if mask is not None
                                       else 0.0, cell_clip=self.cell_clip,
                                       proj_clip=self.proj_clip, reverse=d == 1,
                                       lengths=lengths, backend=self.backend)  # [T, B, P]
                outs.append(out)
                h_all.append(h)
                c_all.append(c)
            layer_in = outs[0] if D == 1 else torch.cat(outs, -1)       # [T, B, D*P]
            if self.training and self.dropout > 0 and k < self.num_layers - 1:
                layer_in = F.dropout(layer_in, self.dropout, training=True)
        return layer_in, torch.stack(h_all, 0), torch.stack(c_all, 0)  # [L*D, B, P|H]

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size != 0:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout != 0:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        if self.weight_dropout != 0:
            s += f", weight_dropout={self.weight_dropout}"
        if self.weight_dropout_names != tuple(self.weight_hh_names()):
            s += f", weight_dropout_names={self.weight_dropout_names}"
        if self.cell_clip is not None:
            s += f", cell_clip={self.cell_clip}"
        if self.proj_clip is not None:
            s += f", proj_clip={self.proj_clip}"
        if self.backend is not None:
            s += f", backend={self.backend!r}"
        return s


def _repack(out: Tensor, like: nn.utils.rnn.PackedSequence) -> nn.utils.rnn.PackedSequence:
    """out ``[T, B, F]`` (the batch's own order) as a PackedSequence with ``like``'s batch
    sizes and indices (what nn.LSTM returns for a packed input)."""
    if like.sorted_indices is not None:
        out = out.index_select(1, like.sorted_indices)              # [T, B, F], longest first
    sizes = like.batch_sizes                                         # [T] (CPU)
    keep = torch.arange(out.shape[1])[None, :] < sizes[:, None]      # [T, B]: step t of row j
    data = out[keep.to(out.device)]                                  # [sum(sizes), F], t-major
    return nn.utils.rnn.PackedSequence(data, sizes, like.sorted_indices, like.unsorted_indices)


# --------------------------------------------------------------------------- dropouts

class LockedDropout(nn.Module):
    """Variational dropout (AWD-LSTM's ``LockedDropout``, fastai's ``RNNDropout``): one
    keep-mask per sequence, shared by every time step (``ctxfast.locked_dropout``).

    ``forward(x, mask=None)``: x ``[T, B, *F]`` (``[B, T, *F]`` with batch_first), mask
    ``[B, *F]`` or None (sampled); identity in eval mode or with ``p = 0``.
    """

    def __init__(self, p: float = 0.5, batch_first: bool = False) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"LockedDropout: p must be a number in [0, 1], got {p!r}")
        self.p, self.batch_first = float(p), bool(batch_first)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return ops.locked_dropout(x, self.p, batch_first=self.batch_first,
                                  training=self.training, mask=mask)

    def extra_repr(self) -> str:
        return f"p={self.p}" + (", batch_first=True" if self.batch_first else "")


class EmbeddingDropout(nn.Module):
    """AWD-LSTM's embedding dropout around an ``nn.Embedding`` (fastai's layout: the
    embedding is the submodule ``emb``, shared, not copied): in training, whole words
    (rows) are dropped with probability ``embed_p`` and kept ones scaled by
    ``1 / (1 - embed_p)`` (``ctxfast.embedding_dropout``).

    ``forward(words, scale=None, mask=None)``: words any integer shape ``[*S]`` ->
    ``[*S, E]``; ``scale`` multiplies the output; ``mask`` ``[V]`` (0/1) replaces the
    sampled one. Honours the embedding's ``padding_idx``, ``scale_grad_by_freq`` and
    ``sparse``; an embedding with ``max_norm`` is refused (its in-place renormalisation
    has no equivalent on dropped rows).
    """

    def __init__(self, emb: nn.Embedding, embed_p: float) -> None:
        super().__init__()
        if not isinstance(emb, nn.Embedding):
            raise TypeError(f"EmbeddingDropout: emb must be an nn.Embedding, got "
                            f"{type(emb).__name__}")
        if emb.max_norm is not None:
            raise NotImplementedError("EmbeddingDropout: embeddings with max_norm are not "
                                      "supported")
        if isinstance(embed_p, bool) or not isinstance(embed_p, (int, float)) \
                or not 0.0 <= embed_p <= 1.0:
            raise ValueError(f"EmbeddingDropout: embed_p must be a number in [0, 1], got "
                             f"{embed_p!r}")
        self.emb, self.embed_p = emb, float(embed_p)

    def forward(self, words: Tensor, scale: Optional[float] = None,
                mask: Optional[Tensor] = None) -> Tensor:
        e = self.emb
        check_ids_in_vocab("EmbeddingDropout", "words", words, e.weight.shape[0])
        return ops.embedding_dropout(e.weight, words, self.embed_p, scale=scale,
                                     padding_idx=e.padding_idx, training=self.training,
                                     mask=mask, scale_grad_by_freq=e.scale_grad_by_freq,
                                     sparse=e.sparse)

    def extra_repr(self) -> str:
        return f"embed_p={self.embed_p}"


# --------------------------------------------------------------------------- AWD-LSTM checkpoints

_LSTM_KEYS = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")


def _awd_layers(state_dict: Mapping[str, Tensor], prefix: Optional[str]
                ) -> Tuple[str, List[Dict[str, Tensor]], List[str]]:
    """-> (prefix, per layer an nn.LSTM(num_layers=1) state dict, per layer its layout)."""
    pat = re.compile(r"^(.*?)rnns\.(\d+)\.module\.weight_ih_l0$")
    found = {}
    for key in state_dict:
        m = pat.match(key)
        if m:
            found.setdefault(m.group(1), set()).add(int(m.group(2)))
    if prefix is None:
        if len(found) != 1:
            raise ValueError(
                "load_awd_lstm: " + ("no AWD-LSTM layers found: expected keys "
                                     "'<prefix>rnns.<k>.module.weight_ih_l0'" if not found else
                                     f"several AWD-LSTM encoders in the state dict (prefixes "
                                     f"{sorted(found)}); pass prefix="))
        prefix = next(iter(found))
    if prefix not in found:
        raise ValueError(f"load_awd_lstm: no key '{prefix}rnns.<k>.module.weight_ih_l0' in the "
                         f"state dict (prefixes found: {sorted(found)})")
    layers = sorted(found[prefix])
    if layers != list(range(len(layers))):
        raise ValueError(f"load_awd_lstm: layers must be numbered 0..n-1, found {layers}")
    result, layouts = [], []
    for k in layers:
        base = f"{prefix}rnns.{k}."
        sd: Dict[str, Tensor] = {}
        layout = "fastai"
        for sfx in _SUFFIXES:
            for name in (n + sfx for n in _LSTM_KEYS):
                # fastai: the raw (undropped) weight on the WeightDropout wrapper; Salesforce:
                # on the wrapped LSTM; otherwise (not dropped, e.g. fastai's _reverse) the
                # LSTM's own parameter.
                for cand in (base + name + "_raw", base + "module." + name + "_raw",
                             base + "module." + name):
                    if cand in state_dict:
                        sd[name] = state_dict[cand]
                        if cand == base + "module." + name + "_raw":
                            layout = "salesforce"
                        break
        if "weight_hh_l0" not in sd:
            raise ValueError(f"load_awd_lstm: layer {k}: none of '{base}weight_hh_l0_raw', "
                             f"'{base}module.weight_hh_l0_raw', '{base}module.weight_hh_l0'")
        result.append(sd)
        layouts.append(layout)
    return prefix, result, layouts


def load_awd_lstm(state_dict: Mapping[str, Tensor], *, prefix: Optional[str] = None,
                  weight_dropout: float = 0.0, batch_first: Optional[bool] = None,
                  backend: Optional[str] = None) -> nn.ModuleList:
    """The LSTM layers of an AWD-LSTM checkpoint as one single-layer
    :class:`WeightDropLSTM` per layer (AWD-LSTM's layers differ in size: the last one's
    hidden size is the embedding size, so they cannot be one multi-layer module).

    Accepted key layouts, for layers ``k = 0 .. n-1`` under one common ``prefix`` (found
    automatically when the state dict holds one encoder, e.g. ``""``, ``"0."`` for
    fastai's language model, ``"0.module."`` for its classifier, ``"encoder."``):

    * fastai v2 (``fastai.text.models.awdlstm``): ``rnns.k.weight_hh_l0_raw`` (the
      undropped weight, a parameter of the ``WeightDropout`` wrapper) and
      ``rnns.k.module.{weight_ih_l0, bias_ih_l0, bias_hh_l0}``; bidirectional adds
      ``rnns.k.module.{weight_ih,weight_hh,bias_ih,bias_hh}_l0_reverse`` (fastai drops only
      the forward ``weight_hh_l0``). Default ``batch_first=True``.
    * fastai v1 (``fastai.text.models.awd_lstm``): the same plus
      ``rnns.k.module.weight_hh_l0`` (a dropped copy), which is ignored: ``_raw`` wins.
    * Salesforce awd-lstm-lm: ``rnns.k.module.weight_hh_l0_raw`` next to
      ``rnns.k.module.{weight_ih_l0, bias_ih_l0, bias_hh_l0}``. Default
      ``batch_first=False``.

    Other keys (encoder, decoder, ...) are ignored. Sizes, bias and bidirectionality come
    from the tensors; each layer's input size must equal the previous layer's output size.

    Args:
        state_dict: the checkpoint (``model.state_dict()`` or ``torch.load``'s dict).
        prefix: the text before ``rnns.`` (None: found automatically).
        weight_dropout: DropConnect p of every layer (fastai's ``weight_p``; not stored in
            checkpoints), on ``weight_hh_l0`` as fastai's ``WeightDropout`` (a bidirectional
            layer's reverse weight undropped: ``weight_dropout_names=("weight_hh_l0",)``).
        batch_first: None: the layout's default (see above).
        backend: passed to ``ctxfast.lstm``.

    Returns:
        ``nn.ModuleList`` of ``WeightDropLSTM(I_k, H_k, 1, batch_first=..., bidirectional=...,
        weight_dropout=...)`` on the checkpoint's device and dtype, weights loaded
        (``load_state_dict(strict=True)``).

    Raises:
        ValueError: no (or several) AWD-LSTM encoders found, missing weights, layer sizes
            that do not chain.
    """
    prefix, layers, layouts = _awd_layers(state_dict, prefix)
    modules = nn.ModuleList()
    prev_out = None
    for k, (sd, layout) in enumerate(zip(layers, layouts)):
        w_ih = sd["weight_ih_l0"]
        G, I = w_ih.shape
        H = G // 4
        bidir = "weight_ih_l0_reverse" in sd
        bias = "bias_ih_l0" in sd
        if prev_out is not None and I != prev_out:
            raise ValueError(f"load_awd_lstm: layer {k} takes {I} inputs but layer {k - 1} "
                             f"gives {prev_out}")
        prev_out = H * (2 if bidir else 1)
        bf = (layout == "fastai") if batch_first is None else batch_first
        m = WeightDropLSTM(I, H, 1, bias=bias, batch_first=bf, bidirectional=bidir,
                           weight_dropout=weight_dropout,
                           weight_dropout_names=("weight_hh_l0",), backend=backend,
                           device=w_ih.device, dtype=w_ih.dtype)
        m.load_state_dict(sd, strict=True)
        modules.append(m)
    return modules
