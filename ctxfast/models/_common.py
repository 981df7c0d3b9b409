"""Pieces shared by the reference models: the backend switch, a language model's decoder
(:func:`lm_decoder`), one multi-head self-attention layer (padded or packed), the feed-forward
block, the kept keys and values of evaluation with memory, and input checks.

``backend="ctxfast"`` runs attention through :func:`ctxfast.attention` /
:func:`ctxfast.attention_varlen` (whichever implementation ctxfast's dispatch picks: the
``backend=`` keyword of the ops is left unset, so ``with ctxfast.backend("triton"):`` or
``CTXFAST_BACKEND`` choose it); ``backend="eager"`` runs the same computation on the
ops' eager backend (:func:`ctxfast.reference.attention`, plain PyTorch): "eager" means
plain PyTorch, no ctxfast kernel, for ops and models alike (docs/ARCHITECTURE.md). Everything else in the
models (embeddings, LayerNorm, feed-forward) is ordinary PyTorch in both.
"""
import threading
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from .. import ops
from ..ops._common import values_checked

MODEL_BACKENDS = ("ctxfast", "eager")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


def model_output(cls):
    """A model's output class, a dataclass, registered as a pytree node (as torch
    registers its own outputs), so that ``torch.export`` (and anything that flattens
    outputs: torch.utils._pytree, torch.func) sees the tensors in it; unregistered,
    ``torch.export.export`` of the model failed on the output's type."""
    torch.export.register_dataclass(cls, serialized_type_name=f"{cls.__module__}.{cls.__name__}")
    return cls


def check_backend(backend: str) -> str:
    if backend not in MODEL_BACKENDS:
        raise ValueError(f"backend must be one of {MODEL_BACKENDS}, got {backend!r}")
    return backend


def check_fields(config, *, positive=(), non_negative=(), optional_positive=(),
                 optional_non_negative=(), drop_rates=(), attn_rates=()) -> None:
    """ValueError naming the config class and field unless every field of each group holds:
    ints ``>= 1`` / ``>= 0`` (the optional ones may be None), dropout rates in ``[0, 1]``
    (``nn.Dropout``'s range; None passes) and attention dropout rates in ``[0, 1)`` (the ops
    refuse 1), so that a bad config fails when it is built, not at the first training step
    (or never: a negative memory length ran, read two ways)."""
    cls = type(config).__name__

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)
    for names, least, optional in ((positive, 1, False), (non_negative, 0, False),
                                   (optional_positive, 1, True),
                                   (optional_non_negative, 0, True)):
        for name in names:
            v = getattr(config, name)
            if not (optional and v is None) and not (is_int(v) and v >= least):
                raise ValueError(f"{cls}.{name} must be an int >= {least}"
                                 f"{' or None' if optional else ''}, got {v!r}")
    for names, top, closed in ((drop_rates, 1.0, True), (attn_rates, 1.0, False)):
        for name in names:
            v = getattr(config, name)
            if v is None:
                continue
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v and (
                v <= top if closed else v < top)
            if not ok:
                raise ValueError(f"{cls}.{name} must be a probability in [0, 1"
                                 f"{']' if closed else ')'}, got {v!r}")


def check_tied_entries(model: nn.Module, state_dict, where: str) -> None:
    """ValueError where `model` ties two parameter names (one parameter) for which
    `state_dict` holds different tensors: a strict ``load_state_dict`` would load both into
    the one parameter and keep whichever came last (an untied checkpoint into a model built
    tied)."""
    names_of: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for names in names_of.values():
        present = [n for n in names if n in state_dict]
        for n in present[1:]:
            a, b = state_dict[present[0]], state_dict[n]
            if a.shape != b.shape or not torch.equal(a, b):
                raise ValueError(f"{where}: the model ties {present[0]} and {n} (one "
                                 "parameter), but the state_dict holds different tensors for "
                                 "them: build the model untied to load it")


def lm_decoder(in_features: int, vocab_size: int, bias: bool, backend: str) -> nn.Linear:
    """A language model's decoder ``[..., in_features] -> [..., vocab_size]``: an
    ``nn.Linear`` on ``ctxfast.linear`` (:class:`ctxfast.nn.Linear`; float32 on the tensor
    cores at float32's accuracy where its dispatch takes Triton), ctxfast's dispatch choosing
    for the ctxfast backend, ``F.linear`` for eager. Its parameters are nn.Linear's."""
    from ..nn.linear import Linear
    return Linear(in_features, vocab_size, bias=bias,
                  backend=None if backend == "ctxfast" else "eager")


