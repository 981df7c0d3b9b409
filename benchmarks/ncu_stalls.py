"""Where the warps of rel_attention's and attention's kernels wait: Nsight Compute's warp
states and sampled stalls, summarised.

The H200 timed rel_attention's bf16 forward (B4 H16 Tq 512 mem 1,024 D 64) at 112 us where
its sm_90 SASS issues ~28 us of instructions and its products ~24 us of tensor-core work
(benchmarks/NOTES.md): its warps mostly wait, and what they wait on (a barrier, a wgmma, a
shared-memory round trip of the relative shift's gather, a TMA tile) decides what to change.
Nothing but a GPU can say. On a GPU machine with ``ncu``::

    python benchmarks/ncu_stalls.py --out-dir OUT       # profile, export, summarise
    python benchmarks/ncu_stalls.py --raw OUT/stalls_raw.csv [--source OUT/stalls_source.csv]

The first form profiles ``kernel_breakdown.py --ncu-target rel`` (one forward+backward of
each op at that shape, default launch rows, inside the NVTX range "profile") with the
sections WarpStateStats, SourceCounters, LaunchStats, Occupancy and SpeedOfLight into
``OUT/stalls.ncu-rep``, exports the report's raw metrics (``stalls_raw.csv``) and its
per-SASS-line view (``stalls_source.csv``, sampled stalls per instruction), and prints per
kernel: duration, registers, achieved occupancy, cycles between a warp's issues, and the
reasons that make them up (``smsp__average_warps_issue_stalled_<reason>_per_issue_active``:
cycles per issued instruction a warp spent stalled for each); then, per kernel in the
source view, the instructions with the most stall samples and the samples by opcode. The
second form summarises exported files again (here, on a CPU). The CSV files are kept so
that the per-line data can be read again without a GPU.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from sass_loops import opcode  # noqa: E402  (the SASS opcode parser of the loop counts)
SECTIONS = ("WarpStateStats", "SourceCounters", "LaunchStats", "Occupancy", "SpeedOfLight")
_STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
_TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
               "msecond": 1e3, "s": 1e6, "second": 1e6}


def _number(text: str) -> Optional[float]:
    """ncu's CSV cell as a float (thousands separators dropped), None if not a number."""
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def _column(header: List[str], *names: str) -> Optional[int]:
    """Index of the first header cell equal to one of ``names`` (case-insensitive)."""
    low = [h.strip().lower() for h in header]
    for n in names:
        if n.lower() in low:
            return low.index(n.lower())
    return None


