"""AWD-LSTM / ULMFiT: fastai's language model and text classifier on ctxfast's LSTM.

Three pieces, named and wired as in fastai (``fastai.text.models.awdlstm`` / ``core``):

* :class:`AWDLSTM` — the encoder. ``x = input_dp(encoder_dp(ids))`` (embedding dropout:
  whole words; input dropout: locked, one mask per sequence), then ``n_layers`` LSTM
  layers, each its own single-layer :class:`~ctxfast.nn.WeightDropLSTM` (DropConnect on
  ``weight_hh_l0``, one mask per forward), with locked ``hidden_dps`` between them (not
  after the last). Layer sizes ``emb_sz -> n_hid -> ... -> n_hid -> emb_sz`` (the last
  layer's hidden size is the embedding size, so the decoder can be tied). The hidden
  state ``(h, c)`` of every layer is kept between calls, detached, so consecutive
  batches of a stream continue each other (truncated BPTT); :meth:`AWDLSTM.reset` clears
  it. A new batch size pads the kept state with zeros or cuts it, as fastai does.
* :class:`AWDLSTMLM` — encoder, locked ``output_dp``, ``decoder`` ``Linear(emb_sz,
  vocab)`` whose weight is the embedding's (``tie_weights``). Optional AR/TAR
  regularisation (fastai's ``RNNRegularizer``) in training.
* :class:`AWDLSTMClassifier` — encoder over the whole text (in chunks of ``bptt`` with
  the state carried, as fastai's ``SentenceEncoder``), concat pooling
  ``[last, max, mean]`` over the non-padding positions, then fastai's
  ``PoolingLinearClassifier`` blocks ``BatchNorm1d -> Dropout -> Linear(bias=False)``
  (ReLU after every block but the last).

``backend="ctxfast"`` runs the LSTMs on :func:`ctxfast.lstm` (whichever implementation
ctxfast's dispatch picks: ``with ctxfast.backend("triton"):`` or ``CTXFAST_BACKEND`` choose)
and the dropouts on :func:`ctxfast.locked_dropout` / :func:`ctxfast.embedding_dropout`;
``backend="eager"`` runs the same on ``ctxfast.reference``. Dropout masks are drawn by the
model (and by ``WeightDropLSTM`` for DropConnect) in the same order on both backends, so
the two agree under the same seed even in training.

fastai checkpoints: :meth:`AWDLSTMLM.from_fastai` / :meth:`AWDLSTMClassifier.from_fastai`
(and ``load_fastai_state_dict``) read the state dicts of fastai v1/v2
``get_language_model`` models and fastai v2 ``get_text_classifier`` models (fastai v1's
classifier head is laid out otherwise and is not read) (keys ``0.encoder.weight``,
``0.rnns.{k}.weight_hh_l0_raw``, ``0.rnns.{k}.module.weight_ih_l0``, ``1.decoder.weight``;
``0.module.*`` and ``1.layers.{k}.{0,1|2}.*`` for the classifier).

    cfg = AWDLSTMConfig(vocab_size=100, emb_sz=16, n_hid=32)
    lm = AWDLSTMLM(cfg)
    logits, loss = lm(input_ids, targets)           # [B, T] each; state carried
    lm.reset()                                      # new stream

Not done: bidirectional encoders (fastai's ``bidir=True``), fastai's ``SentenceEncoder``
row trimming for sorted batches and its ``max_len`` (only the last ``max_len`` tokens
pooled) — here every position is encoded and pooled. fastai skips the rows whose chunk is
all padding (a left-padded text starts from a zero state at its first real chunk); here
the padding chunks run through the LSTMs, so a text's logits depend on the longest text
of its batch (0.039 alone, 0.052 beside a longer one in a small model).
"""
from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import reference
from ..nn.lstm import EmbeddingDropout, LockedDropout, WeightDropLSTM, load_awd_lstm
from ._common import check_backend, check_ids, check_tied_entries, lm_decoder, values_checked

