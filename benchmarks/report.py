"""Run the benchmarks and write the report:
``benchmarks/results/<device>/<date>.json``, ``<date>.md`` and ``<date>-<op>.png``.

Usage (``ctxfast bench`` calls :func:`main`)::

    python benchmarks/report.py --quick                # small cases, minutes on a CPU
    python benchmarks/report.py --ops rel_shift --out /tmp/bench
    python benchmarks/report.py --list                 # the op families found

The op families are the ``benchmarks/bench_<op>.py`` files present (:func:`available_ops`);
the suite interface they follow is at the top of ``_common.py``. Each suite is a
pytest-benchmark suite whose benchmarks carry ``extra_info`` = {op, case, mode, backend,
dtype, device, ...}; every backend of an op is timed next to the op's baseline
(:data:`BASELINES`, else the suite's ``extra_info["baseline"]``) on the same inputs in
the same run. This module runs each suite in its own pytest subprocess (a suite that fails
to import or run costs its own records only), pairs each backend with the baseline of the
same (op, case, mode, dtype, device) and writes one record per pair, keys
:data:`RECORD_KEYS`:

* ``ms``: median milliseconds per call (``_common.measure``: CUDA events on a GPU);
  ``ms_min``, ``ms_max`` over all timed rounds; ``spread``/``baseline_spread``: relative
  difference of two timing passes of the same code (noise); ``speedup = baseline_ms / ms``
  (> 1: faster than the baseline).
* ``tflops`` = suite's ``flops`` / time; ``gbps`` = suite's ``min_bytes`` / time (the
  least traffic the op needs: for memory-bound ops such as rel_shift). None where the
  suite gives no count.
* ``tokens_per_s`` / ``baseline_tokens_per_s`` = suite's ``tokens`` (token positions one
  call processes, e.g. B·T of a training step) / time of the backend / of the baseline;
  None where the suite gives no ``tokens`` (the op suites). The markdown shows them in a
  "tokens/s" column when any record has them.
* ``peak_mem_bytes``, ``baseline_peak_mem_bytes``: peak CUDA memory of one call beyond
  its inputs; None on the CPU (not measured there).
* ``note``: "OOM: ..." where the backend ran out of memory (``ms`` None), "baseline
  OOM: ..." where the baseline did (``baseline_ms`` None), "no baseline" where the
  baseline was not timed.
* ``T``, ``series``: the x value and line of the speedup plot (``plot.py``).

This file is loaded by path (``benchmarks/`` is not an installed package), so it uses no
relative import; ``_common.py`` and ``plot.py`` next to it are loaded by path too.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

#: The baseline backend of each op: what every other backend's speedup is measured
#: against. One line per op; a suite may instead name it in ``extra_info["baseline"]``.
BASELINES: Dict[str, str] = {
    "rel_shift": "eager-pad-view",
    "attention": "eager",
    "rel_attention": "eager-original",
    "lstm": "nn.LSTM+WeightDropout",
    "linear": "eager",
}

#: Keys of one record, in order.
RECORD_KEYS: Tuple[str, ...] = (
    "op", "case", "mode", "backend", "baseline", "ms", "baseline_ms", "speedup",
    "tflops", "gbps", "tokens_per_s", "baseline_tokens_per_s", "peak_mem_bytes", "baseline_peak_mem_bytes", "ms_min", "ms_max",
    "spread", "baseline_spread", "T", "series", "note", "dtype", "device", "torch",
    "triton", "date", "timer", "reps", "op_backends", "profiler_ms", "paired_peer",
    "paired_speedup", "paired_q1", "paired_q3", "paired_rounds")

#: Timed median / profiler kernel time above this is named in a record's note: the timed
#: region held more than the op's kernels (or the GPU waited on the host).
PROFILER_GAP = 1.5

#: A spread (relative difference of two timings of the same code) above this marks a row
#: as noise in the markdown.
NOISY_SPREAD = 0.2

#: Keys of the report's JSON besides "records".
HEADER_KEYS: Tuple[str, ...] = ("device", "date", "written", "torch", "triton", "notes")


def _load(name: str, filename: str):
    """A module next to this file, loaded by path (works however this file was loaded)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_common = _load("ctxfast_bench_common", "_common.py")
_plot = _load("ctxfast_bench_plot", "plot.py")
_compare = _load("ctxfast_bench_compare", "_compare.py")
device_name = _common.device_name


# --------------------------------------------------------------------------- paths