def activation(name: str, x: Tensor) -> Tensor:
    """``gelu`` (erf, BERT and GPT-1), ``gelu_tanh`` (GPT-2's ``gelu_new``) or ``relu``."""
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


# --------------------------------------------------------------------------- attention

def attend(q: Tensor, k: Tensor, v: Tensor, *, backend: str, causal: bool = False,
           key_padding_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
           scale: Optional[float] = None) -> Tensor:
    """q ``[B, H, Tq, D]``, k, v ``[B, H, Tk, D]`` -> ``[B, H, Tq, D]``; causal is
    bottom-right aligned (keys are ``[cache; new]``), ``key_padding_mask`` bool ``[B, Tk]``
    with True = padding. ``backend="eager"`` is the op's eager backend (the reference,
    with its dropout), so the models carry no copy of it."""
    return ops.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                         dropout_p=dropout_p, scale=scale,
                         backend="eager" if backend == "eager" else None)


def attend_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *,
                  backend: str, causal: bool = False, dropout_p: float = 0.0,
                  scale: Optional[float] = None) -> Tensor:
    """Packed self-attention: q, k, v ``[total, H, D]``, sequence ``b`` is rows
    ``cu_seqlens[b]:cu_seqlens[b+1]`` -> ``[total, H, D]`` (eager: the op's eager backend,
    one reference call per sequence)."""
    return ops.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                causal=causal, dropout_p=dropout_p, scale=scale,
                                backend="eager" if backend == "eager" else None)


#: Held while :meth:`KVMemory.extend` decides whether it may write after a buffer's
#: frontier and claims the rows (a few comparisons; the copy runs after, outside it).
_EXTEND_LOCK = threading.Lock()


class KVMemory:
    """Keys and values ``k, v [B, H, L, d_head]`` of a layer's memory rows, kept from one
    call to the next (K/V reuse in Transformer-XL's and XLNet's evaluation), as rows
    ``[start, end)`` of row buffers ``[B, H, capacity, d_head]`` with room after them.

    :meth:`extend` puts the next call's rows after them: in place when these rows end
    where the buffer's written rows end (its ``frontier``) and the room suffices, else in a
    new buffer with ``max(8 · rows, 128)`` rows of room (so the memory, which moves on by
    the new rows every call, is copied about once in 8 calls: the copy of ``[mems;
    current]`` that a concatenation makes every call, amortised). Rows past the frontier
    belong to no view, so writing there changes no kept value, and a memory that is
    extended twice (a branch from an older memory) gets its own buffer the second time.
    Built without buffers (``KVMemory(k, v)``: views of a projection) it copies on its
    first :meth:`extend`."""

    __slots__ = ("k", "v", "_buf")

    def __init__(self, k: Tensor, v: Tensor, buf: Optional[list] = None) -> None:
        self.k, self.v = k, v                                  # [B, H, L, Dh] each
        self._buf = buf        # [k_rows, v_rows, frontier] with k = k_rows[:, :, start:end]

    def _span(self) -> Optional[Tuple[int, int]]:
        """(start, end) of these rows in the buffer, or None without one."""
        if self._buf is None:
            return None
        start = (self.k.storage_offset() - self._buf[0].storage_offset()) // self.k.stride(2)
        return start, start + self.k.shape[2]

    def extend(self, k_new: Tensor, v_new: Tensor, room: Optional[int] = None) -> "KVMemory":
        """These rows followed by ``k_new, v_new [B, H, Q, d_head]``; a new buffer, where
        one is needed, gets ``room`` rows of room (default ``max(min(8 · Q, n), 128)``,
        n the rows it then holds: at most about twice them, and a copy of the kept rows
        every ``room / Q`` calls, ~Q rows a call)."""
        ks = self.k.shape
        if k_new.dim() != 4 or k_new.shape[:2] != ks[:2] or k_new.shape[3] != ks[3] \
                or v_new.shape != k_new.shape:
            raise ValueError(f"KVMemory.extend: k_new and v_new must have shape [B, H, Q, "
                             f"d_head] = [{ks[0]}, {ks[1]}, Q, {ks[3]}] to follow the kept rows, "
                             f"got {list(k_new.shape)} and {list(v_new.shape)}")
        span, q = self._span(), k_new.shape[2]
        if span is not None:
            kb, vb = self._buf[0], self._buf[1]
            # The rows after the frontier are claimed before the copy, under a lock: a
            # second thread extending the same memory meanwhile (two requests on one
            # prefix) finds them taken and copies into a new buffer. (Checked and then
            # written, two threads both wrote the same rows: each branch got the other's.)
            with _EXTEND_LOCK:
                frontier = self._buf[2]
                fits = (span[1] == frontier and frontier + q <= kb.shape[2]
                        and kb.dtype == k_new.dtype and kb.device == k_new.device
                        and kb.shape[:2] == k_new.shape[:2])
                if fits:
                    self._buf[2] = frontier + q
            if fits:
                kb[:, :, frontier:frontier + q].copy_(k_new)
                vb[:, :, frontier:frontier + q].copy_(v_new)
                return KVMemory(kb[:, :, span[0]:frontier + q], vb[:, :, span[0]:frontier + q],
                                self._buf)
        m, (B, H, _, D) = self.k.shape[2], k_new.shape
        n = m + q
        room = max(min(8 * q, n), 128) if room is None else room
        kb = k_new.new_empty((B, H, n + room, D))                  # [B, H, capacity, Dh]
        vb = v_new.new_empty((B, H, n + room, D))
        for buf, old, new in ((kb, self.k, k_new), (vb, self.v, v_new)):
            buf[:, :, :m].copy_(old)
            buf[:, :, m:n].copy_(new)
        return KVMemory(kb[:, :, :n], vb[:, :, :n], [kb, vb, n])

    def rows(self, beg: int, end: int) -> "KVMemory":
        """Rows ``beg:end`` of these (the same buffer)."""
        return KVMemory(self.k[:, :, beg:end], self.v[:, :, beg:end], self._buf)