# fastai's dropouts for the classifier (``awd_lstm_clas_config``); the config's defaults
# are its language-model ones (``awd_lstm_lm_config``).
CLASSIFIER_DROPOUTS = dict(output_p=0.4, hidden_p=0.3, input_p=0.4, embed_p=0.05, weight_p=0.5)


@dataclass
class AWDLSTMConfig:
    vocab_size: int = 60000
    emb_sz: int = 400                # embedding size = last LSTM layer's hidden size
    n_hid: int = 1152                # hidden size of the other layers
    n_layers: int = 3
    pad_token: int = 1               # the embedding's padding_idx (fastai: xxpad = 1)
    embed_p: float = 0.02            # embedding dropout (whole words)
    input_p: float = 0.25            # locked dropout on the embeddings
    hidden_p: float = 0.15           # locked dropout between LSTM layers
    weight_p: float = 0.2            # DropConnect on every weight_hh_l0
    output_p: float = 0.1            # LM: locked dropout before the decoder; classifier:
    #                                  dropout of the first head block
    tie_weights: bool = True         # LM decoder weight is the embedding
    out_bias: bool = True            # LM decoder bias
    ar_alpha: float = 0.0            # LM, training: + alpha * mean(dropped output^2)
    tar_beta: float = 0.0            # LM, training: + beta * mean((h_t - h_{t-1})^2)
    #                                  (fastai's learners use alpha=2, beta=1)
    n_class: int = 2                 # classifier outputs
    lin_ftrs: Tuple[int, ...] = (50,)    # classifier hidden sizes
    lin_ps: Tuple[float, ...] = (0.1,)   # their dropouts
    bptt: int = 72                   # classifier: encoder chunk length (fastai's seq_len)
    backend: str = "ctxfast"         # "ctxfast" | "eager"

    def layer_sizes(self) -> List[Tuple[int, int]]:
        """(input, hidden) size of every LSTM layer."""
        return [(self.emb_sz if k == 0 else self.n_hid,
                 self.emb_sz if k == self.n_layers - 1 else self.n_hid)
                for k in range(self.n_layers)]


def _check_config(c: AWDLSTMConfig) -> None:
    check_backend(c.backend)
    for name in ("vocab_size", "emb_sz", "n_hid", "n_layers", "n_class", "bptt"):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"AWDLSTMConfig.{name} must be an int >= 1, got {v!r}")
    if not (isinstance(c.pad_token, int) and 0 <= c.pad_token < c.vocab_size):
        raise ValueError(f"AWDLSTMConfig.pad_token must be in [0, vocab_size={c.vocab_size}), "
                         f"got {c.pad_token!r}")
    for name in ("embed_p", "input_p", "hidden_p", "output_p", "weight_p"):
        v = getattr(c, name)
        closed = name != "weight_p"                   # DropConnect keeps some weight: p < 1
        if isinstance(v, bool) or not isinstance(v, (int, float)) \
                or not (0.0 <= v <= 1.0 if closed else 0.0 <= v < 1.0):
            raise ValueError(f"AWDLSTMConfig.{name} must be a float in [0, 1"
                             f"{']' if closed else ')'}, got {v!r}")
    if len(c.lin_ps) != len(c.lin_ftrs):
        raise ValueError(f"AWDLSTMConfig.lin_ps must have one dropout per lin_ftrs entry, got "
                         f"lin_ftrs={c.lin_ftrs}, lin_ps={c.lin_ps}")


# --------------------------------------------------------------------------- dropouts

def _keep_mask(shape, p: float, like: Tensor) -> Tensor:
    """0/1 keep-mask of `shape` (keep probability 1 - p) in `like`'s dtype and device."""
    return torch.bernoulli(torch.full(shape, 1.0 - p, dtype=like.dtype, device=like.device))


def _scale(p: float) -> float:
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)