def slug(text: str) -> str:
    """Lowercase, every run of non-alphanumerics turned into one '-', none at the ends."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def default_out_dir(device: Optional[str] = None) -> Path:
    """``benchmarks/results/<device-slug>/`` for the device the benchmarks would run on
    (`device`, else ``$CTXFAST_BENCH_DEVICE``, else CUDA if available, else CPU)."""
    return BENCH_DIR / "results" / slug(device_name(_common.bench_device(device)))


def available_ops(bench_dir: Path = BENCH_DIR) -> Dict[str, Path]:
    """{op: path} of every ``bench_<op>.py`` in `bench_dir`, sorted by op: the op
    families are whatever suites are present."""
    return {p.stem[len("bench_"):]: p for p in sorted(Path(bench_dir).glob("bench_*.py"))}


def bench_files(ops: Optional[Iterable[str]] = None, bench_dir: Path = BENCH_DIR) -> List[Path]:
    """The ``bench_<op>.py`` files: all of them, or those of `ops` (ValueError naming the
    unknown ones and the available ones)."""
    available = available_ops(bench_dir)
    if ops is None:
        return list(available.values())
    ops = list(ops)
    unknown = [op for op in ops if op not in available]
    if unknown:
        raise ValueError(f"no benchmark file for op(s) {', '.join(unknown)}; available: "
                         f"{', '.join(available) or 'none'}")
    return [available[op] for op in ops]


# --------------------------------------------------------------------------- records

def _date_of(data: dict) -> str:
    """ISO date of the pytest-benchmark run (its ``datetime``), else today."""
    stamp = data.get("datetime")
    if stamp:
        try:
            return _dt.datetime.fromisoformat(str(stamp)).date().isoformat()
        except ValueError:
            pass
    return _dt.date.today().isoformat()


def _timing(bench: dict) -> dict:
    """ms, ms_min, ms_max, spread, peak_mem_bytes, oom of one pytest-benchmark entry:
    from ``extra_info`` (``_common.measure``), else from pytest-benchmark's stats."""
    info = bench.get("extra_info") or {}
    if bench.get("error") and info.get("ms") is None and not info.get("oom"):
        return {"ms": None, "ms_min": None, "ms_max": None, "spread": None,
                "peak_mem_bytes": None, "oom": None, "error": bench["error"]}
    if info.get("oom"):
        return {"ms": None, "ms_min": None, "ms_max": None, "spread": None,
                "peak_mem_bytes": None, "oom": info["oom"]}
    if info.get("ms") is not None:
        return {"ms": info["ms"], "ms_min": info.get("ms_min"), "ms_max": info.get("ms_max"),
                "spread": info.get("spread"), "peak_mem_bytes": info.get("peak_mem_bytes"),
                "oom": None}
    stats = bench.get("stats") or {}
    median = stats.get("median")
    return {"ms": median * 1e3 if median is not None else None,
            "ms_min": stats["min"] * 1e3 if stats.get("min") is not None else None,
            "ms_max": stats["max"] * 1e3 if stats.get("max") is not None else None,
            "spread": None, "peak_mem_bytes": info.get("peak_mem_bytes"), "oom": None}


def _backends_text(seen) -> str:
    if not isinstance(seen, dict) or not seen:
        return "no ctxfast op"
    return ", ".join(f"{op} on {'/'.join(map(str, b))}" for op, b in seen.items())


def _rate(amount, ms: Optional[float], unit: float) -> Optional[float]:
    if amount is None or ms is None or ms <= 0:
        return None
    return float(amount) / (ms * 1e-3) / unit