def reuse_allowed(on: bool, backend: str, like: Tensor, weight: Tensor) -> bool:
    """Whether a model call may keep and reuse keys and values (K/V reuse): asked for
    (``on``), the ctxfast backend, no gradient (weight gradients need every row), not traced
    by torch.compile, and no inference tensors (they carry no version counter to check)."""
    return (on and backend != "eager" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and not like.is_inference()
            and not weight.is_inference())


def reuse_key(like: Tensor, what: tuple, params) -> tuple:
    """What a kept value was computed from besides its memory tensor: ``what`` (which value
    and its shape-giving numbers), the dtype and autocast state of the call, and the
    weights ``params`` by identity, address, version (an optimizer step, a load or any
    in-place change moves it) and storage. The storage by a weak reference, which keeps
    the storage's record (not its data) from being reused: a weight rebound to another
    tensor (``p.data = t``, ``.half().float()``, ``vector_to_parameters``) keeps its version,
    and two rebindings can bring it back to its old address (the allocator reuses freed
    blocks) with other values; its storage then differs."""
    dev = like.device.type
    amp = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    return (what, like.dtype, amp,
            tuple((id(p), p.data_ptr(), p._version, StorageWeakRef(p.untyped_storage()))
                  for p in params if p is not None))


def attach(mem: Tensor, name: str, key: tuple, value) -> None:
    """Keep ``value`` with the memory tensor ``mem`` (a Python attribute: it lives and
    dies with the tensor), valid while ``key`` and ``mem``'s version are unchanged."""
    setattr(mem, name, (key, mem._version, value))


def attached(mem: Optional[Tensor], name: str, key: tuple):
    """The value :func:`attach` kept with ``mem`` under ``key``, or None: no memory, none
    kept (a memory the caller built or copied), another key (weights changed, another
    dtype or autocast state), or ``mem`` changed in place since (its version moved on)."""
    got = getattr(mem, name, None) if mem is not None else None
    if got is None or got[0] != key or mem.is_inference() or got[1] != mem._version:
        return None
    return got[2]