def locked(dp: LockedDropout, x: Tensor, backend: str) -> Tensor:
    """Locked dropout of a batch-first x ``[B, T, F]`` with the module's p: one mask
    ``[B, F]`` for every time step (drawn here for both backends)."""
    if not dp.training or dp.p == 0.0:
        return x
    mask = _keep_mask((x.shape[0],) + tuple(x.shape[2:]), dp.p, x)       # [B, F]
    if backend == "ctxfast":
        return dp(x, mask)
    return reference.locked_dropout(x, mask, _scale(dp.p), batch_first=True)


# --------------------------------------------------------------------------- encoder

class AWDLSTM(nn.Module):
    """fastai's ``AWD_LSTM`` encoder (see the module docstring). Parameters: ``encoder``
    (``nn.Embedding(vocab, emb_sz, padding_idx=pad_token)``, also reachable as
    ``encoder_dp.emb``), ``rnns.{k}`` (``WeightDropLSTM``, ``nn.LSTM``'s names:
    ``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``, ``bias_hh_l0``). State: ``hidden``,
    a list of ``(h [1, B, H_k], c [1, B, H_k])`` per layer, or None (zeros)."""

    initrange = 0.1

    def __init__(self, config: AWDLSTMConfig) -> None:
        super().__init__()
        _check_config(config)
        self.config = c = replace(config)                  # our own copy (set_backend)
        lstm_backend = None if c.backend == "ctxfast" else "eager"
        self.encoder = nn.Embedding(c.vocab_size, c.emb_sz, padding_idx=c.pad_token)
        self.encoder_dp = EmbeddingDropout(self.encoder, c.embed_p)
        self.rnns = nn.ModuleList([
            WeightDropLSTM(n_in, n_out, 1, batch_first=True, weight_dropout=c.weight_p,
                           backend=lstm_backend)
            for n_in, n_out in c.layer_sizes()])
        # fastai overwrites the whole table, the padding row included
        nn.init.uniform_(self.encoder.weight, -self.initrange, self.initrange)
        self.input_dp = LockedDropout(c.input_p, batch_first=True)
        self.hidden_dps = nn.ModuleList([LockedDropout(c.hidden_p, batch_first=True)
                                         for _ in range(c.n_layers)])
        self.hidden: Optional[List[Tuple[Tensor, Tensor]]] = None

    def reset(self) -> None:
        """Forget the carried hidden state (the next batch starts from zeros)."""
        self.hidden = None

    def set_backend(self, backend: str) -> None:
        self.config.backend = check_backend(backend)
        for rnn in self.rnns:
            rnn.backend = None if backend == "ctxfast" else "eager"

    def _hidden_for(self, B: int, like: Tensor) -> Optional[List[Tuple[Tensor, Tensor]]]:
        """The carried state resized to batch size B (zeros appended, or rows cut), in
        `like`'s dtype: under autocast the layers return it in the autocast dtype, and it
        goes on from there (it was dropped as if the module had been cast: with AMP every
        batch started from zeros)."""
        hid = self.hidden
        if hid is None:
            return None
        if hid[0][0].device != like.device:
            return None                                  # the module was moved
        out = []
        for h, c in hid:                                 # [1, B_old, H_k] each
            h, c = h.to(like.dtype), c.to(like.dtype)
            b = h.shape[1]
            if b < B:
                h = torch.cat([h, h.new_zeros(1, B - b, h.shape[2])], 1)   # [1, B, H_k]
                c = torch.cat([c, c.new_zeros(1, B - b, c.shape[2])], 1)
            elif b > B:
                h, c = h[:, :B].contiguous(), c[:, :B].contiguous()        # [1, B, H_k]
            out.append((h, c))
        return out

    def embed(self, input_ids: Tensor) -> Tensor:
        """Embedding dropout (training): ``[B, T]`` -> ``[B, T, emb_sz]``."""
        dp = self.encoder_dp
        mask = None
        if self.training and dp.embed_p > 0:
            mask = _keep_mask((self.encoder.num_embeddings,), dp.embed_p, self.encoder.weight)
        if self.config.backend == "ctxfast":
            return dp(input_ids, mask=mask)
        return reference.embedding_dropout(self.encoder.weight, input_ids, mask,
                                           _scale(dp.embed_p),
                                           padding_idx=self.encoder.padding_idx)

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids ``[B, T]`` (ids in ``[0, vocab_size)``, T >= 1) -> the last layer's
        output ``[B, T, emb_sz]`` (before any output dropout). Continues from the carried
        state and replaces it with the new final state, detached. So a call is not a pure
        function of its inputs: under activation checkpointing
        (``torch.utils.checkpoint``) of this module the recomputation starts from the state
        the first pass left, and the gradients are wrong (fastai's module has the same
        property); checkpoint the ``rnns`` layers instead (each is pure given its state)."""
        c = self.config
        p0 = self.encoder.weight
        check_ids("input_ids", input_ids, c.vocab_size, device=p0.device)
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("input_ids must hold at least one time step, got shape "
                             f"{tuple(input_ids.shape)}")
        hidden = self._hidden_for(B, p0)
        x = locked(self.input_dp, self.embed(input_ids), c.backend)           # [B, T, E]
        new_hidden = []
        for k, (rnn, dp) in enumerate(zip(self.rnns, self.hidden_dps)):
            x, (h, cell) = rnn(x, None if hidden is None else hidden[k])     # [B, T, H_k]
            new_hidden.append((h.detach(), cell.detach()))                   # [1, B, H_k]
            if k != c.n_layers - 1:
                x = locked(dp, x, c.backend)
        self.hidden = new_hidden
        return x


# --------------------------------------------------------------------------- language model

class AWDLSTMLM(nn.Module):
    """ULMFiT's language model: :class:`AWDLSTM` -> locked ``output_dp`` -> ``decoder``
    (``Linear(emb_sz, vocab_size)``, weight tied to ``encoder.encoder`` when
    ``tie_weights``)."""

    initrange = 0.1

    def __init__(self, config: AWDLSTMConfig) -> None:
        super().__init__()
        self.encoder = AWDLSTM(config)
        self.config = config = self.encoder.config          # shared: set_backend updates both
        self.output_dp = LockedDropout(config.output_p, batch_first=True)
        self.decoder = lm_decoder(config.emb_sz, config.vocab_size, config.out_bias,
                                  config.backend)              # ctxfast.linear for ctxfast
        nn.init.uniform_(self.decoder.weight, -self.initrange, self.initrange)
        if config.out_bias:
            nn.init.zeros_(self.decoder.bias)
        if config.tie_weights:
            self.decoder.weight = self.encoder.encoder.weight

    @property
    def backend(self) -> str:
        return self.config.backend

    def set_backend(self, backend: str) -> "AWDLSTMLM":
        """Switch to ``"ctxfast"`` or ``"eager"`` (weights and carried state unchanged)."""
        self.encoder.set_backend(backend)
        self.decoder.backend = None if backend == "ctxfast" else "eager"
        return self

    def reset(self) -> None:
        self.encoder.reset()

    def forward(self, input_ids: Tensor, targets: Optional[Tensor] = None
                ) -> Tuple[Tensor, Optional[Tensor]]:
        """input_ids ``[B, T]`` -> (logits ``[B, T, vocab_size]``, loss or None).

        targets ``[B, T]``: the next token of every position (-100 = ignored); the loss is
        the mean cross-entropy, plus AR/TAR in training when ``ar_alpha``/``tar_beta`` > 0.
        The encoder's state is carried to the next call (see :class:`AWDLSTM`).
        """
        cfg = self.config
        if targets is not None:
            check_ids("input_ids", input_ids, cfg.vocab_size)     # before the targets' check
            _check_targets(targets, input_ids, cfg.vocab_size)
        raw = self.encoder(input_ids)                                       # [B, T, E]
        out = locked(self.output_dp, raw, cfg.backend)                # [B, T, E]
        logits = self.decoder(out)                                    # [B, T, V]
        loss = None
        if targets is not None:
            B, T = input_ids.shape
            # [B, T, V] -> [B*T, V]; [B, T] -> [B*T]
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T),
                                   ignore_index=-100)
            if self.training and cfg.ar_alpha:
                loss = loss + cfg.ar_alpha * out.float().pow(2).mean()
            if self.training and cfg.tar_beta and raw.shape[1] > 1:
                loss = loss + cfg.tar_beta * (raw[:, 1:] - raw[:, :-1]).float().pow(2).mean()
        return logits, loss

    @classmethod
    def from_fastai(cls, state_dict: Mapping[str, Tensor], **config) -> "AWDLSTMLM":
        """A model with the weights of a fastai ``get_language_model(AWD_LSTM, ...)`` state
        dict; sizes come from the tensors, other fields (``pad_token``, dropouts,
        ``backend``) from `config`."""
        sd, inferred = _from_fastai(state_dict, "lm")
        model = cls(AWDLSTMConfig(**{**inferred, **config}))
        check_tied_entries(model, sd, "AWDLSTMLM.from_fastai")       # a tie_weights override
        model.load_state_dict(sd, strict=True)
        return model

    def load_fastai_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load a fastai language-model state dict (sizes must match this model)."""
        sd = _from_fastai(state_dict, "lm")[0]
        check_tied_entries(self, sd, "AWDLSTMLM.load_fastai_state_dict")
        self.load_state_dict(sd, strict=True)


