"""PNG plots of a benchmark report: speedup over the baseline against the sequence length
T, one file per op, one panel per mode, one line per (backend, series).

matplotlib is optional: without it :func:`write_plots` writes nothing and says so (the
JSON and markdown of a report never depend on it). Loaded by path from ``report.py``
(``benchmarks/`` is not a package), so no relative imports.

A record is plotted where it has a ``speedup`` and a ``T``: ``record["T"]`` (from the
suite's ``extra_info["T"]``), else the first ``Tq<n>`` or ``T<n>`` in the case name.
Lines are ``record["series"]`` (from ``extra_info["series"]``; "" when the suite gives
none) per backend.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

_T_IN_NAME = re.compile(r"(?:^|\s)Tq?(\d+)(?:\s|$)")


def seq_len(record: dict) -> Optional[int]:
    """The T of a record (see the module docstring), or None."""
    t = record.get("T")
    if isinstance(t, (int, float)) and t > 0:
        return int(t)
    m = _T_IN_NAME.search(str(record.get("case", "")))
    return int(m.group(1)) if m else None


def _points(records: Sequence[dict]) -> Dict[str, Dict[str, Dict[str, List[Tuple[int, float]]]]]:
    """{op: {mode: {line label: [(T, speedup), ...] sorted by T}}}."""
    out: Dict[str, Dict[str, Dict[str, List[Tuple[int, float]]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for r in records:
        t, s = seq_len(r), r.get("speedup")
        if t is None or s is None or not s > 0:
            continue
        label = r["backend"] + (f" · {r['series']}" if r.get("series") else "")
        out[r["op"]][r["mode"]][label].append((t, s))
    for modes in out.values():
        for lines in modes.values():
            for pts in lines.values():
                pts.sort()
    return out


def write_plots(records: Sequence[dict], out_dir, stem: str) -> Tuple[List[Path], str]:
    """Write ``<out_dir>/<stem>-<op>.png`` for every op with plottable records.

    Returns (paths written, a one-line note for the report: what was plotted, or why
    nothing was). Never raises for a missing matplotlib."""
    points = _points(records)
    if not points:
        return [], "plots: nothing to plot (no record has both a speedup and a T)"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError as e:
        return [], f"plots skipped: matplotlib is not installed ({e})"

    header = records[0] if records else {}
    title_tail = " · ".join(str(header[k]) for k in ("device", "date") if header.get(k))
    paths = []
    for op, modes in sorted(points.items()):
        mode_names = sorted(modes)
        fig, axes = plt.subplots(1, len(mode_names), figsize=(5.5 * len(mode_names), 4.2),
                                 squeeze=False)
        for ax, mode in zip(axes[0], mode_names):
            baselines = {r["baseline"] for r in records
                         if r["op"] == op and r["mode"] == mode and r.get("baseline")}
            for label, pts in sorted(modes[mode].items()):
                ts, ss = zip(*pts)
                ax.plot(ts, ss, marker="o", label=label)
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
            ax.yaxis.set_minor_formatter(FuncFormatter(         # label 2x, 5x, 0.2x, ...
                lambda y, _: f"{y:g}x" if f"{y:.0e}"[0] in "25" else ""))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("T (query length)")
            ax.set_ylabel(f"speedup over {', '.join(sorted(baselines)) or 'baseline'}")
            ax.set_title(f"{op} · {mode}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(title_tail, fontsize=9)
        fig.tight_layout()
        path = Path(out_dir) / f"{stem}-{op}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths, "plots: " + ", ".join(p.name for p in paths)
