"""Run the benchmarks and write the report: ``benchmarks/results/<device>/<date>.{json,md}``.

Usage (``ctxfast bench`` calls :func:`main`)::

    python benchmarks/report.py --quick                # small cases, seconds on a CPU
    python benchmarks/report.py --ops rel_shift --out /tmp/bench

Each ``benchmarks/bench_<op>.py`` is a pytest-benchmark suite whose benchmarks carry
``extra_info`` = {op, case, mode, backend, dtype, device, ...}; every backend of an op is
timed next to the op's eager baseline (:data:`BASELINES`) on the same inputs in the same
run. This module runs them in a subprocess, pairs each backend with the baseline of the
same (op, case, mode) and writes one record per pair::

    op, case, mode, backend, baseline, ms, baseline_ms, speedup, dtype, device,
    torch, triton, date

``ms`` is the median in milliseconds; ``speedup = baseline_ms / ms`` (> 1: faster than the
baseline).

This file is loaded by path (``benchmarks/`` is not an installed package), so it uses no
relative import; ``_common.py`` next to it is loaded by path too.
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

#: The baseline backend of each op: what every other backend's speedup is measured against.
BASELINES: Dict[str, str] = {"rel_shift": "eager-pad-view", "attention": "eager",
                              "rel_attention": "eager-original"}

#: Keys of one record, in order.
RECORD_KEYS: Tuple[str, ...] = ("op", "case", "mode", "backend", "baseline", "ms",
                                "baseline_ms", "speedup", "dtype", "device", "torch",
                                "triton", "date")


def _load_common():
    """``benchmarks/_common.py``, loaded by path (works however this file was loaded)."""
    name = "ctxfast_bench_common"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / "_common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_common = _load_common()
device_name = _common.device_name


# --------------------------------------------------------------------------- paths

def slug(text: str) -> str:
    """Lowercase, every run of non-alphanumerics turned into one '-', none at the ends."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def default_out_dir(device: Optional[str] = None) -> Path:
    """``benchmarks/results/<device-slug>/`` for the device the benchmarks would run on
    (`device`, else ``$CTXFAST_BENCH_DEVICE``, else CUDA if available, else CPU)."""
    return BENCH_DIR / "results" / slug(device_name(_common.bench_device(device)))


def bench_files(ops: Optional[Iterable[str]] = None) -> List[Path]:
    """The ``benchmarks/bench_<op>.py`` files: all of them, or those of `ops`."""
    available = {p.stem[len("bench_"):]: p for p in sorted(BENCH_DIR.glob("bench_*.py"))}
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


def records_from_pytest_benchmark(data: dict) -> List[dict]:
    """One record per (op, case, mode, backend) that is not the op's baseline.

    `data` is pytest-benchmark's JSON (``--benchmark-json``). Benchmarks without
    ``extra_info["op"]`` are ignored. A backend is paired with the baseline benchmark of
    the same op, case, mode, dtype and device; where that baseline is missing,
    ``baseline_ms`` and ``speedup`` are None. ``device``, ``torch`` and ``triton`` come from
    the benchmark's ``extra_info`` (``device_name``, ``torch``, ``triton``) when present,
    else from this process.
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
        baseline = BASELINES.get(op)
        if backend == baseline:
            continue
        info = bench["extra_info"]
        ms = bench["stats"]["median"] * 1e3
        base = by_key.get((op, case, mode, dtype, device, baseline))
        baseline_ms = base["stats"]["median"] * 1e3 if base is not None else None
        name = info.get("device_name")
        if not name:
            name = device_name(device) if device else "unknown"
        records.append({
            "op": op, "case": case, "mode": mode, "backend": backend,
            "baseline": baseline,
            "ms": ms,
            "baseline_ms": baseline_ms,
            "speedup": baseline_ms / ms if baseline_ms is not None and ms > 0 else None,
            "dtype": dtype,
            "device": name,
            "torch": info.get("torch", local["torch"]),
            "triton": info.get("triton", local["triton"]),
            "date": date,
        })
    return records


# --------------------------------------------------------------------------- writing

def _header(records: Sequence[dict]) -> dict:
    """device, date, torch, triton of a run (from its first record; this process if none)."""
    if records:
        first = records[0]
        return {k: first[k] for k in ("device", "date", "torch", "triton")}
    v = _common.versions()
    return {"device": device_name(_common.bench_device()),
            "date": _dt.date.today().isoformat(), "torch": v["torch"], "triton": v["triton"]}


def _fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "—"
    return f"{x:.4f}" if x < 0.1 else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def markdown(records: Sequence[dict]) -> str:
    """The report as markdown: a header line (device, date, versions) and one table."""
    h = _header(records)
    lines = [
        f"**{h['device']}** · {h['date']} · torch {h['torch']} · triton {h['triton']}"
        " · ms = median",
        "",
        "| op | case | mode | backend | ms | baseline | baseline ms | speedup |",
        "|---|---|---|---|---:|---|---:|---:|",
    ]
    for r in records:
        speedup = "—" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['op']} | {r['case']} | {r['mode']} | {r['backend']} | "
                     f"{_fmt_ms(r['ms'])} | {r['baseline']} | {_fmt_ms(r['baseline_ms'])} | "
                     f"{speedup} |")
    return "\n".join(lines) + "\n"


def write(records: Sequence[dict], out_dir) -> Tuple[Path, Path]:
    """Write ``<out_dir>/<date>.json`` and ``<out_dir>/<date>.md``; returns their paths.

    The JSON is ``{"device", "date", "torch", "triton", "records": [...]}``. An existing
    report of the same date is never overwritten: the name gets ``-2``, ``-3``, ... .
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = _header(records)
    stem, n = header["date"], 1
    while (out_dir / f"{stem}.json").exists() or (out_dir / f"{stem}.md").exists():
        n += 1
        stem = f"{header['date']}-{n}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    with open(json_path, "w") as f:
        json.dump({**header, "records": list(records)}, f, indent=2)
        f.write("\n")
    md_path.write_text(markdown(records))
    return json_path, md_path