def _check_targets(targets: Tensor, input_ids: Tensor, vocab: int) -> None:
    if not isinstance(targets, Tensor) or targets.dtype.is_floating_point \
            or targets.dtype == torch.bool:
        raise TypeError("targets must be an integer tensor [B, T]")
    if targets.shape != input_ids.shape:
        raise ValueError(f"targets must have the shape of input_ids [B, T] = "
                         f"{tuple(input_ids.shape)}, got {tuple(targets.shape)}")
    if values_checked(targets):
        bad = (targets != -100) & ((targets < 0) | (targets >= vocab))
        if bool(bad.any()):
            raise ValueError(f"targets must be in [0, {vocab}) (vocab_size) or -100 "
                             f"(ignored), got values in [{int(targets.min())}, "
                             f"{int(targets.max())}]")


# --------------------------------------------------------------------------- classifier

class LinBnDrop(nn.Module):
    """fastai's ``LinBnDrop`` (``lin_first=False``): ``bn`` (``BatchNorm1d(n_in)``, weight 1,
    bias 1e-3) -> ``drop`` (Dropout(p), absent when p = 0) -> ``lin`` (``Linear(n_in,
    n_out, bias=False)``) -> ReLU if ``relu``. ``[N, n_in]`` -> ``[N, n_out]``."""

    def __init__(self, n_in: int, n_out: int, p: float, relu: bool) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(n_in)
        nn.init.ones_(self.bn.weight)
        nn.init.constant_(self.bn.bias, 1e-3)
        self.drop = nn.Dropout(p) if p != 0 else None
        self.lin = nn.Linear(n_in, n_out, bias=False)
        self.relu = relu

    def forward(self, x: Tensor) -> Tensor:
        x = self.bn(x)
        if self.drop is not None:
            x = self.drop(x)
        x = self.lin(x)
        return F.relu(x) if self.relu else x