class KVCache:
    """Keys and values of the tokens seen so far, one ``(k, v)`` pair ``[B, H, T, D]`` per
    layer, for decoding one step at a time. ``length`` is T (0 when empty).

    Without gradients each layer's pairs are the views of a :class:`KVMemory` whose
    buffer doubles when full: a step writes its rows after the others in place, instead
    of copying the whole cache every token (a concatenation per step made decoding T
    tokens cost O(T²) copies), and the views an earlier step handed out never change.
    With gradients (or under torch.compile) a step concatenates, which autograd and the
    compiler follow."""

    def __init__(self, n_layer: int) -> None:
        self.layers: List[Optional[Tuple[Tensor, Tensor]]] = [None] * n_layer
        self._mems: List[Optional[KVMemory]] = [None] * n_layer

    @property
    def length(self) -> int:
        kv = self.layers[0]
        return 0 if kv is None else kv[0].shape[2]

    def check_batch(self, B: int, layer: Optional[int] = None) -> None:
        """ValueError unless the cache (its `layer`, or every layer) is empty or holds ``B``
        sequences: a cache belongs to one batch (``reset()`` it for another)."""
        for kv in self.layers if layer is None else [self.layers[layer]]:
            if kv is not None and kv[0].shape[0] != B:
                raise ValueError(f"KVCache holds a batch of B={kv[0].shape[0]} sequences but "
                                 f"the input has B={B}; reset() the cache (or use a new one) "
                                 f"for another batch")

    def update(self, layer: int, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """Append the new ``k, v [B, H, t, D]``; returns all keys and values ``[B, H, T+t, D]``."""
        self.check_batch(k.shape[0], layer)
        past = self.layers[layer]
        graph = torch.is_grad_enabled() and any(
            x.requires_grad for x in (k, v, *(past or ())))
        if graph or torch.compiler.is_compiling():
            self._mems[layer] = None
            if past is not None:
                k = torch.cat([past[0], k], 2)               # [B, H, T + t, D]
                v = torch.cat([past[1], v], 2)
            self.layers[layer] = (k, v)
            return k, v
        mem = self._mems[layer]
        if mem is None or past is None or mem.k is not past[0]:   # none, or set from outside
            mem = KVMemory(*past) if past is not None else KVMemory(k[:, :, :0], v[:, :, :0])
        T = mem.k.shape[2] + k.shape[2]
        mem = self._mems[layer] = mem.extend(k, v, room=max(T, 64))   # room: doubling
        self.layers[layer] = (mem.k, mem.v)
        return self.layers[layer]

    def reset(self) -> None:
        self.layers = [None] * len(self.layers)
        self._mems = [None] * len(self.layers)


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused q/k/v projection.

    ``qkv``: ``Linear(D, 3D)``, output columns ``[q | k | v]``, each split into H heads of
    ``D / H``; ``proj``: ``Linear(D, D)``. Dropout on the attention probabilities
    (``attn_dropout``) and on the output (``resid_dropout``).
    """

    def __init__(self, n_embd: int, n_head: int, *, bias: bool = True, attn_dropout: float = 0.0,
                 resid_dropout: float = 0.0, scale: Optional[float] = None,
                 backend: str = "ctxfast") -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = attn_dropout
        self.resid_dropout = nn.Dropout(resid_dropout)
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.backend = check_backend(backend)

    def forward(self, x: Tensor, *, causal: bool = False,
                key_padding_mask: Optional[Tensor] = None,
                cache: Optional[KVCache] = None, layer: int = 0) -> Tensor:
        """x ``[B, T, D]`` -> ``[B, T, D]``. With `cache`, x holds only the new tokens and
        attends to the cached ones too (causal stays bottom-right aligned)."""
        B, T, C = x.shape
        H, Dh = self.n_head, self.head_dim
        # [B, T, 3D] -> [B, T, 3, H, Dh] -> [3, B, H, T, Dh]
        q, k, v = self.qkv(x).view(B, T, 3, H, Dh).permute(2, 0, 3, 1, 4).unbind(0)
        if cache is not None:
            k, v = cache.update(layer, k, v)                 # [B, H, T_cache + T, Dh]
        p = self.attn_dropout if self.training else 0.0
        y = attend(q, k, v, backend=self.backend, causal=causal,
                   key_padding_mask=key_padding_mask, dropout_p=p, scale=self.scale)
        y = y.transpose(1, 2).reshape(B, T, C)               # [B, H, T, Dh] -> [B, T, D]
        return self.resid_dropout(self.proj(y))

    def forward_packed(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int, *,
                       causal: bool = False) -> Tensor:
        """x ``[total, D]`` (packed sequences, see :func:`pack`) -> ``[total, D]``."""
        N, C = x.shape
        H, Dh = self.n_head, self.head_dim
        # [total, 3D] -> [total, 3, H, Dh] -> 3 x [total, H, Dh]
        q, k, v = self.qkv(x).view(N, 3, H, Dh).unbind(1)
        p = self.attn_dropout if self.training else 0.0
        y = attend_varlen(q, k, v, cu_seqlens, max_seqlen, backend=self.backend, causal=causal,
                          dropout_p=p, scale=self.scale)
        y = y.reshape(N, C)                                  # [total, H, Dh] -> [total, D]
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """``fc: Linear(D, 4D)`` -> activation -> ``proj: Linear(4D, D)`` -> dropout."""

    def __init__(self, n_embd: int, n_inner: int, *, act: str = "gelu", bias: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {act!r}")
        self.act = act
        self.fc = nn.Linear(n_embd, n_inner, bias=bias)
        self.proj = nn.Linear(n_inner, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(activation(self.act, self.fc(x))))


# --------------------------------------------------------------------------- packing

def pack(x: Tensor, keep: Tensor) -> Tuple[Tensor, Tensor, Tensor, int]:
    """Drop the padding of a batch: x ``[B, T, D]``, keep bool ``[B, T]`` (True = token) ->
    (``x_packed [total, D]``, ``indices [total]`` into ``B*T``, ``cu_seqlens`` int32
    ``[B + 1]``, ``max_seqlen``). Tokens keep their order; padding may be anywhere."""
    B, T, C = x.shape
    indices = keep.reshape(-1).nonzero().squeeze(1)          # [total]
    seqlens = keep.sum(1, dtype=torch.int32)                 # [B]
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))  # [B + 1]
    max_seqlen = int(seqlens.max()) if B > 0 else 0          # one host sync
    return x.reshape(B * T, C)[indices], indices, cu_seqlens, max_seqlen  # [B*T, D] -> [total, D]


def unpack(x: Tensor, indices: Tensor, B: int, T: int) -> Tensor:
    """Inverse of :func:`pack`: ``[total, D]`` -> ``[B, T, D]`` with zeros at padding."""
    C = x.shape[-1]
    out = x.new_zeros(B * T, C).index_copy(0, indices, x)   # [B*T, D]
    return out.view(B, T, C)                                 # [B*T, D] -> [B, T, D]


# --------------------------------------------------------------------------- checks

def check_device(name: str, t: Tensor, device: torch.device) -> None:
    """`t` (argument `name`) is on the model's `device`, else ValueError: an embedding
    lookup of ids on the meta device returns uninitialised values, not an error."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the model on {device}")