def records_from_pytest_benchmark(data: dict) -> List[dict]:
    """One record per (op, case, mode, backend) that is not the op's baseline.

    `data` is pytest-benchmark's JSON (``--benchmark-json``). Benchmarks without
    ``extra_info["op"]`` are ignored. A backend is paired with the baseline benchmark of
    the same op, case, mode, dtype and device; where that baseline is missing or ran out
    of memory, ``baseline_ms`` and ``speedup`` are None and ``note`` says why.
    ``device``, ``torch`` and ``triton`` come from the benchmark's ``extra_info``
    (``device_name``, ``torch``, ``triton``) when present, else from this process.
    """
    date = _date_of(data)
    local = _common.versions()
    by_key: Dict[tuple, dict] = {}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info") or {}
        if "op" not in info:
            continue
        key = (info["op"], info["case"], info["mode"], info.get("dtype"),
               info.get("device"), info["backend"])
        by_key[key] = bench

    records = []
    for (op, case, mode, dtype, device, backend), bench in by_key.items():
        info = bench["extra_info"]
        baseline = BASELINES.get(op, info.get("baseline"))
        if backend == baseline:
            continue
        mine = _timing(bench)
        base_bench = by_key.get((op, case, mode, dtype, device, baseline))
        base = _timing(base_bench) if base_bench is not None else None
        baseline_ms = base["ms"] if base is not None else None
        notes = []
        if mine["oom"]:
            notes.append(f"OOM: {mine['oom']}")
        if mine.get("error"):
            notes.append(f"failed: {mine['error']}")
        if base is None:
            notes.append("no baseline" if baseline else "no baseline defined for this op")
        elif base["oom"]:
            notes.append(f"baseline OOM: {base['oom']}")
        elif base.get("error"):
            notes.append(f"baseline failed: {base['error']}")
        ms = mine["ms"]
        prof = info.get("profiler_ms")
        if ms is not None and prof and ms / prof > PROFILER_GAP:
            notes.append(f"timed {ms:.3g} ms but the profiler saw {prof:.3g} ms of kernels")
        if info.get("check_op_backends"):
            notes.append(f"timed call ran {_backends_text(info.get('op_backends'))}, the "
                         f"check {_backends_text(info['check_op_backends'])}")
        relative = None  # ms as a multiple of another backend's (the suite's yardstick)
        other = info.get("relative_to")
        if other and ms:
            other_bench = by_key.get((op, case, mode, dtype, device, other))
            other_ms = _timing(other_bench)["ms"] if other_bench is not None else None
            if other_ms:
                relative = ms / other_ms
                notes.append(f"{relative:.2f}x the time of {other}")
        paired = info.get("paired") or {}
        if paired.get("error"):
            notes.append(f"interleaved timing with {paired['peer']} failed: {paired['error']}")
        if paired.get("speedup") is not None:
            notes.append(f"interleaved with {paired['peer']}: {paired['speedup']:.2f}x "
                         f"(quartiles {paired['q1']:.2f}x-{paired['q3']:.2f}x, "
                         f"{paired['rounds']} rounds)")
        name = info.get("device_name")
        if not name:
            name = device_name(device) if device else "unknown"
        t = info.get("T")
        record = {
            "op": op, "case": case, "mode": mode, "backend": backend,
            "baseline": baseline,
            "ms": ms,
            "baseline_ms": baseline_ms,
            "speedup": (baseline_ms / ms if baseline_ms is not None and ms is not None
                        and ms > 0 else None),
            "tflops": _rate(info.get("flops"), ms, 1e12),
            "gbps": _rate(info.get("min_bytes"), ms, 1e9),
            "tokens_per_s": _rate(info.get("tokens"), ms, 1.0),
            "baseline_tokens_per_s": _rate(info.get("tokens"), baseline_ms, 1.0),
            "peak_mem_bytes": mine["peak_mem_bytes"],
            "baseline_peak_mem_bytes": base["peak_mem_bytes"] if base is not None else None,
            "ms_min": mine["ms_min"], "ms_max": mine["ms_max"],
            "spread": mine["spread"],
            "baseline_spread": base["spread"] if base is not None else None,
            "T": t,
            "series": info.get("series"),
            "note": "; ".join(notes) or None,
            "dtype": dtype,
            "device": name,
            "torch": info.get("torch", local["torch"]),
            "triton": info.get("triton", local["triton"]),
            "date": date,
            "timer": info.get("timer"),
            "reps": info.get("reps"),
            "op_backends": info.get("op_backends"),
            "profiler_ms": prof,
            "relative_to": other if relative is not None else None,
            "relative": relative,
            "paired_peer": paired.get("peer"),
            "paired_speedup": paired.get("speedup"),
            "paired_q1": paired.get("q1"),
            "paired_q3": paired.get("q3"),
            "paired_rounds": paired.get("rounds"),
        }
        if record["T"] is None:
            record["T"] = _plot.seq_len(record)
        records.append(record)
    return records


# --------------------------------------------------------------------------- writing

def _header(records: Sequence[dict], notes: Sequence[str] = ()) -> dict:
    """device, date, torch, triton, notes of a run (from its first record; this process
    if none)."""
    if records:
        first = records[0]
        head = {k: first[k] for k in ("device", "date", "torch", "triton")}
    else:
        v = _common.versions()
        head = {"device": device_name(_common.bench_device()),
                "date": _dt.date.today().isoformat(), "torch": v["torch"],
                "triton": v["triton"]}
    return {**head, "notes": list(notes)}


def _fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "—"
    return f"{x:.4f}" if x < 0.1 else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _fmt_rate(r: dict) -> str:
    if r.get("tflops") is not None:
        if r["tflops"] < 1:                      # CPU-sized rates read better in GFLOP/s
            return f"{r['tflops'] * 1e3:.3g} GFLOP/s"
        return f"{r['tflops']:.3g} TFLOP/s"
    if r.get("gbps") is not None:
        return f"{r['gbps']:.3g} GB/s"
    return "—"


def _fmt_pair(r: dict, key: str, fmt) -> str:
    """"ours / baseline" of ``r[key]`` and ``r["baseline_" + key]`` (— where missing)."""
    a, b = r.get(key), r.get("baseline_" + key)
    if a is None and b is None:
        return "—"
    return " / ".join("—" if x is None else fmt(x) for x in (a, b))


def _fmt_tokens(r: dict) -> str:
    return _fmt_pair(r, "tokens_per_s", lambda x: f"{x:.3g}")


def _fmt_mem(r: dict) -> str:
    return _fmt_pair(r, "peak_mem_bytes", lambda x: f"{x / 2**20:.0f}")


