"""ELMo: a character-CNN bidirectional LSTM language model and its scalar mix of layers
(Peters et al. 2018), with AllenNLP's semantics (``allennlp.modules.elmo``,
``elmo_lstm``, ``highway``, ``scalar_mix``, ``models.language_model``) on ctxfast's LSTM.

* :class:`ElmoCharacterEncoder` — every token is ``max_characters_per_token`` character
  ids (0 = padding; a token whose ids are all 0 is padding). Optionally adds ``<S>`` and
  ``</S>`` tokens around each sentence. Characters are embedded, convolved with filters of
  several widths (``Conv1d``), max-pooled over the characters, passed through the
  activation (in that order, as AllenNLP), concatenated, then ``n_highway`` highway layers
  (``y = g * x + (1 - g) * relu(A x)``, ``g = sigmoid(B x)``) and a linear projection to
  ``projection_dim``.
* :class:`ElmoLstm` — ``n_layers`` of a forward and a backward LSTM, each a single-layer
  :class:`~ctxfast.nn.WeightDropLSTM` with projection (``cell_size -> projection_dim``),
  ``cell_clip`` and ``proj_clip`` (AllenNLP's ``LstmCellWithProjection``). The two
  directions are separate stacks: layer k's forward LSTM reads layer k-1's forward output
  only (likewise backward), and layers after the first add their input (residual).
  The backward LSTM starts at each sentence's own last token (the sequence is reversed
  within its length), outputs at padding positions are zero.
* :class:`ElmoBiLM` — encoder + biLSTM; its activations are ``[token, token]`` and each
  layer's ``[forward, backward]`` (``[B, T', 2P]`` each). With ``vocab_size > 0`` it is
  the biLM being trained: the forward state at a position predicts the next real token,
  the backward state the previous one, through one softmax ``Linear(P, vocab_size)``
  shared by both directions (the ELMo paper ties the softmax across directions;
  ``share_softmax=False`` gives each its own). ``loss = (forward_loss +
  backward_loss) / 2``, each the mean negative log-likelihood over its targets.
* :class:`ScalarMix` — ``gamma * sum_k softmax(w)_k * h_k`` (optionally each ``h_k``
  normalised over all its non-padding elements first), one per downstream task.
* :class:`Elmo` — the biLM and ``num_output_representations`` scalar mixes, the
  boundary tokens removed, then dropout.

``backend="ctxfast"`` runs the LSTMs on :func:`ctxfast.lstm` (the implementation ctxfast's
dispatch picks); ``backend="eager"`` on the eager reference. Everything else is plain
PyTorch in both.

    cfg = ElmoConfig(char_embed_dim=4, filters=((1, 4), (2, 8)), projection_dim=8,
                     cell_size=16, max_characters_per_token=10, vocab_size=50)
    elmo = Elmo(cfg)
    out = elmo(batch_to_ids([["hello", "world"]], 10), word_ids)
    out.elmo_representations[0]      # [B, T, 2 * projection_dim]; out.loss: the biLM loss

Differences from AllenNLP: no state carried between batches (AllenNLP's ElmoLstm is
stateful); dropout inside the LSTM is DropConnect on ``W_hh`` (``weight_dropout``), not
AllenNLP's variational dropout on ``h`` (``recurrent_dropout_probability``); the LM
targets are the real tokens only (with boundaries added, ``<S>``/``</S>`` give context but
are not predicted); full softmax only (no sampled softmax). Weight files (hdf5) are not
read.
"""
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.lstm import WeightDropLSTM
from ._common import check_backend, lm_decoder, model_output, values_checked

# AllenNLP's ELMoCharacterMapper: byte values 0..255 and five special characters, stored
# +1 so that 0 can mean "no character" (padding).
BOS_CHAR, EOS_CHAR, BOW_CHAR, EOW_CHAR, PAD_CHAR = 256, 257, 258, 259, 260
BOS_TOKEN, EOS_TOKEN = "<S>", "</S>"