def masked_concat_pool(output: Tensor, padding_mask: Tensor) -> Tensor:
    """Concat pooling over the non-padding positions: output ``[B, T, E]``, padding_mask
    bool ``[B, T]`` (True = padding) -> ``[B, 3E]`` = ``[output at the last non-padding
    position, max, mean]``. Padding may be anywhere; on fastai's layout (whole ``bptt``
    chunks of padding first, the remainder at the end) the last position is the one
    fastai's ``masked_concat_pool`` picks. Every row needs a non-padding position."""
    B, T, E = output.shape
    keep = ~padding_mask                                              # [B, T]
    lens = keep.sum(1)                                                # [B]
    pos = torch.arange(T, device=output.device).expand(B, T)          # [B, T]
    last = torch.where(keep, pos, torch.full_like(pos, -1)).amax(1)   # [B]
    last_h = output[torch.arange(B, device=output.device), last]      # [B, E]
    pad = padding_mask.unsqueeze(-1)                                  # [B, T, 1]
    max_pool = output.masked_fill(pad, float("-inf")).amax(1)         # [B, E]
    avg_pool = output.masked_fill(pad, 0.0).sum(1) / lens.unsqueeze(1).to(output.dtype)
    return torch.cat([last_h, max_pool, avg_pool], 1)                 # [B, 3E]


