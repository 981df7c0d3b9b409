"""Turn the output of an earlier benchmark run into a report in ``benchmarks/results/``
(JSON + markdown + PNG, the format ``report.py`` writes) without re-measuring anything.

Used once so far: the first H100 round (2026-11-22, commit af671e2), whose runner was
killed before it wrote its JSON for attention, lstm, rel_attention and rel_shift, so
the only numbers left for those suites are the pytest-benchmark tables in its logs::

    python benchmarks/import_logs.py \\
        --log ../shared/gpu-runs/2026-11-22-h100/bench_attention_lstm.log \\
        --log ../shared/gpu-runs/2026-11-22-h100/bench_rel_attention_rel_shift.log \\
        --report ../shared/gpu-runs/2026-11-22-h100/bench_models.json \\
        --device "NVIDIA H100 80GB HBM3" --date 2026-11-22 --torch 2.11.0+cu130 \\
        --triton 3.6.0 --note "..." --out benchmarks/results/nvidia-h100-80gb-hbm3

What is read, and nothing else:

* ``--log``: pytest-benchmark's tables (group ``'<op> <case> <mode>'``, one row per
  backend: median, IQR, rounds, iterations) and pytest's ``FAILED`` lines. A row with one
  round is the old harness's out-of-memory marker (``_common.record_oom`` ran a no-op
  once): recorded as an OOM. A ``FAILED`` benchmark becomes a record with no time and
  the note "failed: ...". The time of a row is pytest-benchmark's median; ``timer`` says
  what it was (the old harness's extra pass: wall clock, a CUDA synchronisation inside
  every call).
* ``--report``: a report JSON written by ``report.py``; its records are kept as they are.

FLOP and byte counts (TFLOP/s, GB/s) come from the suites' own formulas
(``bench_<op>.py``: ``flops()``, the ``min_bytes`` of ``describe``) for the case of the
same name; the plot's ``T`` and ``series`` likewise. Loaded by path (no package).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

BENCH_DIR = Path(__file__).resolve().parent

_GROUP = re.compile(r"benchmark '(?P<group>[^']+)': \d+ tests?")
_UNIT = re.compile(r"^Name \(time in (?P<unit>ns|us|ms|s)\)")
_ROW = re.compile(r"^test_(?P<op>\w+)\[(?P<id>[^\]]+)\]\s+(?P<median>[\d,.]+)(?: \([^)]*\))?"
                  r"\s+(?P<iqr>[\d,.]+)(?: \([^)]*\))?\s+(?P<rounds>\d+)\s+(?P<it>\d+)\s*$")
_FAILED = re.compile(r"^FAILED benchmarks/bench_(?P<op>\w+)\.py::test_\w+\[(?P<id>[^\]]+)\]")
_TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}

#: What the old harness's pytest-benchmark rows are (``timer`` of an imported record).
LOG_TIMER = "wall-clock, 3 rounds, torch.cuda.synchronize() in every call (old harness)"


def _load(name: str, filename: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def parse_log(text: str) -> List[dict]:
    """``{"op", "case", "mode", "backend", "ms", "iqr_ms", "rounds", "iterations"}`` per
    table row and ``{"op", "id", "failed": True}`` per FAILED line of a pytest log."""
    out: List[dict] = []
    group: Optional[str] = None
    unit = "us"
    for line in text.splitlines():
        m = _GROUP.search(line)
        if m:
            group = m.group("group")
            continue
        m = _UNIT.match(line)
        if m:
            unit = m.group("unit")
            continue
        m = _ROW.match(line)
        if m and group:
            op, *case, mode = group.split(" ")
            prefix = f"{'-'.join(case)}-{mode}-"
            tid = m.group("id")
            if not tid.startswith(prefix):
                continue
            scale = _TO_MS[unit]
            out.append({"op": op, "case": " ".join(case), "mode": mode,
                        "backend": tid[len(prefix):],
                        "ms": float(m.group("median").replace(",", "")) * scale,
                        "iqr_ms": float(m.group("iqr").replace(",", "")) * scale,
                        "rounds": int(m.group("rounds")), "iterations": int(m.group("it"))})
            continue
        m = _FAILED.match(line)
        if m:
            out.append({"op": m.group("op"), "id": m.group("id"), "failed": True})
    return out


# --------------------------------------------------------------------------- the suites' counts

def _suite(op: str):
    sys.path.insert(0, str(BENCH_DIR))
    return _load(f"bench_{op}", f"bench_{op}.py")


def _case_info(op: str, case_name: str, mode: str) -> dict:
    """dtype, T, series, flops / min_bytes of `case_name` from ``bench_<op>.py`` (the
    CUDA dtypes: bf16 attention, fp32/fp16 LSTM as named)."""
    try:
        suite = _suite(op)
    except (ImportError, FileNotFoundError, AttributeError):
        return {}
    cases = {c.name: c for c in getattr(suite, "FULL_CASES", ())}
    case = cases.get(case_name)
    if case is None:
        return {}
    info: dict = {}
    if op == "attention":
        B, H, Tq, Tk, D = case.shape
        info.update(dtype="bfloat16", T=Tq, flops=suite.flops(case, mode),
                    series=" ".join(s for s in (case.model, case.mask, f"D{D}") if s),
                    min_bytes=2 * B * H * (Tq + Tk) * D * (2 if mode == "fwd" else 6))
    elif op == "rel_attention":
        B, H, Tq, mem, D = case.shape
        info.update(dtype="bfloat16", T=Tq + mem, series=f"Tq{Tq}",
                    flops=suite.flops(case, mode))
    elif op == "rel_shift":
        B, H, Tq, Tk = case.shape
        info.update(dtype="bfloat16", T=Tq, series=case.series,
                    min_bytes=B * H * Tq * Tk * 2 * (2 if mode == "fwd" else 4))
    elif op == "lstm":
        info.update(dtype=case.dtype, T=case.T, series=case.model,
                    flops=suite.flops(case, mode))
    return info


def _split_id(op: str, tid: str) -> Optional[tuple]:
    """(case, mode, backend) of a test id ``<case with dashes>-<mode>-<backend>``."""
    try:
        suite = _suite(op)
    except (ImportError, FileNotFoundError):
        return None
    for case in getattr(suite, "FULL_CASES", ()):
        for mode in getattr(suite, "MODES", ()):
            prefix = f"{case.name.replace(' ', '-')}-{mode}-"
            if tid.startswith(prefix):
                return case.name, mode, tid[len(prefix):]
    return None


def entries(rows: Sequence[dict], header: dict) -> List[dict]:
    """pytest-benchmark-JSON-shaped entries (``extra_info`` as ``_common`` writes it)."""
    report = _load("ctxfast_bench_report", "report.py")
    out = []
    for row in rows:
        if row.get("failed"):
            split = _split_id(row["op"], row["id"])
            if split is None:
                continue
            case, mode, backend = split
            row = {"op": row["op"], "case": case, "mode": mode, "backend": backend,
                   "failed": True}
        info = {"op": row["op"], "case": row["case"], "mode": row["mode"],
                "backend": row["backend"], "device": "cuda",
                "device_name": header["device"], "torch": header["torch"],
                "triton": header["triton"], "timer": LOG_TIMER,
                "baseline": report.BASELINES.get(row["op"])}
        info.update(_case_info(row["op"], row["case"], row["mode"]))
        entry: Dict[str, object] = {"extra_info": info, "stats": {}}
        if row.get("failed"):
            entry["error"] = "failed the benchmark's correctness check (see the log)"
        elif row["rounds"] == 1:
            info.update(oom="out of memory (the old harness's marker: one no-op round)",
                        ms=None)
        else:
            info.update(ms=row["ms"], reps=row["rounds"] * row["iterations"])
        out.append(entry)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", action="append", default=[], type=Path,
                        help="pytest log with pytest-benchmark tables (repeatable)")
    parser.add_argument("--report", action="append", default=[], type=Path,
                        help="report JSON whose records are kept as they are (repeatable)")
    parser.add_argument("--device", required=True)
    parser.add_argument("--date", required=True)
    parser.add_argument("--torch", required=True)
    parser.add_argument("--triton", required=True)
    parser.add_argument("--note", action="append", default=[],
                        help="a note for the report's header (repeatable)")
    parser.add_argument("--record-note", action="append", default=[], metavar="CASE|MODE|BACKEND|NOTE",
                        help="a note added to one record (repeatable)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    report = _load("ctxfast_bench_report", "report.py")
    header = {"device": args.device, "torch": args.torch, "triton": args.triton}
    rows = [r for log in args.log for r in parse_log(log.read_text())]
    data = {"benchmarks": entries(rows, header), "datetime": args.date}
    records = report.records_from_pytest_benchmark(data)
    for path in args.report:
        for r in json.loads(path.read_text())["records"]:
            records.append({k: r.get(k) for k in report.RECORD_KEYS}
                           | {"timer": r.get("timer") or "cuda-events"})
    for spec in args.record_note:
        case, mode, backend, note = spec.split("|", 3)
        for r in records:
            if (r["case"], r["mode"], r["backend"]) == (case, mode, backend):
                r["note"] = "; ".join(x for x in (r.get("note"), note) if x)
    for r in records:
        r["date"] = args.date
    json_path, md_path = report.write(records, args.out, args.note, plots=True,
                                      stem=args.date)
    print(f"import_logs: {len(records)} records -> {json_path}, {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