@dataclass
class ElmoConfig:
    n_characters: int = 262          # rows of the char embedding; ids in [0, 262), 0 = padding
    max_characters_per_token: int = 50
    char_embed_dim: int = 16
    filters: Tuple[Tuple[int, int], ...] = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256),
                                            (6, 512), (7, 1024))   # (width, number)
    n_highway: int = 2
    activation: str = "relu"         # char CNN: "relu" | "tanh"
    projection_dim: int = 512        # P: token embedding and LSTM output (projection) size
    cell_size: int = 4096            # H: LSTM cell size
    n_layers: int = 2
    cell_clip: Optional[float] = 3.0
    proj_clip: Optional[float] = 3.0
    weight_dropout: float = 0.0      # DropConnect on every W_hh (training)
    add_sentence_boundaries: bool = True   # <S>, </S> around each sentence
    vocab_size: int = 0              # LM softmax size; 0 = no LM head
    share_softmax: bool = True       # one softmax for both directions (ELMo)
    lm_dropout: float = 0.0          # dropout on the top layer before the softmax
    num_output_representations: int = 1    # scalar mixes (one per task)
    do_layer_norm: bool = False      # ScalarMix: normalise each layer first
    dropout: float = 0.5             # on the mixed representations (AllenNLP's default)
    backend: str = "ctxfast"         # "ctxfast" | "eager"

    @property
    def n_filters(self) -> int:
        return sum(n for _, n in self.filters)


def _check_config(c: ElmoConfig) -> None:
    check_backend(c.backend)
    for name, low in (("n_characters", 2), ("max_characters_per_token", 1),
                      ("char_embed_dim", 1), ("n_highway", 0), ("projection_dim", 1),
                      ("cell_size", 2), ("n_layers", 1), ("vocab_size", 0),
                      ("num_output_representations", 0)):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"ElmoConfig.{name} must be an int >= {low}, got {v!r}")
    if c.projection_dim >= c.cell_size:
        raise ValueError(f"ElmoConfig.projection_dim ({c.projection_dim}) must be smaller than "
                         f"cell_size ({c.cell_size})")
    if not c.filters or any(not (1 <= w <= c.max_characters_per_token and n >= 1)
                            for w, n in c.filters):
        raise ValueError(f"ElmoConfig.filters must be (width, number) pairs with 1 <= width <= "
                         f"max_characters_per_token={c.max_characters_per_token}, got "
                         f"{c.filters}")
    if c.activation not in ("relu", "tanh"):
        raise ValueError(f"ElmoConfig.activation must be 'relu' or 'tanh', got {c.activation!r}")
    if c.add_sentence_boundaries and (c.max_characters_per_token < 3
                                      or c.n_characters <= PAD_CHAR + 1):
        raise ValueError("ElmoConfig: add_sentence_boundaries needs max_characters_per_token >= 3 "
                         f"and n_characters >= {PAD_CHAR + 2} (the boundary tokens' ids)")


def _check_char_ids(char_ids: object, c: ElmoConfig) -> None:
    if not isinstance(char_ids, Tensor) or char_ids.dtype.is_floating_point \
            or char_ids.dtype == torch.bool or char_ids.dtype.is_complex:
        raise TypeError(f"char_ids must be an integer tensor [B, T, "
                        f"max_characters_per_token={c.max_characters_per_token}], got "
                        f"{getattr(char_ids, 'dtype', type(char_ids).__name__)}")
    if char_ids.dim() != 3 or char_ids.shape[2] != c.max_characters_per_token:
        raise ValueError(f"char_ids must have shape [B, T, max_characters_per_token="
                         f"{c.max_characters_per_token}], got {tuple(char_ids.shape)}")
    if values_checked(char_ids):
        lo, hi = int(char_ids.min()), int(char_ids.max())
        if lo < 0 or hi >= c.n_characters:
            raise ValueError(f"char_ids must be in [0, {c.n_characters}) (n_characters), got "
                             f"values in [{lo}, {hi}]")


# --------------------------------------------------------------------------- characters