def _fmt_spread(r: dict) -> str:
    s = [x for x in (r.get("spread"), r.get("baseline_spread")) if x is not None]
    return f"±{max(s):.0%}" if s else "—"


def _timer_label(timer: Optional[str]) -> str:
    """Short name of a record's timer for the markdown's timer column."""
    if not timer:
        return ""
    if timer == "cuda-events":
        return "events"
    if timer == "perf_counter":
        return "wall"
    if timer.startswith("wall-clock, 3 rounds"):
        return "3 synced rounds"
    return timer


def markdown(records: Sequence[dict], notes: Sequence[str] = ()) -> str:
    """The report as markdown: a header (device, date, versions, how to read it, `notes`)
    and one table of the records."""
    h = _header(records)
    tokens = any(r.get("tokens_per_s") is not None
                 or r.get("baseline_tokens_per_s") is not None for r in records)
    on_cpu = not any(r.get("peak_mem_bytes") is not None
                     or r.get("baseline_peak_mem_bytes") is not None for r in records)
    lines = [
        f"**{h['device']}** · {h['date']} · torch {h['torch']} · triton {h['triton']}",
        "",
        "ms = median per call over at least 10 timed calls after a warm-up (CUDA events "
        "on a GPU, wall clock on the CPU; nothing but the op inside the timed loop); min "
        "ms = the fastest round (less hurt by other work on a shared machine); speedup = "
        "baseline ms / ms, same inputs, same run. Noise: *spread* is the larger relative "
        "difference between the medians of the first and second half of the rounds (the "
        "same code timed twice) of the backend and of its baseline — a speedup within "
        "1 ± spread of 1.0 is noise. Where a note says *interleaved*, the backend and "
        "that peer were also timed in alternating rounds (CPU): the median over the rounds "
        "of their time / ours, both from the same round, which a slow stretch of a shared "
        "machine cannot give to one side only. Rate: achieved TFLOP/s (FlashAttention count; "
        "Transformer-XL's position term included) or GB/s (least bytes the op must "
        "move)."
        + (" Tokens/s: token positions per second, ours / baseline." if tokens else "")
        + " Peak memory: MiB beyond the inputs, ours / baseline"
        + (" — CUDA only, not measured on the CPU (—)." if on_cpu else "."),
    ]
    noisy = sum(1 for r in records
                if max([x for x in (r.get("spread"), r.get("baseline_spread"))
                        if x is not None] or [0.0]) > NOISY_SPREAD)
    notes = list(notes) + ([f"{noisy} of {len(records)} rows have a spread above "
                            f"{NOISY_SPREAD:.0%}: their speedups are noise, not results "
                            "(re-run on a quiet machine)"] if noisy else [])
    for note in notes:
        lines += ["", f"Note: {note}"]
    timers = {_timer_label(r.get("timer")) for r in records} - {""}
    show_timer = len(timers) > 1 or bool(timers - {"events", "wall"})
    lines += [
        "",
        "| op | case | mode | backend | ms | min ms | baseline | baseline ms | speedup "
        "| rate | " + ("tokens/s | " if tokens else "") + "peak MiB | spread | "
        + ("timer | " if show_timer else "") + "note |",
        "|---|---|---|---|---:|---:|---|---:|---:|---:|" + ("---:|" if tokens else "")
        + "---:|---:|" + ("---|" if show_timer else "") + "---|",
    ]
    for r in records:
        speedup = "—" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['op']} | {r['case']} | {r['mode']} | {r['backend']} | "
                     f"{_fmt_ms(r['ms'])} | {_fmt_ms(r.get('ms_min'))} | {r['baseline']} | "
                     f"{_fmt_ms(r['baseline_ms'])} | "
                     f"{speedup} | {_fmt_rate(r)} | "
                     + (f"{_fmt_tokens(r)} | " if tokens else "")
                     + f"{_fmt_mem(r)} | {_fmt_spread(r)} | "
                     + (f"{_timer_label(r.get('timer')) or '—'} | " if show_timer else "")
                     + f"{r.get('note') or ''} |")
    return "\n".join(lines) + "\n"


def free_stem(out_dir, date: str) -> str:
    """``<date>``, else ``<date>-2``, ``-3``, ...: the first with no report in `out_dir`."""
    stem, n = date, 1
    while (Path(out_dir) / f"{stem}.json").exists() or (Path(out_dir) / f"{stem}.md").exists():
        n += 1
        stem = f"{date}-{n}"
    return stem


