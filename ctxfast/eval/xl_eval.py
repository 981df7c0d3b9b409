"""``ctxfast xl-eval``: Transformer-XL evaluation with state reuse against a vanilla
Transformer that recomputes a sliding window for every token, at the same attention
length L (the comparison of the paper's Table 9).

One model, one set of weights (random by default, or ``--checkpoint``), one token stream
(``--text FILE``, byte- or char-level, or a deterministic built-in stream):

* **XL**: ``--batch`` parallel streams (the stream cut into that many contiguous parts, as
  the original evaluation does) in segments of ``--tgt-len`` tokens with ``mem_len = L -
  tgt_len`` cached hidden states per layer. The first ``ceil(mem_len / tgt_len)`` (at
  least one) segments fill the memory and warm up; the next ``--xl-segments`` are timed.
  The backends run interleaved, segment by segment, each with its own memory, so that
  their timings share the machine's moments (:func:`xl_log_probs_interleaved`).
* **vanilla**: for each sampled position p (``--vanilla-positions`` of them, evenly spread
  over the timed region), a full forward of the L tokens ending at p with no memory,
  keeping only the last prediction; ``--batch`` windows per forward. Positions before
  ``L - 1`` (shorter contexts) come from one causal forward of the stream's first L
  tokens (:func:`vanilla_log_probs`), which the timing never uses.

For each L and each model backend (``ctxfast``: the kernels of ``ctxfast.rel_attention``,
and in XL mode the memory's keys, values and projected position encodings kept from one
segment to the next instead of recomputed, ``TransformerXLConfig.reuse_kv``, off with
``--no-reuse-kv``; ``eager``: the original einsum + pad-and-view formulation, recomputing
them as the original code does) one row: ms per predicted
token in both modes, the speedup (vanilla / XL: the algorithmic gain), the kernel gain
(eager / ctxfast in the same mode) and the bits per token of both modes on the sampled
positions. Output: a table on the terminal, ``--json``, ``--plot`` (PNG) and ``--out DIR``
(all three).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import random
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _dispatch
from ..models.transformer_xl import TransformerXL, TransformerXLConfig

# Table 9 of the Transformer-XL paper: evaluation speedup over the vanilla model.
PAPER_SPEEDUPS: Tuple[Tuple[int, float], ...] = ((800, 363.0), (1800, 773.0), (2800, 1409.0),
                                                 (3800, 1874.0))
BACKENDS = ("ctxfast", "eager")
LEVELS = ("byte", "char")


# --------------------------------------------------------------------------- settings

@dataclass
class Settings:
    """What one run measures (the command line fills it; see :func:`defaults`)."""
    attn_lens: Tuple[int, ...]
    tgt_len: int
    batch: int                       # XL: parallel streams; vanilla: windows per forward
    xl_segments: int                 # timed XL segments per L (after the memory is full)
    vanilla_positions: int           # sampled positions per L
    model: TransformerXLConfig
    backends: Tuple[str, ...] = BACKENDS
    device: str = "cpu"
    dtype: str = "float32"
    level: str = "byte"
    text: Optional[str] = None       # path, or None for the built-in stream
    checkpoint: Optional[str] = None
    seed: int = 0
    quick: bool = False
    reuse_kv: bool = True            # ctxfast backend: keep the memory's keys and values


def quick_model(n_token: int) -> TransformerXLConfig:
    """The --quick model: 4 layers, d_model 128 (a few seconds per L on 2 CPU cores)."""
    return TransformerXLConfig(n_token=n_token, n_layer=4, n_head=4, d_model=128, d_head=32,
                               d_inner=512, dropout=0.0, dropatt=0.0)


def tiny_model(n_token: int) -> TransformerXLConfig:
    """2 layers, d_model 64: for smoke runs and tests."""
    return TransformerXLConfig(n_token=n_token, n_layer=2, n_head=2, d_model=64, d_head=32,
                               d_inner=128, dropout=0.0, dropatt=0.0)


def enwik8_model(n_token: int) -> TransformerXLConfig:
    """The paper's enwik8 shape: 12 layers, d_model 512, 8 heads of 64, d_inner 2048."""
    return TransformerXLConfig.enwik8(n_token=n_token, dropout=0.0, dropatt=0.0)


MODELS = {"enwik8": enwik8_model, "quick": quick_model, "tiny": tiny_model}


def defaults(device: str, quick: bool) -> dict:
    """Lengths and counts per device: the paper's lengths on a GPU, short ones on a CPU."""
    if device.startswith("cuda"):
        return dict(attn_lens=(800, 1800, 2800, 3800), tgt_len=128, batch=8, xl_segments=16,
                    vanilla_positions=64 if not quick else 32, model="enwik8")
    if quick:
        return dict(attn_lens=(64, 128, 256, 512), tgt_len=32, batch=4, xl_segments=48,
                    vanilla_positions=32, model="quick")
    return dict(attn_lens=(128, 256, 512, 1024, 2048), tgt_len=64, batch=4, xl_segments=16,
                vanilla_positions=16, model="quick")