def check_ids(name: str, ids: Tensor, vocab: int, max_len: Optional[int] = None,
              what: str = "vocab_size", device: Optional[torch.device] = None) -> None:
    """A ``[B, T]`` integer tensor with values in ``[0, vocab)`` and ``T <= max_len``
    (positions left; None = no limit), on ``device`` (the model's; None = not checked).
    Raises before anything runs."""
    if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool \
            or ids.dtype.is_complex:
        raise TypeError(f"{name} must be an integer tensor [B, T], got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() != 2:
        raise ValueError(f"{name} must have shape [B, T], got {tuple(ids.shape)}")
    if device is not None:
        check_device(name, ids, device)
    if max_len is not None and ids.shape[1] > max_len:
        raise ValueError(f"{name} has length T={ids.shape[1]} but only {max_len} positions "
                         f"are left (n_positions minus cached tokens)")
    if values_checked(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{name} must be in [0, {vocab}) ({what}), got values in "
                             f"[{lo}, {hi}]")


def check_labels(name: str, labels: Optional[Tensor], shape: tuple, n: int,
                 device: Optional[torch.device] = None) -> None:
    """None, or an integer tensor of ``shape`` with values in ``[0, n)`` or -100 (ignored),
    on ``device`` (None = not checked): the targets of a cross-entropy over ``n`` classes."""
    if labels is None:
        return
    if not isinstance(labels, Tensor) or labels.dtype.is_floating_point \
            or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor {list(shape)}")
    if tuple(labels.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(labels.shape)}")
    if device is not None:
        check_device(name, labels, device)
    if values_checked(labels):
        bad = (labels != -100) & ((labels < 0) | (labels >= n))
        if bool(bad.any()):
            raise ValueError(f"{name} must be in [0, {n}) or -100 (ignored), got "
                             f"{labels[bad][0].item()}")


def check_sampling(max_new_tokens: object, temperature: float, top_k: object) -> None:
    """The arguments of a model's ``generate()``; ValueError naming the bad one."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")


def next_token(logits: Tensor, temperature: float, top_k: Optional[int],
               generator: Optional[torch.Generator] = None) -> Tensor:
    """Pick the next token from ``logits [B, V]``: argmax when temperature is 0, else a
    sample from softmax(logits / temperature) restricted to the top_k most likely.
    Returns ``[B, 1]``."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)                       # [B, 1]
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]   # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # [B, 1]


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2/BERT initialisation: normal(0, std) weights, zero biases, unit LayerNorm."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, 0.0, std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, std)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


__all__ = ["MODEL_BACKENDS", "check_backend", "attend", "attend_varlen", "KVCache",
           "KVMemory", "attach", "attached", "reuse_allowed", "reuse_key",
           "SelfAttention", "MLP", "pack", "unpack", "check_device", "check_ids",
           "check_labels", "init_weights"]
