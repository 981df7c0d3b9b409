"""PNG plots of a benchmark report: speedup over the op's baseline, one file per op, one
panel per mode (and per dtype where a run has several).

matplotlib is optional: without it :func:`write_plots` writes nothing and says so (the
JSON and markdown of a report never depend on it). Loaded by path from ``report.py``
(``benchmarks/`` is not a package), so no relative imports.

What a plot shows:

* **x axis.** Where a case family is timed at several lengths (a sweep), the x axis is
  that length, named for the op (:data:`X_LABELS`: the query length for attention, the
  key length ``Tk = memory + Tq`` for relative attention, ...), log scale, a labelled
  tick at every length timed. Where no family has more than one length (the LSTM cases,
  the whole models), the x axis is the cases themselves, one labelled group each, and
  the backends are bars side by side.
* **Series.** One per (backend, case family), colour = backend, marker = family (two
  legends, beside the panel): the family is the suite's ``series``
  (``extra_info["series"]``) plus whatever the case name adds that is not a size (e.g.
  ``window1600``), so two different cases are never joined by one line.
* **y axis.** Speedup = baseline time / backend time, log scale, labelled ticks
  (0.1x, 0.2x, 0.5x, 1x, 2x, ...), at least three of them. The baseline is the dashed
  line at 1x, named in the legend.

A record is plotted where it has a ``speedup``; on a sweep axis it also needs a ``T``:
``record["T"]``, else the first ``Tq<n>`` or ``T<n>`` in the case name.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

_T_IN_NAME = re.compile(r"(?:^|\s)Tq?(\d+)(?:\s|$)")
_SIZE_TOKEN = re.compile(r"^(?:B|H|Tq|Tk|T|D|mem|P|I)\d+$")

#: What ``record["T"]`` is, per op (the sweep axis's label).
X_LABELS: Dict[str, str] = {
    "attention": "query length Tq (keys: Tk = memory + Tq)",
    "rel_attention": "key length Tk = memory + Tq",
    "rel_shift": "query length Tq (Tk = 2 Tq)",
}
_TICKS = [a * 10.0 ** e for e in range(-3, 4) for a in (1, 2, 5)]


def seq_len(record: dict) -> Optional[int]:
    """The T of a record (see the module docstring), or None."""
    t = record.get("T")
    if isinstance(t, (int, float)) and t > 0:
        return int(t)
    m = _T_IN_NAME.search(str(record.get("case", "")))
    return int(m.group(1)) if m else None


def family(record: dict) -> str:
    """The record's case family: its ``series`` plus the non-size words of its case name
    that the series does not already say."""
    series = str(record.get("series") or "")
    extra = [w for w in str(record.get("case", "")).split()
             if not _SIZE_TOKEN.match(w) and w not in series.split()]
    if not series:
        return " ".join(extra)
    extra = [w for w in extra if any(ch.isdigit() for ch in w) or w.startswith("window")]
    return " ".join([series] + extra)


def _panels(records: Sequence[dict]) -> Dict[str, Dict[str, List[dict]]]:
    """{op: {panel title: [records with a speedup]}} (panel = mode, plus dtype when the op
    has several)."""
    out: Dict[str, Dict[str, List[dict]]] = defaultdict(lambda: defaultdict(list))
    dtypes: Dict[str, set] = defaultdict(set)
    for r in records:
        dtypes[r["op"]].add(r.get("dtype"))
    for r in records:
        s = r.get("speedup")
        if s is None or not s > 0:
            continue
        title = r["mode"] + (f" · {r.get('dtype')}" if len(dtypes[r["op"]]) > 1 else "")
        out[r["op"]][title].append(r)
    return out


def _is_sweep(recs: Sequence[dict]) -> bool:
    """True when some (backend, family) was timed at two or more lengths."""
    lengths: Dict[Tuple[str, str], set] = defaultdict(set)
    for r in recs:
        t = seq_len(r)
        if t is not None:
            lengths[(r["backend"], family(r))].add(t)
    return any(len(v) > 1 for v in lengths.values())


def _y_ticks(values: Sequence[float]) -> List[float]:
    """Labelled ticks (1-2-5 steps) covering `values` and 1x, at least three of them."""
    lo, hi = min(list(values) + [1.0]), max(list(values) + [1.0])
    lo, hi = min(lo, 0.5), max(hi, 2.0)
    below = max([t for t in _TICKS if t <= lo] or [_TICKS[0]])
    above = min([t for t in _TICKS if t >= hi] or [_TICKS[-1]])
    ticks = [t for t in _TICKS if below <= t <= above]
    if len(ticks) > 9:                               # keep it readable: the decades + 1x
        ticks = [t for t in ticks if f"{t:.0e}"[0] in "1" or t == 1.0]
    return ticks


def _style_y(ax, values: Sequence[float], baseline: str) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator
    ax.set_yscale("log")
    ticks = _y_ticks(values)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(ticks[0] / 1.15, ticks[-1] * 1.15)
    line = ax.axhline(1.0, color="black", linewidth=1.0, linestyle="--",
                      label=f"baseline: {baseline} (1x)")
    ax.set_ylabel(f"speedup over {baseline} (higher is faster)")
    ax.grid(True, axis="y", alpha=0.3)
    return line


_MARKERS = "osD^vP*Xhp<>"


def _color(backend: str, backends: Sequence[str]) -> str:
    """A fixed colour per backend (ours in the blues/purples, peers in the others)."""
    fixed = {"triton": "tab:blue", "cuda": "tab:purple", "cpu": "tab:cyan",
             "ctxfast": "tab:blue", "sdpa": "tab:orange", "flex": "tab:green",
             "hf-sdpa": "tab:orange", "eager": "tab:gray", "nn.LSTM-no-drop": "tab:olive"}
    if backend in fixed:
        return fixed[backend]
    spare = ["tab:red", "tab:brown", "tab:pink", "gold", "black"]
    return spare[list(backends).index(backend) % len(spare)]


def _sweep_panel(ax, op: str, recs: Sequence[dict]):
    """Lines over T: colour = backend, marker = case family. Returns legend handles."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    lines: Dict[Tuple[str, str], List[Tuple[int, float]]] = defaultdict(list)
    for r in recs:
        t = seq_len(r)
        if t is not None:
            lines[(r["backend"], family(r))].append((t, r["speedup"]))
    backends = list(dict.fromkeys(b for b, _ in lines))
    families = list(dict.fromkeys(f for _, f in lines))
    ts = sorted({t for pts in lines.values() for t, _ in pts})
    for (b, fam), pts in lines.items():
        pts.sort()
        x, y = zip(*pts)
        ax.plot(x, y, marker=_MARKERS[families.index(fam) % len(_MARKERS)],
                color=_color(b, backends), linestyle="-" if len(pts) > 1 else "none",
                markersize=5)
    ax.set_xscale("log", base=2)
    shown: List[int] = []                        # a labelled tick per length, unless too close
    for t in ts:
        if not shown or t / shown[-1] > 1.15:
            shown.append(t)
    ax.xaxis.set_major_locator(FixedLocator(shown))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    if ts:
        ax.set_xlim(ts[0] / 1.3, ts[-1] * 1.3)
    ax.set_xlabel(X_LABELS.get(op, "sequence length T"))
    ax.grid(True, axis="x", alpha=0.3)
    handles = [Line2D([], [], color=_color(b, backends), linewidth=2, label=b) for b in backends]
    handles += [Line2D([], [], color="black", marker=_MARKERS[i % len(_MARKERS)],
                       linestyle="none", label=f or "(one family)")
                for i, f in enumerate(families)]
    return handles