def word_to_char_ids(word: str, max_chars: int = 50) -> List[int]:
    """AllenNLP's ``ELMoCharacterMapper``: ``[begin-word, utf-8 bytes (at most max_chars -
    2), end-word, padding...]`` + 1; ``<S>``/``</S>`` map to their special tokens."""
    if word in (BOS_TOKEN, EOS_TOKEN):
        return _boundary_chars(BOS_CHAR if word == BOS_TOKEN else EOS_CHAR, max_chars)
    data = word.encode("utf-8", "ignore")[:max_chars - 2]
    ids = [PAD_CHAR] * max_chars
    ids[0] = BOW_CHAR
    ids[1:1 + len(data)] = list(data)
    ids[len(data) + 1] = EOW_CHAR
    return [i + 1 for i in ids]


def _boundary_chars(char: int, max_chars: int) -> List[int]:
    ids = [PAD_CHAR] * max_chars
    ids[0], ids[1], ids[2] = BOW_CHAR, char, EOW_CHAR
    return [i + 1 for i in ids]


def batch_to_ids(batch: Sequence[Sequence[str]], max_chars: int = 50) -> Tensor:
    """Sentences (lists of tokens) -> char ids ``[B, T_max, max_chars]`` (int64), padded
    at the end with all-zero tokens."""
    T = max((len(s) for s in batch), default=0)
    out = torch.zeros(len(batch), T, max_chars, dtype=torch.long)
    for b, sent in enumerate(batch):
        for t, word in enumerate(sent):
            out[b, t] = torch.tensor(word_to_char_ids(word, max_chars))
    return out


def _prefix_lengths(mask: Tensor, name: str) -> Tensor:
    """Lengths of a right-padded bool mask ``[B, T]``; refuses padding before a token."""
    lengths = mask.sum(1)                                               # [B]
    if values_checked(mask):
        pos = torch.arange(mask.shape[1], device=mask.device)           # [T]
        if not torch.equal(mask, pos[None, :] < lengths[:, None]):
            raise ValueError(f"{name}: padding tokens (all character ids 0) must come after "
                             f"the tokens of each sentence (right padding)")
    return lengths


class Highway(nn.Module):
    """``n`` highway layers on ``[..., D]``: ``y = g * x + (1 - g) * relu(A x)`` with
    ``[A x | B x] = layers[k](x)`` (``Linear(D, 2D)``), ``g = sigmoid(B x)``; the gate's
    bias starts at 1 (carry the input)."""

    def __init__(self, dim: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, 2 * dim) for _ in range(n)])
        for layer in self.layers:
            with torch.no_grad():
                layer.bias[dim:].fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            nonlinear, gate = layer(x).chunk(2, dim=-1)                  # 2 x [..., D]
            g = torch.sigmoid(gate)
            x = g * x + (1 - g) * F.relu(nonlinear)
        return x