# --------------------------------------------------------------------------- running

def run(out_dir, quick: bool = True, ops: Optional[Iterable[str]] = None,
        device: Optional[str] = None) -> dict:
    """Run the benchmarks in a subprocess and write the report into `out_dir`.

    Runs ``python -m pytest benchmarks/bench_<op>.py ... --benchmark-json=<tmp>`` from the
    repository root (its output goes to this process's stdout/stderr), with
    ``CTXFAST_BENCH_QUICK=1`` when `quick` and ``CTXFAST_BENCH_DEVICE=<device>`` when
    `device` is given. `ops` picks the ``bench_<op>.py`` files (default: all).

    Returns the written report (``{"device", "date", "torch", "triton", "records"}``) with
    ``json_path`` and ``md_path`` added. Raises RuntimeError if pytest fails.
    """
    files = bench_files(ops)
    if not files:
        raise RuntimeError(f"no bench_*.py file in {BENCH_DIR}")
    env = dict(os.environ)
    env[_common.QUICK_ENV] = "1" if quick else "0"
    if device is not None:
        env[_common.DEVICE_ENV] = device
    with tempfile.TemporaryDirectory(prefix="ctxfast-bench-") as tmp:
        json_tmp = Path(tmp) / "pytest-benchmark.json"
        cmd = [sys.executable, "-m", "pytest", *[str(p.relative_to(REPO_ROOT)) for p in files],
               f"--benchmark-json={json_tmp}", "--benchmark-columns=median,iqr,rounds,iterations",
               "-q", "-p", "no:cacheprovider"]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmarks failed: `{' '.join(cmd)}` exited with "
                               f"{proc.returncode} (its output is above)")
        data = json.loads(json_tmp.read_text())
    records = records_from_pytest_benchmark(data)
    json_path, md_path = write(records, out_dir)
    return {**_header(records), "records": records,
            "json_path": str(json_path), "md_path": str(md_path)}


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line (also ``ctxfast bench``): run, write, print the markdown table."""
    parser = argparse.ArgumentParser(
        prog="ctxfast bench", description="Benchmark ctxfast ops against eager PyTorch.")
    parser.add_argument("--quick", action="store_true",
                        help="small cases only (seconds on a CPU)")
    parser.add_argument("--ops", nargs="+", metavar="OP",
                        help="ops to benchmark (bench_<op>.py; comma-separated or several); "
                             "default: all")
    parser.add_argument("--device", help="device to run on (default: cuda if available, "
                                         "else cpu)")
    parser.add_argument("--out", type=Path,
                        help="output folder (default: benchmarks/results/<device>/)")
    args = parser.parse_args(argv)
    ops = [o for arg in args.ops for o in arg.split(",") if o] if args.ops else None
    out = args.out if args.out is not None else default_out_dir(args.device)
    busy = cpu_busy_fraction()
    if busy is not None and busy > 0.2:
        # Measured on the 2-core machines: with another job running, CPU medians snap to
        # multiples of ~8 ms and the ratios mean nothing.
        print(f"ctxfast bench: warning: the CPUs are {busy:.0%} busy with other work; "
              "CPU timings will be noisy", file=sys.stderr)
    try:
        report = run(out, quick=args.quick, ops=ops, device=args.device)
    except (RuntimeError, ValueError) as e:
        print(f"ctxfast bench: {e}", file=sys.stderr)
        return 1
    print(f"\nwrote {report['json_path']}\n      {report['md_path']}\n")
    print(Path(report["md_path"]).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