def write(records: Sequence[dict], out_dir, notes: Sequence[str] = (),
          plots: bool = True, stem: Optional[str] = None) -> Tuple[Path, Path]:
    """Write ``<out_dir>/<stem>.json``, ``<stem>.md`` and (with matplotlib, `plots`)
    ``<stem>-<op>.png``; returns the JSON and markdown paths. ``<stem>`` is the date; an
    existing report of the same date is never overwritten: ``-2``, ``-3``, ... .

    The JSON is ``{"device", "date", "written", "torch", "triton", "notes", "records":
    [...]}`` (``written``: UTC time the report was written, ISO 8601: orders runs of the
    same date in different device folders); the notes say what was plotted or why not
    (e.g. matplotlib missing). With `stem`, that report is (re)written in place: the
    runner rewrites its own report after every benchmark."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = _header(records, notes)
    header = {"device": header["device"], "date": header["date"],
              "written": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              **{k: header[k] for k in ("torch", "triton", "notes")}}
    if stem is None:
        stem = free_stem(out_dir, header["date"])
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    notes = list(notes)
    if plots:
        pngs, plot_note = _plot.write_plots(records, out_dir, stem)
        notes.append(plot_note)
    header["notes"] = notes
    with open(json_path, "w") as f:
        json.dump({**header, "records": list(records)}, f, indent=2)
        f.write("\n")
    md_path.write_text(markdown(records, notes))
    return json_path, md_path



# --------------------------------------------------------------------------- running

#: Environment variables the runner sets for the suites (read by ``_bench_plugin.py``).
RECORDS_ENV = "CTXFAST_BENCH_RECORDS"
DEADLINE_ENV = "CTXFAST_BENCH_DEADLINE"
PROGRESS_ENV = "CTXFAST_BENCH_PROGRESS"

#: Share of a run's time budget (``--time-budget``) each suite gets, relative to the others:
#: the seconds each is expected to take on an H100 with the GPU round's settings (the
#: first round took attention 6.8 min, rel_attention 3.8, models 4.1, lstm 1.9, rel_shift
#: 0.8 with 2 s of timing and 3 extra synchronised calls per case; estimated from those,
#: not measured). A suite not listed weighs 60. Time a suite leaves unused goes to the
#: suites after it.
SUITE_WEIGHTS: Dict[str, float] = {"attention": 190.0, "rel_attention": 140.0,
                                   "models": 150.0, "lstm": 40.0, "rel_shift": 25.0}

#: What to install for ``ctxfast bench`` (setup.py's ``bench`` extra).
INSTALL_HINT = ("pip install pytest pytest-benchmark  (or, from the checkout: "
                "pip install -e '.[bench]')")


def missing_requirements() -> List[str]:
    """The Python packages ``ctxfast bench`` needs that are not installed."""
    return [name for name, mod in (("pytest", "pytest"), ("pytest-benchmark", "pytest_benchmark"))
            if importlib.util.find_spec(mod) is None]


def entries_from_lines(lines: Iterable[str]) -> List[dict]:
    """The benchmark entries of ``_bench_plugin.py``'s JSON lines (a torn last line, from a
    suite killed while writing, is ignored)."""
    out = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _entries_to_data(entries: Sequence[dict]) -> dict:
    """pytest-benchmark-JSON-shaped ``{"benchmarks": [...]}`` of the timed entries."""
    return {"benchmarks": [e for e in entries if "extra_info" in e]}


class _Progress:
    """A progress bar over the cases of the suites: tqdm when installed, else one line
    rewritten in place (a TTY) or printed every 10% (a log)."""

    def __init__(self, enabled: bool, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.bar = None
        self.label, self.total, self.done, self._last = "", 0, 0, -1

    def start(self, label: str) -> None:
        self.close()
        self.label, self.total, self.done, self._last = label, 0, 0, -1

    def update(self, total: int, done: int, last: str = "") -> None:
        if not self.enabled or (total == self.total and done == self.done):
            return
        self.total, self.done = total, done
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            if self.bar is None and total:
                self.bar = tqdm(total=total, desc=self.label, unit="case", file=self.stream,
                                leave=True, dynamic_ncols=True)
            if self.bar is not None:
                self.bar.total = total
                self.bar.n = done
                self.bar.set_postfix_str(last[-40:], refresh=False)
                self.bar.refresh()
            return
        if not total:
            return
        width = 30
        fill = int(width * done / total)
        line = f"{self.label:<14} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}"
        if self.stream.isatty():
            self.stream.write("\r" + line)
            self.stream.flush()
        elif done * 10 // total != self._last or done == total:
            self._last = done * 10 // total
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self.total and self.stream.isatty():
            self.stream.write("\n")
            self.stream.flush()


def _read_progress(path: Path) -> Tuple[int, int, str]:
    """(total cases, finished, last test id) from the suite's progress file."""
    total = done = 0
    last = ""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0, 0, ""
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "total":
            total = int(rest or 0)
        elif word:
            done += 1
            last = rest.rsplit("[", 1)[-1].rstrip("]")
    return total, done, last


def suite_command(path: Path) -> List[str]:
    """The pytest command that runs one suite (its entries reach the runner through
    ``_bench_plugin.py``'s JSON lines, not through ``--benchmark-json``)."""
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    return [sys.executable, "-m", "pytest", str(shown), "-q", "-p", "no:cacheprovider",
            "-p", "no:xdist", "-p", "_bench_plugin", "-rfE",
            "--benchmark-columns=median,iqr,min,max,rounds,iterations"]