class ElmoCharacterEncoder(nn.Module):
    """Context-independent token embeddings from characters (AllenNLP's
    ``_ElmoCharacterEncoder``). Parameters: ``char_embedding`` ``[n_characters, d]``
    (row 0, padding, stays zero), ``convs.{i}`` (``Conv1d(d, n_i, width_i)``),
    ``highways``, ``projection`` (``Linear(n_filters, projection_dim)``)."""

    def __init__(self, config: ElmoConfig) -> None:
        super().__init__()
        c = self.config = config
        self.char_embedding = nn.Embedding(c.n_characters, c.char_embed_dim, padding_idx=0)
        self.convs = nn.ModuleList([nn.Conv1d(c.char_embed_dim, n, w, bias=True)
                                    for w, n in c.filters])
        self.highways = Highway(c.n_filters, c.n_highway)
        self.projection = nn.Linear(c.n_filters, c.projection_dim, bias=True)
        C = c.max_characters_per_token
        if c.add_sentence_boundaries:
            bos = torch.tensor(_boundary_chars(BOS_CHAR, C))
            eos = torch.tensor(_boundary_chars(EOS_CHAR, C))
        else:
            bos = eos = torch.zeros(C, dtype=torch.long)
        self.register_buffer("bos_chars", bos, persistent=False)        # [C]
        self.register_buffer("eos_chars", eos, persistent=False)        # [C]

    def add_boundaries(self, char_ids: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
        """``[B, T, C]``, token mask ``[B, T]`` -> ``[B, T + 2, C]`` with ``<S>`` first and
        ``</S>`` right after each sentence's last token, and its mask ``[B, T + 2]``."""
        B, T, C = char_ids.shape
        lengths = _prefix_lengths(mask, "char_ids")                     # [B]
        out = char_ids.new_zeros(B, T + 2, C)
        out[:, 1:-1] = char_ids
        out[:, 0] = self.bos_chars
        rows = torch.arange(B, device=char_ids.device)
        out[rows, lengths + 1] = self.eos_chars                         # [B, C] at T_b + 1
        return out, (out > 0).any(-1)

    def forward(self, char_ids: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """char_ids ``[B, T, C]`` -> (embeddings ``[B, T', P]``, mask ``[B, T']`` of the
        sequence the LSTM sees, token mask ``[B, T]`` of the input); ``T' = T + 2`` with
        sentence boundaries, else T."""
        c = self.config
        token_mask = (char_ids > 0).any(-1)                             # [B, T]
        if c.add_sentence_boundaries:
            char_ids, mask = self.add_boundaries(char_ids, token_mask)  # [B, T+2, C]
        else:
            _prefix_lengths(token_mask, "char_ids")
            mask = token_mask
        B, T, C = char_ids.shape
        x = self.char_embedding(char_ids.reshape(B * T, C))             # [B*T, C, d]
        x = x.transpose(1, 2)                                           # [B*T, d, C]
        act = F.relu if c.activation == "relu" else torch.tanh
        # each conv: [B*T, n_i, C - w_i + 1] -> max over characters -> [B*T, n_i]
        x = torch.cat([act(conv(x).amax(-1)) for conv in self.convs], -1)   # [B*T, n_filters]
        x = self.projection(self.highways(x))                           # [B*T, P]
        return x.view(B, T, c.projection_dim), mask, token_mask         # [B*T, P] -> [B, T, P]


# --------------------------------------------------------------------------- biLSTM

def _reverse_index(lengths: Tensor, T: int) -> Tensor:
    """``[B, T]`` gather index reversing each row within its length (``t -> len - 1 - t``
    for ``t < len``, padding positions stay). Its own inverse."""
    t = torch.arange(T, device=lengths.device)[None, :]                 # [1, T]
    L = lengths[:, None]                                                # [B, 1]
    return torch.where(t < L, L - 1 - t, t)                            # [B, T]


def _gather_time(x: Tensor, index: Tensor) -> Tensor:
    """x ``[B, T, D]``, index ``[B, T]`` -> ``x[b, index[b, t]]``."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


class ElmoLstm(nn.Module):
    """AllenNLP's ``ElmoLstm``: ``forward_layers.{k}`` and ``backward_layers.{k}``, each a
    single-layer ``WeightDropLSTM(P, H, proj_size=P, batch_first=True, cell_clip,
    proj_clip, weight_dropout)`` (P = projection_dim, H = cell_size); forget-gate bias
    starts at 1, other biases at 0, as AllenNLP."""

    def __init__(self, config: ElmoConfig) -> None:
        super().__init__()
        c = self.config = config
        lstm_backend = None if c.backend == "ctxfast" else "eager"

        def one() -> WeightDropLSTM:
            m = WeightDropLSTM(c.projection_dim, c.cell_size, 1, batch_first=True,
                               proj_size=c.projection_dim, weight_dropout=c.weight_dropout,
                               cell_clip=c.cell_clip, proj_clip=c.proj_clip,
                               backend=lstm_backend)
            with torch.no_grad():
                H = c.cell_size
                m.bias_ih_l0.zero_()
                m.bias_ih_l0[H:2 * H].fill_(1.0)                         # forget gate
                m.bias_hh_l0.zero_()
            return m

        self.forward_layers = nn.ModuleList([one() for _ in range(c.n_layers)])
        self.backward_layers = nn.ModuleList([one() for _ in range(c.n_layers)])

    def set_backend(self, backend: str) -> None:
        for m in (*self.forward_layers, *self.backward_layers):
            m.backend = None if backend == "ctxfast" else "eager"

    def forward(self, inputs: Tensor, mask: Tensor) -> Tensor:
        """inputs ``[B, T, P]``, mask bool ``[B, T]`` (right padding) -> ``[n_layers, B, T,
        2P]``: per layer ``[forward, backward]``, zero at padding."""
        B, T, _ = inputs.shape
        lengths = mask.sum(1)                                           # [B]
        rev = _reverse_index(lengths, T)                                # [B, T]
        keep = mask.unsqueeze(-1).to(inputs.dtype)                      # [B, T, 1]
        fwd_in, bwd_in = inputs, inputs
        outputs = []
        for k, (f_lstm, b_lstm) in enumerate(zip(self.forward_layers, self.backward_layers)):
            f_out = f_lstm(fwd_in)[0] * keep                            # [B, T, P]
            # the backward LSTM runs forward over each sentence reversed within its length
            b_out = _gather_time(b_lstm(_gather_time(bwd_in, rev))[0], rev) * keep  # [B, T, P]
            if k > 0:                                                   # residual
                f_out, b_out = f_out + fwd_in, b_out + bwd_in
            outputs.append(torch.cat([f_out, b_out], -1))               # [B, T, 2P]
            fwd_in, bwd_in = f_out, b_out
        return torch.stack(outputs, 0)                                  # [L, B, T, 2P]


# --------------------------------------------------------------------------- biLM

@model_output
@dataclass
class ElmoBiLMOutput:
    activations: List[Tensor]                 # n_layers + 1 of [B, T', 2P]
    mask: Tensor                              # [B, T'] bool, the LSTM's sequence
    token_mask: Tensor                        # [B, T] bool, the input tokens
    loss: Optional[Tensor] = None             # (forward_loss + backward_loss) / 2
    forward_loss: Optional[Tensor] = None     # mean NLL of the forward LM
    backward_loss: Optional[Tensor] = None    # mean NLL of the backward LM


class ElmoBiLM(nn.Module):
    """The biLM: ``token_embedder`` (:class:`ElmoCharacterEncoder`), ``lstm``
    (:class:`ElmoLstm`) and, with ``vocab_size > 0``, ``softmax`` (``Linear(P,
    vocab_size)``; ``softmax_backward`` too when not ``share_softmax``)."""

    def __init__(self, config: ElmoConfig) -> None:
        super().__init__()
        _check_config(config)
        self.config = c = replace(config)                  # our own copy (set_backend)
        self.token_embedder = ElmoCharacterEncoder(c)
        self.lstm = ElmoLstm(c)
        self.softmax = self.softmax_backward = None
        if c.vocab_size > 0:
            self.softmax = self._softmax(c)
            if not c.share_softmax:
                self.softmax_backward = self._softmax(c)
        self.lm_dropout = nn.Dropout(c.lm_dropout)

    @staticmethod
    def _softmax(c: ElmoConfig) -> nn.Linear:
        lin = lm_decoder(c.projection_dim, c.vocab_size, True, c.backend)  # ctxfast.linear
        nn.init.normal_(lin.weight, 0.0, c.projection_dim ** -0.5)      # AllenNLP's SoftmaxLoss
        nn.init.zeros_(lin.bias)
        return lin

    @property
    def backend(self) -> str:
        return self.config.backend

    def set_backend(self, backend: str) -> "ElmoBiLM":
        self.config.backend = check_backend(backend)
        self.lstm.set_backend(backend)
        for head in (self.softmax, self.softmax_backward):
            if head is not None:
                head.backend = None if backend == "ctxfast" else "eager"
        return self

    def forward(self, char_ids: Tensor, word_ids: Optional[Tensor] = None) -> ElmoBiLMOutput:
        """char_ids ``[B, T, max_characters_per_token]`` (ids in ``[0, n_characters)``,
        right-padded with all-zero tokens) -> :class:`ElmoBiLMOutput`.

        word_ids ``[B, T]``: the vocabulary ids of the tokens (``[0, vocab_size)``; -100 or
        padding positions are ignored), for the LM losses; needs ``vocab_size > 0``.
        """
        c = self.config
        _check_char_ids(char_ids, c)
        if word_ids is not None:
            self._check_word_ids(word_ids, char_ids)
        emb, mask, token_mask = self.token_embedder(char_ids)           # [B, T', P]
        layers = self.lstm(emb, mask)                                   # [L, B, T', 2P]
        keep = mask.unsqueeze(-1).to(emb.dtype)                         # [B, T', 1]
        activations = [torch.cat([emb, emb], -1) * keep] + list(layers.unbind(0))
        out = ElmoBiLMOutput(activations, mask, token_mask)
        if word_ids is not None:
            out.loss, out.forward_loss, out.backward_loss = self._lm_loss(
                activations[-1], word_ids, mask, token_mask)
        return out

    def _check_word_ids(self, word_ids: Tensor, char_ids: Tensor) -> None:
        V = self.config.vocab_size
        if V == 0:
            raise ValueError("word_ids given but the model has no LM softmax (vocab_size=0)")
        if not isinstance(word_ids, Tensor) or word_ids.dtype.is_floating_point \
                or word_ids.dtype == torch.bool:
            raise TypeError("word_ids must be an integer tensor [B, T]")
        if tuple(word_ids.shape) != tuple(char_ids.shape[:2]):
            raise ValueError(f"word_ids must have shape [B, T] = {tuple(char_ids.shape[:2])} "
                             f"(char_ids' first two), got {tuple(word_ids.shape)}")
        if values_checked(word_ids):
            tok = (char_ids > 0).any(-1) & (word_ids != -100)
            bad = tok & ((word_ids < 0) | (word_ids >= V))
            if bool(bad.any()):
                vals = word_ids[bad]
                raise ValueError(f"word_ids must be in [0, {V}) (vocab_size) or -100 at the "
                                 f"tokens, got values in [{int(vals.min())}, {int(vals.max())}]")

    def _lm_loss(self, top: Tensor, word_ids: Tensor, mask: Tensor, token_mask: Tensor):
        """top ``[B, T', 2P]`` -> (loss, forward_loss, backward_loss). The forward state at
        position p predicts the real token at p + 1, the backward state the one at p - 1."""
        off = 1 if self.config.add_sentence_boundaries else 0
        ids = word_ids.long().masked_fill(~token_mask, -100)            # [B, T]
        ids = F.pad(ids, (off, off), value=-100)                        # [B, T'] token at p
        pad = ~mask                                                     # [B, T'] no state there
        fwd_t = F.pad(ids[:, 1:], (0, 1), value=-100).masked_fill(pad, -100)   # token at p+1
        bwd_t = F.pad(ids[:, :-1], (1, 0), value=-100).masked_fill(pad, -100)  # token at p-1
        fwd, bwd = self.lm_dropout(top).chunk(2, -1)                    # 2 x [B, T', P]
        back = self.softmax_backward if self.softmax_backward is not None else self.softmax
        losses = []
        for states, targets, head in ((fwd, fwd_t, self.softmax), (bwd, bwd_t, back)):
            logits = head(states)                                       # [B, T', V]
            # [B, T', V] -> [B*T', V]; [B, T'] -> [B*T']
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                  ignore_index=-100, reduction="sum")
            losses.append(nll / (targets != -100).sum().clamp(min=1))
        return 0.5 * (losses[0] + losses[1]), losses[0], losses[1]


# --------------------------------------------------------------------------- scalar mix

class ScalarMix(nn.Module):
    """``gamma * sum_k softmax(w)_k * h_k`` over ``mixture_size`` tensors of one shape
    ``[..., D]``. With ``do_layer_norm`` each ``h_k`` is first normalised by the mean and
    variance of all its non-padding elements (one mean for the whole tensor, as
    AllenNLP). Parameters: ``scalar_parameters.{k}`` ``[1]`` (w, start at 0) and ``gamma``
    ``[1]`` (starts at 1)."""

    def __init__(self, mixture_size: int, do_layer_norm: bool = False,
                 initial_scalar_parameters: Optional[Sequence[float]] = None,
                 trainable: bool = True) -> None:
        super().__init__()
        init = [0.0] * mixture_size if initial_scalar_parameters is None \
            else list(initial_scalar_parameters)
        if len(init) != mixture_size:
            raise ValueError(f"ScalarMix: initial_scalar_parameters must have mixture_size="
                             f"{mixture_size} values, got {len(init)}")
        self.mixture_size, self.do_layer_norm = mixture_size, do_layer_norm
        self.scalar_parameters = nn.ParameterList(
            [nn.Parameter(torch.tensor([v]), requires_grad=trainable) for v in init])
        self.gamma = nn.Parameter(torch.tensor([1.0]), requires_grad=trainable)

    def forward(self, tensors: Sequence[Tensor], mask: Optional[Tensor] = None) -> Tensor:
        """tensors: ``mixture_size`` of ``[B, T, D]``; mask ``[B, T]`` (True/1 = token),
        needed with ``do_layer_norm``. -> ``[B, T, D]``."""
        if len(tensors) != self.mixture_size:
            raise ValueError(f"ScalarMix: expected {self.mixture_size} tensors, got "
                             f"{len(tensors)}")
        w = torch.softmax(torch.cat(list(self.scalar_parameters)), 0)    # [K]
        if not self.do_layer_norm:
            return self.gamma * sum(w[k] * t for k, t in enumerate(tensors))
        if mask is None:
            raise ValueError("ScalarMix: do_layer_norm needs the mask [B, T]")
        # the count and the moments in fp32 at least: in fp16 the count of unpadded
        # elements passed 65,504 (64 tokens x 1,024 features) and became inf, and 1e-12 is 0
        acc = torch.promote_types(tensors[0].dtype, torch.float32)
        m = mask.to(acc).unsqueeze(-1)                                   # [B, T, 1]
        n = m.sum() * tensors[0].shape[-1]
        pieces = []
        for k, t in enumerate(tensors):
            x = t.to(acc)
            mean = (x * m).sum() / n
            var = (((x * m) - mean) * m).pow(2).sum() / n
            pieces.append(w[k] * ((x - mean) / torch.sqrt(var + 1e-12)).to(t.dtype))
        return self.gamma * sum(pieces)


# --------------------------------------------------------------------------- ELMo

@model_output
@dataclass
class ElmoOutput:
    elmo_representations: List[Tensor]        # num_output_representations of [B, T, 2P]
    mask: Tensor                              # [B, T] bool
    loss: Optional[Tensor] = None             # the biLM's LM loss, when word_ids are given


class Elmo(nn.Module):
    """ELMo representations: ``bilm`` (:class:`ElmoBiLM`), ``scalar_mixes.{i}``
    (:class:`ScalarMix` over the ``n_layers + 1`` activations, one per task), the boundary
    tokens removed, then ``dropout``."""

    def __init__(self, config: ElmoConfig) -> None:
        super().__init__()
        self.bilm = ElmoBiLM(config)
        self.config = config = self.bilm.config             # shared: set_backend updates both
        self.scalar_mixes = nn.ModuleList([ScalarMix(config.n_layers + 1, config.do_layer_norm)
                                           for _ in range(config.num_output_representations)])
        self.dropout = nn.Dropout(config.dropout)

    @property
    def backend(self) -> str:
        return self.config.backend

    def set_backend(self, backend: str) -> "Elmo":
        self.bilm.set_backend(backend)
        return self

    def forward(self, char_ids: Tensor, word_ids: Optional[Tensor] = None) -> ElmoOutput:
        """char_ids ``[B, T, max_characters_per_token]`` -> :class:`ElmoOutput` (each
        representation ``[B, T, 2 * projection_dim]``, zero at padding before dropout);
        word_ids ``[B, T]`` adds the biLM loss (see :meth:`ElmoBiLM.forward`)."""
        out = self.bilm(char_ids, word_ids)
        keep = out.token_mask.unsqueeze(-1).to(out.activations[0].dtype)   # [B, T, 1]
        reps = []
        for mix in self.scalar_mixes:
            r = mix(out.activations, out.mask)                          # [B, T', 2P]
            if self.config.add_sentence_boundaries:
                r = r[:, 1:-1]                                          # [B, T, 2P]
            reps.append(self.dropout(r * keep))
        return ElmoOutput(reps, out.token_mask, out.loss)


__all__ = ["ElmoConfig", "Elmo", "ElmoOutput", "ElmoBiLM", "ElmoBiLMOutput", "ElmoLstm",
           "ElmoCharacterEncoder", "Highway", "ScalarMix", "batch_to_ids", "word_to_char_ids"]