# --------------------------------------------------------------------------- the stream

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "en", "or", "an", "is", "th",
              "qu", "ex", "ly", "de", "ph", "st", "ch")


def builtin_text(n_chars: int, seed: int = 0) -> str:
    """A deterministic pseudo-text of `n_chars` characters: words from a small syllable
    set with a skewed (Zipf-like) word distribution, punctuation and paragraphs, so a
    trained model would have something to learn; the same for a given seed everywhere."""
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
               for _ in range(400)]
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]
    parts: List[str] = []
    size, sentence = 0, 0
    while size < n_chars:
        word = rng.choices(lexicon, weights)[0]
        if sentence == 0:
            word = word.capitalize()
        sentence += 1
        sep = " "
        if sentence > rng.randint(4, 16):
            sep, sentence = rng.choice((". ", ". ", "! ", "? ", ".\n\n")), 0
        elif rng.random() < 0.08:
            sep = ", "
        parts.append(word + sep)
        size += len(word) + len(sep)
    return "".join(parts)[:n_chars]


def encode(text: str, level: str) -> Tuple[Tensor, int, str]:
    """-> (ids ``[N]`` int64, vocabulary size, description). byte: UTF-8 bytes, vocabulary
    256; char: the distinct characters, sorted, vocabulary their count."""
    if level == "byte":
        data = text.encode("utf-8")
        return torch.tensor(list(data), dtype=torch.long), 256, f"{len(data)} bytes"
    if level == "char":
        vocab = sorted(set(text))
        index = {ch: i for i, ch in enumerate(vocab)}
        return (torch.tensor([index[ch] for ch in text], dtype=torch.long), len(vocab),
                f"{len(text)} characters, {len(vocab)} distinct")
    raise ValueError(f"--level must be one of {LEVELS}, got {level!r}")


def stream_matrix(ids: Tensor, batch: int, length: int) -> Tensor:
    """The first ``batch * (length + 1)`` ids as ``batch`` contiguous streams, time-major
    ``[length + 1, batch]`` (position p of stream b predicts row p + 1)."""
    need = batch * (length + 1)
    if ids.numel() < need:
        raise ValueError(f"the token stream has {ids.numel()} tokens, {need} are needed")
    return ids[:need].view(batch, length + 1).t().contiguous()        # [length + 1, batch]


# --------------------------------------------------------------------------- the two modes

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Wall time of each step: CUDA events on a GPU (no host sync between steps),
    ``perf_counter`` on a CPU. :meth:`ms` (after the last step) syncs once."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list = []

    def start(self) -> None:
        self.marks.append([self._now(), None])

    def stop(self) -> None:
        self.marks[-1][1] = self._now()

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self) -> List[float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) for a, b in self.marks]
        return [1e3 * (b - a) for a, b in self.marks]