def parse_raw(text: str) -> List[Dict]:
    """Per profiled kernel of ``ncu --page raw --csv``: {"kernel", "us", "registers",
    "occupancy_pct", "cycles_per_issue", "stalls": {reason: cycles per issued
    instruction}}, in the report's order. The second row of the export holds the units
    (its ID cell empty) and gives the duration's."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    start = next((i for i, r in enumerate(rows) if _column(r, "ID") is not None
                  and _column(r, "Kernel Name", "Function Name", "Name") is not None), None)
    if start is None:
        return []
    header = rows[start]
    idc = _column(header, "ID")
    name = _column(header, "Kernel Name", "Function Name", "Name")
    body, units = rows[start + 1:], [""] * len(header)
    if body and not body[0][idc].strip():
        units, body = body[0], body[1:]
    col = {h.strip(): i for i, h in enumerate(header)}
    out = []
    for r in body:
        if len(r) < len(header) or not r[idc].strip():
            continue
        rec = {"kernel": r[name], "stalls": {}}
        t = col.get("gpu__time_duration.sum")
        if t is not None and _number(r[t]) is not None:
            rec["us"] = _number(r[t]) * _TIME_UNITS.get(units[t].strip().lower(), 1e-3)
        for key, metric in (
                ("registers", "launch__registers_per_thread"),
                ("occupancy_pct", "sm__warps_active.avg.pct_of_peak_sustained_active"),
                ("cycles_per_issue", "smsp__average_warp_latency_per_inst_issued.ratio")):
            if metric in col and _number(r[col[metric]]) is not None:
                rec[key] = _number(r[col[metric]])
        for h, i in col.items():
            m = _STALL.match(h)
            if m and _number(r[i]) is not None:
                rec["stalls"][m.group(1)] = _number(r[i])
        out.append(rec)
    return out


def parse_source(text: str, top: int = 12) -> List[Dict]:
    """Per kernel of ``ncu --page source --csv --print-source sass`` (a header row starts
    each): {"samples": total stall samples, "by_opcode": [(opcode, samples)] largest first,
    "top": [(address, SASS, samples)]}. The samples column is the first whose header names
    the warp stall sampling of all samples (else any "Warp Stall Sampling")."""
    blocks: List[Dict] = []
    src = smp = addr = None
    for r in csv.reader(io.StringIO(text)):
        if not r:
            continue
        if _column(r, "Source") is not None:                    # a kernel's header row
            src = _column(r, "Source")
            hits = [i for i, h in enumerate(r) if "warp stall sampling (all" in h.lower()]
            hits = hits or [i for i, h in enumerate(r) if "warp stall sampling" in h.lower()]
            smp = hits[0] if hits else None
            addr = _column(r, "Address", "# Address")
            blocks.append({"lines": []})
            continue
        if src is None or smp is None or len(r) <= max(src, smp):
            continue
        n = _number(r[smp])
        if n:
            blocks[-1]["lines"].append((r[addr] if addr is not None else "", r[src].strip(), n))
    out = []
    for b in blocks:
        by_op: Dict[str, float] = {}
        for _a, s, n in b["lines"]:
            op = opcode(s) if s else ""
            by_op[op] = by_op.get(op, 0.0) + n
        out.append({"samples": sum(n for *_x, n in b["lines"]),
                    "by_opcode": sorted(by_op.items(), key=lambda kv: -kv[1])[:top],
                    "top": sorted(b["lines"], key=lambda x: -x[2])[:top]})
    return out


def report(kernels: List[Dict], sources: List[Dict], reasons: int = 6) -> str:
    """The printed summary of :func:`parse_raw` and :func:`parse_source`."""
    lines = []
    for k in kernels:
        stalls = sorted(k["stalls"].items(), key=lambda kv: -kv[1])
        head = [f"{k['kernel'][:48]:48s}"]
        for key, fmt in (("us", "{:9.1f} us"), ("registers", "{:4.0f} regs"),
                         ("occupancy_pct", "{:5.1f}% warps"),
                         ("cycles_per_issue", "{:6.1f} cycles/issue")):
            if key in k:
                head.append(fmt.format(k[key]))
        lines.append("  ".join(head))
        if stalls:
            lines.append("    stalled, cycles per issued instruction: " + ", ".join(
                f"{r} {v:.2f}" for r, v in stalls[:reasons]))
    for i, s in enumerate(sources):
        name = kernels[i]["kernel"][:48] if i < len(kernels) else f"kernel #{i}"
        lines.append(f"{name}: {s['samples']:.0f} stall samples; by opcode: " + ", ".join(
            f"{op} {n:.0f}" for op, n in s["by_opcode"]))
        for a, sass, n in s["top"]:
            lines.append(f"    {n:8.0f}  {a}  {sass[:90]}")
    return "\n".join(lines)


def _run(cmd: List[str], timeout: float, out_file: Optional[str] = None) -> int:
    """Run ``cmd``; its stdout to ``out_file`` (else to ours); the exit status, 124 when
    it ran past ``timeout``."""
    print("$ " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"timed out after {timeout:.0f} s", flush=True)
        return 124
    if out_file:
        with open(out_file, "w") as f:
            f.write(proc.stdout)
    else:
        sys.stdout.write(proc.stdout[-4000:])
    return proc.returncode


def profile(out_dir: str, ncu: str, target: str, timeout: float) -> int:
    """Profile, export and summarise (the module docstring's first form)."""
    os.makedirs(out_dir, exist_ok=True)
    rep = os.path.join(out_dir, "stalls")
    cmd = [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", "profile/"]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += ["-f", "-o", rep, sys.executable, os.path.join(HERE, "kernel_breakdown.py"),
            "--ncu-target", target]
    rc = _run(cmd, timeout)
    if not os.path.exists(rep + ".ncu-rep"):
        print(f"no report written (ncu exit status {rc})")
        return rc or 1
    raw, src = (os.path.join(out_dir, f) for f in ("stalls_raw.csv", "stalls_source.csv"))
    _run([ncu, "-i", rep + ".ncu-rep", "--page", "raw", "--csv"], 60, raw)
    _run([ncu, "-i", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
         60, src)
    return summarise(raw, src, os.path.join(out_dir, "stalls.json"))


def summarise(raw: str, source: Optional[str], out: Optional[str]) -> int:
    """Print (and write as JSON) the summary of exported files."""
    with open(raw) as f:
        kernels = parse_raw(f.read())
    sources = []
    if source and os.path.exists(source):
        with open(source) as f:
            sources = parse_source(f.read())
    print(report(kernels, sources))
    if out:
        with open(out, "w") as f:
            json.dump({"kernels": kernels, "sources": sources}, f, indent=1)
    return 0 if kernels else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", help="profile into this folder (needs ncu and a GPU)")
    ap.add_argument("--target", default="rel", choices=("rel", "all"),
                    help="kernel_breakdown.py --ncu-target's calls (default: rel)")
    ap.add_argument("--ncu", default="ncu", help="the ncu executable")
    ap.add_argument("--timeout", type=float, default=100.0, help="seconds for the profile")
    ap.add_argument("--raw", help="summarise this raw-page CSV export instead")
    ap.add_argument("--source", help="and this source-page CSV export (with --raw)")
    ap.add_argument("--out", help="JSON summary (with --raw)")
    args = ap.parse_args(argv)
    if args.raw:
        return summarise(args.raw, args.source, args.out)
    if not args.out_dir:
        ap.error("give --out-dir (profile) or --raw (summarise)")
    return profile(args.out_dir, args.ncu, args.target, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