def run(out_dir, quick: bool = True, ops: Optional[Iterable[str]] = None,
        device: Optional[str] = None, plots: bool = True, echo: bool = True,
        bench_dir: Path = BENCH_DIR, threads: Optional[int] = None,
        time_budget_s: Optional[float] = None, verbose: bool = False,
        progress: bool = False, profile_check: bool = False) -> dict:
    """Run the suites and write the report into `out_dir`.

    Each ``bench_<op>.py`` of `ops` in `bench_dir` (default: all present) runs in its own
    ``python -m pytest`` from the repository root, with ``CTXFAST_BENCH_QUICK=1`` when
    `quick`, ``CTXFAST_BENCH_DEVICE=<device>`` when `device` is given, ``OMP_NUM_THREADS``
    and ``CTXFAST_BENCH_THREADS`` = `threads` when given (the CPU thread count; it is part
    of the device name, so of the results folder), ``CTXFAST_BENCH_PROFILE=1`` with
    `profile_check`.

    Every benchmark reaches the report the moment it ends (``_bench_plugin.py`` appends it to
    a JSON-lines file; this process rewrites ``<stem>.json`` and ``.md`` as they come),
    so a run that is killed keeps everything it finished. `time_budget_s`: the whole
    run's budget; each suite gets its share (:data:`SUITE_WEIGHTS`) of the time left, and
    a case that would start after its suite's share is skipped and named in the notes.

    Output: with `verbose` (or `echo` and not `progress`) the suites' pytest output goes
    to this process's stdout; otherwise it is kept and the tail of a failed suite's
    output is printed. `progress`: a progress bar over the cases on stderr.

    Returns the written report (``{"device", "date", "torch", "triton", "notes",
    "records"}``) with ``json_path``, ``md_path``, ``failed`` (the suites that failed),
    ``skipped_budget`` (cases not run for lack of time) and ``wall_s`` added. Raises
    RuntimeError when no suite wrote anything.
    """
    files = bench_files(ops, bench_dir)
    if not files:
        raise RuntimeError(f"no bench_*.py file in {bench_dir}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env[_common.QUICK_ENV] = "1" if quick else "0"
    if device is not None:
        env[_common.DEVICE_ENV] = device
    if threads is not None:
        env["OMP_NUM_THREADS"] = env[_common.THREADS_ENV] = str(int(threads))
    if profile_check:
        env[_common.PROFILE_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])      # for -p _bench_plugin
    t0 = time.perf_counter()
    wall0 = time.time()
    entries: List[dict] = []
    failed: List[str] = []
    notes: List[str] = []
    skipped_budget: List[str] = []
    busy = cpu_busy_fraction()
    if busy is not None and busy > 0.2 and _common.bench_device(device).type == "cpu":
        # Measured on the 2-core machines: with another job running, multi-threaded CPU
        # medians snap to multiples of ~4 ms (a 256 KiB copy: 0.036 ms on 1 thread, 12 ms
        # on 2 threads with one core taken) and the ratios mean nothing.
        notes.append(f"the CPUs were {busy:.0%} busy with other work when the run "
                     "started: CPU timings are noisy"
                     + ("" if threads == 1 else " (with other work running, `--threads 1` "
                        "avoids the worst of it: threads waiting for a descheduled peer)"))
    if _common.bench_device(device).type == "cpu":
        paths = cpu_code_paths()
        if paths:
            notes.append(f"CPU code: {paths}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = free_stem(out_dir, _dt.date.today().isoformat())
    show = verbose or (echo and not progress)
    bar = _Progress(progress)
    written: Dict[str, Path] = {}

    def rewrite(final: bool) -> None:
        records = records_from_pytest_benchmark(_entries_to_data(entries))
        run_notes = list(notes)
        if skipped_budget:
            run_notes.append(f"{len(skipped_budget)} case(s) not run: the time budget "
                             f"({time_budget_s:.0f} s) was spent: "
                             + ", ".join(skipped_budget[:8])
                             + (", ..." if len(skipped_budget) > 8 else ""))
        if not final:
            run_notes.append("partial report: the run is still going (or was stopped)")
        j, m = write(records, out_dir, run_notes, plots=plots and final, stem=stem)
        written["json"], written["md"] = j, m

    with tempfile.TemporaryDirectory(prefix="ctxfast-bench-") as tmp:
        for k, path in enumerate(files):
            op = path.stem[len("bench_"):]
            rec_file = Path(tmp) / f"{op}.jsonl"
            prog_file = Path(tmp) / f"{op}.progress"
            log_file = Path(tmp) / f"{op}.log"
            suite_env = dict(env, **{RECORDS_ENV: str(rec_file), PROGRESS_ENV: str(prog_file)})
            if time_budget_s is not None:
                left = time_budget_s - (time.time() - wall0)
                weights = [SUITE_WEIGHTS.get(p.stem[len("bench_"):], 60.0) for p in files[k:]]
                share = max(0.0, left) * weights[0] / sum(weights)
                suite_env[DEADLINE_ENV] = repr(time.time() + share)
            cmd = suite_command(path)
            bar.start(op)
            with open(log_file, "w") as log:
                proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=suite_env,
                                        stdout=None if show else log,
                                        stderr=None if show else subprocess.STDOUT)
                seen = 0
                while True:
                    code = proc.poll()
                    lines = rec_file.read_text().splitlines() if rec_file.exists() else []
                    if len(lines) != seen:
                        new = entries_from_lines(lines[seen:])
                        seen = len(lines)
                        for e in new:
                            if e.get("budget_skipped"):
                                skipped_budget.append(e["name"].split("::")[-1])
                            else:
                                entries.append(e)
                        rewrite(final=False)
                    bar.update(*_read_progress(prog_file))
                    if code is not None:
                        break
                    time.sleep(0.5)
            bar.close()
            if code not in (0, 5):                  # 5: pytest collected nothing
                failed.append(path.name)
                notes.append(f"{path.name} failed (`pytest {cmd[3]}` exited with {code}); "
                             "its records are those written before")
                if not show and echo:
                    tail = log_file.read_text().splitlines()[-25:]
                    print(f"--- {path.name} failed (exit {code}); the end of its output:",
                          *tail, sep="\n", file=sys.stderr)
    if not entries and failed:
        raise RuntimeError(f"every benchmark suite failed: {', '.join(failed)}"
                           + (" (their output is above)" if show else ""))
    rewrite(final=True)
    report = json.loads(written["json"].read_text())
    return {**report, "json_path": str(written["json"]), "md_path": str(written["md"]),
            "failed": failed, "skipped_budget": skipped_budget,
            "wall_s": time.perf_counter() - t0}