class PoolingLinearClassifier(nn.Module):
    """fastai's ``PoolingLinearClassifier``: concat pooling then ``layers`` (one
    :class:`LinBnDrop` per pair of ``dims``, ReLU after all but the last)."""

    def __init__(self, dims: List[int], ps: List[float]) -> None:
        super().__init__()
        if len(ps) != len(dims) - 1:
            raise ValueError(f"PoolingLinearClassifier: one dropout per layer: dims={dims}, "
                             f"ps={ps}")
        n = len(dims) - 1
        self.layers = nn.ModuleList([LinBnDrop(i, o, p, relu=k < n - 1)
                                     for k, (i, o, p) in enumerate(zip(dims[:-1], dims[1:], ps))])

    def forward(self, output: Tensor, padding_mask: Tensor) -> Tensor:
        """output ``[B, T, E]``, padding_mask ``[B, T]`` -> logits ``[B, n_class]``."""
        x = masked_concat_pool(output, padding_mask)                  # [B, 3E]
        for layer in self.layers:
            x = layer(x)
        return x


class AWDLSTMClassifier(nn.Module):
    """ULMFiT's classifier: :class:`AWDLSTM` over the whole text, then
    :class:`PoolingLinearClassifier` with ``dims = [3 * emb_sz, *lin_ftrs, n_class]`` and
    ``ps = [output_p, *lin_ps]`` (fastai's ``get_text_classifier``). Use
    ``CLASSIFIER_DROPOUTS`` for fastai's classifier dropouts."""

    def __init__(self, config: AWDLSTMConfig) -> None:
        super().__init__()
        self.encoder = AWDLSTM(config)
        self.config = config = self.encoder.config          # shared: set_backend updates both
        dims = [3 * config.emb_sz, *config.lin_ftrs, config.n_class]
        self.head = PoolingLinearClassifier(dims, [config.output_p, *config.lin_ps])

    @property
    def backend(self) -> str:
        return self.config.backend

    def set_backend(self, backend: str) -> "AWDLSTMClassifier":
        self.encoder.set_backend(backend)
        return self

    def reset(self) -> None:
        self.encoder.reset()

    def encode(self, input_ids: Tensor) -> Tensor:
        """The encoder over the whole text from a zero state, ``bptt`` tokens at a time
        (state carried, detached, between chunks): ``[B, T]`` -> ``[B, T, emb_sz]``."""
        self.encoder.reset()
        T = input_ids.shape[1] if isinstance(input_ids, Tensor) and input_ids.dim() == 2 else 0
        if T <= self.config.bptt:
            return self.encoder(input_ids)
        outs = [self.encoder(input_ids[:, i:i + self.config.bptt])     # [B, <= bptt, E]
                for i in range(0, T, self.config.bptt)]
        return torch.cat(outs, 1)                                      # [B, T, E]

    def forward(self, input_ids: Tensor, targets: Optional[Tensor] = None,
                padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """input_ids ``[B, T]`` -> (logits ``[B, n_class]``, loss or None).

        padding_mask: bool ``[B, T]``, True = padding (default: ``input_ids ==
        pad_token``); padding positions are run through the LSTMs (fastai runs those of a
        chunk that holds real tokens too, but skips chunks of padding alone: see the
        module docstring) and left out of the pooling. targets: ``[B]`` class ids; the loss is the mean
        cross-entropy. The encoder state is reset at every call.
        """
        cfg = self.config
        check_ids("input_ids", input_ids, cfg.vocab_size)
        if padding_mask is None:
            padding_mask = input_ids == cfg.pad_token
        elif not isinstance(padding_mask, Tensor) or padding_mask.dtype != torch.bool:
            raise TypeError("padding_mask must be a bool tensor [B, T] (True = padding)")
        elif padding_mask.shape != input_ids.shape:
            raise ValueError(f"padding_mask must have the shape of input_ids [B, T] = "
                             f"{tuple(input_ids.shape)}, got {tuple(padding_mask.shape)}")
        if values_checked(padding_mask) and bool(padding_mask.all(1).any()):
            raise ValueError("every sequence of input_ids needs at least one non-padding "
                             "token (a row is all padding)")
        if targets is not None:
            if not isinstance(targets, Tensor) or targets.dtype.is_floating_point \
                    or targets.dtype == torch.bool:
                raise TypeError("targets must be an integer tensor [B]")
            if tuple(targets.shape) != (input_ids.shape[0],):
                raise ValueError(f"targets must have shape [B] = [{input_ids.shape[0]}], got "
                                 f"{tuple(targets.shape)}")
            if values_checked(targets) and (int(targets.min()) < 0
                                            or int(targets.max()) >= cfg.n_class):
                raise ValueError(f"targets must be in [0, {cfg.n_class}) (n_class), got values "
                                 f"in [{int(targets.min())}, {int(targets.max())}]")
        out = self.encode(input_ids)                                  # [B, T, E]
        logits = self.head(out, padding_mask)                         # [B, n_class]
        loss = F.cross_entropy(logits, targets) if targets is not None else None
        return logits, loss

    @classmethod
    def from_fastai(cls, state_dict: Mapping[str, Tensor], **config) -> "AWDLSTMClassifier":
        """A model with the weights of a fastai ``get_text_classifier(AWD_LSTM, ...)`` state
        dict; sizes (``lin_ftrs``, ``n_class`` included) come from the tensors, the
        rest from `config` (give ``lin_ps``/``output_p``: the dropouts decide fastai's
        layer indices only, not the weights)."""
        sd, inferred = _from_fastai(state_dict, "classifier")
        inferred.setdefault("lin_ps", tuple(0.1 for _ in inferred["lin_ftrs"]))
        model = cls(AWDLSTMConfig(**{**inferred, **config}))
        model.load_state_dict(sd, strict=True)
        return model

    def load_fastai_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load a fastai text-classifier state dict (sizes must match this model)."""
        self.load_state_dict(_from_fastai(state_dict, "classifier")[0], strict=True)


# --------------------------------------------------------------------------- fastai checkpoints

def _from_fastai(state_dict: Mapping[str, Tensor], kind: str) -> Tuple[Dict[str, Tensor], dict]:
    """fastai keys -> ours, and the config fields the tensors determine.

    LM (``SequentialRNN(AWD_LSTM, LinearDecoder)``): ``0.<encoder>`` -> ``encoder.<...>``,
    ``1.decoder.*`` -> ``decoder.*``. Classifier (``SequentialRNN(SentenceEncoder,
    PoolingLinearClassifier)``): ``0.module.<encoder>`` -> ``encoder.<...>``,
    ``1.layers.{k}.0.*`` (BatchNorm) -> ``head.layers.{k}.bn.*``, the block's 2-D
    ``weight`` (index 1 or 2, after an optional Dropout) -> ``head.layers.{k}.lin.weight``.
    The LSTM keys of fastai v1 and v2 (and Salesforce's) are read by
    :func:`ctxfast.nn.load_awd_lstm`.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got "
                        f"{type(state_dict).__name__}")
    want = "0.module." if kind == "classifier" else "0."
    rnns = load_awd_lstm(state_dict, prefix=want)              # raises if absent
    emb_key = want + "encoder.weight"
    if emb_key not in state_dict:
        raise ValueError(f"fastai state dict: no embedding '{emb_key}'")
    emb = state_dict[emb_key]
    V, E = emb.shape
    sizes = [(m.input_size, m.hidden_size) for m in rnns]
    if any(m.bidirectional for m in rnns):
        raise ValueError("fastai state dict: bidirectional AWD-LSTM encoders are not supported")
    if sizes[0][0] != E or sizes[-1][1] != E:
        raise ValueError(f"fastai state dict: the first LSTM layer must take the embedding "
                         f"size {E} and the last must output it, got layers {sizes}")
    n_hid = sizes[0][1] if len(sizes) > 1 else E
    out: Dict[str, Tensor] = {"encoder.encoder.weight": emb,
                              "encoder.encoder_dp.emb.weight": emb}
    for k, m in enumerate(rnns):
        for name, t in m.state_dict().items():
            out[f"encoder.rnns.{k}.{name}"] = t
    inferred = dict(vocab_size=V, emb_sz=E, n_hid=n_hid, n_layers=len(sizes))
    if kind == "lm":
        if "1.decoder.weight" not in state_dict:
            raise ValueError("fastai language-model state dict: no '1.decoder.weight'")
        dec = state_dict["1.decoder.weight"]
        if tuple(dec.shape) != (V, E):
            raise ValueError(f"fastai state dict: 1.decoder.weight must have shape [{V}, {E}], "
                             f"got {tuple(dec.shape)}")
        out["decoder.weight"] = dec
        inferred["out_bias"] = "1.decoder.bias" in state_dict
        if inferred["out_bias"]:
            out["decoder.bias"] = state_dict["1.decoder.bias"]
        inferred["tie_weights"] = bool(torch.equal(dec, emb))
        return out, inferred
    # classifier head
    blocks: Dict[int, Dict[str, Tensor]] = {}
    for key, t in state_dict.items():
        parts = key.split(".")
        if len(parts) == 5 and parts[:2] == ["1", "layers"]:
            blocks.setdefault(int(parts[2]), {})[f"{parts[3]}.{parts[4]}"] = t
    if not blocks or sorted(blocks) != list(range(len(blocks))):
        raise ValueError("fastai classifier state dict: no '1.layers.<k>.<i>.*' head blocks "
                         "numbered from 0")
    dims = []
    for k in range(len(blocks)):
        b = blocks[k]
        lin = [n for n in ("1.weight", "2.weight") if n in b and b[n].dim() == 2]
        if len(lin) != 1 or "0.weight" not in b:
            raise ValueError(f"fastai classifier state dict: block {k} must be BatchNorm1d "
                             f"(index 0) and Linear (index 1 or 2), got keys {sorted(b)}")
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            if f"0.{name}" in b:
                out[f"head.layers.{k}.bn.{name}"] = b[f"0.{name}"]
        w = b[lin[0]]
        out[f"head.layers.{k}.lin.weight"] = w
        dims.append(tuple(w.shape))                         # (n_out, n_in)
    if dims[0][1] != 3 * E:
        raise ValueError(f"fastai classifier state dict: the head must take 3 * emb_sz = "
                         f"{3 * E} features, got {dims[0][1]}")
    inferred["lin_ftrs"] = tuple(d[0] for d in dims[:-1])
    inferred["n_class"] = dims[-1][0]
    return out, inferred


__all__ = ["AWDLSTMConfig", "AWDLSTM", "AWDLSTMLM", "AWDLSTMClassifier",
           "PoolingLinearClassifier", "LinBnDrop", "masked_concat_pool", "CLASSIFIER_DROPOUTS"]