def _case_panel(ax, recs: Sequence[dict]):
    """Bars per case (x), one per backend, from the baseline's 1x. Returns handles."""
    cases = list(dict.fromkeys(r["case"] for r in recs))
    backends = list(dict.fromkeys(r["backend"] for r in recs))
    width = 0.8 / max(1, len(backends))
    handles = []
    for k, b in enumerate(backends):
        xs, ys = [], []
        for i, c in enumerate(cases):
            for r in recs:
                if r["case"] == c and r["backend"] == b:
                    xs.append(i - 0.4 + width * (k + 0.5))
                    ys.append(r["speedup"])
        # bars start at the baseline (1x): up where faster, down where slower
        handles.append(ax.bar(xs, [y - 1.0 for y in ys], bottom=1.0, width=width * 0.9,
                              label=b, color=_color(b, backends)))
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([re.sub(r" (B\d+ )", r"\n\1", c, count=1) for c in cases], fontsize=7,
                       rotation=30 if len(cases) > 3 else 0,
                       ha="right" if len(cases) > 3 else "center")
    ax.set_xlabel("case (bars: backends)")
    return handles


def write_plots(records: Sequence[dict], out_dir, stem: str) -> Tuple[List[Path], str]:
    """Write ``<out_dir>/<stem>-<op>.png`` for every op with plottable records.

    Returns (paths written, a one-line note for the report: what was plotted, or why
    nothing was). Never raises for a missing matplotlib."""
    panels = _panels(records)
    if not panels:
        return [], "plots: nothing to plot (no record has a speedup)"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return [], f"plots skipped: matplotlib is not installed ({e})"

    header = records[0] if records else {}
    title_tail = " · ".join(str(header[k]) for k in ("device", "date") if header.get(k))
    paths = []
    for op, by_title in sorted(panels.items()):
        titles = sorted(by_title)
        sweep = any(_is_sweep(by_title[t]) for t in titles)
        n_cases = max(len({r["case"] for r in by_title[t]}) for t in titles)
        width = 8.0 if sweep else max(7.0, 0.9 * n_cases + 4)
        ncols = min(2, len(titles))
        nrows = (len(titles) + ncols - 1) // ncols
        fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 4.8 * nrows),
                                 squeeze=False)
        for ax in axes.flat[len(titles):]:
            ax.set_visible(False)
        for ax, title in zip(axes.flat, titles):
            recs = by_title[title]
            baseline = ", ".join(sorted({r["baseline"] for r in recs if r.get("baseline")}))
            handles = _sweep_panel(ax, op, recs) if sweep else _case_panel(ax, recs)
            base = _style_y(ax, [r["speedup"] for r in recs], baseline or "baseline")
            ax.set_title(f"{op} · {title}")
            ax.legend(handles=list(handles) + [base], fontsize=6, loc="upper left",
                      bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        fig.suptitle(title_tail, fontsize=9)
        fig.tight_layout()
        if ncols > 1:                                # room for the legends beside the panels
            fig.subplots_adjust(wspace=0.55)
        path = Path(out_dir) / f"{stem}-{op}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths, "plots: " + ", ".join(p.name for p in paths)