def cpu_code_paths() -> Optional[str]:
    """What code ctxfast's CPU kernels take in a process with this environment (own AVX-512
    / AVX2 tiles or the BLAS, ...: ``torch.ops.ctxfast.cpu_code_paths``), for the report's
    notes: the same name of CPU can run different code. None where ctxfast._C is missing."""
    try:
        import torch

        import ctxfast  # noqa: F401  (registers the ops)
        return str(torch.ops.ctxfast.cpu_code_paths())
    except (ImportError, AttributeError, RuntimeError):
        return None


def cpu_busy_fraction(interval_s: float = 0.5) -> Optional[float]:
    """Fraction of all CPUs busy over `interval_s` while this process sleeps (from
    ``/proc/stat``), i.e. how much other work competes with a benchmark; None if unknown."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)    # total, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return 1.0 - (idle1 - idle0) / (total1 - total0)


# --------------------------------------------------------------------------- compact output

def _row_keys(all_times: dict, op: str) -> List[Tuple[str, str, str, str]]:
    """(case, mode, dtype, backend) of each row :func:`compact_tables` makes for `op`, in
    its order."""
    keys = []
    for (o, case, mode, dtype), ms in all_times.items():
        if o == op:
            keys += [(case, mode, dtype, b) for b in [b for b in ms if b in _compare.OURS] or ["—"]]
    return keys


def compact_tables(records: Sequence[dict]) -> str:
    """One plain-text table per op: each of our backends per case and mode, its time, its
    rate, and its speedup over every other backend timed on the same case (``>1x``: we
    are faster; ``<1x``: slower), and where it was timed in rounds interleaved with a
    peer (the CPU's ``paired`` timing) that speedup too. What ``ctxfast bench`` prints."""
    out: List[str] = []
    ops = list(dict.fromkeys(r["op"] for r in records))
    all_times = _compare.times(records)
    rate = {(r["op"], r["case"], r["mode"], str(r.get("dtype")), r["backend"]): _fmt_rate(r)
            for r in records}
    for op in ops:
        peers = _compare.peers(records, op)
        rows = []
        for (o, case, mode, dtype), ms in all_times.items():
            if o != op:
                continue
            ours = [b for b in ms if b in _compare.OURS]
            for b in ours or ["—"]:
                mine = ms.get(b)
                cells = [case, mode, b, _compare.fmt_ms(mine), rate.get((o, case, mode, dtype, b), "—")]
                for p in peers:
                    if p not in ms:
                        cells.append("—")
                    elif mine is None:
                        cells.append(_compare.fmt_ms(ms[p]) + " ms")
                    else:
                        cells.append(f"{ms[p] / mine:.2f}x")
                rows.append(cells)
        interleaved = {(r["case"], r["mode"], str(r.get("dtype")), r["backend"]):
                       f"{r['paired_speedup']:.2f}x vs {r['paired_peer']}"
                       for r in records
                       if r["op"] == op and r.get("paired_speedup") is not None}
        if interleaved:
            for cells, (case, mode, dtype, b) in zip(rows, _row_keys(all_times, op)):
                cells.append(interleaved.get((case, mode, dtype, b), "—"))
        head = (["case", "mode", "ours", "ms", "rate"] + [f"vs {p}" for p in peers]
                + (["interleaved"] if interleaved else []))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else []
        note = ("" if any(r[2] != "—" for r in rows) else
                "  (no ctxfast backend timed on this device: the peers' times are shown)")
        out.append(f"{op}: speedup = peer's time / ours (>1x: ctxfast is faster)" + note)
        for cells in [head] + rows:
            out.append("  " + "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w)
                                        for i, (c, w) in enumerate(zip(cells, widths))))
        out.append("")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line (also ``ctxfast bench``): run, write, print one compact table per op
    and where the report is. Exit status 1 when a suite failed (the report of the others
    is still written), 2 on a bad argument."""
    parser = argparse.ArgumentParser(
        prog="ctxfast bench", description="Benchmark ctxfast ops against eager PyTorch "
        "(and on a GPU against SDPA, FlexAttention, cuDNN).")
    parser.add_argument("--quick", action="store_true",
                        help="small cases only (minutes on a CPU)")
    parser.add_argument("--ops", nargs="+", metavar="OP",
                        help="op families to benchmark (bench_<op>.py; comma-separated or "
                             f"several; default: all of {', '.join(available_ops())})")
    parser.add_argument("--device", help="device to run on (default: cuda if available, "
                                         "else cpu)")
    parser.add_argument("--out", type=Path,
                        help="output folder (default: benchmarks/results/<device>/)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="CPU threads (OMP_NUM_THREADS); on a shared machine 1 keeps "
                             "timings sane (default: torch's)")
    parser.add_argument("--time-budget", type=float, metavar="S",
                        help="seconds for the whole run: a case that would start after its "
                             "suite's share is skipped and named in the report")
    parser.add_argument("--profile-check", action="store_true",
                        help="CUDA: also run each case once under torch.profiler and record "
                             "its kernel time next to the timed median")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="show pytest's output and pytest-benchmark's tables")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG")
    parser.add_argument("--list", action="store_true",
                        help="list the op families (bench_<op>.py) and exit")
    args = parser.parse_args(argv)
    if args.list:
        for op, path in available_ops().items():
            print(f"{op:<16} {path.relative_to(REPO_ROOT)}  baseline: "
                  f"{BASELINES.get(op, '(from the suite)')}")
        return 0
    missing = missing_requirements()
    if missing:
        print(f"ctxfast bench: {' and '.join(missing)} not installed; install with: "
              f"{INSTALL_HINT}", file=sys.stderr)
        return 1
    ops = [o for arg in args.ops for o in arg.split(",") if o] if args.ops else None
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.time_budget is not None and not args.time_budget > 0:
        parser.error(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    if args.device is not None:
        reason = device_problem(args.device)
        if reason is not None:
            print(f"ctxfast bench: --device {args.device}: {reason}", file=sys.stderr)
            return 2
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)          # names the results folder
    try:
        out = args.out if args.out is not None else default_out_dir(args.device)
        report = run(out, quick=args.quick, ops=ops, device=args.device,
                     plots=not args.no_plots, threads=args.threads,
                     time_budget_s=args.time_budget, verbose=args.verbose,
                     progress=not args.no_progress and not args.verbose,
                     profile_check=args.profile_check)
    except (RuntimeError, ValueError) as e:
        print(f"ctxfast bench: {e}", file=sys.stderr)
        return 1
    print()
    if args.verbose:
        print(Path(report["md_path"]).read_text(), end="")
    else:
        print(compact_tables(report["records"]), end="")
    for note in report["notes"]:
        if not note.startswith("plots:"):
            print(f"note: {note}")
    pngs = sorted(Path(report["json_path"]).parent.glob(Path(report["json_path"]).stem + "-*.png"))
    print(f"\nreport ({report['wall_s']:.0f} s, {len(report['records'])} records): "
          f"{report['md_path']}\n  also {Path(report['json_path']).name}"
          + "".join(f", {p.name}" for p in pngs)
          + f" in {Path(report['json_path']).parent}")
    if report["failed"]:
        print(f"ctxfast bench: failed suites: {', '.join(report['failed'])}", file=sys.stderr)
        return 1
    return 0


def device_problem(device: str) -> Optional[str]:
    """Why `device` cannot run the benchmarks here (one line), or None."""
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return "not a device name; use cpu, cuda or cuda:<index>"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"benchmarks run on cpu or cuda, not {dev.type}"
    if not torch.cuda.is_available():
        return ("CUDA is not available here (torch " + torch.__version__
                + ("" if torch.version.cuda else ", a CPU-only build")
                + "); use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"only {torch.cuda.device_count()} CUDA device(s) here"
    return None


if __name__ == "__main__":
    sys.exit(main())