def _median(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return float("nan")
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


class Progress:
    """A plain-text progress bar on stderr (redrawn in place on a terminal; on a pipe only
    the final line of each phase is written)."""

    def __init__(self, enabled: bool = True, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label, self.total, self.done, self.t0, self.last = "", 1, 0, 0.0, 0.0

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.t0 = self.last = time.perf_counter()
        self._draw(force=True)

    def step(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def finish(self) -> None:
        self.done = self.total
        if self.enabled:
            self._draw(force=True)
            if self.tty:
                self.stream.write("\n")
            else:
                self.stream.write(f"{self.label}: done in {time.perf_counter() - self.t0:.1f} s\n")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.perf_counter()
        if not force and now - self.last < 0.1:
            return
        self.last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        el = now - self.t0
        eta = f" eta {el / frac - el:5.1f} s" if 0 < frac < 1 else ""
        self.stream.write(f"\r{self.label:<34} [{bar}] {self.done:>5}/{self.total:<5} "
                          f"{el:6.1f} s{eta}   ")
        self.stream.flush()


def xl_log_probs(model: TransformerXL, data: Tensor, tgt_len: int, mem_len: int, *,
                 time_from: int = 0, progress: Optional[Progress] = None
                 ) -> Tuple[Tensor, List[float], int]:
    """XL mode over ``data [n + 1, B]``: segments of `tgt_len` with `mem_len` of memory.

    Returns (log-probability of each next token ``[n, B]``, the milliseconds of each
    segment from number `time_from` on, tokens predicted per such segment (``tgt_len *
    B``; a shorter last segment is not timed)). The caller checked the ids."""
    return xl_log_probs_interleaved(model, data, tgt_len, mem_len, (model.backend,),
                                    time_from=time_from, progress=progress)[model.backend]


def xl_log_probs_interleaved(model: TransformerXL, data: Tensor, tgt_len: int, mem_len: int,
                             backends: Sequence[str], *, time_from: int = 0,
                             progress: Optional[Progress] = None
                             ) -> Dict[str, Tuple[Tensor, List[float], int]]:
    """:func:`xl_log_probs` for several model backends at once, segment by segment: each
    segment runs on every backend in turn (each with its own memory) before the next one,
    so that both backends' timings sample the same moments of a shared machine (one
    backend after the other, a busy spell lands on one of them and fakes a kernel gain or
    loss); the order alternates from segment to segment. Returns {backend: (log-probs,
    segment ms, tokens per timed segment)}; the model is left on the last backend."""
    model.reset_length(tgt_len, 0, mem_len)
    n, B = data.shape[0] - 1, data.shape[1]
    outs = {b: torch.empty(n, B, dtype=torch.float32, device=data.device) for b in backends}
    mems = {b: model.init_mems() for b in backends}
    timers = {b: StepTimer(data.device) for b in backends}
    with torch.no_grad():
        for si, s in enumerate(range(0, n, tgt_len)):
            timed = si >= time_from and s + tgt_len <= n
            x = data[s:s + tgt_len]                                       # [t, B]
            y = data[s + 1:s + 1 + x.shape[0]]                            # [t, B]
            order = backends if si % 2 == 0 else tuple(reversed(backends))  # no order bias
            for b in order:
                model.set_backend(b)
                if timed:
                    timers[b].start()
                logp, mems[b] = model.log_probs(x, *mems[b], validate=False)  # [t, B, V]
                outs[b][s:s + x.shape[0]] = logp.gather(2, y[..., None])[..., 0].float()
                if timed:
                    timers[b].stop()
            if progress is not None:
                progress.step()
    return {b: (outs[b], timers[b].ms(), tgt_len * B) for b in backends}


def vanilla_log_probs(model: TransformerXL, data: Tensor, attn_len: int,
                      positions: Sequence[Tuple[int, int]], batch: int, *,
                      progress: Optional[Progress] = None) -> Tuple[Tensor, List[float]]:
    """Vanilla mode: for each (position p, stream b), the log-probability of
    ``data[p + 1, b]`` from a forward of the window ``data[p - L + 1 : p + 1, b]`` with no
    memory (the last prediction only). Windows of the full length L run `batch` per
    forward; positions ``p < L - 1`` read one causal forward of ``data[:L]``.

    Returns (log-probs ``[len(positions)]``, milliseconds per predicted token of each
    forward over full windows)."""
    return vanilla_log_probs_interleaved(model, data, attn_len, positions, batch,
                                         (model.backend,), progress=progress)[model.backend]


def vanilla_log_probs_interleaved(model: TransformerXL, data: Tensor, attn_len: int,
                                  positions: Sequence[Tuple[int, int]], batch: int,
                                  backends: Sequence[str], *,
                                  progress: Optional[Progress] = None
                                  ) -> Dict[str, Tuple[Tensor, List[float]]]:
    """:func:`vanilla_log_probs` for several model backends, forward by forward: each
    batch of windows runs on every backend in turn (the order alternating) before the
    next, for the same reason as :func:`xl_log_probs_interleaved`. Returns {backend:
    (log-probs, ms per predicted token of each full-window forward)}; the model is left on
    the last backend."""
    L = attn_len
    outs = {b: torch.empty(len(positions), dtype=torch.float32, device=data.device)
            for b in backends}
    full = [(i, p, b) for i, (p, b) in enumerate(positions) if p >= L - 1]
    short = [(i, p, b) for i, (p, b) in enumerate(positions) if p < L - 1]
    offsets = torch.arange(L, device=data.device) - (L - 1)              # [L]: -(L-1) .. 0
    timers = {b: StepTimer(data.device) for b in backends}
    sizes: List[int] = []
    with torch.no_grad():
        if short:
            for be in backends:
                model.set_backend(be)
                logp, _ = model.log_probs(data[:L], validate=False)      # [L, B, V]
                for i, p, b in short:
                    outs[be][i] = logp[p, b, data[p + 1, b]].float()
        for ci, s in enumerate(range(0, len(full), batch)):
            chunk = full[s:s + batch]
            order = backends if ci % 2 == 0 else tuple(reversed(backends))  # no order bias
            for be in order:
                model.set_backend(be)
                timers[be].start()
                p = torch.tensor([c[1] for c in chunk], device=data.device)   # [nb]
                b = torch.tensor([c[2] for c in chunk], device=data.device)   # [nb]
                rows = p[None, :] + offsets[:, None]                          # [L, nb]
                windows = data[rows, b[None, :]]                              # [L, nb]
                logp, _ = model.log_probs(windows, last=1, validate=False)    # [1, nb, V]
                nxt = data[p + 1, b]                                          # [nb]
                outs[be][torch.tensor([c[0] for c in chunk], device=data.device)] = \
                    logp[0].gather(1, nxt[:, None])[:, 0].float()
                timers[be].stop()
            sizes.append(len(chunk))
            if progress is not None:
                progress.step()
    return {be: (outs[be], [ms / k for ms, k in zip(timers[be].ms(), sizes)])
            for be in backends}


def sample_positions(lo: int, hi: int, count: int, batch: int) -> List[Tuple[int, int]]:
    """`count` (position, stream) pairs spread evenly over positions ``[lo, hi]`` and
    round-robin over the `batch` streams."""
    if hi < lo:
        return []
    count = min(count, (hi - lo + 1) * batch)
    return [(lo + (k * (hi - lo + 1)) // count, k % batch) for k in range(count)]


# --------------------------------------------------------------------------- one run

def attention_impl(backend: str, device: torch.device, reuse_kv: bool = False) -> str:
    """What runs the attention for a model backend on `device` (for the table)."""
    if backend == "eager":
        return "original einsum + pad-and-view"
    impl = f"ctxfast.rel_attention [{_dispatch.resolve('rel_attention', device)}]"
    return impl + (" + K/V reuse" if reuse_kv else "")


def fill_segments(attn_len: int, tgt_len: int) -> int:
    """The untimed XL segments before the timed ones: until the memory (``mem_len =
    attn_len``) is full, and at least one (the warm-up)."""
    return max(1, math.ceil(attn_len / tgt_len))


def profile(model: TransformerXL, ids: Tensor, s: Settings,
            progress: Optional[Progress] = None) -> List[dict]:
    """Measure every (L, backend) of `s` on `model` over the stream `ids` -> rows."""
    device = next(model.parameters()).device
    rows: List[dict] = []
    model.eval()
    same_length, keep_mem = model.same_length, model.mem_len
    for L in s.attn_lens:
        # The paper's setting (its enwik8 / wt103 evaluation scripts: mem_len 3,800 / 1,600,
        # same_length): each XL query sees exactly L keys, as each vanilla prediction sees
        # the L tokens of its window. (mem_len = L - tgt_len before: an XL query saw
        # L - tgt_len + 1 .. L keys, L - tgt_len / 2 on average, an XL cost 1.05-1.5x too
        # low at the --quick lengths.)
        mem_len = L
        model.same_length = True
        fill = fill_segments(L, s.tgt_len)
        n = (fill + s.xl_segments) * s.tgt_len
        data = stream_matrix(ids, s.batch, n).to(device)      # [n + 1, batch]
        lo = fill * s.tgt_len                                  # first timed position
        positions = sample_positions(max(lo, L - 1), n - 1, s.vanilla_positions, s.batch)
        pos_p = torch.tensor([p for p, _ in positions], device=device)
        pos_b = torch.tensor([b for _, b in positions], device=device)
        per_backend: Dict[str, dict] = {}
        # XL mode: the backends interleaved segment by segment (same moments of the machine)
        if progress is not None:
            progress.start(f"L={L} {','.join(s.backends)}: XL", fill + s.xl_segments)
        xl_runs = xl_log_probs_interleaved(model, data, s.tgt_len, mem_len, s.backends,
                                           time_from=fill, progress=progress)
        if progress is not None:
            progress.finish()
        # vanilla: no memory, so no window inside the L tokens of a forward
        model.reset_length(s.tgt_len, 0, 0)
        # vanilla mode: warm-up (and on a GPU the windows per forward that fit) per backend,
        # then the backends interleaved forward by forward with the smallest such count
        n_fwd = math.ceil(len(positions) / s.batch)
        if progress is not None:
            progress.start(f"L={L} {','.join(s.backends)}: vanilla", n_fwd + 1)
        nb = s.batch
        for backend in s.backends:
            model.set_backend(backend)
            nb = _fitting_batch(model, data, L, positions, nb)
        if progress is not None:
            progress.step()
        van_runs = vanilla_log_probs_interleaved(model, data, L, positions, nb, s.backends,
                                                 progress=progress)
        if progress is not None:
            progress.finish()
        for backend in s.backends:
            model.set_backend(backend)
            impl = attention_impl(backend, device, model.config.reuse_kv)
            xl, xl_ms, xl_tok = xl_runs[backend]
            van, van_ms = van_runs[backend]
            xl_same = xl[pos_p, pos_b]
            row = dict(
                attn_len=L, backend=backend, attention=impl, device=_device_name(device),
                dtype=s.dtype, tgt_len=s.tgt_len, mem_len=mem_len, batch=s.batch,
                xl_tokens_timed=xl_tok * len(xl_ms), vanilla_positions=len(positions),
                vanilla_windows_per_forward=nb,
                # means (the time of every timed step over its tokens: a cost that comes
                # back every few segments, as the kept keys' buffer growing, counts; the
                # medians hid it: 1.41-1.53x the median at L 256 on a CPU); medians beside
                vanilla_ms_total=sum(m * k for m, k in zip(van_ms, _chunks(len(positions), nb))),
                xl_ms_total=sum(xl_ms),
                vanilla_ms_per_token_median=_median(van_ms),
                xl_ms_per_token_median=_median(xl_ms) / xl_tok,
                vanilla_bits_per_token=float(-van.mean() / math.log(2)),
                xl_bits_per_token=float(-xl_same.mean() / math.log(2)),
                xl_bits_per_token_all=float(-xl.mean() / math.log(2)),
                xl_tokens_evaluated=xl.numel(),
            )
            row["vanilla_ms_per_token"] = row["vanilla_ms_total"] / len(positions)
            row["xl_ms_per_token"] = row["xl_ms_total"] / row["xl_tokens_timed"]
            row["speedup"] = row["vanilla_ms_per_token"] / row["xl_ms_per_token"]
            per_backend[backend] = row
            rows.append(row)
        if "eager" in per_backend:
            e = per_backend["eager"]
            for row in per_backend.values():
                row["xl_kernel_speedup"] = e["xl_ms_per_token"] / row["xl_ms_per_token"]
                row["vanilla_kernel_speedup"] = (e["vanilla_ms_per_token"]
                                                 / row["vanilla_ms_per_token"])
                row["speedup_vs_eager_vanilla"] = e["vanilla_ms_per_token"] / row["xl_ms_per_token"]
    model.same_length = same_length
    model.reset_length(s.tgt_len, 0, keep_mem)
    return rows


def _fitting_batch(model: TransformerXL, data: Tensor, L: int,
                   positions: Sequence[Tuple[int, int]], batch: int) -> int:
    """Run one untimed vanilla forward of `batch` windows (the warm-up); on a GPU that runs
    out of memory, halve the windows per forward until it fits. Returns the count used."""
    while True:
        try:
            vanilla_log_probs(model, data, L, positions[:batch], batch)
            return batch
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2
            torch.cuda.empty_cache()


def _chunks(n: int, size: int) -> List[int]:
    return [min(size, n - i) for i in range(0, n, size)]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = torch.get_num_threads()
    return f"cpu ({n} thread{'s' if n != 1 else ''})"


# --------------------------------------------------------------------------- output

_COLUMNS = (("attn_len", "L", "{}"), ("backend", "backend", "{}"),
            ("attention", "attention", "{}"),
            ("vanilla_ms_per_token", "vanilla ms/tok", "{:.3f}"),
            ("xl_ms_per_token", "XL ms/tok", "{:.4f}"), ("speedup", "speedup", "{:.0f}x"),
            ("xl_kernel_speedup", "ctxfast gain XL", "{:.2f}x"),
            ("vanilla_kernel_speedup", "kernel gain vanilla", "{:.2f}x"),
            ("vanilla_bits_per_token", "bits/tok vanilla", "{:.3f}"),
            ("xl_bits_per_token", "bits/tok XL", "{:.3f}"),
            ("vanilla_positions", "vanilla positions", "{}"),
            ("xl_tokens_timed", "XL tokens timed", "{}"))


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    return "-" if v is None else fmt.format(v)


def table(rows: Sequence[dict], markdown: bool = False) -> str:
    """The rows as an aligned text table (or a markdown table)."""
    head = [h for _, h, _ in _COLUMNS]
    body = [[_cell(r, k, f) for k, _, f in _COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body]) + "\n"
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i not in (1, 2) else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]) + "\n"


def notes(meta: dict, width: int = 100) -> str:
    """What the table measured, as a wrapped paragraph."""
    m = meta
    text = (f"model: {m['model']}; stream: {m['stream']}; device: {m['device']}, {m['dtype']}; "
            f"XL: {m['batch']} parallel streams, segments of {m['tgt_len']} tokens, "
            f"mem_len = L with same_length (each query sees L keys, the paper's evaluation "
            f"setting), {m['xl_segments']} timed segments per L after the "
            f"memory is full; vanilla: a full forward of L tokens per prediction, "
            f"{m['batch']} windows per forward (fewer where a GPU runs out of memory: JSON "
            f"vanilla_windows_per_forward), {m['vanilla_positions']} sampled positions per "
            f"L (the same positions give both bits/tok columns). The backends run interleaved "
            f"(segment by segment, forward by forward). ms/tok: the timed steps' total time over "
            f"their tokens (medians in the JSON). speedup = vanilla / XL ms per token (same "
            f"backend): the algorithmic gain; ctxfast gain XL / kernel gain vanilla = eager / "
            f"ctxfast in the same mode"
            + (": in XL mode that is the kernels and the K/V reuse together (ctxfast keeps "
               "the memory's keys, values and position projections from segment to segment, "
               "where eager recomputes them as the original code; --no-reuse-kv for the "
               "kernels alone)" if m.get("reuse_kv") else ": the kernels alone")
            + ". Paper (Table 9, its own model and GPUs): "
            + ", ".join(f"{s:.0f}x at {L}" for L, s in PAPER_SPEEDUPS) + ".")
    if m.get("checkpoint") is None:
        text += (" Random weights: the model ignores most of its context, so the bits/tok "
                 "columns agreeing says little (give --checkpoint for meaningful ones); the "
                 "timings do not depend on the weights.")
    if m.get("cpu_busy") is not None and m["cpu_busy"] > 0.2 and "cpu" in m["device"]:
        text += (f" The CPUs were {m['cpu_busy']:.0%} busy with other work when this started: "
                 f"the timings are noisy.")
    return textwrap.fill(text, width) + "\n"


def plot(rows: Sequence[dict], path: Path, title: str = "") -> Optional[str]:
    """Speedup and ms/token against L (log scales), with the paper's points. Returns None
    when written, else why not (matplotlib missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}); skipping the plot"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for backend, marker, color in (("ctxfast", "o", "tab:blue"), ("eager", "s", "tab:orange")):
        rs = sorted((r for r in rows if r["backend"] == backend), key=lambda r: r["attn_len"])
        if not rs:
            continue
        Ls = [r["attn_len"] for r in rs]
        ax1.plot(Ls, [r["speedup"] for r in rs], marker=marker, color=color,
                 label=f"ours, {backend}")
        ax2.plot(Ls, [r["vanilla_ms_per_token"] for r in rs], marker=marker, color=color,
                 linestyle="--", label=f"vanilla, {backend}")
        ax2.plot(Ls, [r["xl_ms_per_token"] for r in rs], marker=marker, color=color,
                 label=f"XL, {backend}")
    ax1.plot([p[0] for p in PAPER_SPEEDUPS], [p[1] for p in PAPER_SPEEDUPS], "k*",
             markersize=10, label="paper (Table 9)")
    ax1.set(xscale="log", yscale="log", xlabel="attention length L",
            ylabel="speedup of XL over vanilla", title="evaluation speedup")
    ax2.set(xscale="log", yscale="log", xlabel="attention length L", ylabel="ms per token",
            title="time per predicted token")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- command line

def _positive_ints(flag: str):
    def parse(text: str) -> Tuple[int, ...]:
        try:
            vals = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers, got {text!r}")
        if not vals or any(v < 1 for v in vals):
            raise argparse.ArgumentTypeError(f"{flag} takes integers >= 1, got {text!r}")
        return vals
    return parse


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes an integer, got {text!r}")
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {v}")
        return v
    return parse


def _backends(text: str) -> Tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in vals if v not in BACKENDS]
    if len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"--backends: each backend once (one memory each), "
                                         f"got {text!r}")
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"--backends takes a comma-separated subset of "
                                         f"{','.join(BACKENDS)}, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ctxfast xl-eval",
        description="Transformer-XL evaluation with memory against a vanilla sliding window "
                    "at the same attention length L (the paper's Table 9), ctxfast kernels "
                    "and eager.")
    p.add_argument("--attn-lens", type=_positive_ints("--attn-lens"),
                   help="comma-separated attention lengths L (default: 800,1800,2800,3800 on a "
                        "GPU; 128..2048 on a CPU; 64..512 with --quick on a CPU)")
    p.add_argument("--tgt-len", type=_positive_int("--tgt-len"),
                   help="XL segment length (mem_len = L - tgt-len); default 128 GPU, 64 CPU, "
                        "32 --quick CPU")
    p.add_argument("--batch", type=_positive_int("--batch"),
                   help="XL: parallel streams; vanilla: windows per forward")
    p.add_argument("--xl-segments", type=_positive_int("--xl-segments"),
                   help="timed XL segments per L (after the memory is full)")
    p.add_argument("--vanilla-positions", type=_positive_int("--vanilla-positions"),
                   help="positions the vanilla mode evaluates per L (a sample: it is slow)")
    p.add_argument("--backends", type=_backends, default=BACKENDS,
                   help="model backends to run: ctxfast,eager (default both)")
    p.add_argument("--text", help="evaluate on this file instead of the built-in stream")
    p.add_argument("--level", choices=LEVELS, default="byte",
                   help="tokens of --text: UTF-8 bytes (vocabulary 256) or characters")
    p.add_argument("--checkpoint",
                   help="a state_dict (original Transformer-XL names) or {'config': {...}, "
                        "'state_dict': ...}; default: random weights")
    p.add_argument("--quick", action="store_true",
                   help="small model and short lengths (< 2 min on a 2-core CPU; the paper's "
                        "lengths with a smaller sample on a GPU)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--model", choices=tuple(MODELS),
                   help="model shape for random weights: enwik8 (12 layers, d_model 512), quick "
                        "(4 layers, d_model 128), tiny (2 layers, d_model 64); default: enwik8 "
                        "on a GPU, quick on a CPU")
    p.add_argument("--n-layer", type=_positive_int("--n-layer"), help="override the layer count")
    p.add_argument("--threads", type=_positive_int("--threads"),
                   help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-reuse-kv", action="store_true",
                   help="ctxfast backend: recompute the memory's keys, values and position "
                        "projections every segment, as the original code (default: kept "
                        "from the previous segment; TransformerXLConfig.reuse_kv)")
    p.add_argument("--json", dest="json_path", help="write the rows and settings as JSON here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--out", help="report folder: xl_eval.json, xl_eval.md, xl_eval.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _fail(parser: argparse.ArgumentParser, msg: str):
    parser.error(msg)          # exits with status 2 and the usage line


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser
                       ) -> Tuple[Settings, Tensor, str]:
    """Validate the flags -> (settings, token ids, stream description)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        _fail(parser, f"--device: unknown device {device!r}")
    if dev.type not in ("cpu", "cuda"):
        _fail(parser, f"--device must be cpu or cuda, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        _fail(parser, "--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    d = defaults(device, args.quick)
    attn_lens = args.attn_lens or d["attn_lens"]
    tgt_len = args.tgt_len or d["tgt_len"]
    if args.text is not None:
        path = Path(args.text)
        if not path.is_file():
            _fail(parser, f"--text: no such file: {args.text}")
        raw = path.read_bytes()
        if not raw:
            _fail(parser, "--text: the file is empty")
        if args.level == "char":
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                _fail(parser, f"--text: not UTF-8 ({e}); use --level byte")
    batch = args.batch or d["batch"]
    xl_segments = args.xl_segments or d["xl_segments"]
    fill = fill_segments(max(attn_lens), tgt_len)
    need = batch * ((fill + xl_segments) * tgt_len + 1)
    if args.text is None:
        text = builtin_text(need + 16, seed=args.seed)
        ids, vocab, what = encode(text, args.level)
        what = f"built-in pseudo-text (seed {args.seed}), {args.level}-level, {what}"
    elif args.level == "byte":
        ids, vocab, what = torch.tensor(list(raw), dtype=torch.long), 256, f"{len(raw)} bytes"
        what = f"{args.text}, byte-level, {what}"
    else:
        ids, vocab, what = encode(text, "char")
        what = f"{args.text}, char-level, {what}"
    if ids.numel() < need:
        _fail(parser, f"--text: {ids.numel()} tokens, but L={max(attn_lens)} with --tgt-len "
                      f"{tgt_len}, --batch {batch} and --xl-segments {xl_segments} needs "
                      f"{need}; use a longer file or lower those flags")
    if args.checkpoint is not None and not Path(args.checkpoint).is_file():
        _fail(parser, f"--checkpoint: no such file: {args.checkpoint}")
    shape = args.model or d["model"]
    model = MODELS[shape](vocab)
    if args.n_layer:
        model = replace(model, n_layer=args.n_layer)
    s = Settings(attn_lens=tuple(attn_lens), tgt_len=tgt_len, batch=batch,
                 xl_segments=xl_segments,
                 vanilla_positions=args.vanilla_positions or d["vanilla_positions"],
                 model=model, backends=tuple(args.backends), device=device, dtype=args.dtype,
                 level=args.level, text=args.text, checkpoint=args.checkpoint, seed=args.seed,
                 quick=args.quick, reuse_kv=not args.no_reuse_kv)
    return s, ids, what


def _unreadable(s: Settings) -> dict:
    """What a bare state_dict cannot say, from the --model preset (the paper's models are
    post-LN; mem_len is set per attention length by the evaluation itself)."""
    return dict(dropout=0.0, dropatt=0.0, pre_lnorm=s.model.pre_lnorm, mem_len=s.model.mem_len)


def _load_error(e: Exception) -> str:
    """The gist of torch.load's error: its type and first line (for the weights-only
    unpickler's, the line after "WeightsUnpickler error:", not the advice around it)."""
    lines = [ln.strip() for ln in str(e).split("WeightsUnpickler error:")[-1].splitlines()]
    lines = [ln for ln in lines if ln]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def load_model(s: Settings, vocab_needed: int) -> TransformerXL:
    """Random weights (seeded) of ``s.model``, or the checkpoint's."""
    if s.checkpoint is None:
        torch.manual_seed(s.seed)
        model = TransformerXL(s.model)
    else:
        try:
            obj = torch.load(s.checkpoint, map_location="cpu", weights_only=True)
        except Exception as e:  # a foreign file raises what its bytes lead to: UnpicklingError,
            # EOFError, KeyError, IndexError, UnicodeDecodeError, struct.error, RuntimeError, ...
            raise ValueError(f"--checkpoint: cannot read {s.checkpoint} as a PyTorch "
                             f"checkpoint ({_load_error(e)})") from e
        if isinstance(obj, dict) and "state_dict" in obj:
            if not isinstance(obj["state_dict"], dict):
                raise ValueError(f"--checkpoint: its 'state_dict' must be a dict of tensors, "
                                 f"got {type(obj['state_dict']).__name__}")
            cfg = obj.get("config")
            if isinstance(cfg, dict):
                try:
                    model = TransformerXL(TransformerXLConfig(**{**cfg, "dropout": 0.0,
                                                                 "dropatt": 0.0}))
                except TypeError as e:                  # an unknown field, a wrong type
                    raise ValueError(f"--checkpoint: its 'config' does not fit "
                                     f"TransformerXLConfig: {e}") from e
                model.load_state_dict(obj["state_dict"])
            else:
                model = TransformerXL.from_state_dict(obj["state_dict"], **_unreadable(s))
        elif isinstance(obj, dict):
            model = TransformerXL.from_state_dict(obj, **_unreadable(s))
        else:
            raise ValueError(f"--checkpoint: expected a state_dict or {{'config', 'state_dict'}}, "
                             f"got {type(obj).__name__}")
        if model.n_token < vocab_needed:
            raise ValueError(f"--checkpoint: the model has n_token={model.n_token} but the "
                             f"stream's ids go up to {vocab_needed - 1}")
    dtype = getattr(torch, s.dtype)
    model.config.reuse_kv = s.reuse_kv
    return model.to(device=s.device, dtype=dtype).eval()


def run(argv: Optional[Sequence[str]] = None) -> Tuple[List[dict], dict]:
    """Parse, measure, write. Returns (rows, meta). Torch's thread count is restored."""
    threads = torch.get_num_threads()
    try:
        return _run(argv)
    finally:
        torch.set_num_threads(threads)


def _run(argv: Optional[Sequence[str]]) -> Tuple[List[dict], dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    s, ids, what = settings_from_args(args, parser)
    busy = _cpu_busy()
    if args.threads:
        torch.set_num_threads(args.threads)
    elif s.device == "cpu" and busy is not None and busy > 0.5 and torch.get_num_threads() > 1:
        # Measured on the 2-core machines: with the cores taken by other work, OpenMP
        # threads waiting for each other make small ops 10-50x slower; one thread degrades
        # gracefully.
        torch.set_num_threads(1)
        print(f"ctxfast xl-eval: the CPUs are {busy:.0%} busy with other work: running on 1 "
              "thread (--threads N to choose); timings will be noisy", file=sys.stderr)
    elif s.device == "cpu" and busy is not None and busy > 0.2:
        print(f"ctxfast xl-eval: warning: the CPUs are {busy:.0%} busy with other work; "
              "timings will be noisy", file=sys.stderr)
    try:
        model = load_model(s, int(ids.max()) + 1)
    except (ValueError, RuntimeError, OSError) as e:
        _fail(parser, str(e) if str(e).startswith("--checkpoint") else f"--checkpoint: {e}")
    c = model.config
    meta = dict(
        date=_dt.datetime.now().isoformat(timespec="seconds"),
        device=_device_name(torch.device(s.device)),
        dtype=s.dtype, torch=torch.__version__, python=platform.python_version(),
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
        model=(f"Transformer-XL {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads of "
               f"{c.d_head}, d_inner {c.d_inner}, n_token {c.n_token}, "
               + ("random weights (seed %d)" % s.seed if s.checkpoint is None
                  else f"checkpoint {s.checkpoint}")),
        stream=what, tgt_len=s.tgt_len, batch=s.batch, xl_segments=s.xl_segments,
        vanilla_positions=s.vanilla_positions, attn_lens=list(s.attn_lens),
        backends=list(s.backends), quick=s.quick, model_config=asdict(c), reuse_kv=s.reuse_kv,
        cpu_busy=busy, threads=torch.get_num_threads(), checkpoint=s.checkpoint,
    )
    progress = Progress(enabled=not args.no_progress)
    t0 = time.perf_counter()
    rows = profile(model, ids, s, progress)
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    print(table(rows), end="")
    print(notes(meta), end="")
    print(f"(measured in {meta['seconds']} s)")
    outs = []
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        outs.append(("json", out / "xl_eval.json"))
        outs.append(("md", out / "xl_eval.md"))
        outs.append(("png", out / "xl_eval.png"))
    if args.json_path:
        outs.append(("json", Path(args.json_path)))
    if args.plot:
        outs.append(("png", Path(args.plot)))
    for kind, path in outs:
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "json":
            path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        elif kind == "md":
            path.write_text(f"# ctxfast xl-eval, {meta['date']}\n\n" + table(rows, markdown=True)
                            + "\n" + notes(meta))
        else:
            why = plot(rows, path, title=f"{meta['model']}; {meta['device']}")
            if why is not None:
                print(f"ctxfast xl-eval: {why}", file=sys.stderr)
                continue
        print(f"wrote {path}")
    return rows, meta


def _cpu_busy(interval_s: float = 0.3) -> Optional[float]:
    """Fraction of the CPUs busy with other work over `interval_s` (from /proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)
    try:
        t0, i0 = sample()
        time.sleep(interval_s)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return None if t1 <= t0 else round(1.0 - (i1 - i0) / (t1 - t0), 3)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ctxfast xl-eval``: 0 on success (argument errors exit with status 2)."""
    run(argv)
    return 0


__all__ = ["PAPER_SPEEDUPS", "Settings", "builtin_text", "encode", "stream_matrix",
           "xl_log_probs", "xl_log_probs_interleaved", "vanilla_log_probs",
           "vanilla_log_probs_interleaved", "sample_positions", "profile", "table",
           "plot", "run", "main", "Progress"]
